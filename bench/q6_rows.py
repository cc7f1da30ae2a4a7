"""Q6_K's blocks as stored (q6a16) against the same weights as int8 (q8a16), by rows.

    python bench/q6_rows.py [ROWS ...]        # default 1 2 4 8 16 64 256

Twelve random Q6_K matrices of qwen2.5-coder-0.5b's ffn_down shape (896 x 4864: the 12 of
its Q4_K_M file, 43 MB as stored, more than the L3 here), each called in turn, both kernels
alternated 15 times; prints each one's median and best time, the read rate at the best, and
the median of the paired ratios (below 1: the 6-bit kernel is faster). Both give the same
bits (tests/test_q5_q6.py); which one a call takes is Q6Weight.DECODE_ROWS.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from gguf import GGMLQuantizationType as Q  # noqa: E402

from mashbox.engine.q6_weight import Q6Weight  # noqa: E402
from test_q5_q6 import blocks_of, random_blocks, reference  # noqa: E402


def main() -> None:
    rows_list = [int(a) for a in sys.argv[1:]] or [1, 2, 4, 8, 16, 64, 256]
    weights = []
    for seed in range(12):
        raw = random_blocks(Q.Q6_K, 896, 4864, seed=seed)
        weights.append(Q6Weight(reference(Q.Q6_K, raw), [blocks_of(Q.Q6_K, raw)]))
    kernel = weights[0].kernel
    calls = {
        "q6a16": lambda w, x: kernel.q6a16_linear(x, w.qs, w.scales),
        "q8a16": lambda w, x: kernel.q8a16_linear(x, w.qs8, w.d8),
    }
    nbytes = {
        "q6a16": sum(w.qs.nbytes + w.scales.nbytes for w in weights),
        "q8a16": sum(w.qs8.nbytes + w.d8.nbytes for w in weights),
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, isa {kernel.isa()}")
    for rows in rows_list:
        x = torch.randn(rows, 4864)
        times = {name: [] for name in calls}
        for _ in range(15):
            for name, call in calls.items():
                t0 = time.perf_counter()
                for _ in range(3):
                    for w in weights:
                        call(w, x)
                times[name].append((time.perf_counter() - t0) / 3)
        for name, ts in times.items():
            best, mb = min(ts), nbytes[name] / 1e6
            print(
                f"rows {rows:3d} {name}: median {statistics.median(ts) * 1e3:6.2f} ms, best "
                f"{best * 1e3:6.2f} ms, {mb:.1f} MB at {mb / best / 1e3:.1f} GB/s"
            )
        ratio = statistics.median(
            a / b for a, b in zip(times["q6a16"], times["q8a16"], strict=True)
        )
        print(f"rows {rows:3d} q6a16 / q8a16: {ratio:.3f}")


if __name__ == "__main__":
    main()
