"""The scheduler: the one task that admits requests into slots, steps the engine and feeds
each request's bounded channel. What goes in each step and what each result means is the
batch core's (`batch.Batch`); this is the trio side: submit and cancel, the step loop over
the engine link, and the channels. It never imports torch.
"""

from __future__ import annotations

import collections
import logging
import math
import time

import trio

from .batch import Batch
from .events import MAX_WAITING, MAX_WAITING_PER_TENANT, Failed, NotReady, QueueFull, Request
from .observer import Observer, Stats
from .prompt_cache import PromptCache
from .protocol import Step
from .sequence import Sequence, Slot
from .text.tokenizer import Tokenizer
from .worker_client import EngineLink, StepTimeout, WorkerError

log = logging.getLogger("mashbox")

CHANNEL_SIZE = 64

# The most runs one repeated decode step holds (`Step.repeat`, `Scheduler.decode_burst`).
MAX_REPEAT = 8


class RequestEvents(trio.abc.ReceiveChannel):
    """One request's events, as its route reads them. Closing it (`async with`) cancels the
    request: its slot frees before the next step. Through it the route says what became of
    the answer, which the scheduler's one retry and its metrics need; the route never holds
    the request itself (`sequence` is there for tests)."""

    def __init__(self, receive: trio.MemoryReceiveChannel, seq: Sequence, scheduler: Scheduler):
        self._receive, self.sequence, self._scheduler = receive, seq, scheduler

    async def receive(self):
        return await self._receive.receive()

    async def aclose(self) -> None:
        self._scheduler._cancel(self.sequence)
        await self._receive.aclose()

    def mark_delivered(self) -> None:
        """Output has gone to the client: after an engine fault the request now fails
        rather than runs again (it would repeat what the client has)."""
        self.sequence.delivered = True

    def mark_called_tools(self) -> None:
        """The answer called tools: its success is counted as finished_reason=tool_calls."""
        self.sequence.called_tools = True


class ChoiceEvents(trio.abc.ReceiveChannel):
    """The events of a request's n choices, in one channel as they come: (choice index,
    event). Closing it cancels every choice; the route marks each choice's answer as
    `RequestEvents` does one request's."""

    def __init__(self, receive: trio.MemoryReceiveChannel, seqs: list[Sequence], scheduler):
        self._receive, self.sequences, self._scheduler = receive, seqs, scheduler

    async def receive(self):
        return await self._receive.receive()

    async def aclose(self) -> None:
        for seq in self.sequences:
            self._scheduler._cancel(seq)
        await self._receive.aclose()

    def mark_delivered(self, index: int) -> None:
        self.sequences[index].delivered = True

    def mark_called_tools(self, index: int) -> None:
        self.sequences[index].called_tools = True


