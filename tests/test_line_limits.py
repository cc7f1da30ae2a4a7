"""LineWatch: /infill's n_indent and t_max_predict_ms end a code completion where llama-server
ends it, however the text is split into tokens."""

from __future__ import annotations

import itertools

import pytest

from mashbox.text.line_limits import LineLimits, LineWatch


def kept(indent: int, text: str) -> tuple[str, bool]:
    """llama-server's rule on the whole text: a line after the first whose first character
    that is not a space or tab (a blank line's newline too) sits at a column under `indent`
    ends the answer just before that character."""
    lines = text.split("\n")
    at = len(lines[0]) + 1
    for line in lines[1:]:
        column = len(line) - len(line.lstrip(" \t"))
        if column < len(line) or at + len(line) < len(text):  # the line has ended or has text
            if column < indent:
                return text[: at + column], True
        at += len(line) + 1
    return text, False


def feed_all(limits: LineLimits, chunks: list[str], elapsed=0.0) -> tuple[str, bool]:
    watch, out, stopped = LineWatch(limits), [], False
    for chunk in chunks:
        text, stopped = watch.feed(chunk, elapsed)
        out.append(text)
    return "".join(out), stopped


TEXTS = [
    "a + b\n    return c\nprint(x)\n",
    "x\n\ty = 1\n  z\n",
    "first line\n\n    after a blank\n",
    "    deep\n        deeper\n    back\n",
    "no newline at all",
    "\n  \n",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("indent", [1, 2, 4, 8])
def test_every_split_cuts_where_the_whole_text_does(text, indent):
    want = kept(indent, text)
    for a, b in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        chunks = [text[:a], text[a:b], text[b:]]
        assert feed_all(LineLimits(indent), chunks) == want, chunks


def test_the_rule_as_llama_server_applies_it():
    # The first line continues the cursor's: never cut, whatever its indentation.
    assert feed_all(LineLimits(4), ["x = 1"]) == ("x = 1", False)
    # A later line indented as deep goes on; a shallower one ends it where its text starts.
    assert feed_all(LineLimits(4), ["a\n    b\n  c\n"]) == ("a\n    b\n  ", True)
    # Tabs count as one column each, as llama-server counts them.
    assert feed_all(LineLimits(2), ["a\n\t\tb\n\tc"]) == ("a\n\t\tb\n\t", True)
    # A blank line ends it (its newline is not a space or a tab).
    assert feed_all(LineLimits(1), ["a\n", "\n b"]) == ("a\n", True)
    # After the end, nothing more.
    watch = LineWatch(LineLimits(4))
    assert watch.feed("a\nb", 0) == ("a\n", True) and watch.feed("more", 0) == ("", True)


def test_past_the_time_limit_the_next_newline_ends_it():
    limits = LineLimits(seconds=0.5)
    watch = LineWatch(limits)
    assert watch.feed("a\n", 0.4) == ("a\n", False)  # in time: goes on
    assert watch.feed("bc", 0.6) == ("bc", False)  # late, but no newline yet
    assert watch.feed("d\ne", 0.7) == ("d\ne", True)  # the piece with the newline is kept
    assert watch.feed("f\n", 0.8) == ("", True)
    # Both limits: the indentation cut comes first where it falls in the same piece.
    both = LineWatch(LineLimits(2, 0.1))
    assert both.feed("x\ny\n", 1.0) == ("x\n", True)
