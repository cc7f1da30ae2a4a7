"""Anthropic Messages as a codec (the body parsed into a `Call`, the answer encoded as a
message or its events; driver.py runs both), and count_tokens."""

from __future__ import annotations

import json
import os
import secrets

from ..events import Finished
from ..text.parser import Reasoning, ToolCall
from . import chat, structured
from .chat import Answer, Ping, ToolChoice
from .driver import Call, Frame, OneFieldFrame, frame
from .errors import bad_request, not_ready
from .generation import build_request, encode_prompt, system_fingerprint
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


def answer_schema_of(body: Body) -> structured.AnswerSchema | None:
    """Structured outputs: `output_config.format` (or the beta's `output_format`), a JSON
    schema the answer's text follows; Anthropic's are always strict."""
    config = body.object("output_config")
    if config is not None and config.has("format"):
        fmt, field = config.object("format"), "output_config.format"
    else:
        fmt, field = body.object("output_format"), "output_format"
    return structured.answer_schema(fmt, field, strict_default=True)


def strict_tools(body: Body) -> set[str]:
    """The tools marked `strict`: their calls' input follows their input_schema."""
    tools = body.list("tools") or []
    return {t["name"] for t in tools if isinstance(t, dict) and t.get("strict") is True}


def prompt_of(state: ServerState, body: Body) -> chat.ChatPrompt:
    # Anthropic's MCP connector runs the servers' tools at Anthropic, as server tools do.
    body.refuse("mcp_servers", "MCP servers' tools run at Anthropic; only client tools run here")
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


async def parse(state: ServerState, body: Body, tenant: str) -> Call:
    prompt = prompt_of(state, body)
    ids = await encode_prompt(state, prompt.text, "messages", tenant=tenant, rendered=True)
    request = build_request(body, state, ids, tenant)
    choice = body.object("tool_choice")
    request = await structured.constrain(
        state,
        request,
        prompt,
        answer=answer_schema_of(body),
        tools=tools_of(body),
        choice=tool_choice_of(body),
        parallel=not (choice is not None and choice.bool("disable_parallel_tool_use", False)),
        strict=strict_tools(body),
    )
    model = body.str("model") or state.model_id
    encoder = MessagesEncoder(model, len(ids), system_fingerprint(state, request))
    return Call(request, prompt, encoder)


def _event(data: dict) -> Frame:
    return frame(data, data["type"])


class MessagesEncoder:
    """One answer as a message, or as its events: one content block per run of thinking or
    text, one per tool call."""

    ping_every = PING_EVERY
    waits_for_admission = True

    def __init__(self, model: str, prompt_tokens: int, fingerprint: str = ""):
        self.mid = "msg_" + secrets.token_hex(12)
        self.model, self.prompt_tokens = model, prompt_tokens
        # OpenAI's name for what a seeded answer repeats under; Message allows extra fields.
        self.fingerprint = {"system_fingerprint": fingerprint} if fingerprint else {}
        self.index = -1
        self.open_kind: str | None = None  # "text" or "thinking": the block now open
        self.piece: OneFieldFrame | None = None  # the open block's delta, its text left open
        self.called = False

    def start(self, cached: int | None) -> list[Frame]:
        # Seed 000: input_tokens is the part not served from cache. It is known once the
        # request has a slot (at once, unless it queues: then, after a ping's wait, the whole
        # prompt is counted here and the final usage corrects it).
        usage = {"input_tokens": self.prompt_tokens - (cached or 0),
                 "cache_creation_input_tokens": 0,
                 "cache_read_input_tokens": cached or 0, "output_tokens": 0}  # fmt: skip
        message = {
            "id": self.mid, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage,
            **self.fingerprint,
        }  # fmt: skip
        return [_event({"type": "message_start", "message": message}), _event({"type": "ping"})]

    def feed(self, item) -> list[Frame]:
        if isinstance(item, Ping):
            return [_event({"type": "ping"})]
        if isinstance(item, Reasoning):
            return self._piece("thinking", item.text)
        if isinstance(item, ToolCall):
            block = _tool_use(item)
            arguments = json.dumps(block.pop("input"), ensure_ascii=False)
            out = [*self._close(), self._start({**block, "input": {}})]
            out.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
            out.append(_event({"type": "content_block_stop", "index": self.index}))
            self.called = True
            return out
        if self.called and not item.text.strip():  # Content or InvalidToolCall
            return []  # whitespace between tool calls
        return self._piece("text", item.text)

    def finish(self, done: Finished) -> list[Frame]:
        stop = {"stop_reason": _stop_reason(done, self.called),
                "stop_sequence": done.stop_sequence}  # fmt: skip
        delta = {"type": "message_delta", "delta": stop, "usage": _usage(done)}
        return [*self._close(), _event(delta), _event({"type": "message_stop"})]

    def fail(self, message: str, status: int) -> list[Frame]:
        kind = "overloaded_error" if status == 503 else "api_error"
        error = {"type": kind, "message": message}
        return [_event({"type": "error", "error": error, "request_id": self.mid})]

    def whole(self, answer: Answer) -> dict:
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
        return {
            "id": self.mid,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": blocks,
            "stop_reason": _stop_reason(done, called),
            "stop_sequence": done.stop_sequence,
            "usage": _usage(done),
            **self.fingerprint,
        }

    def _piece(self, kind: str, text: str) -> list[Frame]:
        """Text for a thinking or text block, opening one if another kind is open."""
        out = []
        if self.open_kind != kind:
            out = self._close()
            if kind == "thinking":
                out.append(self._start({"type": "thinking", "thinking": "", "signature": ""}))
            else:
                out.append(self._start({"type": "text", "text": ""}))
            self.open_kind = kind
            field = "thinking" if kind == "thinking" else "text"
            self.piece = OneFieldFrame(lambda t: self._delta({"type": f"{field}_delta", field: t}))
        return [*out, self.piece(text)]

    def _close(self) -> list[Frame]:
        out = []
        if self.open_kind == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": SIGNATURE}))
        if self.open_kind is not None:
            out.append(_event({"type": "content_block_stop", "index": self.index}))
        self.open_kind = None
        return out

    def _start(self, block: dict) -> Frame:
        self.index += 1
        return _event({"type": "content_block_start", "index": self.index, "content_block": block})

    def _delta(self, delta: dict) -> Frame:
        return _event({"type": "content_block_delta", "index": self.index, "delta": delta})
