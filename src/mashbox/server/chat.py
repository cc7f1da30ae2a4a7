"""One chat path for every protocol: neutral messages -> prompt; engine text -> parsed events.

Adapters (OpenAI chat, Anthropic messages, OpenAI responses) convert their messages into the
Hugging Face message dicts used here and render the parsed events; none of them renders a
template or parses model text itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import attrs
import trio

from ..events import (
    Admitted,
    Failed,
    Finished,
    PromptLogprobs,
    Restarted,
    TextDelta,
    TokenLogprob,
)
from ..text.chat_template import ChatTemplateError
from ..text.parser import (
    Content,
    InvalidToolCall,
    OutputParser,
    Reasoning,
    ToolCall,
    call_from_json,
    merge,
)
from .errors import ApiError, bad_request
from .state import ServerState
from .token_logprobs import ItemTokens, Logprobs

# Qwen2.5's own words, for templates that know nothing of tools (Hermes-style tool calling).
TOOL_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@attrs.frozen
class ToolChoice:
    """auto, none, required, or one named function."""

    mode: str = "auto"
    name: str | None = None


@attrs.frozen
class ChatPrompt:
    """A rendered prompt and how to read the model's answer to it."""

    text: str
    reasoning: bool  # thinking is on: <think> spans become reasoning
    in_reasoning: bool  # the prompt itself opened <think>
    tools_offered: bool  # tool-call markup is parsed as calls
    forced_prefix: str | None  # text the server put after the generation prompt
    tool_names: frozenset[str] = frozenset()
    # A token's bytes, where log-probs were asked for: to place tokens in the parsed items.
    token_bytes: Callable[[int], bytes] | None = None

    def parser(self) -> OutputParser:
        parser = OutputParser(
            reasoning=self.reasoning,
            in_reasoning=self.in_reasoning,
            tools=self.tools_offered,
            tool_call_open=self.forced_prefix is not None,
        )
        if self.forced_prefix:
            # The body of a forced call starts in the prompt: the parser must see it too.
            parser.feed(self.forced_prefix.removeprefix("<tool_call>\n"))
        return parser


def _arguments_as_object(tool_call: dict) -> dict:
    """Templates expect function.arguments as a mapping; clients send a JSON string."""
    call = dict(tool_call)
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):
            parsed = None
        if isinstance(parsed, dict):
            function["arguments"] = parsed
    call["function"] = function
    return call


def _tool_call_text(call: dict) -> str:
    function = call.get("function") or {}
    body = {"name": function.get("name"), "arguments": function.get("arguments", {})}
    return "<tool_call>\n" + json.dumps(body, ensure_ascii=False) + "\n</tool_call>"


