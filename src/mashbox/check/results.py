"""What one case found: held, FAILED or skipped, with a note, the problems a conformance
case saw and, where a reproducibility case failed, the two texts that differ."""

from __future__ import annotations

import attrs

HELD, FAILED, SKIPPED = "held", "FAILED", "skipped"


@attrs.frozen
class Result:
    status: str
    note: str = ""
    problems: tuple[str, ...] = ()
    reference: str | None = None  # the text asked alone...
    got: str | None = None  # ...and this case's, where they differ

    @property
    def failed(self) -> bool:
        return self.status == FAILED


def held(note: str = "") -> Result:
    return Result(HELD, note)


def skipped(note: str) -> Result:
    return Result(SKIPPED, note)


def failed(note: str, *, problems=(), reference=None, got=None) -> Result:
    return Result(FAILED, note, tuple(problems), reference, got)


def same_text(reference: str, got: str, note: str = "", *, why: str = "") -> Result:
    """Held when this case's text is the reference's, else FAILED showing both (and `why`,
    where the server itself says it may differ)."""
    if got == reference:
        return held(note)
    differs = "; ".join(filter(None, ("the text differs from the reference", why)))
    return failed(differs, reference=reference, got=got)
