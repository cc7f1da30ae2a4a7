"""A lean streaming client for the decode benches: one POST, its server-sent events as dicts.

On a 2-core machine the benchmark's client runs on the cores the server decodes with, so
every microsecond it spends per event is taken from the server under test. httpx under trio
(its transport, its line iterator, an event-loop turn per read) cost ~0.5 ms of CPU per
event here, half as much as the server's own work per token; trio's raw sockets still
~0.37. This is a blocking socket read on a thread of its own, with the events split here
(HTTP/1.1, chunked or close-delimited bodies, as mashbox and llama-server send them), so the
measurement takes less of what it measures. Both servers are read by the same client, so
ratios between them stay fair either way.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from urllib.parse import urlsplit


class _Body:
    """The response body's bytes as they arrive, chunked framing undone."""

    def __init__(self, sock: socket.socket, rest: bytes, chunked: bool):
        self.sock, self.buf, self.chunked = sock, rest, chunked
        self.chunk_left = 0  # bytes of the current chunk not yet returned
        self.done = False

    def _fill(self) -> bool:
        data = self.sock.recv(65536)
        self.buf += data
        return bool(data)

    def read(self) -> bytes:
        """The next piece of the body; b"" at its end."""
        if not self.chunked:
            if not self.buf and not self._fill():
                return b""
            out, self.buf = self.buf, b""
            return out
        while not self.done:
            if self.chunk_left:
                if not self.buf and not self._fill():
                    raise RuntimeError("connection closed inside a chunk")
                out = self.buf[: self.chunk_left]
                self.buf = self.buf[len(out) :]
                self.chunk_left -= len(out)
                return out
            end = self.buf.find(b"\r\n")
            if end < 0:
                if not self._fill():
                    raise RuntimeError("connection closed before a chunk's size")
                continue
            line, self.buf = self.buf[:end], self.buf[end + 2 :]
            if line:  # else the CRLF that ends the chunk before
                self.chunk_left = int(line.split(b";")[0], 16)
                self.done = self.chunk_left == 0
        return b""


def post_events(url: str, path: str, body: dict, timeout: float = 600) -> Iterator[dict]:
    """POST `body` as JSON; yield each `data:` event's JSON (not "[DONE]"). Blocking: run it
    on a thread (trio.to_thread) when an event loop must go on meanwhile."""
    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    with socket.create_connection((parts.hostname, parts.port or 80), timeout=timeout) as sock:
        sock.sendall(head + payload)
        buf = b""
        while b"\r\n\r\n" not in buf:
            data = sock.recv(65536)
            if not data:
                raise RuntimeError("connection closed before the response's headers")
            buf += data
        header, rest = buf.split(b"\r\n\r\n", 1)
        lines = header.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        chunked = any(
            x.lower().startswith("transfer-encoding:") and "chunked" in x.lower() for x in lines
        )
        reader = _Body(sock, rest, chunked)
        if status != 200:
            whole = rest
            while piece := reader.read():
                whole += piece
            raise RuntimeError(f"HTTP {status}: {whole[:300]!r}")
        pending = b""
        while piece := reader.read():
            # A CR LF split across two reads is whole again in `pending` before it is split.
            pending += piece
            *events, pending = pending.replace(b"\r\n", b"\n").split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                        yield json.loads(line[5:])
