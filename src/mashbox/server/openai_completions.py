"""OpenAI Completions as a codec: a prompt string in, the text out unparsed, whole or as
`text_completion` events (driver.py runs both)."""

from __future__ import annotations

import secrets
import time

import attrs

from ..events import Finished, TokenLogprob
from . import structured
from .chat import Answer, Logprobs
from .driver import Call, Frame, OneFieldFrame, Tally, frame
from .errors import bad_request
from .generation import (
    MAX_CHOICES,
    build_request,
    check_model,
    choice_count,
    encode_prompt,
    system_fingerprint,
)
from .openai_chat import error_frame, include_usage, usage_dict, usage_tally
from .state import ServerState
from .validate import Body


def completion_prompt(body: Body) -> str:
    """`prompt`: a string, or a list of one string."""
    prompt = body.raw("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad_request("prompt must be a string or a list of one string", "prompt")
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    return prompt


def refuse_what_is_not_done(body: Body, n: int) -> None:
    """OpenAI's completions fields mashbox does not do: a 400, not an answer without them."""
    body.refuse("echo", "the answer never repeats the prompt")
    body.refuse("suffix", "the models here write after the prompt")
    if body.int("best_of", n) != n:
        raise bad_request("best_of is not supported: n asks for several choices", "best_of")


async def parse(state: ServerState, body: Body, tenant: str) -> Call:
    check_model(body, state)
    top = body.int("logprobs", lo=0, hi=MAX_LOGPROBS)  # None: none asked for
    n = choice_count(body, MAX_CHOICES)
    refuse_what_is_not_done(body, n)
    ids = await encode_prompt(state, completion_prompt(body), "prompt", tenant=tenant)
    request = build_request(
        body, state, ids, tenant, logprobs=-1 if top is None else top, most_choices=MAX_CHOICES
    )
    # vLLM's extension, which OpenAI's completions lack: the continuation follows a schema.
    answer = structured.answer_schema(body.object("response_format"), "response_format")
    request = await structured.constrain(state, request, None, answer=answer)
    fingerprint = system_fingerprint(state, request)
    token_text = None if top is None else _token_text(state.tokenizer)
    tally = usage_tally(body, request, n)
    encoder = CompletionEncoder(
        state.model_id, fingerprint, include_usage(body), token_text, tally=tally
    )
    return Call(request, None, encoder, n, tally)


class CompletionEncoder:
    """One answer as a text_completion, whole or in events; one encoder per choice (`n`)."""

    ping_every = None
    waits_for_admission = False

    def __init__(
        self,
        model: str,
        fingerprint: str,
        usage_chunk: bool,
        token_text=None,
        *,
        index: int = 0,
        of: CompletionEncoder | None = None,
        tally: Tally | None = None,
    ):
        """token_text: a token id's text, where log-probs were asked for (else None).
        index: the choice this encodes; of: choice 0's encoder, whose answer (its id, clock
        and tally) this is another choice of; tally: where every event carries the usage so
        far."""
        self.token_text = token_text
        self.index = index
        self.pending: list[TokenLogprob] = []  # those of the text that comes next
        self.offset = 0  # characters of the answer so far (each token's text_offset)
        if of is not None:
            self.rid, self.base, self.tally = of.rid, of.base, of.tally
        else:
            self.tally = tally
            self.rid = "cmpl-" + secrets.token_hex(12)
            self.base = {
                "id": self.rid,
                "object": "text_completion",
                "created": int(time.time()),
                "model": model,
                "system_fingerprint": fingerprint,
            }
        self.usage_chunk = usage_chunk
        self.text = OneFieldFrame(
            lambda text: frame({**self.base, "choices": [_choice(text, index)]})
        )

    def choice(self, index: int) -> CompletionEncoder:
        model, fingerprint = self.base["model"], self.base["system_fingerprint"]
        return CompletionEncoder(
            model, fingerprint, self.usage_chunk, self.token_text, index=index, of=self
        )

    def start(self, cached: int | None) -> list[Frame]:
        return []

    def feed(self, item) -> list[Frame]:
        if isinstance(item, Logprobs):
            self.pending.extend(item.entries)
            return []
        if self.token_text is None and self.tally is None:
            return [self.text(item.text)]
        choice = _choice(item.text, self.index)
        if self.token_text is not None:
            choice["logprobs"], self.pending = self._logprobs(self.pending), []
        return [self._event(choice)]

    def finish(self, done: Finished) -> list[Frame]:
        return [*self.finish_choice(done), *self.finish_answer(done)]

    def finish_choice(self, done: Finished) -> list[Frame]:
        choice = _choice("", self.index, done.reason)
        timings = attrs.asdict(done.timings)
        if self.tally is not None:  # the choice's own count, now final
            usage = usage_dict(done.usage, details=False)
            return [self._event(choice, timings=timings, usage=usage)]
        return [self._event(choice, timings=timings)]

    def _event(self, choice: dict, **extra) -> Frame:
        """One text_completion event of this choice; with the usage so far where tallied."""
        if self.tally is not None and "usage" not in extra:
            extra["usage"] = self.tally.usage(self.index)
        return frame({**self.base, "choices": [choice], **extra})

    def finish_answer(self, done: Finished) -> list[Frame]:
        out = []
        if self.usage_chunk:
            usage = usage_dict(done.usage, details=False)
            out.append(frame({**self.base, "choices": [], "usage": usage}))
        return [*out, frame("[DONE]")]

    def fail(self, message: str, status: int) -> list[Frame]:
        return [error_frame(self.rid, message)]

    def whole(self, answer: Answer) -> dict:
        return self.whole_answer([self.whole_choice(answer)], answer.done)

    def whole_choice(self, answer: Answer) -> dict:
        return {
            "index": self.index,
            "text": answer.text(),
            "finish_reason": answer.done.reason,
            **self._logprobs_field(answer.logprobs),
        }

    def whole_answer(self, choices: list[dict], done: Finished) -> dict:
        """choices: each choice's whole_choice; done: how the answer ended (all its usage)."""
        return {
            **self.base,
            "choices": choices,
            "usage": usage_dict(done.usage, details=False),
            "timings": attrs.asdict(done.timings),
        }

    def _logprobs_field(self, entries) -> dict:
        return {} if self.token_text is None else {"logprobs": self._logprobs(entries)}

    def _logprobs(self, entries) -> dict:
        """OpenAI's completions log-probs of these tokens: each one's text, log-prob, the
        likeliest tokens' (the sampled one always among them) and where its text starts."""
        name = self.token_text
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            text = name(e.token)
            top: dict[str, float] = {}
            for t, lp in e.top:  # tokens that spell alike (pieces of characters): the likeliest
                top.setdefault(name(t), lp)
            top[text] = e.logprob  # the sampled token's own entry, always
            out["tokens"].append(text)
            out["token_logprobs"].append(e.logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


MAX_LOGPROBS = 5  # OpenAI's bound for completions


def _token_text(tokenizer):
    """A token's text as the answer spells it (U+FFFD for a piece of a character)."""
    return lambda token: tokenizer.token_bytes(token).decode("utf-8", errors="replace")


def _choice(text: str, index: int, finish=None) -> dict:
    return {"index": index, "text": text, "finish_reason": finish}
