"""End a code completion where an editor wants it to end, as llama-server does for `/infill`
(its `n_indent` and `t_max_predict_ms`): at a later line indented less than the cursor's, or
at a newline once the answer has taken long enough."""

from __future__ import annotations

import attrs

_BLANK = " \t"


@attrs.frozen
class LineLimits:
    """indent: a line after the first that starts with fewer than this many spaces or tabs
    ends the answer (a blank line too), cut where its text starts; seconds: past this long
    since the first token, the answer ends with the first newline it then writes."""

    indent: int = 0
    seconds: float | None = None


class LineWatch:
    """LineLimits applied to an answer's text as it arrives in pieces (after stop strings):
    the result does not depend on how the text was split."""

    def __init__(self, limits: LineLimits):
        self.limits = limits
        # Spaces and tabs so far at the start of the current line; None on the first line
        # (it continues the cursor's) and once a line's text has started.
        self.column: int | None = None
        self.stopped = False

    def feed(self, text: str, elapsed_s: float) -> tuple[str, bool]:
        """Return the part of `text` the answer keeps, and True once a limit ends it;
        elapsed_s: seconds since the answer's first token."""
        if self.stopped:
            return "", True
        indent = self.limits.indent
        if indent > 0:
            for i, ch in enumerate(text):
                if self.column is not None and ch not in _BLANK and self.column < indent:
                    self.stopped = True
                    return text[:i], True
                if ch == "\n":
                    self.column = 0
                elif ch in _BLANK:
                    if self.column is not None:
                        self.column += 1
                else:
                    self.column = None
        seconds = self.limits.seconds
        if seconds is not None and elapsed_s > seconds and "\n" in text:
            self.stopped = True
        return text, self.stopped
