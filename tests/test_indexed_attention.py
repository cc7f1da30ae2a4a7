"""Decode attention that reads each row's slot in place (indexed_attention.py): against
torch's SDPA over gathered copies, eager and compiled (inductor's C++ here; Triton on a GPU,
which bench/gpu_check.py times), its compile count over every bucket, and the fallback
where it does not compile. Fixed-shape decode through it: tests/test_graph_decode.py."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from mashbox.engine import indexed_attention, kernel_build
from mashbox.engine.engine import Engine, compiles_so_far
from mashbox.engine.graph_decode import GraphDecoder, batch_buckets, context_buckets
from mashbox.engine.indexed_attention import indexed_attention as attend
from mashbox.engine.kv_cache import KVCache
from support.tinymodels import no_tokenizer, random_weights, write_gguf

needs_compiler = pytest.mark.skipif(
    not kernel_build.compiler(), reason="no C++ compiler, which torch.compile needs on a CPU"
)


def case(batch, length, *, heads=4, kv_heads=2, head_dim=16, slots=5, ctx=48, dtype, seed=0):
    """A random layer cache, this step's q/k/v for `batch` rows in distinct slots at random
    positions below `length`, and the additive mask of what each row sees."""
    g = torch.Generator().manual_seed(seed)
    cache_k = torch.randn(slots, kv_heads, ctx, head_dim, generator=g).to(dtype)
    cache_v = torch.randn(slots, kv_heads, ctx, head_dim, generator=g).to(dtype)
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    k, v = (torch.randn(batch, kv_heads, head_dim, generator=g).to(dtype) for _ in "kv")
    slot_index = torch.randperm(slots, generator=g)[:batch]
    positions = torch.randint(0, length, (batch,), generator=g)
    visible = torch.arange(length) <= positions[:, None]
    mask = torch.where(visible, 0.0, float("-inf")).to(dtype)[:, None, None]
    return q, k, v, cache_k, cache_v, slot_index, positions, mask


def gathered(q, k, v, cache_k, cache_v, slot_index, positions, mask):
    """graph_decode's other attention: write, copy the rows' slots out, SDPA in float32."""
    cache_k[slot_index, :, positions] = k
    cache_v[slot_index, :, positions] = v
    length, (batch, kv_heads, head_dim) = mask.shape[-1], k.shape
    keys = cache_k[:, :, :length].index_select(0, slot_index).float()
    values = cache_v[:, :, :length].index_select(0, slot_index).float()
    grouped = q.float().reshape(batch, kv_heads, -1, head_dim)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask.float())
    return out.reshape(batch, -1).to(q.dtype)


def run(fn, inputs):
    """fn on copies of the caches: its output and the caches it leaves."""
    q, k, v, cache_k, cache_v, *rest = inputs
    cache_k, cache_v = cache_k.clone(), cache_v.clone()
    return fn(q, k, v, cache_k, cache_v, *rest), cache_k, cache_v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch, length", [(1, 16), (3, 40), (5, 48)])
def test_it_attends_as_sdpa_over_gathered_copies(dtype, batch, length):
    """The same output (float32 inside both) and the same cache: this step's K/V at each
    row's (slot, position), every other entry as it was."""
    inputs = case(batch, length, dtype=dtype)
    out, cache_k, cache_v = run(attend, inputs)
    want, want_k, want_v = run(gathered, inputs)
    assert torch.equal(cache_k, want_k) and torch.equal(cache_v, want_v)
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(out, want, rtol=tolerance, atol=tolerance)


def test_a_row_sees_only_its_own_slot_up_to_its_position():
    """Changing what lies past a row's position, or in a slot no row uses, changes nothing."""
    inputs = case(2, 40, dtype=torch.float32, seed=3)
    out, *_ = run(attend, inputs)
    q, k, v, cache_k, cache_v, slot_index, positions, mask = inputs
    cache_k, cache_v = cache_k.clone(), cache_v.clone()
    for s in set(range(cache_k.shape[0])) - set(slot_index.tolist()):
        cache_k[s], cache_v[s] = 1e4, -1e4
    for s, p in zip(slot_index.tolist(), positions.tolist(), strict=True):
        cache_k[s, :, p + 1 :], cache_v[s, :, p + 1 :] = 1e4, -1e4
    again = attend(q, k, v, cache_k, cache_v, slot_index, positions, mask)
    assert torch.equal(again, out)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_it_computes_what_it_computes_eagerly(dtype):
    compiled = indexed_attention.compiled()
    for batch, length in ((1, 16), (4, 40), (2, 48)):  # 48: the whole cache
        inputs = case(batch, length, dtype=dtype, seed=batch)
        out, cache_k, cache_v = run(compiled, inputs)
        want, want_k, want_v = run(attend, inputs)
        assert torch.equal(cache_k, want_k) and torch.equal(cache_v, want_v)
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out, want, rtol=tolerance, atol=tolerance)


@needs_compiler
def test_every_bucket_of_an_8b_layout_shares_four_compiles():
    """32 query heads, 8 KV heads, 32 slots: batches 1 to 32 (one as large as the head
    count) over contexts 256 to 1024, in capture order. Four compiles (a batch of one and
    a context of the whole cache specialised), under torch's limit of 8."""
    compiled, before = indexed_attention.compiled(), compiles_so_far()
    for batch in reversed(batch_buckets(32)):
        for length in reversed(context_buckets(1024)):
            inputs = case(batch, length, heads=32, kv_heads=8, slots=33, ctx=1024,
                          dtype=torch.bfloat16)  # fmt: skip
            run(compiled, inputs)
    assert compiles_so_far() - before == 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    w = random_weights(vocab=97, seed=5)
    return write_gguf(tmp_path_factory.mktemp("indexed") / "m.gguf", w, no_tokenizer)


def test_where_it_does_not_compile_decode_attends_over_gathered_copies(tiny, monkeypatch, caplog):
    def broken():
        def fail(*args):
            raise RuntimeError("no Triton here")

        return fail

    monkeypatch.setattr(indexed_attention, "compiled", broken)
    engine = Engine(tiny, slots=2, ctx=64, graph_decode=False)
    cache = KVCache(engine.cfg, 2, 64, "cpu", torch.float32, scratch_slot=True)
    decoder = GraphDecoder(engine.model, cache, indexed=True)
    assert decoder.indexed is None
    assert [r.message for r in caplog.records if r.levelno == logging.WARNING] == [
        "decode attention over slots in place did not compile (RuntimeError: no Triton "
        "here): attending over gathered copies"
    ]
    ids, positions = torch.tensor([5]), torch.tensor([0])
    torch.testing.assert_close(
        decoder.decode([0], ids, positions),
        engine.model.decode(engine.cache, [0], ids, positions),
    )


def test_the_environment_chooses_it(monkeypatch):
    monkeypatch.delenv(indexed_attention.ENV, raising=False)
    assert not indexed_attention.wanted()
    monkeypatch.setenv(indexed_attention.ENV, "gathered")
    assert not indexed_attention.wanted()
    monkeypatch.setenv(indexed_attention.ENV, "indexed")
    assert indexed_attention.wanted()
