"""The check's run: the cases in order against one server, each one's error caught as its
result, a row printed as each ends, and the exit status (1 when any case failed)."""

from __future__ import annotations

import sys
from functools import partial

import httpx

from . import conformance, reproducibility
from .client import NotServed, Refused, Server
from .results import Result, failed, skipped
from .table import row, summary


def check(
    url: str,
    *,
    model: str | None = None,
    api_key: str | None = None,
    seed: int = 1234,
    restart_cmd: str | None = None,
    timeout: float = 120.0,
) -> int:
    """Check the server at `url`, print the table; 0 when nothing failed, else 1."""
    server = Server(url, api_key=api_key, timeout=timeout)
    try:
        try:
            model = model or server.first_model()
        except (NotServed, Refused, httpx.HTTPError) as e:
            why = _describe(e)
            print(f"mashbox check: cannot list {server.url}'s models: {why}", file=sys.stderr)
            return 1
        return _run(server, model, seed, restart_cmd, timeout)
    finally:
        server.close()


def _run(server: Server, model: str, seed: int, restart_cmd: str | None, timeout: float) -> int:
    seeded = reproducibility.Seeded(server, model, seed)
    sections = {
        f"seeded sampling (model {model}, seed {seed})": {
            "alone": partial(reproducibility.alone, seeded),
            "beside 7 others": partial(reproducibility.beside_others, seeded),
            "in another slot": partial(reproducibility.in_another_slot, seeded),
            "from a cached prefix": partial(reproducibility.from_cached_prefix, seeded),
            "after a restart": partial(reproducibility.after_restart, seeded, restart_cmd, timeout),
        },
        "protocols": {
            "chat completions": partial(conformance.chat, server, model),
            "completions": partial(conformance.completions, server, model),
            "responses": partial(conformance.responses, server, model),
            "messages": partial(conformance.messages, server, model),
        },
    }
    width = max(len(name) for cases in sections.values() for name in cases)
    results = []
    print(f"mashbox check {server.url}", flush=True)
    for title, cases in sections.items():
        print(title, flush=True)
        for name, case in cases.items():
            results.append(_outcome(case))
            print(row(name, results[-1], width), flush=True)
    print(summary(results), flush=True)
    return 1 if any(r.failed for r in results) else 0


def _outcome(case) -> Result:
    try:
        return case()
    except NotServed:
        return skipped("not served (404)")
    except (Refused, httpx.HTTPError) as e:
        return failed(_describe(e))


def _describe(error: Exception) -> str:
    if isinstance(error, httpx.TimeoutException):
        return f"timed out ({type(error).__name__})"
    if isinstance(error, httpx.TransportError):
        return f"cannot reach the server ({error or type(error).__name__})"
    return str(error) or type(error).__name__
