"""Errors a route answers with, in the OpenAI shape."""

from __future__ import annotations

import attrs


@attrs.define
class ApiError(Exception):
    """An error response: status, message, OpenAI type, and the field it is about."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict = attrs.Factory(dict)

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def not_ready(retry_after: int = 5) -> ApiError:
    return ApiError(
        503,
        "the model is still loading",
        type="unavailable",
        headers={"Retry-After": str(retry_after)},
    )
