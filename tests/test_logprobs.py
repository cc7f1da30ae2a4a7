"""Chat and Responses log probabilities through a real server and the official `openai` SDK:
OpenAI's shape whole and streamed, only content tokens in it (never reasoning or tool-call
markup), the sampled token first in its top list at greedy, and the 400s."""

from __future__ import annotations

import codecs
import itertools
import json
import math

import httpx
import openai
import pytest

from mashbox.events import TextDelta, TokenLogprob
from mashbox.server.token_logprobs import ItemTokens, Logprobs
from mashbox.text.parser import Content, InvalidToolCall, OutputParser, ToolCall
from support import trained
from support.responses_events import check_sequence

MODEL = "tiny-llama.gguf"
HI = [{"role": "user", "content": "Tell me about Paris."}]
INCLUDE = ["message.output_text.logprobs"]


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture
def taught(trained_url):
    """A client of the model trained to think, then greet (tests/support/trained.py)."""
    return openai.OpenAI(base_url=trained_url + "/v1", api_key="x", max_retries=0)


def spelled(entries) -> str:
    """The text the entries' tokens' bytes make (U+FFFD for a broken character, as the
    server's detokenizer writes it)."""
    return b"".join(bytes(e.bytes) for e in entries).decode("utf-8", errors="replace")


def check_entries(entries, top_n: int, greedy: bool) -> None:
    """Each entry: its text its bytes', a log-prob; its top list a distribution's slice of
    top_n, likeliest first, led by the sampled token at greedy."""
    for e in entries:
        assert e.token == bytes(e.bytes).decode("utf-8", errors="replace")
        assert e.logprob <= 0
        assert len(e.top_logprobs) == top_n
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert sum(math.exp(v) for v in values) <= 1 + 1e-6
        for t in e.top_logprobs:
            assert t.token == bytes(t.bytes).decode("utf-8", errors="replace")
        if greedy and top_n:
            assert (e.top_logprobs[0].token, e.top_logprobs[0].logprob) == (e.token, e.logprob)


def same_entries(a, b) -> None:
    """The same tokens with the same values (to float32's noise: the second asking reads its
    prompt from the cache)."""
    assert [(e.token, e.bytes) for e in a] == [(e.token, e.bytes) for e in b]
    assert [e.logprob for e in a] == pytest.approx([e.logprob for e in b], abs=1e-4)
    tops = [[(t.token, t.logprob) for t in e.top_logprobs] for e in a]
    assert [[t.token for t in e.top_logprobs] for e in b] == [[t for t, _ in x] for x in tops]


# --- which item a token belongs to ----------------------------------------------------------

EURO = "\u20ac".encode()
PIECES = [
    b"<think>", b"\n", b"Hmm", b" ok", b"\n", b"</think>", b"\n\n", b"Hel", b"lo", b" w",
    EURO[:2], b"<tool_call>", b'\n{"name": "f", "arguments": {}}\n', b"</tool_call>",
    EURO[2:] + b"!", EURO[:1], EURO[1:] + b"?", b"<tool_call>", b"{oops", b"</tool_call>",
]  # fmt: skip
CONTENT_TOKENS = [7, 8, 9, 10, 14, 15, 16, 17, 18, 19]


def placed(cuts: tuple[int, ...]) -> list:
    """Items and Logprobs for PIECES as token ids 0..n, the scheduler's deltas ending after
    the tokens at `cuts` (a delta waits for text, as the detokenizer's do)."""
    parser = OutputParser(reasoning=True, tools=True)
    tokens = ItemTokens(PIECES.__getitem__, parser.fed)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out, text, unsent = [], "", []
    for token, piece in enumerate(PIECES):
        text += decoder.decode(piece)
        unsent.append(TokenLogprob(token, -1.0))
        if text and (token in cuts or token == len(PIECES) - 1):
            tokens.add(TextDelta(text, len(unsent), tuple(unsent)))
            out += tokens.place(parser.feed(text))
            text, unsent = "", []
    return out + tokens.place(parser.finish())


def test_each_parsed_item_says_where_its_text_is():
    text = '<think>\n a\n</think>\n\n b <tool_call>{"name": "f"}</tool_call> c<tool_call>{x'
    for cut in range(len(text) + 1):
        parser = OutputParser(reasoning=True, tools=True)
        items = [*parser.feed(text[:cut]), *parser.feed(text[cut:]), *parser.finish()]
        assert [type(i).__name__ for i in items if i.start is None] == []
        for item in items:
            shown = item.raw if isinstance(item, ToolCall) else item.text
            assert text[item.start : item.start + len(shown)] == shown


def test_a_token_belongs_to_the_item_holding_its_first_held_character():
    """However the text is cut into deltas: think tags, reasoning, the blank line after it and
    a parsed call's markup in no content; a piece of a character with its character; markup
    that did not parse is content, so its tokens are; each Logprobs just before its item."""
    ends = range(len(PIECES))
    every = [(), *itertools.combinations(ends, 1), *itertools.combinations(ends, 3), ends]
    for cuts in every:
        out = placed(cuts)
        content = [e.token for item in out if isinstance(item, Logprobs) for e in item.entries]
        assert content == CONTENT_TOKENS, cuts
        for item, after in itertools.pairwise(out):
            if isinstance(item, Logprobs):
                assert isinstance(after, Content | InvalidToolCall), cuts


# --- chat ----------------------------------------------------------------------------------


