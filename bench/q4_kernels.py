"""The Q4 block kernels side by side on SmolLM2's layer matrices: float32, int16 and int8
activations (q4_linear, q4a16_linear, q4a8_linear) against float32 sgemm of the same weights.

    .venv/bin/python bench/q4_kernels.py [--rows 1 8 48 96 256] [--reps 5] [--layers 30]

Random Q4 blocks in the four shapes of a SmolLM2-135M layer (q/k/v 960 x 576, o 576 x 576,
gate/up 3072 x 576, down 576 x 1536), each called 30 times a pass (the 120 matmuls of one
decode step at 1-16 rows, of one prefill chunk at more), best of --reps passes. By default
the same 4 matrices, so they stay in cache more than a real step's 30 layers do; with
--layers 30, 30 layers of their own, read from memory as a decode step reads them (66 MB of
Q4: the GB/s column is what a one-row step is bound by). Prints ms a pass and each
kernel's speed as a ratio to sgemm's (> 1: faster), and each kernel's largest
error against the float64 product at 8 rows. Which kernel a matrix uses, and up to how many
rows, is int4.Q4_MAX_ROWS: where these ratios cross 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from mashbox.engine import cpu_kernels  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K) of one layer


def matrices(layers: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, k in SHAPES * layers:
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
        d = (torch.rand(n, k // 32, generator=g) / 50).half()
        m = (-8 * d.float() + torch.randn(n, k // 32, generator=g) / 1000).half()
        qs, dm = cpu_kernels.pack_q4(q, d, m)
        w = q.float() * d.float().repeat_interleave(32, 1) + m.float().repeat_interleave(32, 1)
        out.append({"qs": qs, "dm": dm, "w": w})
    return out


def kernels(kernel):
    return {
        "sgemm": lambda x, m: F.linear(x, m["w"]),
        "q4 (float32 x)": lambda x, m: kernel.q4_linear(x, m["qs"], m["dm"]),
        "q4a16": lambda x, m: kernel.q4a16_linear(x, m["qs"], m["dm"]),
        "q4a8": lambda x, m: kernel.q4a8_linear(x, m["qs"], m["dm"]),
    }


def best_pass(f, mats, xs, reps: int) -> float:
    def one_pass():
        for _ in range(30 * len(SHAPES) // len(mats)):  # 30 layers in all
            for x, m in zip(xs * (len(mats) // len(SHAPES)), mats, strict=True):
                f(x, m)

    one_pass()  # warm
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        one_pass()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 48, 96, 128, 256])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--layers",
        type=int,
        default=1,
        choices=[1, 30],
        help="distinct layers of matrices: 30 reads them from memory",
    )
    args = parser.parse_args()
    kernel = cpu_kernels.load()
    if kernel is None:
        sys.exit("mashbox's CPU kernels do not build here")
    mats, fs = matrices(args.layers), kernels(kernel)
    q4_bytes = 30 // args.layers * sum(m["qs"].numel() + 2 * m["dm"].numel() for m in mats)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{torch.backends.cpu.get_cpu_capability()}")  # fmt: skip
    x8 = [torch.randn(8, k) for _, k in SHAPES]
    for name, f in fs.items():
        err = max(
            float((f(x, m).double() - x.double() @ m["w"].double().T).abs().max())
            for x, m in zip(x8, mats[: len(SHAPES)], strict=True)
        )
        print(f"  {name:15s} largest error at 8 rows: {err:.2e}")
    print(f"one pass reads {q4_bytes / 1e6:.1f} MB of Q4 weights; GB/s: q4a16's")
    print("rows  " + "  ".join(f"{name:>22s}" for name in fs) + "   GB/s")
    for rows in args.rows:
        xs = [torch.randn(rows, k) for _, k in SHAPES]
        times = {name: best_pass(f, mats, xs, args.reps) for name, f in fs.items()}
        base = times["sgemm"]
        cells = [f"{t * 1e3:8.2f} ms ({base / t:4.2f}x)" for t in times.values()]
        rate = q4_bytes / times["q4a16"] / 1e9
        print(f"{rows:4d}  " + "  ".join(f"{c:>22s}" for c in cells) + f"  {rate:5.1f}")


if __name__ == "__main__":
    main()
