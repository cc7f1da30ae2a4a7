"""llama-server's `POST /completion` (and `/completions`), past the seeds: a raw prompt's
continuation in llama-server's own shape (llama_answer.py), for the clients written against
it (SillyTavern's and Continue's llama.cpp backends, scripts). The prompt is a string, token
ids, a list of both, or a list of such prompts (each answered on its own, the answer a list).
llama-server's samplers that mashbox lacks are a 400 when set to anything but their neutral
value, never silently skipped."""

from __future__ import annotations

import attrs

from .driver import Call
from .errors import bad_request, too_long
from .generation import (
    biasable_tokens,
    build_request,
    check_fits,
    check_model,
    check_token_ids,
    encode_prompt,
    for_prompt,
    system_fingerprint,
)
from .llama_answer import (
    LlamaEncoder,
    Shape,
    as_completion_fields,
    line_limits,
    response_fields,
)
from .openai_completions import MAX_ANSWERS, is_token, prompt_where
from .state import ServerState
from .structured import AnswerSchema, constrain
from .token_logprobs import MAX_TOP_LOGPROBS
from .validate import Body

# llama-server's samplers mashbox does not have, at the values that leave them off (which
# its clients send by default).
NEUTRAL = {
    "typical_p": 1, "mirostat": 0, "dry_multiplier": 0, "xtc_probability": 0,
    "dynatemp_range": 0,
}  # fmt: skip


def refuse_what_is_not_done(body: Body) -> None:
    """A 400 naming the field, rather than an answer that ignored it."""
    for name, neutral in NEUTRAL.items():
        value = body.number(name)
        if value is not None and value != neutral:
            raise bad_request(
                f"{name} is not supported (only {neutral}, which leaves that sampler off)", name
            )
    if body.str("grammar"):
        raise bad_request("grammar (GBNF) is not supported; json_schema is", "grammar")
    if body.bool("post_sampling_probs", False):
        raise bad_request(
            "post_sampling_probs is not supported: n_probs gives the model's log-probs",
            "post_sampling_probs",
        )
    for name in ("lora", "image_data", "multimodal_data"):
        if body.raw(name):
            raise bad_request(f"{name} is not supported", name)


def llama_prompts(body: Body) -> list:
    """`prompt` as llama-server reads it: a string, token ids, or ids and strings mixed, is
    one prompt; a list with no number in it is several, each of those forms."""
    prompt = body.raw("prompt")
    if prompt is None:
        raise bad_request("prompt is required", "prompt")
    if not isinstance(prompt, list) or any(is_token(p) for p in prompt):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if len(prompt) > MAX_ANSWERS:
        raise bad_request(f"prompt: {len(prompt)} prompts; at most {MAX_ANSWERS}", "prompt")
    return prompt


async def prompt_ids(state: ServerState, body: Body, prompt, where: str, tenant: str) -> list:
    """One prompt's token ids: a string's with the bos where the model wants one, token ids
    as they are, and in a mixed list each string's tokens in its place (the bos only before
    a string that comes first, as llama-server)."""
    pieces = prompt if isinstance(prompt, list) else [prompt]
    if not pieces or not all(isinstance(p, str) or is_token(p) for p in pieces):
        raise bad_request(
            f"{where} must be a string, a list of token ids, or a list of token ids and strings",
            where,
        )
    check_fits(body, state, len(pieces), where)  # each piece is a token at least
    check_token_ids([p for p in pieces if not isinstance(p, str)], biasable_tokens(state), where)
    chars = sum(len(p) for p in pieces if isinstance(p, str))
    if chars > state.ctx * state.tokenizer.max_token_chars:
        raise too_long(
            f"{where}: {chars} characters, more than a {state.ctx}-token context can hold", where
        )
    ids = []
    for i, piece in enumerate(pieces):
        if isinstance(piece, str):
            bos = None if i == 0 else False  # None: as the model wants
            ids += await encode_prompt(state, piece, where, tenant=tenant, add_bos=bos)
        else:
            ids.append(piece)
    if not ids:
        raise bad_request(f"{where} must not be empty", where)
    check_fits(body, state, len(ids), where)
    return ids


async def parse(state: ServerState, body: Body, tenant: str) -> Call:
    check_model(body, state)
    refuse_what_is_not_done(body)
    fields = as_completion_fields(body)
    n_probs = body.int("n_probs", 0, lo=0, hi=MAX_TOP_LOGPROBS)
    return_tokens = body.bool("return_tokens", False)
    wanted = response_fields(body)
    prompts = llama_prompts(body)
    ids = [
        await prompt_ids(state, body, p, prompt_where(i, len(prompts)), tenant)
        for i, p in enumerate(prompts)
    ]
    logprobs = n_probs if n_probs else (0 if return_tokens else -1)  # 0: the ids alone
    request = build_request(fields, state, ids[0], tenant, logprobs=logprobs)
    request = attrs.evolve(request, lines=line_limits(body))
    schema = body.object("json_schema")
    if schema is not None:  # llama-server's: the answer is JSON of this schema
        request = await constrain(
            state, request, None, answer=AnswerSchema(schema.data, True, "json_schema")
        )
    others = tuple(for_prompt(fields, state, request, more) for more in ids[1:])
    shape = Shape(
        state.model_id,
        system_fingerprint(state, request),
        tuple(map(len, ids)),
        warm_only=body.int("n_predict") == 0,
        wanted=wanted,
        token_bytes=state.tokenizer.token_bytes if n_probs else None,
        return_tokens=return_tokens,
    )
    return Call(request, None, LlamaEncoder(shape), more_prompts=others)
