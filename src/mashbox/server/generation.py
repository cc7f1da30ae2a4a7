"""Turn the sampling and limit fields shared by the generation routes into a `Request`."""

from __future__ import annotations

import logging
import time

from ..protocol import SamplingParams
from ..scheduler import Finished, Request, random_seed
from .errors import ApiError, bad_request
from .state import ServerState
from .validate import Body


def check_model(body: Body, state: ServerState) -> None:
    """404 model_not_found for another model id; leaving `model` out is fine."""
    model = body.str("model")
    if model is not None and model != state.model_id:
        raise ApiError(
            404,
            f"model '{model}' is not served here (this server runs '{state.model_id}')",
            param="model",
            code="model_not_found",
        )


def sampling_params(body: Body) -> SamplingParams:
    """Every sampling field with the seed's ranges; out of range is a 400 naming the field."""
    if body.int("n", 1) != 1:
        raise bad_request("n must be 1", "n")
    seed = body.int("seed")
    return SamplingParams(
        temperature=body.number("temperature", 0.0, lo=0, hi=4),
        top_p=body.number("top_p", 1.0, lo=0, hi=1, lo_open=True),
        top_k=body.int("top_k", 0, lo=0),
        min_p=_min_p(body),
        repetition_penalty=body.number("repetition_penalty", 1.0, lo=0, lo_open=True),
        frequency_penalty=body.number("frequency_penalty", 0.0, lo=-2, hi=2),
        presence_penalty=body.number("presence_penalty", 0.0, lo=-2, hi=2),
        seed=random_seed() if seed is None else seed,
    )


def _min_p(body: Body) -> float:
    value = body.number("min_p", 0.0, lo=0)
    if value >= 1:
        raise bad_request("min_p must be in [0, 1)", "min_p")
    return value


def stop_strings(body: Body) -> tuple[str, ...]:
    """`stop` (a string or list of non-empty strings), else Anthropic's `stop_sequences`."""
    name = "stop" if body.has("stop") else "stop_sequences"
    value = body.raw(name)
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise bad_request(f"{name} must be a string or a list of non-empty strings", name)
    return tuple(value)


def max_new_tokens(body: Body, prompt_len: int, ctx: int) -> int:
    """max_completion_tokens wins over max_tokens; default: up to the end of the context."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.int(name, lo=1)
        if value is not None:
            return value
    return max(ctx - prompt_len, 1)


def build_request(body: Body, state: ServerState, prompt_ids: list[int], tenant: str) -> Request:
    """Check the prompt fits the context and gather the generation fields."""
    if len(prompt_ids) >= state.ctx:
        raise bad_request(
            f"the prompt is {len(prompt_ids)} tokens; the context is {state.ctx} tokens "
            "(it must leave room for at least one new token)",
            next((k for k in ("messages", "input", "prompt") if k in body.data), "messages"),
        )
    return Request(
        prompt_ids=tuple(prompt_ids),
        params=sampling_params(body),
        max_tokens=max_new_tokens(body, len(prompt_ids), state.ctx),
        stop=stop_strings(body),
        tenant=tenant,
        ignore_eos=body.bool("ignore_eos", False),
        stream=body.bool("stream", False),
    )


log = logging.getLogger("mashbox")


def log_request(route: str, status: int, done: Finished | None, session: str | None, t0: float):
    """One server log line per request when it ends (never a key, never the text)."""
    total_ms = (time.perf_counter() - t0) * 1000
    if done is None:
        log.info("%s %d total=%.0fms session=%s", route, status, total_ms, session or "-")
        return
    u, t = done.usage, done.timings
    log.info(
        "%s %d prompt=%d cached=%d generated=%d queue=%.0fms total=%.0fms finish=%s session=%s",
        route, status, u.prompt_tokens, u.cached_tokens, u.completion_tokens,
        t.queue_ms, total_ms, done.reason, session or "-",
    )  # fmt: skip
