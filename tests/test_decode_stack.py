"""The one-call CPU decode step (`DecodeStack`, decode_layers.cpp) against the torch ops it
replaces: the same int8 or int4 weights, the same float32 math, one call instead of ~400, over
a float16 KV cache (the default where it runs) or a float32 one."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from mashbox.engine import cpu_kernels, kernel_build
from mashbox.engine.engine import Engine
from mashbox.engine.int4 import Int4Weight
from mashbox.engine.q8_weight import Q8Weight
from support.decode_steps import (
    PROMPTS,
    assert_one_call_is_two,
    decode_with_caches,
    prefill,
)
from support.tinymodels import no_tokenizer, random_weights, write_gguf

LACKS = kernel_build.machine_lacks()  # anywhere else, no kernels fails the tests below
pytestmark = pytest.mark.skipif(LACKS is not None, reason=f"cannot build the kernels: {LACKS}")


Q = gguf.GGMLQuantizationType
KINDS = {
    "int8": (None, None),
    "int4": (Q.Q4_1, Int4Weight),
    "int4a16": (Q.Q4_1, Int4Weight),
    "int4a8": (Q.Q4_1, Int4Weight),
    "int4-q8": (Q.Q8_0, Q8Weight),
}


def assert_caches_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Keys or values written by the two paths: float32 ones up to float32 rounding; float16
    ones within one float16 step (a sum a hair either side of a rounding boundary)."""
    assert got.dtype == want.dtype
    tolerance = 1e-3 if got.dtype == torch.float16 else 1e-4
    torch.testing.assert_close(got, want, rtol=tolerance, atol=1e-4)


def assert_hidden_close(got: torch.Tensor, want: torch.Tensor, cache: torch.Tensor) -> None:
    """Hidden states of the two paths up to float32 rounding; over a float16 cache, where a
    key one float16 step apart (assert_caches_close) moves what the next layers read, 1e-3
    (1.5e-4 seen)."""
    tolerance = 1e-3 if cache.dtype == torch.float16 else 1e-4
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


@pytest.fixture(
    scope="module",
    params=[
        ("llama", "int8", "auto"),
        ("qwen2", "int8", "auto"),
        ("qwen3", "int8", "auto"),
        ("llama", "int4", "auto"),
        ("llama", "int4a16", "auto"),
        ("llama", "int4a8", "auto"),
        ("llama", "int4-q8", "auto"),
        ("qwen2", "int8", "float32"),
        ("llama", "int4a16", "float32"),
    ],  # fmt: skip
    ids=lambda p: "-".join(p).removesuffix("-auto"),
)
def engine(request, tmp_path_factory):
    """Each architecture's extra: qwen2 q/k/v biases (and a tied head), qwen3 q/k norms; and
    the file's own Q4_1 or Q8_0 blocks, every matrix (the 97-row head stays int8); a float16
    KV cache (auto) or a float32 one."""
    arch, kind, kv_dtype = request.param
    qtype, weight_class = KINDS[kind]
    w = random_weights(vocab=97, qkv_bias=arch == "qwen2", tied=arch == "qwen2", seed=5)
    if arch == "qwen3":
        rng = np.random.default_rng(6)
        for i in range(2):
            for name in ("attn_q_norm.weight", "attn_k_norm.weight"):
                w[f"blk.{i}.{name}"] = (1 + 0.1 * rng.standard_normal(16)).astype(np.float32)
    path = write_gguf(
        tmp_path_factory.mktemp(arch) / "m.gguf", w, no_tokenizer,
        arch=arch, qtype_of=lambda name: None if name.endswith("norm.weight") else qtype,
    )  # fmt: skip
    engine = Engine(
        path, slots=4, ctx=64, decode_weights=kind.removesuffix("-q8"), kv_dtype=kv_dtype
    )
    assert engine.model.decode_stack is not None
    assert engine.info.batch_invariant  # what the server reports: the promise tested below
    assert engine.cache.k.dtype == (torch.float32 if kv_dtype == "float32" else torch.float16)
    if weight_class is not None:
        assert isinstance(engine.model.layers[0]["w_down"], weight_class)
    assert engine.model.decode_kind == {"int4-q8": "q8_0"}.get(kind, kind)
    assert (engine.model.layers[0]["q_norm"] is not None) == (arch == "qwen3")
    prefill(engine)
    return engine


def test_it_computes_what_the_torch_ops_compute(engine):
    fused, k, v = decode_with_caches(engine, [3, 0, 2], fused=True)
    torch_ops, k_ref, v_ref = decode_with_caches(engine, [3, 0, 2], fused=False)
    assert_hidden_close(fused, torch_ops, k)
    assert_caches_close(k, k_ref)
    assert_caches_close(v, v_ref)
    assert not torch.equal(k, engine.cache.k)  # the steps did write their keys


def test_a_row_has_the_same_bits_alone_and_in_any_batch(engine):
    """Seeded sampling sees the same logits whatever else is decoding (the float32 path
    cannot promise this: CPU sgemm rounds by batch size)."""
    batch, _, _ = decode_with_caches(engine, [2, 0, 3], fused=True)
    for i, slot in enumerate([2, 0, 3]):
        alone, _, _ = decode_with_caches(engine, [slot], fused=True)
        assert torch.equal(alone[:, 0], batch[:, i]), slot


def test_the_stack_and_its_head_in_one_call_give_the_same_bits(engine):
    """What an engine step calls (`decode_logits`: the embedding, the stack and the head in
    one call into the kernels) against `decode`, then `logits`."""
    assert_one_call_is_two(engine, [3, 0, 2], [11, 23, 5])


LONG = 3000  # positions: several of the attention's chunks (decode_math.h's ATTENTION_CHUNK)


