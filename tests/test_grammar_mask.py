"""The engine's vocabulary for grammars, read in a thread once the weights are loaded: a
constrained step that comes first waits for that read rather than starting another, and a
read that fails is tried again by the step (which then fails as loudly as before)."""

from __future__ import annotations

import threading
import time

import pytest

from mashbox.engine import grammar_mask
from mashbox.engine.grammar_mask import GrammarMasks
from mashbox.text.tokenizer import Tokenizer

ANSWER = 'start: "yes" | "no"'


def slowed_reads(monkeypatch, seconds: float, fail: bool = False) -> list[str]:
    """Make every vocabulary read take `seconds` (a 152k-token vocabulary takes ~1.3 s, the
    tiny test models' a few ms) and record which thread did it."""
    readers = []
    read = Tokenizer.for_model

    def slow(path):
        readers.append(threading.current_thread().name)
        time.sleep(seconds)
        if fail:
            raise ValueError("no vocabulary here")
        return read(path)

    monkeypatch.setattr(grammar_mask.Tokenizer, "for_model", slow)
    return readers


def test_a_step_waits_for_the_read_under_way(tiny_qwen2, monkeypatch):
    readers = slowed_reads(monkeypatch, 0.5)
    masks = GrammarMasks(tiny_qwen2)
    t0 = time.monotonic()
    masks.read_soon()
    assert time.monotonic() - t0 < 0.2  # the worker reports ready without waiting
    matcher = masks.matcher(ANSWER)  # as a constrained step does, at once
    assert time.monotonic() - t0 >= 0.5
    assert readers == ["mashbox-vocabulary"]  # read once, by the thread
    assert not matcher.is_error()
    assert masks.grammars() is masks.grammars()


def test_a_failed_read_is_logged_then_tried_again_by_the_step(tiny_qwen2, monkeypatch, caplog):
    readers = slowed_reads(monkeypatch, 0.0, fail=True)
    masks = GrammarMasks(tiny_qwen2)
    masks.read_soon()
    deadline = time.monotonic() + 10
    while "cannot read" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.01)
    assert f"cannot read {tiny_qwen2.name}'s vocabulary for grammars" in caplog.text
    with pytest.raises(ValueError, match="no vocabulary here"):
        masks.matcher(ANSWER)
    assert readers == ["mashbox-vocabulary", threading.current_thread().name]
