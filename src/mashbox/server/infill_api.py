"""llama-server's `POST /infill`, past the seeds: code completion for editors (llama.vscode,
llama.vim and others that speak it). The code before the cursor (`input_prefix`, then
`prompt`), the code after it (`input_suffix`) and other files' chunks (`input_extra`) go to
the model between its fill-in-the-middle markers as llama-server writes them; the answer is
the middle, in llama-server's /completion shape (llama_answer.py), whole or streamed."""

from __future__ import annotations

import attrs

from .driver import Call
from .errors import bad_request
from .generation import build_request, check_model, encode_prompt, system_fingerprint
from .llama_answer import (
    LlamaEncoder,
    Shape,
    as_completion_fields,
    line_limits,
    response_fields,
)
from .openai_completions import Infill
from .state import ServerState
from .validate import Body

# Chunks of other files an editor may send as context: llama.vscode sends up to 16 a request.
MAX_EXTRA_CHUNKS = 128


@attrs.frozen
class Pieces:
    """A request's token ids, before they are fitted to the context."""

    extra: list[int]  # other files' chunks, the repository and file names
    prefix: list[int]  # input_prefix
    prompt: list[int]  # `prompt`: the text at the cursor, after the prefix
    suffix: list[int]  # input_suffix


# llama-server's default batch (-b): it keeps at most 3/4 of it of the prefix's end and 1/4 of
# it, less the prompt and two, of the suffix's start, whatever the context.
LLAMA_SERVER_BATCH = 2048


def fit(state: ServerState, p: Pieces, reserve: int) -> tuple[list[int], bool]:
    """[extra] [bos] <prefix> PREFIX PROMPT <suffix> SUFFIX <middle>, as llama-server writes
    it: the prefix and suffix first cut as llama-server cuts them (LLAMA_SERVER_BATCH), then
    all of it to leave `reserve` tokens of the context for the answer, the code nearest the
    cursor kept first (the prompt whole, then the prefix's end and the suffix's start, 3:1
    while both are longer than their share), other files' chunks with what is left, their
    latest part. Returns the ids and whether anything was cut."""
    tok = state.tokenizer
    room = state.ctx - reserve - Infill.of(tok, []).extra(text=True) - len(p.prompt)
    if room < 0:
        raise bad_request(
            f"prompt is {len(p.prompt)} tokens; with the markers it leaves no room in the "
            f"{state.ctx}-token context",
            "prompt",
        )
    quarter = LLAMA_SERVER_BATCH // 4
    prefix = p.prefix[max(len(p.prefix) - 3 * quarter, 0) :]
    suffix = p.suffix[: max(quarter - 2 - len(p.prompt), 0)]
    suffix_take = min(len(suffix), max(room // 4, room - len(prefix)))
    prefix_take = min(len(prefix), room - suffix_take)
    extra_take = min(len(p.extra), room - suffix_take - prefix_take)
    cursor = [*prefix[len(prefix) - prefix_take :], *p.prompt]
    ids = [
        *p.extra[len(p.extra) - extra_take :],
        *Infill.of(tok, suffix[:suffix_take]).around(cursor, text=True),
    ]
    kept = (extra_take, prefix_take, suffix_take)
    return ids, kept != (len(p.extra), len(p.prefix), len(p.suffix))


async def pieces(state: ServerState, body: Body, tenant: str) -> Pieces:
    """The request's texts, every one checked before any is tokenized, then each tokenized
    off the event loop as a completions prompt is."""
    prefix, prompt, suffix = (body.str(k, "") for k in ("input_prefix", "prompt", "input_suffix"))
    chunks = extra_chunks(body, state.ctx * state.tokenizer.max_token_chars)

    async def ids(text: str, field: str) -> list[int]:
        return await encode_prompt(state, text, field, tenant=tenant, add_bos=False) if text else []

    tok = state.tokenizer
    file_sep, repo = tok.fim_file_id, tok.fim_repo_id
    extra = []
    if repo is not None:  # llama-server names the repository, then each file
        extra += [repo, *await ids("myproject\n", "input_extra")]
    for i, (filename, text) in enumerate(chunks):
        where = f"input_extra[{i}]"
        if file_sep is not None:
            extra += [file_sep, *await ids(filename + "\n", f"{where}.filename")]
        else:  # llama-server's separator where the model has none
            extra += await ids("\n\n--- snippet ---\n\n", where)
        extra += await ids(text, f"{where}.text")
    if file_sep is not None:  # and the file being edited, whose name it does not know
        extra += [file_sep, *await ids("filename\n", "input_extra")]
    return Pieces(
        extra,
        await ids(prefix, "input_prefix"),
        await ids(prompt, "prompt"),
        await ids(suffix, "input_suffix"),
    )


def extra_chunks(body: Body, most_chars: int) -> list[tuple[str, str]]:
    """`input_extra`'s (filename, text) pairs: at most MAX_EXTRA_CHUNKS, and all the texts
    together at most `most_chars`, what one prompt may hold (only a context's worth can be
    read, and the tokenizer's threads are everyone's)."""
    chunks = body.list("input_extra", [])
    if len(chunks) > MAX_EXTRA_CHUNKS:
        raise bad_request(
            f"input_extra: {len(chunks)} chunks; at most {MAX_EXTRA_CHUNKS}", "input_extra"
        )
    pairs = []
    for i, chunk in enumerate(chunks):
        where = f"input_extra[{i}]"
        if not isinstance(chunk, dict):
            raise bad_request(f"{where} must be an object with filename and text", where)
        pairs.append(tuple(_chunk_text(chunk, where, k, d) for k, d in _CHUNK_FIELDS))
    chars = sum(len(text) for _, text in pairs)
    if chars > most_chars:
        raise bad_request(
            f"input_extra: {chars} characters in all its texts, more than a context can hold",
            "input_extra",
        )
    return pairs


_CHUNK_FIELDS = (("filename", "tmp"), ("text", ""))


def _chunk_text(chunk: dict, where: str, name: str, default: str) -> str:
    value = chunk.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise bad_request(f"{where}.{name} must be a string", f"{where}.{name}")
    return value


async def parse(state: ServerState, body: Body, tenant: str) -> Call:
    check_model(body, state)
    if state.tokenizer.fim_ids is None:
        raise bad_request(
            f"/infill is not supported by {state.model_id}: its vocabulary has no "
            "fill-in-the-middle tokens",
            None,
        )
    fields = as_completion_fields(body)
    warm_only = body.int("n_predict") == 0
    wanted = response_fields(body)
    reserve = min(fields.int("max_tokens") or state.ctx // 4, state.ctx // 2)
    ids, cut = fit(state, await pieces(state, body, tenant), reserve)
    request = attrs.evolve(build_request(fields, state, ids, tenant), lines=line_limits(body))
    fingerprint = system_fingerprint(state, request)
    shape = Shape(state.model_id, fingerprint, (len(ids),), cut, warm_only, wanted)
    return Call(request, None, LlamaEncoder(shape))
