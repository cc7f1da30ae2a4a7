"""Clients that send their request slowly, or stop: a body read to the end however long it
takes while bytes keep coming, a body that stops cut at the stall timeout with a 408 in the
route's shape, and a flood of stalled bodies leaving the server its descriptors."""

from __future__ import annotations

import json
import resource
import socket
import time

import httpx
import pytest

from support import rawhttp
from support.serverproc import ServerProcess, serving

STALL_S = 2.0
CHAT_BODY = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def quick_stall(tiny_llama):
    with serving(str(tiny_llama), "--ctx", "256", "--stall-timeout", str(STALL_S)) as proc:
        yield proc.url


def send_head(url: str, path: str, length: int, extra: str = "") -> socket.socket:
    sock = rawhttp.connect(url)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n{extra}\r\n"
    )
    sock.sendall(head.encode())
    return sock


def status_and_body(reply: bytes) -> tuple[int, dict]:
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


@pytest.mark.parametrize(
    ("path", "error_of"),
    [
        ("/v1/chat/completions", lambda body: body["error"]["message"]),
        ("/v1/messages", lambda body: body["error"]["type"] + " " + body["error"]["message"]),
    ],
)
def test_a_body_that_stops_is_a_408_at_the_stall_timeout(quick_stall, path, error_of):
    sock = send_head(quick_stall, path, 1000, "anthropic-version: 2023-06-01\r\n")
    sock.sendall(b'{"messages": [')
    t0 = time.monotonic()
    reply, closed = rawhttp.read_to_eof(sock, timeout=STALL_S * 5)
    waited = time.monotonic() - t0
    status, body = status_and_body(reply)
    assert status == 408 and closed, reply
    assert "the body stalled: no bytes came for 2 s" in error_of(body)
    assert STALL_S * 0.9 <= waited < STALL_S * 3, waited
    if path == "/v1/messages":
        assert body["error"]["type"] == "timeout_error"


def test_a_body_that_trickles_for_longer_than_the_stall_timeout_is_read_whole(quick_stall):
    """Bytes every half second for ~3 stall timeouts: slow is not stalled (a big agent
    prompt over a thin tunnel)."""
    data = json.dumps(CHAT_BODY).encode()
    sock = send_head(quick_stall, "/v1/chat/completions", len(data))
    pieces = [data[i : i + 5] for i in range(0, len(data), 5)]
    step = 3 * STALL_S / len(pieces)
    for piece in pieces:
        sock.sendall(piece)
        time.sleep(step)
    status, body = status_and_body(rawhttp.read_until(sock, b'"usage"'))
    assert status == 200 and body["object"] == "chat.completion"


def test_stalled_bodies_past_the_soft_descriptor_limit_leave_room_for_others(tiny_llama):
    """Started under a soft limit of 256 open files (a desktop's is 1024), the server raises
    it to the hard limit: 300 connections holding half a body each do not keep a normal
    request out. Before, accept failed with EMFILE and every client waited."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1024:
        pytest.skip(f"this machine's hard limit on open files is {hard}: nothing to raise to")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # the server inherits it
    try:
        proc = ServerProcess(str(tiny_llama), "--ctx", "256")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    held = []
    try:
        url = proc.wait_ready(120)
        for _ in range(300):
            held.append(send_head(url, "/v1/chat/completions", 1000))
            held[-1].sendall(b"{")
        r = httpx.post(url + "/v1/chat/completions", json=CHAT_BODY, timeout=20)
        assert r.status_code == 200, r.text
        assert any("open files: up to" in line and "was 256" in line for line in proc.lines)
    finally:
        for sock in held:
            sock.close()
        proc.stop()
