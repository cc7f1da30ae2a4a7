"""llama-server's own `/completion` (and `/completions`): a prompt's continuation in
llama-server's shape, for the clients written against it. Each answer must be the one
/v1/completions gives for the same prompt tokens and sampling, whatever form the prompt takes
(text, token ids, both mixed, several prompts), whole or streamed."""

from __future__ import annotations

import json

import httpx
import pytest

from mashbox.text.tokenizer import Tokenizer

PROMPT = "The capital of France is"


def llama(server, expect: int = 200, path: str = "/completion", **body):
    body = {"n_predict": 8, "temperature": 0} | body
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == expect, r.text
    return r.json()


def completion(server, **body) -> dict:
    body = {"max_tokens": 8, "temperature": 0} | body
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + "/completion", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: {") for line in lines)  # data only, no [DONE]
    return [json.loads(line[6:]) for line in lines]


@pytest.fixture(scope="module")
def tok(tiny_llama) -> Tokenizer:
    return Tokenizer.from_gguf(tiny_llama)


@pytest.mark.parametrize("path", ["/completion", "/completions"])
@pytest.mark.parametrize(
    "sampling", [{}, {"temperature": 1, "seed": 7, "top_k": 20}], ids=["greedy", "seeded"]
)
def test_a_text_prompt_is_answered_as_v1_completions_answers_it(server, path, sampling):
    r = llama(server, path=path, prompt=PROMPT, ignore_eos=True, **sampling)
    want = completion(server, prompt=PROMPT, ignore_eos=True, **sampling)
    assert r["content"] == want["choices"][0]["text"] != ""
    assert r["tokens_evaluated"] == want["usage"]["prompt_tokens"]
    assert r["tokens_predicted"] == want["usage"]["completion_tokens"] == 8
    assert r["stop"] is True and r["stop_type"] == "limit" and r["index"] == 0
    assert r["timings"]["prompt_n"] + r["tokens_cached"] == r["tokens_evaluated"]


def test_token_ids_and_mixed_prompts_read_each_piece_in_its_place(server, tok):
    ids = tok.encode(PROMPT, add_bos=True)
    by_ids = llama(server, prompt=ids)
    assert by_ids["content"] == completion(server, prompt=ids)["choices"][0]["text"]
    assert by_ids["tokens_evaluated"] == len(ids)
    # [ids, text, ids]: the text's tokens between, no bos before it (it does not come first).
    mixed = llama(server, prompt=[*ids[:3], " Paris", 13])
    spelled = [*ids[:3], *tok.encode(" Paris", add_bos=False), 13]
    assert mixed["tokens_evaluated"] == len(spelled)
    assert mixed["content"] == completion(server, prompt=spelled)["choices"][0]["text"]
    # A text first gets the bos where the model wants one, as a text prompt does.
    first = llama(server, prompt=[PROMPT, 13])
    assert first["tokens_evaluated"] == len(ids) + 1 and tok.add_bos


def test_several_prompts_are_answered_each_as_alone(server, tok):
    seeded = {"temperature": 1, "seed": 3, "ignore_eos": True}
    prompts = [PROMPT, tok.encode("Once upon a time", add_bos=True), ["Hello", 13]]
    answers = llama(server, prompt=prompts, **seeded)
    assert [a["index"] for a in answers] == [0, 1, 2]
    for answer, prompt in zip(answers, prompts, strict=True):
        alone = llama(server, prompt=prompt, **seeded)
        assert answer["content"] == alone["content"] != ""
        assert answer["tokens_evaluated"] == alone["tokens_evaluated"]
    # Streamed: each prompt's events under its index, each ending once.
    events = stream(server, {"prompt": prompts, "n_predict": 8, "stream": True, **seeded})
    for i, answer in enumerate(answers):
        mine = [e for e in events if e["index"] == i]
        assert "".join(e["content"] for e in mine) == answer["content"]
        assert [e["stop"] for e in mine][-1] is True and sum(e["stop"] for e in mine) == 1


def test_the_stream_is_llama_servers_events(server):
    body = {"prompt": PROMPT, "n_predict": 12, "temperature": 0, "ignore_eos": True}
    whole = llama(server, **body)
    events = stream(server, body | {"stream": True})
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == whole["content"]
    assert events[-1]["tokens_predicted"] == 12 and events[-1]["stop_type"] == "limit"
    assert whole["tokens"] == events[-1]["tokens"] == []  # llama-server's key, ids unasked


def test_n_probs_and_return_tokens_are_the_models_log_probs(server, tok):
    r = llama(server, prompt=PROMPT, n_probs=3, return_tokens=True, ignore_eos=True)
    want = completion(server, prompt=PROMPT, logprobs=3, ignore_eos=True)["choices"][0]
    probs = r["completion_probabilities"]
    assert len(probs) == len(r["tokens"]) == 8
    assert [p["id"] for p in probs] == r["tokens"]
    assert [p["token"] for p in probs] == want["logprobs"]["tokens"]
    assert [p["logprob"] for p in probs] == want["logprobs"]["token_logprobs"]
    for p in probs:
        assert bytes(p["bytes"]) == tok.token_bytes(p["id"])
        assert len(p["top_logprobs"]) == 3
        tops = [t["logprob"] for t in p["top_logprobs"]]
        assert tops == sorted(tops, reverse=True) and p["logprob"] <= tops[0]
    assert tok.decode(r["tokens"]) == r["content"]
    # Streamed, each event carries its own tokens' entries.
    events = stream(server, {"prompt": PROMPT, "n_predict": 8, "temperature": 0,
                             "n_probs": 3, "ignore_eos": True, "stream": True})  # fmt: skip
    streamed = [p for e in events[:-1] for p in e["completion_probabilities"]]
    assert streamed == probs


def test_llama_servers_logit_bias_pairs_ban_a_token(server):
    first = llama(server, prompt=PROMPT, n_predict=1, return_tokens=True)["tokens"][0]
    banned = llama(server, prompt=PROMPT, n_predict=1, return_tokens=True,
                   logit_bias=[[first, False]])  # fmt: skip
    assert banned["tokens"][0] != first
    as_openai = llama(server, prompt=PROMPT, n_predict=1, return_tokens=True,
                      logit_bias={str(first): -100})  # fmt: skip
    assert as_openai["tokens"] == banned["tokens"]


def test_json_schema_constrains_the_answer(server):
    schema = {"type": "object", "properties": {}, "additionalProperties": False}
    r = llama(server, prompt=PROMPT, n_predict=32, json_schema=schema)
    assert json.loads(r["content"]) == {} and r["stop_type"] == "eos"


def test_n_predict_0_reads_the_prompt_and_answers_nothing(server):
    warm = llama(server, prompt=PROMPT + " warm", n_predict=0)
    assert warm["content"] == "" and warm["tokens_predicted"] == 0


def test_llama_servers_samplers_at_their_neutral_values_are_accepted(server):
    neutral = {"typical_p": 1, "mirostat": 0, "dry_multiplier": 0, "xtc_probability": 0,
               "dynatemp_range": 0, "grammar": "", "cache_prompt": True, "samplers": ["top_k"],
               "n_keep": 0, "repeat_last_n": 64, "t_max_prompt_ms": 100}  # fmt: skip
    assert (
        llama(server, prompt=PROMPT, **neutral)["content"]
        == llama(server, prompt=PROMPT)["content"]
    )


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": ["a", []]}, "prompt[1]"),
        ({"prompt": ["a", {}]}, "prompt[1]"),
        ({"prompt": [1.5]}, "prompt"),
        ({"prompt": {"text": "x"}}, "prompt"),
        ({"prompt": [10**9]}, "prompt"),
        ({"prompt": [1, "x" * 10**7]}, "prompt"),
        ({"prompt": ["x"] * 33}, "prompt"),
        ({"prompt": [1] * 5000}, "prompt"),
        ({"prompt": "x", "typical_p": 0.9}, "typical_p"),
        ({"prompt": "x", "mirostat": 2}, "mirostat"),
        ({"prompt": "x", "dry_multiplier": 0.8}, "dry_multiplier"),
        ({"prompt": "x", "xtc_probability": 0.5}, "xtc_probability"),
        ({"prompt": "x", "dynatemp_range": 0.5}, "dynatemp_range"),
        ({"prompt": "x", "grammar": 'root ::= "a"'}, "grammar"),
        ({"prompt": "x", "post_sampling_probs": True}, "post_sampling_probs"),
        ({"prompt": "x", "lora": [{"id": 0, "scale": 1}]}, "lora"),
        ({"prompt": "x", "n_probs": 21}, "n_probs"),
        ({"prompt": "x", "n_probs": -1}, "n_probs"),
        ({"prompt": "x", "logit_bias": [["hello", 1]]}, "logit_bias"),
        ({"prompt": "x", "logit_bias": [[1, 500]]}, "logit_bias"),
        ({"prompt": "x", "return_tokens": 1}, "return_tokens"),
        ({"prompt": "x", "json_schema": "object"}, "json_schema"),
        ({"prompt": "x", "n_indent": -1}, "n_indent"),
    ],
)
def test_a_bad_field_is_a_4xx_naming_it(server, body, field):
    r = httpx.post(server.url + "/completion", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_props_says_what_llama_servers_clients_read_there(server, tok):
    """GET /props: the context, slots, chat template and special tokens, as llama-server
    gives them (front ends read the template and n_ctx there)."""
    r = httpx.get(server.url + "/props", timeout=60)
    assert r.status_code == 200
    props = r.json()
    assert props["default_generation_settings"]["n_ctx"] == 1024  # the fixture's --ctx
    assert props["default_generation_settings"]["params"]["temperature"] == 0
    assert props["total_slots"] == 4
    models = httpx.get(server.url + "/v1/models", timeout=60).json()
    assert props["model_alias"] == models["data"][0]["id"]
    assert props["bos_token"] == tok.bos_token != "" and props["eos_token"] == tok.eos_token
    assert "{%" in props["chat_template"] and props["modalities"]["vision"] is False


# --- llama-server's form of /tokenize and /detokenize -------------------------------------


def tokenize(server, expect: int = 200, **body):
    r = httpx.post(server.url + "/tokenize", json=body, timeout=60)
    assert r.status_code == expect, r.text
    return r.json()


def test_tokenize_reads_llama_servers_content_as_it_does(server, tok):
    """No bos unless add_special asks (llama-server's default is false); a mixed list's
    texts each tokenized in their place; a special token's text is that token unless
    parse_special is false."""
    assert tokenize(server, content=PROMPT)["tokens"] == tok.encode(PROMPT)
    with_bos = tokenize(server, content=PROMPT, add_special=True)["tokens"]
    assert with_bos == tok.encode(PROMPT, add_bos=tok.add_bos) != tok.encode(PROMPT)
    mixed = tokenize(server, content=[7, "the sea", 9, " and"], add_special=True)["tokens"]
    assert mixed == [7, *tok.encode("the sea"), 9, *tok.encode(" and")]  # no bos: 7 is first
    assert tokenize(server, content=tok.eos_token)["tokens"] == [tok.eos_id]
    plain = tokenize(server, content=tok.eos_token, parse_special=False)["tokens"]
    # As plain text (SentencePiece puts its space before it).
    assert tok.eos_id not in plain and tok.decode(plain).lstrip() == tok.eos_token
    answer = tokenize(server, content="")
    assert answer == {"tokens": [], "count": 0, "max_model_len": 1024}


def test_with_pieces_answers_each_token_with_its_text_or_bytes(server, tok):
    ids = tok.encode(PROMPT)
    pieces = tokenize(server, content=PROMPT, with_pieces=True)["tokens"]
    assert [p["id"] for p in pieces] == ids
    assert "".join(p["piece"] for p in pieces) == tok.decode(ids)
    bos = tokenize(server, content=[tok.bos_id], with_pieces=True)["tokens"]
    assert bos == [{"id": tok.bos_id, "piece": tok.bos_token}]  # a control token's text
    partial = next(
        i
        for i in range(tok.vocab_size)
        if len(tok.token_bytes(i)) == 1 and tok.token_bytes(i)[0] >= 0x80
    )
    raw = tokenize(server, content=[partial], with_pieces=True)["tokens"]
    assert raw == [{"id": partial, "piece": list(tok.token_bytes(partial))}]  # not UTF-8 alone


def test_detokenize_answers_llama_servers_content_too(server, tok):
    """content as llama-server spells it: a control token's text too, where vLLM's prompt
    (an answer's text) has none."""
    ids = tok.encode(PROMPT)
    r = httpx.post(server.url + "/detokenize", json={"tokens": ids}, timeout=60).json()
    assert r["content"] == r["prompt"] == tok.decode(ids)
    both = [tok.bos_id, *ids, tok.eos_id]
    r = httpx.post(server.url + "/detokenize", json={"tokens": both}, timeout=60).json()
    assert r["prompt"] == tok.decode(ids)
    assert r["content"] == tok.bos_token + tok.decode(ids) + tok.eos_token


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"content": 5}, "content"),
        ({"content": [1.5]}, "content"),
        ({"content": [{"text": "a"}]}, "content"),
        ({"content": [10**9]}, "content"),
        ({"content": [-1, "a"]}, "content"),
        ({"content": ["a"] * 1025}, "content"),  # more items than the context holds
        ({"content": "x", "prompt": "y"}, "content"),
        ({"content": "x", "with_pieces": "yes"}, "with_pieces"),
        ({"content": "x", "add_special": 1}, "add_special"),
        ({"content": "x", "parse_special": "no"}, "parse_special"),
        ({"content": "x", "model": "other"}, "model"),
    ],
)
def test_a_bad_llama_tokenize_body_is_a_4xx_naming_its_field(server, body, field):
    r = httpx.post(server.url + "/tokenize", json=body, timeout=60)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == field


