"""The one route driver: every generation protocol (OpenAI chat and completions, Anthropic
messages, OpenAI responses) is a codec, and this runs each of them the same way.

A codec parses a body into a `Call`: the scheduler `Request`, the rendered prompt (how to
read the answer) and an `Encoder`, which turns the parsed answer (reasoning, content, tool
calls, the end or a failure) into that protocol's events without any I/O. The driver owns
everything else: the ready check, submitting, the one retry's bookkeeping, reading the
answer whole or streaming it, the request's log line, and releasing the request from the
scheduler however the client goes. HTTP frames the events as server-sent events; the chat
WebSocket sends the same events as frames. Where `n` asks for several choices (OpenAI chat and
completions), it runs them all under one answer: submitted together, each with its own seed,
read as they come and released together; completions' list of prompts is n choices of each
prompt, in the prompts' order, the same way.
"""

from __future__ import annotations

import collections
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

import attrs
import trio

from ..events import (
    Failed,
    Finished,
    NotReady,
    QueueFull,
    Request,
    Restarted,
    TextDelta,
    Usage,
)
from ..scheduler import ChoiceEvents, RequestEvents
from ..text.parser import ToolCall, merge
from . import chat
from .chat import Answer, ChatPrompt, Logprobs, Ping
from .errors import ApiError, not_ready, queue_full
from .generation import choice_request, log_request, log_tag
from .state import ServerState
from .validate import Body


@attrs.frozen
class Frame:
    """One protocol event: its JSON text, and its SSE event name where the protocol names
    its events (Anthropic, Responses); OpenAI's data-only streams have none."""

    json: bytes
    name: str | None = None

    def sse(self) -> bytes:
        head = b"event: " + self.name.encode() + b"\n" if self.name else b""
        return head + b"data: " + self.json + b"\n\n"


def frame(data, name: str | None = None) -> Frame:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return Frame(text.encode(), name)


class OneFieldFrame:
    """A stream's per-token event, rendered once with one string field left open.

    json.dumps of the whole event for every token is a measurable share of the server's
    time per token; only the text changes."""

    _OPEN = "\x00open\x00"

    def __init__(self, render: Callable[[str], Frame]):
        """render(text) -> the event's Frame, text being its last string."""
        probe = render(self._OPEN)
        self.name = probe.name
        self.head, _, self.tail = probe.json.rpartition(json.dumps(self._OPEN).encode())
        assert self("probe") == render("probe")

    def __call__(self, text: str) -> Frame:
        text_json = json.dumps(text, ensure_ascii=False).encode()
        return Frame(self.head + text_json + self.tail, self.name)


class Encoder(Protocol):
    """A protocol's answer, as events: one per request, fed in order, no I/O."""

    ping_every: float | None  # seconds of silence before a Ping is fed (None: never)
    waits_for_admission: bool  # start() wants the cached prompt tokens, once known

    def start(self, cached: int | None) -> list[Frame]: ...
    def feed(self, item) -> list[Frame]: ...  # Reasoning, Content, InvalidToolCall, ToolCall, Ping
    def finish(self, done: Finished) -> list[Frame]: ...
    def fail(self, message: str, status: int) -> list[Frame]: ...
    def whole(self, answer: Answer) -> dict: ...  # the body of a non-streamed answer


class ChoicesEncoder(Encoder, Protocol):
    """An encoder whose protocol answers n choices at once (OpenAI chat and completions)."""

    def choice(self, index: int) -> ChoicesEncoder: ...  # another choice of the same answer
    def finish_choice(self, done: Finished) -> list[Frame]: ...  # this choice's last event
    def finish_answer(self, done: Finished) -> list[Frame]: ...  # after every choice's last
    def whole_choice(self, answer: Answer) -> dict: ...  # this choice in the whole answer
    def whole_answer(self, choices: list[dict], done: Finished) -> dict | list: ...


class Tally:
    """The tokens each choice of an answer has generated so far, counted as its events
    arrive, for usage in every event of a stream (vLLM's `continuous_usage_stats`). A token
    whose text is held back counts when it arrives, not when its text is sent."""

    def __init__(self, prompt_tokens: list[int]):
        """prompt_tokens: each choice's prompt's length (one per choice, in order)."""
        self.prompt_tokens = prompt_tokens
        self.completion = [0] * len(prompt_tokens)

    def count(self, index: int, event) -> None:
        if isinstance(event, TextDelta):
            self.completion[index] += event.tokens
        elif isinstance(event, Restarted):  # the answer starts again
            self.completion[index] = 0

    def usage(self, index: int) -> dict:
        prompt, done = self.prompt_tokens[index], self.completion[index]
        return {"prompt_tokens": prompt, "completion_tokens": done,
                "total_tokens": prompt + done}  # fmt: skip


class _Counted(trio.abc.ReceiveChannel):
    """A request's events, each counted into its Tally as the parser reads it."""

    def __init__(self, events, tally: Tally):
        self.events, self.tally = events, tally

    async def receive(self):
        event = await self.events.receive()
        self.tally.count(0, event)
        return event

    async def aclose(self) -> None:
        await self.events.aclose()


