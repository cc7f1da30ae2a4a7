"""Fault injection for tests: `MASHBOX_FAULTS` makes the engine process misbehave on purpose.

The value is a comma-separated list of ACTION@STEP, STEP being the scheduler's global step
number (it keeps counting across worker restarts, so each fault fires once):
  crash@K   the process exits at once (as a segfault or OOM kill would)
  raise@K   the step raises an exception
  hang@K    the step never returns (the scheduler's step deadline must catch it)
  slow=S    every step, each run of a repeated one, takes S seconds longer, counted in its
            time as a slow device's would be (makes prefill/decode windows wide for tests)
  crash_token=ID   the process exits in any step whose prompt chunks hold token ID (a
            poison request: it crashes the engine however often it runs)
"""

from __future__ import annotations

import os
import time

ENV = "MASHBOX_FAULTS"


class InjectedFault(RuntimeError):
    """Raised by raise@K."""


def parse(spec: str) -> tuple[dict[int, str], float, frozenset[int]]:
    """Return ({step: action}, slow seconds, crash tokens) from a MASHBOX_FAULTS value."""
    at: dict[int, str] = {}
    slow = 0.0
    crash_tokens: set[int] = set()
    for item in filter(None, (part.strip() for part in spec.split(","))):
        if item.startswith("slow="):
            slow = float(item.removeprefix("slow="))
            continue
        if item.startswith("crash_token="):
            crash_tokens.add(int(item.removeprefix("crash_token=")))
            continue
        action, _, step = item.partition("@")
        if action not in ("crash", "raise", "hang") or not step.isdigit():
            raise ValueError(f"bad {ENV} entry {item!r}")
        at[int(step)] = action
    return at, slow, frozenset(crash_tokens)


class Faults:
    """The faults this process was started with."""

    def __init__(self, spec: str | None = None):
        spec = os.environ.get(ENV, "") if spec is None else spec
        self.at, self.slow, self.crash_tokens = parse(spec)

    def before_step(self, index: int, prompt_ids=()) -> None:
        """Misbehave as asked before step `index`, whose prompt chunks hold `prompt_ids`
        (slow=S is the engine's: `Engine.slow_s`)."""
        if self.crash_tokens and self.crash_tokens.intersection(prompt_ids):
            os._exit(70)
        action = self.at.get(index)
        if action == "crash":
            os._exit(70)
        if action == "raise":
            raise InjectedFault(f"injected fault at step {index}")
        if action == "hang":
            time.sleep(10**6)
