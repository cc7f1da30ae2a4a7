"""What the scheduler keeps per request and per KV slot, and the record of a step sent to the
engine. Plain state, no trio: the scheduler's task and its batch core (`batch.Batch`) share it.
"""

from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING

import attrs

from .events import Finished, Request, Restarted, Timings, Usage
from .protocol import Step
from .text.line_limits import LineWatch
from .text.stops import StopMatcher
from .text.tokenizer import Detokenizer, Tokenizer

if TYPE_CHECKING:
    import trio


@attrs.define(eq=False)
class Sequence:
    """A request owned by the scheduler; its handler holds only the receive channel."""

    request: Request
    # The scheduler's task feeds it from `outbox`; the batch core never touches it.
    channel: trio.MemorySendChannel | None
    detok: Detokenizer
    stops: StopMatcher
    t_submit: float
    lines: LineWatch | None = None  # the request's LineLimits, watching its text
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
    unsent_logprobs: list = attrs.Factory(list)  # their TokenLogprobs, where asked for
    prompt_logprobs: list = attrs.Factory(list)  # echo's reads of the prompt so far
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
    pending: int = 0  # tokens sent to be sampled for this sequence, results not yet in
    # One of a request's several choices: its index, which tags its events in the channel
    # the choices share, and its prompt's first choice, whose KV it copies once prefilled.
    choice: int | None = None
    leader: Sequence | None = None
    t_start: float | None = None
    t_first: float | None = None
    t_last: float | None = None

    @classmethod
    def new(
        cls, request: Request, tokenizer: Tokenizer, channel: trio.MemorySendChannel | None
    ) -> Sequence:
        """A request just submitted, its clock started."""
        return cls(
            request=request,
            channel=channel,
            detok=Detokenizer(tokenizer),
            stops=StopMatcher(list(request.stop)),
            t_submit=time.perf_counter(),
            lines=LineWatch(request.lines) if request.lines else None,
        )

    @property
    def decoding(self) -> bool:
        r = self.request
        return self.prefilled == len(r.prompt_ids) and not (r.embed or r.branches)

    @property
    def waits_for_leader(self) -> bool:
        """A later choice waits while its prompt's first choice prefills the prompt they
        share: placed then, it copies that KV (`Share`) rather than compute it again. If the
        first ends first, it goes on its own."""
        lead = self.leader
        if lead is None or lead.done or lead.cancelled:
            return False
        return lead.prefilled < len(lead.request.prompt_ids) - 1

    def run_again(self, tokenizer: Tokenizer) -> None:
        """Forget this run (the engine lost it) and wait for a slot again, as if just queued:
        only the clock and the handler's view (`Restarted` if it saw text) carry over."""
        self.retried, self.admitted, self.prefilled, self.cached = True, False, 0, 0
        self.pending = 0
        self.output_ids.clear()
        self.readings.clear()
        self.unsent_tokens = 0  # (the route resets its own counts on Restarted)
        self.unsent_logprobs.clear()
        self.prompt_logprobs.clear()
        self.outbox.clear()
        self.detok = Detokenizer(tokenizer)
        self.stops = StopMatcher(list(self.request.stop))
        self.lines = LineWatch(self.request.lines) if self.request.lines else None
        self.t_first = self.t_last = None
        if self.emitted:  # the handler drops what it collected or its parser holds
            self.outbox.append(Restarted())
            self.emitted = False

    def usage(self) -> Usage:
        return Usage(len(self.request.prompt_ids), len(self.output_ids), self.cached)

    def timings(self) -> Timings:
        prompt_n = len(self.request.prompt_ids) - self.cached
        prompt_ms = (self.t_first - self.t_start) * 1000
        predicted_ms = (self.t_last - self.t_first) * 1000
        n = len(self.output_ids)
        return Timings(
            prompt_n=prompt_n,
            prompt_ms=round(prompt_ms, 3),
            prompt_per_second=round(prompt_n / prompt_ms * 1000, 2) if prompt_ms > 0 else None,
            predicted_n=n,
            predicted_ms=round(predicted_ms, 3),
            predicted_per_second=(
                round((n - 1) / predicted_ms * 1000, 2) if n > 1 and predicted_ms > 0 else None
            ),
            cache_n=self.cached,
            queue_ms=round((self.t_start - self.t_submit) * 1000, 3),
        )


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

    def run(self, i: int) -> Sent:
        """Run i of a repeated step (`Step.run`), with the same owners."""
        return Sent(self.step.run(i), self.owners, self.ahead)

    @property
    def sampling_slots(self) -> list[int]:
        """The slots whose next token this step samples: its decodes and final prompt chunks."""
        step = self.step
        return [d.slot for d in step.decodes] + [p.slot for p in step.prefills if p.sample]
