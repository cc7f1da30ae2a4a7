"""Protocol conformance: each route's whole answer held against its shape, and its stream
against the SSE framing and its protocol's event order. A route that answers 404 raises
NotServed (the case is skipped)."""

from __future__ import annotations

from . import shapes, sse, streams
from .client import NotServed, Server
from .results import Result, failed, held

PROMPT = "Say hello to the sea."
MAX_TOKENS = 16  # OpenAI's least max_output_tokens for Responses


def chat(server: Server, model: str) -> Result:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}]}
    body["max_tokens"] = MAX_TOKENS
    found = _whole(server, "/v1/chat/completions", body, shapes.CHAT_COMPLETION)
    found += _streamed(server, "/v1/chat/completions", body, streams.chat_stream)
    return _verdict(found)


def completions(server: Server, model: str) -> Result:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS}
    found = _whole(server, "/v1/completions", body, shapes.COMPLETION)
    found += _streamed(server, "/v1/completions", body, streams.completions_stream)
    return _verdict(found)


def responses(server: Server, model: str) -> Result:
    body = {"model": model, "input": PROMPT, "max_output_tokens": MAX_TOKENS}
    found = _whole(server, "/v1/responses", body, shapes.RESPONSE)
    found += _streamed(server, "/v1/responses", body, streams.responses_stream)
    return _verdict(found)


def messages(server: Server, model: str) -> Result:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}]}
    body["max_tokens"] = MAX_TOKENS
    found = _whole(server, "/v1/messages", body, shapes.MESSAGE)
    found += _streamed(server, "/v1/messages", body, streams.messages_stream)
    return _verdict(found)


def _whole(server: Server, path: str, body: dict, shape: dict) -> list[str]:
    """The answer without streaming, against its shape (and its usage's sum)."""
    answer = server.post(path, body)
    found = [f"answer: {line}" for line in shapes.problems(answer, shape)]
    if isinstance(answer, dict):
        if "choices" in shape and answer.get("choices") == []:
            found.append("answer: no choices")
        usage = answer.get("usage")
        if not found and "total_tokens" in shape.get("usage", {}):
            parts = usage["prompt_tokens"] + usage["completion_tokens"]
            if usage["total_tokens"] != parts:
                found.append(f"answer: usage.total_tokens {usage['total_tokens']} is not {parts}")
        if path == "/v1/responses" and answer.get("status") not in ("completed", "incomplete"):
            found.append(f"answer: status {answer.get('status')!r}, not completed or incomplete")
    return found


def _streamed(server: Server, path: str, body: dict, check) -> list[str]:
    """The streamed answer: an event stream, framed as SSE, its events as `check` wants."""
    try:
        with server.stream(path, {**body, "stream": True}) as r:
            kind = r.headers.get("content-type", "")
            raw = r.read()
    except NotServed:
        return ["stream: answers 404 where the whole answer did not"]
    found = [] if kind.startswith("text/event-stream") else [f"stream: content-type {kind!r}"]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return found + [f"stream: not UTF-8 ({e})"]
    events, framing = sse.parse(text)
    return found + [f"stream: {line}" for line in framing + check(events)]


def _verdict(found: list[str]) -> Result:
    if not found:
        return held()
    return failed(f"{len(found)} problem{'s' if len(found) > 1 else ''}", problems=found)
