"""mashbox's own CPU kernel: int8 weights x float32 activations for decode batches.

torch's `_weight_int8pack_mm` wants bf16 activations and reads the weights at ~8-13 GB/s on
the 2-core AVX2 machines here; `int8_gemm.cpp` reads them once per call at up to ~26 GB/s
for one row, reuses each converted weight across up to 4 rows, and keeps the activations in
float32 (closer to the float path). It is built once per machine with torch's extension
builder (g++ and ninja, ~30 s, cached under ~/.cache/mashbox/kernels) the first time an
engine with int8 or int4 decode weights loads. Without AVX2/FMA or a compiler, or with
MASHBOX_CPU_KERNELS=0, `load()` returns None and torch's kernel is used.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger("mashbox")

SOURCE = Path(__file__).with_name("int8_gemm.cpp")


def _supported() -> bool:
    capability = torch.backends.cpu.get_cpu_capability()
    return capability in ("AVX2", "AVX512") and os.environ.get("MASHBOX_CPU_KERNELS") != "0"


@functools.cache
def load():
    """The compiled module (`int8_linear(x, q, scale)`), or None where it cannot be used."""
    if not _supported():
        return None
    from torch.utils.cpp_extension import load as build

    build_dir = Path.home() / ".cache" / "mashbox" / "kernels"
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        return build(
            "mashbox_int8_gemm",
            sources=[str(SOURCE)],
            # OpenMP binds to the libgomp torch has loaded: one thread pool for both.
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
        )
    except Exception as exc:  # no compiler, no ninja, a build error: torch's kernel instead
        log.warning("mashbox: CPU int8 kernel unavailable (%s); using torch's", exc)
        return None
