"""The scheduler's batch core: which requests hold the KV slots, what the next engine step
runs, and what each step's result means for each request. Synchronous and trio-free, as
nano-vllm's `Scheduler.schedule` / `postprocess`: the scheduler's task (scheduler.py) sends
the steps it plans and hands it their results; tests hand it made-up ones.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Callable, Iterator

import attrs

from .events import (
    Admitted,
    Decision,
    Embedding,
    Failed,
    Finished,
    PromptLogprobs,
    TextDelta,
    TokenLogprob,
)
from .kv_moves import KVMoves
from .observer import Observer, Stats
from .placement import pair, pick
from .prompt_cache import PromptCache
from .protocol import PREVIOUS, Admit, Decide, Decode, Prefill, Step, StepResult
from .sequence import Sent, Sequence, Slot
from .text.tokenizer import Tokenizer

log = logging.getLogger("mashbox")

# Why a request ended whose logits were not finite (`Batch._overflowed`).
NONFINITE = (
    "the model's logits were NaN or infinite: a numerical overflow. With a float16 KV cache "
    "(`/v1/models` says `kv_dtype`) keys or values past 65504 overflow; `mashbox run "
    "--kv-dtype float32` keeps them as computed"
)

# Prompt tokens a join may carry (`Batch.plan_join`): it is written to the engine's pipe while
# a step runs, so it must fit the pipe's buffer (64 KiB) or the event loop would wait.
MAX_JOIN_TOKENS = 4096

# The most generated tokens one text event grows to (`Batch._emit`): growing copies the event,
# so a reader far behind costs a bounded copy a token, not one the length of its backlog.
MAX_EVENT_TOKENS = 32


class Batch:
    """The queue, the slots and the steps in flight. Each request's events go to its
    `outbox`; one that ended waits in `draining` until its events are delivered."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        slots: int,
        ctx: int,
        prefill_chunk: int = 256,
        observer: Observer | None = None,
        prompt_cache: PromptCache | None = None,
        tenant_slots: int = 0,
    ):
        """tenant_slots: slots one tenant's requests may hold at once (0: any number)."""
        self.tokenizer = tokenizer
        self._ends = tuple(sorted(tokenizer.eog_ids))  # what a step planned ahead names
        self.ctx = ctx
        self.prefill_chunk = prefill_chunk
        self.tenant_slots = tenant_slots or slots
        self.observer = observer or Observer()
        self.slots = [Slot(i) for i in range(slots)]
        self.moves = KVMoves(self.slots, prompt_cache or PromptCache(0, 0))
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.draining: list[Sequence] = []  # finished, events not yet taken by the handler
        self.in_flight: collections.deque[Sent] = collections.deque()  # oldest first, at most 2
        self._uses = 0
        self._steps = 0

    @property
    def prompt_cache(self) -> PromptCache:
        return self.moves.prompt_cache

    def statistics(self) -> Stats:
        running = [s for s in self.slots if s.seq is not None]
        used = sum(len(s.tokens) for s in running)
        cache = self.prompt_cache
        return Stats(
            running=len(running),
            waiting=len(self.waiting),
            slots=len(self.slots),
            kv_cache_usage=used / (len(self.slots) * self.ctx) if self.slots and self.ctx else 0.0,
            cache_bytes=cache.nbytes,
            cache_cap_bytes=cache.cap_bytes,
            cache_evictions=cache.evictions,
        )

    def live(self) -> Iterator[Sequence]:
        """The requests whose events may still be on their way: running, then draining."""
        yield from (s.seq for s in self.slots if s.seq is not None)
        yield from self.draining

    # --- placement ------------------------------------------------------------------------

    def admit(self, free: list[Slot] | None = None, budget: float = math.inf) -> list[Sequence]:
        """Give free slots to waiting requests, fairly across tenants (`placement.pick`), each
        to a free slot sharing the longest prefix with its prompt (`placement.pair`). Return
        the requests placed (their prompts at most `budget` tokens in all)."""
        if not self.waiting:  # the common case, every step of steady decoding
            return []
        if free is None:
            free = [s for s in self.slots if s.seq is None]
        batch = pick(self.waiting, self.slots, len(free), self.tenant_slots, budget)
        # In arrival order: an earlier one can be a later one's source (`KVMoves.bring_prefix`).
        for seq, slot, shared in pair(batch, free):
            self._place(seq, slot, shared)
        return batch

    def _place(self, seq: Sequence, slot: Slot, shared: int) -> None:
        """Admit seq to slot, which holds `shared` tokens of its prompt (`admit`'s match)."""
        prompt = seq.request.prompt_ids
        # Generation runs at least its last prompt token (its logits give the first new
        # token); a decision reads after the prefix and can take all of it from a cache.
        reusable = len(prompt) - (0 if seq.request.branches else 1)
        if not seq.request.reads_every_position:  # (pooling, echo's log-probs): no reuse
            shared = self.moves.bring_prefix(slot, seq.request.tenant, prompt, shared, reusable)
        seq.cached = min(shared, reusable)
        del slot.tokens[seq.cached :]
        slot.tenant = seq.request.tenant
        seq.prefilled = seq.cached
        seq.outbox.append(Admitted(seq.cached))
        self.observer.admitted(len(prompt), seq.cached)
        self._uses += 1
        slot.seq, slot.last_used, seq.slot = seq, self._uses, slot
        seq.t_start = time.perf_counter()

    # --- planning -------------------------------------------------------------------------

    def plan(self, only: list[Sequence] | None = None, *, reads: bool = True) -> Step | None:
        """The next step on the engine's latest state; `only`: just these requests' work;
        `reads`: whether decisions' reads may be planned (not in a join: `plan_join`)."""
        admits, prefills, decodes, decides = [], [], [], []
        budget = self.prefill_chunk
        for slot in self.slots:
            seq = slot.seq
            if seq is None or (only is not None and seq not in only):
                continue
            if not seq.admitted:
                admits.append(Admit(slot.index, seq.request.params, seq.request.prompt_ids))
                seq.admitted = True
            prompt = seq.request.prompt_ids
            if seq.request.branches and seq.prefilled == len(prompt):
                if reads:
                    budget -= self._read(seq, budget, decides, prefills)
            elif seq.decoding:
                # A reader that is behind does not hold its slot: its answer goes on into its
                # outbox (at most max_tokens events) and frees the slot when it ends.
                pos = len(seq.request.prompt_ids) + len(seq.output_ids) - 1
                decodes.append(Decode(slot.index, seq.output_ids[-1], pos))
            elif budget > 0:
                chunk = prompt[seq.prefilled : seq.prefilled + budget]
                budget -= len(chunk)
                last = seq.prefilled + len(chunk) == len(prompt)
                branches, embed = seq.request.branches, seq.request.embed
                sample = last and not branches
                prefills.append(Prefill(slot.index, seq.prefilled, chunk, sample, embed))
                if last and branches and reads:  # right after the chunk completing the prefix
                    budget -= self._read(seq, budget, decides)  # (no piece: its slot's chunk)
        if not (admits or prefills or decodes or decides or self.moves):
            return None
        self._steps += 1
        return Step(
            self._steps,
            admits=tuple(admits),
            prefills=tuple(prefills),
            decodes=tuple(decodes),
            decides=tuple(decides),
            **self.moves.take(),
        )

    def _read(
        self, seq: Sequence, budget: int, decides: list[Decide], prefills: list | None = None
    ) -> int:
        """Plan a decision's next work while any `budget` is left, like a prompt chunk, so a
        large read never holds the other streams for long; return the rows planned.

        Questions of at most a chunk go together, as many as fit the budget (at least one).
        A longer question's suffix is written to the slot after the prefix a chunk a step
        (`prefills`: none in the step that completes the prefix, whose chunk is the slot's),
        then its last piece and leaves are read after it. Its pieces are cut from its own
        start, whatever else the steps hold, so its answer has the same bits in any batch."""
        if budget <= 0:
            return 0
        prefix, piece = len(seq.request.prompt_ids), self.prefill_chunk
        todo = seq.request.branches[len(seq.readings) :]
        if len(todo[0].token_ids) > piece:
            suffix = todo[0].token_ids
            tail = (len(suffix) - 1) // piece * piece  # where its last piece starts
            written = len(seq.slot.tokens) - prefix  # its pieces the slot holds
            if written < tail:
                if prefills is None:
                    return 0
                chunk = suffix[written : written + piece]
                prefills.append(Prefill(seq.slot.index, prefix + written, chunk, False, alone=True))
                return len(chunk)
            rest = attrs.evolve(todo[0], token_ids=suffix[tail:])
            decides.append(Decide(seq.slot.index, prefix + tail, (rest,)))
            return len(rest.token_ids) + len(rest.leaves)
        group, rows = [], 0
        for branch in todo:
            n = len(branch.token_ids) + len(branch.leaves)  # its suffix and its leaves
            if group and (rows + n > budget or len(branch.token_ids) > piece):
                break
            group.append(branch)
            rows += n
        decides.append(Decide(seq.slot.index, prefix, tuple(group)))
        return rows

    def needs_latest_state(self) -> bool:
        """Whether the next step carries work that must be planned on the engine's latest
        state: an admission, a prompt chunk, a read or a cache move."""
        if self.moves:
            return True
        return any(s.seq is not None and not s.seq.decoding for s in self.slots)

    def plan_ahead(self, repeat: int = 1) -> Step | None:
        """The decodes of the step after the one in flight, run up to `repeat` times. A row
        whose token is still being sampled feeds it back (PREVIOUS) one position on, unless
        that token ends the answer for sure (max_tokens, context). No run goes past any row's
        limits. The step names the ends of turn (`Step.ends`) unless a row ignores them: a
        row fed one back is left out by the engine. A stop string costs the runs after it,
        wasted rows. A row that follows a grammar runs once where ends of turn do not end
        every row (its matcher would be asked for tokens past the answer's end)."""
        decodes, ignores_ends, follows_grammar = [], False, False
        for slot in self.slots:
            seq = slot.seq
            if seq is None or seq.cancelled or not seq.decoding:
                continue
            ignores_ends |= seq.request.ignore_eos
            follows_grammar |= bool(seq.request.params.grammar)
            n_prompt, known = len(seq.request.prompt_ids), len(seq.output_ids) + seq.pending
            # Runs left before this row's answer ends for sure, each sampling one token.
            left = min(seq.request.max_tokens - known, self.ctx - n_prompt - known)
            if not seq.pending:
                decodes.append(Decode(slot.index, seq.output_ids[-1], n_prompt + known - 1))
                repeat = min(repeat, max(left, 1))
            elif left > 0:
                decodes.append(Decode(slot.index, PREVIOUS, n_prompt + known - 1))
                repeat = min(repeat, left)
        if not decodes:
            return None
        if ignores_ends and follows_grammar:
            repeat = 1
        self._steps += 1
        ends = () if ignores_ends else self._ends
        return Step(self._steps, decodes=tuple(decodes), repeat=repeat, ends=ends)

    def plan_join(self) -> Step | None:
        """New work for waiting requests, to run inside the step queued behind the running
        one (decodes, planned ahead; `Step.joins`). Only slots the queued step leaves alone
        are given, and only small prompts (MAX_JOIN_TOKENS): the rest wait for a step
        planned on the engine's latest state. No decision is read in a join: a join that
        comes once its step has started runs alone, without the decodes, and a read there (a
        whole question, thousands of rows) would hold every stream for a step of its own. In
        the next step the streams' decodes ride beside it."""
        if len(self.in_flight) != 2 or not self.in_flight[-1].ahead:
            return None
        queued = self.in_flight[-1]
        busy = {d.slot for d in queued.step.decodes}
        free = [s for s in self.slots if s.seq is None and s.index not in busy]
        placed = self.admit(free, budget=MAX_JOIN_TOKENS) if free else []
        step = self.plan(only=placed, reads=False) if placed else None
        return attrs.evolve(step, joins=queued.step.index) if step is not None else None

    # --- the steps in flight --------------------------------------------------------------

    def track(self, step: Step, *, ahead: bool = False) -> Sent:
        """Record a step just sent to the engine, with each slot's owner as of now."""
        sent = Sent(step, {s.index: s.seq for s in self.slots if s.seq is not None}, ahead)
        for slot in sent.sampling_slots:
            sent.owners[slot].pending += 1
        if step.repeat > 1:  # each later run samples its decodes' slots again
            for d in step.decodes:
                sent.owners[d.slot].pending += step.repeat - 1
        self.in_flight.append(sent)
        return sent

    def landed(self, result: StepResult) -> Sent:
        """The oldest step in flight, whose result this is (with its join, if it ran inside)."""
        sent = self.in_flight.popleft()
        if result.joined:
            sent = sent.with_join(self.in_flight.popleft())
        return sent

    # --- postprocessing -------------------------------------------------------------------

    def apply(self, sent: Sent, result: StepResult) -> None:
        """A step's result: tokens become events in their requests' outboxes (a repeated
        step's runs in order; a row whose answer ended in one is left out of the runs after
        it, or wastes them where its request ignores ends of turn)."""
        self._apply_run(sent, result)
        for i, later in enumerate(result.more, 1):
            self._apply_run(sent.run(i), later)
        for _ in range(len(result.more) + 1, sent.step.repeat):  # not run: every row had ended
            for d in sent.step.decodes:
                sent.owners[d.slot].pending -= 1

    def _apply_run(self, sent: Sent, result: StepResult) -> None:
        now = time.perf_counter()
        step, tokens = sent.step, result.tokens
        prompt_tokens = generated = 0

        def owner(slot: int) -> Sequence | None:
            """The slot's sequence if it still owns the slot it had when this was planned."""
            seq = sent.owners.get(slot)
            return seq if seq is self.slots[slot].seq and not seq.cancelled else None

        for slot in sent.sampling_slots:
            sent.owners[slot].pending -= 1
        for p in step.prefills:
            seq = owner(p.slot)
            if seq is None:
                continue
            self.slots[p.slot].tokens.extend(p.token_ids)
            if not p.alone:  # (a long question's piece is not its prompt: `_read`)
                seq.prefilled += len(p.token_ids)
            if p.slot in result.prompt_logprobs:
                seq.prompt_logprobs.extend(result.prompt_logprobs[p.slot])
            if p.slot in result.nonfinite:  # (sampling, or a row echo's log-probs read)
                self._overflowed(seq)
            elif p.pool and p.sample:
                prompt_tokens += len(seq.request.prompt_ids)
                seq.t_first = seq.t_last = now
                seq.outbox.append(Embedding(result.embeddings[p.slot]))
                self._finish(seq, "stop", flush=False)
            elif p.sample:
                if seq.request.params.prompt_logprobs:
                    self._emit_prompt_logprobs(seq)
                prompt_tokens += len(seq.request.prompt_ids)
                generated += 1
                self._on_token(seq, tokens[p.slot], now, result.logprobs.get(p.slot))
        for d in step.decides:
            seq = owner(d.slot)
            if seq is None:
                continue
            if d.slot in result.nonfinite:
                self._overflowed(seq)
                continue
            seq.readings.extend(result.decisions[d.slot])
            # The slot holds the state alone again: the next question's pieces overwrite these.
            del self.slots[d.slot].tokens[len(seq.request.prompt_ids) :]
            if len(seq.readings) < len(seq.request.branches):
                continue  # more branches to read, in the next steps
            prompt_tokens += len(seq.request.prompt_ids)
            seq.t_first = seq.t_last = now
            seq.outbox.append(Decision(tuple(seq.readings)))
            self._finish(seq, "stop", flush=False)
        for d in step.decodes:
            seq = owner(d.slot)
            if seq is None:  # ended, or dropped, after this was planned: a wasted row
                continue
            # The token fed at d.position: known now, even where the plan said PREVIOUS.
            self.slots[d.slot].tokens.append(
                seq.output_ids[d.position - len(seq.request.prompt_ids)]
            )
            if d.slot in result.nonfinite:
                self._overflowed(seq)
                continue
            generated += 1
            self._on_token(seq, tokens[d.slot], now, result.logprobs.get(d.slot))
        self.observer.stepped(prompt_tokens, generated, result.forwards, result.elapsed_s)

    @staticmethod
    def _emit_prompt_logprobs(seq: Sequence) -> None:
        """Echo's log-probs of the whole prompt, once it is prefilled (before its answer's
        first text): the first token has none, each other its read's."""
        first = TokenLogprob(seq.request.prompt_ids[0], None)
        entries = (first, *(TokenLogprob(*e) for e in seq.prompt_logprobs))
        seq.outbox.append(PromptLogprobs(entries))
        seq.prompt_logprobs.clear()

    def _on_token(self, seq: Sequence, token: int, now: float, logprob=None) -> None:
        """logprob: (the token's log-prob, the likeliest tokens') where the request asked."""
        if seq.t_first is None:
            seq.t_first = now
        seq.t_last = now
        seq.output_ids.append(token)
        if token in self.tokenizer.eog_ids and not seq.request.ignore_eos:
            return self._finish(seq, "stop")
        text, stopped = seq.stops.feed(seq.detok.feed(token))
        limited = False
        if seq.lines is not None and text:
            text, limited = seq.lines.feed(text, now - seq.t_first)
        seq.unsent_tokens += 1
        if logprob is not None:
            seq.unsent_logprobs.append(TokenLogprob(token, *logprob))
        if text:
            self._emit(seq, text)
        if limited:  # its text ends before any stop string's (llama-server's "limit")
            return self._finish(seq, "length", flush=False)
        if stopped:
            return self._finish(seq, "stop", flush=False)
        n_prompt, n_out = len(seq.request.prompt_ids), len(seq.output_ids)
        if n_out >= seq.request.max_tokens or n_prompt + n_out >= self.ctx:
            self._finish(seq, "length")

    @staticmethod
    def _emit(seq: Sequence, text: str) -> None:
        """Text for the route, with the tokens it is the text of and their log-probs. Text
        the route has not taken yet (a repeated step's runs, a reader behind) grows the last
        event, up to MAX_EVENT_TOKENS, rather than queue another: one write to the client.
        Its `parts` keep where each delta was, for the route's count of reasoning tokens."""
        last = seq.outbox[-1] if seq.outbox else None
        if isinstance(last, TextDelta) and last.tokens < MAX_EVENT_TOKENS:
            seq.outbox[-1] = TextDelta(
                last.text + text,
                last.tokens + seq.unsent_tokens,
                last.logprobs + tuple(seq.unsent_logprobs),
                (*(last.parts or ((len(last.text), last.tokens),)), (len(text), seq.unsent_tokens)),
            )
        else:
            seq.outbox.append(TextDelta(text, seq.unsent_tokens, tuple(seq.unsent_logprobs)))
        seq.emitted, seq.unsent_tokens = True, 0
        seq.unsent_logprobs.clear()

    def _finish(self, seq: Sequence, reason: str, *, flush: bool = True) -> None:
        if flush:
            text, _ = seq.stops.feed(seq.detok.flush())
            text += seq.stops.flush()
            if seq.lines is not None and text:
                text, _ = seq.lines.feed(text, 0.0)
            if text:
                self._emit(seq, text)
        finished = Finished(reason, seq.usage(), seq.timings(), seq.stops.matched)
        seq.finished = finished
        n = len(seq.output_ids)
        self.observer.finished(
            finished,
            queue_s=seq.t_start - seq.t_submit,
            ttft_s=seq.t_first - seq.t_submit,
            e2e_s=time.perf_counter() - seq.t_submit,
            tpot_s=(seq.t_last - seq.t_first) / (n - 1) if n > 1 else None,
        )
        seq.outbox.append(finished)
        seq.done = True
        self.release(seq)
        self.draining.append(seq)

    def _overflowed(self, seq: Sequence) -> None:
        """The request's logits came back NaN or infinite: it ends with a 500 that says so,
        and its slot keeps nothing, so no later prompt reuses the keys and values that
        overflowed (a prompt with the same tokens computes the same overflow itself)."""
        n = len(seq.output_ids)
        log.warning("a request's logits were NaN or infinite at output token %d: ended", n + 1)
        seq.slot.tokens.clear()
        self.fail(seq, Failed(f"{NONFINITE} (at output token {n + 1})", status=500))

    def fail(self, seq: Sequence, failure: Failed) -> None:
        self.release(seq)
        seq.outbox.append(failure)
        seq.done = True
        self.draining.append(seq)

    def fail_all(self, failure: Failed) -> None:
        """Every request running or waiting ends with `failure`."""
        for seq in [*(s.seq for s in self.slots if s.seq), *self.waiting]:
            self.fail(seq, failure)
        self.waiting.clear()

    def release(self, seq: Sequence) -> None:
        if seq.slot is not None:
            seq.slot.seq = None
            seq.slot = None

    # --- engine faults --------------------------------------------------------------------

    def _poison(self) -> Sequence | None:
        """The request to blame for a fault: the only one whose new work (admission, prompt
        chunk or read) was in the lost steps, when others were decoding steadily beside it:
        their decodes in those steps, fine the step before, or their output landed before a
        join that ran after their step (the join alone was lost). Alone in the engine, or
        with other new work, nobody is blamed."""
        new, steady = set(), set()
        for sent in self.in_flight:
            step = sent.step
            for slot in (
                {a.slot for a in step.admits}
                | {p.slot for p in step.prefills}
                | {d.slot for d in step.decides}
            ):
                new.add(sent.owners[slot])
            steady.update(sent.owners[d.slot] for d in step.decodes)
        steady.update(s.seq for s in self.slots if s.seq and s.seq.decoding and s.seq.output_ids)
        return next(iter(new)) if len(new) == 1 and steady - new else None

    def on_fault(self, *, hung: bool, unseen: Callable[[Sequence], bool]) -> None:
        """The engine lost every slot: run each request again once, unless its client has
        text already (a stream that is not `unseen`), it already had its second run, or it
        is the poison (`_poison`): run again, it would fault again and take everyone's slots
        again."""
        again = []
        poison = self._poison()
        self.in_flight.clear()  # the new engine process never runs what the old one was sent
        self.moves.forget_all()
        for slot in self.slots:
            seq = slot.seq
            if seq is None:
                continue
            self.release(seq)
            # A hung engine is a 504 (seed 004's backend_timeout), a crashed one a 500.
            status = 504 if hung else 500
            if seq is poison:
                log.warning("a request's new work faulted the engine: it is not run again")
                message = "the request faulted the engine and is not run again"
                self.fail(seq, Failed(message, status=status))
                continue
            if seq.retried or (seq.request.stream and not unseen(seq)):
                what = "timed out on the device" if hung else "failed on the device"
                self.fail(seq, Failed(f"the request {what}", status=status))
                continue
            seq.run_again(self.tokenizer)
            again.append(seq)
        again.sort(key=lambda s: s.t_submit)
        self.waiting.extendleft(reversed(again))
