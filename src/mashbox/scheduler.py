"""The scheduler: the one task that admits requests into slots, steps the engine and feeds
each request's bounded channel. It never imports torch.
"""

from __future__ import annotations

import collections
import logging
import math
import time

import attrs
import trio

from .events import (
    MAX_WAITING,
    MAX_WAITING_PER_TENANT,
    Admitted,
    Decision,
    Embedding,
    Failed,
    Finished,
    NotReady,
    QueueFull,
    Request,
    Restarted,
    TextDelta,
    Timings,
    Usage,
)
from .prompt_cache import PromptCache, common_prefix
from .protocol import (
    PREVIOUS,
    Admit,
    Decide,
    Decode,
    Prefill,
    Restore,
    Save,
    Share,
    Step,
    StepResult,
)
from .text.stops import StopMatcher
from .text.tokenizer import Detokenizer, Tokenizer
from .worker_client import StepTimeout, WorkerError

log = logging.getLogger("mashbox")

CHANNEL_SIZE = 64
# Prompt tokens a join may carry (`Scheduler._join`): it is written to the engine's pipe while
# a step runs, so it must fit the pipe's buffer (64 KiB) or the event loop would wait.
MAX_JOIN_TOKENS = 4096


@attrs.define(eq=False)
class Sequence:
    """A request owned by the scheduler; its handler holds only the receive channel."""

    request: Request
    channel: trio.MemorySendChannel
    detok: Detokenizer
    stops: StopMatcher
    t_submit: float
    slot: Slot | None = None
    admitted: bool = False  # the worker has its sampling state
    prefilled: int = 0  # prompt tokens whose KV the slot holds
    cached: int = 0
    output_ids: list[int] = attrs.Factory(list)
    outbox: collections.deque = attrs.Factory(collections.deque)
    blocked_since: float | None = None
    cancelled: bool = False
    done: bool = False
    emitted: bool = False  # text has gone to the handler
    unsent_tokens: int = 0  # generated tokens whose text is still held back
    reasoning_tokens: int = 0  # generated tokens of reasoning, as the route's parser read them
    # Output has gone to the client (set by the route as it writes it): what ends a stream's
    # one retry. Text the route's parser still holds back (a tool call's start) is not.
    delivered: bool = False
    called_tools: bool = False  # the route's parser read tool calls in the answer
    finished: Finished | None = None  # how the answer ended, once it has
    counted: bool = False  # its success is counted (when the route let go of it)
    retried: bool = False  # the one run-again after an engine fault is spent
    # A typed decision's reads so far: one tuple per branch, read a budget of rows a step.
    readings: list = attrs.Factory(list)
    pending: int = 0  # steps sent that sample this sequence's next token, results not yet in
    t_start: float | None = None
    t_first: float | None = None
    t_last: float | None = None

    @property
    def decoding(self) -> bool:
        r = self.request
        return self.prefilled == len(r.prompt_ids) and not (r.embed or r.branches)


@attrs.define(eq=False)
class Slot:
    """One KV slot; `tokens` is exactly what its cache holds, kept after a request ends, for
    the tenant whose prompt they are (and only for them)."""

    index: int
    tokens: list[int] = attrs.Factory(list)
    tenant: str = ""
    seq: Sequence | None = None
    last_used: int = 0


@attrs.frozen
class Sent:
    """A step sent to the engine, and which sequence owned each slot when it was planned
    (by the time its result is in, a slot may have a new owner)."""

    step: Step
    owners: dict[int, Sequence]
    ahead: bool = False  # decodes planned while the step before ran: others may join it

    def with_join(self, join: Sent) -> Sent:
        """This step and its join, as the engine ran them: one step (`Step.joins`)."""
        return Sent(self.step.with_join(join.step), {**self.owners, **join.owners})


@attrs.frozen
class Stats:
    """A snapshot for /health and metrics."""

    running: int
    waiting: int
    kv_cache_usage: float = 0.0  # fraction of slots x ctx holding tokens of running requests


