"""Replay a multi-turn agent conversation and print time to first token per turn, with the
host prompt cache off and on, side by side.

An agent resends the whole conversation every turn. Here: a ~2,000-token system prompt with
tool definitions, then turns that each append a user message and the model's answer; two
other conversations are interleaved, so with 2 slots the measured conversation's slot is
taken between its turns. Without the host cache each turn pays a full prefill again; with
it the saved prefix comes back from host memory.

    python bench/agent_turns.py                    # default model, 4 turns
    python bench/agent_turns.py --turns 6 --model PATH.gguf
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support.serverproc import ServerProcess  # noqa: E402

TOOLS = [
    {"type": "function", "function": {
        "name": name, "description": f"{what}. " + "Use it carefully and check the result. " * 3,
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "A path relative to the repository root"},
            "text": {"type": "string", "description": "The text to write or search for"},
        }, "required": ["path"]},
    }}
    for name, what in [
        ("read_file", "Read a file"), ("write_file", "Write a file"), ("list_dir", "List files"),
        ("search", "Search the code"), ("run_tests", "Run the test suite"),
        ("git_diff", "Show the diff"), ("git_commit", "Commit the change"),
        ("open_issue", "Open an issue"),
    ]
]  # fmt: skip
RULES = "\n".join(
    f"{i}. When you change code, keep functions small, name things plainly, test the change, "
    f"and explain what you did in one short paragraph."
    for i in range(1, 41)
)
SYSTEM = "You are a careful coding agent working in a Python repository.\n\n" + RULES
QUESTIONS = [
    "Find where the scheduler admits requests.",
    "Now explain how a slot is chosen.",
    "What happens when a client disconnects?",
    "Write a test for that.",
    "Summarise the change.",
    "Anything else to check?",
]


def ttft(http: httpx.Client, messages: list[dict], max_tokens: int) -> tuple[float, str, dict]:
    body = {"messages": messages, "tools": TOOLS, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    first, text, usage = None, [], {}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = {**event["usage"], **event["timings"]}
            for choice in event["choices"]:
                delta = choice["delta"]
                if first is None and (
                    "content" in delta
                    and delta["content"]
                    or "tool_calls" in delta
                    or choice["finish_reason"]
                ):
                    first = time.perf_counter() - t0
                text.append(delta.get("content") or "")
    return first, "".join(text), usage


def run(model: str, cache_mib: int, turns: int, max_tokens: int) -> list[tuple[float, dict]]:
    proc = ServerProcess(model, "--slots", "2", "--ctx", "4096", "--cache-ram", str(cache_mib))
    try:
        url = proc.wait_ready(900)
        convs = {name: [{"role": "system", "content": SYSTEM + f"\n(session {name})"}]
                 for name in ("main", "other1", "other2")}  # fmt: skip
        out = []
        with httpx.Client(base_url=url, timeout=600) as http:
            for turn in range(turns):
                for name, messages in convs.items():
                    messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
                    seconds, text, usage = ttft(http, messages, max_tokens)
                    messages.append({"role": "assistant", "content": text})
                    if name == "main":
                        out.append((seconds, usage))
            health = http.get("/health").json()
        print(f"  cache-ram {cache_mib} MiB: host cache {health['host_cache_bytes'] / 2**20:.0f}"
              f" MiB, evictions {health['host_cache_evictions']}", file=sys.stderr)  # fmt: skip
        return out
    finally:
        proc.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--cache-ram", type=int, default=512)
    args = parser.parse_args()
    off = run(args.model, 0, args.turns, args.max_tokens)
    on = run(args.model, args.cache_ram, args.turns, args.max_tokens)
    print(f"{'turn':>4} {'prompt':>7} {'TTFT off (s)':>13} {'TTFT on (s)':>12} {'cached on':>10}"
          f" {'on/off':>7}")  # fmt: skip
    for i, ((t_off, _), (t_on, u_on)) in enumerate(zip(off, on, strict=True), 1):
        print(f"{i:>4} {u_on.get('prompt_tokens', 0):>7} {t_off:>13.2f} {t_on:>12.2f} "
              f"{u_on.get('cache_n', 0):>10} {t_on / t_off:>6.0%}")  # fmt: skip


if __name__ == "__main__":
    main()
