"""AMX tiles for prefill chunks' Q4, Q5 and Q8_0 matmuls (rounded_gemm.cpp): on wherever
the CPU and Linux have them and the kernels are built for this machine, and the same bits as
the AVX-512 kernels at every row count a prefill chunk gives them (the AVX-512 kernels are the
fallback everywhere else, and the reference the other kernel tests check row by row)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from mashbox.engine import cpu_kernels, kernel_build
from mashbox.engine.int4 import Int4Weight
from mashbox.engine.q8_weight import Q8Weight
from mashbox.engine.weights import RawBlocks

LACKS = kernel_build.machine_lacks()
pytestmark = pytest.mark.skipif(LACKS is not None, reason=f"cannot build the kernels: {LACKS}")

AMX_FLAGS = {"amx_tile", "amx_int8"}
# A block's bytes and weights, and where its fp16 scales lie (the other bytes any value).
BLOCKS = {
    Q.Q4_0: (18, 32, (0,)),
    Q.Q4_1: (20, 32, (0, 2)),
    Q.Q5_0: (22, 32, (0,)),
    Q.Q5_1: (24, 32, (0, 2)),
    Q.Q4_K: (144, 256, (0, 2)),
    Q.Q5_K: (176, 256, (0, 2)),
    Q.Q8_0: (34, 32, (0,)),
}


def amx_on() -> bool:
    kernel = cpu_kernels.load()
    return kernel is not None and kernel.amx() == "on"


def test_amx_is_on_wherever_the_cpu_has_it():
    """A native build on a CPU with AMX-INT8 uses it, and says so in its instruction sets (the
    ready line's `kernels`). Elsewhere: not in the build, and the AVX-512 kernels run."""
    kernel = cpu_kernels.load()
    report = cpu_kernels.report()
    if not AMX_FLAGS <= kernel_build.cpu()[1]:
        assert kernel.amx() in ("not in this build", "on")
        pytest.skip("this CPU has no AMX-INT8 (lscpu: amx_tile, amx_int8)")
    if "-march=native" not in report.chosen.flags:
        pytest.skip(f"the kernels are built for {report.chosen.target}, not this machine")
    if kernel.amx().startswith("refused"):  # the WARNING at load says so too
        pytest.skip(f"AMX {kernel.amx()}")
    assert kernel.amx() == "on", kernel.amx()
    assert report.isa.endswith("+amx"), report.isa


def random_blocks(qtype, n: int, k: int, seed: int) -> RawBlocks:
    """n rows of k weights in random blocks, their scales fp16 of either sign."""
    size, weights, scales_at = BLOCKS[qtype]
    g = np.random.default_rng(seed)
    raw = g.integers(0, 256, (n, k // weights, size), dtype=np.uint8)
    for at in scales_at:
        scale = g.standard_normal(raw.shape[:2]) * 2.0 ** g.integers(-14, -2, raw.shape[:2])
        raw[..., at : at + 2] = scale.astype(np.float16)[..., None].view(np.uint8)
    return RawBlocks(qtype, torch.from_numpy(raw))


@contextlib.contextmanager
def avx512_alone():
    """AMX off inside the block (the AVX-512 kernels alone), back on after."""
    kernel = cpu_kernels.load()
    kernel.set_amx(False)
    try:
        yield
    finally:
        kernel.set_amx(True)


@pytest.mark.skipif(not amx_on(), reason="AMX is not on here (test_amx_is_on_wherever...)")
@pytest.mark.parametrize("qtype", list(BLOCKS))
def test_amx_gives_the_avx512_kernels_bits_at_every_prefill_row_count(qtype):
    """Every kind of block that a prefill chunk multiplies by on the tiles (Q4 and Q5 records,
    Q8_0's pairs of int8; Q6_K's groups of 16 stay on AVX-512) at rows 33-256 (16 at a time,
    the last few padded with zero rows), with the int16 activations' full range (x spread
    over many magnitudes per block)."""
    k = 512
    blocks = random_blocks(qtype, 64, k, seed=int(qtype))
    kind = Q8Weight if qtype == Q.Q8_0 else Int4Weight
    weight = kind([blocks], activations="int16")
    assert weight.kernel is cpu_kernels.load() and weight.max_rows == 256
    g = torch.Generator().manual_seed(7)
    x = torch.randn(256, k, generator=g) * 2.0 ** torch.randint(-8, 8, (256, k), generator=g)
    for rows in (33, 47, 48, 100, 255, 256):
        with_amx = weight(x[:rows])
        with avx512_alone():
            assert cpu_kernels.load().amx() == "turned off"
            without = weight(x[:rows])
        assert torch.equal(with_amx, without), rows
    assert torch.equal(weight(x[:1]), with_amx[:1])  # and a row alone, as a decode step has it