def _without_template_tools(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Describe tools, calls and results as text for a template that cannot."""
    out: list[dict] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(_tool_call_text(c) for c in m["tool_calls"])
            content = (m.get("content") or "").rstrip()
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = f"{content}\n{calls}" if content else calls
        elif m["role"] == "tool":
            text = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("_tool_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + text}
                continue
            m = {"role": "user", "content": text, "_tool_results": True}
        out.append(m)
    out = [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        prompt = TOOL_PROMPT.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _defused(value, defuse):
    """value (parsed JSON) with `defuse` applied to every string in it, keys included: over
    its JSON text, so no nesting depth recurses here."""
    if value is None:
        return None
    text = json.dumps(value, ensure_ascii=False)
    safe = defuse(text)
    return value if safe == text else json.loads(safe)


def render(
    state: ServerState,
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    tool_choice: ToolChoice = ToolChoice(),
    thinking: bool = False,
) -> ChatPrompt:
    """Render messages (HF dicts) through the model's template, with tools and thinking.

    tool_choice none hides the tools; required and a named function are enforced by
    starting the answer with the tool-call markup (and the name) after the generation prompt.
    """
    if tool_choice.mode == "none":
        tools = None
    if tool_choice.name is not None and not any(
        (t.get("function") or {}).get("name") == tool_choice.name for t in tools or ()
    ):
        raise bad_request(f"tool_choice names '{tool_choice.name}', which is not in tools")
    forced = tool_choice.mode in ("required", "function") and bool(tools)
    if forced:
        thinking = False  # the forced call starts the answer
    # Whatever the client wrote is text: a special token's text in a message, a tool's
    # description or a tool result cannot become a control token (a forged system turn).
    defuse = state.tokenizer.defuse
    messages, tools = _defused(messages, defuse), _defused(tools, defuse)
    messages = [
        {**m, "tool_calls": [_arguments_as_object(c) for c in m["tool_calls"]]}
        if m.get("tool_calls")
        else m
        for m in messages
    ]
    template = state.template
    if not template.uses_tools:
        messages = _without_template_tools(messages, tools)
    try:
        text = template.render(
            messages,
            tools=tools if template.uses_tools else None,
            add_generation_prompt=True,
            enable_thinking=thinking,
        )
    except ChatTemplateError as exc:
        raise bad_request(f"the chat template refused these messages: {exc}", "messages") from None
    prefix = None
    if forced:
        prefix = "<tool_call>\n"
        if tool_choice.name is not None:
            # No space after the colon: the model writes ' {' as one token (token healing).
            prefix += json.dumps({"name": defuse(tool_choice.name)})[:-1] + ', "arguments":'
        text += prefix
    in_reasoning = thinking and text.rstrip().endswith("<think>")
    names = frozenset((t.get("function") or {}).get("name") for t in tools or ())
    return ChatPrompt(text, thinking, in_reasoning, bool(tools), prefix, names)


@attrs.frozen
class Ping:
    """Nothing happened for a while (streams send a keep-alive event)."""


class PutBack:
    """A receive channel with one event put back in front of it."""

    def __init__(self, first, events):
        self._first, self._events = first, events

    async def receive(self):
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await self._events.receive()


async def admission(events, wait: float):
    """(cached prompt tokens, the channel to read on) once the request has a slot, waiting
    at most `wait` seconds: a stream's opening event can then say how much of the prompt a
    cache served. (None, ...) when it is still queued, or something else came first."""
    with trio.move_on_after(wait):
        try:
            first = await events.receive()
        except trio.EndOfChannel:
            return None, events
        if isinstance(first, Admitted):
            return first.cached, events
        return None, PutBack(first, events)
    return None, events


async def _receive(events, ping_every: float | None):
    """The next event, or None after ping_every seconds without one (no timer without
    ping_every: a cancel scope per token is a measurable share of the server's time)."""
    if not ping_every:
        return await events.receive()
    with trio.move_on_after(ping_every):
        return await events.receive()
    return None


async def parsed(events, prompt: ChatPrompt, *, ping_every: float | None = None):
    """Scheduler events with the answer's text parsed into reasoning, content and tool calls;
    `Finished` carries how many generated tokens were reasoning (think tags included). Where
    log-probs were asked for, each content item comes after the Logprobs of its tokens.

    With ping_every, a Ping is yielded after that many seconds without an event (during a
    long prefill, say): the receive is cancelled, never the generator itself.
    """
    parser = prompt.parser()
    bare = _BareCalls(prompt.tool_names)
    tokens = ItemTokens(prompt.token_bytes, parser.fed)
    reasoning_tokens = 0
    while True:
        try:
            event = await _receive(events, ping_every)
        except trio.EndOfChannel:
            return
        if event is None:
            yield Ping()
            continue
        if isinstance(event, TextDelta):
            tokens.add(event)
            read = []
            for text, n in event.pieces():  # a grown delta's pieces: exact reasoning counts
                before = parser.in_reasoning
                read += parser.feed(text)
                if before or parser.in_reasoning:  # the think tags count with the reasoning
                    reasoning_tokens += n
            for item in tokens.place(bare.pass_through(_joined(read))):
                yield item
        elif isinstance(event, Finished):
            for item in tokens.place(bare.finish(parser.finish())):
                yield item
            yield attrs.evolve(event, reasoning_tokens=reasoning_tokens)
        elif isinstance(event, Restarted):  # what was read before the fault is void
            parser = prompt.parser()
            bare = _BareCalls(prompt.tool_names)
            tokens = ItemTokens(prompt.token_bytes, parser.fed)
            reasoning_tokens = 0
            yield event
        elif isinstance(event, Failed):
            yield event


def _joined(items: list) -> list:
    """Adjacent reasoning, or content, read from one delta's pieces as one item each: one
    event to the client for one delta, however many pieces it was grown from."""
    out = []
    for item in items:
        last = out[-1] if out else None
        if (
            isinstance(item, Reasoning | Content)
            and type(item) is type(last)
            and item.start is not None
            and last.start is not None
            and last.start + len(last.text) == item.start
        ):
            out[-1] = attrs.evolve(last, text=last.text + item.text)
        else:
            out.append(item)
    return out


class _BareCalls:
    """Read an answer that is only a call's bare JSON as that call.

    Small models (qwen2.5-coder-0.5b, say) often answer a tool request with
    `{"name": "get_weather", "arguments": {...}}` and no <tool_call> tags. When tools are
    offered and the answer's content starts with "{" (or a ``` fence), the content is held
    back to the end: one JSON object per line (fences allowed), each naming an offered
    tool, becomes those calls; anything else is given out as the content it was.
    """

    def __init__(self, tool_names: frozenset[str]):
        self.tool_names = tool_names
        self.held: list[Content] | None = None  # None: not holding (yet)
        self.decided = not tool_names  # the answer's start has been seen

    def pass_through(self, events) -> list:
        out = []
        for event in events:
            if self.held is not None:
                if isinstance(event, Content):
                    self.held.append(event)
                    continue
                out.extend(self._release())
            elif not self.decided and isinstance(event, Content) and event.text.strip():
                self.decided = True
                if event.text.lstrip().startswith(("{", "```")):
                    self.held = [event]
                    continue
            out.append(event)
        return out

    def finish(self, events) -> list:
        out = self.pass_through(events)
        if self.held is not None:
            calls = self._calls("".join(e.text for e in self.held))
            out.extend(calls if calls else self._release())
            self.held = None
        return out

    def _release(self) -> list:
        held, self.held = self.held or [], None
        return held

    def _calls(self, text: str) -> list[ToolCall]:
        body = text.strip()
        if body.startswith("```"):
            body = body.strip("`").removeprefix("json").strip()
        lines = [line for line in body.splitlines() if line.strip()]
        for candidates in ([body], lines):
            calls = [call_from_json(c) for c in candidates]
            if calls and all(c is not None and c.name in self.tool_names for c in calls):
                return calls
        return []


@attrs.frozen
class Answer:
    """A whole non-streamed answer: its parsed events in order, and how it ended."""

    events: list  # Reasoning, Content, ToolCall, InvalidToolCall (merged where adjacent)
    done: Finished
    # Where asked for: every token of plain completions, a chat answer's content tokens.
    logprobs: tuple[TokenLogprob, ...] = ()

    def text(self, kind=Content) -> str:
        """The joined text of one kind (InvalidToolCall markup counts as content)."""
        kinds = (Content, InvalidToolCall) if kind is Content else (kind,)
        return "".join(e.text for e in self.events if isinstance(e, kinds))

    @property
    def calls(self) -> list[ToolCall]:
        return [e for e in self.events if isinstance(e, ToolCall)]


async def collect(events, prompt: ChatPrompt | None, failure) -> Answer:
    """Read a non-streamed answer to its end; `failure(Failed)` builds the error to raise.
    The request is released however this ends (a disconnect included): the events close.

    Without a prompt (text completions) the text is not parsed: it is all content.
    """
    items: list = []
    logprobs: list[TokenLogprob] = []
    source = plain_events(events) if prompt is None else parsed(events, prompt)
    async with events:
        async for event in source:
            if isinstance(event, Logprobs):
                logprobs.extend(event.entries)
                continue
            if isinstance(event, Finished):
                answer = Answer(merge(items), event, tuple(logprobs))
                if answer.calls:
                    events.mark_called_tools()
                return answer
            if isinstance(event, Failed):
                raise failure(event)
            if isinstance(event, Restarted):
                items, logprobs = [], []  # the engine failed before the client got anything
            else:
                items.append(event)
    raise ApiError(500, "the request was dropped before it finished", type="server_error")


async def plain_events(events):
    """Scheduler events read by `PlainText`, as they come."""
    text = PlainText()
    async for event in events:
        for item in text.read(event):
            yield item


class PlainText:
    """One answer's scheduler events as plain completions' items: text as Content, unparsed,
    with the Logprobs of its tokens, where asked for, just before it. The prompt's (echo)
    go with the first text, or before the end where there is none; a run again after a
    fault sends them anew, so they are held, not added to."""

    def __init__(self):
        self.prompt: tuple[TokenLogprob, ...] = ()

    def read(self, event) -> list:
        if isinstance(event, PromptLogprobs):
            self.prompt = event.entries
            return []
        if isinstance(event, TextDelta):
            entries, self.prompt = self.prompt + tuple(event.logprobs), ()
            return [Logprobs(entries), Content(event.text)] if entries else [Content(event.text)]
        if isinstance(event, Finished) and self.prompt:
            entries, self.prompt = self.prompt, ()
            return [Logprobs(entries), event]
        if isinstance(event, Finished | Failed | Restarted):
            return [event]
        return []


def finish_reason(done: Finished, called_tools: bool) -> str:
    """stop, length, or tool_calls when the answer ended after calling tools."""
    return "tool_calls" if called_tools and done.reason == "stop" else done.reason
