"""Read request bodies field by field, naming the field in every 400.

Fields a route does not list are accepted and ignored (the official SDKs send many).
"""

from __future__ import annotations

import math

from .errors import bad_request

_MISSING = object()


class Body:
    """A JSON object body with typed, range-checked accessors."""

    def __init__(self, data, where: str = "body"):
        if not isinstance(data, dict):
            raise bad_request(f"the {where} must be a JSON object")
        self.data = data

    def has(self, name: str) -> bool:
        return self.data.get(name) is not None

    def raw(self, name: str, default=None):
        value = self.data.get(name, _MISSING)
        return default if value is _MISSING or value is None else value

    def bool(self, name: str, default: bool = False) -> bool:
        value = self.raw(name, default)
        if not isinstance(value, bool):
            raise bad_request(f"{name} must be a boolean", name)
        return value

    def int(self, name: str, default=None, *, lo=None, hi=None):
        value = self.raw(name, default)
        if value is None:
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad_request(f"{name} must be an integer", name)
        _check_range(name, value, lo, hi)
        return value

    def number(self, name: str, default=None, *, lo=None, hi=None, lo_open=False):
        value = self.raw(name, default)
        if value is None:
            return None
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise bad_request(f"{name} must be a number", name)
        if lo_open and value <= lo:
            raise bad_request(f"{name} must be greater than {lo}", name)
        _check_range(name, value, None if lo_open else lo, hi)
        return float(value)

    def str(self, name: str, default=None):
        value = self.raw(name, default)
        if value is not None and not isinstance(value, str):
            raise bad_request(f"{name} must be a string", name)
        return value

    def object(self, name: str) -> Body | None:
        value = self.raw(name)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise bad_request(f"{name} must be an object", name)
        return Body(value, name)

    def list(self, name: str, default=None):
        value = self.raw(name, default)
        if value is not None and not isinstance(value, list):
            raise bad_request(f"{name} must be an array", name)
        return value

    def refuse(self, name: str, why: str) -> None:
        """400 when a field that mashbox does not support is set (null, false and empty ask
        for nothing: some clients send `functions: []`)."""
        value = self.data.get(name)
        if value is not None and value is not False and value not in ("", [], {}):
            raise bad_request(f"{name} is not supported: {why}", name)


def _check_range(name, value, lo, hi):
    if lo is not None and value < lo:
        raise bad_request(f"{name} must be >= {lo}", name)
    if hi is not None and value > hi:
        raise bad_request(f"{name} must be <= {hi}", name)