# --- llama-server's /apply-template --------------------------------------------------------


def apply_template(server, **body) -> str:
    r = httpx.post(server.url + "/apply-template", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def test_apply_template_is_the_prompt_chat_completions_reads(server, tok):
    """The rendered prompt, tokenized as a completion's prompt is, is the chat route's prompt
    to the token, and /completion answers it as /v1/chat/completions answers the messages."""
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Name three planets."},
    ]
    prompt = apply_template(server, messages=messages)
    assert prompt.index("Answer briefly.") < prompt.index("Name three planets.")
    chat = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
        timeout=60,
    ).json()
    ids = tokenize(server, content=prompt, add_special=True)["tokens"]
    assert len(ids) == chat["usage"]["prompt_tokens"]
    answer = llama(server, prompt=ids, ignore_eos=True)
    assert answer["content"] == chat["choices"][0]["message"]["content"] != ""


def test_apply_template_gives_a_messages_special_token_text_as_written(server, tok):
    said = f"Say {tok.eos_token} twice."
    prompt = apply_template(server, messages=[{"role": "user", "content": said}])
    assert said in prompt and "\ufdd0" not in prompt  # not the server's own marks


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": "x"}, "tools"),
        ({"messages": [{"role": "user", "content": "hi"}], "model": "other"}, "model"),
    ],
)
def test_a_bad_apply_template_body_is_a_4xx_naming_its_field(server, body, field):
    r = httpx.post(server.url + "/apply-template", json=body, timeout=60)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == field
