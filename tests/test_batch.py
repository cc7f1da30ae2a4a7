"""The scheduler's batch core alone: steps planned, made-up results applied (no engine, no
trio). What each result means for each request, step by step."""

from __future__ import annotations

import pytest

from mashbox.batch import MAX_EVENT_TOKENS, MAX_JOIN_TOKENS, Batch
from mashbox.events import Admitted, Decision, Failed, Finished, Request, Restarted, TextDelta
from mashbox.observer import Observer
from mashbox.protocol import (
    PREVIOUS,
    Admit,
    Branch,
    Decide,
    Decode,
    Prefill,
    SamplingParams,
    Step,
    StepResult,
)
from mashbox.sequence import Sequence
from mashbox.text.tokenizer import Tokenizer

PARIS = "The capital of France is Paris."


@pytest.fixture(scope="module")
def tok(tiny_llama) -> Tokenizer:
    return Tokenizer.from_gguf(tiny_llama)


class Steps(Observer):
    """Records what each applied step generated."""

    def __init__(self):
        self.generated: list[int] = []

    def stepped(self, prompt_tokens, generated_tokens, forwards=0, engine_s=0.0):
        self.generated.append(generated_tokens)


def queue(batch: Batch, prompt, max_tokens=50, **kw) -> Sequence:
    """A request submitted as the scheduler does, without a channel (the core never uses it)."""
    request = Request(tuple(prompt), SamplingParams(), max_tokens, **kw)
    seq = Sequence.new(request, batch.tokenizer, None)
    batch.waiting.append(seq)
    return seq


def send(batch: Batch, step: Step | None, *, ahead: bool = False) -> Step:
    assert step is not None
    batch.track(step, ahead=ahead)
    return step


def result(batch: Batch, tokens: dict[int, int] | None = None, *, joined: bool = False) -> None:
    """The oldest step in flight comes back, having sampled `tokens` (slot -> token)."""
    done = StepResult(tokens or {}, 0.001, joined=joined)
    batch.apply(batch.landed(done), done)


def texts(seq: Sequence) -> str:
    return "".join(e.text for e in seq.outbox if isinstance(e, TextDelta))


def started(batch: Batch, prompt, first: int, **kw) -> Sequence:
    """A request admitted, its whole prompt prefilled and `first` sampled after it."""
    seq = queue(batch, prompt, **kw)
    batch.admit()
    send(batch, batch.plan())
    result(batch, {seq.slot.index: first})
    assert seq.decoding and seq.output_ids == [first]
    return seq


def test_an_admitted_prompt_is_prefilled_a_chunk_a_step_and_its_last_chunk_samples(tok):
    batch = Batch(tok, slots=2, ctx=64, prefill_chunk=4)
    prompt = tok.encode(PARIS * 2)
    assert len(prompt) > 8
    seq = queue(batch, prompt)
    assert batch.plan() is None  # waiting has no slot yet: nothing to run
    assert batch.admit() == [seq]
    assert list(seq.outbox) == [Admitted(0)] and seq.slot is batch.slots[0]
    assert not batch.waiting and batch.statistics().running == 1
    first = send(batch, batch.plan())
    assert first.admits == (Admit(0, seq.request.params, tuple(prompt)),)
    assert first.prefills == (Prefill(0, 0, tuple(prompt[:4]), False),)
    result(batch)
    assert seq.prefilled == 4 and batch.slots[0].tokens == prompt[:4]
    starts = []
    while not seq.decoding:
        step = send(batch, batch.plan())
        assert not step.admits and len(step.prefills) == 1
        (p,) = step.prefills
        starts.append(p.start)
        assert len(p.token_ids) <= 4 and p.sample == (p.start + len(p.token_ids) == len(prompt))
        result(batch, {0: prompt[0]} if p.sample else {})
    assert starts == list(range(4, len(prompt), 4))
    assert seq.output_ids == [prompt[0]] and batch.slots[0].tokens == prompt


