"""Parse streamed model output into reasoning, content and tool-call events.

One `OutputParser` per generation is fed the detokenized text (already cut at stop strings)
in whatever pieces it arrives, and returns events. Every protocol adapter renders these
events; none parses model text itself.

The events do not depend on how the text was split: merging adjacent Reasoning (or Content)
events of `feed()` calls plus `finish()` gives the same list for any split. Partial tags are
held back exactly as a stop-string matcher holds back a partial stop.

Each event knows where its text starts in the text fed (`start`, in characters; a ToolCall's
`raw` starts there), so a route can tell which generated tokens each event holds.

Whitespace that only separates blocks is dropped, so splits cannot change it:

- Reasoning loses its leading newlines (right after `<think>`) and its trailing newlines
  (right before `</think>`, or at the end of generation), as vLLM's Qwen3/DeepSeek parsers
  and the Qwen3 chat template (`reasoning.strip("\\n")`) do.
- Content loses its leading whitespace after a closed block (`</think>`, `</tool_call>`),
  until its first non-space character; so whitespace between tool calls is never content.
- Content loses its trailing whitespace right before an opening tag (`<think>`,
  `<tool_call>`); trailing whitespace at the end of generation is kept.
"""

from __future__ import annotations

import enum
import json
import re

import attrs


@attrs.frozen
class Reasoning:
    """Thinking text (inside `<think>...</think>`)."""

    text: str
    start: int | None = attrs.field(default=None, eq=False, repr=False, kw_only=True)


@attrs.frozen
class Content:
    """Answer text."""

    text: str
    start: int | None = attrs.field(default=None, eq=False, repr=False, kw_only=True)


@attrs.frozen
class ToolCall:
    """One complete tool call.

    `arguments` is `json.dumps(obj, ensure_ascii=False)` of the arguments object ("{}" when
    absent); `raw` is the exact text between the tags, for custom tools that take free text.
    """

    name: str
    arguments: str
    raw: str
    start: int | None = attrs.field(default=None, eq=False, repr=False, kw_only=True)


@attrs.frozen
class InvalidToolCall:
    """Tool-call markup without valid JSON naming a tool; adapters render it as content."""

    text: str
    start: int | None = attrs.field(default=None, eq=False, repr=False, kw_only=True)


Event = Reasoning | Content | ToolCall | InvalidToolCall


def merge(events: list[Event]) -> list[Event]:
    """Join adjacent Reasoning events, and adjacent Content events, into one each."""
    out: list[Event] = []
    for event in events:
        last = out[-1] if out else None
        if isinstance(event, Reasoning | Content) and type(last) is type(event):
            out[-1] = attrs.evolve(last, text=last.text + event.text)
        else:
            out.append(event)
    return out


class _State(enum.Enum):
    CONTENT = enum.auto()
    REASONING = enum.auto()
    TOOL = enum.auto()


