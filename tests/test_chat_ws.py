"""The chat WebSocket with a real WebSocket client: streamed and not, two requests at once,
cancellation on close, authentication at the handshake, foreign Origin refused."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from support.serverproc import ServerProcess

REQUEST = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5}


def ws_url(url: str) -> str:
    return url.replace("http://", "ws://") + "/v1/chat/completions/ws"


def test_whole_and_streamed_replies(server):
    with connect(ws_url(server.url)) as ws:
        ws.send(json.dumps(REQUEST))
        whole = json.loads(ws.recv(timeout=60))
        assert whole["object"] == "chat.completion"
        ws.send(json.dumps({**REQUEST, "stream": True}))
        frames = []
        while (frame := ws.recv(timeout=60)) != "[DONE]":
            frames.append(json.loads(frame))
        assert all(f["object"] == "chat.completion.chunk" for f in frames)
        text = "".join(
            f["choices"][0]["delta"].get("content") or "" for f in frames if f["choices"]
        )
        assert text == whole["choices"][0]["message"]["content"]
        ws.send("{not json")
        assert "error" in json.loads(ws.recv(timeout=10))
        ws.send(json.dumps({"messages": []}))
        error = json.loads(ws.recv(timeout=10))
        assert error["status"] == 400 and "messages" in error["error"]["message"]


def test_two_requests_in_flight(server):
    with connect(ws_url(server.url)) as ws:
        ws.send(json.dumps({**REQUEST, "stream": True, "max_tokens": 20}))
        ws.send(json.dumps(REQUEST))
        ids, done = set(), 0
        while done < 2:
            frame = ws.recv(timeout=60)
            if frame == "[DONE]":
                done += 1
                continue
            body = json.loads(frame)
            ids.add(body["id"])
            if body["object"] == "chat.completion":
                done += 1
        assert len(ids) == 2


def test_closing_the_socket_cancels_its_requests(tiny_llama):
    proc = ServerProcess(str(tiny_llama), "--ctx", "2048", "--slots", "1",
                         env={"MASHBOX_FAULTS": "slow=0.02"})  # fmt: skip
    try:
        url = proc.wait_ready(120)
        with connect(ws_url(url)) as ws:
            long = {**REQUEST, "stream": True, "max_tokens": 1500, "ignore_eos": True}
            ws.send(json.dumps(long))
            ws.recv(timeout=30)
            assert httpx.get(url + "/health").json()["live_rows"] == 1
        deadline = time.monotonic() + 2
        while httpx.get(url + "/health").json()["live_rows"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert httpx.get(url + "/health").json()["live_rows"] == 0
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def keyed_server(tiny_llama):
    proc = ServerProcess(str(tiny_llama), "--ctx", "256", env={"MASHBOX_API_KEY": "ws-key"})
    try:
        proc.wait_ready(120)
        yield proc
    finally:
        proc.stop()


def test_handshake_authentication(keyed_server):
    url = ws_url(keyed_server.url)
    with pytest.raises(InvalidStatus) as refused, connect(url):
        pass
    assert refused.value.response.status_code == 401
    with connect(url + "?token=ws-key") as ws:
        ws.send(json.dumps(REQUEST))
        assert json.loads(ws.recv(timeout=60))["object"] == "chat.completion"
    with connect(url, subprotocols=["bearer", "ws-key"]) as ws:
        assert ws.subprotocol == "bearer"
        ws.send(json.dumps(REQUEST))
        assert json.loads(ws.recv(timeout=60))["object"] == "chat.completion"
    # ?token= is for the WebSocket handshake only, never for ordinary HTTP requests.
    assert httpx.get(keyed_server.url + "/v1/models?token=ws-key").status_code == 401


def test_foreign_origin_is_refused(server):
    with (
        pytest.raises(InvalidStatus) as refused,
        connect(ws_url(server.url), origin="http://evil.example"),
    ):
        pass
    assert refused.value.response.status_code == 403


def test_plain_http_on_the_websocket_route_is_426(server):
    r = httpx.get(server.url + "/v1/chat/completions/ws")
    assert r.status_code == 426 and r.headers["Upgrade"] == "websocket"


def test_a_bad_frame_gets_an_error_frame_while_its_sibling_finishes(server):
    """A frame nested past the recursion limit, one with a lone surrogate, one that is not an
    object: each an error frame of its own; the stream sent before them runs to [DONE]."""
    bad = [
        "[" * 100_000 + "]" * 100_000,
        '{"messages": [{"role": "user", "content": "\\ud800"}]}',
        "[1]",
    ]
    with connect(ws_url(server.url), max_size=None) as ws:
        ws.send(json.dumps({**REQUEST, "stream": True, "max_tokens": 30}))
        for frame in bad:
            ws.send(frame)
        errors, done = [], False
        while not done or len(errors) < len(bad):
            frame = ws.recv(timeout=60)
            if frame == "[DONE]":
                done = True
            elif "error" in (body := json.loads(frame)):
                errors.append(body)
        assert sorted(e["status"] for e in errors) == [400, 400, 400], errors


def test_requests_in_flight_on_one_socket_are_bounded(server):
    with connect(ws_url(server.url)) as ws:
        for _ in range(9):
            ws.send(json.dumps({**REQUEST, "stream": True, "max_tokens": 200}))
        refused = None
        while refused is None:
            body = json.loads(frame) if (frame := ws.recv(timeout=60)) != "[DONE]" else {}
            if "error" in body:
                refused = body
        assert refused["status"] == 429 and "8 requests" in refused["error"]["message"]


def peak_rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM")))


def test_a_compressed_frame_is_never_inflated_past_the_cap(server):
    """256 MiB of spaces deflate to ~256 KB on the wire: the server stops inflating at its
    16 MiB cap and closes the socket, instead of holding all of it (it grew by ~360 MiB
    before), and goes on serving."""
    before = peak_rss_kib(server.proc.pid)
    with connect(ws_url(server.url), max_size=None) as ws:
        ws.send(" " * (256 * 2**20))
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=30)
    assert peak_rss_kib(server.proc.pid) - before < 100 * 1024
    with connect(ws_url(server.url)) as ws:
        ws.send(json.dumps(REQUEST))
        assert json.loads(ws.recv(timeout=60))["object"] == "chat.completion"


@pytest.fixture(scope="module")
def two_tenant_server(tiny_llama, tmp_path_factory):
    keys = tmp_path_factory.mktemp("ws-keys") / "keys"
    keys.write_text("ws-a tenant-a\nws-b tenant-b\n")
    proc = ServerProcess(str(tiny_llama), "--ctx", "256", "--api-key-file", str(keys))
    try:
        proc.wait_ready(120)
        yield proc
    finally:
        proc.stop()


def test_one_tenant_holds_a_bounded_number_of_sockets(two_tenant_server):
    """Each open socket holds a descriptor and its tasks, idle or not: past 32 a tenant's
    handshake is a 429, another tenant's is not, and closing one makes room again."""
    url = ws_url(two_tenant_server.url)
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(connect(url + "?token=ws-a")) for _ in range(32)]
        with pytest.raises(InvalidStatus) as refused, connect(url + "?token=ws-a"):
            pass
        assert refused.value.response.status_code == 429
        assert b"32 of your WebSockets are open" in refused.value.response.body
        with connect(url + "?token=ws-b") as other:
            other.send(json.dumps(REQUEST))
            assert json.loads(other.recv(timeout=60))["object"] == "chat.completion"
        sockets.pop().close()
        deadline = time.monotonic() + 10
        while True:  # the server notices the close a moment later
            try:
                with connect(url + "?token=ws-a") as again:
                    again.send(json.dumps(REQUEST))
                    assert json.loads(again.recv(timeout=60))["object"] == "chat.completion"
                break
            except InvalidStatus:
                assert time.monotonic() < deadline
                time.sleep(0.05)
