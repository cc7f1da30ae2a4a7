"""Server-sent events as the wire carries them: a stream's text split into its events (the
WHATWG rules: `event:` and `data:` fields, `:` comments, a blank line ends each event),
with whatever framing those rules do not allow noted."""

from __future__ import annotations

import re

import attrs

_LINE_END = re.compile(r"\r\n|\r|\n")
FIELDS = ("event", "data", "id", "retry")


@attrs.frozen
class Event:
    name: str | None  # its `event:` field, None without one
    data: str


def parse(text: str) -> tuple[list[Event], list[str]]:
    """The events in a whole stream, and its framing problems."""
    events: list[Event] = []
    found: list[str] = []
    name, data, pending = None, [], False
    lines = _LINE_END.split(text)
    ended = lines[-1] == ""  # the text ended with a line end
    if ended:
        lines.pop()
    for line in lines:
        if line == "":
            if data:
                events.append(Event(name, "\n".join(data)))
            elif pending:
                found.append(f"an event without data (event: {name})")
            name, data, pending = None, [], False
            continue
        if line.startswith(":"):
            continue
        field, colon, value = line.partition(":")
        if not colon or field not in FIELDS:
            found.append(f"not an SSE field: {line[:60]!r}")
            continue
        value = value.removeprefix(" ")
        pending = True
        if field == "event":
            name = value
        elif field == "data":
            data.append(value)
    if pending or not ended:
        found.append("the stream ended inside an event (no blank line after its last one)")
    return events, found
