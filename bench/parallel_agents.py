"""Sub-agents under one system prompt: time to first token of a request that arrives while
another with the same ~2,000-token system prompt is decoding, beside one whose system prompt
is new (the baseline: a full prefill), in one run.

A coding agent that fans out sends its sub-agents the same system prompt and tools. The
second one's prefix is in the first one's slot, which is busy: mashbox copies that prefix's
KV to the new slot (`Share`) and prefills only what differs.

    python bench/parallel_agents.py                 # default model, 3 rounds
    python bench/parallel_agents.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from agent_turns import QUESTIONS, SYSTEM, TOOLS, ttft  # noqa: E402

from support.serverproc import ServerProcess  # noqa: E402


def agent(system: str, question: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def round_(http: httpx.Client, n: int) -> tuple[float, float, dict, dict]:
    """A long-running first agent; while it decodes, a sibling (same system prompt) and a
    stranger (a system prompt never seen). Their TTFTs and usage."""
    system = SYSTEM + f"\n(run {n})"  # nothing left over from the round before
    running = threading.Event()

    def first_agent():
        body = {"messages": agent(system, QUESTIONS[0]), "tools": TOOLS, "max_tokens": 400,
                "stream": True, "ignore_eos": True}  # same tools: the same prefix  # fmt: skip
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if '"content": "' in line and '"content": ""' not in line:
                    running.set()

    thread = threading.Thread(target=first_agent)
    thread.start()
    running.wait(600)
    sibling, _, sibling_usage = ttft(http, agent(system, QUESTIONS[1]), 4)
    stranger_system = SYSTEM.replace("careful", "patient") + f"\n(stranger {n})"
    stranger, _, stranger_usage = ttft(http, agent(stranger_system, QUESTIONS[1]), 4)
    thread.join()
    return sibling, stranger, sibling_usage, stranger_usage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    proc = ServerProcess(args.model, "--slots", "4", "--ctx", "4096")
    try:
        url = proc.wait_ready(900)
        with httpx.Client(base_url=url, timeout=600) as http:
            ttft(http, agent("Warm up.", "Hi"), 2)
            rows = [round_(http, n) for n in range(args.rounds)]
    finally:
        proc.stop()
    print(f"{'round':>5} {'sibling TTFT s':>15} {'cached':>7} {'stranger TTFT s':>16} "
          f"{'cached':>7} {'prompt tokens':>14} {'stranger/sibling':>17}")  # fmt: skip
    for n, (sibling, stranger, su, xu) in enumerate(rows):
        print(f"{n:>5} {sibling:>15.2f} {su['cache_n']:>7} {stranger:>16.2f} {xu['cache_n']:>7} "
              f"{su['prompt_tokens']:>14} {stranger / sibling:>16.1f}x")  # fmt: skip
    ratio = statistics.median(x / s for s, x, _, _ in rows)
    print(f"median stranger/sibling TTFT: {ratio:.1f}x")


if __name__ == "__main__":
    main()