class OutputParser:
    """Turn one generation's output text, fed in pieces, into events.

    `reasoning` turns `<think>...</think>` into Reasoning; `in_reasoning` says the prompt
    already opened `<think>`. `tools` turns `<tool_call>{json}</tool_call>` into ToolCall;
    `tool_call_open` says the prompt already opened `<tool_call>` (a forced tool call).
    Tags that are off are plain content. Within one state no active tag may contain another.
    """

    def __init__(
        self,
        *,
        reasoning: bool = False,
        in_reasoning: bool = False,
        tools: bool = True,
        tool_call_open: bool = False,
        think_tags: tuple[str, str] = ("<think>", "</think>"),
        tool_tags: tuple[str, str] = ("<tool_call>", "</tool_call>"),
    ) -> None:
        if in_reasoning and not reasoning:
            raise ValueError("in_reasoning needs reasoning=True")
        if tool_call_open and not tools:
            raise ValueError("tool_call_open needs tools=True")
        if in_reasoning and tool_call_open:
            raise ValueError("output cannot start both in reasoning and in a tool call")
        if not all(think_tags) or not all(tool_tags):
            raise ValueError("tags must be non-empty strings")
        self._think_open, self._think_close = think_tags
        self._tool_open, self._tool_close = tool_tags
        self._opening = tuple(
            tag for tag, on in ((self._think_open, reasoning), (self._tool_open, tools)) if on
        )
        self._buf = ""
        self._fed = 0  # characters fed so far (where `start` counts from)
        # Set at a block boundary (tag seen, or opened by the prompt); cleared once the text
        # that follows has emitted a non-space character.
        self._strip_lead = in_reasoning
        self._scanned = 0  # how much of a tool body was already searched for the close tag
        self._json = _JsonStrings()
        self._skipped: int | None = None  # the first close tag found inside a JSON string
        self._slipped = False  # a call fell back to its first close tag (_fall_back)
        if in_reasoning:
            self._state = _State.REASONING
        elif tool_call_open:
            self._enter_tool()
        else:
            self._state = _State.CONTENT

    @property
    def in_reasoning(self) -> bool:
        """Whether the text fed so far ends inside reasoning."""
        return self._state is _State.REASONING

    @property
    def fed(self) -> int:
        """How many characters were fed so far: where the next one's `start` would be."""
        return self._fed

    def feed(self, text: str) -> list[Event]:
        """Add output text; return the events it completes."""
        self._buf += text
        self._fed += len(text)
        events: list[Event] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[Event]:
        """End the generation: return events for the text still held back."""
        events: list[Event] = []
        # Models often stop at EOS right after the JSON, without the close tag.
        if self._state is _State.TOOL and self._skipped is not None:
            body = self._buf[: len(self._buf) - _partial_suffix(self._buf, (self._tool_close,))]
            if call_from_json(body) is None:
                self._fall_back(events)
                while self._step(events):
                    pass
        return events + self._held_events()

    def _held_events(self) -> list[Event]:
        held, self._buf = self._buf, ""
        start = self._fed - len(held)
        if self._state is _State.CONTENT:
            # Held content is trailing whitespace, maybe followed by part of a tag.
            return [Content(held, start=start)] if held else []
        if self._state is _State.REASONING:
            # Held reasoning is newlines, maybe followed by part of </think>.
            text = held.rstrip("\n")
            return [Reasoning(text, start=start)] if text else []
        body = held[: len(held) - _partial_suffix(held, (self._tool_close,))]
        event = self._tool_call(body, start)
        if isinstance(event, InvalidToolCall):
            event = InvalidToolCall(self._tool_open + held, start=event.start)
        return [event]

    def _step(self, events: list[Event]) -> bool:
        """Consume what the buffer allows; return True when the state changed."""
        if self._state is _State.CONTENT:
            return self._step_content(events)
        if self._state is _State.REASONING:
            return self._step_reasoning(events)
        return self._step_tool(events)

    def _step_content(self, events: list[Event]) -> bool:
        buf = self._buf.lstrip() if self._strip_lead else self._buf
        at, tag = _first_tag(buf, self._opening)
        if tag is not None:
            if text := buf[:at].rstrip():
                events.append(Content(text, start=self._fed - len(buf)))
            self._buf = buf[at + len(tag) :]
            self._strip_lead = True
            if tag == self._tool_open:
                self._enter_tool()
            else:
                self._state = _State.REASONING
            return True
        safe = len(buf) - _partial_suffix(buf, self._opening)
        # Trailing whitespace waits: it is dropped if an opening tag follows.
        text = buf[:safe].rstrip() if self._opening else buf[:safe]
        if text:
            events.append(Content(text, start=self._fed - len(buf)))
            self._strip_lead = False
        self._buf = buf[len(text) :]
        return False

    def _step_reasoning(self, events: list[Event]) -> bool:
        buf = self._buf.lstrip("\n") if self._strip_lead else self._buf
        at = buf.find(self._think_close)
        if at >= 0:
            if text := buf[:at].rstrip("\n"):
                events.append(Reasoning(text, start=self._fed - len(buf)))
            self._buf = buf[at + len(self._think_close) :]
            self._state, self._strip_lead = _State.CONTENT, True
            return True
        safe = len(buf) - _partial_suffix(buf, (self._think_close,))
        # Trailing newlines wait: they are dropped if </think> follows.
        if text := buf[:safe].rstrip("\n"):
            events.append(Reasoning(text, start=self._fed - len(buf)))
            self._strip_lead = False
        self._buf = buf[len(text) :]
        return False

    def _enter_tool(self) -> None:
        self._state, self._scanned, self._skipped = _State.TOOL, 0, None
        self._json = _JsonStrings()

    def _step_tool(self, events: list[Event]) -> bool:
        # A close tag inside a JSON string is the argument's text (a strict call's grammar
        # allows it there), not the call's end; if the body then never becomes a valid call,
        # the call ends at the first such tag after all (an unconstrained model's slip), and
        # so do all later calls.
        while True:
            at = self._buf.find(self._tool_close, self._scanned)
            if at < 0:
                self._scanned = max(self._scanned, len(self._buf) - len(self._tool_close) + 1)
                return False
            if self._slipped or not self._json.in_string_at(self._buf, at):
                break
            if self._skipped is None:
                self._skipped = at
            self._scanned = at + 1
        if self._skipped is not None and call_from_json(self._buf[:at]) is None:
            self._fall_back(events)
        else:
            self._end_tool(at, events)
        return True

    def _fall_back(self, events: list[Event]) -> None:
        """The call skipped a close tag inside a string but never became JSON: it ends at
        that tag after all, and from then on every call ends at its first close tag (the
        output is not a grammar's; reading the rest again call after call was quadratic)."""
        self._end_tool(self._skipped, events)
        self._slipped = True

    def _end_tool(self, at: int, events: list[Event]) -> None:
        """Emit the call whose body is the buffer's first `at` characters; then content."""
        events.append(self._tool_call(self._buf[:at], self._fed - len(self._buf)))
        self._buf = self._buf[at + len(self._tool_close) :]
        self._state, self._strip_lead = _State.CONTENT, True

    def _tool_call(self, body: str, start: int) -> ToolCall | InvalidToolCall:
        """Parse a tool-call body (Hermes/Qwen JSON) that starts at `start` into a ToolCall,
        or mark it invalid (the markup, its open tag included, is then the text)."""
        call = call_from_json(body)
        if call is not None:
            return attrs.evolve(call, start=start)
        markup = self._tool_open + body + self._tool_close
        return InvalidToolCall(markup, start=start - len(self._tool_open))


