"""GET /v1/chat/completions/ws: chat completions over one WebSocket.

Each text frame is a chat request; a non-streamed reply is one ChatCompletion frame, a
streamed one is chunk frames then "[DONE]", an error an error frame. Several requests may be
in flight on one socket (replies interleave; each frame carries its response id); closing the
socket cancels them. The handshake authenticates with `?token=` or
`Sec-WebSocket-Protocol: bearer, TOKEN` (handshake only) and refuses a foreign Origin.
"""

from __future__ import annotations

import json

import trio
from quart import Response, websocket

from . import openai_api
from .errors import ApiError
from .state import ServerState


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


async def serve(state: ServerState) -> None:
    ws = websocket._get_current_object()
    headers = _handshake_headers(ws)
    try:
        tenant = state.guard.check(ws.path, headers)
    except ApiError as exc:
        # Refused before the upgrade: an ordinary HTTP answer (401 or 403).
        raise exc from None
    bearer = [p for p in ws.requested_subprotocols if p.lower() == "bearer"]
    await ws.accept(subprotocol="bearer" if bearer else None)
    send_lock = trio.Lock()

    async def send(obj) -> None:
        text = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
        async with send_lock:
            await ws.send(text)

    async def answer(frame: str) -> None:
        try:
            data = json.loads(frame)
        except ValueError as exc:
            await send(ApiError(400, f"the frame is not valid JSON: {exc}").body())
            return
        try:
            result = await openai_api.chat_completions(state, data, headers, tenant)
        except ApiError as exc:
            await send({**exc.body(), "status": exc.status})
            return
        if not isinstance(result, Response):
            await send(result)
            return
        async with result.response as body:  # the SSE stream: one frame per data line
            async for chunk in body:
                for line in chunk.decode().split("\n"):
                    if line.startswith("data: "):
                        await send(line[6:])

    async with trio.open_nursery() as nursery:
        while True:
            frame = await ws.receive()
            if isinstance(frame, bytes):
                frame = frame.decode("utf-8", errors="replace")
            nursery.start_soon(answer, frame)
