"""Typed decisions: 16 questions on a ~1,000-token state in one /v1/systemone request, against
16 single-question requests and against 16 chat prompts with max_tokens 1.

Each method gets its own state (a unique first line), so no method reads another's prompt
cache; within a method the server may reuse what it cached, as it would for a client. The
forward passes each method ran come from the server's `mashbox:forward_passes` counter.

    python bench/decisions.py                    # default model, 4 slots
    python bench/decisions.py --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from mashbox.server import decision_labels, decisions  # noqa: E402

TICKET = (
    "Customer {i} wrote on day {i}: my order number {n} arrived late and the box was damaged. "
    "I was charged twice for it, once on the card ending {c} and once through the app. "
)


def make_state(tag: str, sentences: int = 23) -> str:
    lines = [f"Case {tag}."]
    lines += [TICKET.format(i=i, n=1000 + 37 * i, c=4000 + i) for i in range(sentences)]
    return "".join(lines)


def make_questions() -> dict:
    qs = {}
    for i in range(6):
        qs[f"noul{i}"] = {"type": "noul", "instructions": f"Does message {i} mention a refund?"}
    for i in range(5):
        qs[f"choice{i}"] = {
            "type": "choice",
            "instructions": f"Which team should handle point {i}?",
            "criteria": {"billing": "Payments", "shipping": "Deliveries", "tech": None},
        }
    for i in range(5):
        qs[f"score{i}"] = {
            "type": "score",
            "instructions": f"How upset is the customer about point {i}?",
            "criteria": ["calm", "annoyed", "angry", "furious"],
        }
    return qs


def forwards(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(
        float(v) for v in re.findall(r"^mashbox:forward_passes_total\{.*\} (\S+)$", text, re.M)
    )


async def one_request(http, state: str, questions: dict) -> dict:
    body = {"model": "jev-latest", "state": state, "questions": questions}
    r = await http.post("/v1/systemone", json=body)
    r.raise_for_status()
    return r.json()


async def chat_prompt(http, state: str, question: dict) -> None:
    q = decisions.parse_question(question, ("q",))
    labels = [decision_labels.Label(text, ()) for text in _label_texts(q)]
    messages = [
        {"role": "system", "content": decisions.SYSTEM},
        {"role": "user", "content": state},
        {"role": "user", "content": decisions.question_text(q, labels)},
    ]
    body = {"messages": messages, "max_tokens": 1, "temperature": 0}
    r = await http.post("/v1/chat/completions", json=body)
    r.raise_for_status()


def _label_texts(q) -> list[str]:
    if q.kind == "noul":
        return ["Yes", "No"]
    if q.kind == "score":
        return [str(i) for i in range(len(q.keys))]
    return [chr(ord("A") + i) for i in range(len(q.keys))]


async def timed(url: str, run) -> tuple[float, float]:
    """Seconds and forward passes of one method."""
    before = forwards(url)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        await run(http)
    seconds = time.perf_counter() - t0
    return seconds, forwards(url) - before


async def main_async(url: str, questions: dict) -> None:
    count = httpx.post(
        url + "/v1/messages/count_tokens",
        json={"messages": [{"role": "user", "content": make_state("x")}]},
    ).json()["input_tokens"]
    print(f"state: ~{count} tokens; {len(questions)} questions")
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:  # warm-up
        await one_request(http, make_state("warm"), {"q": questions["noul0"]})

    async def batched(http):
        await one_request(http, make_state("batched"), questions)

    async def separate_sequential(http):
        state = make_state("separate-seq")
        for qid, q in questions.items():
            await one_request(http, state, {qid: q})

    async def separate_concurrent(http):
        state = make_state("separate-conc")
        async with trio.open_nursery() as nursery:
            for qid, q in questions.items():
                nursery.start_soon(one_request, http, state, {qid: q})

    async def chat_sequential(http):
        state = make_state("chat-seq")
        for q in questions.values():
            await chat_prompt(http, state, q)

    async def chat_concurrent(http):
        state = make_state("chat-conc")
        async with trio.open_nursery() as nursery:
            for q in questions.values():
                nursery.start_soon(chat_prompt, http, state, q)

    methods = [
        ("one request, 16 questions", batched),
        ("16 requests, one after another", separate_sequential),
        ("16 requests, all at once", separate_concurrent),
        ("16 chat prompts, one after another", chat_sequential),
        ("16 chat prompts, all at once", chat_concurrent),
    ]
    results = [(name, *await timed(url, run)) for name, run in methods]
    base = results[0][1]
    print(f"{'method':<36} {'seconds':>8} {'forwards':>9} {'vs one request':>15}")
    for name, seconds, passes in results:
        print(f"{name:<36} {seconds:>8.2f} {passes:>9.0f} {seconds / base:>14.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="an already running server")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--server-args", default="", help="more `mashbox run` flags")
    args = parser.parse_args()
    questions = make_questions()
    if args.url:
        trio.run(main_async, args.url, questions)
        return
    from support.serverproc import ServerProcess

    proc = ServerProcess(
        args.model, "--slots", str(args.slots), "--ctx", "2048", *args.server_args.split()
    )
    try:
        trio.run(main_async, proc.wait_ready(900), questions)
    finally:
        proc.stop()


if __name__ == "__main__":
    main()
