"""Engine.step with the decode stack and its head in one call (`Model.decode_logits`, what a
step runs) against the same step through `decode`, then `logits` (the fallback), in one
process: blocks of steps in random order, so both ways see the same host.

    python bench/one_call_ab.py [--model smollm2-135m-instruct] [--rounds 20] [--steps 60]

A change this size (~4% of a step on the AVX-512 host, stop 38) moves less than this host's
memory does between two processes a minute apart, so `against_rev.sh` cannot see it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from mashbox import registry
from mashbox.engine.engine import Engine
from mashbox.engine.sampling import DecodeLogits
from mashbox.protocol import PREVIOUS, Admit, Decode, Prefill, SamplingParams, Step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=registry.DEFAULT_MODEL)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=60, help="greedy steps a block")
    args = parser.parse_args()
    path = registry.fetch(registry.resolve(args.model), registry.default_models_dir())
    engine = Engine(path, slots=1, ctx=2048, decode_weights="int4a16")
    prompt = tuple(range(10, 74))
    admit = Admit(0, SamplingParams(), prompt)
    engine.step(Step(1, admits=(admit,), prefills=(Prefill(0, 0, prompt, True),)))
    model, decoder = engine.model, engine.decoder
    one_call = decoder.logits

    def two_calls(slots, token_ids, positions):
        ids, at = torch.tensor(token_ids), torch.tensor(positions)
        return DecodeLogits.of(model.logits(model.decode(engine.cache, slots, ids, at)))

    ways = {"one call": one_call, "decode, then logits": two_calls}
    medians: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name in random.sample(list(ways), len(ways)):
            decoder.logits = ways[name]
            times = []
            for position in range(len(prompt), len(prompt) + args.steps):
                t0 = time.perf_counter()
                engine.step(Step(2, decodes=(Decode(0, PREVIOUS, position),)))
                times.append(time.perf_counter() - t0)
            medians[name].append(statistics.median(times) * 1e3)
    for name, ms in medians.items():
        print(f"{name:>20}: step median {statistics.median(ms):.3f} ms over {args.rounds} rounds")
    ratios = [a / b for a, b in zip(*medians.values(), strict=True)]
    print(
        f"one call / decode, then logits: median of the rounds' ratios "
        f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
    )


if __name__ == "__main__":
    main()