@attrs.frozen
class Call:
    """One generation request, parsed: what the scheduler runs and how to answer it."""

    request: Request  # choice 0's, where the answer holds several
    prompt: ChatPrompt | None  # None: plain completions (the text is not parsed)
    encoder: Encoder  # a ChoicesEncoder where the answer holds several choices
    choices: int = 1  # `n`, of each prompt
    tally: Tally | None = None  # where every event carries the usage so far (its encoders')
    more_prompts: tuple[Request, ...] = ()  # completions' further prompts, each with n choices

    def requests(self) -> list[Request]:
        """Every choice's request, each prompt's n in turn (OpenAI's order of indexes)."""
        prompts = (self.request, *self.more_prompts)
        return [choice_request(r, i) for r in prompts for i in range(self.choices)]


Parse = Callable[[ServerState, Body, str], Awaitable[Call]]


def submit(state: ServerState, request: Request) -> RequestEvents:
    """Queue a request, turning scheduler refusals into the route's error responses; closing
    the events it returns cancels the request."""
    try:
        return state.scheduler.submit(request)
    except NotReady:
        raise not_ready() from None
    except QueueFull as exc:
        raise queue_full(str(exc), whole_queue=exc.whole_queue) from None


def failure(event: Failed) -> ApiError:
    """The error response for an answer the engine could not produce."""
    if event.status == 503:
        return ApiError(503, event.message, type="unavailable", headers={"Retry-After": "5"})
    code = "backend_timeout" if event.status == 504 else None  # seed 004's name for it
    return ApiError(event.status, event.message, type="server_error", code=code)


DROPPED = "the request was dropped before it finished"


async def answer(
    state: ServerState, route: str, parse: Parse, data, headers, tenant: str = ""
) -> dict | list | AsyncIterator[Frame]:
    """Run one generation request: the whole answer's body, or its stream of events."""
    if not state.ready:
        raise not_ready()
    t0 = time.perf_counter()
    body = Body(data)
    call = await parse(state, body, tenant)
    session = log_tag(body, headers, tenant)

    def logged(status: int, done: Finished | None) -> None:
        log_request(route, status, done, session, t0)

    if call.choices > 1 or call.more_prompts:
        return await _answer_choices(state, call, logged)
    events = submit(state, call.request)
    if not call.request.stream:

        def fail(event: Failed) -> ApiError:
            logged(event.status, None)
            return failure(event)

        whole = await chat.collect(events, call.prompt, fail)
        logged(200, whole.done)
        return call.encoder.whole(whole)
    return _stream(events, call, logged)


async def _stream(events: RequestEvents, call: Call, logged) -> AsyncIterator[Frame]:
    """The answer's events as they come; the request is cancelled however this ends."""
    encoder = call.encoder
    async with events:
        source, cached = events, None
        if encoder.waits_for_admission:
            cached, source = await chat.admission(events, encoder.ping_every)
        if call.tally is not None:
            source = _Counted(source, call.tally)
        for f in encoder.start(cached):
            yield f
        if call.prompt is None:
            items = chat.plain_events(source)
        else:
            items = chat.parsed(source, call.prompt, ping_every=encoder.ping_every)
        async for item in items:
            if isinstance(item, Finished):
                for f in encoder.finish(item):
                    yield f
                logged(200, item)
                return
            if isinstance(item, Failed):
                for f in encoder.fail(item.message, item.status):
                    yield f
                logged(item.status, None)
                return
            if isinstance(item, Restarted):  # nothing was sent before a restart
                continue
            if not isinstance(item, Ping | Logprobs):
                # Output now reaches the client: a fault can no longer run it again. Text the
                # parser still holds back (a tool call's start) has not, so it still can.
                events.mark_delivered()
                if isinstance(item, ToolCall):
                    events.mark_called_tools()
            for f in encoder.feed(item):
                yield f
    for f in encoder.fail(DROPPED, 500):
        yield f


# --- n choices under one answer ----------------------------------------------------------


async def _answer_choices(
    state: ServerState, call: Call, logged
) -> dict | list | AsyncIterator[Frame]:
    """Run a request's n choices (each its own seed, `choice_request`) of each of its
    prompts as one answer."""
    requests = call.requests()
    try:
        events = state.scheduler.submit_choices(requests)
    except NotReady:
        raise not_ready() from None
    except QueueFull as exc:
        raise queue_full(str(exc), whole_queue=exc.whole_queue) from None
    encoders = [call.encoder, *(call.encoder.choice(i) for i in range(1, len(requests)))]
    if call.request.stream:
        return _stream_choices(events, call, encoders, logged)
    answers = await _collect_choices(events, call.prompt, logged)
    done = answer_end([a.done for a in answers], call.choices)
    logged(200, done)
    choices = [e.whole_choice(a) for e, a in zip(encoders, answers, strict=True)]
    return call.encoder.whole_answer(choices, done)


