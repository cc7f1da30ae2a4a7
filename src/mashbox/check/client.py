"""The server under check, over HTTP: one httpx client carrying the key, and the routes'
answers read the way every case needs them (404 means the route is not served)."""

from __future__ import annotations

import contextlib
import time

import httpx

ANTHROPIC_VERSION = "2023-06-01"


class NotServed(Exception):
    """The server answers 404 on this route."""


class Refused(Exception):
    """The server answered with an error status; the message quotes its body."""


class Server:
    """An OpenAI/Anthropic-compatible server at `url` (with or without its /v1)."""

    def __init__(self, url: str, *, api_key: str | None, timeout: float):
        self.url = url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}", "x-api-key": api_key} if api_key else {}
        # Enough connections for a held stream, eight requests at once and a spare.
        limits = httpx.Limits(max_connections=16, max_keepalive_connections=16)
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, limits=limits)

    def close(self) -> None:
        self.http.close()

    def _models(self) -> tuple[object, list]:
        """/v1/models' answer, and its `data` list ([] where it has none)."""
        body = self._json(self.http.get("/v1/models"))
        models = body.get("data") if isinstance(body, dict) else None
        return body, models if isinstance(models, list) else []

    def first_model(self) -> str:
        """The first id in /v1/models: what a client that names no model would use."""
        body, models = self._models()
        first = models[0] if models else None
        if not isinstance(first, dict) or not isinstance(first.get("id"), str):
            raise Refused(f"/v1/models lists no model: {_quote(body)}")
        return first["id"]

    def model_card(self, model: str) -> dict:
        """`model`'s entry in /v1/models; {} where there is none or the list cannot be read."""
        try:
            _, models = self._models()
        except (NotServed, Refused, httpx.HTTPError):
            return {}
        cards = [m for m in models if isinstance(m, dict) and m.get("id") == model]
        return cards[0] if cards else {}

    def post(self, path: str, body: dict) -> dict:
        """POST a JSON body; the JSON answer, or NotServed / Refused."""
        return self._json(self.http.post(path, json=body, headers=_route_headers(path)))

    @contextlib.contextmanager
    def stream(self, path: str, body: dict):
        """POST a streaming request; yields the open response once its status is a success."""
        with self.http.stream("POST", path, json=body, headers=_route_headers(path)) as r:
            if r.status_code >= 400:
                r.read()
                self._json(r)
            yield r

    def is_up(self) -> bool:
        """Whether /health (or, where there is none, /v1/models) answers 200."""
        for path in ("/health", "/v1/models"):
            try:
                r = self.http.get(path, timeout=5)
            except httpx.TransportError:
                return False
            if r.status_code != 404:
                return r.status_code == 200
        return False

    def wait_up(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.is_up():
                return True
            time.sleep(0.1)
        return False

    @staticmethod
    def _json(r: httpx.Response):
        if r.status_code == 404 and not _names_the_model(r):
            raise NotServed(f"{r.request.url.path} answers 404")
        if r.status_code >= 400:
            raise Refused(f"{r.request.url.path} answered {r.status_code}: {_quote(r.text)}")
        try:
            return r.json()
        except ValueError as e:
            raise Refused(f"{r.request.url.path} answered no JSON: {_quote(r.text)}") from e


def _names_the_model(r: httpx.Response) -> bool:
    """Whether a 404 is about the model asked for (the route is there), as OpenAI's
    model_not_found, vLLM's "The model `x` does not exist" and the like say."""
    try:
        error = r.json()
    except ValueError:
        return False
    if isinstance(error, dict) and isinstance(error.get("error"), dict):
        error = error["error"]
    if not isinstance(error, dict):
        return False
    message = error.get("message")
    return (
        error.get("code") == "model_not_found"
        or error.get("param") == "model"
        or (isinstance(message, str) and "model" in message.lower())
    )


def _route_headers(path: str) -> dict:
    # Only on Messages: mashbox answers /v1/models in Anthropic's shape when it sees it.
    return {"anthropic-version": ANTHROPIC_VERSION} if path == "/v1/messages" else {}


def _quote(value, width: int = 200) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= width else text[: width - 1] + "…"
