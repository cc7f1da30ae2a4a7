"""Steps planned ahead, through the real engine process and its pipe: while the engine runs
one decode step the next is already in its pipe, planned before the running step's tokens
are known. What that may never change: seeded answers (the same tokens as a request run
alone, step by step), answers ending at a stop string or at max_tokens (no token computed
ahead is ever emitted or counted), a cancelled stream's slot (free for the next request at
once, which answers as it would alone) and a request joining a queued step."""

from __future__ import annotations

import contextlib

import pytest
import trio

from mashbox.engine.engine import Engine
from mashbox.events import Finished, Request, TextDelta
from mashbox.protocol import PREVIOUS, Admit, Decode, Load, Prefill, SamplingParams, Step
from mashbox.scheduler import MAX_REPEAT, Scheduler
from mashbox.text.stops import StopMatcher
from mashbox.text.tokenizer import Detokenizer, Tokenizer
from mashbox.worker_client import EngineLink, Supervisor, WorkerProcess
from support.tinymodels import step_by_step


class Recorded(EngineLink):
    """The server's engine process (a Supervisor), with each step sent and who owned each
    slot when it was sent, and a count of results received."""

    def __init__(self, supervisor: Supervisor):
        self.supervisor = supervisor
        self.scheduler: Scheduler | None = None
        self.sent = []  # (step, {slot: the sequence owning it then})
        self.received = 0

    @property
    def ready(self) -> bool:
        return self.supervisor.ready

    def send(self, step):
        owners = {s.index: s.seq for s in self.scheduler.slots if s.seq is not None}
        self.sent.append((step, owners))
        self.supervisor.send(step)

    async def receive(self):
        result = await self.supervisor.receive()
        self.received += 1
        return result

    async def restart(self):
        await self.supervisor.restart()

    def rows(self, seq) -> list[int]:
        """The positions of every decode row sent for `seq` (every run of a repeated step)."""
        return [
            d.position
            for step, owners in self.sent
            for i in range(step.repeat)
            for d in step.run(i).decodes
            if owners[d.slot] is seq
        ]


@pytest.fixture(scope="module")
def tok(tiny_llama) -> Tokenizer:
    return Tokenizer.from_gguf(tiny_llama)


@pytest.fixture(scope="module")
def reference(tiny_llama) -> Engine:
    return Engine(tiny_llama, slots=1, ctx=512)


@contextlib.asynccontextmanager
async def serving(tiny_llama, tok, slots: int, decode_burst: float = 0.0):
    """A scheduler stepping a real engine process (threads=1: the tests share the cores);
    decode_burst: as `mashbox run --decode-burst`, in seconds."""
    supervisor = Supervisor(
        lambda: WorkerProcess(device="cpu", threads=1), Load(str(tiny_llama), slots=slots, ctx=512)
    )
    await supervisor.start()
    link = Recorded(supervisor)
    scheduler = Scheduler(tok, link, slots=slots, ctx=512, decode_burst=decode_burst)
    link.scheduler = scheduler
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(scheduler.run)
            yield scheduler, link
            while scheduler.batch.in_flight:  # no result left unread in the pipe at the end
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    finally:
        supervisor.stop()


def alone(engine: Engine, prompt, params: SamplingParams, n: int) -> list[int]:
    return step_by_step(engine, [prompt], n, params)[0]


def read_alone(tok: Tokenizer, tokens: list[int], stop: tuple[str, ...]) -> tuple[int, str]:
    """Where an answer of these tokens ends (the token completing a stop string, else after
    all of them) and its text, read token by token as the scheduler reads them."""
    detok, stops, text = Detokenizer(tok), StopMatcher(list(stop)), ""
    for n, token in enumerate(tokens, 1):
        piece, stopped = stops.feed(detok.feed(token))
        text += piece
        if stopped:
            return n, text
    piece, _ = stops.feed(detok.flush())
    return len(tokens), text + piece + stops.flush()


async def answer(events) -> tuple[str, Finished]:
    text, last = "", None
    async for event in events:
        if isinstance(event, TextDelta):
            text += event.text
        last = event
    assert isinstance(last, Finished), last
    return text, last


