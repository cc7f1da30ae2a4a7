"""The K-quants as stored against their wider forms, by rows: Q6_K's six bits (q6a16)
against the same weights as int8 (q8a16), and Q4_K's scales as stored against float32 d and
m (both q4a16).

    python bench/kquant_rows.py [ROWS ...]        # default 1 2 4 8 16 64 256

Twelve random matrices of qwen2.5-coder-0.5b's ffn_down shape (896 x 4864: its Q4_K_M file
has 12 Q6_K and 12 Q4_K ones; more than the L3 here), each called in turn, both forms
alternated 15 times; prints each one's median and best time, the read rate at the best, and
the median of the paired ratios (below 1: the form as stored is faster). Both forms give the
same bits (tests/test_q5_q6.py, tests/test_kquant.py); a Q6Weight reads its six bits up to
Q6Weight.DECODE_ROWS rows.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from gguf import GGMLQuantizationType as Q  # noqa: E402

import test_kquant  # noqa: E402
import test_q5_q6  # noqa: E402
from mashbox.engine import cpu_kernels  # noqa: E402
from mashbox.engine.int4 import Int4Weight, unpack  # noqa: E402
from mashbox.engine.q6_weight import Q6Weight  # noqa: E402


def q6_forms() -> dict:
    weights = []
    for seed in range(12):
        raw = test_q5_q6.random_blocks(Q.Q6_K, 896, 4864, seed=seed)
        blocks = test_q5_q6.blocks_of(Q.Q6_K, raw)
        weights.append(Q6Weight([blocks]))
    kernel = weights[0].kernel
    return {
        "Q6_K as stored (q6a16)": ([(w.qs, w.scales) for w in weights], kernel.q6a16_linear),
        "Q6_K as int8 (q8a16)": ([(w.qs8, w.d8) for w in weights], kernel.q8a16_linear),
    }


def q4_k_forms() -> dict:
    stored, float32 = [], []
    for seed in range(12):
        raw = test_kquant.random_q4_k(896, 4864, seed=seed)
        blocks = test_kquant.blocks_of(raw)
        w = Int4Weight([blocks], activations="int16")
        stored.append((w.qs, w.dm))
        float32.append((w.qs, cpu_kernels.pack_scales(*unpack(blocks)[1:])))
    kernel = cpu_kernels.load()
    return {
        "Q4_K scales as stored": (stored, kernel.q4a16_linear),
        "Q4_K float32 d, m": (float32, kernel.q4a16_linear),
    }


def compare(forms: dict, rows_list: list[int]) -> None:
    (name_a, (a, call_a)), (name_b, (b, call_b)) = forms.items()
    nbytes = {name: sum(t.nbytes for pair in ts for t in pair) for name, (ts, _) in forms.items()}
    for rows in rows_list:
        x = torch.randn(rows, 4864)
        times = {name_a: [], name_b: []}
        for _ in range(15):
            for name, (tensors, call) in forms.items():
                t0 = time.perf_counter()
                for _ in range(3):
                    for pair in tensors:
                        call(x, *pair)
                times[name].append((time.perf_counter() - t0) / 3)
        for name, ts in times.items():
            best, mb = min(ts), nbytes[name] / 1e6
            print(
                f"rows {rows:3d} {name}: median {statistics.median(ts) * 1e3:6.2f} ms, best "
                f"{best * 1e3:6.2f} ms, {mb:.1f} MB at {mb / best / 1e3:.1f} GB/s"
            )
        pairs = zip(times[name_a], times[name_b], strict=True)
        print(
            f"rows {rows:3d} {name_a} / {name_b}: {statistics.median(a / b for a, b in pairs):.3f}"
        )


def main() -> None:
    rows_list = [int(a) for a in sys.argv[1:]] or [1, 2, 4, 8, 16, 64, 256]
    isa = cpu_kernels.load().isa()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, isa {isa}")
    compare(q6_forms(), rows_list)
    compare(q4_k_forms(), rows_list)


if __name__ == "__main__":
    main()
