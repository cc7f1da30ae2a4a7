"""The check's report: a line per case (name, held / FAILED / skipped, a note), under a
failed case its problems or the two texts that differ, and the count at the end."""

from __future__ import annotations

from collections import Counter

from .results import FAILED, HELD, SKIPPED, Result

TEXT_WIDTH = 64  # characters of each differing text shown
MAX_PROBLEMS = 8


def row(name: str, result: Result, name_width: int) -> str:
    lines = [f"  {name:<{name_width}}  {result.status:<7}  {result.note}".rstrip()]
    if result.reference is not None and result.got is not None:
        reference, got = around_difference(result.reference, result.got)
        lines += [f"      reference: {reference}", f"      this case: {got}"]
    lines += [f"      {line}" for line in result.problems[:MAX_PROBLEMS]]
    if len(result.problems) > MAX_PROBLEMS:
        lines.append(f"      ... and {len(result.problems) - MAX_PROBLEMS} more")
    return "\n".join(lines)


def summary(results: list[Result]) -> str:
    counts = Counter(r.status for r in results)
    return f"{counts[HELD]} held, {counts[FAILED]} failed, {counts[SKIPPED]} skipped"


def around_difference(a: str, b: str, width: int = TEXT_WIDTH) -> tuple[str, str]:
    """Both texts cut to `width` characters around where they first differ, quoted."""
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if first is None:
        first = min(len(a), len(b))  # one text is the other's beginning
    start = max(0, first - width // 3)
    return _cut(a, start, width), _cut(b, start, width)


def _cut(text: str, start: int, width: int) -> str:
    shown = repr(text[start : start + width])
    return ("…" if start else "") + shown + ("…" if start + width < len(text) else "")
