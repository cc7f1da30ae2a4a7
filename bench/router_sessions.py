"""Agent sessions through SGLang's model gateway (smg): its cache-aware policy against
round-robin, over two mashbox replicas, side by side.

8 agent sessions run at once, 4 turns each, over one shared system prompt (~1,500 tokens);
every turn resends the whole conversation. Per policy: the share of prompt tokens served from
the replicas' prompt caches (usage cached_tokens over prompt_tokens, all turns) and the mean
time to first token of turns 2-4, the ones a cache can serve. Each policy gets fresh replicas,
so neither inherits the other's cache.

    python bench/router_sessions.py                       # default model, 2 replicas
    python bench/router_sessions.py --model PATH.gguf --slots 4 --threads 2
    python bench/router_sessions.py --spill 2    # and cache_aware that spills sooner
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support.serverproc import ServerProcess  # noqa: E402

RULES = "\n".join(
    f"{i}. Read the code before changing it, keep each function small, name things plainly, "
    "run the tests after every change and say in one short paragraph what you did."
    for i in range(1, 51)
)
SYSTEM = "You are a careful coding agent working in a Python repository.\n\n" + RULES
TASKS = [
    "Add a --verbose flag to the command line.",
    "Find why the cache test is flaky.",
    "Rename the Worker class to Engine.",
    "Write a test for the tokenizer's byte fallback.",
    "Make the health route report the queue depth.",
    "Remove the unused imports in the server package.",
    "Document the retry policy in the README.",
    "Speed up the JSON encoder on large answers.",
]
FOLLOW_UPS = ["Show me the change.", "Now run the tests.", "Summarise what you did."]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_gateway(workers: list[str], policy: str, *extra: str) -> tuple[subprocess.Popen, str]:
    """`smg launch` in front of the workers; returns once it has registered them."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "smg", "launch", "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        "--worker-urls", *workers, "--policy", policy, "--log-level", "error",
        "--shutdown-grace-period-secs", "2", *extra,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            models = httpx.get(url + "/v1/models", timeout=5).json().get("data") or []
            if models:
                return proc, url
        except (httpx.TransportError, ValueError):
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"smg did not register the workers at {url}")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def turn(http: httpx.Client, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed turn: its answer, time to first token and usage."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    first, text, usage = None, [], {}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            for choice in event.get("choices", ()):
                if first is None and (choice["delta"].get("content") or choice["finish_reason"]):
                    first = time.perf_counter() - t0
                text.append(choice["delta"].get("content") or "")
    return {"ttft": first, "text": "".join(text), "usage": usage}


def session(url: str, model: str, task: str, max_tokens: int, out: list) -> None:
    messages = [{"role": "system", "content": SYSTEM}]
    with httpx.Client(base_url=url, timeout=600) as http:
        for number, question in enumerate([task, *FOLLOW_UPS], 1):
            messages.append({"role": "user", "content": question})
            result = turn(http, model, messages, max_tokens)
            messages.append({"role": "assistant", "content": result["text"]})
            out.append((number, result))


def answered(url: str) -> int:
    """Requests a replica has answered (its mashbox:request_success counters)."""
    text = httpx.get(url + "/metrics").text
    lines = [line for line in text.splitlines() if line.startswith("mashbox:request_success_total")]
    return round(sum(float(line.rsplit(" ", 1)[1]) for line in lines))


def run(policy: str, args, *gateway_args: str) -> dict:
    """Fresh replicas, the gateway with `policy`, the 8 sessions at once."""
    extra = ["--slots", str(args.slots), "--threads", str(args.threads), "--ctx", "4096"]
    replicas = [ServerProcess(args.model, *extra) for _ in range(args.replicas)]
    gateway = None
    try:
        urls = [p.wait_ready(900) for p in replicas]
        model = httpx.get(urls[0] + "/v1/models").json()["data"][0]["id"]
        gateway, url = start_gateway(urls, policy, *gateway_args)
        out: list = []
        threads = [
            threading.Thread(target=session, args=(url, model, task, args.max_tokens, out))
            for task in TASKS[: args.sessions]
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        per_replica = "/".join(str(answered(u)) for u in urls)
    finally:
        if gateway is not None:
            stop(gateway)
        for p in replicas:
            p.stop()
    prompt = sum(r["usage"]["prompt_tokens"] for _, r in out)
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for _, r in out)
    return {
        "cached share": cached / prompt,
        "TTFT turn 1 (s)": statistics.mean(r["ttft"] for n, r in out if n == 1),
        "TTFT turns 2-4 (s)": statistics.mean(r["ttft"] for n, r in out if n > 1),
        "prompt tokens": prompt,
        "requests/replica": per_replica,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--slots", type=int, default=4, help="per replica")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument(
        "--spill",
        type=int,
        default=0,
        metavar="N",
        help="also run cache_aware with --balance-abs-threshold N (0: not)",
    )
    args = parser.parse_args()
    results = {policy: run(policy, args) for policy in ("cache_aware", "round_robin")}
    if args.spill:  # cache-aware that leaves a matched replica sooner for a less loaded one
        spill = ["--balance-abs-threshold", str(args.spill), "--balance-rel-threshold", "1.0"]
        results[f"cache_aware/{args.spill}"] = run("cache_aware", args, *spill)
    print(f"{args.sessions} sessions x 4 turns, {args.replicas} replicas of {args.model}")
    print(f"{'':<20}" + "".join(f"{p:>16}" for p in results))
    for row in next(iter(results.values())):
        cells = [results[p][row] for p in results]
        if row == "cached share":
            print(f"{row:<20}" + "".join(f"{v:>16.0%}" for v in cells))
        elif isinstance(cells[0], float):
            print(f"{row:<20}" + "".join(f"{v:>16.3f}" for v in cells))
        else:
            print(f"{row:<20}" + "".join(f"{v:>16}" for v in cells))


if __name__ == "__main__":
    main()
