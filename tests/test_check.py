"""`mashbox check URL`: every case holds against a real mashbox (restarted for real), and a
stub that breaks one case on purpose is reported for exactly that case."""

from __future__ import annotations

import json
import random
import re
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from mashbox.check import shapes, sse, streams
from mashbox.check.table import around_difference
from mashbox.cli import main
from support.serverproc import ServerProcess, wait_for

ROW = re.compile(r"^  (?P<name>\S.*?)\s{2,}(?P<status>held|FAILED|skipped)\b", re.MULTILINE)
SAMPLING = ["alone", "beside 7 others", "in another slot", "from a cached prefix"]
CASES = [*SAMPLING, "after a restart", "chat completions", "completions", "responses", "messages"]


def statuses(table: str) -> dict[str, str]:
    found = {m["name"]: m["status"] for m in ROW.finditer(table)}
    assert list(found) == CASES, table
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- against a real mashbox ----------------------------------------------------------------


class Supervised:
    """`mashbox run` on a fixed port, started again whenever it exits (as systemd's
    Restart=always would): a --restart-cmd that stops it restarts the server for real."""

    def __init__(self, model: Path, port: int, pidfile: Path):
        self.args = (str(model), "--port", str(port), "--ctx", "1024", "--slots", "4")
        self.url = f"http://127.0.0.1:{port}"
        self.pidfile = pidfile
        self.starts = 0
        self.closing = False
        self.current: ServerProcess | None = None
        self.thread = threading.Thread(target=self._keep_running, daemon=True)
        self.thread.start()

    def _keep_running(self) -> None:
        while not self.closing:
            self.current = ServerProcess(*self.args, "--threads", "1")
            self.pidfile.write_text(str(self.current.proc.pid))
            self.starts += 1
            self.current.proc.wait()
            self.current.stop()

    def health(self) -> dict | None:
        try:
            r = httpx.get(self.url + "/health", timeout=5)
        except httpx.TransportError:
            return None
        return r.json() if r.status_code == 200 else None

    def close(self) -> None:
        self.closing = True
        if self.current is not None:
            self.current.stop()
        self.thread.join(30)


