"""Each connection's task: its failures stay in it, and a peer that takes nothing is cut.

Containment: hypercorn's trio TCPServer.run lets anything but OSError escape, and
`serve_listeners` then ends every connection and the server with it. A client can trigger
that: a malformed chunked body makes h11 raise while the app is answering, and hypercorn's
error reply then races its own close (trio.BusyResourceError). Found by fuzz/test_raw_http.py.

The stall cut (seed 000: a client that reads nothing for 30 s loses its request): "reads
nothing" is measured where it happens, at the transport, as the time since the peer last
acknowledged a byte while bytes waited for it (TCP_INFO). With default socket buffers the
kernel queues megabytes for a peer that stopped reading, and the scheduler's own clock (a
full event channel) starts only after all of them: minutes of a held slot at a stream's rate.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct

import trio
from hypercorn.trio import tcp_server

log = logging.getLogger("mashbox")
_original_run = tcp_server.TCPServer.run
_stall_timeout = 30.0

# struct tcp_info (linux/tcp.h): tcpi_unacked (segments sent, not yet acknowledged),
# tcpi_bytes_acked (Linux 4.1) and tcpi_notsent_bytes (Linux 4.6).
_UNACKED, _BYTES_ACKED, _NOTSENT = 24, 120, 144
_TCP_INFO_NEEDED = _NOTSENT + 4


def transport_progress(sock) -> tuple[int, bool] | None:
    """(bytes the peer has acknowledged, whether bytes wait for it), or None where the
    socket cannot say: not TCP, not Linux, or a kernel older than 4.6."""
    if not hasattr(socket, "TCP_INFO"):
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    except OSError:
        return None
    if len(info) < _TCP_INFO_NEEDED:
        return None
    (unacked,) = struct.unpack_from("I", info, _UNACKED)
    (acked,) = struct.unpack_from("Q", info, _BYTES_ACKED)
    (notsent,) = struct.unpack_from("I", info, _NOTSENT)
    return acked, bool(unacked or notsent)


def watch_interval(timeout: float) -> float:
    """How often a connection is looked at: the cut lands at most this late."""
    return min(1.0, timeout / 8)


async def watch(sock, timeout: float) -> bool:
    """Return True after cutting `sock` once its peer acknowledged nothing for `timeout`
    seconds while bytes waited for it; False at once where the transport cannot say (the
    scheduler's channel clock still holds such streams to the same timeout, later)."""
    progress = transport_progress(sock)
    if progress is None:
        return False
    last_acked, _ = progress
    since = trio.current_time()
    while True:
        await trio.sleep(watch_interval(timeout))
        progress = transport_progress(sock)
        if progress is None:  # closed under us
            return False
        acked, waiting = progress
        now = trio.current_time()
        if acked != last_acked or not waiting:
            last_acked, since = acked, now
        elif now - since >= timeout:
            log.info("cut a connection whose client took nothing for %.1f s", now - since)
            cut(sock)
            return True


def cut(sock) -> None:
    """Reset the connection: its blocked send fails at once, its reader sees the end, and the
    kernel drops what it still held for the peer."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RDWR)


async def _run_connection(self) -> None:
    sock = getattr(self.stream, "socket", None)  # a plain SocketStream (no TLS here)
    async with trio.open_nursery() as nursery:
        if sock is not None:
            nursery.start_soon(watch, sock, _stall_timeout)
        try:
            await _original_run(self)
        except Exception as exc:  # noqa: BLE001 (cancellation is a BaseException and passes)
            log.debug("connection ended with %r", exc)
        nursery.cancel_scope.cancel()


def stall_timeout() -> float:
    """Seconds a connection may move nothing, either way, while a request is on it."""
    return _stall_timeout


def install(stall_timeout: float) -> None:
    """Patch hypercorn's per-connection task (idempotent); say so loudly where this platform
    cannot measure a stalled reader at the transport."""
    global _stall_timeout
    _stall_timeout = stall_timeout
    tcp_server.TCPServer.run = _run_connection
    probe = socket.socket()
    try:
        supported = transport_progress(probe) is not None
    finally:
        probe.close()
    if not supported:
        log.warning(
            "this platform's sockets do not report acknowledged bytes (TCP_INFO, Linux 4.6+): "
            "a client that stops reading is cut %g s after the kernel's send buffer and its "
            "stream's queue fill, which with default buffers can be minutes later",
            stall_timeout,
        )