def answer_end(ends: list[Finished], n: int) -> Finished:
    """How an answer of n choices a prompt ended: choice 0's end, with the usage of all of
    them (each prompt once, every choice's completion tokens: OpenAI's count)."""
    first, prompts = ends[0], ends[::n]
    usage = Usage(
        prompt_tokens=sum(e.usage.prompt_tokens for e in prompts),
        completion_tokens=sum(e.usage.completion_tokens for e in ends),
        cached_tokens=sum(e.usage.cached_tokens for e in prompts),
    )
    return attrs.evolve(first, usage=usage, reasoning_tokens=sum(e.reasoning_tokens for e in ends))


async def _collect_choices(events: ChoiceEvents, prompt, logged) -> list[Answer]:
    """Read every choice's answer to its end (as `chat.collect` reads one); the first
    failure is the request's error. The choices are released however this ends."""
    n = len(events.sequences)
    items: list[list] = [[] for _ in range(n)]
    logprobs: list[list] = [[] for _ in range(n)]
    answers: list[Answer | None] = [None] * n
    async with events, ChoiceItems(prompt, n) as reader:
        async for index, event in events:
            for item in await reader.read(index, event):
                if isinstance(item, Logprobs):
                    logprobs[index].extend(item.entries)
                elif isinstance(item, Finished):
                    answers[index] = Answer(merge(items[index]), item, tuple(logprobs[index]))
                    if answers[index].calls:
                        events.mark_called_tools(index)
                elif isinstance(item, Failed):
                    logged(item.status, None)
                    raise failure(item)
                elif isinstance(item, Restarted):  # the engine failed before it was sent
                    items[index], logprobs[index] = [], []
                else:
                    items[index].append(item)
            if all(answers):
                return answers
    raise ApiError(500, DROPPED, type="server_error")


async def _stream_choices(
    events: ChoiceEvents, call: Call, encoders: list[ChoicesEncoder], logged
) -> AsyncIterator[Frame]:
    """Every choice's events as they come, each with its index; the usage and the stream's
    end once, after the last choice's end. The choices are cancelled however this ends."""
    ends: list[Finished | None] = [None] * len(encoders)
    async with events, ChoiceItems(call.prompt, len(encoders)) as reader:
        for encoder in encoders:
            for f in encoder.start(None):
                yield f
        async for index, event in events:
            encoder = encoders[index]
            if call.tally is not None:
                call.tally.count(index, event)
            for item in await reader.read(index, event):
                if isinstance(item, Finished):
                    ends[index] = item
                    for f in encoder.finish_choice(item):
                        yield f
                elif isinstance(item, Failed):
                    for f in encoder.fail(item.message, item.status):
                        yield f
                    logged(item.status, None)
                    return
                elif not isinstance(item, Restarted):  # nothing of it was sent before that
                    if not isinstance(item, Logprobs):
                        events.mark_delivered(index)
                        if isinstance(item, ToolCall):
                            events.mark_called_tools(index)
                    for f in encoder.feed(item):
                        yield f
            if all(ends):
                done = answer_end(ends, call.choices)
                for f in call.encoder.finish_answer(done):
                    yield f
                logged(200, done)
                return
    for f in call.encoder.fail(DROPPED, 500):
        yield f


class ChoiceItems:
    """Each choice's events read as `chat.parsed` (or `chat.plain_events`) reads one
    request's: the choices' events come in one channel, and each choice's parser is handed
    its own, in order, as they come."""

    # parsed()'s clock: a choice's parser waiting this long for an event has read all it was
    # handed (it gives a Ping), so its next event can wait while the other choices go on.
    DRAINED = 1e-9

    def __init__(self, prompt: ChatPrompt | None, n: int):
        self.inboxes = [_Inbox() for _ in range(n)]
        self.plain = [chat.PlainText() for _ in range(n)]
        self.parsers = (
            None
            if prompt is None
            else [chat.parsed(inbox, prompt, ping_every=self.DRAINED) for inbox in self.inboxes]
        )

    async def read(self, index: int, event) -> list:
        """What choice `index`'s parser makes of its next event."""
        if self.parsers is None:  # plain text
            return self.plain[index].read(event)
        self.inboxes[index].events.append(event)
        parser, items = self.parsers[index], []
        while not isinstance(item := await anext(parser), Ping):
            items.append(item)
        return items

    async def __aenter__(self) -> ChoiceItems:
        return self

    async def __aexit__(self, *exc) -> None:
        for parser in self.parsers or ():
            await parser.aclose()


class _Inbox:
    """One choice's events handed to its parser; with none there, it waits (for ever: the
    parser's clock cuts that short)."""

    def __init__(self):
        self.events: collections.deque = collections.deque()

    async def receive(self):
        if self.events:
            return self.events.popleft()  # at once: no checkpoint, so never cut short
        await trio.sleep_forever()
