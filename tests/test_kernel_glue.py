"""A prefill chunk's norms, RoPE and SiLU on the CPU kernels (decode_layers.cpp's rows_*,
`Model.glue`): the decode step's own arithmetic, against float64, each row's bits its own,
the same bits from both vector widths, and a model's prefill that agrees with torch's ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mashbox.engine import cpu_kernels, kernel_build
from mashbox.engine.engine import Engine
from mashbox.engine.model import TORCH_GLUE, KernelGlue
from support.tinymodels import no_tokenizer, random_weights, write_gguf

LACKS = kernel_build.machine_lacks()  # anywhere else, no kernels fails the tests below
pytestmark = pytest.mark.skipif(LACKS is not None, reason=f"cannot build the kernels: {LACKS}")
kernel = cpu_kernels.load()

WIDTHS = [8, 72, 576, 100]  # under a vector, whole vectors, SmolLM2's, a ragged tail


def inputs(rows: int, n: int, seed: int = 0):
    """x with strided rows (a slice of a wider matrix, as qkv's q and k are), and weights."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, n + 24, generator=g) * 3
    return wide[:, 5 : 5 + n], torch.randn(n, generator=g)


@pytest.mark.parametrize("n", WIDTHS)
def test_rms_norm_is_rmsnorm(n):
    x, w = inputs(37, n)
    got = kernel.rows_rms_norm(x, w, 1e-5)
    want = F.rms_norm(x.double(), (n,), w.double(), 1e-5)
    assert got.is_contiguous() and torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hd", [8, 64, 128, 40])
def test_rope_rotates_every_head_half_against_half(hd):
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(19, 5 * hd + 3 * hd, generator=g)
    x = qkv[:, : 5 * hd].view(19, 5, hd)  # rows strided, heads contiguous
    angles = torch.rand(19, hd // 2, generator=g, dtype=torch.float64) * 50
    cos, sin = angles.cos().float(), angles.sin().float()
    got = kernel.rows_rope(x, cos, sin)
    x1, x2 = x[..., : hd // 2].double(), x[..., hd // 2 :].double()
    c, s = cos.double()[:, None], sin.double()[:, None]
    want = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.allclose(got, TORCH_GLUE.apply_rope(x, cos, sin), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", WIDTHS)
def test_silu_mul_is_silu_of_gate_times_up(n):
    g = torch.Generator().manual_seed(2)
    gate_up = torch.randn(23, 2 * n, generator=g) * 4
    gate, up = gate_up.double().chunk(2, dim=-1)
    want = gate * torch.sigmoid(gate) * up
    assert torch.allclose(kernel.rows_silu_mul(gate_up).double(), want, rtol=1e-5, atol=1e-6)


def test_a_rows_bits_are_its_own():
    """Each row alone gives the bits it gets among others: chunking and batching a prompt
    never change them."""
    x, w = inputs(40, 100, seed=3)
    whole = kernel.rows_rms_norm(x, w, 1e-6)
    for r in (0, 17, 39):
        assert torch.equal(kernel.rows_rms_norm(x[r : r + 1], w, 1e-6), whole[r : r + 1])
    gate_up = torch.randn(40, 200)
    whole = kernel.rows_silu_mul(gate_up)
    assert torch.equal(kernel.rows_silu_mul(gate_up[9:10].contiguous()), whole[9:10])


def test_both_vector_widths_give_the_same_bits(narrow_kernels):
    for n in WIDTHS:
        x, w = inputs(21, n, seed=n)
        assert torch.equal(
            narrow_kernels.rows_rms_norm(x, w, 1e-5), kernel.rows_rms_norm(x, w, 1e-5)
        )
        gate_up = torch.randn(21, 2 * n)
        assert torch.equal(narrow_kernels.rows_silu_mul(gate_up), kernel.rows_silu_mul(gate_up))
    x = torch.randn(9, 3, 64)
    cos, sin = torch.rand(9, 32), torch.rand(9, 32)
    assert torch.equal(narrow_kernels.rows_rope(x, cos, sin), kernel.rows_rope(x, cos, sin))


def test_bad_shapes_are_refused_not_read_past():
    x, w = inputs(4, 16)
    with pytest.raises(RuntimeError, match="w \\[n\\]"):
        kernel.rows_rms_norm(x, w[:8], 1e-5)
    with pytest.raises(RuntimeError, match="float32"):
        kernel.rows_rms_norm(x.double(), w, 1e-5)
    with pytest.raises(RuntimeError, match="2 n"):
        kernel.rows_silu_mul(torch.randn(4, 7))
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel.rows_silu_mul(torch.randn(8, 4).t())
    with pytest.raises(RuntimeError, match="hd / 2"):
        kernel.rows_rope(torch.randn(4, 2, 8), torch.rand(4, 3), torch.rand(4, 3))
    with pytest.raises(RuntimeError, match="heads, hd"):
        kernel.rows_rope(torch.randn(4, 8, 2).transpose(1, 2), torch.rand(4, 1), torch.rand(4, 1))


def test_a_models_prefill_uses_it_and_agrees_with_torchs_ops(tmp_path):
    """Model.forward on the CPU in float32 takes the kernels' glue; its prefill's hidden
    states and cache agree with torch's ops up to float32 rounding."""
    w = random_weights(vocab=97, d_model=256, n_heads=4, n_kv_heads=2, seed=5)
    path = write_gguf(tmp_path / "m.gguf", w, no_tokenizer, n_heads=4, n_kv_heads=2)
    engine = Engine(path, slots=1, ctx=300, decode_weights="int8", kv_dtype="float32")
    model, cache = engine.model, engine.cache
    assert isinstance(model.glue, KernelGlue)
    ids = torch.randint(0, 97, (260,), generator=torch.Generator().manual_seed(6))

    def run():
        first = model.prefill(cache, 0, 0, ids[:130], all_rows=True)
        rest = model.prefill(cache, 0, 130, ids[130:], all_rows=True)
        return torch.cat([first, rest]), cache.k[:, 0, :, :260].clone()

    kernels_glue = run()
    model.glue = TORCH_GLUE
    torch_glue = run()
    for a, b in zip(kernels_glue, torch_glue, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)
