"""OpenAI Chat Completions as a codec: the body parsed into a `Call`, the answer encoded as
a `chat.completion` or as `chat.completion.chunk` events (driver.py runs both)."""

from __future__ import annotations

import secrets
import time

import attrs

from ..events import Finished, Request
from ..text.parser import Reasoning, ToolCall
from . import chat, structured
from .chat import Answer, Logprobs, ToolChoice
from .content import ContentError, text_of
from .driver import Call, Frame, OneFieldFrame, Tally, frame
from .errors import bad_request
from .generation import (
    MAX_CHOICES,
    build_request,
    check_model,
    choice_count,
    encode_prompt,
    system_fingerprint,
)
from .state import ServerState
from .token_logprobs import MAX_TOP_LOGPROBS, openai_entries
from .validate import Body

_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


# --- request parsing -------------------------------------------------------------------------


def message_text(content, where: str) -> str:
    """A message's content as text: a string, a list of text parts, or null."""
    try:
        return text_of(content)
    except ContentError as exc:
        if exc.index is None:
            why = f"{where}.content must be a string or a list of parts"
        elif exc.media:
            why = f"{where}.content[{exc.index}] is a {exc.media} part: this model reads text only"
        else:
            why = f"{where}.content[{exc.index}] must be a text part"
        raise bad_request(why, "messages") from None


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
    """enable_thinking (chat_template_kwargs' first); else OpenAI's reasoning_effort, read
    as Responses' reasoning.effort: any value but none or minimal turns thinking on."""
    kwargs = body.object("chat_template_kwargs")
    if kwargs is not None and kwargs.has("enable_thinking"):
        return kwargs.bool("enable_thinking")
    if body.has("enable_thinking"):
        return body.bool("enable_thinking")
    effort = body.str("reasoning_effort")
    return effort is not None and effort not in ("none", "minimal")


def refuse_what_text_cannot(body: Body) -> None:
    """Fields that ask for what a text model here cannot give: a 400, not an answer that
    silently lacks it."""
    modalities = body.list("modalities") or []
    if any(m != "text" for m in modalities):
        raise bad_request("modalities: this model writes text only", "modalities")
    body.refuse("audio", "this model writes text only")
    body.refuse("functions", "use tools (OpenAI's deprecated functions are not read)")
    body.refuse("function_call", "use tool_choice (with tools)")


def logprobs_asked(body: Body) -> int:
    """-1 without `logprobs: true`; else how many likeliest tokens to list beside each
    generated one (`top_logprobs`, 0-20, which needs `logprobs: true`, as at OpenAI)."""
    top = body.int("top_logprobs", lo=0, hi=MAX_TOP_LOGPROBS)
    if not body.bool("logprobs", False):
        if top is not None:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        return -1
    return top or 0


def include_usage(body: Body) -> bool:
    options = body.object("stream_options")
    return bool(options and options.bool("include_usage", False))


def usage_tally(body: Body, requests: list[Request], choices: int) -> Tally | None:
    """A Tally where a stream asks for usage in every event (vLLM's
    `stream_options.continuous_usage_stats`), else None. requests: each prompt's, of
    `choices` choices each."""
    options = body.object("stream_options")
    if not (options and options.bool("continuous_usage_stats", False) and requests[0].stream):
        return None
    return Tally([len(r.prompt_ids) for r in requests for _ in range(choices)])


