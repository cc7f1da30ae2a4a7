"""The engine's vocabulary for grammars, read in a thread once the worker is first idle after
ready: a constrained step that comes first waits for that read rather than starting another,
and a read that fails is tried again by the step (which then fails as loudly as before)."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest

from mashbox.engine import grammar_mask, worker
from mashbox.engine.engine import Engine
from mashbox.engine.faults import Faults
from mashbox.engine.grammar_mask import GrammarMasks
from mashbox.protocol import Shutdown, Step, StepResult, send
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


@pytest.fixture
def serving_worker(tiny_qwen2):
    """The worker's step loop on a real engine over a real pipe, in a thread: yields the
    server's end, the time the loop was started (its IDLE_BY_S counts from then, which may be
    well before the test's first line on a starved host) and the times `when_idle` ran.
    IDLE_S and IDLE_BY_S are the real ones: steps 50 ms apart leave ~0.95 s for a starved
    host's stalls before a pause is seen."""
    engine = Engine(tiny_qwen2, slots=1, ctx=64)
    server_end, worker_end = multiprocessing.Pipe()
    ran: list[float] = []
    loop = threading.Thread(
        target=worker._serve,
        args=(worker_end, engine, Faults(), lambda: ran.append(time.monotonic())),
        daemon=True,
    )
    started = time.monotonic()
    loop.start()
    yield server_end, started, ran
    send(server_end, Shutdown())
    loop.join(10)
    assert not loop.is_alive()


def steps_every(conn, seconds: float, until: float) -> list[float]:
    """Send empty steps `seconds` apart, each after the last one's answer, until `until`:
    the times they were sent."""
    sent = []
    while time.monotonic() < until:
        sent.append(time.monotonic())
        send(conn, Step(index=len(sent) - 1))
        assert isinstance(conn.recv(), StepResult)
        time.sleep(seconds)
    return sent


def test_the_worker_reads_the_vocabulary_once_it_is_idle(serving_worker):
    """Steps coming closer together than IDLE_S leave the read for later; the first pause of
    IDLE_S starts it, once."""
    conn, _, ran = serving_worker
    t0 = time.monotonic()
    sent = steps_every(conn, 0.05, t0 + 1.5)
    assert len(sent) > 5
    assert ran == []  # answers at ready come first
    time.sleep(worker.IDLE_S + 0.5)
    # The pause counts from the worker's answer to the last step, after it was sent.
    assert len(ran) == 1 and ran[0] - sent[-1] >= worker.IDLE_S
    steps_every(conn, worker.IDLE_S + 0.2, time.monotonic() + 3)
    assert len(ran) == 1


def test_under_a_steady_load_the_worker_reads_it_after_idle_by_s(serving_worker):
    conn, started, ran = serving_worker
    steps_every(conn, 0.05, started + worker.IDLE_BY_S + 1.5)
    assert len(ran) == 1 and worker.IDLE_BY_S <= ran[0] - started < worker.IDLE_BY_S + 1.0
