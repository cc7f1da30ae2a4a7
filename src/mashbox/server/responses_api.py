"""OpenAI Responses as a codec (stateless: Codex resends the whole conversation every turn):
the body parsed into a `Call`, the answer encoded as a response or its numbered events."""

from __future__ import annotations

import time

import attrs

from ..events import Finished
from ..text.parser import Reasoning, ToolCall
from . import chat, structured
from .chat import Answer, Logprobs, ToolChoice
from .driver import Call, Frame, frame
from .generation import build_request, encode_prompt, system_fingerprint
from .responses_input import (
    Toolbox,
    input_messages,
    logprobs_asked,
    max_tokens_field,
    new_id,
    thinking_of,
    tool_choice_of,
)
from .state import ServerState
from .token_logprobs import openai_entries
from .validate import Body


def refuse_stored_state(body: Body) -> None:
    """Nothing is stored here (`store` is accepted and ignored, as seed 000 says): a request
    that leans on an earlier response, a conversation or a background run would be answered
    without it, so it is a 400. Codex sends the whole conversation each turn."""
    stateless = "responses are not stored here: send the whole conversation in input"
    body.refuse("previous_response_id", stateless)
    body.refuse("conversation", stateless)
    body.refuse("background", "every response is answered in its own request here")


async def parse(state: ServerState, body: Body, tenant: str) -> Call:
    # Seed 000: "Accepted for compatibility; the server answers with the one model it runs."
    # Codex sends whatever its config names.
    refuse_stored_state(body)
    top = logprobs_asked(body)
    toolbox = Toolbox(body.list("tools"))
    choice = tool_choice_of(body)
    if choice.name is not None and choice.name not in toolbox.kinds:
        choice = ToolChoice("function", next(
            (k for k, v in toolbox.kinds.items() if v[2] == choice.name), choice.name
        ))  # fmt: skip
    prompt = chat.render(
        state,
        input_messages(body),
        tools=toolbox.functions or None,
        tool_choice=choice,
        thinking=thinking_of(body),
    )
    ids = await encode_prompt(state, prompt.text, "input", tenant=tenant, rendered=True)
    request = build_request(max_tokens_field(body), state, ids, tenant, logprobs=top)
    text = body.object("text")
    request = await structured.constrain(
        state,
        request,
        prompt,
        answer=structured.answer_schema(text.object("format") if text else None, "text.format"),
        tools=toolbox.functions,
        strict=toolbox.strict,
        lark_inputs=toolbox.lark_inputs,
        choice=choice,
        parallel=body.bool("parallel_tool_calls", True),
    )
    shell = {
        "id": new_id("resp"),
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "model": body.str("model") or state.model_id,
        "output": [],
        "parallel_tool_calls": body.bool("parallel_tool_calls", False),
        "tool_choice": body.raw("tool_choice", "auto"),
        "tools": body.list("tools") or [],
        "usage": None,
        # What a seeded answer repeats under (OpenAI's name; Response allows extra fields).
        "system_fingerprint": system_fingerprint(state, request),
    }
    if top >= 0:
        prompt = attrs.evolve(prompt, token_bytes=state.tokenizer.token_bytes)
    return Call(request, prompt, ResponsesEncoder(shell, toolbox, prompt.token_bytes))


