"""mashbox's CPU int8 kernel against a plain float matmul of the same int8 weights."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from mashbox.engine import cpu_kernels, kernel_build
from mashbox.engine.int8_weight import Int8Weight, quantize_int8

# Skipped only where the machine truly cannot build them; anywhere else no kernels is a failure.
LACKS = kernel_build.machine_lacks()
pytestmark = pytest.mark.skipif(LACKS is not None, reason=f"cannot build the kernels: {LACKS}")
kernel = cpu_kernels.load()


def test_the_kernels_load_on_a_machine_that_can_build_them():
    assert kernel is not None, cpu_kernels.report().fallback
    assert cpu_kernels.report().kernels.startswith(kernel.isa())


SHAPES = [(960, 576), (37, 64), (8, 8), (70, 12)]  # (N, K): whole tiles, ragged, tiny, odd K


def problem(m: int, n: int, k: int):
    g = torch.Generator().manual_seed(m * 1000 + n)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    return torch.randn(m, k, generator=g), q, torch.rand(n, generator=g) / 100


@pytest.mark.parametrize("m", range(1, 17))
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_int8_linear_is_the_dequantized_matmul(m, n, k):
    """Every batch size a decode step can have (1-16 rows: blocks of 4, 3, 2 and 1 rows, one
    row two tiles at a time) and output sizes that do not fill the last tile."""
    x, q, scale = problem(m, n, k)
    w = q.double() * scale.double()[:, None]
    y = kernel.int8_linear(x, cpu_kernels.pack_int8(q), scale).double()
    # A float32 sum of k products in order is within k ulps of the sum of their magnitudes.
    bound = (k + 2) * 2.0**-24 * (x.double().abs() @ w.abs().T)
    assert ((y - x.double() @ w.T).abs() <= bound).all()


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_a_row_has_the_same_bits_in_any_batch(n, k):
    """Each output is summed in one order whatever block computes it, so seeded sampling
    sees the same logits for a row alone and among 15 others, at any index."""
    x, q, scale = problem(16, n, k)
    packed = cpu_kernels.pack_int8(q)
    alone = torch.cat([kernel.int8_linear(x[i : i + 1], packed, scale) for i in range(16)])
    for m in range(2, 17):
        assert torch.equal(kernel.int8_linear(x[:m], packed, scale), alone[:m]), m


def test_int8_weights_use_it_with_float32_activations():
    w = torch.randn(64, 128)
    weight = Int8Weight(w)
    assert weight.kernel is kernel
    x = torch.randn(3, 128)
    q, scale = quantize_int8(w)
    dequantized = q.float() * scale[:, None]
    torch.testing.assert_close(weight(x), x @ dequantized.T, rtol=1e-5, atol=1e-5)


def test_loading_the_kernels_counts_as_a_compile():
    """What compiles_after_ready counts: a fresh process has compiled nothing until the
    kernels load (built, or loaded from the cache), and then one program."""
    code = (
        "from mashbox.engine import cpu_kernels; from mashbox.engine.engine import compiles_so_far;"
        "before = compiles_so_far(); cpu_kernels.load(); print(before, compiles_so_far())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0", "1"]


def assert_reads_exactly(matmul, w: torch.Tensor) -> None:
    """matmul(x) = x . W^T for the file's weights w: x = identity reads w back bit for bit;
    any x is within float32 summation error of the float64 product (per block: a k-ordered
    sum of 32 products, then scaled and added: a few ulps of the magnitudes involved); a row
    has the same bits alone and in a batch of up to 16."""
    n, k = w.shape
    assert torch.equal(matmul(torch.eye(k)).T, w)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(n))
    y = matmul(x)
    bound = (k + 70) * 2.0**-24 * (x.double().abs() @ w.double().abs().T)
    assert ((y.double() - x.double() @ w.double().T).abs() <= bound).all()
    alone = torch.cat([matmul(x[i : i + 1]) for i in range(16)])
    for m in range(1, 17):
        assert torch.equal(matmul(x[:m]), alone[:m]), m


@pytest.mark.parametrize(("n", "k"), [(960, 576), (64, 64), (96, 1536)])
def test_q4_linear_multiplies_by_the_files_weights_exactly(n, k):
    """Q4 blocks: w = q * d + m, q in 0..15 (Q4_0 is m = -8 d)."""
    g = torch.Generator().manual_seed(n + k)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    d = (torch.rand(n, k // 32, generator=g) / 64).half()
    m = (-torch.rand(n, k // 32, generator=g) / 8).half()
    w = q.float() * d.float().repeat_interleave(32, 1) + m.float().repeat_interleave(32, 1)
    qs, dm = cpu_kernels.pack_q4(q, d, m)
    assert_reads_exactly(lambda x: kernel.q4_linear(x, qs, dm), w)


@pytest.mark.parametrize(("n", "k"), [(960, 576), (64, 64), (96, 1536)])
def test_q8_linear_multiplies_by_the_files_weights_exactly(n, k):
    """Q8_0 blocks: w = q * d, q int8."""
    g = torch.Generator().manual_seed(n + k)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    d = (torch.rand(n, k // 32, generator=g) / 64).half()
    w = q.float() * d.float().repeat_interleave(32, 1)
    qs, ds = cpu_kernels.pack_q8(q, d)
    assert_reads_exactly(lambda x: kernel.q8_linear(x, qs, ds), w)


LIMITS = {"int8": 127, "int16": 32767}  # the largest |xq| of each activation type


def round_blocks(x: torch.Tensor, activations: str):
    """What q4a8 / q4a16 multiply by, as rounded_gemm.cpp's quantize_rows computes it: per block
    of 32, dx = max|x| / LIMIT and xq = x / dx rounded to the nearest (even) integer."""
    b = x.view(x.shape[0], -1, 32)
    dx = b.abs().amax(-1) / LIMITS[activations]
    inv = torch.where(dx != 0, 1 / dx, torch.zeros_like(dx))
    return torch.round(b * inv[..., None]), dx


def rounded_reference(x, q, d, m, activations):
    """float64 of the kernel's formula: per block dx * (d * sum(q * xq)) + m * (dx * sum(xq)),
    the integer sums exact; and the magnitude of its terms, for the rounding bound."""
    xq, dx = round_blocks(x, activations)
    n, k = q.shape
    qb = q.double().view(n, k // 32, 32)
    sums = torch.einsum("mbk,nbk->mnb", xq.double(), qb)  # exact: integers below 2^53
    xs = (dx * xq.sum(-1)).double()  # the kernel's float32 dx * sum(xq)
    scaled = d.double()[None] * dx.double()[:, None] * sums
    offset = m.double()[None] * xs[:, None]
    return (scaled + offset).sum(-1), (scaled.abs() + offset.abs()).sum(-1)


def q4_problem(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    d = (torch.rand(n, k // 32, generator=g) / 64).half()
    m = (-torch.rand(n, k // 32, generator=g) / 8).half()
    return q, d, m


def rounded_matmul(q, d, m, activations):
    """The kernel for `activations` on q, d, m, packed as it reads them."""
    qs, dm = cpu_kernels.pack_q4(q, d, m)
    if activations == "int8":
        return lambda x: kernel.q4a8_linear(x, qs, dm)
    return lambda x: kernel.q4a16_linear(x, qs, dm)


@pytest.mark.parametrize("activations", ["int8", "int16"])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (64, 64), (96, 1536)])
def test_rounded_activations_times_q4_is_the_integer_product(n, k, activations):
    """Activations rounded per block of 32 times the file's Q4 weights: within a few float32
    roundings a block of the exact product of those integers; a zero block stays zero; a row
    has the same bits alone and in a batch of up to 16."""
    q, d, m = q4_problem(n, k, n + k)
    matmul = rounded_matmul(q, d, m, activations)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(k)) * 3
    x[3, :32] = 0  # a block with nothing in it: dx = 0
    x[5, 32:64] *= 1e4  # an outlier block: its own scale, the other blocks unaffected
    y = matmul(x)
    ref, magnitude = rounded_reference(x, q, d.float(), m.float(), activations)
    blocks = k // 32
    assert ((y.double() - ref).abs() <= (3 * blocks + 4) * 2.0**-24 * magnitude).all()
    alone = torch.cat([matmul(x[i : i + 1]) for i in range(16)])
    for rows in range(1, 17):
        assert torch.equal(matmul(x[:rows]), alone[:rows]), rows


@pytest.mark.parametrize("activations", ["int8", "int16"])
def test_the_error_is_the_roundings_and_no_more(activations):
    """Against float32 activations the error is each activation's rounding (half a step,
    dx / 2) times its weight: int16's steps are 258x finer than int8's."""
    q, d, m = q4_problem(64, 256, 7)
    w = q.float() * d.float().repeat_interleave(32, 1) + m.float().repeat_interleave(32, 1)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(1))
    y = rounded_matmul(q, d, m, activations)(x)
    _, dx = round_blocks(x, activations)
    step = dx.repeat_interleave(32, 1)  # each activation's rounding step
    bound = (step / 2).double() @ w.double().abs().T + 1e-5
    error = (y.double() - x.double() @ w.double().T).abs()
    assert (error <= bound).all()
    assert not torch.equal(y, kernel.q4_linear(x, *cpu_kernels.pack_q4(q, d, m)))


def test_pack_q4_round_trips_and_int4a8_weights_hold_the_files_weights():
    from mashbox.engine.int4 import Int4Weight
    from mashbox.engine.weights import RawBlocks

    q, d, m = q4_problem(96, 128, 3)
    assert torch.equal(cpu_kernels.unpack_q4(cpu_kernels.pack_q4(q, d, m)[0]), q)
    five = torch.randint(0, 32, (96, 128), dtype=torch.uint8, generator=torch.Generator())
    assert torch.equal(cpu_kernels.unpack_q4(cpu_kernels.pack_q5(five, d, m)[0]), five)
    # A Q4_1 block as GGUF stores it: d, m (fp16), then 16 bytes, byte j = q[j] | q[j + 16] << 4.
    nib = q.view(96, 4, 32)
    qbytes = nib[..., :16] | (nib[..., 16:] << 4)
    raw = torch.cat([d.view(torch.uint8).view(96, 4, 2), m.view(torch.uint8).view(96, 4, 2),
                     qbytes], dim=-1)  # fmt: skip
    from gguf import GGMLQuantizationType as Q

    w = q.float() * d.float().repeat_interleave(32, 1) + m.float().repeat_interleave(32, 1)
    weight = Int4Weight([RawBlocks(Q.Q4_1, raw)], activations="int8")
    assert weight.activations == "int8" and weight.qs.shape == (3, 16, 128)
    assert torch.equal(weight.dequantized(), w)
    x = torch.randn(3, 128)
    assert torch.equal(weight(x), kernel.q4a8_linear(x, weight.qs, weight.dm))
    weight = Int4Weight([RawBlocks(Q.Q4_1, raw)], activations="int16")
    assert torch.equal(weight.dequantized(), w)
    assert torch.equal(weight(x), kernel.q4a16_linear(x, weight.qs, weight.dm))


@pytest.mark.parametrize("activations", ["float", "int16", "int8"])
def test_q4_0_weights_keep_d_alone_and_read_the_files_weights(activations):
    """Q4_0's m = -8 d is derived by the kernels: dm holds d alone (2 bytes a block, not 4),
    and the weights are the file's, each row alone as in any batch."""
    from gguf import GGMLQuantizationType as Q

    from mashbox.engine.int4 import Int4Weight
    from mashbox.engine.weights import RawBlocks

    q, d, _ = q4_problem(96, 128, 5)
    nib = q.view(96, 4, 32)
    raw = torch.cat([d.view(torch.uint8).view(96, 4, 2), nib[..., :16] | (nib[..., 16:] << 4)],
                    dim=-1)  # fmt: skip
    w = (q.float() - 8) * d.float().repeat_interleave(32, 1)
    weight = Int4Weight([RawBlocks(Q.Q4_0, raw)], activations=activations)
    assert weight.dm.shape == (3, 4, 1, 32)
    assert torch.equal(weight.dequantized(), w)
    x = torch.randn(17, 128, generator=torch.Generator().manual_seed(6))
    batch = weight(x)
    for row in (0, 5, 16):
        assert torch.equal(weight(x[row : row + 1]), batch[row : row + 1])