def call_from_json(body: str) -> ToolCall | None:
    """A Hermes/Qwen tool-call body, `{"name": ..., "arguments": {...}}`, as a ToolCall."""
    try:
        call = json.loads(body)
    except (ValueError, RecursionError):  # model output may nest past the recursion limit
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    args = call.get("arguments", call.get("parameters"))
    if isinstance(args, str):
        # Some models encode the arguments object as a JSON string.
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            return None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None
    return ToolCall(call["name"], json.dumps(args, ensure_ascii=False), body)


class _JsonStrings:
    """Where JSON strings are in a growing text: lexes quotes and escapes once, forward."""

    _QUOTE_OR_ESCAPE = re.compile(r'["\\]')

    def __init__(self) -> None:
        self._lexed = 0
        self._in_string = False

    def in_string_at(self, text: str, end: int) -> bool:
        """Whether text[end] is inside a JSON string (end never moves backwards)."""
        at = self._lexed
        while True:
            if not self._in_string:
                quote = text.find('"', at, end)
                if quote < 0:
                    break
                self._in_string, at = True, quote + 1
                continue
            found = self._QUOTE_OR_ESCAPE.search(text, at, end)
            if found is None:
                break
            if found.group() == '"':
                self._in_string, at = False, found.end()
            elif found.end() < end:
                at = found.end() + 1  # past the escaped character
            else:
                self._lexed = found.start()  # lex the escape again once its character is in
                return True
        self._lexed = end
        return self._in_string


def _first_tag(buf: str, tags: tuple[str, ...]) -> tuple[int, str | None]:
    """Return where the earliest of tags starts in buf, and which; (-1, None) if none does."""
    best: tuple[int, str | None] = (-1, None)
    for tag in tags:
        at = buf.find(tag)
        if at >= 0 and (best[1] is None or at < best[0]):
            best = (at, tag)
    return best


def _partial_suffix(buf: str, tags: tuple[str, ...]) -> int:
    """Return the length of the longest suffix of buf that begins one of tags."""
    longest = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(buf)), longest, -1):
            if buf.endswith(tag[:n]):
                longest = n
                break
    return longest
