"""How long a typed decision with long questions holds another tenant's stream: the stream's
longest gap between tokens while one /v1/systemone request reads 255-option questions
(~2,800 tokens of text each), against its gaps before the decision came.

    python bench/decision_stall.py                 # default model, 4 questions
    bash bench/against_rev.sh HEAD~1 bench/decision_stall.py --questions 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx
from stream_gaps import gaps_around

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

STATE = "I was charged twice for my order. Please refund the duplicate payment today."


def question(i: int) -> dict:
    options = {f"option {j} of point {i}": f"the customer means case {j}" for j in range(255)}
    return {"type": "choice", "instructions": f"Which case is point {i}?", "criteria": options}


def measure(url: str, n_questions: int) -> dict:
    questions = {f"q{i}": question(i) for i in range(n_questions)}
    body = {"model": "jev-latest", "state": STATE, "questions": questions}
    answer: dict = {}

    def decide() -> None:
        t0 = time.perf_counter()
        r = httpx.post(url + "/v1/systemone", json=body, timeout=600)
        answer["s"] = time.perf_counter() - t0
        r.raise_for_status()
        answer["usage"] = r.json()["usage"]["input_tokens"]

    before, during = gaps_around(url, decide)
    return {
        "decision_s": answer["s"],
        "usage": answer["usage"],
        "before_median": statistics.median(before),
        "during_median": statistics.median(during) if during else float("nan"),
        "during_max": max(during, default=float("nan")),
        "tokens_during": len(during),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="an already running server")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.url:
        url, proc = args.url, None
    else:
        from support.serverproc import ServerProcess

        proc = ServerProcess(args.model, "--slots", "2", "--ctx", "4096")
        url = proc.wait_ready(900)
    try:
        measure(url, 1)  # warm-up: the first read's shapes
        for i in range(args.rounds):
            m = measure(url, args.questions)
            print(
                f"round {i + 1}: {args.questions} questions ({m['usage']} tokens read) in "
                f"{m['decision_s']:.2f} s; the stream's gap between events: "
                f"{m['before_median'] * 1e3:.0f} ms before, {m['during_median'] * 1e3:.0f} ms "
                f"median and {m['during_max'] * 1e3:.0f} ms longest during "
                f"({m['tokens_during']} events)"
            )
    finally:
        if proc is not None:
            proc.stop()


if __name__ == "__main__":
    main()
