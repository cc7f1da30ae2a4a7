"""The HTTP application: routes, error shapes, and the ASGI fix for closing connections."""

from __future__ import annotations

import contextlib
import json

import attrs
import trio
from quart import Response, g, has_request_context, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from . import (
    anthropic_api,
    chat_ws,
    completion_api,
    connections,
    driver,
    embeddings_api,
    infill_api,
    openai_chat,
    openai_completions,
    openapi,
    responses_api,
    status,
    systemone_api,
    template_api,
    tokenize_api,
)
from . import ui as chat_ui
from .body import parse_json, read_body
from .errors import ApiError
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .state import ServerState

MAX_BODY_BYTES = 16 * 1024 * 1024
WS_PATH = "/v1/chat/completions/ws"


def _json(body, status: int = 200, headers=None) -> Response:
    response = Response(
        json.dumps(body, ensure_ascii=False), status=status, mimetype="application/json"
    )
    for key, value in (headers or {}).items():
        response.headers[key] = value
    return response


async def _json_body():
    """The request's JSON object, or a 4xx naming what is wrong with it."""
    content_type = request.mimetype or ""
    if content_type != "application/json":
        raise ApiError(415, "the body must be JSON (Content-Type: application/json)")
    return parse_json(await read_body(request, MAX_BODY_BYTES, connections.stall_timeout()))


def create_app(state: ServerState, *, ui: bool = False, drain: Drain | None = None) -> QuartTrio:
    """Build the Quart-Trio app over shared server state; with `ui`, / is the chat page.
    drain: the SIGTERM grace period that /health reports (serve.py refuses work with it)."""
    drain = drain or Drain()
    app = QuartTrio("mashbox")
    app.config["RESPONSE_TIMEOUT"] = None  # quart's 60 s default would cut long streams
    app.config["BODY_TIMEOUT"] = None  # read_body bounds each wait for bytes instead
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES

    @app.errorhandler(ApiError)
    async def api_error(exc: ApiError):
        if has_request_context():  # not during a WebSocket handshake
            exc = _shaped(exc, request.path)
        return _json(exc.body(), exc.status, exc.headers)

    @app.before_request
    async def guard():
        if request.method == "HEAD":  # seed 000: the ready check, the same on every path
            return Response(b"", status=200 if state.ready and not drain.draining else 503)
        if request.routing_exception is not None:
            return  # 404 and 405 come first
        g.tenant = state.guard.check(request.path, request.headers)  # ApiErrors: api_error

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException):
        kind = "invalid_request_error" if exc.code < 500 else "server_error"
        headers = {}
        if exc.code == 405 and exc.valid_methods:
            headers["Allow"] = ", ".join(exc.valid_methods)
        error = ApiError(exc.code, exc.description, type=kind, headers=headers)
        if request.path == WS_PATH and exc.code == 400:  # plain HTTP on the WebSocket route
            error = ApiError(
                426, "this route speaks WebSocket only", headers={"Upgrade": "websocket"}
            )
        error = _shaped(error, request.path)
        return _json(error.body(), error.status, error.headers)

    @app.errorhandler(Exception)
    async def unexpected(exc: Exception):
        app.logger.exception("unexpected error")
        error = _shaped(ApiError(500, "internal error", type="server_error"), request.path)
        return _json(error.body(), error.status)

    async def health():
        body = status.health(state, draining=drain.draining)
        if not state.guard.authenticated(request.headers):
            body = {"status": body["status"]}  # a probe learns whether it is up, not how busy
        return _json(body, 200 if body["status"] == "ok" else 503)

    async def chat_page():
        return Response(page.body, status=200, headers=page.headers)

    page = chat_ui.load() if ui else None
    for path in ("/v1/health", "/health", "/"):
        view = chat_page if page is not None and path == "/" else health
        app.add_url_rule(path, f"health{path}", view, methods=["GET"])

    @app.get("/health/live")
    async def live():
        """200 while the process runs, loaded or not (seed 004)."""
        return _json({"status": "alive"})

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), content_type=METRICS_CONTENT_TYPE)

    @app.get("/openapi.json")
    async def openapi_json():
        return _json(openapi.document(state.model_id))

    app.add_url_rule("/v1/openapi.json", "v1_openapi_json", openapi_json, methods=["GET"])

    @app.get("/v1/models")
    async def list_models():
        if "anthropic-version" in request.headers:  # the Anthropic model-list shape
            return _json(status.anthropic_model_list(state))
        return _json(status.model_list(state))

    @app.get("/v1/models/<path:model>")
    async def get_model(model: str):
        if model != state.model_id:
            raise ApiError(404, f"model '{model}' is not served here", code="model_not_found")
        return _json(status.model_card(state))

    def generation(route: str, parse: driver.Parse):
        """A generation route's view: the driver runs the protocol's codec."""

        async def view() -> Response:
            body = await _json_body()
            result = await driver.answer(state, route, parse, body, request.headers, g.tenant)
            return _json(result) if isinstance(result, dict | list) else event_stream(result)

        return view

    for route, parse in GENERATION_ROUTES.items():
        app.add_url_rule(route, route, generation(route, parse), methods=["POST"])

    @app.post("/v1/embeddings")
    async def embeddings():
        body = await _json_body()
        return _json(await embeddings_api.embeddings(state, body, request.headers, g.tenant))

    @app.post("/v1/systemone")
    async def systemone():
        body = await _json_body()
        return _json(await systemone_api.systemone(state, body, g.tenant))

    @app.get("/v1/limits")
    async def limits():
        return _json(systemone_api.limits(state, MAX_BODY_BYTES))

    @app.websocket(WS_PATH)
    async def chat_websocket():
        await chat_ws.serve(state)

    @app.get("/v1/capabilities")
    async def capabilities():
        """The routes this server registers, read from its own routing table."""
        return _json(status.capabilities(app.url_map))

    @app.get("/v1/status")
    async def local_status():
        return _json(status.local_status(state))

    @app.get("/props")
    async def llama_props():
        """llama-server's server properties, for its clients."""
        return _json(status.llama_props(state))

    @app.post("/tokenize")
    async def tokenize():
        return _json(await tokenize_api.tokenize(state, await _json_body(), g.tenant))

    @app.post("/detokenize")
    async def detokenize():
        return _json(tokenize_api.detokenize(state, await _json_body()))

    @app.post("/apply-template")
    async def apply_template():
        """llama-server's: the prompt a chat request renders to."""
        return _json(template_api.apply_template(state, await _json_body()))

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return _json(tokenize_api.tokenizer_info(state))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens():
        return _json(await anthropic_api.count_tokens(state, await _json_body(), g.tenant))

    return app


