"""OpenAI Chat Completions and Completions: parse, submit to the scheduler, render."""

from __future__ import annotations

import json
import secrets
import time

import attrs
from quart import Response

from ..scheduler import Failed, Finished, NotReady, QueueFull, Request, Restarted, TextDelta
from ..text.chat_template import ChatTemplateError
from .errors import ApiError, bad_request, not_ready
from .generation import build_request, check_model
from .state import ServerState
from .validate import Body

_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


def submit(state: ServerState, request: Request):
    """Queue a request, turning scheduler refusals into the route's error responses."""
    try:
        return state.scheduler.submit(request)
    except NotReady:
        raise not_ready() from None
    except QueueFull as exc:
        raise ApiError(
            429, str(exc), type="rate_limit_error", headers={"Retry-After": "1"}
        ) from None


def message_text(content, where: str) -> str:
    """A message's content as text: a string, a list of text parts, or null."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("text", "input_text", "output_text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("image_url", "input_image", "input_audio", "file", "image", "audio"):
            raise bad_request(
                f"{where}.content[{j}] is a {kind} part: this model reads text only", where
            )
        else:
            raise bad_request(f"{where}.content[{j}] must be a text part", where)
    return "".join(texts)


def chat_messages(body: Body) -> list[dict]:
    """Messages for the chat template; system and developer join one leading system prompt."""
    messages = body.list("messages")
    if not messages:
        raise bad_request("messages must be a non-empty array", "messages")
    system, rest = [], []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object", "messages")
        role = m.get("role")
        if role not in _ROLES:
            raise bad_request(
                f"{where}.role must be one of {', '.join(sorted(_ROLES))}", "messages"
            )
        text = message_text(m.get("content"), where)
        if role in ("system", "developer"):
            system.append(text)
            continue
        out = {"role": "tool" if role == "function" else role, "content": text}
        for key in ("tool_calls", "tool_call_id", "reasoning_content", "name"):
            if m.get(key) is not None:
                out[key] = m[key]
        rest.append(out)
    head = [{"role": "system", "content": "\n\n".join(system)}] if system else []
    return head + rest


def _thinking(body: Body) -> bool:
    kwargs = body.object("chat_template_kwargs")
    if kwargs is not None and kwargs.has("enable_thinking"):
        return kwargs.bool("enable_thinking")
    return body.bool("enable_thinking", False)


def _refuse_unsupported(body: Body) -> None:
    body.refuse("logprobs", "log probabilities are not returned")
    body.refuse("top_logprobs", "log probabilities are not returned")
    fmt = body.object("response_format")
    if fmt is not None and fmt.raw("type", "text") != "text":
        raise bad_request("response_format: only {'type': 'text'} is supported", "response_format")


def _include_usage(body: Body) -> bool:
    options = body.object("stream_options")
    return bool(options and options.bool("include_usage", False))


def _sse(obj) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def _event_stream(chunks) -> Response:
    response = Response(chunks, mimetype="text/event-stream")
    response.headers["Cache-Control"] = "no-cache"
    response.headers["X-Accel-Buffering"] = "no"
    response.timeout = None  # long streams must not be cut
    return response


def _usage_dict(usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def _failure(event: Failed) -> ApiError:
    if event.status == 503:
        return ApiError(503, event.message, type="unavailable", headers={"Retry-After": "5"})
    return ApiError(event.status, event.message, type="server_error")


async def _collect(state, seq, events) -> tuple[str, Finished]:
    """Gather a whole answer (non-streamed requests)."""
    parts = []
    try:
        async with events:
            async for event in events:
                if isinstance(event, TextDelta):
                    parts.append(event.text)
                elif isinstance(event, Restarted):
                    parts.clear()
                elif isinstance(event, Finished):
                    return "".join(parts), event
                elif isinstance(event, Failed):
                    raise _failure(event)
    finally:
        state.scheduler.cancel(seq)
    raise ApiError(500, "the request was dropped before it finished", type="server_error")


async def chat_completions(state: ServerState, data, tenant: str = ""):
    if not state.ready:
        raise not_ready()
    body = Body(data)
    check_model(body, state)
    _refuse_unsupported(body)
    messages = chat_messages(body)
    try:
        prompt = state.template.render(
            messages, add_generation_prompt=True, enable_thinking=_thinking(body)
        )
    except ChatTemplateError as exc:
        raise bad_request(f"the chat template refused these messages: {exc}", "messages") from None
    ids = state.tokenizer.encode(prompt, add_bos=state.tokenizer.add_bos)
    request = build_request(body, state, ids, tenant)
    stream = body.bool("stream", False)
    include_usage = _include_usage(body)
    seq, events = submit(state, request)
    rid = "chatcmpl-" + secrets.token_hex(12)
    created = int(time.time())
    base = {"id": rid, "created": created, "model": state.model_id}
    fingerprint = f"seed-{request.params.seed}"

    if not stream:
        text, done = await _collect(state, seq, events)
        return {
            **base,
            "object": "chat.completion",
            "system_fingerprint": fingerprint,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": done.reason,
                }
            ],
            "usage": _usage_dict(done.usage),
            "timings": attrs.asdict(done.timings),
        }

    def chunk(delta: dict, finish=None, **extra) -> bytes:
        return _sse(
            {
                **base,
                "object": "chat.completion.chunk",
                "system_fingerprint": fingerprint,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                **extra,
            }
        )

    async def chunks():
        try:
            yield chunk({"role": "assistant", "content": ""})
            async with events:
                async for event in events:
                    if isinstance(event, TextDelta):
                        yield chunk({"content": event.text})
                    elif isinstance(event, Finished):
                        timings = attrs.asdict(event.timings)
                        yield chunk({}, event.reason, timings=timings)
                        if include_usage:
                            yield _sse(
                                {
                                    **base,
                                    "object": "chat.completion.chunk",
                                    "choices": [],
                                    "usage": _usage_dict(event.usage),
                                    "timings": timings,
                                }
                            )
                        yield _sse("[DONE]")
                        return
                    elif isinstance(event, Failed):
                        yield _stream_error(rid, event.message)
                        return
            yield _stream_error(rid, "the request was dropped before it finished")
        finally:
            state.scheduler.cancel(seq)

    return _event_stream(chunks())


def _stream_error(rid: str, message: str) -> bytes:
    return _sse({"error": {"message": message, "type": "server_error", "request_id": rid}})


def completion_prompt(body: Body) -> str:
    """`prompt`: a string, or a list of one string."""
    prompt = body.raw("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad_request("prompt must be a string or a list of one string", "prompt")
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    return prompt


async def completions(state: ServerState, data, tenant: str = ""):
    if not state.ready:
        raise not_ready()
    body = Body(data)
    check_model(body, state)
    body.refuse("logprobs", "log probabilities are not returned")
    prompt = completion_prompt(body)
    ids = state.tokenizer.encode(prompt, add_bos=state.tokenizer.add_bos)
    request = build_request(body, state, ids, tenant)
    stream = body.bool("stream", False)
    include_usage = _include_usage(body)
    seq, events = submit(state, request)
    rid = "cmpl-" + secrets.token_hex(12)
    base = {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": state.model_id,
        "system_fingerprint": f"seed-{request.params.seed}",
    }

    def usage_dict(usage):
        d = _usage_dict(usage)
        d.pop("prompt_tokens_details")
        return d

    if not stream:
        text, done = await _collect(state, seq, events)
        return {
            **base,
            "choices": [{"index": 0, "text": text, "finish_reason": done.reason}],
            "usage": usage_dict(done.usage),
            "timings": attrs.asdict(done.timings),
        }

    async def chunks():
        try:
            async with events:
                async for event in events:
                    if isinstance(event, TextDelta):
                        yield _sse(
                            {
                                **base,
                                "choices": [
                                    {"index": 0, "text": event.text, "finish_reason": None}
                                ],
                            }
                        )
                    elif isinstance(event, Finished):
                        timings = attrs.asdict(event.timings)
                        choice = {"index": 0, "text": "", "finish_reason": event.reason}
                        yield _sse({**base, "choices": [choice], "timings": timings})
                        if include_usage:
                            yield _sse({**base, "choices": [], "usage": usage_dict(event.usage)})
                        yield _sse("[DONE]")
                        return
                    elif isinstance(event, Failed):
                        yield _stream_error(rid, event.message)
                        return
            yield _stream_error(rid, "the request was dropped before it finished")
        finally:
            state.scheduler.cancel(seq)

    return _event_stream(chunks())
