"""Engine.step with this tree's decode stack (A) against another build's (B), in one process.

    bash bench/stack_ab.sh REV [ROUNDS [REPEAT]]     # builds REV's kernels, then runs this

Both stacks hold the same weights and write the same KV cache; rounds of 128 greedy steps
(SmolLM2, one row, positions 36-164) take turns in random order, and each round's median
step time gives a ratio A / B. REPEAT (default 1) runs each step that many times back to back
(`Step.repeat`, as the server's decode bursts do), and a step's time is per run. Both sides
must pick the same tokens. Two processes a minute apart differ by more than the few percent a
change to the stack's code moves; on the AVX-512 host (stop 40) a build against itself read
1.000 (quartiles 0.991-1.014) over 30 rounds.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

from mashbox import registry
from mashbox.engine import cpu_kernels, kernel_build
from mashbox.engine.engine import Engine
from mashbox.protocol import PREVIOUS, Admit, Decode, Prefill, SamplingParams, Step

PROMPT = tuple(range(10, 46))


def main() -> None:
    library, rounds = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 30
    repeat = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    path = registry.fetch(registry.resolve(registry.DEFAULT_MODEL), registry.default_models_dir())
    engine = Engine(path, slots=1, ctx=1024, decode_weights="int4a16")
    model = engine.model
    other = kernel_build.import_library(library.parent, str(library))
    mine, cpu_kernels.load = cpu_kernels.load, lambda: other
    try:
        stacks = {"A": model.decode_stack, "B": model._decode_stack()}
    finally:
        cpu_kernels.load = mine
    times: dict[str, list[float]] = {"A": [], "B": []}
    picked: dict[str, list[int]] = {}
    for _ in range(rounds):
        for side in random.sample(list(stacks), 2):
            model.decode_stack = stacks[side]
            admit = Admit(0, SamplingParams(), PROMPT)
            engine.step(Step(1, admits=(admit,), prefills=(Prefill(0, 0, PROMPT, True),)))
            steps, tokens = [], []
            for position in range(len(PROMPT), len(PROMPT) + 128, repeat):
                start = time.perf_counter()
                step = Step(2, decodes=(Decode(0, PREVIOUS, position),), repeat=repeat)
                result = engine.step(step)
                steps.append((time.perf_counter() - start) / repeat)
                tokens += [r.tokens[0] for r in (result, *result.more)]
            assert picked.setdefault(side, tokens) == tokens, f"{side} picked other tokens"
            times[side].append(statistics.median(steps) * 1e3)
    assert picked["A"] == picked["B"], "the two builds picked different tokens"
    ratios = [a / b for a, b in zip(times["A"], times["B"], strict=True)]
    q = statistics.quantiles(ratios, n=4)
    print(
        f"A {statistics.median(times['A']):.3f} ms a step, B {statistics.median(times['B']):.3f};"
        f" A / B median {statistics.median(ratios):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f},"
        f" {rounds} rounds of 128 steps); the same tokens"
    )


if __name__ == "__main__":
    main()
