"""llama-server's own request fields and answer shape, which its `/completion` and `/infill`
share (mashbox serves both, past the seeds): the fields under llama-server's names mapped
onto /v1/completions', and the answer (`content`, `stop_type`, its counts and timings),
whole or as data-only events."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from ..text.line_limits import LineLimits
from .chat import Answer, Logprobs
from .driver import Frame, OneFieldFrame, frame
from .errors import bad_request
from .generation import MAX_LOGIT_BIAS
from .openai_chat import error_frame
from .validate import Body

# The fields read as they are; besides these, n_predict, repeat_penalty, logit_bias,
# response_fields, n_indent and t_max_predict_ms are read, and llama-server's others that
# change no answer (cache_prompt: mashbox always caches; samplers; id_slot; t_max_prompt_ms,
# which llama-server does not implement either) are accepted and ignored, as is
# repeat_last_n: repeat_penalty is /v1/completions' repetition_penalty, over every token.
SAME_FIELDS = (
    "model", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "presence_penalty",
    "frequency_penalty", "stream", "ignore_eos",
)  # fmt: skip


def as_completion_fields(body: Body) -> Body:
    """The generation fields under the names /v1/completions reads them by, each checked
    under its own name first: n_predict (-1 or absent: to the end of the context; 0: the
    prompt is read into the cache and nothing is answered, as llama.vscode warms it),
    repeat_penalty, and logit_bias in llama-server's form too."""
    n_predict = body.int("n_predict", lo=-1)
    penalty = body.number("repeat_penalty", lo=0, lo_open=True)
    data = {k: body.data[k] for k in SAME_FIELDS if k in body.data}
    if n_predict is not None and n_predict >= 0:
        data["max_tokens"] = max(n_predict, 1)
    if penalty is not None:
        data["repetition_penalty"] = penalty
    bias = logit_bias(body)
    if bias is not None:
        data["logit_bias"] = bias
    return Body(data)


def logit_bias(body: Body) -> dict | None:
    """`logit_bias` as OpenAI writes it ({"id": bias}) or as llama-server does ([[id, bias],
    ...], false for never), as OpenAI's: -100 to 100 (false is -100)."""
    bias = body.raw("logit_bias")
    if not isinstance(bias, list):
        return bias
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(
            f"logit_bias holds {len(bias)} tokens; at most {MAX_LOGIT_BIAS}", "logit_bias"
        )
    out = {}
    for i, pair in enumerate(bias):
        ok = isinstance(pair, list) and len(pair) == 2 and type(pair[0]) is int
        if not ok or not (pair[1] is False or type(pair[1]) in (int, float)):
            raise bad_request(
                f"logit_bias[{i}] must be [token id, bias or false] (token texts are not "
                "supported)",
                "logit_bias",
            )
        out[str(pair[0])] = -100 if pair[1] is False else pair[1]
    return out


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


@attrs.frozen
class Shape:
    """What an answer holds beyond its text and end, the same for each of its prompts."""

    model: str
    fingerprint: str
    prompt_ns: tuple[int, ...]  # each prompt's tokens, in order
    cut: bool = False  # text was cut to fit the context (/infill)
    warm_only: bool = False  # n_predict 0: the prompt is read into the cache, nothing answered
    wanted: tuple[str, ...] | None = None  # response_fields, for the whole answer
    token_bytes: Callable[[int], bytes] | None = None  # where n_probs asks for probabilities
    return_tokens: bool = False  # each piece's token ids too


class LlamaEncoder:
    """One prompt's answer in llama-server's /completion shape: `content`, `stop`,
    `stop_type` and its counts and timings; streamed as data-only events of `content`
    pieces, the last one with `stop: true` and the rest (no [DONE], as llama-server). With
    several prompts (/completion's list), one encoder each: the whole answer is a list of
    theirs, and each event names its prompt's `index`."""

    ping_every = None
    waits_for_admission = False

    def __init__(self, shape: Shape, index: int = 0):
        self.shape, self.index = shape, index
        self.base = {"index": index, "model": shape.model, "system_fingerprint": shape.fingerprint}
        self.text = OneFieldFrame(lambda text: frame({**self.base, "content": text, "stop": False}))
        self.pending: list = []  # the TokenLogprobs of the text that comes next
        self.new_line = False  # in the text streamed so far

    def choice(self, index: int) -> LlamaEncoder:
        return LlamaEncoder(self.shape, index)

    def start(self, cached: int | None) -> list[Frame]:
        return []

    def feed(self, item) -> list[Frame]:
        if isinstance(item, Logprobs):
            self.pending.extend(item.entries)
            return []
        if self.shape.warm_only:
            return []
        self.new_line = self.new_line or "\n" in item.text
        if not self.pending:
            return [self.text(item.text)]
        event = {**self.base, "content": item.text, "stop": False, **self._tokens(self.pending)}
        self.pending = []
        return [frame(event)]

    def finish(self, done) -> list[Frame]:
        return self.finish_choice(done)

    def finish_choice(self, done) -> list[Frame]:
        return [frame({**self.base, **self._end(done, self.new_line), "content": ""})]

    def finish_answer(self, done) -> list[Frame]:
        return []

    def fail(self, message: str, status: int) -> list[Frame]:
        return [error_frame("llama", message)]

    def whole(self, answer: Answer) -> dict:
        return self._picked(self.whole_choice(answer))

    def whole_choice(self, answer: Answer) -> dict:
        text = "" if self.shape.warm_only else answer.text()
        entries = () if self.shape.warm_only else answer.logprobs
        return {
            **self.base,
            "content": text,
            **self._end(answer.done, "\n" in text),
            **self._tokens(entries),
        }

    def whole_answer(self, choices: list[dict], done) -> list[dict]:
        return [self._picked(c) for c in choices]

    def _picked(self, whole: dict) -> dict:
        wanted = self.shape.wanted
        return whole if wanted is None else picked(whole, wanted)

    def _tokens(self, entries) -> dict:
        """The token ids (return_tokens) and their probabilities (n_probs) of a piece."""
        out = {}
        if self.shape.return_tokens:
            out["tokens"] = [e.token for e in entries]
        if self.shape.token_bytes is not None:
            out["completion_probabilities"] = [self._probability(e) for e in entries]
        return out

    def _probability(self, e) -> dict:
        """llama-server's entry for one token: its id, text, bytes and log-prob, and the
        likeliest tokens' (the model's log-softmax before temperature and penalties)."""

        def one(token: int, logprob: float) -> dict:
            raw = self.shape.token_bytes(token)
            text = raw.decode("utf-8", errors="replace")
            return {"id": token, "token": text, "bytes": list(raw), "logprob": logprob}

        return {**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}

    def _end(self, done, new_line: bool) -> dict:
        predicted = 0 if self.shape.warm_only else done.usage.completion_tokens
        if done.reason == "length":
            stop_type = "limit"
        else:
            stop_type = "word" if done.stop_sequence else "eos"
        return {
            "tokens": [],  # llama-server's key; the ids are in it where return_tokens asks
            "stop": True,
            "stop_type": stop_type,
            "stopping_word": done.stop_sequence or "",
            "tokens_predicted": predicted,
            "tokens_evaluated": self.shape.prompt_ns[self.index],
            "tokens_cached": done.timings.cache_n,
            "truncated": self.shape.cut,
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
