"""Time one engine decode step per decode-weights kind and batch size, and profile one.

    python bench/step_profile.py [--model PATH] [--kinds float int8 int4] [--batches 1 4 8]
                                 [--context N] [--kv-dtype auto float32]

The Engine alone (no server): each slot is prefilled with the same 64-token prompt, then
decode steps are timed at each batch size (min and median over --steps steps; the machine
may be shared, so the min is the better estimate). Prints a torch.profiler table (top ops by
self CPU time) of one batch-1 decode step of the last kind, and, where that kind decodes
through DecodeStack (one C++ call the profiler cannot see into), where its milliseconds go:
the whole stack, its layer matmuls alone (same matrices, same kernels; the rest of the stack
is attention, norms, RoPE and residuals), the output head, and sampling.

--context N times the steps at position N instead (the KV cache filled with random keys and
values: an agent's long conversation, without prefilling it), once per --kv-dtype.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from mashbox.engine.decode_weight import nbytes
from mashbox.engine.engine import Engine
from mashbox.protocol import Admit, Decode, Prefill, SamplingParams, Step
from mashbox.registry import DEFAULT_MODEL, default_models_dir, known_models

DEFAULT = default_models_dir() / DEFAULT_MODEL / known_models()[DEFAULT_MODEL]["filename"]
PROMPT = tuple(range(1000, 1064))


def prepare(path: Path, kind: str, slots: int, context: int = 0, kv_dtype="auto") -> Engine:
    engine = Engine(
        path, slots=slots, ctx=max(1024, context + 64), decode_weights=kind, kv_dtype=kv_dtype
    )
    greedy = SamplingParams()
    for s in range(slots):
        engine.step(
            Step(admits=(Admit(s, greedy, PROMPT),), prefills=(Prefill(s, 0, PROMPT, True),))
        )
    if context:  # what a long prompt would have left there, as far as speed goes
        engine.cache.k.normal_()
        engine.cache.v.normal_()
    return engine


def decode_step(engine: Engine, batch: int, position: int) -> float:
    step = Step(decodes=tuple(Decode(s, 42, position) for s in range(batch)))
    return engine.step(step).elapsed_s


def time_steps(engine: Engine, batch: int, position: int, steps: int) -> list[float]:
    """Seconds of `steps` decode steps at batch size `batch` from `position` on, after one
    warm-up step; the next free position is position + steps + 1."""
    decode_step(engine, batch, position)
    return [decode_step(engine, batch, position + 1 + i) for i in range(steps)]


def best_ms(fn, repeats: int = 10) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


@torch.inference_mode()
def breakdown(engine: Engine, batch: int, position: int) -> None:
    """Where a DecodeStack step's time goes, part by part (each timed alone, best of 10)."""
    model = engine.model
    slots, ids = list(range(batch)), torch.full((batch,), 42)
    positions = torch.full((batch,), position)
    inputs = {}

    def matmuls():
        for layer in model.layers:
            for name in ("wqkv", "wo", "w_gate_up", "w_down"):
                w = layer[name]  # an int8 or int4 decode weight: its kernel, as in the stack
                w(inputs.setdefault(w.shape[1], torch.randn(batch, w.shape[1])))

    hidden = model.decode(engine.cache, slots, ids, positions)
    logits = model.logits(hidden)
    parts = {
        "stack": best_ms(lambda: model.decode(engine.cache, slots, ids, positions)),
        "matmuls": best_ms(matmuls),
        "head": best_ms(lambda: model.logits(hidden)),
        "sampling": best_ms(lambda: [engine._sample(s, logits[s], position) for s in slots]),
    }
    mats = [layer[name] for layer in model.layers for name in ("wqkv", "wo", "w_gate_up", "w_down")]
    read = sum(nbytes(w) for w in mats)
    flops = 2 * batch * sum(math.prod(w.shape) for w in mats)
    print(
        f"  batch {batch}: DecodeStack {parts['stack']:.2f} ms; its {len(mats)} matmuls called "
        f"one by one {parts['matmuls']:.2f} ms ({read / parts['matmuls'] / 1e6:.1f} GB/s, "
        f"{flops / parts['matmuls'] / 1e6:.0f} GFLOP/s; a few us a call of Python the stack "
        f"does not pay); head {parts['head']:.2f} ms; sampling {parts['sampling']:.2f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT)
    parser.add_argument("--kinds", nargs="+", default=["float", "int8", "int4"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4, 8])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per batch size")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--top", type=int, default=15, help="rows of the profiler table")
    parser.add_argument("--profile-batch", type=int, default=1, help="batch size to profile")
    parser.add_argument("--context", type=int, default=0, help="decode at this position")
    parser.add_argument("--kv-dtype", nargs="+", default=["auto"], dest="kv_dtypes")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, load {os.getloadavg()}")
    engine = None
    for kind, kv_dtype in itertools.product(args.kinds, args.kv_dtypes):
        t0 = time.perf_counter()
        engine = prepare(args.model, kind, max(args.batches), args.context, kv_dtype)
        print(
            f"{kind}, {engine.info.kv_dtype} KV: loaded and prefilled in "
            f"{time.perf_counter() - t0:.1f} s"
        )
        position = args.context or len(PROMPT)
        for batch in args.batches:
            times = time_steps(engine, batch, position, args.steps)
            position += args.steps + 1
            print(
                f"  batch {batch}: step min {min(times) * 1e3:.1f} ms, "
                f"median {statistics.median(times) * 1e3:.1f} ms"
            )
    batch = args.profile_batch
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        decode_step(engine, batch, position)
    print(f"\nOne batch-{batch} decode step, {args.kinds[-1]} weights:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    if engine.model.decode_stack is not None:
        print(f"\nInside the DecodeStack step ({args.kinds[-1]} weights):")
        for batch in args.batches:
            breakdown(engine, batch, position)


if __name__ == "__main__":
    main()
