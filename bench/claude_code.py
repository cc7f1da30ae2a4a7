"""Claude Code's real first request, replayed on mashbox and on llama-server (same GGUF):
time to the first token and to the end of a cold session, then an agent's second session
(same system prompt and tools, another question) on the same server, and on mashbox also
after a restart on its --cache-dir.

The body is recorded once by claude_capture.py (Claude Code's `claude -p` against a capture
server; kept under bench/.claude-code/, never committed), then sent as it is to each
server's /v1/messages, streamed, with the model renamed and a small max_tokens. The servers
run one after the other, never both at once.

    .venv/bin/python bench/claude_code.py --llama-server /tmp/llama/build/bin/llama-server
    .venv/bin/python bench/claude_code.py              # mashbox only
    .venv/bin/python bench/claude_code.py --again      # record Claude Code's request anew

A cold ~20k-token prefill on 2 cores takes minutes on either server: --repeats (default 1)
repeats each server's whole run, fresh, and the table shows the medians.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import claude_capture
import httpx
import vs_llama  # also puts tests/ on sys.path for serverproc

from support.serverproc import ServerProcess

SECOND_QUESTION = "In one sentence: what does Python's `with` statement guarantee?"
THIRD_QUESTION = "In one sentence: when does a Python generator run its body?"
TARGET = 2.0  # issue 28: Claude Code's first request answered >= 2x sooner than llama-server
HEADERS = {"anthropic-version": "2023-06-01", "x-api-key": "any"}


def replay_body(recorded: dict, model: str, max_tokens: int, question: str) -> dict:
    """The recorded body with the model renamed, a small max_tokens, and the user's question
    (the recording's own, or another one: a second session) swapped in."""
    body = copy.deepcopy(recorded)
    body.update(model=model, max_tokens=max_tokens, stream=True)
    for message in body["messages"]:
        blocks = message["content"] if isinstance(message["content"], list) else []
        for block in blocks:
            if block.get("type") == "text" and block.get("text") == claude_capture.QUESTION:
                block["text"] = question
                return body
    raise SystemExit(f"the recorded body has no text block {claude_capture.QUESTION!r}")


def send(url: str, body: dict, timeout: float) -> dict:
    """Stream one /v1/messages answer; client-clock seconds to its first content event and
    to its end, its usage (message_start's, updated by message_delta's) and its text."""
    t0 = time.perf_counter()
    first, event, usage, text = None, "", {}, []
    with httpx.Client(base_url=url, timeout=timeout, headers=HEADERS) as http:
        with http.stream("POST", "/v1/messages", json=body) as r:
            if r.status_code != 200:
                raise SystemExit(f"{url}: {r.status_code} {r.read().decode()[:2000]}")
            for line in r.iter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                if not line.startswith("data:"):
                    continue
                data = json.loads(line[5:])
                if event in ("content_block_start", "content_block_delta", "message_delta"):
                    # llama-server sends message_start only with its first token; mashbox at
                    # admission: so the first token is the first content (or the stop).
                    first = first or time.perf_counter() - t0
                if event == "message_start":
                    usage.update(data["message"].get("usage") or {})
                elif event == "message_delta":
                    usage.update(data.get("usage") or {})
                elif event == "content_block_delta":
                    delta = data["delta"]
                    text.append(delta.get("text") or delta.get("partial_json") or "")
    end = time.perf_counter() - t0
    cached = usage.get("cache_read_input_tokens") or 0
    return {"ttft": first, "end": end, "cached": cached, "text": "".join(text),
            "prompt": (usage.get("input_tokens") or 0) + cached}  # fmt: skip


def show(who: str, name: str, answer: dict) -> None:
    print(f"  {who} {name}: first token {answer['ttft']:.2f} s, end {answer['end']:.2f} s, "
          f"prompt {answer['prompt']} tokens ({answer['cached']} cached): "
          f"{answer['text']!r}", flush=True)  # fmt: skip


def sessions(who: str, url: str, args, recorded: dict, model: str) -> dict:
    """The cold first session, then the second (another question) on the same server."""
    out = {}
    for name, question in (("first", claude_capture.QUESTION), ("second", SECOND_QUESTION)):
        out[name] = send(url, replay_body(recorded, model, args.max_tokens, question), args.timeout)
        show(who, name, out[name])
    return out


def count_tokens(url: str, body: dict) -> int:
    r = httpx.post(url + "/v1/messages/count_tokens", json=body, headers=HEADERS, timeout=300)
    r.raise_for_status()
    return r.json()["input_tokens"]


def served_model(url: str) -> dict:
    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]


