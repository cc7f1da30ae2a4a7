"""Cut streamed text at the first stop string, without ever leaking part of one."""

from __future__ import annotations


class StopMatcher:
    """Find stop strings in text that arrives in pieces.

    The stop is the match that completes first in the text (the earliest-starting one
    among those ending at the same place), so the result does not depend on how the text
    was split into feed() calls.
    """

    def __init__(self, stops: list[str]) -> None:
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop strings must be non-empty strings")
        self._stops = tuple(dict.fromkeys(stops))
        self._held = ""
        self._stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    @property
    def stopped(self) -> bool:
        """Tell whether a stop string has matched."""
        return self._stopped

    def feed(self, text: str) -> tuple[str, bool]:
        """Add text; return the text safe to emit now, and True once a stop string matched.

        After a match the returned text is everything before it, and later calls return
        ("", True).
        """
        if self._stopped:
            return "", True
        buf = self._held + text
        match = self._first_match(buf)
        if match is not None:
            self._stopped = True
            self._held = ""
            self.matched = match[1]
            return buf[: match[0]], True
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """Return the held-back text at the end of generation (a match that never completed)."""
        held, self._held = self._held, ""
        return "" if self._stopped else held

    def _first_match(self, buf: str) -> tuple[int, str] | None:
        """Return where the stop that ends first in buf starts, and which stop it is."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = buf.find(stop)
            if start >= 0:
                cand = (start + len(stop), start, stop)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        return None if best is None else (best[1], best[2])

    def _partial_suffix(self, buf: str) -> int:
        """Return the length of the longest suffix of buf that begins some stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:n]):
                    longest = n
                    break
        return longest
