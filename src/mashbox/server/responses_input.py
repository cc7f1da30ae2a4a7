"""What a Responses request asks for: its input items as chat messages, and its tools
(function, custom, namespace; hosted tools dropped, as seed 000 says) flattened for the
model, with the way back from a model's call to the item the client expects."""

from __future__ import annotations

import json
import logging
import secrets

from ..text.lark_in_json import Unsupported, json_string_lark
from ..text.parser import ToolCall
from .chat import ToolChoice
from .errors import bad_request
from .openai_chat import message_text
from .token_logprobs import MAX_TOP_LOGPROBS
from .validate import Body

log = logging.getLogger("mashbox")

HOSTED_TOOLS = {
    "web_search", "web_search_preview", "file_search", "code_interpreter", "image_generation",
    "computer_use_preview", "computer_use", "mcp", "local_shell", "tool_search",
}  # fmt: skip
_NS_SEP = "."  # a namespace tool's functions are offered to the model as "namespace.name"


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class Toolbox:
    """The tools a request offers, flattened to function tools for the model, and the way
    back from a model's call to the item type the client expects."""

    def __init__(self, tools: list | None):
        self.functions: list[dict] = []
        self.kinds: dict[str, tuple[str, str | None, str]] = {}  # model name -> (kind, ns, name)
        self.strict: set[str] = set()  # tools whose calls' arguments follow their parameters
        self.lark_inputs: dict[str, str] = {}  # custom tools' Lark, over JSON-escaped text
        for i, tool in enumerate(tools or []):
            if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
                raise bad_request(f"tools[{i}] must be an object with a type", "tools")
            kind = tool["type"]
            if kind in HOSTED_TOOLS or kind.startswith(("web_search", "computer_use")):
                continue  # hosted tools run at OpenAI; the model here never sees them
            if kind == "function":
                self._function(tool, i, None)
            elif kind == "custom":
                self._custom(tool, i)
            elif kind == "namespace":
                ns = tool.get("name")
                if not isinstance(ns, str) or not isinstance(tool.get("tools"), list):
                    raise bad_request(f"tools[{i}] (namespace) needs a name and tools", "tools")
                for inner in tool["tools"]:
                    self._function(inner, i, ns)
            else:
                raise bad_request(f"tools[{i}] has an unknown type {kind!r}", "tools")

    def _function(self, tool: dict, i: int, ns: str | None) -> None:
        name = tool.get("name") if isinstance(tool, dict) else None
        if not isinstance(name, str):
            raise bad_request(f"tools[{i}].name is required", "tools")
        shown = f"{ns}{_NS_SEP}{name}" if ns else name
        function = {"name": shown, "parameters": tool.get("parameters") or {"type": "object"}}
        if tool.get("strict") is not False:  # the Responses API's default: strict
            self.strict.add(shown)
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        self.functions.append({"type": "function", "function": function})
        self.kinds[shown] = ("function", ns, name)

    def _custom(self, tool: dict, i: int) -> None:
        name = tool.get("name")
        if not isinstance(name, str):
            raise bad_request(f"tools[{i}].name is required", "tools")
        description = tool.get("description") or ""
        fmt = tool.get("format") or {}
        if not isinstance(fmt, dict) or not isinstance(fmt.get("definition", ""), str):
            raise bad_request(f"tools[{i}].format must be an object", "tools")
        text = {"type": "string", "description": "The raw input."}
        if fmt.get("type") == "grammar":
            description += (
                f"\nThe input must follow this {fmt.get('syntax', '')} grammar:\n"
                f"{fmt.get('definition', '')}"
            )
            if fmt.get("syntax") == "regex":  # held to it (structured.py)
                text["pattern"] = f"^(?:{fmt.get('definition', '')})$"
                self.strict.add(name)
            elif fmt.get("syntax") == "lark":
                try:  # held to it where it can be carried into the call's JSON string
                    self.lark_inputs[name] = json_string_lark(fmt.get("definition", ""))
                    self.strict.add(name)
                except Unsupported as exc:
                    log.info("custom tool %r: its Lark grammar is described only (%s)", name, exc)
        parameters = {"type": "object", "properties": {"input": text}, "required": ["input"]}
        function = {"name": name, "description": description.strip(), "parameters": parameters}
        self.functions.append({"type": "function", "function": function})
        self.kinds[name] = ("custom", None, name)

    def item(self, call: ToolCall) -> dict:
        """The output item for a model's call (a bare name that one namespace alone offers
        is that namespace's function: small models drop the prefix)."""
        bare = [k for k in self.kinds.values() if k[1] and k[2] == call.name]
        default = bare[0] if len(bare) == 1 else ("function", None, call.name)
        kind, ns, name = self.kinds.get(call.name, default)
        if kind == "custom":
            arguments = json.loads(call.arguments)
            raw = arguments.get("input") if isinstance(arguments.get("input"), str) else None
            return {
                "type": "custom_tool_call",
                "id": new_id("ctc"),
                "call_id": new_id("call"),
                "name": name,
                "input": raw if raw is not None else call.arguments,
                "status": "completed",
            }
        item = {
            "type": "function_call",
            "id": new_id("fc"),
            "call_id": new_id("call"),
            "name": name,
            "arguments": call.arguments,
            "status": "completed",
        }
        if ns:
            item["namespace"] = ns
        return item


def _output_text(output, where: str) -> str:
    if isinstance(output, str):
        return output
    if output is None:
        return ""
    return message_text(output, where)


def input_messages(body: Body) -> list[dict]:
    """HF-style messages from `instructions` and `input` (a string or items)."""
    system = [body.str("instructions")] if body.has("instructions") else []
    items = body.raw("input")
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("input must be a string or a non-empty array of items", "input")
    out: list[dict] = []
    reasoning: list[str] = []

    def assistant() -> dict:
        """The assistant message that calls and reasoning attach to (a new one if needed)."""
        if not out or out[-1]["role"] != "assistant":
            out.append({"role": "assistant", "content": ""})
        if reasoning:
            out[-1]["reasoning_content"] = "\n".join(reasoning)
            reasoning.clear()
        return out[-1]

    def call(name: str, arguments, call_id) -> None:
        message = assistant()
        message.setdefault("tool_calls", []).append(
            {"id": str(call_id or ""), "type": "function",
             "function": {"name": name, "arguments": arguments}}
        )  # fmt: skip

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise bad_request(
                    f"{where}.role must be system, developer, user or assistant", "input"
                )
            text = message_text(item.get("content"), where)
            if role in ("system", "developer"):
                system.append(text)
            elif role == "assistant":
                message = assistant()
                if message.get("tool_calls"):  # text after calls starts a new turn
                    out.append({"role": "assistant", "content": text})
                else:
                    message["content"] += text
            else:
                out.append({"role": "user", "content": text})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning.append("".join(p.get("text", "") for p in parts if isinstance(p, dict)))
        elif kind == "function_call":
            name = item.get("name")
            if not isinstance(name, str):
                raise bad_request(f"{where}.name is required", "input")
            if isinstance(item.get("namespace"), str):
                name = f"{item['namespace']}{_NS_SEP}{name}"
            call(name, item.get("arguments") or "{}", item.get("call_id"))
        elif kind == "custom_tool_call":
            call(
                str(item.get("name", "")),
                {"input": str(item.get("input", ""))},
                item.get("call_id"),
            )
        elif kind == "local_shell_call":
            call("local_shell", item.get("action") or {}, item.get("call_id") or item.get("id"))
        elif kind in ("function_call_output", "custom_tool_call_output", "local_shell_call_output"):
            out.append(
                {"role": "tool", "tool_call_id": str(item.get("call_id") or item.get("id") or ""),
                 "content": _output_text(item.get("output"), f"{where}.output")}
            )  # fmt: skip
        elif kind in ("input_image", "input_file", "input_audio", "image", "file"):
            raise bad_request(f"{where} is a {kind} item: this model reads text only", "input")
        else:
            raise bad_request(f"{where} has an unknown type {kind!r}", "input")
    head = [{"role": "system", "content": "\n\n".join(system)}] if system else []
    return head + out


def tool_choice_of(body: Body) -> ToolChoice:
    value = body.raw("tool_choice", "auto")
    if value in ("auto", "none", "required"):
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type") in ("function", "custom"):
        name = value.get("name") or (value.get("function") or {}).get("name")
        if isinstance(name, str):
            return ToolChoice("function", name)
    if isinstance(value, dict) and value.get("type") in ("auto", "none", "required"):
        return ToolChoice(value["type"])
    raise bad_request("tool_choice must be auto, none, required or a named function", "tool_choice")


def thinking_of(body: Body) -> bool:
    reasoning = body.object("reasoning")
    effort = reasoning.raw("effort") if reasoning else None
    return effort is not None and effort not in ("none", "minimal")


LOGPROBS_INCLUDE = "message.output_text.logprobs"


def logprobs_asked(body: Body) -> int:
    """-1 unless `include` names message.output_text.logprobs; else how many likeliest tokens
    to list beside each generated one (`top_logprobs`, 0-20; without the include, nothing)."""
    top = body.int("top_logprobs", lo=0, hi=MAX_TOP_LOGPROBS)
    return (top or 0) if LOGPROBS_INCLUDE in (body.list("include") or []) else -1


def max_tokens_field(body: Body) -> Body:
    """max_output_tokens is the Responses name; max_completion_tokens and max_tokens too."""
    data = dict(body.data)
    value = body.int("max_output_tokens", lo=1)
    if value is not None and not body.has("max_completion_tokens"):
        data["max_completion_tokens"] = value
    return Body(data)
