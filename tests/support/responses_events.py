"""What every Responses event stream must hold, whoever produced it."""

from __future__ import annotations


def check_sequence(events) -> None:
    """sequence_number 1, 2, 3...; created, in_progress first; a terminal event last; every
    delta inside an added/done pair of its item."""
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    open_items = set()
    for e in events[2:-1]:
        if e.type == "response.output_item.added":
            open_items.add(e.output_index)
        elif e.type == "response.output_item.done":
            open_items.remove(e.output_index)
        else:
            assert e.output_index in open_items, e.type
    assert not open_items
