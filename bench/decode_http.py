"""Decode tokens/s of a model through the HTTP API at 1 and N concurrent streams.

Starts `mashbox run` (the default model unless --model or --url is given), sends greedy
streaming chat requests with ignore_eos so each stream decodes exactly --tokens tokens, and
prints per-stream and total decode speed next to the machine's decode limit: its read rate
(the faster of memory's and of a buffer a step's size, which a cache may hold) over the bytes
each step must read.
Also the engine's time per step and the server's (everything else: HTTP, scheduler, IPC,
detokenizing, SSE), from the server's metrics during steady decoding, and the longest wait
any stream saw for a token after its first (a join's prefill shows there too). And, where it
started the server itself, the same engine alone in this process (no server, no HTTP),
timed just before and just after each API run: its decode step beside the step through the
API, so "server overhead" is what the API costs over the engine alone, whatever the engine
does meanwhile.

    python bench/decode_http.py                      # default model, 1 and 4 streams
    python bench/decode_http.py --streams 1 4 8 --tokens 128
    python bench/decode_http.py --url http://127.0.0.1:8000   # an already running server
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import sse_client  # noqa: E402
import vs_llama_targets  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper and the sea."


class SteadyWindow:
    """Marks steady decoding: every stream has its first token, and none is near its end.

    The bench reads the server's counters only at these two edges: a /metrics scrape costs
    the server ~2.5 ms, so sampling through the run would bill the bench to the server.
    It counts content chunks, a token each from llama-server. mashbox's decode bursts send
    several tokens an event, so there no stream reaches end_piece and the window ends when
    the first stream ends (one_stream), its last tokens and usage event included. Asking for
    `continuous_usage_stats` would count tokens exactly, but its events leave the encoder's
    one-field fast path, so the bench would no longer measure what other clients get."""

    def __init__(self, streams: int, tokens: int):
        self.waiting_for_first = streams
        self.end_piece = max(tokens - 8, 2)  # a stream's content chunk that ends the window
        self.started = trio.Event()
        self.ending = trio.Event()

    def piece(self, count: int) -> None:
        """A stream received its count-th content chunk."""
        if count == 1:
            self.waiting_for_first -= 1
            if self.waiting_for_first == 0:
                self.started.set()
        if count >= self.end_piece and self.started.is_set():
            self.ending.set()


# Which client reads the streams: "lean" (sse_client.py on a thread: the least CPU an event)
# or "httpx" under trio (what most Python programs use; ~0.5 ms of CPU an event here).
CLIENT = "lean"


# Sampling fields every request carries (--temperature, --top-p, --top-logprobs); greedy
# without log-probs when empty.
SAMPLING: dict = {}


def add_client_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--client", choices=["lean", "httpx"], default="lean",
        help="what reads the streams (default lean: bench/sse_client.py, the least CPU an event)",
    )  # fmt: skip
    parser.add_argument("--temperature", type=float, help="sample (seeded) instead of greedy")
    parser.add_argument("--top-p", type=float, help="with --temperature: nucleus sampling")
    parser.add_argument("--top-logprobs", type=int, help="ask for log-probs, this many top ones")


def use_client(args: argparse.Namespace) -> None:
    global CLIENT
    CLIENT = args.client
    if args.temperature is not None:
        SAMPLING.update(temperature=args.temperature, seed=1)
    if args.top_p is not None:
        SAMPLING.update(top_p=args.top_p)
    if args.top_logprobs is not None:
        SAMPLING.update(logprobs=True, top_logprobs=args.top_logprobs)


class Tally:
    """One stream's events as they arrive: its first and last content chunk's times, their
    count, and the usage the server reported. `tell` runs window.piece in trio's thread (a
    thread's tally is told only at the window's edges: each call costs a loop turn)."""

    def __init__(self, window: SteadyWindow | None, tell):
        self.window, self.tell = window, tell
        self.first = self.last = None
        self.pieces = 0  # content chunks: the token count for servers that send no usage
        self.max_gap = 0.0  # the longest wait for a content chunk after the first
        self.usage = self.timings = None

    def add(self, event: dict) -> None:
        now = time.perf_counter()
        if event["choices"] and event["choices"][0]["delta"].get("content"):
            self.first = self.first or now
            if self.last is not None:
                self.max_gap = max(self.max_gap, now - self.last)
            self.last = now
            self.pieces += 1
            w = self.window
            if w and (self.pieces == 1 or self.pieces >= w.end_piece and not w.ending.is_set()):
                self.tell(w.piece, self.pieces)
        if event.get("usage"):
            self.usage, self.timings = event["usage"], event["timings"]


def read_lean(url: str, body: dict, tally: Tally) -> None:
    for event in sse_client.post_events(url, "/v1/chat/completions", body):
        tally.add(event)


async def read_httpx(url: str, body: dict, tally: Tally) -> None:
    async with httpx.AsyncClient(timeout=600) as http:
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    tally.add(json.loads(line[6:]))


async def one_stream(
    url: str, tokens: int, seed: int, extra: dict | None = None, window: SteadyWindow | None = None
) -> dict:
    body = {
        "messages": [{"role": "user", "content": f"{PROMPT} ({seed})"}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **SAMPLING,
        **(extra or {}),  # fields another server needs (bench/vs_llama.py)
    }
    if CLIENT == "lean":
        tally = Tally(window, trio.from_thread.run_sync)
        await trio.to_thread.run_sync(read_lean, url, body, tally, abandon_on_cancel=True)
    else:
        tally = Tally(window, lambda fn, *args: fn(*args))
        await read_httpx(url, body, tally)
    if not tally.pieces:  # an error, or a server that lost the request: never wait for it
        raise RuntimeError(f"stream {seed} ended without any text")
    if window and window.started.is_set():
        window.ending.set()  # a stream ended: steady decoding is over, however few its pieces
    return {"first": tally.first, "last": tally.last, "usage": tally.usage,
            "timings": tally.timings, "pieces": tally.pieces, "max_gap": tally.max_gap}  # fmt: skip


async def gather_streams(
    url: str, n: int, tokens: int, extra: dict | None = None, window: SteadyWindow | None = None
) -> list[dict]:
    """Run n streams at once; one_stream's result for each."""
    # The client's own full collections (~100 ms with torch loaded here) would read as the
    # server's stalls: what is alive now is out of their reach.
    gc.collect()
    gc.freeze()
    results = []

    async def worker(i):
        results.append(await one_stream(url, tokens, i, extra, window))

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(worker, i)
    return results


