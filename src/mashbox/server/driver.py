"""The one route driver: every generation protocol (OpenAI chat and completions, Anthropic
messages, OpenAI responses) is a codec, and this runs each of them the same way.

A codec parses a body into a `Call`: the scheduler `Request`, the rendered prompt (how to
read the answer) and an `Encoder`, which turns the parsed answer (reasoning, content, tool
calls, the end or a failure) into that protocol's events without any I/O. The driver owns
everything else: the ready check, submitting, the one retry's bookkeeping, reading the
answer whole or streaming it, the request's log line, and releasing the request from the
scheduler however the client goes. HTTP frames the events as server-sent events; the chat
WebSocket sends the same events as frames.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

import attrs

from ..events import Failed, Finished, NotReady, QueueFull, Request, Restarted
from ..scheduler import RequestEvents
from ..text.parser import ToolCall
from . import chat
from .chat import Answer, ChatPrompt, Logprobs, Ping
from .errors import ApiError, not_ready, queue_full
from .generation import log_request, log_tag
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


@attrs.frozen
class Call:
    """One generation request, parsed: what the scheduler runs and how to answer it."""

    request: Request
    prompt: ChatPrompt | None  # None: plain completions (the text is not parsed)
    encoder: Encoder


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
) -> dict | AsyncIterator[Frame]:
    """Run one generation request: the whole answer's body, or its stream of events."""
    if not state.ready:
        raise not_ready()
    t0 = time.perf_counter()
    body = Body(data)
    call = await parse(state, body, tenant)
    session = log_tag(body, headers, tenant)
    events = submit(state, call.request)

    def logged(status: int, done: Finished | None) -> None:
        log_request(route, status, done, session, t0)

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
