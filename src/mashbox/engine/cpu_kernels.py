"""mashbox's own CPU kernels for decode steps with int8 or int4 weights.

- `int8_gemm.cpp`: int8 weights x float32 activations. torch's `_weight_int8pack_mm` wants
  bf16 activations and reads the weights at ~8-13 GB/s on the 2-core AVX2 machines here; this
  one reads them (packed by `pack_int8`) once per call at up to ~20 GB/s, keeps activations
  in float32 (closer to the float path) and sums every output in one order, so a row's bits
  do not depend on the batch.
- `blocks_gemm.cpp`: the same with a GGUF file's own Q4_0/Q4_1 and Q8_0 blocks read as
  stored (packed by `pack_q4` / `pack_q8`): the file's weights exactly. And `q4a16` /
  `q4a8`: the Q4 blocks (`q4a8` packed by `pack_q4a8`) with activations rounded per block
  of 32 to int16 / int8 (llama.cpp's rounding), for exact integer dot products (VNNI where
  there is): ~1.2-1.7x / ~1.8-2.4x the float32-activation kernel.
- `decode_layers.cpp`: `DecodeStack`, a whole decode step (every layer) in one call, with
  no torch op dispatch per norm, RoPE or residual.

Built once per machine with torch's extension builder (g++ and ninja, ~40 s, cached under
~/.cache/mashbox/kernels) the first time an engine with int8 or int4 decode weights loads.
Without AVX2/FMA or a compiler, or with MASHBOX_CPU_KERNELS=0, `load()` returns None and
torch's ops are used.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger("mashbox")

builds = 0  # times this process ran the extension builder (a compile, or a cached load)

SOURCES = [
    Path(__file__).with_name(name)
    for name in ("int8_gemm.cpp", "blocks_gemm.cpp", "decode_layers.cpp")
]


def _supported() -> bool:
    capability = torch.backends.cpu.get_cpu_capability()
    return capability in ("AVX2", "AVX512") and os.environ.get("MASHBOX_CPU_KERNELS") != "0"


@functools.cache
def load():
    """The compiled module (`int8_linear(x, pack_int8(q), scale)`, `DecodeStack`), or None
    where it cannot be used."""
    if not _supported():
        return None
    from torch.utils.cpp_extension import load as build

    global builds
    builds += 1
    # One build per instruction set: -march=native code from an AVX-512 machine would not
    # run on an AVX2 one that shares the home directory. MASHBOX_CPU_KERNELS=avx2 builds
    # the 256-bit kernels on an AVX-512 machine (to test or time both widths).
    capability = torch.backends.cpu.get_cpu_capability().lower()
    width = ["-mno-avx512f"] if os.environ.get("MASHBOX_CPU_KERNELS") == "avx2" else []
    if width:
        capability = "avx2"
    build_dir = Path.home() / ".cache" / "mashbox" / "kernels" / capability
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        return build(
            f"mashbox_cpu_kernels_{capability}",
            sources=[str(s) for s in SOURCES],
            # OpenMP binds to the libgomp torch has loaded: one thread pool for both.
            extra_cflags=["-O3", "-march=native", *width, "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
        )
    except Exception as exc:  # no compiler, no ninja, a build error: torch's kernel instead
        log.warning("mashbox: CPU kernels unavailable (%s); using torch's ops", exc)
        return None


TILE = 32  # output rows per packed tile (int8_gemm.cpp)


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 weights [N, K] as the kernel reads them: tiles of 32 output rows, k-major,
    [ceil(N / 32), K, 32], the last tile padded with zeros."""
    n, k = q.shape
    pad = -n % TILE
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
    return q.view(-1, TILE, k).transpose(1, 2).contiguous()


def pack_q4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF matrix's 4-bit blocks as q4_gemm (blocks_gemm.cpp) reads them: q uint8 [N, K]
    in 0..15 and fp16 d, m [N, K / 32] (w = q * d + m) -> qs uint8 [N / 32, K / 2, 32]
    (weights k and k + 1 of an output in one byte, low nibble first) and dm fp16
    [N / 32, K / 32, 2, 32]."""
    n, k = q.shape
    tiles = q.view(n // TILE, TILE, k).transpose(1, 2)  # [N / 32, K, 32]
    qs = (tiles[:, 0::2] | (tiles[:, 1::2] << 4)).contiguous()
    dm = torch.stack([d, m], dim=-1).view(n // TILE, TILE, k // 32, 2)
    return qs, dm.permute(0, 2, 3, 1).contiguous()


def pack_q4a8(q: torch.Tensor) -> torch.Tensor:
    """4-bit weights q uint8 [N, K] in 0..15 as q4a8_gemm reads them: [N / 32, K / 8, 32, 4],
    for each 8 weights of an output 4 bytes, byte j holding weights j (low nibble) and j + 4
    (high), so one 32-bit lane holds 4 consecutive weights for an int8 dot product."""
    n, k = q.shape
    eights = q.view(n // TILE, TILE, k // 8, 8)
    return (eights[..., :4] | (eights[..., 4:] << 4)).permute(0, 2, 1, 3).contiguous()


def unpack_q4a8(qs: torch.Tensor) -> torch.Tensor:
    """pack_q4a8's inverse: q uint8 [N, K]."""
    t = qs.permute(0, 2, 1, 3)  # [N / 32, 32, K / 8, 4]
    q = torch.cat([t & 0x0F, t >> 4], dim=-1)
    return q.reshape(qs.shape[0] * TILE, -1)


def pack_q8(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF matrix's Q8_0 blocks as q8_gemm reads them: q int8 [N, K] and fp16 d
    [N, K / 32] (w = q * d) -> qs int8 [N / 32, K, 32] and d fp16 [N / 32, K / 32, 32]."""
    n, k = q.shape
    qs = q.view(n // TILE, TILE, k).transpose(1, 2).contiguous()
    return qs, d.view(n // TILE, TILE, k // 32).transpose(1, 2).contiguous()
