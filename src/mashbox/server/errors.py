"""Errors a route answers with: in the OpenAI shape, the Anthropic one, or seed 004's
`ErrorResponse` for typed decisions (/v1/systemone, /v1/limits)."""

from __future__ import annotations

import attrs

# OpenAI error type (or status) -> Anthropic error type.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}


# Seed 001's codes by status, where an error has no more particular one.
_LOCALENGINE_CODES = {
    400: "invalid_request",
    401: "invalid_token",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    415: "unsupported_content",
    429: "rate_limited",
    503: "unavailable",
    504: "timeout",
}

# Seed 004's error codes (ErrorDetail.code).
SYSTEMONE_CODES = frozenset(
    {
        "validation", "body_too_large", "unknown_model", "too_many_tokens",
        "unsupported_content", "backend_unreachable", "backend_error", "backend_timeout",
        "readout_truncated", "overloaded", "client_disconnected",
    }
)  # fmt: skip


@attrs.define
class ApiError(Exception):
    """An error response: status, message, OpenAI type, and the field it is about."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict = attrs.Factory(dict)
    shape: str = "openai"  # or "anthropic" (/v1/messages*) or "systemone" (/v1/systemone)
    detail: list | None = None  # FastAPI-style validation entries (systemone shape)

    def body(self) -> dict:
        if self.shape == "anthropic":
            kind = _ANTHROPIC_TYPES.get(self.status, "api_error")
            return {"type": "error", "error": {"type": kind, "message": self.message}}
        if self.shape == "systemone":
            # Seed 004's `error`, and for TypeSafe's clients a `detail`: FastAPI's list on a
            # validation error, else {error_type, message} (Anthropic's type names).
            body = {"error": {"message": self.message, "code": self.code}}
            if self.detail:
                return {**body, "detail": self.detail}
            kind = _ANTHROPIC_TYPES.get(self.status, "api_error")
            return {**body, "detail": {"error_type": kind, "message": self.message}}
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def for_localengine(self) -> ApiError:
        """The same error in seed 001's shape (embeddings, WebSocket frames): a string `code`
        on every error, and an unknown model a 400 model_not_found."""
        status, code = self.status, self.code
        if code == "model_not_found":
            status = 400
        code = code or _LOCALENGINE_CODES.get(
            status, "server_error" if status >= 500 else "invalid_request"
        )
        return attrs.evolve(self, status=status, code=code)

    def for_anthropic(self) -> ApiError:
        """The same error for an Anthropic client: 529 overloaded_error when the server
        cannot take work (loading, engine restarting, whole queue full)."""
        status, headers = self.status, dict(self.headers)
        if self.type == "unavailable" or self.code == "queue_full":
            status = 529
            headers.setdefault("Retry-After", "5")
            if self.type == "unavailable":
                headers["x-should-retry"] = "true"
        return attrs.evolve(self, status=status, headers=headers, shape="anthropic")

    def for_systemone(self) -> ApiError:
        """The same error in seed 004's shape: one of its codes, 422 for validation (with a
        `detail` list, as FastAPI-style clients expect), 529 overloaded when the queue is
        full, 503 while the model loads, 502 when the engine failed."""
        if self.shape == "systemone":
            return self
        status, code, headers = self.status, self.code, dict(self.headers)
        if self.type == "unavailable":
            status, code = 503, "backend_unreachable"
        elif code in ("queue_full", "tenant_queue_full"):
            status, code = 529, "overloaded"
            headers.setdefault("Retry-After", "1")
        elif status == 413:
            code = "body_too_large"
        elif status == 415:
            code = "unsupported_content"
        elif status == 504:
            code = "backend_timeout"
        elif code == "model_not_found":
            code = "unknown_model"
        elif status in (401, 403, 404, 405):
            # No code of seed 004's names these; `detail.error_type` does.
            code = "validation"
        elif code not in SYSTEMONE_CODES:
            # The seed has no code for auth, routing or method errors: they keep their
            # status and read as a request problem.
            status, code = (502, "backend_error") if status >= 500 else (status, "validation")
            if status == 400:
                status = 422
        detail = self.detail
        if code == "validation" and not detail and status == 422:
            detail = [{"loc": ["body"], "msg": self.message, "type": "value_error"}]
        return attrs.evolve(
            self, status=status, code=code, headers=headers, shape="systemone", detail=detail
        )


def invalid(loc: tuple, message: str, kind: str = "value_error", code="validation") -> ApiError:
    """A typed-decision request error naming its field (loc: path inside the body)."""
    where = ".".join(str(part) for part in loc)
    entry = {"loc": ["body", *loc], "msg": message, "type": kind}
    return ApiError(422, f"{where}: {message}" if where else message, code=code,
                    param=where or None, shape="systemone", detail=[entry])  # fmt: skip


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def queue_full(message: str, *, whole_queue: bool) -> ApiError:
    """429 with Retry-After: the server's queue is full, or this tenant's share of it."""
    code = "queue_full" if whole_queue else "tenant_queue_full"
    headers = {"Retry-After": "1"}
    return ApiError(429, message, type="rate_limit_error", code=code, headers=headers)


def too_long(message: str, param: str) -> ApiError:
    """A prompt or input that cannot fit the context (OpenAI's and seed 001's code)."""
    return ApiError(400, message, param=param, code="context_length_exceeded")


def not_ready(retry_after: int = 5) -> ApiError:
    headers = {"Retry-After": str(retry_after)}
    return ApiError(503, "the model is still loading", type="unavailable", headers=headers)
