"""Two running servers against each other, one greedy stream at a time, taking turns.

For a change that only shows through HTTP (the server's share of the cores, the worker's
threads, scheduling policy): start one `mashbox run` for each side on its own port (two trees
through PYTHONPATH, or one tree with and without a setting), then

    python bench/server_ab.py http://127.0.0.1:8124 http://127.0.0.1:8125 [--rounds 40]

Each round streams `--tokens` tokens from each (the lean client of sse_client.py, the order
flipping every round) and takes the ratio A / B of their times a token (first content event
to last). Prints the median ratio and its quartiles, and the ratio of the means. On the
AVX-512 host (stop 39) two servers of the same tree read 0.979 (quartiles 0.946-1.033) over 40
rounds: run it both ways round (A B, then B A) before believing a few percent.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sse_client  # noqa: E402


def ready(url: str) -> bool:
    try:
        return httpx.get(url + "/health").status_code == 200
    except httpx.TransportError:  # not listening yet
        return False


def served_model(url: str, wait_s: float = 600) -> str:
    """The model `url` serves, once it is ready (a server still loading answers 503)."""
    deadline = time.monotonic() + wait_s
    while not ready(url):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not ready after {wait_s:.0f} s")
        time.sleep(0.5)
    return httpx.get(url + "/v1/models").json()["data"][0]["id"]


def ms_per_token(url: str, model: str, tokens: int, seed: int) -> float:
    """One greedy stream's time a token: its first content event to its last, over the
    tokens after the first (the usage's count: an event may carry several tokens)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Write about the sea ({seed})"}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    times, generated = [], 0
    for event in sse_client.post_events(url, "/v1/chat/completions", body):
        if event.get("choices") and event["choices"][0]["delta"].get("content"):
            times.append(time.perf_counter())
        if event.get("usage"):
            generated = event["usage"]["completion_tokens"]
    if len(times) < 2 or generated < 2:
        raise RuntimeError(f"{url} streamed {len(times)} content events, {generated} tokens")
    return (times[-1] - times[0]) / (generated - 1) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", help="side A's base URL")
    parser.add_argument("b", help="side B's base URL")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    urls = {"A": args.a, "B": args.b}
    models = {side: served_model(url) for side, url in urls.items()}
    times: dict[str, list[float]] = {"A": [], "B": []}
    ratios = []
    for r in range(args.rounds):
        for side in ("A", "B") if r % 2 == 0 else ("B", "A"):
            times[side].append(ms_per_token(urls[side], models[side], args.tokens, r))
        ratios.append(times["A"][-1] / times["B"][-1])
    q = statistics.quantiles(ratios, n=4)
    mean = {side: statistics.mean(t) for side, t in times.items()}
    print(
        f"A {statistics.median(times['A']):.3f} ms a token, "
        f"B {statistics.median(times['B']):.3f}; A / B median {statistics.median(ratios):.3f}"
        f" (quartiles {q[0]:.3f}-{q[2]:.3f}, {args.rounds} rounds of {args.tokens} tokens)"
    )
    # A cost that comes and goes (a state the host's scheduler falls into for some hundreds
    # of steps, stop 40) hides under the median of the rounds; the means show it.
    print(f"means: A {mean['A']:.3f}, B {mean['B']:.3f}, A / B {mean['A'] / mean['B']:.3f}")


if __name__ == "__main__":
    main()