def test_every_case_holds_against_mashbox_restarted_for_real(tiny_llama, tmp_path):
    pidfile = tmp_path / "server.pid"
    server = Supervised(tiny_llama, free_port(), pidfile)
    try:
        first = wait_for(server.health, 60)
        # Stops the server and waits until it is gone; the supervisor starts it again.
        restart = (
            f"pid=$(cat {pidfile}); kill -INT $pid; "
            "while kill -0 $pid 2>/dev/null; do sleep 0.05; done"
        )
        # `mashbox check` stays light: neither torch nor the server is imported.
        script = (
            "import sys; from mashbox.cli import main; code = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules and 'mashbox.server' not in sys.modules; "
            "sys.exit(code)"
        )
        args = ["check", server.url, "--restart-cmd", restart, "--timeout", "60"]
        result = subprocess.run(
            [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert set(statuses(result.stdout).values()) == {"held"}, result.stdout
        assert "9 held, 0 failed, 0 skipped" in result.stdout
        assert server.starts == 2
        assert server.health()["worker_pid"] != first["worker_pid"]
    finally:
        server.close()


# -- against a stub that breaks one case on purpose ------------------------------------------

CROWD_WAIT_S = 0.3
WORDS = "sea salt lamp gull tide rope bell fog oar keel mast wave dune reef buoy cove".split()


def head(kind: str) -> dict:
    return {"id": "chatcmpl-stub", "object": kind, "created": 0, "model": "stub"}


class StubHandler(BaseHTTPRequestHandler):
    """Chat completions only (whole and streamed), answered with seeded random words; the
    server's `breaks` says which case it breaks."""

    protocol_version = "HTTP/1.0"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send_json({"status": "ok"}, 503 if self.server.restarting() else 200)
        elif self.path == "/v1/models":
            card = {"id": "stub", "object": "model"}
            if self.server.breaks == "crowd":  # and says so, as mashbox on torch's float ops
                card["batch_invariant"] = False
            self._send_json({"object": "list", "data": [card]})
        else:
            self._send_json({"error": {"message": "not found"}}, 404)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/chat/completions":
            return self._send_json({"error": {"message": "not found"}}, 404)
        if self.server.restarting():
            return self._send_json({"error": {"message": "restarting"}}, 503)
        words = self.server.words(body)
        if body.get("stream"):
            return self._stream(words)
        text = " ".join(words)
        if self.server.breaks == "crowd":
            text += self.server.crowd_mark()
        usage = {
            "prompt_tokens": 9,
            "completion_tokens": len(words),
            "total_tokens": 9 + len(words),
        }
        choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        choice["finish_reason"] = "length"
        self._send_json({**head("chat.completion"), "choices": [choice], "usage": usage})

    def _stream(self, words: list[str]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        deltas = [{"role": "assistant", "content": ""}] + [{"content": f" {w}"} for w in words]
        chunks = [(delta, None) for delta in deltas] + [({}, "length")]
        try:
            for delta, finish in chunks:
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
                chunk = {**head("chat.completion.chunk"), "choices": [choice]}
                self.wfile.write(b"data: " + json.dumps(chunk).encode())
                self.wfile.write(b"\n\n")
                self.wfile.flush()
                time.sleep(0.002)
            if self.server.breaks != "no [DONE]":
                self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the check let go of the stream that held a slot

    def _send_json(self, body: dict, status: int = 200) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class Stub(ThreadingHTTPServer):
    """breaks: "crowd" (a whole answer given while others are in flight differs), "restart"
    (answers differ after --restart-cmd touches `restart_flag`) or "no [DONE]" (streams end
    without it)."""

    daemon_threads = True
    # socketserver's backlog of 5 drops some of eight connections made at once, and their
    # SYN is sent again a second later: the seeded one could then arrive after the others.
    request_queue_size = 64

    def __init__(self, breaks: str, restart_flag: Path):
        super().__init__(("127.0.0.1", 0), StubHandler)
        self.breaks = breaks
        self.restart_flag = restart_flag
        self.generation = 0
        self.down_until = 0.0
        self.in_flight = 0
        self.arrivals = 0
        self.lock = threading.Condition()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def words(self, body: dict) -> list[str]:
        key = [body.get("seed"), body["messages"]]
        if self.breaks == "restart":
            key.append(self.generation)
        rng = random.Random(json.dumps(key))
        return [rng.choice(WORDS) for _ in range(min(body.get("max_tokens", 16), 64))]

    def crowd_mark(self) -> str:
        """The mark " (crowded)" when another whole answer is in flight as this one is made.
        An answer waits up to CROWD_WAIT_S for company, and stops waiting once it has some."""
        with self.lock:
            self.in_flight += 1
            self.arrivals += 1
            mine = self.arrivals
            self.lock.notify_all()
            crowded = self.in_flight > 1 or self.lock.wait_for(
                lambda: self.arrivals != mine, timeout=CROWD_WAIT_S
            )
            self.in_flight -= 1
        return " (crowded)" if crowded else ""

    def restarting(self) -> bool:
        """A restart (the flag file) takes the stub down for half a second, then it answers
        as its next generation."""
        with self.lock:
            if self.restart_flag.exists():
                self.restart_flag.unlink()
                self.generation += 1
                self.down_until = time.monotonic() + 0.5
            return time.monotonic() < self.down_until


@pytest.fixture
def stub(request, tmp_path):
    server = Stub(request.param, tmp_path / "restart")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(5)


@pytest.mark.parametrize(
    ("stub", "broken"),
    [
        ("crowd", "beside 7 others"),
        ("restart", "after a restart"),
        ("no [DONE]", "chat completions"),
    ],
    indirect=["stub"],
)
def test_a_stub_that_breaks_one_case_is_reported_for_exactly_that_case(stub, broken, capsys):
    code = main(["check", stub.url, "--restart-cmd", f"touch {stub.restart_flag}"])
    table = capsys.readouterr().out
    assert code == 1, table
    found = statuses(table)
    assert [name for name, status in found.items() if status == "FAILED"] == [broken], table
    not_served = ["completions", "responses", "messages"]
    assert [name for name, status in found.items() if status == "skipped"] == not_served, table
    assert table.count("not served (404)") == 3
    assert "5 held, 1 failed, 3 skipped" in table
    if broken == "beside 7 others":
        reference, this_case = re.search(r"reference: (.*)\n\s+this case: (.*)", table).groups()
        assert "(crowded)" in this_case and "(crowded)" not in reference
        caveat = "the server says batch_invariant: false"
        assert re.search(rf"alone\s+held\s+{caveat}", table), table
        assert re.search(rf"beside 7 others\s+FAILED\s+the text differs.*; {caveat}", table)
    if broken == "chat completions":
        assert "stream: the stream does not end with data: [DONE]" in table


def test_an_unreachable_server_exits_1(capsys):
    assert main(["check", f"http://127.0.0.1:{free_port()}", "--timeout", "5"]) == 1
    assert "cannot list" in capsys.readouterr().err


# -- the validators and the table, on hand-made answers --------------------------------------


def plain(*chunks) -> list[sse.Event]:
    return [sse.Event(None, json.dumps(chunk)) for chunk in chunks]


def named(*payloads) -> list[sse.Event]:
    """Events named as their type, as Responses and Messages send them."""
    return [sse.Event(payload["type"], json.dumps(payload)) for payload in payloads]


def test_sse_framing_problems():
    found, problems = sse.parse("data: 1\n\nevent: x\ndata: 2\n\n")
    assert [e.data for e in found] == ["1", "2"] and found[1].name == "x" and not problems
    assert sse.parse("data: 1\r\n\r\n: comment\r\ndata:2\r\n\r\n")[0][1].data == "2"
    assert sse.parse("data: 1\n\ndata: 2\n")[1] == [
        "the stream ended inside an event (no blank line after its last one)"
    ]
    assert sse.parse("data: 1\nhello\n\n")[1] == ["not an SSE field: 'hello'"]


def test_shape_problems():
    shape = {"id": str, "n?": int, "kind": "a", "items": [{"x": frozenset({1, 2})}]}
    assert shapes.problems({"id": "i", "kind": "a", "items": [{"x": 1}]}, shape) == []
    assert shapes.problems({"id": 3, "n": True, "kind": "b", "items": [{"x": 5}, {}]}, shape) == [
        "id: an integer, not a string",
        "n: a boolean, not an integer",
        "kind: 'b', not 'a'",
        "items[0].x: 5, not 1, 2",
        "items[1].x: missing",
    ]


def chat_chunk(delta, finish=None, id="c"):
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return {"id": id, "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [choice]}  # fmt: skip


def test_chat_stream_order():
    good = plain(chat_chunk({"role": "assistant"}), chat_chunk({"content": "hi"}))
    good += [*plain(chat_chunk({}, "stop")), sse.Event(None, "[DONE]")]
    assert streams.chat_stream(good) == []
    bad = plain(chat_chunk({"content": "hi"}, "stop"), chat_chunk({"role": "assistant"}, id="d"))
    assert streams.chat_stream(bad) == [
        "the stream does not end with data: [DONE]",
        "the chunks carry 2 different ids",
        "the role is in chunks [2], not in the first alone",
        "the finish reason is in chunks [1], not in the last (2)",
    ]


def test_responses_stream_order():
    response = {"id": "r", "object": "response", "created_at": 0, "status": "in_progress",
                "model": "m", "output": [], "usage": None}  # fmt: skip
    item = {"type": "message", "id": "i"}
    part = {"item_id": "i", "output_index": 0, "content_index": 0}
    text_part = {**part, "part": {"type": "output_text"}}
    good = [
        {"type": "response.created", "response": response},
        {"type": "response.in_progress", "response": response},
        {"type": "response.output_item.added", "output_index": 0, "item": item},
        {"type": "response.content_part.added", **text_part},
        {"type": "response.output_text.delta", **part, "delta": "hi"},
        {"type": "response.content_part.done", **text_part},
        {"type": "response.output_item.done", "output_index": 0, "item": item},
        {"type": "response.completed", "response": {**response, "status": "completed"}},
    ]
    assert streams.responses_stream(named(*numbered(good, 1))) == []
    del good[3]  # no content part opened
    assert streams.responses_stream(named(*numbered(good, 0))) == [
        "sequence_number runs 0, 1, 2, 3, 4, 5, …, not 1..7",
        "event 4 (response.output_text.delta): part (0, 0) is not open",
        "event 5 (response.content_part.done): part (0, 0) is not open",
    ]


def numbered(events: list[dict], first: int) -> list[dict]:
    return [{**e, "sequence_number": n} for n, e in enumerate(events, first)]


def test_messages_stream_order():
    message = {"id": "m", "type": "message", "role": "assistant", "model": "m", "content": [],
               "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": 1, "output_tokens": 0}}  # fmt: skip
    start = {"type": "message_start", "message": message}
    ping = {"type": "ping"}
    block = {"type": "content_block_start", "index": 0, "content_block": {"type": "text"}}
    delta = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta"}}
    stop = {"type": "content_block_stop", "index": 0}
    ending = {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
              "usage": {"output_tokens": 1}}  # fmt: skip
    last = {"type": "message_stop"}
    assert streams.messages_stream(named(start, ping, block, delta, ping, stop, ending, last)) == []
    second, stop_second = {**block, "index": 1}, {**stop, "index": 1}
    assert streams.messages_stream(named(start, second, stop_second, last, ending)) == [
        "it ends with ['message_stop', 'message_delta'], not message_delta, message_stop",
        "block 1 starts where block 0 should",
    ]
    assert streams.messages_stream(named(start, block, delta, ending, last)) == [
        "message_delta while block 0 is open"
    ]


def test_differing_texts_are_cut_around_their_first_difference():
    a, b = "x" * 100 + "abc" + "y" * 100, "x" * 100 + "abd" + "y" * 100
    shown_a, shown_b = around_difference(a, b, width=30)
    assert shown_a == "…'xxxxxxxxabcyyyyyyyyyyyyyyyyyyy'…"
    assert shown_b == "…'xxxxxxxxabdyyyyyyyyyyyyyyyyyyy'…"
    assert around_difference("same", "same but longer") == ("'same'", "'same but longer'")
