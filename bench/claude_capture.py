"""Record the first request Claude Code sends: its `claude -p` talks to a capture server on
loopback instead of Anthropic's API, which stores every POST /v1/messages body and answers
each with a minimal valid message (events when streamed), so claude finishes at once.

Everything stays under bench/.claude-code/ (gitignored: the bodies are Anthropic's prompt
text): the npm install, a scratch HOME and working directory, requests/NN.json for every
body, and first_request.json, the body with the tools (the session's main request).

    .venv/bin/python bench/claude_capture.py           # record, unless already recorded
    .venv/bin/python bench/claude_capture.py --again   # record anew
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

CLAUDE_DIR = Path(__file__).resolve().parent / ".claude-code"
RECORDED = CLAUDE_DIR / "first_request.json"
PACKAGE = "@anthropic-ai/claude-code"
WRAPPER = CLAUDE_DIR / "node_modules" / "@anthropic-ai" / "claude-code" / "cli-wrapper.cjs"
QUESTION = "In one sentence: what does a Python function decorated with @functools.cache do?"
ANSWER = "It memoizes the function."


def answer_events(model: str) -> list[tuple[str, dict]]:
    """The smallest stream of a one-block text message, as Anthropic sends it."""
    usage = {"input_tokens": 1, "output_tokens": 1}
    message = {
        "id": "msg_capture",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }
    return [
        ("message_start", {"type": "message_start", "message": message}),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        ),  # fmt: skip
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": ANSWER},
            },
        ),  # fmt: skip
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "usage": {"output_tokens": 5},
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
            },
        ),  # fmt: skip
        ("message_stop", {"type": "message_stop"}),
    ]


def answer_message(model: str) -> dict:
    return {"id": "msg_capture", "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": ANSWER}], "stop_reason": "end_turn",
            "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 5}}  # fmt: skip


class CaptureHandler(BaseHTTPRequestHandler):
    """Stores POST bodies in server.bodies; answers /v1/messages as Anthropic would."""

    def log_message(self, *args) -> None:  # claude's traffic is the record, not the log
        pass

    def _json(self, status: int, data: dict) -> None:
        raw = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:
        self.server.paths.append(f"GET {self.path}")
        self._json(404, {"type": "error", "error": {"type": "not_found_error", "message": ""}})

    def do_POST(self) -> None:
        path = self.path.split("?")[0]
        self.server.paths.append(f"POST {self.path}")
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
        if path.endswith("/count_tokens"):
            return self._json(200, {"input_tokens": 1})
        if not path.endswith("/v1/messages"):
            return self._json(404, {"type": "error", "error": {"type": "not_found_error"}})
        self.server.bodies.append(body)
        model = body.get("model", "claude")
        if not body.get("stream"):
            return self._json(200, answer_message(model))
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.end_headers()
        for name, data in answer_events(model):
            self.wfile.write(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())
        self.wfile.flush()
        self.close_connection = True


def ensure_claude() -> None:
    """npm-install Claude Code under bench/.claude-code unless it is there."""
    if WRAPPER.exists():
        return
    if not shutil.which("npm"):
        raise SystemExit("npm is needed to install Claude Code")
    print(f"installing {PACKAGE} into {CLAUDE_DIR}", flush=True)
    CLAUDE_DIR.mkdir(exist_ok=True)
    subprocess.run(["npm", "install", "--prefix", str(CLAUDE_DIR), PACKAGE], check=True)


def claude_env(base_url: str, home: Path) -> dict:
    """A clean environment: only the capture server to talk to, nothing sent elsewhere."""
    keep = {k: os.environ[k] for k in ("PATH", "LANG", "TMPDIR") if k in os.environ}
    return {
        **keep,
        "HOME": str(home),
        "TERM": "dumb",
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": "any",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_ERROR_REPORTING": "1",
    }


def main_request(bodies: list[dict]) -> dict:
    """The session's main request: the one carrying the tools (the most, if several do)."""
    with_tools = [b for b in bodies if b.get("tools")]
    if not with_tools:
        raise SystemExit(f"none of claude's {len(bodies)} requests carried tools")
    return max(with_tools, key=lambda b: len(b["tools"]))


def record(question: str = QUESTION, timeout: float = 300) -> dict:
    """Run `claude -p question` against the capture server; save and return the main body."""
    ensure_claude()
    server = ThreadingHTTPServer(("127.0.0.1", 0), CaptureHandler)
    server.bodies, server.paths = [], []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    home, work = CLAUDE_DIR / "home", CLAUDE_DIR / "work"
    for scratch in (home, work):
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    cmd = ["node", str(WRAPPER), "-p", question]
    try:
        done = subprocess.run(cmd, cwd=work, env=claude_env(url, home), capture_output=True,
                              text=True, timeout=timeout)  # fmt: skip
    finally:
        server.shutdown()
    print(f"claude exited {done.returncode}; it printed {done.stdout.strip()!r}")
    print(f"requests it made: {server.paths}")
    requests = CLAUDE_DIR / "requests"
    shutil.rmtree(requests, ignore_errors=True)
    requests.mkdir()
    for i, body in enumerate(server.bodies):
        (requests / f"{i:02}.json").write_text(json.dumps(body, indent=1))
    body = main_request(server.bodies)
    RECORDED.write_text(json.dumps(body, indent=1))
    return body


def recorded_body(again: bool = False) -> dict:
    """The recorded main request, recorded now if it is not yet (or if `again`)."""
    if again or not RECORDED.exists():
        return record()
    return json.loads(RECORDED.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--again", action="store_true", help="record anew")
    args = parser.parse_args()
    body = recorded_body(args.again)
    system = body.get("system", "")
    chars = len(system) if isinstance(system, str) else sum(len(b["text"]) for b in system)
    print(f"{RECORDED}: {len(body['tools'])} tools, {len(json.dumps(body))} characters of JSON, "
          f"{chars} of system prompt, model {body.get('model')}")  # fmt: skip


if __name__ == "__main__":
    main()
