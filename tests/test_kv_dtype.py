"""The KV cache's dtype: float16 where the CPU kernels attend (half the memory, and half the
bytes a decode step reads at long context), float32 when asked or where torch's ops attend;
and what float16 keys and values change in the default model's greedy text."""

from __future__ import annotations

import httpx
import pytest
import torch

from mashbox import registry
from mashbox.engine import kernel_build
from mashbox.engine.engine import Engine
from mashbox.protocol import Admit, Branch, Decide, Decode, Prefill, SamplingParams, Step
from support.decode_steps import STEPS, TEXT_PROMPTS, greedy_logits
from support.serverproc import serving
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


# --- values past float16's range -----------------------------------------------------------

SPECIAL = 5  # the one token whose layer-0 values overflow float16 (`overflowing`)


@pytest.fixture(scope="module")
def overflowing(tmp_path_factory):
    """A model whose layer-0 values for SPECIAL are ~3e5, finite in float32 and past float16's
    65504, and ~1 for every other token: only SPECIAL's embedding has a first component (its
    normalized input is 16 there), and v's weights read that component 20,000-fold."""
    w = random_weights(vocab=97, d_model=256, n_heads=4, n_kv_heads=2, seed=11)
    w["token_embd.weight"][:, 0] = 0.0
    w["token_embd.weight"][SPECIAL] = 0.0
    w["token_embd.weight"][SPECIAL, 0] = 1.0
    w["blk.0.attn_v.weight"][:, 0] = 20000.0
    path = tmp_path_factory.mktemp("overflow") / "m.gguf"
    return write_gguf(path, w, no_tokenizer, n_heads=4, n_kv_heads=2)


def generate(engine: Engine, prompts: dict[int, list[int]], steps: int = 6) -> dict:
    """Greedy tokens per slot, all prompts in the same steps; a slot the engine reports
    non-finite (`StepResult.nonfinite`) gets None and is not decoded again."""
    greedy_params = SamplingParams()
    out = {slot: [] for slot in prompts}
    result = engine.step(
        Step(
            admits=tuple(Admit(s, greedy_params, tuple(p)) for s, p in prompts.items()),
            prefills=tuple(Prefill(s, 0, tuple(p), True) for s, p in prompts.items()),
        )
    )
    for i in range(steps):
        for slot in out:
            if slot in result.nonfinite:
                assert slot not in result.tokens
                out[slot].append(None)
            elif out[slot][-1:] != [None]:
                out[slot].append(result.tokens[slot])
        live = [s for s in out if out[s][-1] is not None]
        if i == steps - 1 or not live:
            break
        decodes = tuple(Decode(s, out[s][-1], len(prompts[s]) + len(out[s]) - 1) for s in live)
        result = engine.step(Step(decodes=decodes))
    return out


def test_a_row_past_float16s_range_ends_alone_and_the_others_keep_their_bits(overflowing):
    """Over a float16 cache SPECIAL's values overflow to infinity and its request's logits
    become NaN: the engine samples nothing for that row and says so, where before it picked
    garbage. The other row in the same steps gets the tokens it gets alone, and a float32
    cache computes SPECIAL's request through."""
    hostile, plain = [7, SPECIAL, 9, 11], [7, 8, 9, 11]

    def engine(kv_dtype):
        return Engine(overflowing, slots=2, ctx=64, decode_weights="int8", kv_dtype=kv_dtype)

    both = generate(engine("float16"), {0: hostile, 1: plain})
    assert None in both[0], both
    assert both[1] == generate(engine("float16"), {1: plain})[1]
    assert None not in both[1]
    exact = generate(engine("float32"), {0: hostile, 1: plain})
    assert None not in exact[0] and len(exact[0]) == 6
    assert exact[1] == both[1]


