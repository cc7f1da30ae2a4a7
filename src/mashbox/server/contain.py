"""Keep one broken connection from stopping the server.

hypercorn's trio TCPServer.run lets anything but OSError escape, and `serve_listeners` then
ends every connection and the server with it. A client can trigger that: a malformed
chunked body makes h11 raise while the app is answering, and hypercorn's error reply then
races its own close (trio.BusyResourceError). Found by fuzz/test_raw_http.py.
"""

from __future__ import annotations

import logging

from hypercorn.trio import tcp_server

log = logging.getLogger("mashbox")
_original_run = tcp_server.TCPServer.run


async def _run_contained(self) -> None:
    try:
        await _original_run(self)
    except Exception as exc:  # noqa: BLE001 (cancellation is a BaseException and passes)
        log.debug("connection ended with %r", exc)


def install() -> None:
    """Patch hypercorn's per-connection task once (idempotent)."""
    tcp_server.TCPServer.run = _run_contained
