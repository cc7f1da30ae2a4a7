"""The scheduler alone, stepping a real engine in this process (no HTTP)."""

from __future__ import annotations

import attrs
import pytest
import trio

from mashbox.engine.engine import Engine
from mashbox.events import (
    MAX_WAITING,
    MAX_WAITING_PER_TENANT,
    Admitted,
    Finished,
    QueueFull,
    Request,
    TextDelta,
)
from mashbox.prompt_cache import common_prefix
from mashbox.protocol import PREVIOUS, Admit, Decode, Prefill, SamplingParams, Step
from mashbox.scheduler import Scheduler
from mashbox.text.tokenizer import Tokenizer
from mashbox.worker_client import EngineLink
from support.tinymodels import step_by_step


class InProcessEngine(EngineLink):
    """The engine link (the Supervisor's part) over an engine running in this process."""

    ready = True

    def __init__(self, engine: Engine, step_delay: float = 0.0):
        self.engine = engine
        self.step_delay = step_delay
        self.steps = 0
        self.sent = []  # in order, as the worker's pipe holds them
        self.ran = []  # every step run, in order
        self.most_in_flight = 0

    def send(self, step):
        self.sent.append(step)
        self.most_in_flight = max(self.most_in_flight, len(self.sent))

    async def receive(self):
        self.steps += 1
        step = self.sent.pop(0)
        # As the worker does: a join already in the pipe when its step starts runs inside it.
        joined = bool(self.sent) and self.sent[0].joins == step.index
        if joined:
            step = step.with_join(self.sent.pop(0))
        self.ran.append(step)
        await trio.sleep(self.step_delay)  # the step runs
        return attrs.evolve(self.engine.step(step), joined=joined)

    async def restart(self):
        self.sent.clear()  # as a new worker's pipe: what the faulted engine was sent never runs


@pytest.fixture(scope="module")
def parts(tiny_llama):
    return Tokenizer.from_gguf(tiny_llama), Engine(tiny_llama, slots=2, ctx=512)


def submit(scheduler: Scheduler, request: Request):
    """(the request as the scheduler holds it, its events), as the tests read both."""
    events = scheduler.submit(request)
    return events.sequence, events


def request(tok, text="Tell me a story", **kw) -> Request:
    params = kw.pop("params", SamplingParams())
    return Request(tuple(tok.encode(text)), params, kw.pop("max_tokens", 400), **kw)


async def test_a_reader_that_takes_nothing_is_dropped_after_the_stall_timeout(parts):
    tok, engine = parts
    worker = InProcessEngine(engine, step_delay=0.005)
    scheduler = Scheduler(tok, worker, slots=2, ctx=512, stall_timeout=0.5)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(scheduler.run)
        seq, events = submit(scheduler, request(tok, ignore_eos=True))
        t0 = trio.current_time()
        while not seq.output_ids:
            await trio.sleep(0.01)
        while scheduler.statistics().running:
            await trio.sleep(0.02)
        elapsed = trio.current_time() - t0
        steps = worker.steps
        await trio.sleep(0.2)
        assert worker.steps == steps  # nothing runs for it any more
        nursery.cancel_scope.cancel()
    # It was dropped after the channel filled and 0.5 s passed, long before 400 tokens.
    assert 0.5 <= elapsed < 10  # the channel fills (64 events), then 0.5 s of nothing taken
    received = [e async for e in events]  # the buffered events, then the closed channel
    assert isinstance(received[0], Admitted)  # its slot, then its text
    assert all(isinstance(e, TextDelta) for e in received[1:])
    assert len(received) < 400


async def test_a_slow_reader_is_never_dropped(parts):
    tok, engine = parts
    worker = InProcessEngine(engine)
    scheduler = Scheduler(tok, worker, slots=2, ctx=512, stall_timeout=0.3)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(scheduler.run)
        _, events = submit(scheduler, request(tok, max_tokens=80, ignore_eos=True))
        received = []
        t0 = trio.current_time()
        async for event in events:
            received.append(event)
            await trio.sleep(0.25 if len(received) % 10 == 0 else 0)  # bursts, then pauses
        assert trio.current_time() - t0 > 1.5  # five times the stall timeout
        nursery.cancel_scope.cancel()
    assert isinstance(received[-1], Finished)
    assert received[-1].usage.completion_tokens == 80


