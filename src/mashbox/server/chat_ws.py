"""GET /v1/chat/completions/ws: chat completions over one WebSocket.

Each text frame is a chat request; a non-streamed reply is one ChatCompletion frame, a
streamed one is chunk frames then "[DONE]", an error an error frame. Several requests may be
in flight on one socket (replies interleave; each frame carries its response id), at most
MAX_IN_FLIGHT, and one tenant holds at most MAX_SOCKETS_PER_TENANT sockets open (a 429 at the
handshake past it); closing the socket cancels them. Each frame passes the HTTP body's checks,
and whatever one frame does ends in an error frame for it alone, never its siblings. The
handshake authenticates with `?token=` or `Sec-WebSocket-Protocol: bearer, TOKEN` (handshake
only) and refuses a foreign Origin.
"""

from __future__ import annotations

import contextlib
import json
import logging
import zlib

import trio
from hypercorn.protocol import ws_stream
from quart import websocket
from wsproto.extensions import PerMessageDeflate
from wsproto.frame_protocol import CloseReason

from . import driver, openai_chat
from .body import parse_json
from .errors import ApiError
from .per_tenant import PerTenant
from .state import ServerState

log = logging.getLogger("mashbox")

ROUTE = "/v1/chat/completions/ws"  # what its requests' log lines name
MAX_IN_FLIGHT = 8  # requests one socket may have running at once
# Sockets one tenant may hold open (a chat page needs one): each holds a descriptor and its
# tasks for as long as it stays open, idle or not.
MAX_SOCKETS_PER_TENANT = 32
OPEN_SOCKETS = PerTenant(MAX_SOCKETS_PER_TENANT)
MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # one frame's message, inflated (an HTTP body's cap)


class BoundedDeflate(PerMessageDeflate):
    """permessage-deflate that stops inflating a message past MAX_MESSAGE_BYTES and closes
    the socket. wsproto inflates each frame whole before hypercorn checks the size: 256 KB
    on the wire grew the server by ~360 MiB. Installed in place of hypercorn's by
    `install_bounded_deflate`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._inflated = 0  # bytes of the current message so far

    def frame_inbound_payload_data(self, proto, data):
        if not self._inbound_compressed or not self._inbound_is_compressible:
            return data
        room = MAX_MESSAGE_BYTES - self._inflated
        try:
            out = self._decompressor.decompress(bytes(data), room + 1)
        except zlib.error:
            return CloseReason.INVALID_FRAME_PAYLOAD_DATA
        self._inflated += len(out)
        return CloseReason.MESSAGE_TOO_BIG if self._inflated > MAX_MESSAGE_BYTES else out

    def frame_inbound_complete(self, proto, fin: bool):
        if fin:
            self._inflated = 0
        return super().frame_inbound_complete(proto, fin)


def install_bounded_deflate() -> None:
    """Make hypercorn offer BoundedDeflate (it builds its extensions from this name)."""
    ws_stream.PerMessageDeflate = BoundedDeflate


def _handshake_headers(ws) -> dict:
    """The handshake's headers, with a token from the query or subprotocol as a Bearer key."""
    headers = {k.lower(): v for k, v in ws.headers.items()}
    token = ws.args.get("token")
    protocols = [p.strip() for p in ws.requested_subprotocols]
    if not token and len(protocols) >= 2 and protocols[0].lower() == "bearer":
        token = protocols[1]
    if token:
        headers["authorization"] = f"Bearer {token}"
    return headers


def error_frame(exc: ApiError) -> dict:
    """An error frame: seed 001's Error (a string code and a message), and its status."""
    error = exc.for_localengine()
    return {**error.body(), "status": error.status}


async def serve(state: ServerState) -> None:
    ws = websocket._get_current_object()
    headers = _handshake_headers(ws)
    try:
        tenant = state.guard.check(ws.path, headers)
    except ApiError as exc:
        # Refused before the upgrade: an ordinary HTTP answer (401 or 403).
        raise exc from None
    with OPEN_SOCKETS.hold(tenant, _sockets_refused):
        await _serve_socket(state, ws, headers, tenant)


def _sockets_refused(most: int) -> ApiError:
    held = f"{most} of your WebSockets are open: close one first"
    return ApiError(429, held, headers={"Retry-After": "1"})


async def _serve_socket(state: ServerState, ws, headers: dict, tenant: str) -> None:
    bearer = [p for p in ws.requested_subprotocols if p.lower() == "bearer"]
    await ws.accept(subprotocol="bearer" if bearer else None)
    send_lock = trio.Lock()

    async def send(obj) -> None:
        text = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
        async with send_lock:
            await ws.send(text)

    async def answer(frame: str) -> None:
        try:
            data = parse_json(frame)
            result = await driver.answer(state, ROUTE, openai_chat.parse, data, headers, tenant)
            if isinstance(result, dict):
                await send(result)
                return
            async with contextlib.aclosing(result):  # the chat events: one WebSocket frame each
                async for event in result:
                    await send(event.json.decode())
        except ApiError as exc:
            await send(error_frame(exc))
        except Exception:  # this frame's fault alone: its siblings go on
            log.exception("a WebSocket frame failed")
            await send(error_frame(ApiError(500, "internal error", type="server_error")))
        finally:
            in_flight.release()

    in_flight = trio.Semaphore(MAX_IN_FLIGHT)
    async with trio.open_nursery() as nursery:
        while True:
            frame = await ws.receive()
            if isinstance(frame, bytes):
                frame = frame.decode("utf-8", errors="replace")
            try:
                in_flight.acquire_nowait()
            except trio.WouldBlock:
                too_many = f"{MAX_IN_FLIGHT} requests are already running on this socket"
                await send(error_frame(ApiError(429, too_many)))
                continue
            nursery.start_soon(answer, frame)