class Observer:
    """What the scheduler reports as requests move (for metrics); this one ignores it all.

    Calls are plain numbers and values, made on the scheduler's task: an observer must not
    block. The scheduler knows nothing of how they are counted (no prometheus here).
    """

    def admitted(self, prompt_tokens: int, cached_tokens: int) -> None:
        """A request got a slot: a prefix cache lookup of `prompt_tokens`, `cached_tokens` hit."""

    def stepped(
        self, prompt_tokens: int, generated_tokens: int, forwards: int = 0, engine_s: float = 0.0
    ) -> None:
        """One engine step: prompts fully prefilled in it (whole prompt lengths, cached part
        included), tokens it generated for requests still running, the model forward
        passes it ran and the seconds the engine spent on it."""

    def finished(
        self, done: Finished, *, queue_s: float, ttft_s: float, e2e_s: float, tpot_s: float | None
    ) -> None:
        """A request's answer ended (`done.reason` stop or length). Times are from
        submission; `tpot_s` is the mean gap after the first token (None for one)."""

    def succeeded(self, reason: str) -> None:
        """A finished request's route is done with it: stop, length, or tool_calls (which
        only the route's parser can tell, so this comes when the route lets go)."""


class Scheduler:
    """Queue, slots and the step loop."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        worker,
        *,
        slots: int,
        ctx: int,
        prefill_chunk: int = 256,
        stall_timeout: float = 30.0,
        observer: Observer | None = None,
        prompt_cache: PromptCache | None = None,
        tenant_slots: int = 0,
    ):
        """tenant_slots: slots one tenant's requests may hold at once (0: any number)."""
        self.tokenizer = tokenizer
        self.tenant_slots = tenant_slots or slots
        self.observer = observer or Observer()
        self.prompt_cache = prompt_cache or PromptCache(0, 0)
        self._saves: list[Save] = []  # prompt-cache moves for the next step
        self._restores: list[Restore] = []
        self._shares: list[Share] = []  # prefixes copied from slots in use
        self._drops: list[int] = []
        self.ctx = ctx
        self.prefill_chunk = prefill_chunk
        self.stall_timeout = stall_timeout
        self.slots = [Slot(i) for i in range(slots)]
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.draining: list[Sequence] = []  # finished, events not yet taken by the handler
        # A started Supervisor: `ready`, `send(step)`, `await receive()`, `await restart()`.
        self.worker = worker
        self._wakeup = trio.Event()
        self._sent: collections.deque[Sent] = collections.deque()  # oldest first, at most 2
        self._uses = 0
        self._steps = 0
        self._closing = False
        self._step_scope: trio.CancelScope | None = None
        self._receiving = False  # the loop awaits a step's result

    # --- called by request handlers -------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.worker.ready and not self._closing

    def stats(self) -> Stats:
        running = [s for s in self.slots if s.seq is not None]
        used = sum(len(s.tokens) for s in running)
        return Stats(
            running=len(running),
            waiting=len(self.waiting),
            kv_cache_usage=used / (len(self.slots) * self.ctx) if self.slots and self.ctx else 0.0,
        )

    def submit(self, request: Request) -> tuple[Sequence, trio.MemoryReceiveChannel]:
        """Queue a request; raise NotReady or QueueFull instead of queueing."""
        if not self.ready:
            raise NotReady("the model is loading")
        if len(self.waiting) >= MAX_WAITING:
            raise QueueFull(f"the server's queue is full ({MAX_WAITING} waiting)", whole_queue=True)
        mine = sum(1 for s in self.waiting if s.request.tenant == request.tenant)
        if mine >= MAX_WAITING_PER_TENANT:
            raise QueueFull(
                f"too many requests waiting ({MAX_WAITING_PER_TENANT} per tenant)",
                whole_queue=False,
            )
        send, receive = trio.open_memory_channel(CHANNEL_SIZE)
        seq = Sequence(
            request=request,
            channel=send,
            detok=Detokenizer(self.tokenizer),
            stops=StopMatcher(list(request.stop)),
            t_submit=time.perf_counter(),
        )
        self.waiting.append(seq)
        self._wakeup.set()
        if self._receiving:
            self._join()
        return seq, receive

    def cancel(self, seq: Sequence) -> None:
        """Forget a request now (its handler is gone); its slot frees before the next step.
        A request that finished is counted as a success now, with the route's reading of
        its answer (`called_tools`)."""
        if seq.finished is not None and not seq.counted:
            seq.counted = True
            self.observer.succeeded("tool_calls" if seq.called_tools else seq.finished.reason)
        if not seq.cancelled:
            seq.cancelled = True
            self._wakeup.set()

    # --- the loop -------------------------------------------------------------------------

    async def run(self) -> None:
        """Step the engine until `close`.

        While the engine runs one step the next is already in its pipe (decodes only,
        planned before the running step's tokens are known: each row feeds back the token
        the engine sampled for it), so the engine never waits for the server between
        steps. Anything else (admissions, prompt chunks, reads, cache moves) waits until
        no step is in flight and goes in a step planned on the engine's latest state."""
        while not self._closing:
            self._deliver()
            self._reap()
            self._admit()
            try:
                if not self._sent and not self._send(self._plan()):
                    await self._idle()
                    continue
                if len(self._sent) == 1 and not self._needs_latest_state():
                    self._send(self._plan_ahead(), ahead=True)
                with trio.CancelScope() as self._step_scope:
                    self._receiving = True
                    try:
                        result = await self.worker.receive()
                    finally:
                        self._receiving = False
                if self._step_scope.cancelled_caught:
                    break
            except WorkerError as exc:
                log.error("engine fault: %s", str(exc).strip().splitlines()[-1])
                self._on_fault(hung=isinstance(exc, StepTimeout))
                await self.worker.restart()
                continue
            sent = self._sent.popleft()
            if result.joined:
                sent = sent.with_join(self._sent.popleft())
            self._apply(sent, result)
        self._fail_everyone(Failed("the server is shutting down", status=503))

    def _send(self, step: Step | None, *, ahead: bool = False) -> bool:
        if step is None:
            return False
        owners = {s.index: s.seq for s in self.slots if s.seq is not None}
        for slot in [d.slot for d in step.decodes] + [p.slot for p in step.prefills if p.sample]:
            owners[slot].pending += 1
        self.worker.send(step)
        self._sent.append(Sent(step, owners, ahead))
        return True

    def _join(self) -> None:
        """Start waiting requests at the next step boundary although the next step (decodes,
        planned ahead) is already in the engine's pipe: their new work goes in a join the
        engine runs inside that step if it has not started yet, else right after it. Only
        slots the queued step leaves alone are given, and only small prompts (MAX_JOIN_TOKENS):
        the rest wait for a step planned on the engine's latest state, as before."""
        if len(self._sent) != 2 or not self._sent[-1].ahead or self._closing:
            return
        queued = self._sent[-1]
        busy = {d.slot for d in queued.step.decodes}
        free = [s for s in self.slots if s.seq is None and s.index not in busy]
        placed = self._admit(free, budget=MAX_JOIN_TOKENS) if free else []
        step = self._plan(only=placed) if placed else None
        if step is not None:
            self._send(attrs.evolve(step, joins=queued.step.index))
            self._deliver()  # their Admitted events

    def close(self) -> None:
        """Stop stepping; every request still running or waiting ends with a 503 error."""
        self._closing = True
        self._wakeup.set()
        if self._step_scope is not None:
            self._step_scope.cancel()

    def _fail_everyone(self, failure: Failed) -> None:
        for seq in [*(s.seq for s in self.slots if s.seq), *self.waiting]:
            self._fail(seq, failure)
        self.waiting.clear()
        self._deliver()

    def _fail(self, seq: Sequence, failure: Failed) -> None:
        self._release(seq)
        seq.outbox.append(failure)
        seq.done = True
        self.draining.append(seq)

    def _poison(self) -> Sequence | None:
        """The request to blame for a fault: the only one whose new work (admission, prompt
        chunk or read) was in the lost steps, when others' decodes, fine the step before,
        were there too. Alone in its steps, or with other new work, nobody is blamed."""
        new, steady = set(), set()
        for sent in self._sent:
            step = sent.step
            for slot in (
                {a.slot for a in step.admits}
                | {p.slot for p in step.prefills}
                | {d.slot for d in step.decides}
            ):
                new.add(sent.owners[slot])
            steady.update(sent.owners[d.slot] for d in step.decodes)
        return next(iter(new)) if len(new) == 1 and steady - new else None

    @staticmethod
    def _unseen(seq: Sequence) -> bool:
        """Whether a stream's client has received none of its output yet: nothing written,
        and nothing waiting in the channel that the route would write before it reads the
        restart (queued text could reach the client, then the retry repeat it)."""
        return not seq.delivered and seq.channel.statistics().current_buffer_used == 0

    def _on_fault(self, hung: bool = False) -> None:
        """The engine lost every slot: run each request again once, unless its client has
        text already (streams), it already had its second run, or it is the poison
        (`_poison`): run again, it would fault again and take everyone's slots again."""
        again = []
        poison = self._poison()
        self._sent.clear()  # the new engine process never runs what the old one was sent
        self.prompt_cache.clear()  # the host copies lived in the engine process too
        self._saves, self._restores, self._shares, self._drops = [], [], [], []
        for slot in self.slots:
            slot.tokens.clear()  # a new engine process starts with empty caches
            seq = slot.seq
            if seq is None:
                continue
            self._release(seq)
            # A hung engine is a 504 (seed 004's backend_timeout), a crashed one a 500.
            status = 504 if hung else 500
            if seq is poison:
                log.warning("a request's new work faulted the engine: it is not run again")
                message = "the request faulted the engine and is not run again"
                self._fail(seq, Failed(message, status=status))
                continue
            if seq.retried or (seq.request.stream and not self._unseen(seq)):
                what = "timed out on the device" if hung else "failed on the device"
                self._fail(seq, Failed(f"the request {what}", status=status))
                continue
            seq.retried, seq.admitted, seq.prefilled, seq.cached = True, False, 0, 0
            seq.pending = 0
            seq.output_ids.clear()
            seq.readings.clear()
            seq.unsent_tokens = 0  # (the route resets its own counts on Restarted)
            seq.outbox.clear()
            seq.detok = Detokenizer(self.tokenizer)
            seq.stops = StopMatcher(list(seq.request.stop))
            seq.t_first = seq.t_last = None
            if seq.emitted:  # the handler drops what it collected or its parser holds
                seq.outbox.append(Restarted())
                seq.emitted = False
            again.append(seq)
        again.sort(key=lambda s: s.t_submit)
        self.waiting.extendleft(reversed(again))

    async def _idle(self) -> None:
        blocked = any(s.outbox for s in self._live())
        self._wakeup = trio.Event()
        # A reader that drains its channel does not signal us: poll while anyone is blocked.
        with trio.move_on_after(0.02 if blocked else math.inf):
            await self._wakeup.wait()

    def _live(self):
        yield from (s.seq for s in self.slots if s.seq is not None)
        yield from self.draining

    def _deliver(self) -> None:
        """Move each sequence's pending events into its channel without ever waiting."""
        now = time.perf_counter()
        for seq in list(self._live()):
            while seq.outbox:
                try:
                    seq.channel.send_nowait(seq.outbox[0])
                except trio.WouldBlock:
                    if seq.blocked_since is None:
                        seq.blocked_since = now
                    break
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    seq.cancelled = True
                    break
                seq.outbox.popleft()
                seq.blocked_since = None  # a reader that takes anything is not stalled
            else:
                if seq.done:
                    seq.channel.close()
                    self.draining.remove(seq)

    def _reap(self) -> None:
        """Drop cancelled requests and readers stalled past the deadline."""
        now = time.perf_counter()
        for seq in list(self._live()):
            stalled = seq.blocked_since is not None and now - seq.blocked_since > self.stall_timeout
            if stalled and not seq.cancelled:
                log.info("dropped a stream whose client read nothing for %g s", self.stall_timeout)
            if seq.cancelled or stalled:
                self._drop(seq)
        if any(s.cancelled for s in self.waiting):
            for seq in [s for s in self.waiting if s.cancelled]:
                self.waiting.remove(seq)
                seq.channel.close()

    def _drop(self, seq: Sequence) -> None:
        seq.cancelled = True
        self._release(seq)
        if seq in self.draining:
            self.draining.remove(seq)
        seq.channel.close()

    def _release(self, seq: Sequence) -> None:
        if seq.slot is not None:
            seq.slot.seq = None
            seq.slot = None

    def _admit(self, free: list[Slot] | None = None, budget: float = math.inf) -> list[Sequence]:
        """Give free slots to waiting requests, fairly across tenants (`_pick`), each to a
        free slot sharing the longest prefix with its prompt (among equals the least recently
        used). The longest matches are placed first: in a burst, a request whose own prompt a
        slot still holds gets that slot, not a request that came before it and would share
        less. Return the requests placed (their prompts at most `budget` tokens in all)."""
        if free is None:
            free = [s for s in self.slots if s.seq is None]
        batch = self._pick(len(free), budget)

        def match(seq: Sequence, slot: Slot) -> int:
            if seq.request.embed or slot.tenant != seq.request.tenant:
                return 0
            return common_prefix(slot.tokens, seq.request.prompt_ids)

        pairs = sorted(
            ((match(q, s), -s.last_used, -i, i, s) for i, q in enumerate(batch) for s in free),
            key=lambda pair: pair[:3],
            reverse=True,
        )
        chosen: dict[int, tuple[Slot, int]] = {}
        taken: set[int] = set()
        for shared, _, _, i, slot in pairs:
            if i not in chosen and slot.index not in taken:
                chosen[i] = slot, shared
                taken.add(slot.index)
        for i, seq in enumerate(batch):  # in arrival order: an earlier one can be a source
            self._place(seq, *chosen[i])
        return batch

    def _pick(self, n: int, budget: float = math.inf) -> list[Sequence]:
        """Up to n waiting requests, round-robin across tenants: each goes to the tenant
        holding the fewest slots (counting those just picked), the oldest request first among
        equals; a tenant at `tenant_slots` waits. So one tenant's requests, however many or
        slow, never keep another's from the next free slot. Their prompts: at most `budget`
        tokens in all (the next pick past it stays waiting)."""
        holding = collections.Counter(s.seq.request.tenant for s in self.slots if s.seq)
        picked: list[Sequence] = []
        while len(picked) < n:
            best = None
            for seq in self.waiting:  # oldest first
                tenant = seq.request.tenant
                if holding[tenant] >= self.tenant_slots:
                    continue
                if best is None or holding[tenant] < holding[best.request.tenant]:
                    best = seq
            if best is None or len(best.request.prompt_ids) > budget:
                break
            budget -= len(best.request.prompt_ids)
            self.waiting.remove(best)
            holding[best.request.tenant] += 1
            picked.append(best)
        picked.sort(key=lambda s: s.t_submit)
        return picked

    def _place(self, seq: Sequence, slot: Slot, shared: int) -> None:
        """Admit seq to slot, which holds `shared` tokens of its prompt (`_admit`'s match)."""
        prompt = seq.request.prompt_ids
        # Generation runs at least its last prompt token (its logits give the first new
        # token); a decision reads after the prefix and can take all of it from a cache.
        reusable = len(prompt) - (0 if seq.request.branches else 1)
        if not seq.request.embed:  # pooling needs every position's hidden state: no reuse
            shared = self._bring_prefix(slot, seq.request.tenant, prompt, shared, reusable)
        seq.cached = min(shared, reusable)
        del slot.tokens[seq.cached :]
        slot.tenant = seq.request.tenant
        seq.prefilled = seq.cached
        seq.outbox.append(Admitted(seq.cached))
        self.observer.admitted(len(prompt), seq.cached)
        self._uses += 1
        slot.seq, slot.last_used, seq.slot = seq, self._uses, slot
        seq.t_start = time.perf_counter()

    def _bring_prefix(self, slot: Slot, tenant: str, prompt, shared: int, reusable: int) -> int:
        """Save what the slot holds before it is overwritten, then bring in the longest
        prefix of the prompt the tenant holds elsewhere, if it beats the slot's own: a slot
        in use (a copy on the device) or the host prompt cache. Return the shared length."""
        cache = self.prompt_cache
        if (
            cache.enabled
            and shared < len(slot.tokens)
            and cache.worth_saving(slot.tokens, slot.tenant)
        ):
            entry, evicted = cache.add(slot.tokens, slot.tenant)
            self._saves.append(Save(slot.index, entry.id, len(slot.tokens)))
            self._drops.extend(e.id for e in evicted)
        # A source must hold its prefix when the step starts: shares run before restores,
        # so a slot still waiting for its own share or restore is no source.
        arriving = {m.slot for m in self._shares} | {m.slot for m in self._restores}
        live = [
            s
            for s in self.slots
            if s.seq is not None
            and s is not slot
            and s.tenant == tenant
            and s.index not in arriving
        ]
        from_live, source = max(
            ((common_prefix(s.tokens, prompt), s) for s in live),
            key=lambda pair: pair[0],
            default=(0, None),
        )
        from_live = min(from_live, reusable)
        entry, from_cache = cache.best(prompt, tenant) if cache.enabled else (None, 0)
        from_cache = min(from_cache, reusable)
        if max(from_live, from_cache) <= shared:
            return shared
        if from_live >= from_cache:
            self._shares.append(Share(source.index, slot.index, from_live))
            slot.tokens[:] = source.tokens[:from_live]
            return from_live
        cache.touch(entry)
        self._restores.append(Restore(slot.index, entry.id, from_cache))
        slot.tokens[:] = entry.tokens[:from_cache]
        return from_cache

    def cache_stats(self) -> tuple[int, int, int]:
        """Host prompt cache: bytes held, cap, evictions."""
        c = self.prompt_cache
        return c.nbytes, c.cap_bytes, c.evictions

    def _plan(self, only: list[Sequence] | None = None) -> Step | None:
        """The next step on the engine's latest state; `only`: just these requests' work."""
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
                budget -= self._read(seq, budget, decides)
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
                if last and branches:  # read right after the chunk that completes the prefix
                    budget -= self._read(seq, budget, decides)
        moves = {
            "saves": tuple(self._saves),
            "restores": tuple(self._restores),
            "shares": tuple(self._shares),
            "drops": tuple(self._drops),
        }
        if not (admits or prefills or decodes or decides or any(moves.values())):
            return None
        self._saves, self._restores, self._shares, self._drops = [], [], [], []
        self._steps += 1
        return Step(
            self._steps,
            admits=tuple(admits),
            prefills=tuple(prefills),
            decodes=tuple(decodes),
            decides=tuple(decides),
            **moves,
        )

    @staticmethod
    def _read(seq: Sequence, budget: int, decides: list[Decide]) -> int:
        """Plan the next of a decision's branches that fit `budget` rows (at least one, however
        many rows it has, while any budget is left), like a prompt chunk: a large read never
        holds the other streams for long. Return the rows planned."""
        if budget <= 0:
            return 0
        group, rows = [], 0
        for branch in seq.request.branches[len(seq.readings) :]:
            n = len(branch.token_ids) + len(branch.leaves)  # its suffix and its leaves
            if group and rows + n > budget:
                break
            group.append(branch)
            rows += n
        decides.append(Decide(seq.slot.index, len(seq.request.prompt_ids), tuple(group)))
        return rows

    def _needs_latest_state(self) -> bool:
        """Whether the next step carries work that must be planned on the engine's latest
        state: an admission, a prompt chunk, a read or a cache move."""
        if self._saves or self._restores or self._shares or self._drops:
            return True
        return any(s.seq is not None and not s.seq.decoding for s in self.slots)

    def _plan_ahead(self) -> Step | None:
        """The decodes of the step after the one in flight. A row whose token is still being
        sampled feeds it back (PREVIOUS) one position on, unless that token ends the answer
        for sure (max_tokens, context); an end of turn or a stop string costs one wasted row."""
        decodes = []
        for slot in self.slots:
            seq = slot.seq
            if seq is None or seq.cancelled or not seq.decoding:
                continue
            n_prompt, n_out = len(seq.request.prompt_ids), len(seq.output_ids)
            if not seq.pending:
                decodes.append(Decode(slot.index, seq.output_ids[-1], n_prompt + n_out - 1))
            elif n_out + 1 < seq.request.max_tokens and n_prompt + n_out + 1 < self.ctx:
                decodes.append(Decode(slot.index, PREVIOUS, n_prompt + n_out))
        if not decodes:
            return None
        self._steps += 1
        return Step(self._steps, decodes=tuple(decodes))

    def _apply(self, sent: Sent, result: StepResult) -> None:
        now = time.perf_counter()
        step, tokens = sent.step, result.tokens
        prompt_tokens = generated = 0

        def owner(slot: int) -> Sequence | None:
            """The slot's sequence if it still owns the slot it had when this was planned."""
            seq = sent.owners.get(slot)
            return seq if seq is self.slots[slot].seq and not seq.cancelled else None

        for slot in [d.slot for d in step.decodes] + [p.slot for p in step.prefills if p.sample]:
            sent.owners[slot].pending -= 1
        for p in step.prefills:
            seq = owner(p.slot)
            if seq is None:
                continue
            self.slots[p.slot].tokens.extend(p.token_ids)
            seq.prefilled += len(p.token_ids)
            if p.pool and p.sample:
                prompt_tokens += len(seq.request.prompt_ids)
                seq.t_first = seq.t_last = now
                seq.outbox.append(Embedding(result.embeddings[p.slot]))
                self._finish(seq, "stop", flush=False)
            elif p.sample:
                prompt_tokens += len(seq.request.prompt_ids)
                generated += 1
                self._on_token(seq, tokens[p.slot], now)
        for d in step.decides:
            seq = owner(d.slot)
            if seq is None:
                continue
            seq.readings.extend(result.decisions[d.slot])
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
            generated += 1
            self._on_token(seq, tokens[d.slot], now)
        self.observer.stepped(prompt_tokens, generated, result.forwards, result.elapsed_s)

    def _on_token(self, seq: Sequence, token: int, now: float) -> None:
        if seq.t_first is None:
            seq.t_first = now
        seq.t_last = now
        seq.output_ids.append(token)
        if token in self.tokenizer.eog_ids and not seq.request.ignore_eos:
            return self._finish(seq, "stop")
        text, stopped = seq.stops.feed(seq.detok.feed(token))
        seq.unsent_tokens += 1
        if text:
            seq.outbox.append(TextDelta(text, seq.unsent_tokens))
            seq.emitted, seq.unsent_tokens = True, 0
        if stopped:
            return self._finish(seq, "stop", flush=False)
        n_prompt, n_out = len(seq.request.prompt_ids), len(seq.output_ids)
        if n_out >= seq.request.max_tokens or n_prompt + n_out >= self.ctx:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str, *, flush: bool = True) -> None:
        if flush:
            text, _ = seq.stops.feed(seq.detok.flush())
            text += seq.stops.flush()
            if text:
                seq.outbox.append(TextDelta(text, seq.unsent_tokens))
                seq.emitted, seq.unsent_tokens = True, 0
        finished = Finished(reason, self._usage(seq), self._timings(seq), seq.stops.matched)
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
        self._release(seq)
        self.draining.append(seq)

    def _usage(self, seq: Sequence) -> Usage:
        return Usage(len(seq.request.prompt_ids), len(seq.output_ids), seq.cached)

    def _timings(self, seq: Sequence) -> Timings:
        prompt_n = len(seq.request.prompt_ids) - seq.cached
        prompt_ms = (seq.t_first - seq.t_start) * 1000
        predicted_ms = (seq.t_last - seq.t_first) * 1000
        n = len(seq.output_ids)
        return Timings(
            prompt_n=prompt_n,
            prompt_ms=round(prompt_ms, 3),
            prompt_per_second=round(prompt_n / prompt_ms * 1000, 2) if prompt_ms > 0 else None,
            predicted_n=n,
            predicted_ms=round(predicted_ms, 3),
            predicted_per_second=(
                round((n - 1) / predicted_ms * 1000, 2) if n > 1 and predicted_ms > 0 else None
            ),
            cache_n=seq.cached,
            queue_ms=round((seq.t_start - seq.t_submit) * 1000, 3),
        )
