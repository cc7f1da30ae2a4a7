"""Each protocol's stream encoder alone (no server, no engine): parsed answer items in, that
protocol's events out, in the order and shape its clients read."""

from __future__ import annotations

import json

import trio

from mashbox.events import Finished, TextDelta, Timings, Usage
from mashbox.server.anthropic_api import MessagesEncoder
from mashbox.server.chat import ChatPrompt, Ping, parsed
from mashbox.server.openai_chat import ChatEncoder
from mashbox.server.openai_completions import CompletionEncoder
from mashbox.server.responses_api import ResponsesEncoder
from mashbox.server.responses_input import Toolbox
from mashbox.text.parser import Content, Reasoning, ToolCall

TIMINGS = Timings(5, 1.0, 5000.0, 3, 2.0, 1000.0, 2, 0.5)
CALL = ToolCall("get_weather", '{"city": "Paris"}', raw='{"city": "Paris"}')


def done(reason="stop", reasoning_tokens=0) -> Finished:
    return Finished(reason, Usage(7, 3, 2), TIMINGS, reasoning_tokens=reasoning_tokens)


def run(encoder, items, end, cached=None) -> list:
    """The encoder's frames for a whole stream, as (event name, JSON value)."""
    frames = encoder.start(cached)
    for item in items:
        frames += encoder.feed(item)
    frames += end(encoder)
    return [(f.name, json.loads(f.json) if f.json != b"[DONE]" else "[DONE]") for f in frames]


def test_openai_chat_chunks():
    encoder = ChatEncoder("m", "seed-3-fp_abc", usage_chunk=True)
    items = [Reasoning("hm"), Content("Hi"), Content(" there"), CALL, CALL]
    out = [value for _, value in run(encoder, items, lambda e: e.finish(done()))]
    deltas = [o["choices"][0]["delta"] for o in out[:-2]]
    assert deltas[:4] == [
        {"role": "assistant", "content": ""},
        {"reasoning_content": "hm"},
        {"content": "Hi"},
        {"content": " there"},
    ]
    assert [d["tool_calls"][0]["index"] for d in deltas[4:6]] == [0, 1]
    assert deltas[4]["tool_calls"][0]["function"] == {
        "name": CALL.name,
        "arguments": CALL.arguments,
    }
    assert out[-3]["choices"][0]["finish_reason"] == "tool_calls"  # it called tools
    assert out[-2]["choices"] == [] and out[-2]["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 2
    }
    assert out[-1] == "[DONE]"
    assert {o["id"] for o in out[:-1]} == {encoder.rid}
    assert all(o["system_fingerprint"] == "seed-3-fp_abc" for o in out[:-2])


def test_openai_chat_failure_is_one_error_chunk():
    encoder = ChatEncoder("m", "seed-0", usage_chunk=False)
    out = run(encoder, [Content("a")], lambda e: e.fail("boom", 500))
    assert out[-1][1] == {
        "error": {"message": "boom", "type": "server_error", "request_id": encoder.rid}
    }


def test_completions_events():
    encoder = CompletionEncoder("m", "seed-1", usage_chunk=False)
    out = [
        v for _, v in run(encoder, [Content("a"), Content("b")], lambda e: e.finish(done("length")))
    ]
    assert [o["choices"][0]["text"] for o in out[:2]] == ["a", "b"]
    assert out[2]["choices"][0]["finish_reason"] == "length" and out[3] == "[DONE]"


def test_anthropic_blocks_open_and_close_in_order():
    encoder = MessagesEncoder("claude-x", prompt_tokens=7)
    items = [Ping(), Reasoning("think"), Content("Hi"), CALL, Content("\n")]
    out = run(encoder, items, lambda e: e.finish(done()), cached=2)
    names = [name for name, _ in out]
    assert names == [
        "message_start", "ping", "ping",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]  # fmt: skip
    assert all(name == value["type"] for name, value in out)
    usage = out[0][1]["message"]["usage"]
    assert (usage["input_tokens"], usage["cache_read_input_tokens"]) == (5, 2)  # uncached only
    starts = [v for n, v in out if n == "content_block_start"]
    assert [s["index"] for s in starts] == [0, 1, 2]
    assert [s["content_block"]["type"] for s in starts] == ["thinking", "text", "tool_use"]
    deltas = [v["delta"] for n, v in out if n == "content_block_delta"]
    assert deltas[0] == {"type": "thinking_delta", "thinking": "think"}
    assert deltas[1]["type"] == "signature_delta"  # a thinking block closes with its signature
    assert deltas[2] == {"type": "text_delta", "text": "Hi"}
    assert json.loads(deltas[3]["partial_json"]) == {"city": "Paris"}
    assert out[-2][1]["delta"]["stop_reason"] == "tool_use"  # the whitespace after it is dropped


