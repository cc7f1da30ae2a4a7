"""What the scheduler tells the rest of the server: its hook for metrics as requests move
(server/metrics.py counts it), and its snapshot for /health and /metrics."""

from __future__ import annotations

import attrs

from .events import Finished


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


@attrs.frozen
class Stats:
    """The queue, the slots and the host prompt cache at one moment (/health, /metrics)."""

    running: int
    waiting: int
    slots: int = 0
    kv_cache_usage: float = 0.0  # fraction of slots x ctx holding tokens of running requests
    cache_bytes: int = 0  # host prompt cache: bytes held, its cap, entries evicted so far
    cache_cap_bytes: int = 0
    cache_evictions: int = 0
