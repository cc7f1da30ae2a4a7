"""Anthropic Messages and count_tokens through the official `anthropic` SDK (tiny Llama)."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from support.serverproc import ServerProcess

MODEL = "mashbox-any-name"  # any name is accepted and echoed


@pytest.fixture
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="any-key", max_retries=0)


def test_create(client):
    m = client.messages.create(
        model=MODEL, max_tokens=12, messages=[{"role": "user", "content": "Hello"}]
    )
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.model == MODEL
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert all(block.type == "text" for block in m.content)
    assert m.usage.output_tokens <= 12
    assert m.usage.cache_creation_input_tokens == 0


def test_max_tokens_is_optional_and_reached(client, server):
    m = client.messages.create(
        model=MODEL,
        max_tokens=3,
        messages=[{"role": "user", "content": "count"}],
        extra_body={"ignore_eos": True},
    )
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3
    r = httpx.post(
        server.url + "/v1/messages",
        json={"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2,
              "max_tokens": 9, "ignore_eos": True},
    ).json()  # fmt: skip
    assert r["usage"]["output_tokens"] == 2


def test_stream_matches_create(client):
    kwargs = dict(model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "Paris"}])
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "".join(b.text for b in whole.content)
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stream_event_order(server):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": True}
    r = httpx.post(server.url + "/v1/messages?beta=true", json=body,
                   headers={"anthropic-version": "2023-06-01", "anthropic-beta": "x"})  # fmt: skip
    names = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]
    body_events = [n for n in names[2:-2] if n != "ping"]
    if body_events:
        assert body_events[0] == "content_block_start" and body_events[-1] == "content_block_stop"


def test_stop_sequence(client, server):
    base = dict(model=MODEL, max_tokens=24, messages=[{"role": "user", "content": "Paris is"}])
    text = "".join(b.text for b in client.messages.create(**base).content)
    if len(text) < 6:
        pytest.skip("the tiny model ended too early to pick a stop sequence")
    stop = text[3:6]
    m = client.messages.create(**base, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert "".join(b.text for b in m.content) == text[: text.index(stop)]


def test_count_tokens_equals_what_the_engine_sees(client):
    kwargs = dict(
        model=MODEL,
        system="You are terse.",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        tools=[
            {"name": "get_weather", "description": "Weather", "input_schema": {"type": "object"}}
        ],
    )
    counted = client.messages.count_tokens(**kwargs).input_tokens
    m = client.messages.create(max_tokens=2, **kwargs)
    assert counted == m.usage.input_tokens + m.usage.cache_read_input_tokens
    bare = client.messages.count_tokens(model=MODEL, messages=kwargs["messages"]).input_tokens
    assert bare < counted  # the system prompt and the tool listing are counted


def test_history_with_tool_use_and_results(client):
    m = client.messages.create(
        model=MODEL,
        max_tokens=4,
        tools=[{"name": "get_weather", "input_schema": {"type": "object"}}],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Call it.", "signature": "mashbox-local"},
                    {"type": "text", "text": "Let me check."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                     "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                     "content": [{"type": "text", "text": "timeout"}]},
                    {"type": "text", "text": "Thanks"},
                ],
            },
        ],
    )  # fmt: skip
    assert m.usage.input_tokens > 0


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
        ({"messages": [{"role": "user", "content": "x"}],
          "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search"),
        ({"messages": [{"role": "user", "content": "x"}],
          "output_config": {"format": {"type": "json_schema"}}}, "output_config.format"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 9}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "maybe"}},
         "thinking"),
        ({"messages": [{"role": "user", "content": "x"}],
          "tool_choice": {"type": "tool", "name": "absent"}}, "absent"),
        ({"messages": [{"role": "user", "content": "x"}],  # tools that run at Anthropic
          "mcp_servers": [{"type": "url", "url": "https://x.example", "name": "x"}]},
         "mcp_servers"),
    ],
)  # fmt: skip
def test_bad_requests_get_anthropic_errors(server, body, needle):
    r = httpx.post(server.url + "/v1/messages", json=body)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"
    assert needle in error["error"]["message"]


def test_sdk_raises_typed_errors(client):
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(
            model=MODEL,
            max_tokens=5,
            messages=[{"role": "user", "content": "x"}],
            extra_body={"temperature": 7},
        )


def test_protocol_errors_use_the_anthropic_shape(server):
    r = httpx.get(server.url + "/v1/messages")
    assert r.status_code == 405 and r.json()["type"] == "error"
    r = httpx.post(
        server.url + "/v1/messages", content=b"{", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/v1/messages/count_tokens", json={"messages": "no"})
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_key_in_either_header_is_accepted(server):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    for headers in ({"x-api-key": "k"}, {"authorization": "Bearer k"}):
        assert (
            httpx.post(server.url + "/v1/messages", json=body, headers=headers).status_code == 200
        )


def test_pings_keep_a_silent_stream_alive(tiny_llama):
    """A long prefill is silent: the stream sends pings meanwhile (every 0.2 s here)."""
    proc = ServerProcess(
        str(tiny_llama), "--ctx", "2048", "--prefill-chunk", "8",
        env={"MASHBOX_FAULTS": "slow=0.05", "MASHBOX_PING_SECONDS": "0.2"},
    )  # fmt: skip
    try:
        url = proc.wait_ready(120)
        body = {"messages": [{"role": "user", "content": "Paris is lovely. " * 60}],
                "max_tokens": 2, "stream": True}  # fmt: skip
        r = httpx.post(url + "/v1/messages", json=body, timeout=120)
        names = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
        first_block = names.index("content_block_start") if "content_block_start" in names else -1
        before = names[:first_block] if first_block >= 0 else names
        assert before[:2] == ["message_start", "ping"]
        assert before.count("ping") >= 3  # ~40 chunks of 50 ms: pings during the prefill
        assert names[-1] == "message_stop"
    finally:
        proc.stop()


def test_text_documents_are_read_and_thinking_and_unknown_blocks_ignored(server):
    """Seed 001: "Input thinking/redacted_thinking blocks and unknown block types are
    ignored"; a document block whose source is text is read ("not PDFs")."""

    def count(content) -> httpx.Response:
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
        return httpx.post(server.url + "/v1/messages/count_tokens", json=body)

    plain = count([{"type": "text", "text": "Summarize this."}]).json()["input_tokens"]
    document = {"type": "document", "source": {"type": "text", "data": "A long memo " * 20}}
    extra = [
        {"type": "thinking", "thinking": "hmm", "signature": ""},
        {"type": "redacted_thinking", "data": "x"},
        {"type": "some_future_block", "x": 1},
    ]
    with_doc = count([document, {"type": "text", "text": "Summarize this."}, *extra])
    assert with_doc.status_code == 200, with_doc.text
    assert with_doc.json()["input_tokens"] > plain + 20
    ignored = count([{"type": "text", "text": "Summarize this."}, *extra])
    assert ignored.json()["input_tokens"] == plain
    pdf_source = {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}
    pdf = {"type": "document", "source": pdf_source}
    r = count([pdf])
    assert r.status_code == 400 and "document" in r.json()["error"]["message"]
    history = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Hello"}, {"type": "some_future_block"}],
        },
        {"role": "user", "content": "again"},
    ]
    r = httpx.post(
        server.url + "/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": history}
    )
    assert r.status_code == 200, r.text


def test_message_start_counts_only_the_uncached_prompt(server):
    """Seed 000: input_tokens is the part of the prompt not served from cache, and
    message_start says so on a cache hit, as the final usage does."""
    history = "The ship left the harbour at dawn and sailed north for many days. " * 8
    body = {"model": MODEL, "max_tokens": 2, "stream": True,
            "messages": [{"role": "user", "content": history}]}  # fmt: skip

    def starts_and_final() -> tuple[dict, dict]:
        r = httpx.post(server.url + "/v1/messages", json=body, timeout=60)
        data = [json.loads(x.split("data: ", 1)[1]) for x in r.text.split("\n\n") if "data: " in x]
        start = next(d for d in data if d["type"] == "message_start")["message"]["usage"]
        final = next(d for d in data if d["type"] == "message_delta")["usage"]
        return start, final

    starts_and_final()  # the prompt is now in a slot
    start, final = starts_and_final()
    assert start["cache_read_input_tokens"] > 0
    assert start["input_tokens"] == final["input_tokens"]
    assert start["cache_read_input_tokens"] == final["cache_read_input_tokens"]