async def test_cancel_frees_the_slot_before_the_next_step(parts):
    tok, engine = parts
    worker = InProcessEngine(engine, step_delay=0.01)
    scheduler = Scheduler(tok, worker, slots=1, ctx=512)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(scheduler.run)
        seq, events = submit(scheduler, request(tok, ignore_eos=True))
        await events.receive()
        queued, _ = submit(scheduler, request(tok, "Another one", max_tokens=2))
        assert scheduler.statistics().waiting == 1
        await events.aclose()  # the route lets go: the request is cancelled
        steps = worker.steps
        while scheduler.statistics().waiting:
            await trio.sleep(0)
        assert worker.steps <= steps + 1  # the queued request took the slot within one step
        assert queued.slot is not None and seq.slot is None
        nursery.cancel_scope.cancel()


def test_queue_limits_per_tenant_and_in_all(parts):
    tok, _ = parts
    # Ready, but never stepped: everyone waits.
    scheduler = Scheduler(tok, InProcessEngine(None), slots=1, ctx=512)
    for _ in range(MAX_WAITING_PER_TENANT):
        submit(scheduler, request(tok, tenant="alice"))
    with pytest.raises(QueueFull) as exc:
        submit(scheduler, request(tok, tenant="alice"))
    assert not exc.value.whole_queue
    tenants = [f"t{i}" for i in range(MAX_WAITING)]
    for name in tenants:
        if len(scheduler.waiting) == MAX_WAITING:
            break
        submit(scheduler, request(tok, tenant=name))
    assert len(scheduler.waiting) == MAX_WAITING
    with pytest.raises(QueueFull) as exc:
        submit(scheduler, request(tok, tenant="somebody-new"))
    assert exc.value.whole_queue


def alone(engine: Engine, prompt, params: SamplingParams, n: int) -> list[int]:
    """n tokens of one sequence, each step planned after the one before (the reference)."""
    return step_by_step(engine, [prompt], n, params)[0]


def test_a_decode_that_feeds_back_the_previous_sample_equals_one_that_names_it(parts, tiny_llama):
    tok, _ = parts
    engine = Engine(tiny_llama, slots=1, ctx=512)
    prompt, seeded = tuple(tok.encode("Once upon a time")), SamplingParams(0.9, seed=5)
    expected = alone(engine, prompt, seeded, 6)
    step = Step(admits=(Admit(0, seeded, prompt),), prefills=(Prefill(0, 0, prompt, True),))
    got = [engine.step(step).tokens[0]]
    for _ in range(5):
        decode = Decode(0, PREVIOUS, len(prompt) + len(got) - 1)
        got.append(engine.step(Step(decodes=(decode,))).tokens[0])
    assert got == expected


