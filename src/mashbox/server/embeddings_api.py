"""POST /v1/embeddings: one vector per input, pooled from the served model's hidden states.

Pooling: the mean of the final (normalized) hidden states over every token of the input,
L2-normalized, in float64. Each input is its own request through the scheduler (same slots,
queue limits and cancellation as generation) and runs alone in its slot, so a vector never
depends on what else is in the batch. A request holds at most half the slots at a time, with
a bounded number of inputs and tokens, all tokenized off the event loop.
"""

from __future__ import annotations

import base64
import struct

import trio

from ..events import Embedding, Failed, Finished, Request
from ..protocol import SamplingParams
from .driver import failure, submit
from .errors import ApiError, bad_request, not_ready, too_long
from .generation import check_model, encode_prompt
from .state import ServerState
from .validate import Body

MAX_INPUTS = 2048  # OpenAI's bound
MAX_TOKENS = 300_000  # tokens of all inputs of one request (OpenAI's bound)


def _base64(vector) -> str:
    """OpenAI's base64 encoding: the vector's float32 values, little-endian."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


# The official OpenAI SDKs ask for base64 unless told otherwise (and decode it back), past
# seed 001's "float only"; float is the vector's float64 values as JSON numbers.
ENCODINGS = {"float": list, "base64": _base64}


def inputs_of(body: Body) -> list[str]:
    value = body.raw("input")
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise bad_request("input must be a string or a non-empty list of strings", "input")
    if len(value) > MAX_INPUTS:
        raise bad_request(f"input holds {len(value)} strings; at most {MAX_INPUTS}", "input")
    if not all(isinstance(v, str) for v in value):
        raise bad_request("input: token-id inputs are not supported; send strings", "input")
    return value


async def embeddings(state: ServerState, data, headers, tenant: str = "") -> dict:
    if not state.ready:
        raise not_ready()
    body = Body(data)
    check_model(body, state)
    if body.has("dimensions"):
        raise bad_request(
            "dimensions is not supported: vectors have the model's width", "dimensions"
        )
    encoding = body.raw("encoding_format", "float")
    if not isinstance(encoding, str) or encoding not in ENCODINGS:  # {} is unhashable
        raise bad_request("encoding_format must be float or base64", "encoding_format")
    texts = inputs_of(body)
    ids: list[list[int]] = []
    total = 0
    for i, text in enumerate(texts):
        tokens = await encode_prompt(state, text, "input", tenant=tenant)
        if not tokens:
            raise bad_request(f"input[{i}] is empty", "input")
        if len(tokens) > state.ctx:
            raise too_long(
                f"input[{i}] is {len(tokens)} tokens; the context is {state.ctx}", "input"
            )
        ids.append(tokens)
        total += len(tokens)
        if total > MAX_TOKENS:
            raise bad_request(f"input is more than {MAX_TOKENS} tokens in all", "input")
    vectors: list[tuple[float, ...] | None] = [None] * len(ids)
    todo = iter(range(len(ids)))

    async def worker() -> None:
        for i in todo:  # the workers share one iterator: each input is taken once
            request = Request(tuple(ids[i]), SamplingParams(), 1, tenant=tenant, embed=True)
            events = submit(state, request)
            async with events:  # closing it releases the request, however this ends
                async for event in events:
                    if isinstance(event, Embedding):
                        vectors[i] = event.vector
                    elif isinstance(event, Failed):
                        raise failure(event)
                    elif isinstance(event, Finished):
                        break
                else:
                    raise ApiError(500, "the request was dropped", type="server_error")

    try:
        async with trio.open_nursery() as nursery:
            for _ in range(min(len(ids), max(1, state.slots // 2))):
                nursery.start_soon(worker)
    except BaseExceptionGroup as group:
        api_errors, _ = group.split(ApiError)
        if api_errors is None:
            raise
        first = api_errors
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None
    n = total
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": ENCODINGS[encoding](v)}
            for i, v in enumerate(vectors)
        ],
        "model": state.model_id,
        "usage": {"prompt_tokens": n, "total_tokens": n},
    }