def usage_dict(usage, *, details: bool = True) -> dict:
    out = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }
    if details:
        out["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens}
    return out


def error_frame(rid: str, message: str) -> Frame:
    """An error after the stream started (OpenAI's streams have no error event of their own)."""
    return frame({"error": {"message": message, "type": "server_error", "request_id": rid}})


def tool_call_dict(call: ToolCall) -> dict:
    return {
        "id": "call_" + secrets.token_hex(12),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


async def parse(state: ServerState, body: Body, tenant: str) -> Call:
    check_model(body, state)
    refuse_what_text_cannot(body)
    top = logprobs_asked(body)
    tools, choice = chat_tools(body), chat_tool_choice(body)
    answer = structured.answer_schema(body.object("response_format"), "response_format")
    messages, thinking = chat_messages(body), thinking_requested(body)
    prompt = chat.render(state, messages, tools=tools, tool_choice=choice, thinking=thinking)
    ids = await encode_prompt(state, prompt.text, "messages", tenant=tenant, rendered=True)
    n = choice_count(body, MAX_CHOICES)
    request = build_request(body, state, ids, tenant, logprobs=top, most_choices=MAX_CHOICES)
    parallel = body.bool("parallel_tool_calls", True)
    request = await structured.constrain(
        state, request, prompt, answer=answer, tools=tools, choice=choice, parallel=parallel
    )
    if top >= 0:
        prompt = attrs.evolve(prompt, token_bytes=state.tokenizer.token_bytes)
    fingerprint = system_fingerprint(state, request)
    tally = usage_tally(body, [request], n)
    encoder = ChatEncoder(
        state.model_id, fingerprint, include_usage(body), prompt.token_bytes, tally=tally
    )
    return Call(request, prompt, encoder, n, tally)


class ChatEncoder:
    """One answer as a chat.completion, or as chat.completion.chunk events; one encoder per
    choice (`n`)."""

    ping_every = None
    waits_for_admission = False

    def __init__(
        self,
        model: str,
        fingerprint: str,
        usage_chunk: bool,
        token_bytes=None,
        *,
        index: int = 0,
        of: ChatEncoder | None = None,
        tally: Tally | None = None,
    ):
        """token_bytes: a token id's bytes, where log-probs were asked for (else None).
        index: the choice this encodes; of: choice 0's encoder, whose answer (its id, clock
        and tally) this is another choice of; tally: where every event carries the usage so
        far."""
        self.index = index
        self.token_bytes = token_bytes
        self.pending: list = []  # the TokenLogprobs of the content that comes next
        if of is not None:
            self.rid, self.base, self.tally = of.rid, of.base, of.tally
        else:
            self.rid = "chatcmpl-" + secrets.token_hex(12)
            self.base = {"id": self.rid, "created": int(time.time()), "model": model}
            self.tally = tally
        self.fingerprint = fingerprint
        self.usage_chunk = usage_chunk
        self.calls = 0
        self.content = OneFieldFrame(lambda text: self._chunk({"content": text}))

    def _chunk(self, delta: dict, finish=None, logprobs=None, **extra) -> Frame:
        choice = {"index": self.index, "delta": delta, "finish_reason": finish}
        if logprobs is not None:
            choice["logprobs"] = logprobs
        if self.tally is not None and "usage" not in extra:
            extra["usage"] = self.tally.usage(self.index)
        return frame(
            {
                **self.base,
                "object": "chat.completion.chunk",
                "system_fingerprint": self.fingerprint,
                "choices": [choice],
                **extra,
            }
        )

    def choice(self, index: int) -> ChatEncoder:
        model, usage = self.base["model"], self.usage_chunk
        return ChatEncoder(model, self.fingerprint, usage, self.token_bytes, index=index, of=self)

    def start(self, cached: int | None) -> list[Frame]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def feed(self, item) -> list[Frame]:
        if isinstance(item, Logprobs):
            self.pending.extend(item.entries)
            return []
        if isinstance(item, Reasoning):
            return [self._chunk({"reasoning_content": item.text})]
        if isinstance(item, ToolCall):
            call = {"index": self.calls, **tool_call_dict(item)}
            self.calls += 1
            return [self._chunk({"tool_calls": [call]})]
        # Content, or tool-call markup that did not parse
        if self.token_bytes is None:
            if self.tally is None:
                return [self.content(item.text)]
            return [self._chunk({"content": item.text})]
        logprobs, self.pending = self._logprobs(self.pending), []
        return [self._chunk({"content": item.text}, logprobs=logprobs)]

    def finish(self, done: Finished) -> list[Frame]:
        return [*self.finish_choice(done), *self.finish_answer(done)]

    def finish_choice(self, done: Finished) -> list[Frame]:
        timings = attrs.asdict(done.timings)
        reason = chat.finish_reason(done, self.calls)
        if self.tally is not None:  # the choice's own count, now final
            usage = usage_dict(done.usage, details=False)
            return [self._chunk({}, reason, timings=timings, usage=usage)]
        return [self._chunk({}, reason, timings=timings)]

    def finish_answer(self, done: Finished) -> list[Frame]:
        out = []
        if self.usage_chunk:
            timings = attrs.asdict(done.timings)
            tail = {"choices": [], "usage": usage_dict(done.usage), "timings": timings}
            out.append(frame({**self.base, "object": "chat.completion.chunk", **tail}))
        return [*out, frame("[DONE]")]

    def fail(self, message: str, status: int) -> list[Frame]:
        return [error_frame(self.rid, message)]

    def whole(self, answer: Answer) -> dict:
        return self.whole_answer([self.whole_choice(answer)], answer.done)

    def whole_choice(self, answer: Answer) -> dict:
        done, calls = answer.done, [tool_call_dict(c) for c in answer.calls]
        text = answer.text()
        message = {"role": "assistant", "content": text if text.strip() or not calls else None}
        if reasoning := answer.text(Reasoning):
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        return {
            "index": self.index,
            "message": message,
            "finish_reason": chat.finish_reason(done, calls),
            **self._logprobs_field(answer.logprobs),
        }

    def whole_answer(self, choices: list[dict], done: Finished) -> dict:
        """choices: each choice's whole_choice; done: how the answer ended (all its usage)."""
        return {
            **self.base,
            "object": "chat.completion",
            "system_fingerprint": self.fingerprint,
            "choices": choices,
            "usage": usage_dict(done.usage),
            "timings": attrs.asdict(done.timings),
        }

    def _logprobs_field(self, entries) -> dict:
        return {} if self.token_bytes is None else {"logprobs": self._logprobs(entries)}

    def _logprobs(self, entries) -> dict:
        """OpenAI's chat log-probs of these content tokens."""
        return {"content": openai_entries(entries, self.token_bytes), "refusal": None}
