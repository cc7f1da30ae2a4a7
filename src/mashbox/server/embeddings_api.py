"""POST /v1/embeddings: one vector per input, pooled from the served model's hidden states.

Pooling: the mean of the final (normalized) hidden states over every token of the input,
L2-normalized, in float64. Each input is its own request through the scheduler (same slots,
queue limits and cancellation as generation) and runs alone in its slot, so a vector never
depends on what else is in the batch.
"""

from __future__ import annotations

import trio

from ..protocol import SamplingParams
from ..scheduler import Embedding, Failed, Finished, Request
from .errors import ApiError, bad_request, not_ready
from .generation import check_model
from .openai_api import failure, submit
from .state import ServerState
from .validate import Body


def inputs_of(body: Body) -> list[str]:
    value = body.raw("input")
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise bad_request("input must be a string or a non-empty list of strings", "input")
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
    if body.raw("encoding_format", "float") != "float":
        raise bad_request("encoding_format: only float is supported", "encoding_format")
    texts = inputs_of(body)
    tok = state.tokenizer
    ids = [tok.encode(text, add_bos=tok.add_bos) for text in texts]
    for i, tokens in enumerate(ids):
        if not tokens:
            raise bad_request(f"input[{i}] is empty", "input")
        if len(tokens) > state.ctx:
            raise bad_request(
                f"input[{i}] is {len(tokens)} tokens; the context is {state.ctx}", "input"
            )
    vectors: list[tuple[float, ...] | None] = [None] * len(ids)
    limit = trio.Semaphore(max(1, state.slots))  # at most a slot's worth in flight at once

    async def one(i: int) -> None:
        async with limit:
            request = Request(tuple(ids[i]), SamplingParams(), 1, tenant=tenant, embed=True)
            seq, events = submit(state, request)
            try:
                async with events:
                    async for event in events:
                        if isinstance(event, Embedding):
                            vectors[i] = event.vector
                        elif isinstance(event, Failed):
                            raise failure(event)
                        elif isinstance(event, Finished):
                            return
                raise ApiError(500, "the request was dropped", type="server_error")
            finally:
                state.scheduler.cancel(seq)

    try:
        async with trio.open_nursery() as nursery:
            for i in range(len(ids)):
                nursery.start_soon(one, i)
    except BaseExceptionGroup as group:
        api_errors, _ = group.split(ApiError)
        if api_errors is None:
            raise
        first = api_errors
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None
    n = sum(len(t) for t in ids)
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": list(v)} for i, v in enumerate(vectors)
        ],
        "model": state.model_id,
        "usage": {"prompt_tokens": n, "total_tokens": n},
    }
