"""OpenAI Chat Completions and Completions: parse, submit to the scheduler, render events."""

from __future__ import annotations

import json
import secrets
import time

import attrs
from quart import Response

from ..events import Failed, Finished, NotReady, QueueFull, Request, Restarted, TextDelta
from ..text.parser import Reasoning, ToolCall
from . import chat
from .chat import ToolChoice
from .errors import ApiError, bad_request, not_ready, queue_full
from .generation import build_request, check_model, encode_prompt, log_request, log_tag
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
        raise queue_full(str(exc), whole_queue=exc.whole_queue) from None


def logged_failure(route: str, session: str, t0: float):
    """The error for a failed answer, after its log line."""

    def fail(event: Failed) -> ApiError:
        log_request(route, event.status, None, session, t0)
        return failure(event)

    return fail


def failure(event: Failed) -> ApiError:
    if event.status == 503:
        return ApiError(503, event.message, type="unavailable", headers={"Retry-After": "5"})
    code = "backend_timeout" if event.status == 504 else None  # seed 004's name for it
    return ApiError(event.status, event.message, type="server_error", code=code)


# --- request parsing -------------------------------------------------------------------------


def message_text(content, where: str) -> str:
    """A message's content as text: a string, a list of text parts, or null."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of parts", "messages")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("text", "input_text", "output_text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("image_url", "input_image", "input_audio", "file", "image", "audio"):
            raise bad_request(
                f"{where}.content[{j}] is a {kind} part: this model reads text only", "messages"
            )
        else:
            raise bad_request(f"{where}.content[{j}] must be a text part", "messages")
    return "".join(texts)


def _tool_calls(value, where: str) -> list[dict]:
    if not isinstance(value, list):
        raise bad_request(f"{where}.tool_calls must be an array", "messages")
    calls = []
    for j, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"{where}.tool_calls[{j}].function.name is required", "messages")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str | dict):
            raise bad_request(
                f"{where}.tool_calls[{j}].function.arguments must be a string", "messages"
            )
        calls.append(
            {
                "id": str(call.get("id") or f"call_{j}"),
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return calls


def chat_messages(body: Body) -> list[dict]:
    """HF-style messages; system and developer join one leading system prompt."""
    messages = body.list("messages")
    if not messages:
        raise bad_request("messages must be a non-empty array", "messages")
    system, rest = [], []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object", "messages")
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise bad_request(
                f"{where}.role must be one of {', '.join(sorted(_ROLES))}", "messages"
            )
        text = message_text(m.get("content"), where)
        if role in ("system", "developer"):
            system.append(text)
            continue
        out = {"role": "tool" if role == "function" else role, "content": text}
        if role == "assistant" and m.get("tool_calls"):
            out["tool_calls"] = _tool_calls(m["tool_calls"], where)
        if role == "assistant" and isinstance(m.get("reasoning_content"), str):
            out["reasoning_content"] = m["reasoning_content"]
        if out["role"] == "tool":
            out["tool_call_id"] = str(m.get("tool_call_id") or "")
            if isinstance(m.get("name"), str):
                out["name"] = m["name"]
        rest.append(out)
    head = [{"role": "system", "content": "\n\n".join(system)}] if system else []
    return head + rest


def chat_tools(body: Body) -> list[dict] | None:
    """Function tools, normalised to {"type": "function", "function": {...}}."""
    tools = body.list("tools")
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise bad_request(f"tools[{i}] must be a function tool", "tools")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"tools[{i}].function.name is required", "tools")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_request(f"tools[{i}].function.parameters must be an object", "tools")
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(body: Body) -> ToolChoice:
    value = body.raw("tool_choice", "auto")
    if value in ("auto", "none", "required"):
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type") == "function":
        name = (value.get("function") or {}).get("name")
        if isinstance(name, str):
            return ToolChoice("function", name)
    raise bad_request(
        "tool_choice must be auto, none, required or {'type': 'function', 'function': "
        "{'name': ...}}",
        "tool_choice",
    )


def thinking_requested(body: Body) -> bool:
    kwargs = body.object("chat_template_kwargs")
    if kwargs is not None and kwargs.has("enable_thinking"):
        return kwargs.bool("enable_thinking")
    return body.bool("enable_thinking", False)


def _refuse_unsupported(body: Body) -> None:
    body.refuse("logprobs", "log probabilities are not returned")
    body.refuse("top_logprobs", "log probabilities are not returned")
    fmt = body.object("response_format")
    if fmt is not None and fmt.raw("type", "text") != "text":
        raise bad_request(
            "response_format: only {'type': 'text'} is supported (no structured output)",
            "response_format",
        )


def include_usage(body: Body) -> bool:
    options = body.object("stream_options")
    return bool(options and options.bool("include_usage", False))


# --- rendering -------------------------------------------------------------------------------


def sse(obj) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


class OneFieldEvent:
    """A stream's per-token event, rendered once with one string field left open.

    json.dumps of the whole event for every token is a measurable share of the server's
    time per token; only the text changes."""

    _OPEN = "\x00open\x00"

    def __init__(self, render):
        """render(text) -> the event's bytes (by `sse`), text being its last string."""
        self.head, _, self.tail = render(self._OPEN).rpartition(json.dumps(self._OPEN).encode())
        assert self("probe") == render("probe")

    def __call__(self, text: str) -> bytes:
        return self.head + json.dumps(text, ensure_ascii=False).encode() + self.tail