async def test_steps_planned_ahead_give_each_stream_what_it_gets_alone(parts, tiny_llama):
    """Two steps in flight (the second planned before the first's tokens are known), five
    requests over two slots: answers that end by length, by a stop string found one step
    late (a wasted row), and slots handed to the next request while a step planned for the
    last owner is still running. Every answer is what the request gets alone."""
    tok, engine = parts
    reference = Engine(tiny_llama, slots=1, ctx=512)
    texts = ["Tell me a story", "Once upon a time", "The sea", "A lighthouse", "Hello"]
    params = [SamplingParams(), SamplingParams(0.8, seed=3), SamplingParams(1.0, top_k=20, seed=9)]
    cases = []
    for i, text in enumerate(texts):
        prompt, p = tuple(tok.encode(text)), params[i % len(params)]
        expected = alone(reference, prompt, p, 40)
        stop = ()
        if i % 2:  # stop on a piece of text the answer reaches mid-way
            words = tok.decode(expected[10:16]).strip()
            stop = (words[: max(3, len(words) // 2)],) if words else ()
        cases.append((Request(prompt, p, 12 + 7 * i, stop=stop, ignore_eos=True), expected))
    worker = InProcessEngine(engine)
    scheduler = Scheduler(tok, worker, slots=2, ctx=512)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(scheduler.run)
        submitted = [submit(scheduler, r) for r, _ in cases]
        for _, events in submitted:
            received = [e async for e in events]
            assert isinstance(received[-1], Finished)
        nursery.cancel_scope.cancel()
    assert worker.most_in_flight == 2
    for (seq, _), (request, expected) in zip(submitted, cases, strict=True):
        n = len(seq.output_ids)
        assert seq.output_ids == expected[:n]
        assert n == request.max_tokens or seq.stops.matched
        assert seq.pending == 0
    assert any(seq.stops.matched for seq, _ in submitted)
    assert all(s.seq is None for s in scheduler.slots)


async def test_a_request_starts_in_the_step_after_the_running_one(parts, tiny_llama):
    """With a decode step planned ahead and queued behind the running one, a request that
    arrives joins that queued step (issue: it used to wait for it, then for a step planned
    after it): its admission and first prompt chunk run in the very next step, beside the
    other stream's decode, and its answer is what it gets alone."""
    tok, engine = parts
    worker = InProcessEngine(engine, step_delay=0.02)
    scheduler = Scheduler(tok, worker, slots=2, ctx=512)
    late = request(tok, "Once upon a time", max_tokens=8, ignore_eos=True)
    expected = alone(Engine(tiny_llama, slots=1, ctx=512), late.prompt_ids, late.params, 8)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(scheduler.run)
        _, first = submit(scheduler, request(tok, max_tokens=300, ignore_eos=True))
        for _ in range(5):
            await first.receive()  # decoding, two steps in flight
        await trio.sleep(0.005)  # inside a step
        assert len(worker.sent) == 1, "no step queued behind the running one"
        running = len(worker.ran) - 1
        seq, events = submit(scheduler, late)
        received = [e async for e in events]
        nursery.cancel_scope.cancel()
    assert isinstance(received[-1], Finished)
    assert seq.output_ids == expected
    next_step = worker.ran[running + 1]
    assert [a.prompt_ids for a in next_step.admits] == [late.prompt_ids]
    assert next_step.prefills and next_step.decodes  # beside the first stream's decode
    assert received[0] == Admitted(0)


async def test_requests_sharing_a_prefix_with_a_running_one_copy_it_and_answer_alike(tiny_llama):
    """Parallel calls under one system prompt: a request admitted while another with the same
    prefix runs copies that prefix's KV from its slot instead of computing it again, and
    answers exactly what it answers alone."""
    tok = Tokenizer.from_gguf(tiny_llama)
    system = "You are a careful assistant who answers in short sentences. " * 6
    texts = [system + "Tell me a story", system + "The sea", system + "Hello there"]
    prompts = [tuple(tok.encode(t)) for t in texts]
    shared = min(common_prefix(prompts[0], p) for p in prompts[1:])
    assert shared > 50
    greedy, seeded = SamplingParams(), SamplingParams(0.8, seed=3)
    reference = Engine(tiny_llama, slots=1, ctx=512)
    expected = [
        alone(reference, p, greedy if i != 1 else seeded, 24) for i, p in enumerate(prompts)
    ]
    worker = InProcessEngine(Engine(tiny_llama, slots=3, ctx=512))
    scheduler = Scheduler(tok, worker, slots=3, ctx=512)  # no host prompt cache
    async with trio.open_nursery() as nursery:
        nursery.start_soon(scheduler.run)
        first = submit(scheduler, Request(prompts[0], greedy, 24, ignore_eos=True))
        while len(first[0].output_ids) < 2:  # its prompt is in its slot
            await trio.sleep(0.001)
        later = [
            submit(scheduler, Request(prompts[1], seeded, 24, ignore_eos=True)),
            submit(scheduler, Request(prompts[2], greedy, 24, ignore_eos=True)),
        ]
        for _, events in [first, *later]:
            assert isinstance([e async for e in events][-1], Finished)
        nursery.cancel_scope.cancel()
    shares = [m for step in worker.ran for m in step.shares]
    assert sorted(m.slot for m in shares) == [1, 2]
    assert all(m.source == 0 and m.n == shared for m in shares)
    assert [seq.cached for seq, _ in later] == [shared, shared]
    for (seq, _), want in zip([first, *later], expected, strict=True):
        assert seq.output_ids == want


def test_in_a_burst_a_request_gets_the_slot_holding_its_own_prompt(parts):
    """Requests queued together are placed longest match first: a request for the prompt a
    free slot still holds gets that slot, though one queued before it shares a little."""
    tok, engine = parts
    scheduler = Scheduler(tok, InProcessEngine(engine), slots=2, ctx=512)
    sea = tuple(tok.encode("The sea is wide and deep and blue tonight"))
    story = tuple(tok.encode("Once upon a time"))
    scheduler.slots[0].tokens, scheduler.slots[0].last_used = [*story, 7, 8], 2
    scheduler.slots[1].tokens, scheduler.slots[1].last_used = [*sea, 5, 6], 1
    near, _ = submit(scheduler, Request((*sea[:3], *story), SamplingParams(), 4))
    again, _ = submit(scheduler, Request(sea, SamplingParams(), 4))
    scheduler._admit()
    assert again.slot is scheduler.slots[1] and again.cached == len(sea) - 1
    assert near.slot is scheduler.slots[0]
