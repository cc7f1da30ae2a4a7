"""Time a decode step's attention at long context against the machine's memory bandwidth.

    python bench/decode_math.py [--shapes smollm2-135m qwen2.5-0.5b] [--contexts 128 2048 16384]
                                [--batch 1] [--steps 10] [--threads N] [--before DIR]

A DecodeStack (decode_layers.cpp) of each model's shape (layers, heads, kv heads, head_dim
64) with random int8 weights, its FFN cut to 256 wide (--ffn: the attention is what is
measured), and a KV cache (--kv-dtype: float16, the default where the kernels attend, or
float32) holding random keys and values. At each context n the step
is timed at position n - 1 (best of --steps) less the step at position 0: what attending
over n positions costs. Its physical limit is reading K and V, 2 * n * head_dim * 2 or 4 bytes per
kv head per layer per row, at the memory read bandwidth (measured here, beside each timing as
other processes share it: a 512 MB tensor's sum, best of 3); printed beside it, GB/s and the
fraction of that bandwidth.

--before DIR also builds the .cpp and .h files in DIR (the engine's kernels at an earlier
revision, copied out) as a separate extension with the same compiler flags, and times both,
one after the other at each context.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

import attrs
import torch

from mashbox.engine import cpu_kernels


@attrs.frozen
class Shape:
    d_model: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int = 64


SHAPES = {
    "smollm2-135m": Shape(576, 30, 9, 3),
    "qwen2.5-0.5b": Shape(896, 24, 14, 2),
}


def read_bandwidth_gbs() -> float:
    """Memory read bandwidth in GB/s: a tensor far larger than the caches summed, best of 3."""
    a = torch.ones(512 * 1024 * 1024 // 4)
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        a.sum()
        best = max(best, a.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    return best


def int8_matrix(n: int, k: int, g: torch.Generator) -> list[torch.Tensor]:
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    return [cpu_kernels.pack_int8(q), torch.full((n,), 1.0 / (127 * math.sqrt(k)))]


def decode_stack(module, shape: Shape, ffn: int, positions: int):
    """A DecodeStack of `shape` with random int8 matrices (13 tensors a layer, as model.py
    passes them) and RoPE tables for `positions` positions."""
    g = torch.Generator().manual_seed(0)
    d, hd = shape.d_model, shape.head_dim
    n_qkv = (shape.heads + 2 * shape.kv_heads) * hd
    ones, absent = torch.ones(d), torch.empty(0)
    layers = [
        [ones, *int8_matrix(n_qkv, d, g), absent, absent, absent]
        + [*int8_matrix(d, shape.heads * hd, g), ones]
        + [*int8_matrix(2 * ffn, d, g), *int8_matrix(d, ffn, g)]
        for _ in range(shape.layers)
    ]
    inv = 1.0 / 10000 ** (torch.arange(0, hd, 2).float() / hd)
    angles = torch.outer(torch.arange(positions).float(), inv)
    args = (layers, ones, angles.cos(), angles.sin(), shape.heads, shape.kv_heads, hd, 1e-5, 32)
    try:  # no head (`forward` is timed), an embedding it never reads
        return module.DecodeStack(*args, torch.zeros(1, d), [], 32)
    except TypeError:  # a --before build older than the stack's own head (stop 38)
        return module.DecodeStack(*args)


def best_step_s(stack, shape: Shape, cache: tuple, position: int, batch: int, steps: int):
    x = torch.randn(batch, shape.d_model, generator=torch.Generator().manual_seed(1))
    positions, slots = torch.full((batch,), position), torch.arange(batch)
    stack.forward(x, positions, slots, *cache)  # warm-up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        stack.forward(x, positions, slots, *cache)
        times.append(time.perf_counter() - t0)
    return min(times)


def kv_cache(shape: Shape, n: int, batch: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    size = (shape.layers, batch, shape.kv_heads, n, shape.head_dim)
    g = torch.Generator().manual_seed(2)
    return torch.randn(size, generator=g).to(dtype), torch.randn(size, generator=g).to(dtype)


def attention_row(stack, shape: Shape, n: int, cache: tuple, args) -> dict:
    """One build at context n: the step at position n - 1, at 0, and what attending costs."""
    base = best_step_s(stack, shape, cache, 0, args.batch, args.steps)
    step = best_step_s(stack, shape, cache, n - 1, args.batch, args.steps)
    kv_bytes = 2 * n * shape.head_dim * cache[0].element_size() * shape.kv_heads * shape.layers
    kv_bytes *= args.batch
    return {"base": base, "step": step, "bytes": kv_bytes}


def build_before(directory: Path):
    """The kernels in `directory` as their own extension, with the chosen build's flags."""
    from torch.utils.cpp_extension import load

    flags = cpu_kernels.report().chosen.flags
    where = Path("/tmp") / f"mashbox-decode-before-{os.getuid()}"
    where.mkdir(exist_ok=True)
    return load(
        "mashbox_decode_before",
        sources=[str(p) for p in sorted(directory.glob("*.cpp"))],
        extra_cflags=["-O3", *flags, "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(where),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--contexts", nargs="+", type=int, default=[128, 2048, 16384])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--kv-dtype", choices=["float16", "float32"], default="float16")
    parser.add_argument("--threads", type=int, help="torch's threads (default: its own)")
    parser.add_argument("--before", type=Path, help="an earlier revision's kernel sources")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    builds = {"after": cpu_kernels.load()}
    if args.before:
        builds = {"before": build_before(args.before), **builds}
    print(
        f"kernels {cpu_kernels.report().kernels}; {torch.get_num_threads()} threads; "
        f"batch {args.batch}; {args.kv_dtype} KV; load average "
        + " ".join(f"{x:.2f}" for x in os.getloadavg())
    )
    print(
        f"{'shape':13} {'context':>7} {'build':7} {'step ms':>8} {'at 0 ms':>8} "
        f"{'attn ms':>8} {'K+V MB':>8} {'GB/s':>6} {'read GB/s':>9} {'of it':>6}"
    )
    for name in args.shapes:
        shape = SHAPES[name]
        stacks = {
            b: decode_stack(m, shape, args.ffn, max(args.contexts)) for b, m in builds.items()
        }
        for n in args.contexts:
            cache = kv_cache(shape, n, args.batch, getattr(torch, args.kv_dtype))
            for build, stack in stacks.items():
                # the bandwidth beside each measurement: other processes share the memory
                bandwidth = read_bandwidth_gbs()
                r = attention_row(stack, shape, n, cache, args)
                attention = r["step"] - r["base"]
                # a step at 0 slower than at n - 1: another process took the core meanwhile
                rate = (
                    f"{r['bytes'] / attention / 1e9:6.1f} {bandwidth:9.1f} "
                    f"{r['bytes'] / attention / 1e9 / bandwidth:6.0%}"
                    if attention > 0
                    else f"{'noise':>6} {bandwidth:9.1f} {'':>6}"
                )
                print(
                    f"{name:13} {n:7} {build:7} {r['step'] * 1e3:8.2f} {r['base'] * 1e3:8.2f} "
                    f"{attention * 1e3:8.2f} {r['bytes'] / 1e6:8.1f} {rate}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