def test_a_typed_decision_past_float16s_range_reads_nothing(overflowing):
    """A decision's reads (log-probs after a prefix) over the overflow: no NaN log-probs
    come back, the slot is reported instead; float32 reads them."""
    prefix = (7, SPECIAL, 9, 11)
    branch = Branch((12, 13), ((1, 2, 3), (5, 6)), leaves=(4,))

    def decide(kv_dtype: str):
        engine = Engine(overflowing, slots=1, ctx=64, decode_weights="int8", kv_dtype=kv_dtype)
        admit = Admit(0, SamplingParams(), prefix)
        engine.step(Step(admits=(admit,), prefills=(Prefill(0, 0, prefix, False),)))
        return engine.step(Step(decides=(Decide(0, len(prefix), (branch,)),)))

    half = decide("float16")
    assert half.nonfinite == (0,) and half.decisions == {}
    exact = decide("float32")
    assert exact.nonfinite == () and len(exact.decisions[0][0]) == 2


@pytest.fixture(scope="module")
def overflowing_llama(tmp_path_factory):
    """`overflowing`'s trick in a tiny Llama with a real vocabulary: the token " Paris"
    overflows float16 in layer 0; "The lazy dog" never holds it. (The tokenizer, the token.)"""
    import sentencepiece

    from support import tinytok

    work = tmp_path_factory.mktemp("overflow-llama")
    spm = tinytok.train_spm(work)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(spm))
    special = sp.piece_to_id("▁Paris")
    assert special != sp.unk_id() and special not in sp.encode("The lazy dog")
    w = random_weights(vocab=sp.get_piece_size(), seed=0)
    w["token_embd.weight"][:, 0] = 0.0
    w["token_embd.weight"][special] = 0.0
    w["token_embd.weight"][special, 0] = 1.0
    w["blk.0.attn_v.weight"][:, 0] = 20000.0
    path = work / "overflow.gguf"
    return write_gguf(path, w, lambda writer: tinytok.add_spm_tokenizer(writer, spm))


def test_a_request_past_float16s_range_is_a_500_that_says_so_and_nobody_elses(
    overflowing_llama,
):
    """Through a real server: the request whose values overflow the float16 cache ends with a
    500 in its route's shape naming `--kv-dtype float32`, streamed or not; a request beside
    it and one after it in the same slot answer as on a fresh server; no engine restart. On
    `--kv-dtype float32` the same request is answered."""
    args = "--slots", "2", "--ctx", "512", "--threads", "1", "--decode-weights", "int8"

    def complete(url: str, prompt: str, **extra) -> httpx.Response:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        return httpx.post(url + "/v1/completions", json={**body, **extra}, timeout=60)

    with serving(str(overflowing_llama), *args, "--kv-dtype", "float16") as proc:
        plain = complete(proc.url, "The lazy dog")
        assert plain.status_code == 200, plain.text
        bad = complete(proc.url, "The capital is Paris")
        assert bad.status_code == 500, bad.text
        message = bad.json()["error"]["message"]
        assert "NaN or infinite" in message and "--kv-dtype float32" in message
        with httpx.stream(
            "POST", proc.url + "/v1/completions", timeout=60,
            json={"prompt": "Paris, then", "max_tokens": 8, "stream": True},
        ) as r:  # fmt: skip
            streamed = r.read().decode()
        assert "NaN or infinite" in streamed, streamed
        # Both slots have now held an overflow: what comes next is as on a fresh server.
        again = [complete(proc.url, "The lazy dog") for _ in range(2)]
        assert [r.json()["choices"][0]["text"] for r in again] == [
            plain.json()["choices"][0]["text"]
        ] * 2
        health = httpx.get(proc.url + "/health").json()
        assert health["worker_restarts"] == 0 and health["status"] == "ok"
    with serving(str(overflowing_llama), *args, "--kv-dtype", "float32") as proc:
        exact = complete(proc.url, "The capital is Paris")
        assert exact.status_code == 200 and exact.json()["usage"]["completion_tokens"] == 8
