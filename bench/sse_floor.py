"""mashbox's server CPU per decode step beside the floor of its stack, side by side.

The floor: quart-trio under hypercorn (mashbox's configuration and ASGI wrapper), streaming
events of the same shape and size as mashbox's chat chunks, fed by one ticker task at
mashbox's own step rate. No engine, no scheduler, no worker pipe, no detokenizing: what the
framework costs to write one SSE event per stream per step. Both servers are measured by
the same client (bench/decode_http.py's steady window, server process CPU from /proc), so
"mashbox / floor" is what mashbox's own per-token work adds over the stack it runs on.

    python bench/sse_floor.py                       # 8 streams, 256 tokens, 2 rounds
    python bench/sse_floor.py --streams 1 8 --rounds 3
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import decode_http  # noqa: E402
from vs_llama import free_port  # noqa: E402

MODEL = "smollm2-135m-instruct"


def floor_app(step_s: float):
    """The bare stack: a chat route that streams one content event per tick."""
    from quart import request
    from quart_trio import QuartTrio

    from mashbox.server.app import ShieldFinalSend, event_stream
    from mashbox.server.driver import OneFieldFrame, frame

    app = QuartTrio(__name__)
    listeners: set = set()
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await trio.sleep(step_s)
            ticks += 1
            for send in list(listeners):
                send.send_nowait(" tok")

    @app.before_serving
    async def start_ticker():
        app.nursery.start_soon(ticker)

    @app.get("/metrics")
    async def metrics():
        # decode_http reads steps and engine seconds; the "engine" is the ticker's sleep.
        return (
            f"mashbox:engine_steps_total {ticks}\n"
            f"mashbox:engine_busy_seconds_total {ticks * step_s}\n"
        )

    @app.post("/v1/chat/completions")
    async def chat():
        body = await request.get_json()
        send, receive = trio.open_memory_channel(64)
        base = {"id": "chatcmpl-" + "0" * 24, "created": int(time.time()), "model": MODEL}

        def chunk(delta, finish=None, **extra):
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            event = {**base, "object": "chat.completion.chunk", "system_fingerprint": "seed-0"}
            return frame({**event, "choices": [choice], **extra})

        content = OneFieldFrame(lambda text: chunk({"content": text}))

        async def chunks():
            listeners.add(send)
            t0 = time.perf_counter()
            try:
                yield chunk({"role": "assistant", "content": ""})
                for _ in range(body["max_tokens"]):
                    yield content(await receive.receive())
                rate = (body["max_tokens"] - 1) / (time.perf_counter() - t0)
                timings = {"predicted_per_second": rate}
                usage = {"completion_tokens": body["max_tokens"]}
                yield chunk({}, "length", timings=timings)
                yield frame({**base, "choices": [], "usage": usage, "timings": timings})
                yield frame("[DONE]")
            finally:
                listeners.discard(send)

        return event_stream(chunks())

    return ShieldFinalSend(app)


def serve_floor(port: int, step_s: float) -> None:
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    trio.run(serve, floor_app(step_s), config)


def measure(url: str, pid: int, streams: list[int], tokens: int) -> dict[int, dict]:
    async def run():
        await decode_http.run_streams(url, 1, 8, pid)  # warm-up
        return {n: await decode_http.run_streams(url, n, tokens, pid) for n in streams}

    return trio.run(run)


def mashbox_run(streams: list[int], tokens: int) -> dict[int, dict]:
    from support.serverproc import ServerProcess

    proc = ServerProcess(MODEL, "--slots", str(max(streams)), "--ctx", "1024")
    try:
        return measure(proc.wait_ready(900), proc.proc.pid, streams, tokens)
    finally:
        proc.stop()


def floor_run(step_ms: float, n: int, tokens: int) -> dict:
    port = free_port()
    cmd = [sys.executable, __file__, "--serve-floor", str(port), "--step-ms", str(step_ms)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                httpx.get(url + "/metrics", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.05)
        return measure(url, proc.pid, [n], tokens)[n]
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[8])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--serve-floor", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--step-ms", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_floor:
        serve_floor(args.serve_floor, args.step_ms / 1000)
        return
    print(
        f"{'round':>5} {'streams':>7} {'step ms':>8} {'mashbox CPU ms/step':>20} "
        f"{'floor CPU ms/step':>18} {'mashbox/floor':>14} {'mashbox % of step':>18} "
        f"{'floor % of step':>16}"
    )
    for round_ in range(1, args.rounds + 1):
        ours = mashbox_run(args.streams, args.tokens)
        for n in args.streams:
            step_ms = ours[n]["step_ms"] + ours[n]["server_ms"]  # a step through the API
            floor = floor_run(step_ms, n, args.tokens)
            mine, bare = ours[n]["server_cpu_ms"], floor["server_cpu_ms"]
            print(
                f"{round_:>5} {n:>7} {step_ms:>8.1f} {mine:>20.2f} {bare:>18.2f} "
                f"{mine / bare:>13.2f}x {mine / step_ms:>17.1%} {bare / step_ms:>15.1%}"
            )


if __name__ == "__main__":
    main()
