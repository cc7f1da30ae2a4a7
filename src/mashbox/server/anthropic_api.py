"""Anthropic Messages and count_tokens, rendering the shared chat pipeline's events."""

from __future__ import annotations

import json
import os
import secrets
import time

from ..events import Failed, Finished, Restarted
from ..text.parser import Reasoning, ToolCall
from . import chat
from .chat import Ping, ToolChoice
from .errors import bad_request, not_ready
from .generation import build_request, encode_prompt, log_request, log_tag
from .openai_api import OneFieldEvent, event_stream, logged_failure, submit
from .state import ServerState
from .validate import Body

SIGNATURE = "mashbox-local"
# Seconds of silence before a ping: Claude Code treats a quiet stream as stalled.
# MASHBOX_PING_SECONDS changes it (tests make it short).
PING_EVERY = float(os.environ.get("MASHBOX_PING_SECONDS", "5"))
_MEDIA = ("image", "document", "audio", "file", "search_result", "container_upload")
# Seed 001: input thinking / redacted_thinking blocks and unknown block types are ignored;
# a document block is read when its source is text ("not PDFs").


def _block_text(block: dict, at: str) -> str | None:
    """A block's text for the model: text and text documents; None for a block that is
    ignored; a 400 for media this model cannot read."""
    kind = block.get("type")
    if kind == "text" and isinstance(block.get("text"), str):
        return block["text"]
    source = block.get("source")
    if kind == "document" and isinstance(source, dict) and source.get("type") == "text":
        if not isinstance(source.get("data"), str):
            raise bad_request(f"{at}.source.data must be a string")
        return source["data"]
    if kind in _MEDIA:
        raise bad_request(f"{at} is a {kind} block: this model reads text only")
    return None  # thinking, redacted_thinking and unknown types (seed 001)


