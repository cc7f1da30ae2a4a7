"""Turn the sampling and limit fields shared by the generation routes into a `Request`."""

from __future__ import annotations

import functools
import hashlib
import logging
import time

import attrs
import trio

from ..events import MAX_WAITING_PER_TENANT, Finished, Request, random_seed
from ..protocol import SamplingParams
from ..text.stops import MAX_STOP_CHARS, MAX_STOPS
from .errors import ApiError, bad_request, queue_full, too_long
from .per_tenant import PerTenant
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


MAX_CHOICES = 8  # `n`'s bound on the routes that answer several choices


def choice_count(body: Body, most: int = 1) -> int:
    """`n`: how many choices the answer holds, 1 to `most` (the route's bound)."""
    if most == 1:
        if body.int("n", 1) != 1:
            raise bad_request("n must be 1", "n")
        return 1
    return body.int("n", 1, lo=1, hi=most)


def choice_seed(seed: int, index: int) -> int:
    """Choice `index`'s sampling seed: the request's for choice 0 (so n=1 answers are what
    they were); else the first 8 bytes of SHA-256 of the ASCII text "{seed}:{index}", big
    endian, shifted right one bit (63 bits). A client asks for that choice alone with it."""
    if index == 0:
        return seed
    digest = hashlib.sha256(f"{seed}:{index}".encode("ascii")).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def choice_request(request: Request, index: int) -> Request:
    """Choice `index` of a request's n: the same request, sampled with its own seed."""
    if index == 0:
        return request
    params = attrs.evolve(request.params, seed=choice_seed(request.params.seed, index))
    return attrs.evolve(request, params=params)


def sampling_params(
    body: Body, logprobs: int = -1, *, most_choices: int = 1, vocab_size: int = 0
) -> SamplingParams:
    """Every sampling field with the seed's ranges; out of range is a 400 naming the field.
    logprobs: -1 none, else the likeliest tokens to report with each sampled one.
    most_choices: the route's bound on `n` (1: it answers one choice). vocab_size: the token
    ids logit_bias may name."""
    choice_count(body, most_choices)
    seed = body.int("seed", lo=-(2**63), hi=2**63 - 1)  # int64, as OpenAI's and vLLM's
    return SamplingParams(
        temperature=body.number("temperature", 0.0, lo=0, hi=4),
        top_p=body.number("top_p", 1.0, lo=0, hi=1, lo_open=True),
        top_k=_top_k(body),
        min_p=_min_p(body),
        repetition_penalty=body.number("repetition_penalty", 1.0, lo=0, lo_open=True),
        frequency_penalty=body.number("frequency_penalty", 0.0, lo=-2, hi=2),
        presence_penalty=body.number("presence_penalty", 0.0, lo=-2, hi=2),
        logit_bias=logit_bias(body, vocab_size),
        seed=random_seed() if seed is None else seed,
        logprobs=logprobs,
    )


MAX_LOGIT_BIAS = 300  # tokens one request may bias, as OpenAI's bound