def test_a_sampled_token_becomes_text_and_max_tokens_ends_by_length(tok):
    batch = Batch(tok, slots=1, ctx=64)
    answer = tok.encode("Paris is the capital of France")
    seq = started(batch, tok.encode(PARIS), answer[0], max_tokens=3)
    assert texts(seq) == " Paris"
    for token in answer[1:3]:
        step = send(batch, batch.plan())
        assert step.decodes == (Decode(0, seq.output_ids[-1], len(batch.slots[0].tokens)),)
        result(batch, {0: token})
    assert seq.output_ids == answer[:3]
    assert texts(seq) == " Paris is the"
    done = seq.outbox[-1]
    assert isinstance(done, Finished) and done.reason == "length"
    assert done.usage.completion_tokens == 3 and done.usage.prompt_tokens == len(tok.encode(PARIS))
    assert seq.done and seq in batch.draining
    assert seq.slot is None and batch.slots[0].seq is None and batch.plan() is None


def test_the_context_end_ends_by_length(tok):
    prompt = tok.encode(PARIS)
    batch = Batch(tok, slots=1, ctx=len(prompt) + 2)
    seq = started(batch, prompt, prompt[0], max_tokens=50)
    send(batch, batch.plan())
    result(batch, {0: prompt[1]})
    assert isinstance(seq.outbox[-1], Finished) and seq.outbox[-1].reason == "length"
    assert len(seq.output_ids) == 2


def test_an_end_of_generation_token_ends_by_stop_without_text(tok):
    eog = min(tok.eog_ids)
    batch = Batch(tok, slots=1, ctx=64)
    seq = started(batch, tok.encode(PARIS), tok.encode("Paris")[0])
    send(batch, batch.plan())
    result(batch, {0: eog})
    events = list(seq.outbox)
    assert isinstance(events[-1], Finished) and events[-1].reason == "stop"
    assert events[-1].usage.completion_tokens == 2
    assert texts(seq) == " Paris"  # the end of turn has no text
    # Unless the request ignores it (benchmarks): then it is one more token.
    other = Batch(tok, slots=1, ctx=64)
    seq = started(other, tok.encode(PARIS), eog, ignore_eos=True)
    assert not seq.done


def test_a_stop_string_ends_by_stop_and_holds_back_its_text(tok):
    batch = Batch(tok, slots=1, ctx=64)
    answer = tok.encode("Paris is the capital")
    seq = started(batch, tok.encode(PARIS), answer[0], stop=("the",))
    for token in answer[1:]:
        if seq.done:
            break
        send(batch, batch.plan())
        result(batch, {0: token})
    done = seq.outbox[-1]
    assert isinstance(done, Finished) and done.reason == "stop" and done.stop_sequence == "the"
    assert texts(seq) == " Paris is "


def test_decodes_planned_ahead_feed_back_the_previous_sample(tok):
    batch = Batch(tok, slots=1, ctx=64)
    prompt = tok.encode(PARIS)
    answer = tok.encode("Paris is the capital")
    seq = started(batch, prompt, answer[0], max_tokens=4)
    assert not batch.needs_latest_state()
    n = len(prompt)
    assert send(batch, batch.plan()).decodes == (Decode(0, answer[0], n),)
    ahead = send(batch, batch.plan_ahead(), ahead=True)
    assert ahead.decodes == (Decode(0, PREVIOUS, n + 1),)  # its token is still being sampled
    assert seq.pending == 2
    result(batch, {0: answer[1]})
    assert seq.pending == 1
    # Three tokens known or sampling, max_tokens 4: the next one may still be asked for.
    assert send(batch, batch.plan_ahead(), ahead=True).decodes == (Decode(0, PREVIOUS, n + 2),)
    result(batch, {0: answer[2]})
    # The token the engine fed back is known now, and is what the slot holds.
    assert batch.slots[0].tokens == [*prompt, answer[0], answer[1]]
    # Four tokens known or sampling: nothing is planned past max_tokens.
    assert batch.plan_ahead() is None
    result(batch, {0: answer[3]})
    assert seq.output_ids == answer[:4] and seq.pending == 0
    assert isinstance(seq.outbox[-1], Finished) and seq.outbox[-1].reason == "length"