def _text_of(blocks, where: str) -> str:
    """Text of a string or a list of text blocks (system prompts, tool results)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise bad_request(f"{where} must be a string or a list of text blocks")
    parts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict):
            raise bad_request(f"{where}[{j}] must be a text block")
        text = _block_text(block, f"{where}[{j}]")
        if text is not None:
            parts.append(text)
    return "\n".join(parts)


def _user_blocks(blocks: list, where: str) -> list[dict]:
    """A user turn: tool results become tool messages (first), text a user message."""
    results, texts = [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if not isinstance(block, dict):
            raise bad_request(f"{at} must be a content block")
        if block.get("type") == "tool_result":
            content = block.get("content")
            text = _text_of(content, f"{at}.content") if content is not None else ""
            if block.get("is_error"):
                text = f"Error: {text}"
            results.append(
                {"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": text}
            )
        elif (text := _block_text(block, at)) is not None:
            texts.append(text)
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts else [])


def _assistant_blocks(blocks: list, where: str) -> dict:
    """An assistant turn: text, thinking (given back to the template) and tool_use blocks."""
    texts, thinking, calls = [], [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "thinking":
            thinking.append(str(block.get("thinking", "")))
        elif kind == "redacted_thinking":
            continue  # opaque to us: nothing to give back
        elif kind in ("tool_use", "server_tool_use"):
            if not isinstance(block.get("name"), str):
                raise bad_request(f"{at}.name is required")
            arguments = block.get("input") if isinstance(block.get("input"), dict) else {}
            calls.append(
                {
                    "id": str(block.get("id", "")),
                    "type": "function",
                    "function": {"name": block["name"], "arguments": arguments},
                }
            )
        elif kind in _MEDIA:
            raise bad_request(f"{at} is a {kind} block: this model reads text only")
        # other types are ignored (seed 001)
    message = {"role": "assistant", "content": "".join(texts)}
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def messages_of(body: Body) -> list[dict]:
    """HF-style messages from `system` and `messages`."""
    system = []
    if body.has("system"):
        system.append(_text_of(body.raw("system"), "system"))
    messages = body.list("messages")
    if not messages:
        raise bad_request("messages must be a non-empty array")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object")
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant", "system", "developer"):
            raise bad_request(f"{where}.role must be user or assistant")
        if content is None:
            raise bad_request(f"{where}.content is required")
        if role in ("system", "developer"):
            system.append(_text_of(content, f"{where}.content"))
        elif isinstance(content, str):
            out.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise bad_request(f"{where}.content must be a string or a list of blocks")
        elif role == "user":
            out.extend(_user_blocks(content, where))
        else:
            out.append(_assistant_blocks(content, where))
    head = [{"role": "system", "content": "\n\n".join(system)}] if system else []
    return head + out


def tools_of(body: Body) -> list[dict] | None:
    """Client tools as function tools; server tools (web search and others) are refused."""
    tools = body.list("tools")
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise bad_request(f"tools[{i}].name is required")
        if tool.get("type") not in (None, "custom"):
            raise bad_request(
                f"tools[{i}] ('{tool['name']}', type {tool['type']}) is a server tool: "
                "only client tools (custom) run here"
            )
        function = {"name": tool["name"]}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        function["parameters"] = tool.get("input_schema") or {"type": "object", "properties": {}}
        out.append({"type": "function", "function": function})
    return out


def tool_choice_of(body: Body) -> ToolChoice:
    value = body.raw("tool_choice")
    if value is None:
        return ToolChoice()
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in ("auto", "none"):
        return ToolChoice(kind)
    if kind == "any":
        return ToolChoice("required")
    if kind == "tool" and isinstance(value.get("name"), str):
        return ToolChoice("function", value["name"])
    raise bad_request("tool_choice must be {'type': 'auto' | 'any' | 'tool' | 'none', 'name'}")


def thinking_of(body: Body) -> bool:
    thinking = body.object("thinking")
    if thinking is None:
        return False
    kind = thinking.raw("type")
    if kind not in ("enabled", "adaptive", "disabled"):
        raise bad_request("thinking.type must be enabled, adaptive or disabled")
    return kind != "disabled"


def prompt_of(state: ServerState, body: Body) -> chat.ChatPrompt:
    output_config = body.object("output_config")
    if output_config is not None and output_config.has("format"):
        raise bad_request("output_config.format is not supported (no structured output)")
    return chat.render(
        state,
        messages_of(body),
        tools=tools_of(body),
        tool_choice=tool_choice_of(body),
        thinking=thinking_of(body),
    )


async def count_tokens(state: ServerState, data, tenant: str = "") -> dict:
    """Prompt tokens after the chat template: what the model would see."""
    if not state.ready:
        raise not_ready()
    prompt = prompt_of(state, Body(data))
    return {
        "input_tokens": len(
            await encode_prompt(state, prompt.text, "messages", tenant=tenant, rendered=True)
        )
    }


def _usage(done: Finished) -> dict:
    u = done.usage
    return {
        "input_tokens": u.prompt_tokens - u.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached_tokens,
        "output_tokens": u.completion_tokens,
    }


def _stop_reason(done: Finished, called_tools: bool) -> str:
    if done.reason == "length":
        return "max_tokens"
    if called_tools:
        return "tool_use"
    return "stop_sequence" if done.stop_sequence is not None else "end_turn"


def _tool_use(call: ToolCall) -> dict:
    return {
        "type": "tool_use",
        "id": "toolu_" + secrets.token_hex(12),
        "name": call.name,
        "input": json.loads(call.arguments),
    }


def _merge_text(blocks: list[dict]) -> list[dict]:
    """Adjacent text blocks (content beside unparsed markup) are one block."""
    out: list[dict] = []
    for block in blocks:
        if out and block["type"] == out[-1]["type"] == "text":
            out[-1] = {"type": "text", "text": out[-1]["text"] + block["text"]}
        else:
            out.append(block)
    return out


def _sse(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


async def messages(state: ServerState, data, headers, tenant: str = ""):
    if not state.ready:
        raise not_ready()
    t0 = time.perf_counter()
    body = Body(data)
    prompt = prompt_of(state, body)
    ids = await encode_prompt(state, prompt.text, "messages", tenant=tenant, rendered=True)
    request = build_request(body, state, ids, tenant)
    session = log_tag(body, headers, tenant)
    seq, events = submit(state, request)
    mid = "msg_" + secrets.token_hex(12)
    model = body.str("model") or state.model_id
    route = "/v1/messages"

    if not request.stream:
        fail = logged_failure(route, session, t0)
        answer = await chat.collect(state, seq, events, prompt, fail)
        done, blocks = answer.done, []
        for event in answer.events:
            if isinstance(event, Reasoning):
                blocks.append({"type": "thinking", "thinking": event.text, "signature": SIGNATURE})
            elif isinstance(event, ToolCall):
                blocks.append(_tool_use(event))
            else:  # Content, or tool-call markup that did not parse
                blocks.append({"type": "text", "text": event.text})
        blocks = _merge_text(blocks)
        called = any(b["type"] == "tool_use" for b in blocks)
        if called:  # whitespace around calls is not an answer
            blocks = [b for b in blocks if b["type"] != "text" or b["text"].strip()]
        log_request(route, 200, done, session, t0)
        return {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": blocks,
            "stop_reason": _stop_reason(done, called),
            "stop_sequence": done.stop_sequence,
            "usage": _usage(done),
        }

    async def stream():
        index = -1
        open_kind = None  # "text" or "thinking": the block now open
        piece = None  # the open block's delta event, its text left open (OneFieldEvent)
        called = False

        def close():
            nonlocal open_kind
            out = []
            if open_kind == "thinking":
                delta = {"type": "signature_delta", "signature": SIGNATURE}
                out.append(
                    _sse(
                        "content_block_delta",
                        {"type": "content_block_delta", "index": index, "delta": delta},
                    )
                )
            if open_kind is not None:
                out.append(
                    _sse("content_block_stop", {"type": "content_block_stop", "index": index})
                )
            open_kind = None
            return out

        def start(block: dict):
            nonlocal index
            index += 1
            return _sse(
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": block},
            )

        def delta(d: dict):
            return _sse(
                "content_block_delta", {"type": "content_block_delta", "index": index, "delta": d}
            )

        try:
            async with events:
                # Seed 000: input_tokens is the part not served from cache. It is known once
                # the request has a slot (at once, unless it queues: then, after a ping's
                # wait, the whole prompt is counted here and the final usage corrects it).
                cached, source = await chat.admission(events, PING_EVERY)
                usage = {"input_tokens": len(ids) - (cached or 0),
                         "cache_creation_input_tokens": 0,
                         "cache_read_input_tokens": cached or 0, "output_tokens": 0}  # fmt: skip
                message = {
                    "id": mid, "type": "message", "role": "assistant", "model": model,
                    "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage,
                }  # fmt: skip
                yield _sse("message_start", {"type": "message_start", "message": message})
                yield _sse("ping", {"type": "ping"})
                async for event in chat.parsed(source, prompt, seq, ping_every=PING_EVERY):
                    if isinstance(event, Ping):
                        yield _sse("ping", {"type": "ping"})
                    elif isinstance(event, Reasoning):
                        if open_kind != "thinking":
                            for chunk in close():
                                yield chunk
                            yield start({"type": "thinking", "thinking": "", "signature": ""})
                            open_kind = "thinking"
                            piece = OneFieldEvent(
                                lambda t: delta({"type": "thinking_delta", "thinking": t})
                            )
                        yield piece(event.text)
                    elif isinstance(event, ToolCall):
                        for chunk in close():
                            yield chunk
                        block = _tool_use(event)
                        arguments = json.dumps(block.pop("input"), ensure_ascii=False)
                        yield start({**block, "input": {}})
                        yield delta({"type": "input_json_delta", "partial_json": arguments})
                        yield _sse(
                            "content_block_stop", {"type": "content_block_stop", "index": index}
                        )
                        called = True
                    elif isinstance(event, Finished):
                        for chunk in close():
                            yield chunk
                        stop = {"stop_reason": _stop_reason(event, called),
                                "stop_sequence": event.stop_sequence}  # fmt: skip
                        yield _sse(
                            "message_delta",
                            {"type": "message_delta", "delta": stop, "usage": _usage(event)},
                        )
                        yield _sse("message_stop", {"type": "message_stop"})
                        log_request(route, 200, event, session, t0)
                        return
                    elif isinstance(event, Failed):
                        kind = "overloaded_error" if event.status == 503 else "api_error"
                        error = {"type": kind, "message": event.message}
                        yield _sse("error", {"type": "error", "error": error, "request_id": mid})
                        log_request(route, event.status, None, session, t0)
                        return
                    elif not isinstance(event, Restarted):  # Content or InvalidToolCall
                        if called and not event.text.strip():
                            continue  # whitespace between tool calls
                        if open_kind != "text":
                            for chunk in close():
                                yield chunk
                            yield start({"type": "text", "text": ""})
                            open_kind = "text"
                            piece = OneFieldEvent(
                                lambda t: delta({"type": "text_delta", "text": t})
                            )
                        yield piece(event.text)
            error = {"type": "api_error", "message": "the request was dropped before it finished"}
            yield _sse("error", {"type": "error", "error": error, "request_id": mid})
        finally:
            state.scheduler.cancel(seq)

    return event_stream(stream())
