"""POST /v1/systemone (typed decisions), GET /v1/limits: seed 004, TypeSafe Jev compatible.

One request is one scheduler request: its state is prefilled through a slot (the prompt
cache makes a repeated state free) and its questions are read after it, a prompt chunk's
worth of rows a step (`Batch._read`); nothing is generated. Errors come in seed 004's
`ErrorResponse` shape.
"""

from __future__ import annotations

import math

from ..events import Decision, Failed, Finished, Request, Restarted
from ..protocol import SamplingParams
from . import decision_labels as dl
from . import decisions as d
from .driver import failure, submit
from .errors import ApiError, invalid, not_ready
from .state import ServerState

MAX_SUFFIX_TOKENS = 65536  # all questions' suffixes together, per request


def limits(state: ServerState, max_body_bytes: int) -> dict:
    """Seed 004's `LimitsResponse`, from what this server really enforces."""
    return {
        "max_answers_per_question": d.MAX_OPTIONS,
        "max_questions": d.MAX_QUESTIONS,
        "max_body_bytes": max_body_bytes,
        "max_input_tokens": state.ctx,
        "max_concurrent_requests": state.slots,
        # Every label's probability is read exactly: no top-n cut-off applies.
        "top_n": state.info.vocab_size if state.info else 0,
    }


def model_entries(state: ServerState) -> list[dict]:
    """Seed 004's `models` list: names a request's `model` may use."""
    description = f"{state.model_id} served by mashbox"
    return [
        {"name": state.model_id, "description": description, "release_date": "1970-01-01"},
        {
            "name": d.TYPESAFE_MODEL,
            "description": f"alias of {state.model_id} for TypeSafe Jev clients",
            "release_date": "1970-01-01",
        },
    ]


async def systemone(state: ServerState, data, tenant: str = "") -> dict:
    """The answers to a typed-decision request (errors are ApiErrors, which the app renders
    in seed 004's shape on this route)."""
    if not isinstance(data, dict):
        raise invalid((), "the body must be a JSON object", "dict_type")
    # A field this route cannot honour is refused, not silently dropped: seed 001's `images`
    # (it needs a vision projector). Other unknown fields are ignored, as on every route.
    if data.get("images"):
        raise invalid(("images",), "this model reads text only", "extra_forbidden")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise invalid(("model",), f"is required: {d.TYPESAFE_MODEL} or {state.model_id}", "missing")
    if model not in (d.TYPESAFE_MODEL, state.model_id):
        raise invalid(
            ("model",),
            f"'{model}' is not served here (use {d.TYPESAFE_MODEL} or {state.model_id})",
            code="unknown_model",
        )
    if "state" not in data:
        raise invalid(("state",), "is required", "missing")
    questions = d.parse_questions(data.get("questions"))
    if not state.ready:
        raise not_ready()

    tok = state.tokenizer
    before, after = d.render_split(state.template, d.state_messages(data["state"]))
    labels = dl.labels_for(tok, after)
    chosen = {}
    for qid, q in questions.items():
        chosen[qid] = labels.for_question(q)
        if chosen[qid] is None:
            why = f"this model's vocabulary cannot label {len(q.keys)} options"
            raise invalid(("questions", qid, "criteria"), why)
    texts = [d.question_text(q, chosen[qid]) + after for qid, q in questions.items()]
    prefix, suffixes = d.tokenize_split(tok, before, texts)
    longest = max(len(s) for s in suffixes) + 1  # a leaf may follow the suffix
    if not prefix or len(prefix) + longest > state.ctx:
        raise invalid(
            ("state",),
            f"the state and its longest question are {len(prefix) + longest} tokens; "
            f"the context is {state.ctx}",
            code="too_many_tokens",
        )
    if sum(len(s) for s in suffixes) > MAX_SUFFIX_TOKENS:
        raise invalid(("questions",), f"the questions are more than {MAX_SUFFIX_TOKENS} tokens",
                      code="too_many_tokens")  # fmt: skip
    branches = [
        dl.branch_for(suffix, chosen[qid]) for qid, suffix in zip(questions, suffixes, strict=True)
    ]
    request = Request(tuple(prefix), SamplingParams(), 1, tenant=tenant, branches=tuple(branches))
    reads = await _run(state, request)

    answers = {}
    for (qid, q), branch, read in zip(questions.items(), branches, reads, strict=True):
        logprobs = dl.label_logprobs(branch, chosen[qid], read)
        if not all(math.isfinite(lp) for lp in logprobs):
            raise ApiError(502, "the model gave non-finite probabilities", code="backend_error")
        answers[qid] = dl.answer(q, dl.softmax(logprobs))
    read_tokens = sum(len(b.token_ids) + len(b.leaves) for b in branches)
    return {
        "model": model,
        "answers": answers,
        "usage": {"input_tokens": len(prefix) + read_tokens, "output_tokens": len(questions) + 1},
    }


async def _run(state: ServerState, request: Request):
    """Submit the decision and wait for its reads; the request is released however this
    ends (a client that disconnects cancels it)."""
    reads = None
    async with submit(state, request) as events:  # closing it releases the request
        async for event in events:
            if isinstance(event, Decision):
                reads = event.logprobs
            elif isinstance(event, Restarted):
                reads = None
            elif isinstance(event, Failed):
                raise failure(event)
            elif isinstance(event, Finished) and reads is not None:
                return reads
    raise ApiError(500, "the request was dropped before it finished", type="server_error")