# The generation routes and their protocols' codecs (driver.py).
GENERATION_ROUTES: dict[str, driver.Parse] = {
    "/v1/chat/completions": openai_chat.parse,
    "/v1/completions": openai_completions.parse,
    "/infill": infill_api.parse,  # llama-server's, for editors
    "/completion": completion_api.parse,  # llama-server's own, for its clients
    "/completions": completion_api.parse,  # the same, under llama-server's other name
    "/v1/responses": responses_api.parse,
    "/v1/messages": anthropic_api.parse,
}


def event_stream(frames) -> Response:
    """A stream of protocol events as server-sent events."""

    async def body():
        async with contextlib.aclosing(frames):  # its end releases the request at once
            async for f in frames:
                yield f.sse()

    response = Response(body(), mimetype="text/event-stream")
    response.headers["Cache-Control"] = "no-cache"
    response.headers["X-Accel-Buffering"] = "no"
    response.timeout = None  # long streams must not be cut
    return response


def _is_anthropic(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


SYSTEMONE_PATHS = frozenset({"/v1/systemone", "/v1/limits"})
LOCALENGINE_PATHS = frozenset({"/v1/embeddings", WS_PATH})  # seed 001's routes: its Error


def _shaped(error: ApiError, path: str) -> ApiError:
    """An error in the shape of the route it answers."""
    if _is_anthropic(path):
        return error.for_anthropic()
    if path in SYSTEMONE_PATHS:
        return error.for_systemone()
    if path in LOCALENGINE_PATHS:
        return error.for_localengine()
    return error


class Drain:
    """SIGTERM's grace period: once `start`ed, /health says "draining" (503, so a router moves
    traffic) and new work is refused, while the requests taken before run to their end."""

    def __init__(self):
        self.draining = False
        self.in_flight = 0  # POST requests being answered, streams until their last byte

    def start(self) -> None:
        self.draining = True

    async def wait_idle(self) -> None:
        while self.in_flight:
            await trio.sleep(0.05)


class RefuseWhileDraining:
    """ASGI wrapper: counts the POST requests being answered (a stream until its last byte is
    sent or its client is gone), and while `drain` is draining refuses new ones with 503 and
    Retry-After in the route's error shape, and new WebSockets with close code 1013 (try
    again later). GETs (health, metrics, models) still answer."""

    def __init__(self, app, drain: Drain):
        self.app, self.drain = app, drain

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket" and self.drain.draining:
            await send({"type": "websocket.close", "code": 1013})
            return
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            await _send_error(_draining_error(scope["path"]), send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


def _draining_error(path: str) -> ApiError:
    """503 in the route's shape; on Anthropic's route too, not the 529 of a loading server: a
    router (smg) retries a 503 on another replica, and passes a 529 on to the client."""
    error = ApiError(
        503,
        "this server is shutting down and takes no new requests; send it to another",
        type="unavailable",
        code="draining",
        headers={"Retry-After": "1"},
    )
    if _is_anthropic(path):
        headers = {**error.headers, "x-should-retry": "true"}
        return attrs.evolve(error, shape="anthropic", headers=headers)
    return _shaped(error, path)


async def _send_error(error: ApiError, send, *, head: bool = False) -> None:
    """An error answered at the ASGI level, before the app sees the request."""
    headers = [(b"content-type", b"application/json")]
    headers += [(k.lower().encode(), str(v).encode()) for k, v in error.headers.items()]
    body = b"" if head else json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RefuseBadHost:
    """ASGI wrapper: a Host header that is no host name (".", "a..b") is a 400 in the route's
    error shape. werkzeug would raise while binding the routes, before any handler, and the
    client would get a 500 (found by fuzz/test_guarded.py)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket") and not _valid_host(scope):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            error = ApiError(400, "the Host header is not a valid host name")
            await _send_error(_shaped(error, scope["path"]), send, head=scope["method"] == "HEAD")
            return
        await self.app(scope, receive, send)


def _valid_host(scope) -> bool:
    """Whether the Host header, less its port, encodes as werkzeug encodes it (IDNA)."""
    for name, value in scope.get("headers", ()):
        if name == b"host":
            try:
                value.decode("latin-1").lower().partition(":")[0].encode("idna")
            except UnicodeError:
                return False
    return True


class ShieldFinalSend:
    """ASGI wrapper: shield the last body message from cancellation.

    quart-trio cancels its request nursery on `http.disconnect` while hypercorn may be inside
    the final send; unshielded, the connection is never closed (Connection: close, HTTP/1.0).
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        async def shielded_send(message):
            if message.get("type") == "http.response.body" and not message.get("more_body"):
                with trio.CancelScope(shield=True):
                    await send(message)
            else:
                await send(message)

        await self.app(scope, receive, shielded_send)