def test_chat_whole_and_streamed(client):
    ask = dict(model=MODEL, messages=HI, max_tokens=12, seed=5, logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**ask)
    choice = whole.choices[0]
    entries = choice.logprobs.content
    assert choice.logprobs.refusal is None
    check_entries(entries, 3, greedy=True)
    assert spelled(entries) == choice.message.content
    if "\ufffd" not in choice.message.content:
        assert "".join(e.token for e in entries) == choice.message.content
    ended_by_eos = choice.finish_reason == "stop"  # the end of turn has no entry
    assert len(entries) == whole.usage.completion_tokens - ended_by_eos

    chunks = list(client.chat.completions.create(**ask, stream=True))
    streamed = []
    for chunk in chunks:
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        if c.delta.content:  # each content chunk carries the entries of its own tokens
            part = c.logprobs.content
            if "\ufffd" not in spelled(part) + c.delta.content:
                assert "".join(e.token for e in part) == c.delta.content
            streamed += part
        else:
            assert c.logprobs is None
    same_entries(streamed, entries)


def test_chat_sampled_and_without_top(client):
    ask = dict(model=MODEL, messages=HI, max_tokens=10, temperature=1.0, seed=3, logprobs=True)
    r = client.chat.completions.create(**ask)
    entries = r.choices[0].logprobs.content
    check_entries(entries, 0, greedy=False)  # logprobs alone: empty top lists
    assert spelled(entries) == r.choices[0].message.content
    plain = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3)
    assert plain.choices[0].logprobs is None  # asked for by nobody: not there
    raw = httpx.post(
        str(client.base_url) + "chat/completions",
        json={"messages": HI, "max_tokens": 3, "logprobs": False},
        timeout=60,
    ).json()
    assert "logprobs" not in raw["choices"][0]


def test_chat_reasoning_tokens_are_not_content(taught):
    ask = dict(
        model="trained.gguf", messages=[{"role": "user", "content": "Good evening!"}],
        max_tokens=60, logprobs=True, top_logprobs=2,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )  # fmt: skip
    whole = taught.chat.completions.create(**ask)
    message = whole.choices[0].message
    assert message.content == trained.GREETING
    assert message.model_extra["reasoning_content"] == "A greeting."
    entries = whole.choices[0].logprobs.content
    check_entries(entries, 2, greedy=True)
    # The think block's tokens and the blank line after it belong to no content.
    assert "".join(e.token for e in entries) == trained.GREETING
    stream = taught.chat.completions.create(**ask, stream=True)
    streamed = []
    for chunk in stream:
        c = chunk.choices[0] if chunk.choices else None
        if c is not None and c.delta.model_extra.get("reasoning_content"):
            assert c.logprobs is None
        if c is not None and c.delta.content:
            streamed += c.logprobs.content
    same_entries(streamed, entries)


def test_chat_tool_call_markup_is_not_content(taught):
    r = taught.chat.completions.create(
        model="trained.gguf", messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[trained.WEATHER_TOOL], max_tokens=80, logprobs=True,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    choice = r.choices[0]
    (call,) = choice.message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert choice.message.content is None and choice.logprobs.content == []


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true, as at OpenAI
        ({"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
        ({"logprobs": "yes"}, "logprobs"),
    ],
)
def test_chat_bad_logprobs_are_400(server, fields, named):
    body = {"messages": HI, "max_tokens": 2, **fields}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert named in r.json()["error"]["message"]


def test_twenty_alternatives_are_the_most(client):
    r = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=2, logprobs=True, top_logprobs=20
    )
    check_entries(r.choices[0].logprobs.content, 20, greedy=True)


# --- Responses -----------------------------------------------------------------------------


def test_responses_whole_and_streamed_with_include(client):
    ask = dict(model=MODEL, input="Tell me about Paris", max_output_tokens=12, top_logprobs=2)
    whole = client.responses.create(**ask, include=INCLUDE)
    (message,) = whole.output
    part = message.content[0]
    check_entries(part.logprobs, 2, greedy=True)
    assert spelled(part.logprobs) == part.text
    events = list(client.responses.create(**ask, include=INCLUDE, stream=True))
    check_sequence(events)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == part.text
    streamed = [e for d in deltas for e in d.logprobs]
    raw = [e for e in events if e.type == "response.output_text.done"][0].logprobs
    final = events[-1].response.output[0].content[0].logprobs
    same_entries(streamed, part.logprobs)
    assert [e.token for e in raw] == [e.token for e in final] == [e.token for e in streamed]


def test_responses_without_include_have_no_logprobs(server):
    url = server.url + "/v1/responses"
    for extra in ({}, {"top_logprobs": 3}):  # top_logprobs alone: still nothing
        body = {"input": "Tell me about Paris", "max_output_tokens": 6, **extra}
        whole = httpx.post(url, json=body, timeout=60).json()
        assert "logprobs" not in whole["output"][0]["content"][0]
        streamed = httpx.post(url, json={**body, "stream": True}, timeout=60).text
        assert '"logprobs"' not in streamed


def test_responses_reasoning_tokens_are_not_in_the_message(taught):
    r = taught.responses.create(
        model="trained.gguf", input="Good evening!", max_output_tokens=60,
        reasoning={"effort": "medium"}, include=INCLUDE,
    )  # fmt: skip
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and message.content[0].text == trained.GREETING
    entries = message.content[0].logprobs
    check_entries(entries, 0, greedy=True)
    assert "".join(e.token for e in entries) == trained.GREETING


def test_responses_top_logprobs_past_twenty_is_400(server):
    body = {"input": "x", "include": INCLUDE, "top_logprobs": 21}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400 and "top_logprobs" in r.json()["error"]["message"]