def mashbox_run(args, recorded: dict) -> dict:
    """One fresh mashbox (empty --cache-dir): two sessions; then a restart on that dir."""
    flags = ["--slots", "1", "--ctx", str(args.ctx), "--threads", str(args.threads)]
    with tempfile.TemporaryDirectory(prefix="claude-code-cache-") as cache_dir:
        flags += ["--cache-dir", cache_dir, *args.server_args.split()]
        proc = ServerProcess(args.model, *flags)
        try:
            url = proc.wait_ready(900)
            card = served_model(url)
            print(f"mashbox at {url} ({' '.join(flags)}); decode {card.get('decode_weights')}")
            body = replay_body(recorded, card["id"], args.max_tokens, claude_capture.QUESTION)
            print(f"  mashbox counts {count_tokens(url, body)} prompt tokens", flush=True)
            out = sessions("mashbox", url, args, recorded, card["id"])
        finally:
            proc.stop()
        files = list(Path(cache_dir).iterdir())
        mib = sum(p.stat().st_size for p in files) / 2**20
        print(f"  cache dir after the first server: {len(files)} files, {mib:.0f} MiB")
        proc = ServerProcess(args.model, *flags)
        try:
            url = proc.wait_ready(900)
            body = replay_body(recorded, card["id"], args.max_tokens, THIRD_QUESTION)
            out["restarted"] = send(url, body, args.timeout)
            show("mashbox", "after restart", out["restarted"])
        finally:
            proc.stop()
    return out


def llama_run(args, recorded: dict, model_path: Path) -> dict:
    """One fresh llama-server (-np 1, the whole context in its one slot): two sessions."""
    port = vs_llama.free_port()
    cmd = [
        str(args.llama_server), "-m", str(model_path), "-c", str(args.ctx), "-np", "1",
        "-t", str(args.threads), "-tb", str(args.threads), "--host", "127.0.0.1",
        "--port", str(port), "--jinja",
    ]  # fmt: skip
    log = Path(str(args.llama_server) + ".claude-code.log")
    proc, url = vs_llama.launch(cmd, port, "/health", log)
    try:
        print(f"llama-server at {url} (log {log}): {' '.join(cmd[1:])}", flush=True)
        return sessions("llama-server", url, args, recorded, model_path.stem)
    finally:
        vs_llama.stop(proc)


def median(runs: list[dict], name: str, key: str) -> float:
    return statistics.median(r[name][key] for r in runs)


def print_table(args, mash: list[dict], base: list[dict]) -> None:
    print(f"\nClaude Code's first request, {args.model}, --ctx {args.ctx}, {args.threads} "
          f"threads, max_tokens {args.max_tokens}; median of {len(mash)} run(s)")  # fmt: skip
    print("| session | llama-server first token, s | mashbox first token, s | ratio | "
          "llama-server end, s | mashbox end, s | cached (llama / mashbox) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name in ("first", "second"):
        m = [median(mash, name, k) for k in ("ttft", "end", "cached")]
        b = [median(base, name, k) for k in ("ttft", "end", "cached")] if base else None
        ratio = f"{b[0] / m[0]:.2f}" if b else "-"
        bs = [f"{b[0]:.2f}", f"{b[1]:.2f}", f"{b[2]:.0f}"] if b else ["-"] * 3
        print(f"| {name} | {bs[0]} | {m[0]:.2f} | {ratio} | {bs[1]} | {m[1]:.2f} | "
              f"{bs[2]} / {m[2]:.0f} |")  # fmt: skip
    r = [median(mash, "restarted", k) for k in ("ttft", "end", "cached")]
    print(f"| mashbox restarted on --cache-dir | - | {r[0]:.2f} | - | - | {r[1]:.2f} | "
          f"- / {r[2]:.0f} |")  # fmt: skip
    if base:
        ratio = median(base, "first", "ttft") / median(mash, "first", "ttft")
        verdict = "pass" if ratio >= TARGET else "fail"
        print(f"target: first request's first token >= {TARGET:.0f}x sooner than llama-server: "
              f"{ratio:.2f}x, {verdict}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="registry id")
    parser.add_argument("--ctx", type=int, default=32768)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1, help="fresh runs of each server")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds a request may take")
    parser.add_argument("--server-args", default="", help="more `mashbox run` flags")
    parser.add_argument("--llama-server", type=Path, help="a llama-server binary: the baseline")
    parser.add_argument("--again", action="store_true", help="record Claude Code's request anew")
    args = parser.parse_args()
    recorded = claude_capture.recorded_body(args.again)
    print(
        f"Claude Code's first request: {len(recorded['tools'])} tools, "
        f"{len(json.dumps(recorded))} characters of JSON ({claude_capture.RECORDED})"
    )
    model_path = vs_llama.model_file(args.model)
    mash, base = [], []
    for _ in range(args.repeats):
        if args.llama_server:
            print(f"load average {os.getloadavg()}", flush=True)
            base.append(llama_run(args, recorded, model_path))
        print(f"load average {os.getloadavg()}", flush=True)
        mash.append(mashbox_run(args, recorded))
    print_table(args, mash, base)


if __name__ == "__main__":
    try:
        main()
    except subprocess.TimeoutExpired as e:
        raise SystemExit(f"timed out: {e}") from e