def test_anthropic_failure_names_overload():
    encoder = MessagesEncoder("m", prompt_tokens=1)
    ((name, value),) = [(f.name, json.loads(f.json)) for f in encoder.fail("busy", 503)]
    assert name == "error" and value["error"] == {"type": "overloaded_error", "message": "busy"}


def test_responses_items_and_numbering():
    toolbox = Toolbox([{"type": "function", "name": "get_weather", "parameters": {}}])
    shell = {"id": "resp_1", "object": "response", "status": "in_progress", "output": []}
    encoder = ResponsesEncoder(shell, toolbox)
    items = [Reasoning("r"), Content(" "), Content("Hi"), CALL]
    out = run(encoder, items, lambda e: e.finish(done(reasoning_tokens=4)))
    assert [v["sequence_number"] for _, v in out] == list(range(1, len(out) + 1))
    assert all(name == value["type"] for name, value in out)
    final = out[-1][1]["response"]
    assert out[-1][0] == "response.completed"
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][1]["content"][0]["text"] == "Hi"  # whitespace between items is dropped
    assert final["usage"]["output_tokens_details"] == {"reasoning_tokens": 4}
    added = [v["item"]["type"] for n, v in out if n == "response.output_item.added"]
    assert added == ["reasoning", "message", "function_call"]


def test_responses_failure_is_error_then_response_failed():
    encoder = ResponsesEncoder({"id": "resp_2", "status": "in_progress", "output": []}, Toolbox([]))
    out = run(encoder, [Content("partial")], lambda e: e.fail("lost", 500))
    names = [n for n, _ in out]
    assert names[-2:] == ["error", "response.failed"]
    assert out[-1][1]["response"]["status"] == "failed"
    assert out[-1][1]["response"]["output"][0]["content"][0]["text"] == "partial"


async def _read_answer(deltas: list) -> tuple[list, int]:
    """`chat.parsed` over these TextDeltas, then a Finished: its items and reasoning count."""
    send, receive = trio.open_memory_channel(len(deltas) + 1)
    for delta in deltas:
        send.send_nowait(delta)
    send.send_nowait(done())
    send.close()
    prompt = ChatPrompt("", reasoning=True, in_reasoning=False, tools_offered=False,
                        forced_prefix=None)  # fmt: skip
    items = [item async for item in parsed(receive, prompt)]
    assert isinstance(items[-1], Finished) and all(isinstance(d, TextDelta) for d in deltas)
    return items[:-1], items[-1].reasoning_tokens


async def test_a_grown_delta_reads_as_its_pieces_did_with_the_same_reasoning_count():
    """Deltas the route had not taken are grown into one (`Batch._emit`, a repeated step's
    runs): read, they give the same reasoning and content as the pieces one by one, the
    same count of reasoning tokens, and one item of each kind, not one a piece."""
    pieces = ["<think>", "Paris", " is", " sunny", "</think>", "It", " is", " sunny."]
    one_by_one = [TextDelta(p) for p in pieces]
    grown = TextDelta("".join(pieces), len(pieces), parts=tuple((len(p), 1) for p in pieces))
    alone, alone_count = await _read_answer(one_by_one)
    items, count = await _read_answer([grown])
    assert count == alone_count == 5  # the think tags count with the reasoning
    assert items == [Reasoning("Paris is sunny"), Content("It is sunny.")]
    assert "".join(i.text for i in alone if isinstance(i, Content)) == "It is sunny."
