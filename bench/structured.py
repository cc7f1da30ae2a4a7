"""What a JSON schema costs: decode tokens/s at N streams with a schema on every row against
the same streams free, side by side, and time to first token with a new schema against a
schema the server has compiled before.

Starts `mashbox run` (the default model unless --model) with --slots N. Each stream asks
for --tokens tokens at temperature 1 (ignore_eos): the constrained ones follow an array of
at least 1,000 small records, so the grammar is live for every token, never done early.
Runs alternate (free, constrained, free, ...) so drift on a shared machine hits both.

    python bench/structured.py                 # default model, 8 streams, 3 rounds
    python bench/structured.py --streams 4 --tokens 128 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support.serverproc import ServerProcess  # noqa: E402

RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
# Never satisfied within the bench's tokens: the mask is computed for every one of them.
PEOPLE = {"type": "array", "items": RECORD, "minItems": 1000}


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "people", "schema": schema}}


async def stream(http: httpx.AsyncClient, url: str, tokens: int, seed: int, extra: dict):
    """(seconds to the first content, seconds from it to the last, tokens)."""
    body = {
        "messages": [{"role": "user", "content": f"List many people as JSON ({seed})."}],
        "max_tokens": tokens, "temperature": 1, "seed": seed, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}, **extra,
    }  # fmt: skip
    t0 = time.perf_counter()
    first = last = None
    usage = 0
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]["completion_tokens"]
            if event["choices"] and event["choices"][0]["delta"].get("content"):
                last = time.perf_counter()
                first = first or last
    return first - t0, last - first, usage


async def decode_round(url: str, streams: int, tokens: int, extra: dict) -> float:
    """Total decode tokens/s of `streams` streams side by side (first token to last)."""
    results = []
    async with httpx.AsyncClient(timeout=600) as http:
        async with trio.open_nursery() as nursery:
            for i in range(streams):

                async def one(i=i):
                    results.append(await stream(http, url, tokens, i, extra))

                nursery.start_soon(one)
    decoding = max(r[1] for r in results)
    return sum(r[2] - 1 for r in results) / decoding


async def first_token(url: str, schema: dict) -> float:
    async with httpx.AsyncClient(timeout=600) as http:
        ttft, _, _ = await stream(http, url, 4, 0, {"response_format": response_format(schema)})
    return ttft


async def main(args) -> None:
    proc = ServerProcess(args.model, "--slots", str(args.streams), "--ctx", "2048")
    try:
        url = proc.wait_ready(900)
        constrained = {"response_format": response_format(PEOPLE)}
        await decode_round(url, args.streams, 16, constrained)  # warm: compile, caches
        free, held = [], []
        for _ in range(args.rounds):
            free.append(await decode_round(url, args.streams, args.tokens, {}))
            held.append(await decode_round(url, args.streams, args.tokens, constrained))
        new, cached = [], []
        for _ in range(args.rounds * 3):
            fresh = {**RECORD, "properties": {**RECORD["properties"], uuid.uuid4().hex: {}}}
            fresh_schema = {"type": "array", "items": fresh, "minItems": 1000}
            new.append(await first_token(url, fresh_schema))
            cached.append(await first_token(url, PEOPLE))
    finally:
        proc.stop()
    f, h = statistics.median(free), statistics.median(held)
    print(f"model {args.model}, {args.streams} streams x {args.tokens} tokens, temperature 1")
    print(f"decode tok/s, all streams: free {f:.1f}  with a schema {h:.1f}  "
          f"ratio {h / f:.3f} ({(1 - h / f) * 100:+.1f}% slower)")  # fmt: skip
    print(f"  rounds: free {[round(x, 1) for x in free]}  schema {[round(x, 1) for x in held]}")
    n, c = statistics.median(new), statistics.median(cached)
    print(f"time to first token: new schema {n * 1000:.0f} ms, cached schema {c * 1000:.0f} ms "
          f"(medians of {len(new)})")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    trio.run(main, parser.parse_args())
