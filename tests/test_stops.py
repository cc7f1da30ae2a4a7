"""StopMatcher: stop strings cut streamed text the same way however the text is split."""

from __future__ import annotations

import itertools

import pytest

from mashbox.text.stops import StopMatcher

try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:  # hypothesis is optional
    given = None


def run(stops: list[str], chunks: list[str]) -> tuple[list[str], bool]:
    """Feed chunks in order; return what was emitted (flush included) and whether it stopped."""
    matcher = StopMatcher(stops)
    out = []
    stopped = False
    for chunk in chunks:
        text, stopped = matcher.feed(chunk)
        out.append(text)
    out.append(matcher.flush())
    return out, stopped


def splits(text: str, parts: int) -> list[list[str]]:
    """Every way to cut text into `parts` pieces (pieces may be empty)."""
    result = []
    for cuts in itertools.combinations_with_replacement(range(len(text) + 1), parts - 1):
        bounds = (0, *cuts, len(text))
        result.append([text[a:b] for a, b in itertools.pairwise(bounds)])
    return result


def expected(stops: list[str], text: str) -> tuple[str, bool]:
    """The whole-text answer: cut before the stop that completes first."""
    best = None
    for stop in stops:
        at = text.find(stop)
        if at >= 0 and (best is None or (at + len(stop), at) < best):
            best = (at + len(stop), at)
    return (text, False) if best is None else (text[: best[1]], True)


CASES = [
    (["</s>"], "Hello world</s>ignored"),
    (["\n\n", "User:"], "The answer is 42.\nUser: more"),
    (["abcd", "bc"], "xxabcdyy"),
    (["abcd", "cd"], "xxabcdyy"),
    (["aab"], "aaaab and more"),
    (["<|end|>"], "no stop here, just <|en"),
    (["ab", "b"], "ab"),
    (["stop"], "ststostopst"),
]


@pytest.mark.parametrize(("stops", "text"), CASES)
def test_every_split_gives_the_same_result(stops, text):
    want_text, want_stopped = expected(stops, text)
    for parts in (1, 2, 3):
        for chunks in splits(text, parts):
            out, stopped = run(stops, chunks)
            assert ("".join(out), stopped) == (want_text, want_stopped), chunks
    out, stopped = run(stops, list(text))
    assert ("".join(out), stopped) == (want_text, want_stopped)


def test_partial_match_is_held_back():
    matcher = StopMatcher(["</s>"])
    assert matcher.feed("Hello </") == ("Hello ", False)
    assert matcher.feed("b") == ("</b", False)
    assert matcher.feed(" <") == (" ", False)
    assert matcher.feed("/s") == ("", False)
    assert matcher.feed(">after") == ("", True)
    assert matcher.stopped
    assert matcher.feed("more") == ("", True)
    assert matcher.flush() == ""


def test_flush_returns_unfinished_match():
    matcher = StopMatcher(["User:"])
    assert matcher.feed("Done.\nUse") == ("Done.\n", False)
    assert matcher.flush() == "Use"
    assert matcher.flush() == ""


def test_no_stops_passes_text_through():
    matcher = StopMatcher([])
    assert matcher.feed("anything") == ("anything", False)
    assert matcher.flush() == ""


def test_empty_stop_is_rejected():
    with pytest.raises(ValueError):
        StopMatcher(["ok", ""])


if given is not None:

    @settings(
        max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
    )
    @given(
        stops=st.lists(st.text("abc", min_size=1, max_size=4), min_size=1, max_size=3),
        text=st.text("abcd", max_size=20),
        cuts=st.lists(st.integers(0, 20), max_size=6),
    )
    def test_any_split_matches_whole_text(stops, text, cuts):
        bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
        chunks = [text[a:b] for a, b in itertools.pairwise(bounds)]
        out, stopped = run(stops, chunks)
        assert ("".join(out), stopped) == expected(stops, text)
        # Nothing after the stop, and no part of a stop string, is ever emitted.
        assert not any(s in "".join(out) for s in stops)