async def engine_counters(http: httpx.AsyncClient) -> tuple[float, float]:
    """(engine steps, seconds the engine spent in them) from the server's metrics."""
    text = (await http.get("/metrics")).text
    values = {}
    for name in ("mashbox:engine_steps_total", "mashbox:engine_busy_seconds_total"):
        values[name] = sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name)
        )
    return values["mashbox:engine_steps_total"], values["mashbox:engine_busy_seconds_total"]


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of a process so far (its own threads, not its children)."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def client_cpu_seconds() -> float:
    return sum(os.times()[:2])


async def run_streams(url: str, n: int, tokens: int, server_pid: int | None = None) -> dict:
    window = SteadyWindow(n, tokens)
    edges = []  # (time, engine steps, engine seconds, server CPU s, this client's CPU s)

    async def sample(http):
        await window.started.wait()
        steps, busy = await engine_counters(http)  # its own CPU falls before the window
        edges.append(
            (time.perf_counter(), steps, busy, cpu_seconds(server_pid), client_cpu_seconds())
        )
        await window.ending.wait()
        t, server, client = time.perf_counter(), cpu_seconds(server_pid), client_cpu_seconds()
        steps, busy = await engine_counters(http)  # and this one's after it
        edges.append((t, steps, busy, server, client))

    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sample, http)
            results = await gather_streams(url, n, tokens, window=window)
    (t0, steps0, busy0, server0, client0), (t1, steps1, busy1, server1, client1) = edges
    steps, busy = max(steps1 - steps0, 1), busy1 - busy0
    per_stream = [r["timings"]["predicted_per_second"] for r in results]
    wall = max(r["last"] for r in results) - min(r["first"] for r in results)
    generated = sum(r["usage"]["completion_tokens"] - 1 for r in results)
    return {
        "per_stream": sum(per_stream) / n,  # server timings: first to last token of each
        "total_wall": generated / wall,  # client clock: every token after each first one
        # Everything that is not the engine (HTTP, scheduler, IPC, detokenize, SSE), per
        # step and as a share of the engine's own step time.
        "step_ms": busy / steps * 1000,
        "server_ms": (t1 - t0 - busy) / steps * 1000,
        # CPU time per step of the server process (HTTP, scheduler, detokenize, SSE; not the
        # engine process) and of this client: on 2 cores both come out of the engine's.
        "server_cpu_ms": (server1 - server0) / steps * 1000,
        "client_cpu_ms": (client1 - client0) / steps * 1000,
        "max_gap_ms": max(r["max_gap"] for r in results) * 1000,  # a stall any stream saw
        "prompt_tokens": results[0]["usage"].get("prompt_tokens", 0),  # sse_floor's: none
    }


def read_rates(step_bytes: float) -> dict[str, float]:
    """This machine's read rates (bytes/s) over memory and over a buffer of a step's bytes,
    which a large cache may hold between steps (vs_llama_targets.ReadProbe); the faster
    bounds a decode step."""
    probe = vs_llama_targets.ReadProbe(os.cpu_count() or 1)
    probe.also_step(int(step_bytes))
    return probe.read()


