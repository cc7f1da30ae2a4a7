"""llama-server's `POST /infill`, past the seeds: code completion for editors (llama.vscode,
llama.vim and others that speak it). The code before the cursor (`input_prefix`, then
`prompt`), the code after it (`input_suffix`) and other files' chunks (`input_extra`) go to
the model between its fill-in-the-middle markers as llama-server writes them; the answer is
the middle, in llama-server's /completion shape, whole or streamed."""

from __future__ import annotations

import attrs

from ..text.line_limits import LineLimits
from .chat import Answer, Logprobs
from .driver import Call, Frame, OneFieldFrame, frame
from .errors import bad_request
from .generation import build_request, check_model, encode_prompt, system_fingerprint
from .openai_chat import error_frame
from .openai_completions import Infill
from .state import ServerState
from .validate import Body

# Chunks of other files an editor may send as context: llama.vscode sends up to 16 a request.
MAX_EXTRA_CHUNKS = 128
# The fields read as they are; besides these, n_predict, repeat_penalty, response_fields,
# n_indent and t_max_predict_ms are read, and llama-server's others (cache_prompt, samplers,
# t_max_prompt_ms, which llama-server does not implement either, id_slot) are accepted and
# ignored.
SAME_FIELDS = (
    "model", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "presence_penalty",
    "frequency_penalty", "stream", "ignore_eos",
)  # fmt: skip


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


def as_completion_fields(body: Body) -> Body:
    """The generation fields under the names /v1/completions reads them by, each checked
    under its own name first: n_predict (-1 or absent: to the end of the context; 0: the
    prompt is read into the cache and nothing is answered, as llama.vscode warms it), and
    repeat_penalty."""
    n_predict = body.int("n_predict", lo=-1)
    penalty = body.number("repeat_penalty", lo=0, lo_open=True)
    data = {k: body.data[k] for k in SAME_FIELDS if k in body.data}
    if n_predict is not None and n_predict >= 0:
        data["max_tokens"] = max(n_predict, 1)
    if penalty is not None:
        data["repetition_penalty"] = penalty
    return Body(data)


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
    encoder = InfillEncoder(
        state.model_id, system_fingerprint(state, request), len(ids), cut, warm_only, wanted
    )
    return Call(request, None, encoder)


def line_limits(body: Body) -> LineLimits | None:
    """llama-server's `n_indent` (the cursor line's indentation: a later line indented less
    ends the answer; 0: none) and `t_max_predict_ms` (past it, the next newline ends the
    answer; 0 or less: none)."""
    indent = body.int("n_indent", 0, lo=0)
    ms = body.number("t_max_predict_ms")
    seconds = ms / 1000 if ms is not None and ms > 0 else None
    if indent == 0 and seconds is None:
        return None
    return LineLimits(indent, seconds)


MAX_RESPONSE_FIELDS = 64


def response_fields(body: Body) -> tuple[str, ...] | None:
    """llama-server's `response_fields`: the answer holds only these, each a path into the
    whole answer ("timings/prompt_n"), under that path as its key (llama.vscode and llama.vim
    read them so); None: all of it."""
    paths = body.list("response_fields")
    if paths is None:
        return None
    if len(paths) > MAX_RESPONSE_FIELDS or not all(
        isinstance(p, str) and len(p) <= 256 for p in paths
    ):
        raise bad_request(
            f"response_fields must be at most {MAX_RESPONSE_FIELDS} strings of at most 256 "
            "characters",
            "response_fields",
        )
    return tuple(paths)


def picked(answer: dict, paths: tuple[str, ...]) -> dict:
    """The values at `paths` in the answer, keyed by path; a path that leads nowhere is left
    out (as llama-server does)."""
    out = {}
    for path in paths:
        value = answer
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            out[path] = value
    return out


class InfillEncoder:
    """The middle in llama-server's /completion shape: `content`, `stop`, `stop_type` and
    its counts and timings; streamed as data-only events of `content` pieces, the last one
    with `stop: true` and the rest (no [DONE], as llama-server)."""

    ping_every = None
    waits_for_admission = False

    def __init__(
        self,
        model: str,
        fingerprint: str,
        prompt_n: int,
        cut: bool,
        warm_only: bool,
        wanted: tuple[str, ...] | None = None,
    ):
        """prompt_n: the prompt's tokens; cut: whether text was cut to fit; warm_only: answer
        nothing (n_predict 0); wanted: response_fields, for the whole answer."""
        self.base = {"index": 0, "model": model, "system_fingerprint": fingerprint}
        self.prompt_n, self.cut, self.warm_only, self.wanted = prompt_n, cut, warm_only, wanted
        self.text = OneFieldFrame(lambda text: frame({**self.base, "content": text, "stop": False}))
        self.new_line = False  # in the text streamed so far

    def start(self, cached: int | None) -> list[Frame]:
        return []

    def feed(self, item) -> list[Frame]:
        if isinstance(item, Logprobs) or self.warm_only:
            return []
        self.new_line = self.new_line or "\n" in item.text
        return [self.text(item.text)]

    def finish(self, done) -> list[Frame]:
        return [frame({**self.base, **self._end(done, self.new_line), "content": ""})]

    def fail(self, message: str, status: int) -> list[Frame]:
        return [error_frame("infill", message)]

    def whole(self, answer: Answer) -> dict:
        text = "" if self.warm_only else answer.text()
        whole = {**self.base, "content": text, **self._end(answer.done, "\n" in text)}
        return whole if self.wanted is None else picked(whole, self.wanted)

    def _end(self, done, new_line: bool) -> dict:
        predicted = 0 if self.warm_only else done.usage.completion_tokens
        if done.reason == "length":
            stop_type = "limit"
        else:
            stop_type = "word" if done.stop_sequence else "eos"
        return {
            "stop": True,
            "stop_type": stop_type,
            "stopping_word": done.stop_sequence or "",
            "tokens_predicted": predicted,
            "tokens_evaluated": self.prompt_n,
            "tokens_cached": done.timings.cache_n,
            "truncated": self.cut,
            "has_new_line": new_line,
            "timings": _timings(done.timings),
        }


def _timings(timings) -> dict:
    """llama-server's timings block, with its per-token milliseconds (editors show them)."""
    out = attrs.asdict(timings)
    for part in ("prompt", "predicted"):
        n = out[f"{part}_n"]
        out[f"{part}_per_token_ms"] = round(out[f"{part}_ms"] / n, 3) if n else None
    return out
