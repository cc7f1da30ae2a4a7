"""Cut streamed text at the first stop string, without ever leaking part of one."""

from __future__ import annotations

MAX_STOPS = 16  # stop strings a request may give (OpenAI allows 4)
MAX_STOP_CHARS = 256  # characters in one stop string


class StopMatcher:
    """Find stop strings in text that arrives in pieces, with one Aho-Corasick automaton.

    The stop is the match that completes first in the text (the earliest-starting one
    among those ending at the same place), so the result does not depend on how the text
    was split into feed() calls. Each character costs O(1) amortized whatever the stops,
    and the automaton's state is the longest end of the text that begins some stop: exactly
    what must be held back.
    """

    def __init__(self, stops: list[str]) -> None:
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop strings must be non-empty strings")
        self._goto: list[dict[str, int]] = [{}]
        self._depth = [0]
        self._stop: list[str | None] = [None]  # the longest stop ending at a state
        for stop in dict.fromkeys(stops):
            state = 0
            for ch in stop:
                if ch not in self._goto[state]:
                    self._goto[state][ch] = len(self._goto)
                    self._goto.append({})
                    self._depth.append(self._depth[state] + 1)
                    self._stop.append(None)
                state = self._goto[state][ch]
            self._stop[state] = stop
        self._fail = self._links()
        self._state = 0
        self._held = ""
        self._stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def _links(self) -> list[int]:
        """Failure links, breadth first; a state without a stop of its own ends the longest
        stop of the state its link leads to."""
        fail = [0] * len(self._goto)
        queue = list(self._goto[0].values())
        for state in queue:
            for ch, child in self._goto[state].items():
                queue.append(child)
                fail[child] = 0 if state == 0 else self._next(fail, fail[state], ch)
                if self._stop[child] is None:
                    self._stop[child] = self._stop[fail[child]]
        return fail

    def _next(self, fail: list[int], state: int, ch: str) -> int:
        while state and ch not in self._goto[state]:
            state = fail[state]
        return self._goto[state].get(ch, 0)

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
        state = self._state
        for i in range(len(self._held), len(buf)):
            state = self._next(self._fail, state, buf[i])
            stop = self._stop[state]
            if stop is not None:
                self._stopped, self._held, self.matched = True, "", stop
                return buf[: i + 1 - len(stop)], True
        self._state = state
        keep = self._depth[state]
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """Return the held-back text at the end of generation (a match that never completed)."""
        held, self._held = self._held, ""
        return "" if self._stopped else held
