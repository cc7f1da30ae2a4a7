"""Drain on SIGTERM (`--drain-timeout`): a replica behind a router stops taking new requests
at once, lets the streams it took finish, then exits 0, against a real `mashbox run`; and
after it exits, no descriptor of its is closed again under the program around it."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import httpx

from support import rawhttp
from support.serverproc import ServerProcess

SUPPORT = Path(__file__).resolve().parent / "support"
CHAT = "/v1/chat/completions"
KEY = "drain-test-key"


def chat_body(**extra) -> dict:
    return {"messages": [{"role": "user", "content": "Tell me a story."}], **extra}


def start(model, *args: str, tmp_path) -> ServerProcess:
    """Two slots, 20 ms engine steps, a key (so /health shows every field to its holder)."""
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{KEY} team\n")
    proc = ServerProcess(
        str(model), "--ctx", "256", "--slots", "2", "--threads", "1",
        "--api-key-file", str(keys), *args,
        env={"MASHBOX_FAULTS": "slow=0.02"},
    )  # fmt: skip
    proc.wait_ready(120)
    return proc


def stream_chunks(data: bytes) -> list[dict]:
    """The JSON events of a raw chunked SSE answer (chunk-size lines are no `data:` lines)."""
    events = []
    for line in data.split(b"\n"):
        line = line.strip()
        if line.startswith(b"data: {"):
            events.append(json.loads(line[len(b"data: ") :]))
    return events


def test_sigterm_drains_running_streams_refuses_new_work_and_exits_0(tiny_llama, tmp_path):
    proc = start(tiny_llama, "--drain-timeout", "20", tmp_path=tmp_path)
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        sock = rawhttp.connect(proc.url)
        body = chat_body(max_tokens=120, ignore_eos=True, stream=True)
        _post(sock, CHAT, body, auth)
        head = rawhttp.read_until(sock, b'"content": "')
        t0 = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)

        # /health says so at once, with a status a router reads as "send nothing here".
        deadline = time.monotonic() + 2
        while (h := httpx.get(proc.url + "/health", headers=auth, timeout=5)).status_code == 200:
            assert time.monotonic() < deadline, "health still 200 two seconds after SIGTERM"
            time.sleep(0.01)
        assert h.status_code == 503
        assert h.json()["status"] == "draining"
        assert h.json()["live_rows"] == 1  # the stream still runs
        assert httpx.head(proc.url + "/health", timeout=5).status_code == 503
        assert httpx.get(proc.url + "/health", timeout=5).json() == {"status": "draining"}

        # New work gets the route's "unavailable" error, with Retry-After.
        r = httpx.post(proc.url + CHAT, json=chat_body(max_tokens=1), headers=auth, timeout=10)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "unavailable"
        assert r.json()["error"]["code"] == "draining"
        assert int(r.headers["Retry-After"]) >= 1
        m = httpx.post(
            proc.url + "/v1/messages", json=chat_body(max_tokens=1), headers=auth, timeout=10
        )
        # 503, not the 529 of a loading server: a router retries a 503 on another replica.
        assert m.status_code == 503
        assert m.json()["type"] == "error" and m.json()["error"]["type"] == "api_error"
        assert int(m.headers["Retry-After"]) >= 1 and m.headers["x-should-retry"] == "true"
        s = httpx.post(proc.url + "/v1/systemone", json={}, headers=auth, timeout=10)
        assert s.status_code == 503 and s.json()["error"]["code"] == "backend_unreachable"

        # The stream taken before SIGTERM runs to its end, whole.
        data, closed = rawhttp.read_to_eof(sock, timeout=30)
        sock.close()
        assert closed
        events = stream_chunks(head + data)
        text = "".join(
            e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices")
        )
        finish = [e["choices"][0]["finish_reason"] for e in events if e.get("choices")]
        assert b"data: [DONE]" in data
        assert b"shutting down" not in data
        assert finish[-1] == "length"
        assert len(text) > 0
        assert proc.wait_exit(30) == 0
        assert time.monotonic() - t0 < 20  # it left as soon as the stream ended
        assert any("draining" in line for line in proc.lines)
    finally:
        proc.stop()


def test_a_stream_past_the_grace_period_ends_with_an_error_and_the_server_exits(
    tiny_llama, tmp_path
):
    proc = start(tiny_llama, "--drain-timeout", "1", tmp_path=tmp_path)
    try:
        sock = rawhttp.connect(proc.url)
        body = chat_body(max_tokens=200, ignore_eos=True, stream=True)  # ~4 s of steps
        _post(sock, CHAT, body, {"Authorization": f"Bearer {KEY}"})
        rawhttp.read_until(sock, b'"content": "')
        t0 = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)
        data, closed = rawhttp.read_to_eof(sock, timeout=10)
        sock.close()
        assert closed
        assert b"shutting down" in data
        assert proc.wait_exit(10) == 0
        assert 1 <= time.monotonic() - t0 < 4
    finally:
        proc.stop()


def test_a_second_signal_ends_the_drain_at_once(tiny_llama, tmp_path):
    proc = start(tiny_llama, "--drain-timeout", "30", tmp_path=tmp_path)
    try:
        sock = rawhttp.connect(proc.url)
        body = chat_body(max_tokens=200, ignore_eos=True, stream=True)
        _post(sock, CHAT, body, {"Authorization": f"Bearer {KEY}"})
        rawhttp.read_until(sock, b'"content": "')
        proc.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        t0 = time.monotonic()
        proc.proc.send_signal(signal.SIGINT)
        data, closed = rawhttp.read_to_eof(sock, timeout=10)
        sock.close()
        assert closed and b"shutting down" in data
        assert proc.wait_exit(10) == 0
        assert time.monotonic() - t0 < 3
    finally:
        proc.stop()


def test_a_file_opened_after_the_server_exits_keeps_its_descriptor(tiny_llama):
    """Hypercorn owns the listening socket's descriptor. mashbox's own socket object kept it
    too, and closed it again when collected: by then the number of a file opened at exit,
    which lost its writes (`python -m cProfile` wrote an empty profile)."""
    proc = ServerProcess(
        str(tiny_llama), "--ctx", "64", "--threads", "1", launcher=SUPPORT / "exit_writer.py"
    )
    try:
        proc.wait_ready(120)
        proc.proc.send_signal(signal.SIGINT)
        assert proc.wait_exit(30) == 0
    finally:
        proc.stop()
    assert "exit writer: the write landed" in proc.lines, proc.output()


def _post(sock, path: str, body: dict, headers: dict) -> None:
    """rawhttp.post_json with extra headers (an API key)."""
    data = json.dumps(body).encode()
    lines = [
        f"POST {path} HTTP/1.1",
        "Host: 127.0.0.1",
        "Content-Type: application/json",
        f"Content-Length: {len(data)}",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + data)
