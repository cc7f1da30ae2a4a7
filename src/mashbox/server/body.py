"""Request bodies: read whole, decompressed (gzip, deflate, zstd) within the size cap.

Clients such as the TypeSafe SDK send large bodies zstd-compressed (`Content-Encoding`); the
cap applies to the decompressed size too, so a small compressed body cannot expand to
gigabytes in memory.
"""

from __future__ import annotations

import json
import sys
import zlib

import trio

from .errors import ApiError

if sys.version_info >= (3, 14):
    from compression.zstd import ZstdDecompressor, ZstdError
else:
    from backports.zstd import ZstdDecompressor, ZstdError


async def read_body(request, cap: int, stall: float) -> bytes:
    """The body's bytes, decoded per Content-Encoding; 413 past `cap`, 415 for an encoding
    this server does not know, 400 for a corrupt one, 408 once no bytes came for `stall`
    seconds: a client that sends slowly is read to the end, however long it takes, and one
    that stops holds its connection (a descriptor) no longer than that."""
    raw, chunks = bytearray(), aiter(request.body)
    while True:
        with trio.move_on_after(stall) as waiting:
            try:
                raw += await anext(chunks)
            except StopAsyncIteration:
                break
        if waiting.cancelled_caught:
            raise ApiError(408, f"the body stalled: no bytes came for {stall:g} s")
        if len(raw) > cap:
            raise ApiError(413, f"the body is larger than {cap} bytes")
    raw = bytes(raw)
    encoding = (request.headers.get("content-encoding") or "identity").strip().lower()
    if encoding == "identity":
        return raw
    if encoding in ("gzip", "x-gzip"):
        decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
    elif encoding == "deflate":
        decoder = zlib.decompressobj()
    elif encoding == "zstd":
        decoder = ZstdDecompressor()
    else:
        raise ApiError(415, f"Content-Encoding {encoding} is not supported (gzip, deflate, zstd)")
    try:
        body = decoder.decompress(raw, cap + 1)
    except (zlib.error, ZstdError) as exc:
        raise ApiError(400, f"the {encoding} body cannot be decompressed: {exc}") from None
    if len(body) > cap:
        raise ApiError(413, f"the decompressed body is larger than {cap} bytes")
    if not decoder.eof:
        raise ApiError(400, f"the {encoding} body is truncated")
    return body


def parse_json(raw: bytes | str):
    """A body's JSON value, or a 400: invalid JSON, nesting past Python's recursion limit, or
    a lone UTF-16 surrogate (which JSON may escape and no tokenizer can encode)."""
    try:
        # ValueError covers invalid UTF-8 and integers past Python's 4300-digit limit.
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None
    if _has_lone_surrogate(data):
        raise ApiError(400, "the body holds a lone UTF-16 surrogate (\\ud800-\\udfff)")
    return data


def _has_lone_surrogate(value) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False