@pytest.fixture(scope="module", params=["float16", "float32"])
def long_engine(request, tmp_path_factory):
    """A 3k-token row (slot 0) and a short one (slot 1), head_dim 64 (the registers' path)
    and two query heads to a kv head, over a float16 or a float32 KV cache."""
    w = random_weights(vocab=97, d_model=256, n_heads=4, n_kv_heads=2, seed=7)
    path = write_gguf(
        tmp_path_factory.mktemp("long") / "m.gguf", w, no_tokenizer, n_heads=4, n_kv_heads=2
    )
    engine = Engine(path, slots=2, ctx=LONG + 8, decode_weights="int8", kv_dtype=request.param)
    assert engine.model.decode_stack is not None and engine.model.cfg.head_dim == 64
    prompts = {0: np.random.default_rng(8).integers(0, 97, LONG).tolist(), 1: PROMPTS[0]}
    prefill(engine, prompts)
    return engine, prompts


def test_a_long_context_computes_what_the_torch_ops_compute(long_engine):
    engine, prompts = long_engine
    fused, k, v = decode_with_caches(engine, [0, 1], fused=True, prompts=prompts)
    torch_ops, k_ref, v_ref = decode_with_caches(engine, [0, 1], fused=False, prompts=prompts)
    assert_hidden_close(fused, torch_ops, k)
    assert_caches_close(k, k_ref)
    assert_caches_close(v, v_ref)


def test_a_row_has_the_same_bits_alone_and_beside_a_longer_row(long_engine):
    """The long row's attention is cut into chunks the threads share; the short row's is not
    touched by that, nor the long row's by its neighbour."""
    engine, prompts = long_engine
    beside, _, _ = decode_with_caches(engine, [1, 0], fused=True, prompts=prompts)
    for i, slot in enumerate([1, 0]):
        alone, _, _ = decode_with_caches(engine, [slot], fused=True, prompts=prompts)
        assert torch.equal(alone[:, 0], beside[:, i]), slot


def test_both_vector_widths_give_the_same_bits(long_engine, narrow_kernels, monkeypatch):
    """The AVX2 build (16 lanes in two 256-bit halves) and the AVX-512 one, where the CPU has
    both: the same sums in the same order, so the same bits."""
    engine, prompts = long_engine
    wide, k, v = decode_with_caches(engine, [1, 0], fused=True, prompts=prompts)
    model = engine.model
    monkeypatch.setattr(cpu_kernels, "load", lambda: narrow_kernels)
    stack, model.decode_stack = model.decode_stack, model._decode_stack()
    try:
        got, k2, v2 = decode_with_caches(engine, [1, 0], fused=True, prompts=prompts)
    finally:
        model.decode_stack = stack
    assert torch.equal(got, wide) and torch.equal(k2, k) and torch.equal(v2, v)


@pytest.mark.parametrize("kind", ["int8", "int4a16"])
def test_a_prompts_bits_do_not_depend_on_its_prefill_chunks(tiny_llama, kind):
    """Where the engine says batch_invariant, `--prefill-chunk` need not be part of the
    answers id (system_fingerprint): a prompt prefilled 256 rows at a time or 48 writes the
    same keys and values, to the bit, and ends in the same hidden state."""
    engine = Engine(tiny_llama, slots=2, ctx=1024, decode_weights=kind)
    assert engine.info.batch_invariant
    prompt = [(i * 37) % 380 + 10 for i in range(700)]
    last = []
    for slot, chunk in enumerate((256, 48)):
        for start in range(0, len(prompt), chunk):
            ids = torch.tensor(prompt[start : start + chunk])
            hidden = engine.model.prefill(engine.cache, slot, start, ids)
        last.append(hidden)
    n = len(prompt)
    assert torch.equal(last[0], last[1])
    assert torch.equal(engine.cache.k[:, 0, :, :n], engine.cache.k[:, 1, :, :n])
    assert torch.equal(engine.cache.v[:, 0, :, :n], engine.cache.v[:, 1, :, :n])


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_the_heads_rows_have_their_bits_however_many_are_projected(tiny_llama, kind):
    """Where the engine says batch_invariant, a prompt's first token is sampled from the
    same logits alone or beside more prompts than the head's compact form takes in one call
    (past `max_rows` it would take the float matrix), and echo's prompt rows read them too."""
    engine = Engine(tiny_llama, slots=1, ctx=256, decode_weights=kind)
    assert engine.info.batch_invariant
    model = engine.model
    hidden = torch.randn(3 * model.lm_head.max_rows + 5, model.cfg.d_model)
    together = model.logits(hidden)
    alone = torch.cat([model.logits(row[None]) for row in hidden])
    assert torch.equal(together, alone)
    assert torch.equal(model.logits(hidden, row_invariant=True), alone)


@pytest.mark.parametrize("kind", ["int8", "int4a16"])
def test_more_rows_than_the_stack_takes_at_once_keep_their_bits(tiny_llama, kind):
    """A decode step of more rows than one stack call takes (17 and 20 streams: a server with
    more slots than that) runs in pieces of as many as it takes: each row's logits what it
    has alone. Past 16 rows torch's ops had run instead, float matrices and all."""
    engine = Engine(tiny_llama, slots=20, ctx=64, decode_weights=kind)
    model = engine.model
    for slot in range(20):
        model.prefill(engine.cache, slot, 0, torch.tensor([1, 50, 60, 70, 80]) + slot)
    alone = model.decode_logits(engine.cache, [3], [103], [5])
    for n in (16, 17, 20):
        many = model.decode_logits(engine.cache, list(range(n)), list(range(100, 100 + n)), [5] * n)
        assert torch.equal(many.values[3], alone.values[0]), n
        assert many.best[3] == alone.best[0] and len(many.best) == len(many.finite) == n
