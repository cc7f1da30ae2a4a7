"""A stream's gaps between events while something else runs on the same server: how long
that something holds other tenants' tokens (`decision_stall.py`, `echo_cost.py`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx


def gaps_around(url: str, during: Callable[[], object]) -> tuple[list[float], list[float]]:
    """Start a long stream, let it decode steadily, run `during()`, and return the stream's
    gaps between events (seconds) before `during` began and while it ran."""
    stamps: list[float] = []
    done = threading.Event()

    def stream() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True}
        with httpx.stream(
            "POST", url + "/v1/completions", json={**body, "stream": True}, timeout=600
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    stamps.append(time.perf_counter())
                    if done.is_set():
                        return

    reader = threading.Thread(target=stream)
    reader.start()
    while len(stamps) < 40:  # decoding steadily
        time.sleep(0.01)
    t0 = time.perf_counter()
    try:
        during()
    finally:
        t1 = time.perf_counter()
        done.set()
        reader.join()
    gaps = [(b - a, a) for a, b in zip(stamps, stamps[1:], strict=False)]
    return [g for g, at in gaps if at < t0], [g for g, at in gaps if t0 <= at < t1]
