"""What each protocol's event stream must hold, in order, beyond the SSE framing: OpenAI's
chat and completions chunks, the Responses events and the Anthropic Messages events.

Each check takes the parsed events (sse.py) and returns its problems, one line each.
"""

from __future__ import annotations

import json

from . import shapes
from .sse import Event

DONE = "[DONE]"


def chat_stream(events: list[Event]) -> list[str]:
    """data: chunks of one id, the role in the first alone, the finish reason in the last
    chunk with a choice (a usage chunk may follow), then data: [DONE]."""
    found, chunks = _openai_chunks(events, shapes.CHAT_CHUNK)
    with_choices = [c for c in chunks if _first_choice(c)]
    if not with_choices:
        return found + ["no chunk carries a choice"]
    deltas = [_first_choice(c).get("delta") or {} for c in with_choices]
    roles = [i + 1 for i, d in enumerate(deltas) if isinstance(d, dict) and "role" in d]
    if roles != [1]:
        found.append(f"the role is in chunks {roles}, not in the first alone")
    return found + _finish_last(with_choices)


def completions_stream(events: list[Event]) -> list[str]:
    """data: chunks of one id, the finish reason in the last chunk, then data: [DONE]."""
    found, chunks = _openai_chunks(events, shapes.COMPLETION_CHUNK)
    with_choices = [c for c in chunks if _first_choice(c)]
    if not with_choices:
        return found + ["no chunk carries a choice"]
    return found + _finish_last(with_choices)


def responses_stream(events: list[Event]) -> list[str]:
    """sequence_number 1..n; created and in_progress first; completed or incomplete last;
    every item and content part opened (added) and closed (done) once, deltas inside."""
    found, payloads = _named_payloads(events)
    if not payloads:
        return found or ["no events"]
    numbers = [p.get("sequence_number") for p in payloads]
    if numbers != list(range(1, len(payloads) + 1)):
        found.append(f"sequence_number runs {_brief(numbers)}, not 1..{len(payloads)}")
    kinds = [p.get("type") for p in payloads]
    if kinds[:2] != ["response.created", "response.in_progress"]:
        found.append(f"it starts {kinds[:2]}, not response.created, response.in_progress")
    if kinds[-1] not in ("response.completed", "response.incomplete"):
        found.append(f"it ends with {kinds[-1]}, not response.completed or .incomplete")
    items: set = set()
    parts: set = set()
    for number, p in enumerate(payloads, 1):
        kind = p.get("type")
        where = f"event {number} ({kind})"
        if kind not in shapes.RESPONSE_EVENTS:
            found.append(f"{where}: not a Responses event mashbox check knows")
            continue
        shape_problems = shapes.problems(p, shapes.RESPONSE_EVENTS[kind])
        found += [f"{where}: {line}" for line in shape_problems]
        if kind == "error":
            found.append(f"{where}: the server failed the answer: {p.get('message')}")
        if shape_problems or "output_index" not in p:
            continue
        item, part = p["output_index"], (p["output_index"], p.get("content_index"))
        if kind == "response.output_item.added":
            found += [f"{where}: item {item} added twice"] if item in items else []
            items.add(item)
        elif item not in items:
            found.append(f"{where}: item {item} is not open")
        elif kind == "response.output_item.done":
            items.discard(item)
            if any(output_index == item for output_index, _ in parts):
                found.append(f"{where}: item {item} done with a part open")
        elif "content_index" not in p:
            continue  # a call's arguments belong to its item, not to a content part
        elif kind == "response.content_part.added":
            found += [f"{where}: part {part} added twice"] if part in parts else []
            parts.add(part)
        elif part not in parts:
            found.append(f"{where}: part {part} is not open")
        elif kind == "response.content_part.done":
            parts.discard(part)
    if items or parts:
        found.append(f"items {sorted(items)} and parts {sorted(parts)} never done")
    return found