class Scheduler:
    """The step loop and the requests' channels, around the batch core's queue and slots."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        worker: EngineLink,
        *,
        slots: int,
        ctx: int,
        prefill_chunk: int = 256,
        stall_timeout: float = 30.0,
        observer: Observer | None = None,
        prompt_cache: PromptCache | None = None,
        tenant_slots: int = 0,
        decode_burst: float = 0.0,
    ):
        """tenant_slots: slots one tenant's requests may hold at once (0: any number).
        decode_burst: seconds of decode steps the engine may run back to back, without the
        server between them (`_repeat`); 0: one step at a time."""
        self.tokenizer = tokenizer
        self.batch = Batch(
            tokenizer,
            slots=slots,
            ctx=ctx,
            prefill_chunk=prefill_chunk,
            observer=observer,
            prompt_cache=prompt_cache,
            tenant_slots=tenant_slots,
        )
        self.stall_timeout = stall_timeout
        self.decode_burst = decode_burst
        self._run_s = math.inf  # how long the engine's latest step ran
        self.worker = worker  # started: a Supervisor, or the tests' engine in process
        self._wakeup = trio.Event()
        self._closing = False
        self._step_scope: trio.CancelScope | None = None
        self._receiving = False  # the loop awaits a step's result

    # The batch core's state, as the server and the tests read it.

    @property
    def slots(self) -> list[Slot]:
        return self.batch.slots

    @property
    def waiting(self) -> collections.deque[Sequence]:
        return self.batch.waiting

    @property
    def draining(self) -> list[Sequence]:
        return self.batch.draining

    @property
    def observer(self) -> Observer:
        return self.batch.observer

    @property
    def prompt_cache(self) -> PromptCache:
        return self.batch.prompt_cache

    @property
    def tenant_slots(self) -> int:
        return self.batch.tenant_slots

    # --- called by request handlers -------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.worker.ready and not self._closing

    def statistics(self) -> Stats:
        """The queue, the slots and the prompt cache, now (a frozen snapshot)."""
        return self.batch.statistics()

    def submit(self, request: Request) -> RequestEvents:
        """Queue a request and return its events; raise NotReady or QueueFull instead."""
        self._check_room(request.tenant, 1)
        send, receive = trio.open_memory_channel(CHANNEL_SIZE)
        seq = Sequence.new(request, self.tokenizer, send)
        self._queue([seq])
        return RequestEvents(receive, seq, self)

    def submit_choices(self, requests: list[Request]) -> ChoiceEvents:
        """Queue a request's choices (n of one prompt, each its own seed; or of each of
        completions' prompts), all or none: they count one place each against the queue's
        limits. The first choice of a prompt prefills it; the others of the same prompt wait
        for it, then copy its KV (`Sequence.leader`)."""
        self._check_room(requests[0].tenant, len(requests))
        send, receive = trio.open_memory_channel(CHANNEL_SIZE * len(requests))
        seqs: list[Sequence] = []
        leaders: dict[tuple[int, ...], Sequence] = {}
        for index, request in enumerate(requests):
            seq = Sequence.new(request, self.tokenizer, send.clone())  # each closes its own
            seq.choice = index
            lead = leaders.setdefault(request.prompt_ids, seq)
            if lead is not seq and not request.reads_every_position:  # (that one copies none)
                seq.leader = lead
            seqs.append(seq)
        send.close()
        self._queue(seqs)
        return ChoiceEvents(receive, seqs, self)

    def _check_room(self, tenant: str, n: int) -> None:
        """NotReady, or QueueFull unless n more of the tenant's requests may wait."""
        if not self.ready:
            raise NotReady("the model is loading")
        if len(self.waiting) + n > MAX_WAITING:
            raise QueueFull(f"the server's queue is full ({MAX_WAITING} waiting)", whole_queue=True)
        mine = sum(1 for s in self.waiting if s.request.tenant == tenant)
        if mine + n > MAX_WAITING_PER_TENANT:
            raise QueueFull(
                f"too many requests waiting ({MAX_WAITING_PER_TENANT} per tenant)",
                whole_queue=False,
            )

    def _queue(self, seqs: list[Sequence]) -> None:
        self.waiting.extend(seqs)
        self._wakeup.set()
        if self._receiving:
            self._join()

    def _cancel(self, seq: Sequence) -> None:
        """Forget a request now (its route closed its events); its slot frees before the next
        step. A request that finished is counted as a success now, with the route's reading
        of its answer (`called_tools`)."""
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
        batch = self.batch
        while not self._closing:
            self._deliver()
            self._reap()
            self._admit()
            try:
                if not batch.in_flight and not self._send(batch.plan()):
                    await self._idle()
                    continue
                if len(batch.in_flight) == 1 and not batch.needs_latest_state():
                    self._send(batch.plan_ahead(self._repeat()), ahead=True)
                with trio.CancelScope() as self._step_scope:
                    self._receiving = True
                    try:
                        result = await self.worker.receive()
                    finally:
                        self._receiving = False
                if self._step_scope.cancelled_caught:
                    break
            except WorkerError as exc:
                lines = str(exc).strip().splitlines()
                # The worker's traceback after the summary: a fault is rare and costs a retry.
                log.error("engine fault: %s", lines[-1] + "".join(f"\n  | {t}" for t in lines))
                batch.on_fault(hung=isinstance(exc, StepTimeout), unseen=self._unseen)
                await self.worker.restart()
                continue
            if result.disk_failed:  # not restored from again; a repeat writes them anew
                self.prompt_cache.forget_disk(result.disk_failed)
            last_run = (result.more or (result,))[-1]
            if last_run.forwards:  # not a step whose every row had ended: it ran nothing
                self._run_s = last_run.elapsed_s
            batch.apply(batch.landed(result), result)
        self._fail_everyone(Failed("the server is shutting down", status=503))

    def _repeat(self) -> int:
        """How many runs the next decode step holds: as many as fit `decode_burst` at the
        latest step's pace, so the server wakes once for that many tokens a stream and its
        CPU time (the engine's cores, on a CPU) goes to decoding. Tokens then reach their
        clients in bursts at most that long. One run while a request waits for a slot (a
        freed slot is seen only after the whole step); the rows' own limits are the batch
        core's (`Batch.plan_ahead`)."""
        if self.decode_burst <= 0 or self.batch.waiting:
            return 1
        return max(1, min(MAX_REPEAT, int(self.decode_burst / max(self._run_s, 1e-6))))

    def _admit(self) -> list[Sequence]:
        """Free slots to waiting requests (the tests place a burst with it, not stepping)."""
        return self.batch.admit()

    def _send(self, step: Step | None, *, ahead: bool = False) -> bool:
        if step is None:
            return False
        self.worker.send(step)
        self.batch.track(step, ahead=ahead)
        return True

    def _join(self) -> None:
        """Start waiting requests at the next step boundary although the next step (decodes,
        planned ahead) is already in the engine's pipe: their new work goes in a join the
        engine runs inside that step if it has not started yet, else right after it
        (`Batch.plan_join`)."""
        if self._closing:
            return
        if self._send(self.batch.plan_join()):
            self._deliver()  # their Admitted events

    def close(self) -> None:
        """Stop stepping; every request still running or waiting ends with a 503 error."""
        self._closing = True
        self._wakeup.set()
        if self._step_scope is not None:
            self._step_scope.cancel()

    def _fail_everyone(self, failure: Failed) -> None:
        self.batch.fail_all(failure)
        self._deliver()

    @staticmethod
    def _unseen(seq: Sequence) -> bool:
        """Whether a stream's client has received none of its output yet: nothing written,
        and nothing waiting in the channel that the route would write before it reads the
        restart (queued text could reach the client, then the retry repeat it)."""
        return not seq.delivered and seq.channel.statistics().current_buffer_used == 0

    async def _idle(self) -> None:
        blocked = any(s.outbox for s in self.batch.live())
        self._wakeup = trio.Event()
        # A reader that drains its channel does not signal us: poll while anyone is blocked.
        with trio.move_on_after(0.02 if blocked else math.inf):
            await self._wakeup.wait()

    def _deliver(self) -> None:
        """Move each sequence's pending events into its channel without ever waiting."""
        now = time.perf_counter()
        for seq in list(self.batch.live()):
            while seq.outbox:
                event = seq.outbox[0] if seq.choice is None else (seq.choice, seq.outbox[0])
                try:
                    seq.channel.send_nowait(event)
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
        for seq in list(self.batch.live()):
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
        self.batch.release(seq)
        if seq in self.draining:
            self.draining.remove(seq)
        seq.channel.close()