def runs(*tokens: dict[int, int]) -> StepResult:
    """A repeated step's result: each run's sampled tokens, in order."""
    first, *later = (StepResult(t, 0.001) for t in tokens)
    return StepResult(first.tokens, 0.001, more=tuple(later))


def test_a_repeated_step_runs_its_decodes_on_within_every_rows_limits(tok):
    batch = Batch(tok, slots=2, ctx=64)
    answer = tok.encode(" Paris is the capital of France, and")
    long = queue(batch, tok.encode(PARIS), max_tokens=50)
    short = queue(batch, tok.encode("Hello"), max_tokens=5)
    batch.admit()
    send(batch, batch.plan())
    result(batch, {0: answer[0], 1: answer[0]})
    n_long, n_short = len(long.request.prompt_ids), len(short.request.prompt_ids)
    running = send(batch, batch.plan())
    # Each row has one token known and one sampling: `short` may sample 3 more, so 3 runs.
    ahead = send(batch, batch.plan_ahead(8), ahead=True)
    assert ahead.repeat == 3
    assert ahead.decodes == (Decode(0, PREVIOUS, n_long + 1), Decode(1, PREVIOUS, n_short + 1))
    assert [d.position for d in ahead.run(2).decodes] == [n_long + 3, n_short + 3]
    assert long.pending == short.pending == 4
    result(batch, {0: answer[1], 1: answer[1]})
    assert running.repeat == 1 and long.pending == 3
    long.outbox.clear()  # delivered
    done = runs(*({0: t, 1: t} for t in answer[2:5]))
    batch.apply(batch.landed(done), done)
    assert long.output_ids == short.output_ids == answer[:5]
    assert long.pending == short.pending == 0
    # The runs' text is one event, which keeps its pieces; the slot holds every token fed.
    (delta,) = long.outbox
    assert (delta.text, delta.tokens) == (tok.decode(answer[2:5]), 3)
    assert [piece for piece, _ in delta.pieces()] == [tok.decode([t]) for t in answer[2:5]]
    assert batch.slots[0].tokens == [*long.request.prompt_ids, *answer[:4]]
    assert short.done and short.outbox[-1].reason == "length"
    # Alone, `long` repeats as asked; never past its context.
    assert send(batch, batch.plan_ahead(8), ahead=True).repeat == 8
    assert Batch(tok, slots=1, ctx=n_long + 3).plan_ahead(8) is None


def test_a_row_that_ends_inside_a_repeated_step_wastes_the_runs_after_it(tok):
    batch = Batch(tok, slots=1, ctx=64)
    answer = tok.encode("Paris is the capital")
    seq = started(batch, tok.encode(PARIS), answer[0])
    send(batch, batch.plan())
    assert send(batch, batch.plan_ahead(4), ahead=True).repeat == 4
    result(batch, {0: answer[1]})
    eog = min(tok.eog_ids)
    done = runs({0: answer[2]}, {0: eog}, {0: 7}, {0: 8})
    batch.apply(batch.landed(done), done)
    assert seq.output_ids == [*answer[:3], eog] and seq.pending == 0
    assert seq.done and batch.slots[0].seq is None
    assert isinstance(seq.outbox[-1], Finished) and seq.outbox[-1].reason == "stop"
    # What the slot is known to hold stops at the answer's end, not at the wasted runs.
    assert batch.slots[0].tokens == [*seq.request.prompt_ids, *answer[:3]]


