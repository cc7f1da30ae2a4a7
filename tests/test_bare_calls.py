"""Answers that are a call's bare JSON (no <tool_call> tags) become calls, nothing else does."""

from __future__ import annotations

from mashbox.server.chat import _BareCalls
from mashbox.text.parser import Content, OutputParser, ToolCall

NAMES = frozenset({"get_weather"})
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def run(text: str, names=NAMES, pieces: int = 3) -> list:
    parser, bare, out = OutputParser(tools=True), _BareCalls(names), []
    step = max(1, len(text) // pieces)
    for i in range(0, len(text), step):
        out.extend(bare.pass_through(parser.feed(text[i : i + step])))
    out.extend(bare.finish(parser.finish()))
    return out


def test_bare_json_is_a_call():
    (call,) = run(CALL)
    assert call == ToolCall("get_weather", '{"city": "Paris"}', CALL)


def test_fenced_and_one_per_line():
    assert [e.name for e in run(f"```json\n{CALL}\n```")] == ["get_weather"]
    assert [e.name for e in run(f"{CALL}\n{CALL}")] == ["get_weather", "get_weather"]


def test_other_json_and_prose_stay_content():
    other = '{"name": "rm_rf", "arguments": {}}'
    assert "".join(e.text for e in run(other)) == other
    assert all(isinstance(e, Content) for e in run("It is sunny. {not json}"))
    assert "".join(e.text for e in run(CALL, names=frozenset())) == CALL


def test_prose_is_not_held_back():
    parser, bare = OutputParser(tools=True), _BareCalls(NAMES)
    assert bare.pass_through(parser.feed("Hello there, ")) == [Content("Hello there,")]