def event_stream(chunks) -> Response:
    response = Response(chunks, mimetype="text/event-stream")
    response.headers["Cache-Control"] = "no-cache"
    response.headers["X-Accel-Buffering"] = "no"
    response.timeout = None  # long streams must not be cut
    return response


def usage_dict(usage, *, details: bool = True) -> dict:
    out = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }
    if details:
        out["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens}
    return out


def stream_error(rid: str, message: str) -> bytes:
    return sse({"error": {"message": message, "type": "server_error", "request_id": rid}})


def _tool_call_dict(call: ToolCall) -> dict:
    return {
        "id": "call_" + secrets.token_hex(12),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


# --- routes ----------------------------------------------------------------------------------


async def chat_completions(state: ServerState, data, headers, tenant: str = ""):
    if not state.ready:
        raise not_ready()
    t0 = time.perf_counter()
    body = Body(data)
    check_model(body, state)
    _refuse_unsupported(body)
    prompt = chat.render(
        state,
        chat_messages(body),
        tools=chat_tools(body),
        tool_choice=chat_tool_choice(body),
        thinking=thinking_requested(body),
    )
    ids = await encode_prompt(state, prompt.text, "messages", tenant=tenant, rendered=True)
    request = build_request(body, state, ids, tenant)
    usage_chunk = include_usage(body)
    session = log_tag(body, headers, tenant)
    seq, events = submit(state, request)
    rid = "chatcmpl-" + secrets.token_hex(12)
    base = {"id": rid, "created": int(time.time()), "model": state.model_id}
    fingerprint = f"seed-{request.params.seed}"
    route = "/v1/chat/completions"

    if not request.stream:
        fail = logged_failure(route, session, t0)
        answer = await chat.collect(state, seq, events, prompt, fail)
        done, calls = answer.done, [_tool_call_dict(c) for c in answer.calls]
        text = answer.text()
        message = {"role": "assistant", "content": text if text.strip() or not calls else None}
        if reasoning := answer.text(Reasoning):
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        log_request(route, 200, done, session, t0)
        return {
            **base,
            "object": "chat.completion",
            "system_fingerprint": fingerprint,
            "choices": [
                {"index": 0, "message": message, "finish_reason": chat.finish_reason(done, calls)}
            ],
            "usage": usage_dict(done.usage),
            "timings": attrs.asdict(done.timings),
        }

    def chunk(delta: dict, finish=None, **extra) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return sse(
            {
                **base,
                "object": "chat.completion.chunk",
                "system_fingerprint": fingerprint,
                "choices": [choice],
                **extra,
            }
        )

    content_chunk = OneFieldEvent(lambda text: chunk({"content": text}))

    async def chunks():
        n_calls = 0
        try:
            yield chunk({"role": "assistant", "content": ""})
            async with events:
                async for event in chat.parsed(events, prompt, seq):
                    if isinstance(event, Reasoning):
                        yield chunk({"reasoning_content": event.text})
                    elif isinstance(event, ToolCall):
                        call = {"index": n_calls, **_tool_call_dict(event)}
                        n_calls += 1
                        yield chunk({"tool_calls": [call]})
                    elif isinstance(event, Finished):
                        timings = attrs.asdict(event.timings)
                        yield chunk({}, chat.finish_reason(event, n_calls), timings=timings)
                        if usage_chunk:
                            yield sse(
                                {
                                    **base,
                                    "object": "chat.completion.chunk",
                                    "choices": [],
                                    "usage": usage_dict(event.usage),
                                    "timings": timings,
                                }
                            )
                        yield sse("[DONE]")
                        log_request(route, 200, event, session, t0)
                        return
                    elif isinstance(event, Failed):
                        yield stream_error(rid, event.message)
                        log_request(route, event.status, None, session, t0)
                        return
                    elif not isinstance(event, Restarted):  # Content or InvalidToolCall
                        yield content_chunk(event.text)
            yield stream_error(rid, "the request was dropped before it finished")
        finally:
            state.scheduler.cancel(seq)

    return event_stream(chunks())


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


async def completions(state: ServerState, data, headers, tenant: str = ""):
    if not state.ready:
        raise not_ready()
    t0 = time.perf_counter()
    body = Body(data)
    check_model(body, state)
    body.refuse("logprobs", "log probabilities are not returned")
    ids = await encode_prompt(state, completion_prompt(body), "prompt", tenant=tenant)
    request = build_request(body, state, ids, tenant)
    usage_chunk = include_usage(body)
    session = log_tag(body, headers, tenant)
    seq, events = submit(state, request)
    rid = "cmpl-" + secrets.token_hex(12)
    base = {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": state.model_id,
        "system_fingerprint": f"seed-{request.params.seed}",
    }
    route = "/v1/completions"

    if not request.stream:
        fail = logged_failure(route, session, t0)
        answer = await chat.collect(state, seq, events, None, fail)
        done = answer.done
        log_request(route, 200, done, session, t0)
        return {
            **base,
            "choices": [{"index": 0, "text": answer.text(), "finish_reason": done.reason}],
            "usage": usage_dict(done.usage, details=False),
            "timings": attrs.asdict(done.timings),
        }

    def choice(text: str, finish=None) -> dict:
        return {"index": 0, "text": text, "finish_reason": finish}

    text_chunk = OneFieldEvent(lambda text: sse({**base, "choices": [choice(text)]}))

    async def chunks():
        try:
            async with events:
                async for event in events:
                    if isinstance(event, TextDelta):
                        seq.delivered = True
                        yield text_chunk(event.text)
                    elif isinstance(event, Finished):
                        timings = attrs.asdict(event.timings)
                        yield sse(
                            {**base, "choices": [choice("", event.reason)], "timings": timings}
                        )
                        if usage_chunk:
                            usage = usage_dict(event.usage, details=False)
                            yield sse({**base, "choices": [], "usage": usage})
                        yield sse("[DONE]")
                        log_request(route, 200, event, session, t0)
                        return
                    elif isinstance(event, Failed):
                        yield stream_error(rid, event.message)
                        log_request(route, event.status, None, session, t0)
                        return
            yield stream_error(rid, "the request was dropped before it finished")
        finally:
            state.scheduler.cancel(seq)

    return event_stream(chunks())