def test_a_step_planned_ahead_names_the_ends_of_turn_unless_a_row_ignores_them(tok):
    batch = Batch(tok, slots=2, ctx=64)
    answer = tok.encode("Paris is")
    seq = started(batch, tok.encode(PARIS), answer[0])
    send(batch, batch.plan())
    ahead = send(batch, batch.plan_ahead(4), ahead=True)
    assert ahead.ends == tuple(sorted(tok.eog_ids)) and ahead.repeat == 4
    assert seq.pending == 5
    # The engine stopped after the first run: the row's answer ended there.
    result(batch, {0: answer[1]})
    done = runs({0: min(tok.eog_ids)})
    batch.apply(batch.landed(done), done)
    assert seq.done and seq.pending == 0
    other = Batch(tok, slots=2, ctx=64)
    started(other, tok.encode(PARIS), answer[0], ignore_eos=True)
    send(other, other.plan())
    assert send(other, other.plan_ahead(4), ahead=True).ends == ()


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_row_that_follows_a_grammar_repeats_only_where_its_end_of_turn_ends_it(tok, ignore_eos):
    """Its matcher must never be asked for a token after the answer's end: a row fed back an
    end of turn is left out (`Step.ends`), unless its request ignores ends of turn."""
    batch = Batch(tok, slots=1, ctx=64)
    params = SamplingParams(grammar='start: "yes" | "no"')
    request = Request(tuple(tok.encode(PARIS)), params, 50, ignore_eos=ignore_eos)
    batch.waiting.append(Sequence.new(request, tok, None))
    batch.admit()
    send(batch, batch.plan())
    result(batch, {0: tok.encode("yes")[0]})
    send(batch, batch.plan())
    assert send(batch, batch.plan_ahead(4), ahead=True).repeat == (1 if ignore_eos else 4)


def test_a_reader_far_behind_gets_its_text_in_events_of_bounded_size(tok):
    """Text the route has not taken grows the last event, but only up to MAX_EVENT_TOKENS:
    each token's copy stays bounded however far behind the reader is."""
    batch = Batch(tok, slots=1, ctx=512)
    answer = tok.encode(PARIS * 20)
    seq = started(batch, tok.encode("Hello"), answer[0], max_tokens=len(answer))
    for token in answer[1:]:
        send(batch, batch.plan())
        result(batch, {0: token})
    deltas = [e for e in seq.outbox if isinstance(e, TextDelta)]
    assert len(answer) > 3 * MAX_EVENT_TOKENS
    assert len(deltas) >= len(answer) // MAX_EVENT_TOKENS
    assert all(d.tokens <= MAX_EVENT_TOKENS for d in deltas)
    assert sum(d.tokens for d in deltas) == len(answer)
    assert texts(seq) == tok.decode(answer)


def test_a_row_for_a_slot_freed_while_it_ran_is_wasted_and_ignored(tok):
    steps = Steps()
    batch = Batch(tok, slots=1, ctx=64, observer=steps)
    prompt = tok.encode(PARIS)
    seq = started(batch, prompt, tok.encode("Paris")[0])
    send(batch, batch.plan())
    send(batch, batch.plan_ahead(), ahead=True)
    result(batch, {0: min(tok.eog_ids)})  # the end of turn: the row after it is wasted
    assert seq.done and batch.slots[0].seq is None
    # The freed slot goes to the next request before the wasted row's result is in.
    later = queue(batch, tok.encode("Hello, world!"))
    batch.admit()
    assert later.slot is batch.slots[0]
    held = list(batch.slots[0].tokens)
    result(batch, {0: 42})
    assert seq.output_ids == [tok.encode("Paris")[0], min(tok.eog_ids)]
    assert seq.pending == 0 and not later.output_ids and batch.slots[0].tokens == held
    assert steps.generated[-1] == 0
    assert isinstance(seq.outbox[-1], Finished) and list(later.outbox) == [Admitted(later.cached)]


def test_a_request_that_arrives_while_a_step_is_queued_joins_it(tok):
    batch = Batch(tok, slots=2, ctx=64)
    first = started(batch, tok.encode(PARIS), tok.encode("Paris")[0])
    send(batch, batch.plan())
    later = queue(batch, tok.encode("Hello, world!"))
    assert batch.plan_join() is None  # no step queued behind the running one
    queued = send(batch, batch.plan_ahead(), ahead=True)
    join = send(batch, batch.plan_join())
    assert join.joins == queued.index and later.slot is batch.slots[1]
    assert [a.slot for a in join.admits] == [1] and not join.decodes
    assert join.prefills == (Prefill(1, 0, later.request.prompt_ids, True),)
    result(batch, {0: 300})
    result(batch, {0: 301, 1: 302}, joined=True)  # the engine ran the join inside its step
    assert not batch.in_flight
    assert first.output_ids[-2:] == [300, 301] and later.output_ids == [302]
    assert first.pending == later.pending == 0


