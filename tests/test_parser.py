"""OutputParser: model text becomes the same events however it is split into feed() calls."""

from __future__ import annotations

import itertools
import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mashbox.text.parser import (
    Content,
    InvalidToolCall,
    OutputParser,
    Reasoning,
    ToolCall,
    call_from_json,
    merge,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
PARIS = ToolCall("get_weather", '{"city": "Paris"}', f"\n{WEATHER}\n")


def parse(chunks: list[str], **options: bool) -> list:
    """Feed chunks in order, then finish; return the merged events."""
    parser = OutputParser(**options)
    events = []
    for chunk in chunks:
        events += parser.feed(chunk)
    return merge(events + parser.finish())


def splits(text: str, parts: int) -> list[list[str]]:
    """Every way to cut text into `parts` pieces (pieces may be empty)."""
    result = []
    for cuts in itertools.combinations_with_replacement(range(len(text) + 1), parts - 1):
        bounds = (0, *cuts, len(text))
        result.append([text[a:b] for a, b in itertools.pairwise(bounds)])
    return result


def test_plain_content():
    assert parse(["Hello, world.\n"]) == [Content("Hello, world.\n")]


def test_think_then_content():
    text = "<think>\nLet me think.\n\nDone.\n</think>\n\n  The answer is 4."
    assert parse([text], reasoning=True) == [
        Reasoning("Let me think.\n\nDone."),
        Content("The answer is 4."),
    ]


def test_think_then_tool_call():
    text = f"<think>\nI should call it.\n</think>\n\n<tool_call>\n{WEATHER}\n</tool_call>"
    assert parse([text], reasoning=True) == [Reasoning("I should call it."), PARIS]


def test_two_tool_calls_drop_whitespace_between():
    second = '{"name": "get_time", "arguments": {}}'
    text = f"<tool_call>\n{WEATHER}\n</tool_call>\n\n <tool_call>{second}</tool_call>\n"
    assert parse([text]) == [PARIS, ToolCall("get_time", "{}", second)]


def test_content_then_tool_call_drops_trailing_whitespace():
    text = f"Let me check.\n\n<tool_call>\n{WEATHER}\n</tool_call>"
    assert parse([text]) == [Content("Let me check."), PARIS]


def test_whitespace_only_before_tool_call_is_not_content():
    assert parse([f"\n\n<tool_call>\n{WEATHER}\n</tool_call>"]) == [PARIS]


def test_text_after_tool_call_is_content():
    text = f"<tool_call>\n{WEATHER}\n</tool_call>\n\nAnything else?"
    assert parse([text]) == [PARIS, Content("Anything else?")]


def test_in_reasoning_start():
    text = "\nThe prompt opened it.\n</think>\n\nHi."
    assert parse([text], reasoning=True, in_reasoning=True) == [
        Reasoning("The prompt opened it."),
        Content("Hi."),
    ]


def test_unterminated_reasoning_is_flushed():
    assert parse(["<think>\nstill going\n\n"], reasoning=True) == [Reasoning("still going")]
    assert parse(["<think>hmm</thi"], reasoning=True) == [Reasoning("hmm</thi")]


def test_empty_think_block():
    assert parse(["<think>\n\n</think>\n\nHi."], reasoning=True) == [Content("Hi.")]


def test_tool_call_open_start():
    events = parse([f"{WEATHER}\n</tool_call>"], tool_call_open=True)
    assert events == [ToolCall("get_weather", '{"city": "Paris"}', f"{WEATHER}\n")]


def test_reasoning_off_keeps_think_as_content():
    text = "<think>\nx\n</think>\n\nHi."
    assert parse([text]) == [Content(text)]


def test_tools_off_keeps_tool_call_as_content():
    text = f"Sure.\n<tool_call>\n{WEATHER}\n</tool_call>"
    assert parse([text], tools=False) == [Content(text)]


def test_tool_markup_inside_reasoning_is_reasoning():
    text = f"<think><tool_call>{WEATHER}</tool_call></think>"
    assert parse([text], reasoning=True) == [Reasoning(f"<tool_call>{WEATHER}</tool_call>")]


@pytest.mark.parametrize(
    "body",
    [
        "not json",
        '{"arguments": {}}',
        '["get_weather"]',
        '{"name": 3}',
        '{"name": "f", "arguments": [1]}',
        '{"name": "f", "arguments": "not json"}',
    ],
)
def test_invalid_tool_call(body):
    text = f"<tool_call>{body}</tool_call>\nok"
    assert parse([text]) == [InvalidToolCall(f"<tool_call>{body}</tool_call>"), Content("ok")]


def test_unterminated_tool_call_with_valid_json():
    assert parse([f"<tool_call>\n{WEATHER}"]) == [
        ToolCall("get_weather", '{"city": "Paris"}', f"\n{WEATHER}")
    ]
    # Cut inside the close tag: the partial tag is not part of the body.
    assert parse([f"<tool_call>\n{WEATHER}\n</tool_"]) == [PARIS]


def test_unterminated_tool_call_with_invalid_json():
    text = '<tool_call>\n{"name": "get_weather", "argum'
    assert parse([text]) == [InvalidToolCall(text)]
    assert parse(['{"name": "f"'], tool_call_open=True) == [
        InvalidToolCall('<tool_call>{"name": "f"')
    ]


def test_arguments_as_string():
    body = json.dumps({"name": "get_weather", "arguments": '{"city": "Paris"}'})
    assert parse([f"<tool_call>{body}</tool_call>"]) == [
        ToolCall("get_weather", '{"city": "Paris"}', body)
    ]


def test_parameters_key_and_missing_arguments():
    body = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert parse([f"<tool_call>{body}</tool_call>"]) == [
        ToolCall("get_weather", '{"city": "Paris"}', body)
    ]
    body = '{"name": "now"}'
    assert parse([f"<tool_call>{body}</tool_call>"]) == [ToolCall("now", "{}", body)]


def test_non_ascii_arguments():
    body = '{"name": "translate", "arguments": {"text": "\\u00e9t\\u00e9 \U0001f31e 東京"}}'
    (call,) = parse([f"<tool_call>{body}</tool_call>"])
    assert call.arguments == '{"text": "été \U0001f31e 東京"}'
    assert call.raw == body


def test_custom_tags():
    text = "[THINK]a[/THINK]b[TOOL]" + WEATHER + "[/TOOL]"
    events = parse(
        [text], reasoning=True, think_tags=("[THINK]", "[/THINK]"), tool_tags=("[TOOL]", "[/TOOL]")
    )
    assert events == [
        Reasoning("a"),
        Content("b"),
        ToolCall("get_weather", '{"city": "Paris"}', WEATHER),
    ]


def test_bad_options():
    with pytest.raises(ValueError):
        OutputParser(in_reasoning=True)
    with pytest.raises(ValueError):
        OutputParser(tools=False, tool_call_open=True)


def test_partial_tag_is_held_back():
    parser = OutputParser(reasoning=True)
    assert parser.feed("Hello <thi") == [Content("Hello")]
    assert parser.feed("nk>x") == [Reasoning("x")]
    assert parser.feed("y\n</thi") == [Reasoning("y")]
    assert parser.feed("nk>\n") == []
    assert parser.finish() == []


def test_merge():
    events = [Content("a"), Content("b"), Reasoning("c"), Reasoning("d"), PARIS, Content("e")]
    assert merge(events) == [Content("ab"), Reasoning("cd"), PARIS, Content("e")]


def test_a_close_tag_inside_a_json_string_is_the_arguments_text():
    # A strict call's grammar lets a string hold the tag; the call ends where its JSON does.
    body = '{"name": "get_weather", "arguments": {"city": "Paris}}</tool_call>\\"x"}}'
    events = parse([f"<tool_call>\n{body}\n</tool_call>\nok"])
    city = 'Paris}}</tool_call>\\"x'
    assert events == [
        ToolCall("get_weather", json.dumps({"city": json.loads(f'"{city}"')}), f"\n{body}\n"),
        Content("ok"),
    ]
    # Unterminated by EOS, as a model stopping right after the JSON.
    assert parse([f"<tool_call>{body}"])[0].name == "get_weather"


SLIP = '<tool_call>{"name": "f", "arguments": {"x": "a</tool_call>'


@pytest.mark.parametrize(
    ("after", "events"),
    [
        ("\nthen", [Content("then")]),
        ("\nthen</tool_call>", [Content("then</tool_call>")]),
        (f"\nthen <tool_call>\n{WEATHER}\n</tool_call>", [Content("then"), PARIS]),
    ],
)
def test_a_body_that_never_becomes_json_ends_at_the_first_close_tag(after, events):
    # An unconstrained model's slip, a string left open: as if the tag had not been skipped.
    assert parse([SLIP + after]) == [InvalidToolCall(SLIP), *events]


def test_slips_by_the_thousand_take_linear_time():
    # What a hostile grammar can make a model write: every call a slip that reads on to the
    # end. Read again call after call (the first fix) 100 KB took 7.5 s.
    unit = '<tool_call>"</tool_call>"'
    parser = OutputParser()
    started = time.perf_counter()
    events = parser.feed(unit * 20_000) + parser.finish()
    assert time.perf_counter() - started < 5
    assert events[:2] == [InvalidToolCall('<tool_call>"</tool_call>'), Content('"')]
    assert len(events) == 40_000


SPLIT_CASES = [
    (
        {"reasoning": True},
        f"<think>\nI should call it.\n</think>\n\n<tool_call>\n{WEATHER}\n</tool_call>",
    ),
    ({}, f"Sure.\n\n<tool_call>{WEATHER}</tool_call>\n<tool_call>{WEATHER}</tool_call>\n"),
    ({"reasoning": True, "in_reasoning": True}, "\nhm <th\n\n</think>\n \nAnswer <t\n"),
    ({"tool_call_open": True}, f"{WEATHER}\n</tool_call>\n\nok </tool_call"),
    ({"reasoning": True}, "<think>a</think>b<think>\n\nc\n</think><tool_call>{bad}</tool_call> "),
    ({}, '<tool_call>{"name": "f", "x": "\\\\\\"</tool_call>"}</tool_call>ok'),
    ({}, SLIP + ' <tool_call>{"name": "f"}</tool_call>'),
]


@pytest.mark.parametrize(("options", "text"), SPLIT_CASES)
def test_every_split_gives_same_events(options, text):
    whole = parse([text], **options)
    assert parse(list(text), **options) == whole
    for parts in (2, 3):
        for chunks in splits(text, parts):
            assert parse(chunks, **options) == whole, chunks


TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<", "</", "<th", "</tool_"]
BODIES = [WEATHER, '{"name": "f", "parameters": "{\\"a\\": 1}"}', '{"name": ', "{}"]
FRAGMENTS = st.sampled_from(
    TAGS + BODIES + ["\n", "\n\n", " ", "word", "é", "x y", '"', "\\", '{"name": "f", "x": "']
)


@st.composite
def split_text(draw):
    """Draw a text of fragments and a random way to cut it."""
    text = "".join(draw(st.lists(FRAGMENTS, max_size=12)))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=6)))
    bounds = (0, *cuts, len(text))
    return text, [text[a:b] for a, b in itertools.pairwise(bounds)]


OPTIONS = st.sampled_from(
    [
        {},
        {"reasoning": True},
        {"reasoning": True, "in_reasoning": True},
        {"tool_call_open": True},
        {"tools": False},
        {"reasoning": True, "tools": False},
    ]
)


@settings(
    max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(split_text(), OPTIONS)
def test_random_splits_give_same_events(case, options):
    text, chunks = case
    assert parse(chunks, **options) == parse([text], **options)


def test_a_tool_call_nested_past_the_recursion_limit_is_an_invalid_call_not_a_crash():
    parser = OutputParser(tools=True)
    deep = "<tool_call>" + "[" * 100_000 + "</tool_call>after"
    events = parser.feed(deep) + parser.finish()
    assert any(isinstance(e, InvalidToolCall) for e in events)
    assert "after" in "".join(e.text for e in events if isinstance(e, Content))
    args = '{"name": "f", "arguments": "' + "[" * 100_000 + '"}'
    assert call_from_json(args) is None