def logit_bias(body: Body, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """`logit_bias`: token ids (decimal strings, as JSON keys are) to a number from -100 to
    100 added to that token's logit (OpenAI's); at most MAX_LOGIT_BIAS of them, each a token
    of this model's vocabulary. Sorted (id, bias) pairs."""
    bias = body.object("logit_bias")
    if bias is None:
        return ()
    if len(bias.data) > MAX_LOGIT_BIAS:
        raise bad_request(
            f"logit_bias holds {len(bias.data)} tokens; at most {MAX_LOGIT_BIAS}", "logit_bias"
        )
    pairs = {}
    for key, value in bias.data.items():
        if not (key.isascii() and key.isdigit() and len(key) < 10 and int(key) < vocab_size):
            last = vocab_size - 1
            why = f"{key[:20]!r} is not a token id of this model (0 to {last})"
            raise bad_request(f"logit_bias: {why}", "logit_bias")
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not (number and -100 <= value <= 100):  # NaN too
            why = f"logit_bias[{key!r}] must be a number from -100 to 100"
            raise bad_request(why, "logit_bias")
        pairs[int(key)] = float(value)
    return tuple(sorted(pairs.items()))


def _top_k(body: Body) -> int:
    """0 = off; -1 is vLLM's and SGLang's "off", which routers in front of us forward."""
    value = body.int("top_k", 0)
    if value < -1:
        raise bad_request("top_k must be >= 0 (or -1: off, the same as 0)", "top_k")
    return max(value, 0)


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
    if len(value) > MAX_STOPS:
        raise bad_request(f"{name} holds {len(value)} strings; at most {MAX_STOPS}", name)
    if any(len(s) > MAX_STOP_CHARS for s in value):
        raise bad_request(f"each of {name} must be at most {MAX_STOP_CHARS} characters", name)
    return tuple(value)


def max_new_tokens(body: Body, prompt_len: int, ctx: int) -> int:
    """max_completion_tokens wins over max_tokens; default: up to the end of the context."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.int(name, lo=1)
        if value is not None:
            return value
    return max(ctx - prompt_len, 1)


# Threads tokenizing at once, all requests together: prompts are tokenized off the event loop
# (~0.7 s a MiB), and one tenant's big ones queue here, not in front of everyone's events.
TOKENIZING = trio.CapacityLimiter(2)
# Prompts of one tenant being tokenized or waiting to be: past this, a 429, so one tenant's
# flood cannot fill the line in front of everyone else's. As many as may wait for a slot.
TOKENIZING_PER_TENANT = PerTenant(MAX_WAITING_PER_TENANT)


async def encode_prompt(
    state: ServerState,
    text: str,
    field: str,
    *,
    tenant: str = "",
    rendered: bool = False,
    add_bos: bool | None = None,
) -> list[int]:
    """The prompt's token ids (bos first where the model wants it, or where add_bos says),
    counted off the event loop; a text too long for any context is a 400 before any work is
    done on it. rendered: a chat template's output, whose client text `chat.render` defused
    (a raw completions prompt is the client's own, special tokens and all)."""
    tok = state.tokenizer
    if len(text) > state.ctx * tok.max_token_chars:
        raise too_long(
            f"{field}: {len(text)} characters, more than a {state.ctx}-token context can hold",
            field,
        )
    encode = functools.partial(
        tok.encode_rendered if rendered else tok.encode,
        text,
        add_bos=tok.add_bos if add_bos is None else add_bos,
    )
    with TOKENIZING_PER_TENANT.hold(tenant, _tokenizing_refused):
        return await trio.to_thread.run_sync(encode, limiter=TOKENIZING)


def _tokenizing_refused(most: int) -> ApiError:
    return queue_full(f"{most} of your prompts are being tokenized", whole_queue=False)


def system_fingerprint(state: ServerState, request: Request) -> str:
    """What the request's answer repeats under: its seed and this deployment's answers id."""
    identity = state.loaded.identity if state.loaded else None
    seed = request.params.seed
    return identity.system_fingerprint(seed) if identity else f"seed-{seed}"


def prompt_field(body: Body) -> str:
    """The field that holds a request's prompt, for errors to name."""
    return next((k for k in ("messages", "input", "prompt") if k in body.data), "messages")


def biasable_tokens(state: ServerState) -> int:
    """How many token ids logit_bias may name: the tokenizer's, within the model's logits."""
    info = state.info
    return min(state.tokenizer.vocab_size, info.vocab_size if info else 2**31)


def check_token_ids(ids: list, vocab: int, where: str) -> None:
    """A 400 naming `where` for an item of `ids` that is not an integer token id below
    `vocab` (the client's own token ids: completions' prompts, /detokenize)."""
    for token in ids:
        if not isinstance(token, int) or isinstance(token, bool):
            raise bad_request(f"{where} must be a list of token ids (integers)", where)
        if not 0 <= token < vocab:
            raise bad_request(
                f"{where}: token id {token} is not in the vocabulary (0 to {vocab - 1})", where
            )


def check_fits(body: Body, state: ServerState, prompt_tokens: int, field: str = "") -> None:
    """A 400 for a prompt that leaves no room in the context for one new token."""
    if prompt_tokens >= state.ctx:
        raise too_long(
            f"{field or 'the prompt'} is {prompt_tokens} tokens; the context is {state.ctx} "
            "tokens (it must leave room for at least one new token)",
            field or prompt_field(body),
        )


def for_prompt(body: Body, state: ServerState, request: Request, prompt_ids) -> Request:
    """`request` asked of another prompt, one that fits (completions' list of prompts): the
    same sampling, seed and grammar, so each prompt is answered as it would be alone."""
    max_tokens = max_new_tokens(body, len(prompt_ids), state.ctx)
    return attrs.evolve(request, prompt_ids=tuple(prompt_ids), max_tokens=max_tokens)


def build_request(
    body: Body,
    state: ServerState,
    prompt_ids: list[int],
    tenant: str,
    *,
    logprobs: int = -1,
    most_choices: int = 1,
) -> Request:
    """Check the prompt fits the context and gather the generation fields (choice 0's, where
    `n` asks for several: `choice_request`)."""
    check_fits(body, state, len(prompt_ids))
    return Request(
        prompt_ids=tuple(prompt_ids),
        params=sampling_params(
            body, logprobs, most_choices=most_choices, vocab_size=biasable_tokens(state)
        ),
        max_tokens=max_new_tokens(body, len(prompt_ids), state.ctx),
        stop=stop_strings(body),
        tenant=tenant,
        ignore_eos=body.bool("ignore_eos", False),
        stream=body.bool("stream", False),
    )


log = logging.getLogger("mashbox")


MAX_SESSION_CHARS = 64  # a longer or unprintable session tag is logged as its hash


def log_tag(body: Body, headers, tenant: str) -> str:
    """What a request's log line names: its tenant (never the key) and its session tag
    (prompt_cache_key or X-Session-Id), cut to a safe printable form."""
    session = body.str("prompt_cache_key") or headers.get("x-session-id") or "-"  # any case
    if len(session) > MAX_SESSION_CHARS or not session.isprintable() or " " in session:
        session = "sha256:" + hashlib.sha256(session.encode("utf-8", "replace")).hexdigest()[:16]
    return f"tenant={tenant or '-'} session={session}"


def log_request(route: str, status: int, done: Finished | None, tag: str, t0: float):
    """One server log line per request when it ends (never a key, never the text)."""
    total_ms = (time.perf_counter() - t0) * 1000
    if done is None:
        log.info("%s %d total=%.0fms %s", route, status, total_ms, tag)
        return
    u, t = done.usage, done.timings
    log.info(
        "%s %d prompt=%d cached=%d generated=%d queue=%.0fms total=%.0fms finish=%s %s",
        route,
        status,
        u.prompt_tokens,
        u.cached_tokens,
        u.completion_tokens,
        t.queue_ms,
        total_ms,
        done.reason,
        tag,
    )
