"""What a route asks the scheduler for and what it answers: a `Request` in, then events on
the request's channel (`Admitted`, `TextDelta`s, then `Finished` or `Failed`; `Restarted`
when a fault makes it start again; `Embedding` or `Decision` for those requests), and the
queue's limits. No trio, no torch: the whole server speaks this vocabulary.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import attrs

from .protocol import Branch, SamplingParams
from .text.line_limits import LineLimits

MAX_WAITING_PER_TENANT = 32  # seed 000: a tenant's requests waiting for a slot
MAX_WAITING = 256  # seed 000: all requests waiting for a slot


class NotReady(Exception):
    """The model is not loaded (or the worker is restarting)."""


class QueueFull(Exception):
    """Too many requests are waiting: for this tenant, or in all."""

    def __init__(self, message: str, *, whole_queue: bool):
        super().__init__(message)
        self.whole_queue = whole_queue


@attrs.frozen
class TokenLogprob:
    """One token's log-probability, and the likeliest tokens' at its position (the model's
    log-softmax before temperature and penalties), likeliest first. A prompt's first token
    has none (None)."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


@attrs.frozen
class TextDelta:
    """New text of the answer, and how many generated tokens it is the text of (a token
    whose text is held back, half a character or a possible stop string, counts with the
    text that releases it), with those tokens' log-probabilities where they were asked for."""

    text: str
    tokens: int = 1
    logprobs: tuple[TokenLogprob, ...] = ()
    # Where deltas the route had not taken yet were grown into this one (`Batch._emit`):
    # each one's (length of text, tokens), in order; () for one delta.
    parts: tuple[tuple[int, int], ...] = ()

    def pieces(self) -> Iterator[tuple[str, int]]:
        """(text, tokens) of each delta this one was grown from, in order."""
        if not self.parts:
            yield self.text, self.tokens
            return
        at = 0
        for length, tokens in self.parts:
            yield self.text[at : at + length], tokens
            at += length


@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@attrs.frozen
class Timings:
    """llama-server's timings block (milliseconds)."""

    prompt_n: int
    prompt_ms: float
    prompt_per_second: float | None
    predicted_n: int
    predicted_ms: float
    predicted_per_second: float | None
    cache_n: int
    queue_ms: float


@attrs.frozen
class Finished:
    """The answer ended: stop (end of turn or a stop string) or length."""

    reason: str
    usage: Usage
    timings: Timings
    stop_sequence: str | None = None  # the stop string that ended the text, if one did
    # Generated tokens inside the reasoning, as the route's parser read them (chat.parsed).
    reasoning_tokens: int = 0


@attrs.frozen
class Failed:
    """The answer could not be produced: 500 (device fault), 504 (the engine hung) or 503
    (shutting down)."""

    message: str
    status: int = 500


@attrs.frozen
class Embedding:
    """An embedding request's vector (mean of the final hidden states, L2-normalized)."""

    vector: tuple[float, ...]


@attrs.frozen
class Decision:
    """A decision request's reads: per branch, per read, the candidates' log-probs."""

    logprobs: tuple[tuple[tuple[float, ...], ...], ...]


@attrs.frozen
class Admitted:
    """The request has a slot; `cached` of its prompt tokens come from a cache (its own
    tenant's), the rest are prefilled. Sent again if the request runs again after a fault."""

    cached: int


@attrs.frozen
class PromptLogprobs:
    """The prompt's tokens' log-probs (OpenAI's `echo`), the first token's None: sent once the
    prompt is prefilled, before the answer's first text."""

    entries: tuple[TokenLogprob, ...]


@attrs.frozen
class Restarted:
    """The engine failed before anything reached the client: the answer starts again."""


@attrs.frozen
class Request:
    """What a route asks for, already tokenized and validated."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams
    max_tokens: int
    stop: tuple[str, ...] = ()
    tenant: str = ""
    ignore_eos: bool = False  # benchmarks: run to max_tokens whatever the model says
    stream: bool = False  # a stream that has sent text is never run again after a fault
    embed: bool = False  # an embedding: prefill every token, pool, generate nothing
    # A typed decision: prefill the prompt, then read these branches after it in one
    # forward; nothing is generated.
    branches: tuple[Branch, ...] = ()
    lines: LineLimits | None = None  # an editor's code completion (/infill): where it ends

    @property
    def reads_every_position(self) -> bool:
        """Whether every prompt position's hidden state is needed (pooled, or its next
        token's log-prob read): then no prefix may come from a cache."""
        return self.embed or self.params.prompt_logprobs


def random_seed() -> int:
    """A seed for requests that give none (still counter-based: reproducible if echoed)."""
    return secrets.randbits(63)