def messages_stream(events: list[Event]) -> list[str]:
    """message_start first; content blocks started, given deltas and stopped in index order,
    one at a time; message_delta, then message_stop last; ping anywhere."""
    found, payloads = _named_payloads(events)
    for number, p in enumerate(payloads, 1):
        kind = p.get("type")
        if kind not in shapes.MESSAGE_EVENTS:
            found.append(f"event {number}: {kind!r} is not a Messages event")
        else:
            found += [
                f"event {number} ({kind}): {line}"
                for line in shapes.problems(p, shapes.MESSAGE_EVENTS[kind])
            ]
    kinds = [p.get("type") for p in payloads if p.get("type") != "ping"]
    if kinds[:1] != ["message_start"]:
        found.append(f"it starts with {kinds[:1]}, not message_start")
    if kinds[-2:] != ["message_delta", "message_stop"]:
        found.append(f"it ends with {kinds[-2:]}, not message_delta, message_stop")
    expected, open_block = 0, None
    for p in payloads:
        kind, index = p.get("type"), p.get("index")
        if kind == "content_block_start":
            if open_block is not None:
                found.append(f"block {index} starts while block {open_block} is open")
            if index != expected:
                found.append(f"block {index} starts where block {expected} should")
            open_block = index
        elif kind in ("content_block_delta", "content_block_stop"):
            if index != open_block:
                found.append(f"a {kind} for block {index} while block {open_block} is open")
            if kind == "content_block_stop":
                open_block, expected = None, expected + 1
        elif kind == "message_delta" and open_block is not None:
            found.append(f"message_delta while block {open_block} is open")
    return found


def _openai_chunks(events: list[Event], shape: dict) -> tuple[list[str], list[dict]]:
    """The JSON chunks before data: [DONE], which must end the stream, and their problems."""
    found: list[str] = []
    if not events or events[-1].data != DONE:
        found.append("the stream does not end with data: [DONE]")
    if any(e.data == DONE for e in events[:-1]):
        found.append("data: [DONE] comes before the end")
    chunks = []
    for number, e in enumerate(events, 1):
        if e.data == DONE:
            continue
        if e.name is not None:
            found.append(f"chunk {number} is a named event ({e.name}), not plain data:")
        chunk = _json(e.data, f"chunk {number}", found)
        if chunk is not None:
            found += [f"chunk {number}: {line}" for line in shapes.problems(chunk, shape)]
            chunks.append(chunk)
    ids = {c.get("id") for c in chunks if isinstance(c, dict)}
    if len(ids) > 1:
        found.append(f"the chunks carry {len(ids)} different ids")
    return found, [c for c in chunks if isinstance(c, dict)]


def _finish_last(chunks: list[dict]) -> list[str]:
    finished = [i + 1 for i, c in enumerate(chunks) if _first_choice(c).get("finish_reason")]
    if finished != [len(chunks)]:
        return [f"the finish reason is in chunks {finished}, not in the last ({len(chunks)})"]
    return []


def _first_choice(chunk: dict) -> dict | None:
    choices = chunk.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0]
    return None


def _named_payloads(events: list[Event]) -> tuple[list[str], list[dict]]:
    """Each event's JSON object, its SSE event name the same as its type."""
    found: list[str] = []
    payloads = []
    for number, e in enumerate(events, 1):
        payload = _json(e.data, f"event {number}", found)
        if not isinstance(payload, dict):
            found += [f"event {number}: not a JSON object"] if payload is not None else []
            continue
        if e.name != payload.get("type"):
            found.append(f"event {number}: named {e.name!r} but of type {payload.get('type')!r}")
        payloads.append(payload)
    return found, payloads


def _json(data: str, where: str, found: list[str]):
    try:
        return json.loads(data)
    except ValueError:
        found.append(f"{where}: not JSON: {data[:60]!r}")
        return None


def _brief(values: list, width: int = 6) -> str:
    shown = ", ".join(map(str, values[:width]))
    return shown + (", …" if len(values) > width else "")