def test_a_decision_joins_for_its_prefix_and_is_read_beside_the_streams(tok):
    """A join that comes once its step has started runs alone, without the decodes: a
    question read there (thousands of rows) would hold every stream for a step of its own. So
    a joining decision only prefills its prefix; its read goes in the next step, with them."""
    batch = Batch(tok, slots=2, ctx=64)
    first = started(batch, tok.encode(PARIS), tok.encode("Paris")[0])
    send(batch, batch.plan())
    question = Branch(tuple(tok.encode(" Yes or no?")), ((1, 2),))
    decision = queue(batch, tok.encode("Hello, world!"), max_tokens=1, branches=(question,))
    send(batch, batch.plan_ahead(), ahead=True)
    join = send(batch, batch.plan_join())
    assert join.prefills == (Prefill(1, 0, decision.request.prompt_ids, False),)
    assert not join.decides and not join.decodes
    result(batch, {0: 300})
    result(batch, {0: 301})  # the join ran after its step, on its own
    step = send(batch, batch.plan())
    assert step.decides == (Decide(1, len(decision.request.prompt_ids), (question,)),)
    assert step.decodes == (Decode(0, 301, len(first.request.prompt_ids) + 2),)


def test_a_long_question_is_written_a_chunk_a_step_then_read(tok):
    """A question longer than a prompt chunk would hold every stream for its whole read: its
    suffix goes into the slot after the prefix a chunk a step, cut from its own start, then
    its last piece and leaves are read. Short questions still go together."""
    batch = Batch(tok, slots=2, ctx=256, prefill_chunk=16)
    steady = started(batch, tok.encode(PARIS), tok.encode("Paris")[0])
    short = Branch((5, 6, 7), ((1, 2),))
    long = Branch(tuple(range(100, 140)), ((1, 2),), leaves=(3, 4))
    prompt = tok.encode("Hello, world!")
    n = len(prompt)
    decision = queue(batch, prompt, max_tokens=1, branches=(short, short, long, short))
    batch.admit()
    slot = decision.slot.index
    step = send(batch, batch.plan())  # the prefix completes, the short ones are read after it
    assert step.prefills[-1] == Prefill(slot, 0, tuple(prompt), False)
    assert step.decides == (Decide(slot, n, (short, short)),)
    read = ((-0.5,),)  # each question's log-probs, as the engine gives them

    def landed(token: int, reads: int = 0) -> None:
        done = StepResult({0: token}, 0.001, decisions={slot: (read,) * reads} if reads else {})
        batch.apply(batch.landed(done), done)

    landed(300, reads=2)
    pieces = []
    for _ in range(2):  # 40 tokens in chunks of 16: two pieces, then the last 8 read
        step = send(batch, batch.plan())
        assert len(step.decodes) == 1 and not step.decides
        pieces += step.prefills
        landed(301)
    assert pieces == [
        Prefill(slot, n, long.token_ids[:16], False, alone=True),
        Prefill(slot, n + 16, long.token_ids[16:32], False, alone=True),
    ]
    assert batch.slots[slot].tokens == [*prompt, *long.token_ids[:32]]
    step = send(batch, batch.plan())
    tail = Branch(long.token_ids[32:], ((1, 2),), leaves=(3, 4))
    assert step.decides == (Decide(slot, n + 32, (tail,)),)
    landed(302, reads=1)
    assert batch.slots[slot].tokens == list(prompt)  # the next question goes after the prefix
    assert send(batch, batch.plan()).decides == (Decide(slot, n, (short,)),)
    landed(303, reads=1)
    assert decision.outbox[-2] == Decision((read,) * 4) and decision.done
    assert steady.output_ids[-5:] == [300, 301, 301, 302, 303]  # a token every step