class ResponsesEncoder:
    """One answer as a response, or as its numbered events: an output item per run of
    reasoning or message text, one per tool call."""

    ping_every = None
    waits_for_admission = False

    def __init__(self, shell: dict, toolbox: Toolbox, token_bytes=None):
        """token_bytes: a token id's bytes, where log-probs were included (else None)."""
        self.shell, self.toolbox, self.token_bytes = shell, toolbox, token_bytes
        self.pending: list = []  # the TokenLogprobs of the message text that comes next
        self.number = 0
        self.output: list[dict] = []
        self.open_item: dict | None = None  # the message or reasoning item being streamed

    def start(self, cached: int | None) -> list[Frame]:
        shell = self.shell
        return [self._sse("response.created", response=shell),
                self._sse("response.in_progress", response=shell)]  # fmt: skip

    def feed(self, item) -> list[Frame]:
        if isinstance(item, Logprobs):
            self.pending.extend(item.entries)
            return []
        if isinstance(item, ToolCall):
            return [*self._close(), *self._call(self.toolbox.item(item))]
        kind = "reasoning" if isinstance(item, Reasoning) else "message"
        entries, self.pending = self._entries(self.pending), []  # this text's tokens'
        open_item = self.open_item
        if kind == "message" and not item.text.strip():
            if open_item is None or open_item["type"] != "message":
                return []  # whitespace between items is not a message
        out = []
        if open_item is None or open_item["type"] != kind:
            out = [*self._close(), *self._open(kind)]
        part = self.open_item["content"][0]
        part["text"] += item.text
        delta = "response.reasoning_text.delta" if kind == "reasoning" else (
            "response.output_text.delta")  # fmt: skip
        logprobs = {}
        if entries is not None and kind == "message":
            part["logprobs"].extend(entries)
            logprobs = {"logprobs": entries}
        out.append(self._sse(delta, item_id=self.open_item["id"], output_index=len(self.output),
                             content_index=0, delta=item.text, **logprobs))  # fmt: skip
        return out

    def finish(self, done: Finished) -> list[Frame]:
        out = self._close()
        kind = "response.incomplete" if done.reason == "length" else "response.completed"
        return [*out, self._sse(kind, response=self._response(done, self.output))]

    def fail(self, message: str, status: int) -> list[Frame]:
        """Seed 000: an error after the stream started is `error`, then `response.failed`
        (the response with status failed and its error)."""
        out = self._close()
        error = {"code": "server_error", "message": message}
        failed = {**self.shell, "status": "failed", "output": self.output, "error": error}
        return [
            *out,
            self._sse(
                "error",
                code="server_error",
                message=message,
                param=None,
                request_id=self.shell["id"],
            ),  # fmt: skip
            self._sse("response.failed", response=failed),
        ]

    def whole(self, answer: Answer) -> dict:
        calls = [self.toolbox.item(c) for c in answer.calls]
        reasoning, text = answer.text(Reasoning), answer.text()
        output = []
        if reasoning:
            output.append(_reasoning_item(new_id("rs"), reasoning))
        if text.strip() or not calls:
            logprobs = self._entries(answer.logprobs)
            output.append(_message_item(new_id("msg"), text, logprobs=logprobs))
        output.extend(calls)
        return self._response(answer.done, output)

    def _response(self, done: Finished, output: list[dict]) -> dict:
        u = done.usage
        response = {
            **self.shell,
            "status": "incomplete" if done.reason == "length" else "completed",
            "output": output,
            "usage": {
                "input_tokens": u.prompt_tokens,
                "input_tokens_details": {"cached_tokens": u.cached_tokens},
                "output_tokens": u.completion_tokens,
                # generated tokens, as the parser read them
                "output_tokens_details": {"reasoning_tokens": done.reasoning_tokens},
                "total_tokens": u.prompt_tokens + u.completion_tokens,
            },
        }
        if done.reason == "length":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        return response

    def _entries(self, entries) -> list[dict] | None:
        """OpenAI's entries of these tokens, where log-probs were included (else None)."""
        return None if self.token_bytes is None else openai_entries(entries, self.token_bytes)

    def _sse(self, kind: str, **fields) -> Frame:
        self.number += 1
        return frame({"type": kind, "sequence_number": self.number, **fields}, kind)

    def _call(self, item: dict) -> list[Frame]:
        index = len(self.output)
        custom = item["type"] == "custom_tool_call"
        field = "input" if custom else "arguments"
        prefix = "response.custom_tool_call_input" if custom else (
            "response.function_call_arguments")  # fmt: skip
        out = [
            self._sse("response.output_item.added", output_index=index,
                      item={**item, field: "", "status": "in_progress"}),
            self._sse(f"{prefix}.delta", item_id=item["id"], output_index=index,
                      delta=item[field]),
            self._sse(f"{prefix}.done", item_id=item["id"], output_index=index,
                      **{field: item[field]}),
        ]  # fmt: skip
        self.output.append(item)
        return [*out, self._sse("response.output_item.done", output_index=index, item=item)]

    def _close(self) -> list[Frame]:
        if self.open_item is None:
            return []
        item, self.open_item = self.open_item, None
        index = len(self.output)
        text = item["content"][0]["text"]
        if item["type"] == "message":
            part = item["content"][0]  # its logprobs too, where included
            logprobs = {"logprobs": part["logprobs"]} if "logprobs" in part else {}
            done = self._sse("response.output_text.done", item_id=item["id"],
                             output_index=index, content_index=0, text=text,
                             **logprobs)  # fmt: skip
        else:
            part = {"type": "reasoning_text", "text": text}
            done = self._sse("response.reasoning_text.done", item_id=item["id"],
                             output_index=index, content_index=0, text=text)  # fmt: skip
        item = {**item, "status": "completed", "content": [part]}
        if item["type"] == "reasoning":
            item.pop("status")
        self.output.append(item)
        return [
            done,
            self._sse("response.content_part.done", item_id=item["id"], output_index=index,
                      content_index=0, part=part),
            self._sse("response.output_item.done", output_index=index, item=item),
        ]  # fmt: skip

    def _open(self, kind: str) -> list[Frame]:
        index = len(self.output)
        if kind == "message":
            logprobs = None if self.token_bytes is None else []
            self.open_item = _message_item(new_id("msg"), "", "in_progress", logprobs)
            part = {"type": "output_text", "text": "", "annotations": []}
            if logprobs is not None:
                part["logprobs"] = []
        else:
            self.open_item = _reasoning_item(new_id("rs"), "")
            part = {"type": "reasoning_text", "text": ""}
        added = {**self.open_item, "content": []}
        return [
            self._sse("response.output_item.added", output_index=index, item=added),
            self._sse("response.content_part.added", item_id=self.open_item["id"],
                      output_index=index, content_index=0, part=part),
        ]  # fmt: skip


def _message_item(item_id: str, text: str, status: str = "completed", logprobs=None) -> dict:
    """logprobs: the text's tokens' entries, where included (else None: no such field)."""
    part = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [part]}  # fmt: skip


def _reasoning_item(item_id: str, text: str) -> dict:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }
