"""The protocols' answers and stream events as shapes, and the small checker that holds a
JSON value against one (the key fields of specs/seeds/000's schemas; no schema library).

A shape is a type or tuple of types the value must be; a str constant it must equal; a
frozenset of the values it may take; a dict of the keys it must have (a key ending in "?"
may be absent) to their shapes; or a one-item list: every item's shape.
"""

from __future__ import annotations

NULL = type(None)


def problems(value, shape, where: str = "") -> list[str]:
    """Where `value` departs from `shape`, one line each (empty when it fits)."""
    if isinstance(shape, dict):
        if not isinstance(value, dict):
            return [f"{where or 'the body'}: not an object but {_kind(value)}"]
        found = []
        for key, inner in shape.items():
            name = key.removesuffix("?")
            if name in value:
                found += problems(value[name], inner, f"{where}.{name}".lstrip("."))
            elif not key.endswith("?"):
                found.append(f"{where}.{name}: missing".lstrip("."))
        return found
    if isinstance(shape, list):
        if not isinstance(value, list):
            return [f"{where}: not an array but {_kind(value)}"]
        each = (problems(item, shape[0], f"{where}[{i}]") for i, item in enumerate(value))
        return [line for lines in each for line in lines]
    if isinstance(shape, str):
        return [] if value == shape else [f"{where}: {value!r}, not {shape!r}"]
    if isinstance(shape, frozenset):
        allowed = ", ".join(sorted(map(repr, shape)))
        return [] if _hashable(value) and value in shape else [f"{where}: {value!r}, not {allowed}"]
    types = shape if isinstance(shape, tuple) else (shape,)
    if isinstance(value, types) and not (isinstance(value, bool) and bool not in types):
        return []
    wanted = " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in types)
    return [f"{where}: {_kind(value)}, not {wanted}"]


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean",
               dict: "an object", list: "an array", NULL: "null"}  # fmt: skip


def _kind(value) -> str:
    return _TYPE_NAMES.get(type(value), type(value).__name__)


def _hashable(value) -> bool:
    return not isinstance(value, dict | list)


FINISH = frozenset({"stop", "length", "tool_calls", "content_filter", "function_call"})
USAGE = {"prompt_tokens": int, "completion_tokens": int, "total_tokens": int}

CHAT_COMPLETION = {
    "id": str,
    "object": "chat.completion",
    "created": int,
    "model": str,
    "choices": [
        {
            "index": int,
            "message": {"role": "assistant", "content": (str, NULL)},
            "finish_reason": FINISH,
        }
    ],
    "usage": USAGE,
}
CHAT_CHUNK = {
    "id": str,
    "object": "chat.completion.chunk",
    "created": int,
    "model": str,
    "choices": [
        {
            "index": int,
            "delta": {"role?": "assistant", "content?": (str, NULL)},
            "finish_reason": FINISH | {None},
        }
    ],
    "usage?": (dict, NULL),
}

COMPLETION = {
    "id": str,
    "object": "text_completion",
    "created": int,
    "model": str,
    "choices": [{"index": int, "text": str, "finish_reason": FINISH}],
    "usage": USAGE,
}
COMPLETION_CHUNK = {
    "id": str,
    "object": "text_completion",
    "created": int,
    "model": str,
    "choices": [{"index": int, "text": str, "finish_reason": FINISH | {None}}],
}

RESPONSE_ITEM = {"type": str, "id": str}
RESPONSE = {
    "id": str,
    "object": "response",
    "created_at": (int, float),
    "status": frozenset({"in_progress", "completed", "incomplete", "failed"}),
    "model": str,
    "output": [RESPONSE_ITEM],
    "usage": (dict, NULL),
}
_CALL = {"item_id": str, "output_index": int}
_PART = {**_CALL, "content_index": int}
# Each Responses event's fields besides type and sequence_number, by its type.
RESPONSE_EVENTS = {
    "response.created": {"response": RESPONSE},
    "response.in_progress": {"response": RESPONSE},
    "response.completed": {"response": RESPONSE},
    "response.incomplete": {"response": RESPONSE},
    "response.failed": {"response": RESPONSE},
    "response.output_item.added": {"output_index": int, "item": RESPONSE_ITEM},
    "response.output_item.done": {"output_index": int, "item": RESPONSE_ITEM},
    "response.content_part.added": {**_PART, "part": {"type": str}},
    "response.content_part.done": {**_PART, "part": {"type": str}},
    "response.output_text.delta": {**_PART, "delta": str},
    "response.output_text.done": {**_PART, "text": str},
    "response.reasoning_text.delta": {**_PART, "delta": str},
    "response.reasoning_text.done": {**_PART, "text": str},
    "response.function_call_arguments.delta": {**_CALL, "delta": str},
    "response.function_call_arguments.done": {**_CALL, "arguments": str},
    "response.custom_tool_call_input.delta": {**_CALL, "delta": str},
    "response.custom_tool_call_input.done": {**_CALL, "input": str},
    "error": {"message": str},
}

STOP_REASONS = frozenset(
    {"end_turn", "max_tokens", "stop_sequence", "tool_use", "pause_turn", "refusal"}
)
MESSAGE = {
    "id": str,
    "type": "message",
    "role": "assistant",
    "model": str,
    "content": [{"type": str}],
    "stop_reason": STOP_REASONS,
    "stop_sequence": (str, NULL),
    "usage": {"input_tokens": int, "output_tokens": int},
}
# Each Messages event's fields besides type, by its type.
MESSAGE_EVENTS = {
    "message_start": {"message": {**MESSAGE, "stop_reason": STOP_REASONS | {None}}},
    "ping": {},
    "content_block_start": {"index": int, "content_block": {"type": str}},
    "content_block_delta": {"index": int, "delta": {"type": str}},
    "content_block_stop": {"index": int},
    "message_delta": {
        "delta": {"stop_reason": STOP_REASONS, "stop_sequence?": (str, NULL)},
        "usage": {"output_tokens": int},
    },
    "message_stop": {},
}