class EngineAlone:
    """The server's engine in this process (no server, no HTTP): bench/step_profile.py's
    setup, its KV cache filled as far as `context` (random values: the API run's prompt and
    answer, as far as speed goes), each timing at the positions the API run decoded at."""

    def __init__(self, model: str, decode_weights: str, slots: int, context: int):
        import step_profile

        from mashbox.registry import default_models_dir, known_models

        path = default_models_dir() / model / known_models()[model]["filename"]
        self.engine = step_profile.prepare(path, decode_weights, slots, context)

    def step_ms(self, batch: int, position: int, steps: int = 20) -> float:
        """Median decode step at this batch size around this position: a step's attention
        reads every position before it (at 1,000 SmolLM2's KV adds a quarter to its weights'
        bytes), so the engine alone is timed where the API run's steps were, on average."""
        import statistics

        import step_profile

        times = step_profile.time_steps(self.engine, batch, max(0, position - steps // 2), steps)
        return statistics.median(times) * 1e3


async def main_async(args, url: str, server_pid: int | None = None, alone=None) -> None:
    card = httpx.get(url + "/v1/models").json()["data"][0]
    print(f"model {card['id']}  weights {card['weights']}  bpw {card['bpw']}  gb {card['gb']}")
    step_bytes = card.get("decode_gb", card["gb"]) * 1e9  # each decode step reads these once
    rates = read_rates(step_bytes)
    limit = max(rates.values()) / step_bytes
    print(
        f"reads: {vs_llama_targets.reads(rates)}; weights read per step {step_bytes / 1e6:.0f} MB"
    )
    print(f"decode limit: {limit:.1f} steps/s (one token per stream per step)")
    warm = await run_streams(url, 1, 8)
    middle = warm["prompt_tokens"] + args.tokens // 2  # the API run's mean decode position
    print(
        f"{'streams':>7} {'tok/s/stream':>13} {'total tok/s':>12} {'vs 1 stream':>12} "
        f"{'steps/s of limit':>17} {'engine ms/step':>15} {'server ms/step':>15} {'max gap ms':>11}"
        + (f" {'server CPU ms/step':>19} {'client CPU ms/step':>19}" if server_pid else "")
    )
    base, compared = None, []
    for n in args.streams:
        # The engine alone just before and just after: the host's speed drifts by tens of
        # percent within minutes, so a comparison with a timing taken later means little.
        before = alone.step_ms(n, middle) if alone else None
        r = await run_streams(url, n, args.tokens, server_pid)
        after = alone.step_ms(n, middle) if alone else None
        base = base or r["total_wall"]
        cpu = ""
        if server_pid:
            share = r["server_cpu_ms"] / r["step_ms"]
            cpu = f" {r['server_cpu_ms']:>12.2f} ({share:.0%}) {r['client_cpu_ms']:>19.2f}"
        print(
            f"{n:>7} {r['per_stream']:>13.1f} {r['total_wall']:>12.1f} "
            f"{r['total_wall'] / base:>11.2f}x {r['per_stream'] / limit:>16.0%} "
            f"{r['step_ms']:>15.1f} {r['server_ms']:>9.1f} ({r['server_ms'] / r['step_ms']:.0%})"
            f" {r['max_gap_ms']:>11.1f}" + cpu
        )
        if alone:
            compared.append((n, r["step_ms"] + r["server_ms"], before, after))
    if compared:
        print(
            f"{'streams':>7} {'API step ms':>12} {'engine alone ms (before/after)':>31} "
            f"{'API overhead':>13}"
        )
        for n, api_ms, before, after in compared:
            alone_ms = (before + after) / 2
            print(
                f"{n:>7} {api_ms:>12.1f} {before:>18.1f} / {after:<10.1f} "
                f"{api_ms / alone_ms - 1:>12.0%}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="an already running server")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument(
        "--server-args", default="", help='more `mashbox run` flags, e.g. "--decode-weights int8"'
    )
    parser.add_argument(
        "--server-log", type=Path, help="also write the server's log here (kept on failure)"
    )
    parser.add_argument(
        "--no-engine-alone", action="store_true", help="skip timing the engine without a server"
    )
    add_client_flag(parser)
    args = parser.parse_args()
    use_client(args)
    if args.url:
        trio.run(main_async, args, args.url)
        return
    from support.serverproc import ServerProcess

    slots = max(args.slots, *args.streams)
    extra = args.server_args.split()
    alone = None
    if not args.no_engine_alone:
        kind = extra[extra.index("--decode-weights") + 1] if "--decode-weights" in extra else "auto"
        # Room for the prompt (the chat template's and the PROMPT's few dozen tokens) and the
        # answer: the KV the API run's last steps read.
        alone = EngineAlone(args.model, kind, max(args.streams), args.tokens + 256)
    proc = ServerProcess(
        args.model, "--slots", str(slots), "--ctx", "1024", *extra, log=args.server_log
    )
    try:
        url = proc.wait_ready(900)
        trio.run(main_async, args, url, proc.proc.pid, alone)
    except BaseException:
        print("the server's last lines:\n" + proc.output(), file=sys.stderr)
        raise
    finally:
        proc.stop()


if __name__ == "__main__":
    main()