@pytest.mark.parametrize("burst", [0.0, 1.0], ids=["one-run-a-step", "repeated-steps"])
async def test_answers_with_steps_ahead_are_the_answers_alone(tiny_llama, tok, reference, burst):
    """Seeded and greedy requests over two slots, ending at a stop string or at max_tokens:
    each answer is the reference's tokens up to exactly where it ends. A stop string found
    one step late costs rows computed ahead, which are neither emitted nor counted; an
    answer ending by length is never decoded past its end. So too where decode steps repeat
    (`--decode-burst`: up to MAX_REPEAT runs a step on the tiny model)."""
    seeded, top_k = SamplingParams(0.8, seed=3), SamplingParams(1.0, top_k=20, seed=9)
    cases = []
    for i, (text, params) in enumerate(
        [("Tell me a story", seeded), ("Once upon a time", SamplingParams()), ("The sea", top_k)]
    ):
        prompt = tuple(tok.encode(text))
        expected = alone(reference, prompt, params, 48)
        stop = ()
        if i != 1:  # a piece of text the answer reaches mid-way
            words = tok.decode(expected[12:20]).strip()
            stop = (words[: max(3, len(words) // 2)],)
        cases.append((Request(prompt, params, 30, stop=stop, ignore_eos=True), expected))
    async with serving(tiny_llama, tok, slots=2, decode_burst=burst) as (scheduler, link):
        submitted = [scheduler.submit(r) for r, _ in cases]
        answers = [await answer(events) for events in submitted]
    assert any(len(step.decodes) and not step.prefills for step, _ in link.sent)
    assert max(step.repeat for step, _ in link.sent) == (MAX_REPEAT if burst else 1)
    for events, (request, expected), (text, done) in zip(submitted, cases, answers, strict=True):
        seq, n_prompt = events.sequence, len(request.prompt_ids)
        if request.stop:  # ends with the token that completes the stop string
            n, alone_text = read_alone(tok, expected, request.stop)
            assert n < request.max_tokens
            assert done.reason == "stop"
            # The step planned ahead asked for the token after the last: computed, unused.
            assert n_prompt + n - 1 in link.rows(seq)
        else:
            n, alone_text = read_alone(tok, expected[: request.max_tokens], ())
            assert done.reason == "length"
            assert max(link.rows(seq)) == n_prompt + n - 2  # no row past the answer's end
        assert text == alone_text
        assert seq.output_ids == expected[:n]
        assert done.usage.completion_tokens == n
        assert seq.pending == 0


async def test_a_cancelled_stream_frees_its_slot_for_the_next_request_at_once(
    tiny_llama, tok, reference
):
    """One slot, a stream cancelled with a step planned ahead for it in the pipe: the queued
    request takes the slot within one step, and the cancelled stream's rows computed ahead
    in that slot change nothing in its answer."""
    params = SamplingParams(0.9, seed=11)
    later = Request(tuple(tok.encode("A lighthouse")), params, 10, ignore_eos=True)
    expected = alone(reference, later.prompt_ids, params, 10)
    first = Request(tuple(tok.encode("Tell me a story")), SamplingParams(), 400, ignore_eos=True)
    async with serving(tiny_llama, tok, slots=1) as (scheduler, link):
        events = scheduler.submit(first)
        for _ in range(6):
            await events.receive()
        queued = scheduler.submit(later)
        assert scheduler.statistics().waiting == 1
        # Results received when the queued request gets its slot, counted as it happens:
        # by the time this task looks, trio may have let the scheduler take one more.
        placed_at, admit = [], scheduler.batch.admit

        def admit_and_count(*args, **kwargs):
            placed = admit(*args, **kwargs)
            if any(seq is queued.sequence for seq in placed):
                placed_at.append(link.received)
            return placed

        scheduler.batch.admit = admit_and_count
        await events.aclose()  # the route lets go mid-stream
        received = link.received
        with trio.fail_after(30):
            while queued.sequence.slot is None:
                await trio.sleep(0)
        assert placed_at[0] <= received + 1  # placed within one step
        assert events.sequence.slot is None
        _, done = await answer(queued)
    assert queued.sequence.output_ids == expected
    assert done.usage.completion_tokens == 10


async def test_a_request_that_joins_a_queued_step_answers_as_it_would_alone(
    tiny_llama, tok, reference
):
    """A request arriving while a stream decodes joins the step planned ahead (inside it if
    the engine has not started it, right after it if it has): both answers are as alone."""
    params = SamplingParams(0.7, seed=5)
    running = Request(tuple(tok.encode("The sea")), params, 40, ignore_eos=True)
    late = Request(tuple(tok.encode("Once upon a time")), params, 12, ignore_eos=True)
    expected_running = alone(reference, running.prompt_ids, params, 40)
    expected_late = alone(reference, late.prompt_ids, params, 12)
    async with serving(tiny_llama, tok, slots=2) as (scheduler, link):
        first = scheduler.submit(running)
        for _ in range(4):
            await first.receive()
        second = scheduler.submit(late)
        await answer(second)
        await answer(first)
    assert any(step.joins for step, _ in link.sent)  # it came in as a join
    assert second.sequence.output_ids == expected_late
    assert first.sequence.output_ids == expected_running


def test_a_row_fed_back_an_end_of_turn_is_left_out_of_the_runs_after(tiny_llama, tok):
    """`Step.ends`: a row whose answer has ended (it is fed back an end of turn) is computed
    no more, in the runs of its step or in a step planned ahead before its end was known;
    a step with no row left ends there, having run nothing."""
    engine = Engine(tiny_llama, slots=2, ctx=128)
    prompts = [tuple(tok.encode("Tell me a story")), tuple(tok.encode("The sea"))]
    (a, b) = step_by_step(engine, prompts, 4)  # each row's greedy tokens
    assert a[1] not in b[1:3]  # so that only row 0 counts a[1] as its end
    first = engine.step(
        Step(
            admits=tuple(Admit(s, SamplingParams(), p) for s, p in enumerate(prompts)),
            prefills=tuple(Prefill(s, 0, p, True) for s, p in enumerate(prompts)),
        )
    )
    assert first.tokens == {0: a[0], 1: b[0]}
    decodes = tuple(Decode(s, PREVIOUS, len(p)) for s, p in enumerate(prompts))
    done = engine.step(Step(1, decodes=decodes, repeat=3, ends=(a[1],)))
    assert done.tokens == {0: a[1], 1: b[1]}
    assert [r.tokens for r in done.more] == [{1: b[2]}, {1: b[3]}]
    # Planned ahead before b[3] was known to end row 1: nothing runs.
    ahead = Step(2, decodes=(Decode(1, PREVIOUS, len(prompts[1]) + 3),), repeat=4, ends=(b[3],))
    idle = engine.step(ahead)
    assert idle.tokens == {} and idle.forwards == 0 and idle.more == ()
