"""OpenAI completions' `echo`: the text starts with the prompt, and with `logprobs` the
prompt's tokens come with their log-probs, each read from the prompt's own prefill (lm-eval's
loglikelihood requests: token ids in, `max_tokens` 1, `echo`, `logprobs`)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from mashbox.text.tokenizer import Tokenizer
from support.serverproc import serving

PROMPT = "The sea was calm, and the ships sailed home"


def complete(server, **body) -> dict:
    body = {"max_tokens": 6, "temperature": 0} | body
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_starts_each_choice_with_its_prompt(server):
    plain = complete(server, prompt=["Once upon a time", PROMPT], n=2, seed=7, temperature=1)
    echoed = complete(
        server, prompt=["Once upon a time", PROMPT], n=2, seed=7, temperature=1, echo=True
    )
    prompts = ["Once upon a time"] * 2 + [PROMPT] * 2
    assert [c["text"] for c in echoed["choices"]] == [
        p + c["text"] for p, c in zip(prompts, plain["choices"], strict=True)
    ]
    assert echoed["usage"] == plain["usage"]  # the echo is not generated


def test_echoed_log_probs_are_each_prompt_tokens_own(server, tiny_llama):
    tok = Tokenizer.from_gguf(tiny_llama)
    ids = tok.encode(PROMPT, add_bos=tok.add_bos)
    r = complete(server, prompt=ids, echo=True, logprobs=3, max_tokens=4)
    (choice,) = r["choices"]
    lp = choice["logprobs"]
    n_prompt = r["usage"]["prompt_tokens"]
    assert n_prompt == len(ids)
    assert len(lp["tokens"]) == n_prompt + r["usage"]["completion_tokens"]
    assert "".join(lp["tokens"]) == choice["text"]
    assert choice["text"].startswith(tok.decode(ids))
    assert lp["text_offset"] == [
        sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))
    ]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, n_prompt):
        top = lp["top_logprobs"][i]
        assert top[lp["tokens"][i]] == lp["token_logprobs"][i] <= 0
        assert len(top) <= 4 and max(top.values()) <= 0  # (pieces of characters: one key)
    # Each prompt token's log-prob is what the model gives it after the tokens before it:
    # asked alone of that prefix, forced by logit_bias (log-probs are read before the bias).
    # On mashbox's kernels to the bit (each row one sum in a fixed order, whatever the rows).
    exact = httpx.get(server.url + "/health").json()["batch_invariant"]
    for k in (1, 5, n_prompt - 1):
        alone = complete(
            server, prompt=ids[:k], logprobs=3, max_tokens=1, logit_bias={str(ids[k]): 100}
        )["choices"][0]["logprobs"]
        want = lp["token_logprobs"][k] if exact else pytest.approx(lp["token_logprobs"][k], 1e-4)
        assert alone["token_logprobs"][0] == want
        assert alone["top_logprobs"][0].keys() == lp["top_logprobs"][k].keys()


def test_echoed_log_probs_are_read_again_not_from_a_cache(server, tiny_llama):
    """The prompt's rows are computed by each request that asks for them: a prefix a slot or
    the cache holds has no hidden states to read."""
    tok = Tokenizer.from_gguf(tiny_llama)
    ids = tok.encode(PROMPT + " again", add_bos=tok.add_bos)
    complete(server, prompt=ids)  # now a slot holds it
    first = complete(server, prompt=ids, echo=True, logprobs=1, max_tokens=1)
    second = complete(server, prompt=ids, echo=True, logprobs=1, max_tokens=1)
    assert first["choices"][0]["logprobs"] == second["choices"][0]["logprobs"]
    assert first["timings"]["cache_n"] == second["timings"]["cache_n"] == 0
    assert len(first["choices"][0]["logprobs"]["tokens"]) == len(ids) + 1


def test_a_streamed_echo_is_the_whole_answers(server):
    body = {"prompt": [PROMPT, "Far away"], "n": 2, "seed": 3, "temperature": 1}
    body |= {"echo": True, "logprobs": 2, "max_tokens": 5}
    whole = complete(server, **body)
    r = httpx.post(
        server.url + "/v1/completions", json={**body, "stream": True, "max_tokens": 5}, timeout=60
    )
    texts: dict[int, str] = {}
    logprobs: dict[int, dict] = {}
    for block in r.text.strip().split("\n\n"):
        data = block.removeprefix("data: ")
        if data == "[DONE]":
            continue
        for c in json.loads(data)["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            for key, values in (c.get("logprobs") or {}).items():
                logprobs.setdefault(c["index"], {}).setdefault(key, []).extend(values)
    for c in whole["choices"]:
        assert texts[c["index"]] == c["text"]
        assert logprobs[c["index"]] == c["logprobs"]


def test_an_empty_answer_still_echoes_its_prompt(server, tiny_llama):
    """The first token sampled ends the answer (an end of text, forced): no text is
    generated, the prompt is still echoed, streamed or not, with its log-probs."""
    tok = Tokenizer.from_gguf(tiny_llama)
    (eos,) = [t for t in tok.eog_ids][:1]
    body = {"prompt": PROMPT, "echo": True, "logprobs": 1, "logit_bias": {str(eos): 100}}
    whole = complete(server, **body)
    (choice,) = whole["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "stop"
    assert whole["usage"]["completion_tokens"] == 1
    r = httpx.post(server.url + "/v1/completions", json={**body, "stream": True}, timeout=60)
    chunks = [json.loads(b[6:]) for b in r.text.strip().split("\n\n") if b != "data: [DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0].get("logprobs")]
    assert streamed[0]["token_logprobs"] == choice["logprobs"]["token_logprobs"]


def test_the_official_sdk_reads_an_echo(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    r = client.completions.create(
        model="tiny-llama.gguf", prompt=PROMPT, echo=True, logprobs=0, max_tokens=3
    )
    (choice,) = r.choices
    assert choice.text.startswith(PROMPT)
    assert choice.logprobs.token_logprobs[0] is None
    assert all(isinstance(x, float) for x in choice.logprobs.token_logprobs[1:])


@pytest.mark.parametrize("echo", ["yes", 1, None, []])
def test_echo_that_is_not_a_boolean_is_400(server, echo):
    body = {"prompt": PROMPT, "echo": echo, "max_tokens": 2}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    if echo is None:  # JSON null: not given
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "echo"


def test_echo_reads_every_prefill_chunk_of_a_long_prompt(server, tiny_llama):
    """A prompt of three 256-token chunks: the rows on each side of a chunk's edge read the
    right tokens, and the whole agrees with what sampling after each prefix is given."""
    tok = Tokenizer.from_gguf(tiny_llama)
    ids = tok.encode((PROMPT + ". ") * 40, add_bos=tok.add_bos)[:700]
    lp = complete(server, prompt=ids, echo=True, logprobs=1, max_tokens=1)["choices"][0]
    lp = lp["logprobs"]
    assert len(lp["token_logprobs"]) == 701 and lp["token_logprobs"][0] is None
    exact = httpx.get(server.url + "/health").json()["batch_invariant"]
    for k in (255, 256, 257, 512, 699):
        alone = complete(
            server, prompt=ids[:k], logprobs=1, max_tokens=1, logit_bias={str(ids[k]): 100}
        )["choices"][0]["logprobs"]
        assert alone["tokens"][0] == lp["tokens"][k]
        want = lp["token_logprobs"][k] if exact else pytest.approx(lp["token_logprobs"][k], 1e-4)
        assert alone["token_logprobs"][0] == want


def test_lm_evals_loglikelihood_request(server, tiny_llama):
    """The body lm-eval's `local-completions` sends for loglikelihood (token ids, a batch
    of them, one new token, echo, one log-prob) and how it reads the answer: by index, the
    continuation's tokens `token_logprobs[ctxlen:-1]`, greedy if each is its top's best."""
    tok = Tokenizer.from_gguf(tiny_llama)
    pairs = [("The sea was", " calm"), ("The ships sailed", " home and away")]
    prompts, ctxlens = [], []
    for ctx, cont in pairs:
        ctx_ids = tok.encode(ctx, add_bos=tok.add_bos)
        prompts.append(ctx_ids + tok.encode(cont))
        ctxlens.append(len(ctx_ids))
    body = {"model": "tiny-llama.gguf", "prompt": prompts, "temperature": 0, "max_tokens": 1}
    out = complete(server, **body, logprobs=1, seed=1234, echo=True)
    choices = sorted(out["choices"], key=lambda c: c["index"])
    for choice, ctxlen, ids in zip(choices, ctxlens, prompts, strict=True):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1
        continuation = lp["token_logprobs"][ctxlen:-1]
        assert len(continuation) == len(ids) - ctxlen and all(x < 0 for x in continuation)
        for token, top in zip(lp["tokens"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1], strict=True):
            assert token in top and max(top.values()) >= top[token]


def test_echoed_log_probs_are_bounded_in_all(tiny_llama):
    """32 answers of a 4,200-token prompt would echo 134,400 entries (~65 MB of JSON): a
    400 naming echo before any of it is computed. Without logprobs the echo is text alone,
    bounded by the context only; a 4,000-token prompt's log-probs are answered whole."""
    with serving(str(tiny_llama), "--ctx", "8192", "--slots", "2", "--threads", "1") as proc:
        over = {"prompt": [[1] + [300] * 4199] * 4, "n": 8, "echo": True, "max_tokens": 1}
        r = httpx.post(proc.url + "/v1/completions", json={**over, "logprobs": 0}, timeout=30)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "echo" and "134400 prompt tokens" in error["message"]
        assert "at most 131072" in error["message"]
        r = httpx.post(proc.url + "/v1/completions", json=over, timeout=120)
        assert r.status_code == 200, r.text  # text alone
        under = {**over, "prompt": [[1] + [300] * 3999], "n": 1, "logprobs": 0}
        r = httpx.post(proc.url + "/v1/completions", json=under, timeout=120)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["logprobs"]["tokens"]) == 4001


