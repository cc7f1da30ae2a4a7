"""Decode at 1 stream with a K-quant model's blocks read as stored (Q4_K, Q5_0, Q6_K, ...),
against the same engine re-quantizing every matrix that is not Q4_0/Q4_1/Q8_0 throughout to
int8 per channel (what it did before), in one process.

    python bench/kquant_decode.py [--model PATH] [--kinds int4 int4a16] [--steps 64]

For each decode-weights kind, both ways: the bytes a decode step reads (EngineInfo's
decode_bytes), the decode weight each matrix got, and batch-1 step times (min and median
over --steps steps after a 64-token prompt; on a shared machine the min is the better
estimate). Defaults to the catalogue's qwen2.5-coder-0.5b-instruct Q4_K_M.
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
from pathlib import Path

from gguf import GGMLQuantizationType as Q
from step_profile import prepare, time_steps

from mashbox.engine import int4, q8_weight
from mashbox.registry import default_models_dir, known_models

QWEN = "qwen2.5-coder-0.5b-instruct"
DEFAULT = default_models_dir() / QWEN / known_models()[QWEN]["filename"]


def run(path: Path, kind: str, as_stored: bool, steps: int) -> None:
    saved = int4.EXACT_QTYPES, int4.KEPT_QTYPES, q8_weight.Q8_QTYPES
    if not as_stored:  # the engine as it was: Q4_0, Q4_1 and Q8_0 only
        int4.EXACT_QTYPES, q8_weight.Q8_QTYPES = (Q.Q4_0, Q.Q4_1), (Q.Q8_0,)
        int4.KEPT_QTYPES = (Q.Q4_0, Q.Q4_1, Q.Q8_0)
    try:
        engine = prepare(path, kind, slots=1)
    finally:
        int4.EXACT_QTYPES, int4.KEPT_QTYPES, q8_weight.Q8_QTYPES = saved
    weights = Counter(
        type(w).__name__ for layer in engine.model.layers for w in layer.values() if w is not None
    )
    times = time_steps(engine, 1, 64, steps)
    ms_min, ms_median = min(times) * 1e3, statistics.median(times) * 1e3
    print(
        f"{kind:8} {'as stored' if as_stored else 'as int8  '}: "
        f"{engine.model.decode_nbytes / 1e6:7.1f} MB a step, {dict(weights)}, "
        f"step {ms_min:.1f} ms min / {ms_median:.1f} median ({1e3 / ms_min:.1f} tok/s best)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT)
    parser.add_argument("--kinds", nargs="+", default=["int4", "int4a16"])
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    for kind in args.kinds:
        for as_stored in (False, True):
            run(args.model, kind, as_stored, args.steps)


if __name__ == "__main__":
    main()
