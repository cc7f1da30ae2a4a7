"""Raw-socket HTTP clients for what httpx cannot do: stop reading, vanish mid-request."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit


def connect(url: str, *, rcvbuf: int | None = None) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect
    sock.settimeout(30)
    sock.connect((parts.hostname, parts.port))
    return sock


def post_json(sock: socket.socket, path: str, body: dict, *, version: str = "1.1") -> None:
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/{version}\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)


def read_until(sock: socket.socket, marker: bytes, limit: int = 1 << 20) -> bytes:
    buf = b""
    while marker not in buf and len(buf) < limit:
        chunk = sock.recv(4096)
        if not chunk:
            break
        buf += chunk
    return buf


def read_to_eof(sock: socket.socket, timeout: float) -> tuple[bytes, bool]:
    """Read until the server closes; returns (data, closed within timeout)."""
    sock.settimeout(timeout)
    buf = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return buf, True
            buf += chunk
    except ConnectionResetError:
        return buf, True
    except TimeoutError:
        return buf, False