def test_a_prompt_too_long_to_join_waits_for_a_step_planned_on_the_latest_state(tok):
    batch = Batch(tok, slots=2, ctx=2 * MAX_JOIN_TOKENS)
    started(batch, tok.encode(PARIS), tok.encode("Paris")[0])
    send(batch, batch.plan())
    send(batch, batch.plan_ahead(), ahead=True)
    long = queue(batch, tok.encode(PARIS) * (MAX_JOIN_TOKENS // 7 + 1))
    assert batch.plan_join() is None and list(batch.waiting) == [long]


def test_a_fault_runs_requests_again_once_and_fails_the_one_that_caused_it(tok):
    batch = Batch(tok, slots=2, ctx=64, prefill_chunk=64)
    steady = started(batch, tok.encode(PARIS), tok.encode("Paris")[0])
    assert texts(steady) == " Paris"
    newcomer = queue(batch, tok.encode("Hello, world!"))
    batch.admit()
    send(batch, batch.plan())  # the steady decode, and the newcomer's first work: lost
    batch.on_fault(hung=False, unseen=lambda seq: True)
    assert not batch.in_flight and all(not s.tokens and s.seq is None for s in batch.slots)
    # Only the newcomer's new work was there beside a decode that ran fine before: its fault.
    failed = newcomer.outbox[-1]
    assert failed == Failed("the request faulted the engine and is not run again", status=500)
    assert newcomer.done and newcomer in batch.draining
    # The other runs again from the start; its handler drops the text it had.
    assert list(batch.waiting) == [steady] and steady.retried
    assert list(steady.outbox) == [Restarted()]
    assert not steady.output_ids and steady.prefilled == 0 and not steady.admitted
    batch.admit()
    step = send(batch, batch.plan())
    assert step.prefills == (Prefill(steady.slot.index, 0, steady.request.prompt_ids, True),)
    # A second fault: its one run again is spent. A hung engine is a 504.
    batch.on_fault(hung=True, unseen=lambda seq: True)
    assert steady.outbox[-1] == Failed("the request timed out on the device", status=504)
    assert not batch.waiting


def test_a_join_lost_alone_after_its_step_is_the_fault_of_its_new_work(tok):
    """The engine ran a join after the step it was queued behind (not inside it), and faulted
    on it: only the newcomer's work was lost, beside a request decoding steadily until then.
    Found on a slow host, where the newcomer was run again beside it, faulted again and took
    the steady one's only run again with it."""
    batch = Batch(tok, slots=2, ctx=64)
    steady = started(batch, tok.encode(PARIS), tok.encode("Paris")[0])
    send(batch, batch.plan())
    newcomer = queue(batch, tok.encode("Hello, world!"))
    send(batch, batch.plan_ahead(), ahead=True)
    send(batch, batch.plan_join())
    result(batch, {0: 300})
    result(batch, {0: 301})  # not joined: the join runs after, on its own
    assert [sent.step.decodes for sent in batch.in_flight] == [()]
    batch.on_fault(hung=False, unseen=lambda seq: True)
    assert newcomer.outbox[-1] == Failed(
        "the request faulted the engine and is not run again", status=500
    )
    assert list(batch.waiting) == [steady] and steady.retried


def test_a_stream_runs_again_only_if_its_client_has_seen_nothing(tok):
    batch = Batch(tok, slots=2, ctx=64)
    seen = queue(batch, tok.encode(PARIS), stream=True)
    unseen = queue(batch, tok.encode("Hello, world!"), stream=True)
    batch.admit()
    send(batch, batch.plan())
    result(batch, {0: tok.encode("Paris")[0], 1: tok.encode("Paris")[0]})
    send(batch, batch.plan())  # decodes only: nobody's new work, nobody to blame
    batch.on_fault(hung=False, unseen=lambda seq: seq is unseen)
    assert seen.outbox[-1] == Failed("the request failed on the device", status=500)
    assert list(batch.waiting) == [unseen] and list(unseen.outbox) == [Restarted()]
