"""A prefill chunk's causal attention in the CPU kernels (prefill_attention.cpp) against
float64 softmax attention, and the promise that lets chunked and cached prompts agree: a row's
bits depend on its position and the keys alone. Over a float16 cache, exactly what it computes
over a float32 one holding the same values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mashbox.engine import cpu_kernels, kernel_build
from mashbox.engine.engine import Engine
from support.tinymodels import no_tokenizer, random_weights, write_gguf

LACKS = kernel_build.machine_lacks()  # anywhere else, no kernels fails the tests below
pytestmark = pytest.mark.skipif(LACKS is not None, reason=f"cannot build the kernels: {LACKS}")
kernel = cpu_kernels.load()

# (query heads, kv heads, head_dim): qwen2.5-0.5b's 7 to a kv head, SmolLM2's 3, one to one
# at 128, and a head of 8 (the tile's width); spans (start, rows) cross the 128-key blocks.
SHAPES = [(14, 2, 64), (9, 3, 64), (4, 4, 128), (6, 2, 8)]
SPANS = [(0, 1), (0, 7), (0, 256), (5, 3), (127, 130), (128, 128), (1000, 130)]


def problem(heads: int, kv_heads: int, hd: int, end: int, seed: int = 0):
    """Queries for positions 0..end-1 and a cache of `end` keys and values, followed by NaN
    positions no chunk may read."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(end, heads + kv_heads, hd, generator=g)[:, :heads] * 2  # rows strided
    k = torch.full((kv_heads, end + 70, hd), float("nan"))
    v = torch.full_like(k, float("nan"))
    k[:, :end] = torch.randn(kv_heads, end, hd, generator=g) * 2
    v[:, :end] = torch.randn(kv_heads, end, hd, generator=g)
    return q, k, v


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    rows = q.shape[0]
    end = start + rows
    sees = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
    out = F.scaled_dot_product_attention(
        q.double().transpose(0, 1)[None], k[:, :end].double()[None], v[:, :end].double()[None],
        attn_mask=sees, enable_gqa=True,
    )  # fmt: skip
    return out[0].transpose(0, 1).reshape(rows, -1).float()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("span", SPANS, ids=lambda s: f"{s[0]}+{s[1]}")
def test_it_is_causal_softmax_attention(shape, span):
    start, rows = span
    q, k, v = problem(*shape, start + rows)
    got = kernel.prefill_attention(q[start:], k, v, start)
    assert got.shape == (rows, shape[0] * shape[2])
    # float32 scores of up to ~30: a few ulps of e^x and of the sums, nothing more.
    torch.testing.assert_close(got, reference(q[start:], k, v, start), rtol=0, atol=5e-5)


@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda s: "x".join(map(str, s)))
def test_a_row_has_the_same_bits_in_any_chunking(shape):
    """So a prompt prefilled whole, in chunks, or after a cached prefix attends alike."""
    q, k, v = problem(*shape, 300, seed=1)
    whole = kernel.prefill_attention(q, k, v, 0)
    for cuts in ([1, 64, 100], [127, 128, 129, 256, 299], [250]):
        bounds = [0, *cuts, 300]
        spans = zip(bounds, bounds[1:], strict=False)
        parts = [kernel.prefill_attention(q[a:b], k, v, a) for a, b in spans]
        assert torch.equal(torch.cat(parts), whole), cuts


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_a_float16_cache_gives_the_float32_caches_bits_for_its_values(shape):
    """Keys and values are widened exactly, so the same sums of the same numbers; the NaN
    positions past the chunk stay unread in float16 too."""
    q, k, v = problem(*shape, 300, seed=3)
    k16, v16 = k.half(), v.half()
    for start in (0, 5, 128, 170):
        got = kernel.prefill_attention(q[start:], k16, v16, start)
        widened = kernel.prefill_attention(q[start:], k16.float(), v16.float(), start)
        assert torch.equal(got, widened)
        assert not got.isnan().any()


def test_bad_shapes_are_refused_not_read_past():
    q, k, v = problem(4, 2, 64, 10)
    with pytest.raises(RuntimeError, match="past the cache"):
        kernel.prefill_attention(q, k, v, 75)  # 10 rows from position 75 of an 80-long cache
    with pytest.raises(RuntimeError, match="shapes"):
        kernel.prefill_attention(q[:, :3], k, v, 0)  # 3 query heads over 2 kv heads
    with pytest.raises(RuntimeError, match="float32"):
        kernel.prefill_attention(q.double(), k, v, 0)
    with pytest.raises(RuntimeError, match="both float16"):
        kernel.prefill_attention(q, k.half(), v, 0)  # one cache of each kind
    with pytest.raises(RuntimeError, match="both float16"):
        kernel.prefill_attention(q, k.bfloat16(), v.bfloat16(), 0)


def test_both_vector_widths_give_the_same_bits(narrow_kernels):
    """The AVX2 build (tiles of 4 keys x 1 vector) and the AVX-512 one (8 x 3) run each sum in
    the same order."""
    for shape in SHAPES:
        q, k, v = problem(*shape, 200, seed=2)
        for start in (0, 70):
            for keys, values in ((k, v), (k.half(), v.half())):
                wide = kernel.prefill_attention(q[start:], keys, values, start)
                got = narrow_kernels.prefill_attention(q[start:], keys, values, start)
                assert torch.equal(got, wide), (shape, keys.dtype)


@pytest.mark.parametrize("kv_dtype", ["float16", "float32"])
def test_a_models_prefill_takes_it_and_agrees_with_torch(tmp_path, kv_dtype):
    """Model.prefill_many with the kernel and with torch's attention: the same hidden states
    up to float32 rounding, several slots' chunks in one forward. Over a float16 cache a key
    a hair either side of a rounding boundary lands one float16 step apart, and the next
    layers read it: 1e-3 there."""
    w = random_weights(vocab=97, d_model=256, n_heads=4, n_kv_heads=2, seed=3)
    path = write_gguf(tmp_path / "m.gguf", w, no_tokenizer, n_heads=4, n_kv_heads=2)
    engine = Engine(path, slots=2, ctx=400, decode_weights="int8", kv_dtype=kv_dtype)
    model, cache = engine.model, engine.cache
    assert cache.k.dtype == getattr(torch, kv_dtype)
    tolerance = 1e-3 if kv_dtype == "float16" else 1e-4
    assert model.attention_kernels is not None
    g = torch.Generator().manual_seed(4)
    ids = [torch.randint(0, 97, (n,), generator=g) for n in (300, 90)]

    def run():
        first = model.prefill_many(cache, [(0, 0, ids[0][:200]), (1, 0, ids[1])])
        rest = model.prefill_many(cache, [(0, 200, ids[0][200:])])
        return torch.cat([first, rest]), cache.k[:, :2].clone(), cache.v[:, :2].clone()

    fused = run()
    kernels, model.attention_kernels = model.attention_kernels, None
    try:
        torch_ops = run()
    finally:
        model.attention_kernels = kernels
    for got, want in zip(fused, torch_ops, strict=True):
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
