"""End to end through a real `mashbox run` on the tiny Llama: routes, SSE, limits, errors."""

from __future__ import annotations

import json
import math
import re
import time

import httpx
import openai
import pytest
import trio

CHAT = "/v1/chat/completions"


def sse_events(text: str) -> list:
    """Parse an SSE body into JSON payloads, keeping the final [DONE] as a string."""
    out = []
    for block in text.strip().split("\n\n"):
        assert block.startswith("data: "), block
        data = block.removeprefix("data: ")
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def chat_body(content="Tell me about Paris.", **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}], **extra}


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_health_and_models(server):
    for path in ("/v1/health", "/health", "/"):
        r = httpx.get(server.url + path)
        assert r.status_code == 200
        body = r.json()
        assert body["status"] == "ok"
        assert body["live_rows"] == 0 and body["waiting"] == 0
        assert isinstance(body["worker_pid"], int)
        head = httpx.head(server.url + path)
        assert head.status_code == 200 and head.content == b""
    models = httpx.get(server.url + "/v1/models").json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == "tiny-llama.gguf"
    assert card["object"] == "model" and card["owned_by"] == "mashbox-labs"
    assert card["max_model_len"] == 1024 and card["slots"] == 4
    assert httpx.get(server.url + "/v1/models/tiny-llama.gguf").json() == card
    r = httpx.get(server.url + "/v1/models/gpt-4")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"


def test_chat_completion_through_the_sdk(client):
    r = client.chat.completions.create(
        model="tiny-llama.gguf",
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=12,
    )
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    timings = r.model_extra["timings"]
    assert timings["predicted_n"] == r.usage.completion_tokens
    assert timings["prompt_n"] + timings["cache_n"] == r.usage.prompt_tokens


def test_greedy_is_deterministic_and_stream_equals_whole(client):
    kwargs = dict(model="tiny-llama.gguf", messages=[{"role": "user", "content": "Paris"}])
    a = client.chat.completions.create(max_tokens=20, **kwargs)
    b = client.chat.completions.create(max_tokens=20, **kwargs)
    assert a.choices[0].message.content == b.choices[0].message.content
    stream = client.chat.completions.create(
        max_tokens=20, stream=True, stream_options={"include_usage": True}, **kwargs
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == a.choices[0].message.content
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == a.choices[0].finish_reason
    assert "timings" in finish[0].model_extra
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.total_tokens == a.usage.total_tokens
    assert "timings" in usage_chunk.model_extra


def test_stream_wire_format(server):
    body = chat_body(stream=True, max_tokens=5)
    r = httpx.post(server.url + CHAT, json=body, timeout=60)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert {e["id"] for e in events[:-1]} == {events[0]["id"]}
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    # Without include_usage no chunk carries usage.
    assert all("usage" not in e for e in events[:-1])


def test_max_tokens_ends_with_length(client):
    r = client.chat.completions.create(
        model="tiny-llama.gguf",
        messages=[{"role": "user", "content": "count"}],
        max_tokens=3,
        temperature=1.0,
        seed=7,
        # Penalties keep a random model from ending its turn early.
        presence_penalty=2.0,
    )
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 3
    else:
        assert r.usage.completion_tokens < 3


def test_max_completion_tokens_wins(server):
    r = httpx.post(
        server.url + CHAT, json=chat_body(max_tokens=50, max_completion_tokens=2), timeout=60
    ).json()
    assert r["usage"]["completion_tokens"] <= 2


def test_completions_whole_and_streamed(server):
    body = {"prompt": "The capital of France is", "max_tokens": 8}
    whole = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    assert whole["object"] == "text_completion"
    assert whole["id"].startswith("cmpl-")
    assert whole["system_fingerprint"].startswith("seed-")
    choice = whole["choices"][0]
    assert choice["finish_reason"] in ("stop", "length")
    r = httpx.post(
        server.url + "/v1/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
        timeout=60,
    )
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == choice["text"]
    assert events[-2]["usage"] == whole["usage"]
    as_list = httpx.post(
        server.url + "/v1/completions", json={**body, "prompt": [body["prompt"]]}, timeout=60
    ).json()
    assert as_list["choices"][0]["text"] == choice["text"]


def test_continuous_usage_counts_each_chunks_tokens(server, client):
    """stream_options.continuous_usage_stats (vLLM's): every chunk carries the usage so far;
    with log-probs, each content chunk's count is the tokens whose log-probs came so far."""
    body = chat_body(max_tokens=24, temperature=0, logprobs=True, ignore_eos=True)
    whole = httpx.post(server.url + CHAT, json=body, timeout=60).json()
    options = {"include_usage": True, "continuous_usage_stats": True}
    r = httpx.post(
        server.url + CHAT, json={**body, "stream": True, "stream_options": options}, timeout=60
    )
    *chunks, usage_chunk, done = sse_events(r.text)
    assert done == "[DONE]" and usage_chunk["choices"] == []
    # include_usage's chunk as before (the prompt now partly cached).
    usage = dict(usage_chunk["usage"])
    assert usage.pop("prompt_tokens_details")["cached_tokens"] >= 0
    final = {k: v for k, v in whole["usage"].items() if k != "prompt_tokens_details"}
    assert usage == final
    prompt = final["prompt_tokens"]
    assert chunks[0]["usage"] == {"prompt_tokens": prompt, "completion_tokens": 0,
                                  "total_tokens": prompt}  # fmt: skip
    seen, text = 0, ""
    for chunk in chunks[1:-1]:
        (choice,) = chunk["choices"]
        seen += len(choice["logprobs"]["content"])
        text += choice["delta"]["content"]
        assert chunk["usage"] == {"prompt_tokens": prompt, "completion_tokens": seen,
                                  "total_tokens": prompt + seen}  # fmt: skip
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == final and seen == final["completion_tokens"] == 24
    # The SDK reads it; without include_usage there is no usage chunk, only the counts.
    stream = client.chat.completions.create(
        model="tiny-llama.gguf",
        messages=body["messages"],
        max_tokens=24,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "stream_options": {"continuous_usage_stats": True}},
    )
    counts = [c.usage.completion_tokens for c in stream]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 24