def test_an_echo_runs_again_whole_after_an_engine_fault(server, tiny_llama):
    """The engine lost after the prompt's log-probs and first tokens went to the route: the
    answer is run again from its start and reads as if nothing happened (its prompt's
    log-probs once, not twice). (A fault in the prefill is any request's retry.)"""
    body = {"prompt": [PROMPT, "Far away"], "n": 2, "seed": 5, "temperature": 1}
    body |= {"echo": True, "logprobs": 2, "max_tokens": 8, "ignore_eos": True}
    want = complete(server, **body)
    with serving(
        str(tiny_llama), "--ctx", "1024", "--slots", "2", "--threads", "1",
        env={"MASHBOX_FAULTS": "raise@6"},
    ) as proc:  # fmt: skip
        r = httpx.post(proc.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        got = r.json()
        assert httpx.get(proc.url + "/health").json()["worker_restarts"] == 1
    for mine, theirs in zip(got["choices"], want["choices"], strict=True):
        assert mine["text"] == theirs["text"]
        assert mine["logprobs"] == theirs["logprobs"]


# --- vLLM's tokenizer routes: what an evaluation harness counts a context's tokens with ---


def test_tokenize_is_what_completions_prompts_are(server, tiny_llama):
    tok = Tokenizer.from_gguf(tiny_llama)
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, timeout=30).json()
    assert r["tokens"] == tok.encode(PROMPT, add_bos=tok.add_bos)
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 1024
    usage = complete(server, prompt=PROMPT, max_tokens=1)["usage"]
    assert usage["prompt_tokens"] == r["count"]  # the same tokens a completion reads
    bare = httpx.post(
        server.url + "/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}
    ).json()["tokens"]
    assert bare == tok.encode(PROMPT)
    text = httpx.post(server.url + "/detokenize", json={"tokens": bare}).json()["prompt"]
    assert text == tok.decode(bare)
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["chat_template"]
    eos = httpx.post(
        server.url + "/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}
    ).json()["tokens"]
    assert eos == [tok.eos_id]  # a special token spelled in the text is that token


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}, "messages"),
        ("/tokenize", {"prompt": "Hi", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/tokenize", {"prompt": "Hi", "model": "other"}, "model"),
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": [1.5]}, "tokens"),
        ("/detokenize", {"tokens": [1] * 131073}, "tokens"),
    ],
)
def test_the_tokenizer_routes_refuse_what_is_not_theirs(server, path, body, field):
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == field
