"""Malformed HTTP on raw sockets: bad request lines, lying Content-Length, slowloris headers.
The server must keep answering everyone else, during and after."""

from __future__ import annotations

import random
import socket
import time
from urllib.parse import urlsplit

import httpx

from conftest import AUTH, EXAMPLES

GARBAGE = [
    b"\r\n\r\n",
    b"GET\r\n\r\n",
    b"GET / HTTP/9.9\r\n\r\n",
    b"BREW /coffee HTCPCP/1.0\r\n\r\n",
    b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-Long: " + b"b" * 70000 + b"\r\n\r\n",
    b"GET / HTTP/1.1\r\n" + b"".join(b"H%d: v\r\n" % i for i in range(2000)) + b"\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
    b"Content-Type: application/json\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n",
    b"\x00\x01\x02\x03\xff\xfe GET / HTTP/1.1\r\n\r\n",
    b"GET /\x00 HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET / HTTP/1.1\nHost: x\n\n",
]


def _connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
    return sock


def _healthy(url: str) -> bool:
    t0 = time.monotonic()
    ok = httpx.get(url + "/health", timeout=5).status_code == 200
    return ok and time.monotonic() - t0 < 2


def _random_request(rng: random.Random) -> bytes:
    pieces = [
        rng.choice([b"GET", b"POST", b"HEAD", b"PUT", b"", b"G\x00T", b"get"]),
        b" ",
        rng.choice([b"/", b"/v1/models", b"/v1/chat/completions", b"*", b"http://x/", b"//"]),
        rng.choice([b" HTTP/1.1", b" HTTP/1.0", b"", b" HTTP/2", b" HTTP/1.1 extra"]),
        b"\r\n",
    ]
    for _ in range(rng.randrange(5)):
        pieces.append(rng.choice([b"Host: x", b"Content-Length: 3", b"Connection: close",
                                  b": novalue", b"Bad Header", b"Content-Type: application/json",
                                  b"Transfer-Encoding: gzip, chunked"]) + b"\r\n")  # fmt: skip
    noise = bytes(rng.randrange(256) for _ in range(20))
    pieces.append(rng.choice([b"\r\n", b"", b"\r\n{}", b"\r\n" + noise]))
    return b"".join(pieces)


def test_garbage_requests(fuzz_server):
    url = fuzz_server.url
    rng = random.Random(1130)
    payloads = GARBAGE + [_random_request(rng) for _ in range(EXAMPLES * 5)]
    for payload in payloads:
        sock = _connect(url)
        try:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(10)
            while sock.recv(65536):
                pass  # whatever it answers, it must end the exchange
        except OSError:
            pass  # the server may close first (reset, broken pipe, not connected): fine
        finally:
            sock.close()
        assert _healthy(url), payload[:80]


def test_lying_content_length_and_slowloris_do_not_starve_others(fuzz_server):
    url = fuzz_server.url
    held = []
    try:
        for _ in range(20):  # promise a body and never send it
            sock = _connect(url)
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{"
            )
            held.append(sock)
        for _ in range(20):  # headers one byte at a time, never finished
            sock = _connect(url)
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHo")
            held.append(sock)
        for round_ in range(5):
            for sock in held[20:]:
                sock.sendall(b"X-%d: y\r\n" % round_)
            assert _healthy(url)
            r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                           headers=AUTH, timeout=30)  # fmt: skip
            assert r.status_code == 200
    finally:
        for sock in held:
            sock.close()
    assert _healthy(url)