def test_continuous_usage_on_completions_and_its_bad_values(server):
    body = {"prompt": "The capital of France is", "max_tokens": 10, "ignore_eos": True}
    whole = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    r = httpx.post(
        server.url + "/v1/completions",
        json={**body, "stream": True, "stream_options": {"continuous_usage_stats": True}},
        timeout=60,
    )
    *chunks, done = sse_events(r.text)
    assert done == "[DONE]" and all(c["choices"] for c in chunks)  # no usage chunk asked for
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == whole["usage"]["completion_tokens"] == 10
    assert chunks[-1]["usage"] == whole["usage"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    for route, extra in ((CHAT, chat_body()), ("/v1/completions", {"prompt": "Hi"})):
        bad = {**extra, "stream": True, "stream_options": {"continuous_usage_stats": "yes"}}
        r = httpx.post(server.url + route, json=bad, timeout=60)
        assert r.status_code == 400
        assert "continuous_usage_stats" in r.json()["error"]["message"]


def test_stop_string_cuts_the_text(server):
    base = {"prompt": "Paris is", "max_tokens": 24, "temperature": 0}
    free = httpx.post(server.url + "/v1/completions", json=base, timeout=60).json()
    text = free["choices"][0]["text"]
    if len(text) < 6:
        pytest.skip("the tiny model ended too early to pick a stop string")
    stop = text[3:6]
    cut = httpx.post(server.url + "/v1/completions", json={**base, "stop": [stop]}, timeout=60)
    got = cut.json()["choices"][0]
    assert got["finish_reason"] == "stop"
    assert got["text"] == text[: text.index(stop)]
    # The same through a stream: nothing of the stop string leaks.
    r = httpx.post(
        server.url + "/v1/completions", json={**base, "stop": stop, "stream": True}, timeout=60
    )
    streamed = "".join(e["choices"][0]["text"] for e in sse_events(r.text)[:-1] if e["choices"])
    assert streamed == got["text"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 4.5),
        ("temperature", "hot"),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_k", -2),  # -1 is "off", as vLLM and SGLang send it
        ("min_p", 1.0),
        ("repetition_penalty", 0),
        ("frequency_penalty", 2.5),
        ("presence_penalty", -3),
        ("max_tokens", 0),
        ("max_completion_tokens", 1.5),
        ("n", 9),  # 1-8 (n choices: test_n_choices.py)
        ("n", 0),
        ("logprobs", "yes"),  # a boolean (true returns log-probs: test_logprobs.py)
        ("top_logprobs", 2),
        ("seed", "x"),
        ("stop", ["ok", ""]),
        ("stream", "yes"),
        ("response_format", {"type": "xml"}),  # json_object, json_schema: test_structured.py
        # What a text model here cannot give is refused, not silently left out:
        ("modalities", ["text", "audio"]),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("functions", [{"name": "f", "parameters": {"type": "object"}}]),  # tools, not these
        ("function_call", "auto"),
        ("reasoning_effort", 3),
    ],
)
def test_bad_fields_are_400_naming_the_field(server, field, value):
    r = httpx.post(server.url + CHAT, json=chat_body(**{field: value}), timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert field in error["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [("suffix", " and so on."), ("best_of", 3), ("logprobs", 6)],
)
def test_completions_fields_it_does_not_do_are_400_naming_them(server, field, value):
    body = {"prompt": "Once upon a time", "max_tokens": 2, field: value}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_chat_fields_that_ask_for_nothing_more_are_fine(server):
    quiet = {"functions": [], "function_call": None, "audio": None, "modalities": ["text"]}
    r = httpx.post(server.url + CHAT, json=chat_body(**quiet), timeout=30)
    assert r.status_code == 200, r.text


def test_completions_fields_that_ask_for_nothing_more_are_fine(server):
    quiet = {"echo": False, "suffix": "", "best_of": 2, "n": 2, "modalities": ["text"]}
    body = {"prompt": "Once upon a time", "max_tokens": 2, **quiet}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text


def test_malformed_requests(server):
    url = server.url + CHAT
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(url, json=[1, 2])
    assert r.status_code == 400
    r = httpx.post(url, json={"model": "tiny-llama.gguf"})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.post(url, json={"messages": [{"role": "robot", "content": "hi"}]})
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    r = httpx.post(url, json={"messages": [{"role": "user", "content": [image]}]})
    assert r.status_code == 400 and "text only" in r.json()["error"]["message"]
    r = httpx.post(url, content=b"messages=1", headers={"content-type": "text/plain"})
    assert r.status_code == 415
    r = httpx.post(server.url + "/v1/completions", json={"max_tokens": 3})
    assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]
    r = httpx.get(url)
    assert r.status_code == 405
    r = httpx.post(server.url + "/health", json={})
    assert r.status_code == 405
    r = httpx.get(server.url + "/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()


def test_another_model_is_404_and_absent_model_is_fine(server):
    r = httpx.post(server.url + CHAT, json=chat_body(model="gpt-4o", max_tokens=2))
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
    assert (
        httpx.post(server.url + CHAT, json=chat_body(max_tokens=2), timeout=60).status_code == 200
    )


def test_prompt_longer_than_the_context_is_400(server):
    long = "Paris France capital " * 700
    r = httpx.post(server.url + "/v1/completions", json={"prompt": long, "max_tokens": 2})
    assert r.status_code == 400
    assert "context" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


async def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch(server):
    seeded = chat_body("Write about France.", temperature=1.0, top_p=0.95, seed=1234, max_tokens=24)
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
        alone = (await http.post(CHAT, json=seeded)).json()["choices"][0]["message"]["content"]
        results = {}

        async def one(name, body):
            r = await http.post(CHAT, json=body)
            results[name] = r.json()["choices"][0]["message"]["content"]

        async with trio.open_nursery() as nursery:
            for i in range(3):
                other = chat_body(f"Noise {i} capital", temperature=1.0, seed=i, max_tokens=30)
                nursery.start_soon(one, f"other{i}", other)
            await trio.sleep(0.05)
            nursery.start_soon(one, "seeded", seeded)
        assert results["seeded"] == alone
        # And a different seed gives another answer.
        other_seed = (await http.post(CHAT, json={**seeded, "seed": 99})).json()
        assert other_seed["choices"][0]["message"]["content"] != alone


async def test_concurrent_streams_all_progress(server):
    """A late request's first token does not wait for the running ones to finish, and the
    running one goes on meanwhile. The first stream is long (cancelled once the late one is
    done) so that a fast engine cannot finish it before the late one is even admitted; the
    late one runs several decode bursts (up to 8 runs each), so that the first one's events
    from them are read before it ends (with 8 tokens, one burst ended it, and the first
    stream's event from that burst could still be unread when the test cancelled it)."""
    long = chat_body(
        "Tell a long story.",
        max_tokens=900,
        ignore_eos=True,
        temperature=1.0,
        seed=3,
        presence_penalty=1.5,
        stream=True,
    )
    events = []

    async def stream(name, body):
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            async with http.stream("POST", CHAT, json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and '"content"' in line:
                        events.append((name, trio.current_time()))
        events.append((f"{name} finished", trio.current_time()))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream, "first", long)
        while not any(name == "first" for name, _ in events):
            await trio.sleep(0.01)
        await stream("late", {**long, "max_tokens": 64, "seed": 4})
        nursery.cancel_scope.cancel()
    late_first = min(t for name, t in events if name == "late")
    assert "first finished" not in [name for name, _ in events]  # still running at the end
    assert any(name == "first" and t > late_first for name, t in events)


def test_default_max_tokens_runs_to_the_end_of_the_context(server):
    r = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "Paris", "ignore_eos": True, "some_future_field": {"x": 1}},
        timeout=120,
    ).json()
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] == 1024


