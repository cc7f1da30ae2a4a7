"""Soak test: many concurrent streams with random disconnects, stalls, cancellations and
injected engine faults against a real `mashbox run`, bounded in time and count, loopback only.

At the end it checks: no leaked slots (health live_rows 0, waiting 0), every completed
request's text identical to the same seeded request run alone, server memory flat.

    python bench/soak.py                       # tiny model built here, 120 s, 12 clients
    python bench/soak.py --duration 300 --clients 16 --model smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import socket
import sys
import tempfile
import time
from pathlib import Path

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support.serverproc import ServerProcess  # noqa: E402

CHAT = "/v1/chat/completions"
PROMPTS = ["Tell me about Paris.", "Write a poem about the sea.", "Explain rain.", "Count to ten."]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def body(rng: random.Random, stream: bool) -> dict:
    return {
        "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
        "temperature": 1.0,
        "top_p": 0.95,
        "seed": rng.randrange(20),  # few seeds: the same request recurs under load
        "max_tokens": rng.choice([8, 24, 64]),
        "stream": stream,
    }


def key(b: dict) -> str:
    return json.dumps([b["messages"][0]["content"], b["seed"], b["max_tokens"]])


class Soak:
    def __init__(self, url: str, stall_s: float):
        self.url = url
        self.stall_s = stall_s
        self.counts = collections.Counter()
        self.texts: dict[str, set[str]] = collections.defaultdict(set)

    async def client(self, seed: int, deadline: float) -> None:
        rng = random.Random(seed)
        async with httpx.AsyncClient(base_url=self.url, timeout=120) as http:
            while trio.current_time() < deadline:
                action = rng.choices(
                    ["whole", "stream", "disconnect", "stall", "cancel"], [3, 3, 2, 1, 1]
                )[0]
                try:
                    await getattr(self, action)(http, rng)
                except (httpx.TransportError, OSError) as exc:
                    self.counts[f"{action}: {type(exc).__name__}"] += 1

    async def whole(self, http, rng):
        b = body(rng, False)
        r = await http.post(CHAT, json=b)
        self.counts[f"whole {r.status_code}"] += 1
        if r.status_code == 200:
            self.texts[key(b)].add(r.json()["choices"][0]["message"]["content"])

    async def stream(self, http, rng):
        b = body(rng, True)
        text, done, status = [], False, None
        async with http.stream("POST", CHAT, json=b) as r:
            status = r.status_code
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.counts["stream error event"] += 1
                    elif event["choices"]:
                        text.append(event["choices"][0]["delta"].get("content") or "")
        self.counts[f"stream {status}{' done' if done else ''}"] += 1
        if done:
            self.texts[key(b)].add("".join(text))

    async def disconnect(self, http, rng):
        """Leave mid-stream (or mid-prefill) after a random moment."""
        b = body(rng, True)
        b["max_tokens"] = 200
        with trio.move_on_after(rng.uniform(0.0, 0.5)):
            async with http.stream("POST", CHAT, json=b) as r:
                async for _ in r.aiter_lines():
                    pass
        self.counts["disconnect"] += 1

    async def cancel(self, http, rng):
        """A non-streamed request given up on almost at once (often still queued)."""
        with trio.move_on_after(rng.uniform(0.0, 0.05)):
            await http.post(CHAT, json=body(rng, False))
        self.counts["cancel"] += 1

    async def stall(self, http, rng):
        """A raw client that asks for a long stream and then reads nothing."""
        sock = trio.socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        host, port = self.url.removeprefix("http://").split(":")
        await sock.connect((host, int(port)))
        b = json.dumps({**body(rng, True), "max_tokens": 2000, "ignore_eos": True}).encode()
        head = (
            f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(b)}\r\n\r\n"
        ).encode()
        await sock.send(head + b)
        await trio.sleep(self.stall_s + 1.0)
        sock.close()
        self.counts["stall"] += 1


async def run(args, url: str, proc: ServerProcess) -> int:
    soak = Soak(url, args.stall_timeout)
    pid = int(httpx.get(url + "/health").json()["worker_pid"])
    server_pid = proc.proc.pid
    # Warm up, then take the memory baseline.
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        for i in range(20):
            await soak.whole(http, random.Random(i))
    rss0 = rss_mb(server_pid)
    t0 = time.monotonic()
    print(f"soaking {args.duration:.0f} s with {args.clients} clients against {url}")
    async with trio.open_nursery() as nursery:
        deadline = trio.current_time() + args.duration
        for i in range(args.clients):
            nursery.start_soon(soak.client, 1000 + i, deadline)
    elapsed = time.monotonic() - t0
    # Let stalled streams be dropped, then check nothing leaked.
    await trio.sleep(args.stall_timeout * 2 + 2)
    health = httpx.get(url + "/health").json()
    rss1 = rss_mb(server_pid)
    # Every distinct completed request, run again alone, must give the same text.
    mismatched = 0
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        for k, texts in soak.texts.items():
            content, seed, max_tokens = json.loads(k)
            b = {
                "messages": [{"role": "user", "content": content}],
                "temperature": 1.0,
                "top_p": 0.95,
                "seed": seed,
                "max_tokens": max_tokens,
            }
            alone = (await http.post(CHAT, json=b)).json()["choices"][0]["message"]["content"]
            if texts != {alone}:
                mismatched += 1
    total = sum(soak.counts.values())
    print(f"{total} requests in {elapsed:.0f} s:")
    for name, n in sorted(soak.counts.items()):
        print(f"  {name:<34} {n}")
    print(
        f"engine restarts: {health['worker_restarts']}  (worker pid {pid} -> "
        f"{health['worker_pid']})"
    )
    print(f"after: live_rows {health['live_rows']}, waiting {health['waiting']}")
    print(f"distinct completed requests checked alone: {len(soak.texts)}, mismatched {mismatched}")
    print(f"server RSS: {rss0:.0f} MB after warm-up, {rss1:.0f} MB at the end")
    ok = health["live_rows"] == 0 and health["waiting"] == 0 and mismatched == 0
    ok = ok and rss1 < rss0 * 1.2 + 20
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="default: a tiny Llama built here")
    parser.add_argument("--duration", type=float, default=120)
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--stall-timeout", type=float, default=2.0)
    parser.add_argument(
        "--fault-every", type=int, default=400, help="crash the engine every N steps"
    )
    args = parser.parse_args()
    model = args.model
    if model is None:
        from support.tinymodels import build_tiny_llama

        model = str(build_tiny_llama(Path(tempfile.mkdtemp()) / "tiny", quantize=True))
    # Faults across the whole run: crashes, raised errors and a hang, at spread-out steps.
    kinds = ["crash", "raise", "crash", "hang"]
    faults = ",".join(f"{kinds[i % len(kinds)]}@{(i + 1) * args.fault_every}" for i in range(200))
    proc = ServerProcess(
        model, "--slots", "4", "--ctx", "2048", "--stall-timeout", str(args.stall_timeout),
        "--step-timeout", "3", env={"MASHBOX_FAULTS": faults},
    )  # fmt: skip
    try:
        url = proc.wait_ready(900)
        return trio.run(run, args, url, proc)
    finally:
        proc.stop()


if __name__ == "__main__":
    raise SystemExit(main())
