"""The KV cache's dtype: float16 where the CPU kernels attend (half the memory, and half the
bytes a decode step reads at long context), float32 when asked or where torch's ops attend;
and what float16 keys and values change in the default model's greedy text."""

from __future__ import annotations

import pytest
import torch

from mashbox import registry
from mashbox.engine import kernel_build
from mashbox.engine.engine import Engine
from support.decode_steps import STEPS, TEXT_PROMPTS, greedy_logits
from support.tinymodels import no_tokenizer, random_weights, write_gguf

LACKS = kernel_build.machine_lacks()  # anywhere else, no kernels fails the tests below
pytestmark = pytest.mark.skipif(LACKS is not None, reason=f"cannot build the kernels: {LACKS}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    w = random_weights(vocab=97, d_model=256, n_heads=4, n_kv_heads=2, seed=11)
    path = tmp_path_factory.mktemp("kv") / "m.gguf"
    return write_gguf(path, w, no_tokenizer, n_heads=4, n_kv_heads=2)


def test_auto_is_float16_where_the_kernels_attend_and_float32_elsewhere(tiny):
    fast = Engine(tiny, slots=2, ctx=64, decode_weights="int8")
    reference = Engine(tiny, slots=2, ctx=64)  # float weights: torch's ops
    asked = Engine(tiny, slots=2, ctx=64, decode_weights="int8", kv_dtype="float32")
    assert fast.cache.k.dtype == fast.cache.v.dtype == torch.float16
    assert fast.info.kv_dtype == "float16"
    assert reference.cache.k.dtype == torch.float32 and reference.info.kv_dtype == "float32"
    assert asked.cache.k.dtype == torch.float32 and asked.info.kv_dtype == "float32"
    assert 2 * fast.info.kv_bytes_per_token == asked.info.kv_bytes_per_token
    assert 2 * fast.cache.nbytes == asked.cache.nbytes


@torch.inference_mode()
def test_torchs_ops_read_a_float16_cache_asked_for(tiny):
    """float decode weights over --kv-dtype float16: the torch ops round what they write
    and widen what they read; the logits stay near the float32 cache's, the picks the same."""
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (40, 9)]
    want = greedy_logits(Engine(tiny, slots=2, ctx=128), prompts)
    half = Engine(tiny, slots=2, ctx=128, kv_dtype="float16")
    assert half.cache.k.dtype == torch.float16 and half.model.decode_stack is None
    got = greedy_logits(half, prompts, want.argmax(-1))
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_unknown_and_impossible_kv_dtypes_are_refused(tiny):
    with pytest.raises(ValueError, match="kv_dtype must be one of auto, float16, float32"):
        Engine(tiny, slots=1, ctx=64, kv_dtype="int8")
    with pytest.raises(ValueError, match="needs a CPU computing in float32"):
        Engine(tiny, slots=1, ctx=64, dtype=torch.bfloat16, kv_dtype="float16")


def test_disk_files_of_one_kv_dtype_are_never_read_by_the_other(tiny, tmp_path):
    def key(kv_dtype: str) -> str:
        engine = Engine(
            tiny, slots=1, ctx=64, decode_weights="int8", kv_dtype=kv_dtype,
            cache_dir=tmp_path, cache_dir_bytes=2**20,
        )  # fmt: skip
        return engine.info.disk_key

    assert key("float16") != key("float32")


@pytest.mark.slow
def test_float16_keys_and_values_keep_the_default_models_greedy_text():
    """int4a16 (the default) over a float16 and a float32 cache, fed the same tokens, on the
    six short prompts and a ~700-token one: logits move by 0.02 at most here (int4a16's own
    rounding: 0.007, test_int4.py), and no greedy pick changes."""
    from mashbox.text.tokenizer import Tokenizer

    path = registry.fetch(registry.resolve(registry.DEFAULT_MODEL), registry.default_models_dir())
    tok = Tokenizer.from_gguf(path)
    log = "The lighthouse keeper wrote in his log every evening, noting the wind, the ships "
    log += "that passed and the colour of the sea. "
    prompts = [tok.encode(p) for p in [*TEXT_PROMPTS, log * 28 + "The keeper"]]
    assert len(prompts[-1]) > 600

    def run(kv_dtype: str, forced=None) -> torch.Tensor:
        engine = Engine(
            path, slots=len(prompts), ctx=1024, decode_weights="int4a16", kv_dtype=kv_dtype
        )
        assert engine.cache.k.dtype == getattr(torch, kv_dtype)
        return greedy_logits(engine, prompts, forced)

    exact = run("float32")
    half = run("float16", exact.argmax(-1))
    change = float((half - exact).abs().max())
    print(f"largest logit change over a float16 cache: {change:.4f}")
    assert change < 0.1
    assert torch.equal(half.argmax(-1), exact.argmax(-1)), f"picks part within {STEPS} steps"