def test_request_log_line_carries_the_session_tag(server):
    httpx.post(
        server.url + CHAT, json=chat_body(max_tokens=2, prompt_cache_key="sess-a1"), timeout=60
    )
    httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "Hi", "max_tokens": 2},
        headers={"X-Session-Id": "sess-b2"},
        timeout=60,
    )
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        lines = [line for line in server.lines if "session=sess-" in line]
        if len(lines) >= 2:
            break
        time.sleep(0.05)
    chat_line = next(line for line in lines if "session=sess-a1" in line)
    assert "/v1/chat/completions 200" in chat_line and "generated=" in chat_line
    assert "queue=" in chat_line and "finish=" in chat_line
    assert any("/v1/completions 200" in line and "session=sess-b2" in line for line in lines)


def test_head_is_the_ready_check_on_every_path(server):
    """Seed 000: "200 when ready, 503 while loading, no body. The server answers HEAD the
    same way on every path" (POST routes and unknown paths included)."""
    for path in ("/health", "/", "/v1/models", "/v1/chat/completions", "/v1/messages", "/nope"):
        r = httpx.head(server.url + path)
        assert r.status_code == 200 and r.content == b"", path


def test_every_route_says_what_a_seeded_answer_repeats_under(server):
    """system_fingerprint is `seed-N-fp_X`: the seed used (a random one echoed) and this
    deployment's answers id; the same on every route; the echoed seed repeats the answer."""
    ask = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 1.0}
    first = httpx.post(server.url + CHAT, json=ask, timeout=60).json()  # no seed: a random one
    fingerprint = first["system_fingerprint"]
    m = re.fullmatch(r"seed-(\d+)-(fp_[0-9a-f]{12})", fingerprint)
    assert m, fingerprint
    seed, deployment = int(m.group(1)), m.group(2)
    again = httpx.post(server.url + CHAT, json={**ask, "seed": seed}, timeout=60).json()
    assert again["system_fingerprint"] == fingerprint
    assert again["choices"][0]["message"] == first["choices"][0]["message"]
    seeded = {"seed": 11, "max_tokens": 4}
    others = [
        httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", **seeded}, timeout=60),
        httpx.post(
            server.url + "/v1/messages",
            json={"model": "any", "messages": [{"role": "user", "content": "Hi"}], **seeded},
            timeout=60,
        ),
        httpx.post(server.url + "/v1/responses", json={"input": "Hi", **seeded}, timeout=60),
    ]
    for r in others:
        assert r.json()["system_fingerprint"] == f"seed-11-{deployment}", r.text


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT, {"messages": [{"role": "user", "content": "Hi"}]}),
        ("/v1/completions", {"prompt": "Hi"}),
        ("/v1/messages", {"model": "any", "messages": [{"role": "user", "content": "Hi"}]}),
        ("/v1/responses", {"input": "Hi"}),
    ],
)
def test_a_seed_is_a_signed_64_bit_integer(server, path, body):
    """Seeds past 64 bits would share their low 64 with another's answer, and a negative one
    a positive one's: both ends of int64 are answered (and echoed), one past either is a 400
    in the route's shape naming `seed`, as OpenAI's and vLLM's bounds."""
    for seed in (-(2**63), 2**63 - 1):
        r = httpx.post(server.url + path, json={**body, "seed": seed, "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["system_fingerprint"].startswith(f"seed-{seed}-")
    for seed in (-(2**63) - 1, 2**63, 2**70):
        r = httpx.post(server.url + path, json={**body, "seed": seed, "max_tokens": 2}, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert "seed must be" in error["message"]
        if path != "/v1/messages":  # Anthropic's errors have no param
            assert error["param"] == "seed"


def test_sampling_parameters_past_float32s_range_are_answered(server):
    """Fuzzing's find (schemathesis, seed 4747): a temperature of ~1e-309 and a repetition
    penalty of ~1e308, both in the contract's ranges, made the sampler raise in the engine
    process; the stream ended in an error event and the engine restarted, stalling every
    other request. Now an answer, greedy (the limit of such a temperature), and no restart."""
    before = httpx.get(server.url + "/health").json()["worker_restarts"]
    body = {
        "prompt": "Tell me about Paris.",
        "max_tokens": 8,
        "stream": True,
        "logprobs": 3,
        "seed": -3328051,
        "temperature": 2.225073858507203e-309,
        "frequency_penalty": 1.3982782918118994,
        "repetition_penalty": 8.481399510011722e307,
    }
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), r.text
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
    assert httpx.get(server.url + "/health").json()["worker_restarts"] == before


def _logprob_checks(lp: dict, top_n: int, greedy: bool) -> None:
    """Each token's entry: its text among its top list (at most top_n others), the top
    list a distribution's slice, the sampled token the likeliest at greedy."""
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
    entries = zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True)
    for token, value, top in entries:
        assert top[token] == value and value <= 0
        assert len(top) <= top_n + 1
        assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-6
        if greedy:
            assert value == max(top.values())


def test_completions_log_probabilities_whole_and_streamed(server):
    body = {"prompt": "The capital of France is", "max_tokens": 8, "logprobs": 3}
    whole = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    choice = whole["choices"][0]
    lp = choice["logprobs"]
    _logprob_checks(lp, 3, greedy=True)
    assert len(lp["tokens"]) == whole["usage"]["completion_tokens"] or choice["finish_reason"]
    if "\ufffd" not in "".join(lp["tokens"]):  # no token is a piece of a character
        assert "".join(lp["tokens"]) == choice["text"]
        assert lp["text_offset"] == [
            len("".join(lp["tokens"][:i])) for i in range(len(lp["tokens"]))
        ]
    r = httpx.post(server.url + "/v1/completions", json={**body, "stream": True}, timeout=60)
    chunks = [e for e in sse_events(r.text) if e != "[DONE]" and e["choices"]]
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0].get("logprobs")]
    assert [t for part in streamed for t in part["tokens"]] == lp["tokens"]
    # (The second asking reads its prompt from the cache: the same values to float32's noise.)
    values = [v for part in streamed for v in part["token_logprobs"]]
    assert values == pytest.approx(lp["token_logprobs"], abs=1e-4)
    assert [o for part in streamed for o in part["text_offset"]] == lp["text_offset"]
    sampled = httpx.post(
        server.url + "/v1/completions",
        json={**body, "logprobs": 0, "temperature": 1.0, "seed": 3},
        timeout=60,
    ).json()
    _logprob_checks(sampled["choices"][0]["logprobs"], 0, greedy=False)
    plain = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert "logprobs" not in plain.json()["choices"][0]  # asked for by nobody: not there


@pytest.mark.parametrize("value", [6, -1, True, 1.5, "2"])
def test_completions_logprobs_out_of_range_is_400(server, value):
    body = {"prompt": "x", "max_tokens": 2, "logprobs": value}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and "logprobs" in r.json()["error"]["message"]
