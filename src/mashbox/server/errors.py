"""Errors a route answers with, in the OpenAI shape or the Anthropic one."""

from __future__ import annotations

import attrs

# OpenAI error type (or status) -> Anthropic error type.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    529: "overloaded_error",
}


@attrs.define
class ApiError(Exception):
    """An error response: status, message, OpenAI type, and the field it is about."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict = attrs.Factory(dict)
    anthropic: bool = False  # render in the Anthropic shape (/v1/messages*)

    def body(self) -> dict:
        if self.anthropic:
            kind = _ANTHROPIC_TYPES.get(self.status, "api_error")
            return {"type": "error", "error": {"type": kind, "message": self.message}}
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def for_anthropic(self) -> ApiError:
        """The same error for an Anthropic client: 529 overloaded_error when the server
        cannot take work (loading, engine restarting, whole queue full)."""
        status, headers = self.status, dict(self.headers)
        if self.type == "unavailable" or self.code == "queue_full":
            status = 529
            headers.setdefault("Retry-After", "5")
            if self.type == "unavailable":
                headers["x-should-retry"] = "true"
        return attrs.evolve(self, status=status, headers=headers, anthropic=True)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def not_ready(retry_after: int = 5) -> ApiError:
    headers = {"Retry-After": str(retry_after)}
    return ApiError(503, "the model is still loading", type="unavailable", headers=headers)
