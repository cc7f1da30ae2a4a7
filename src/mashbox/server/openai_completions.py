"""OpenAI Completions as a codec: a prompt (or a list of them) in, the text out unparsed,
whole or as `text_completion` events (driver.py runs both)."""

from __future__ import annotations

import secrets
import time

import attrs

from ..events import MAX_WAITING_PER_TENANT, Finished, TokenLogprob
from . import structured
from .chat import Answer, Content, Logprobs
from .driver import Call, Frame, OneFieldFrame, Tally, frame
from .errors import bad_request
from .generation import (
    MAX_CHOICES,
    biasable_tokens,
    build_request,
    check_fits,
    check_model,
    check_token_ids,
    choice_count,
    encode_prompt,
    for_prompt,
    system_fingerprint,
)
from .openai_chat import error_frame, include_usage, usage_dict, usage_tally
from .state import ServerState
from .validate import Body

# Prompts in one request, all of them with their n choices together: a tenant's waiting
# requests, since more could never be queued at once.
MAX_ANSWERS = MAX_WAITING_PER_TENANT


def completion_prompts(body: Body) -> list[str | list]:
    """`prompt`: a string, a list of strings, a list of token ids, or a list of lists of
    token ids (as OpenAI's and vLLM's completions take it). Each is answered on its own.
    Token lists are read whole only once their length is known to fit (`token_prompt`)."""
    prompt = body.raw("prompt")
    if isinstance(prompt, list) and prompt and is_token(prompt[0]):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        if len(prompt) > MAX_ANSWERS:
            raise bad_request(f"prompt: {len(prompt)} prompts; at most {MAX_ANSWERS}", "prompt")
        prompts = prompt
    else:
        prompts = [prompt]
    kind = type(prompts[0])
    if kind not in (str, list) or not all(type(p) is kind for p in prompts):
        raise bad_request(
            "prompt must be a string, a list of strings, a list of token ids or a list of "
            "lists of token ids",
            "prompt",
        )
    for i, p in enumerate(prompts):
        if not p:
            where = prompt_where(i, len(prompts))
            raise bad_request(f"{where} must not be empty", where)
    return prompts


def is_token(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def prompt_where(index: int, count: int) -> str:
    """How an error names one prompt of a request's `count`."""
    return "prompt" if count == 1 else f"prompt[{index}]"


@attrs.frozen
class Infill:
    """Fill-in-the-middle (`suffix`): each prompt is the prefix, and the model reads it between
    its markers as the coder models' cards write them, [bos] <prefix> PROMPT <suffix> SUFFIX
    <middle>, then writes the middle. The bos only before a text prompt, where the model
    wants one (token ids are taken as they are). llama-server's /infill puts a repository
    and a file name first, which qwen2.5-coder-0.5b-instruct answered worse."""

    bos: tuple[int, ...]
    prefix: int
    after: tuple[int, ...]  # the suffix marker, the suffix's tokens, the middle marker

    @classmethod
    def of(cls, tok, suffix: list[int]) -> Infill:
        """The markers around a prompt before `suffix`'s tokens, with tok's bos."""
        prefix, marker, middle = tok.fim_ids
        return cls(tok.bos_first, prefix, (marker, *suffix, middle))

    def around(self, ids: list[int], *, text: bool) -> list[int]:
        return [*(self.bos if text else ()), self.prefix, *ids, *self.after]

    def extra(self, *, text: bool) -> int:
        return len(self.around([], text=text))


async def infill(state: ServerState, body: Body, tenant: str) -> Infill | None:
    """What `suffix` asks for: None for a plain continuation (no suffix, or an empty one on a
    model without fill-in-the-middle markers, as some clients always send the field)."""
    suffix = body.str("suffix")
    if suffix is None:
        return None
    tok = state.tokenizer
    if tok.fim_ids is None:
        if suffix == "":
            return None
        raise bad_request(
            f"suffix is not supported by {state.model_id}: its vocabulary has no "
            "fill-in-the-middle tokens",
            "suffix",
        )
    if body.bool("echo", False):
        raise bad_request("suffix cannot be used with echo", "suffix")
    ids = await encode_prompt(state, suffix, "suffix", tenant=tenant, add_bos=False)
    return Infill.of(tok, ids)


def token_prompt(state: ServerState, body: Body, ids: list, where: str, extra: int = 0):
    """A prompt given as token ids, taken as they are (no bos added), each of the
    vocabulary. Its length (with `extra` tokens around it) is checked first, so a huge list
    is refused before it is read."""
    check_fits(body, state, len(ids) + extra, where)
    check_token_ids(ids, biasable_tokens(state), where)
    return ids


async def prompt_ids(
    state: ServerState, body: Body, prompt, where: str, tenant: str, fim: Infill | None = None
) -> list[int]:
    """One prompt's token ids (inside fim's markers, where `suffix` asks), checked to fit
    the context (`where`: how errors name it)."""
    text = not isinstance(prompt, list)
    if not text:
        ids = token_prompt(state, body, prompt, where, fim.extra(text=False) if fim else 0)
        return fim.around(ids, text=False) if fim else ids
    ids = await encode_prompt(state, prompt, where, tenant=tenant, add_bos=False if fim else None)
    if fim:
        ids = fim.around(ids, text=True)
    check_fits(body, state, len(ids), where)
    return ids


# Prompt tokens whose log-probs one request may echo, all its answers together: each entry
# is ~4 us of the event loop and ~0.5 KB of the answer (64 MB at this bound).
MAX_ECHO_LOGPROBS = 131072


def check_echo_size(entries: int) -> None:
    if entries > MAX_ECHO_LOGPROBS:
        raise bad_request(
            f"echo with logprobs: {entries} prompt tokens in all the answers (prompt tokens "
            f"times n); at most {MAX_ECHO_LOGPROBS}",
            "echo",
        )


def refuse_what_is_not_done(body: Body, n: int) -> None:
    """OpenAI's completions fields mashbox does not do: a 400, not an answer without them."""
    if body.int("best_of", n) != n:
        raise bad_request("best_of is not supported: n asks for several choices", "best_of")


async def parse(state: ServerState, body: Body, tenant: str) -> Call:
    check_model(body, state)
    top = body.int("logprobs", lo=0, hi=MAX_LOGPROBS)  # None: none asked for
    n = choice_count(body, MAX_CHOICES)
    refuse_what_is_not_done(body, n)
    prompts = completion_prompts(body)
    if len(prompts) * n > MAX_ANSWERS:
        raise bad_request(
            f"{len(prompts)} prompts of n={n} choices each ask for {len(prompts) * n} "
            f"answers; at most {MAX_ANSWERS} in one request",
            "prompt",
        )
    fim = await infill(state, body, tenant)
    wheres = [prompt_where(i, len(prompts)) for i in range(len(prompts))]
    ids = [await prompt_ids(state, body, p, wheres[i], tenant, fim) for i, p in enumerate(prompts)]
    request = build_request(
        body, state, ids[0], tenant, logprobs=-1 if top is None else top, most_choices=MAX_CHOICES
    )
    # vLLM's extension, which OpenAI's completions lack: the continuation follows a schema.
    answer = structured.answer_schema(body.object("response_format"), "response_format")
    request = await structured.constrain(state, request, None, answer=answer)
    echoes = ()
    if body.bool("echo", False):  # each choice's text starts with its prompt's
        echoes = tuple(_echo(state, p) for p in prompts for _ in range(n))
        if top is not None:  # and its log-probs with the prompt tokens'
            check_echo_size(sum(map(len, ids)) * n)
            params = attrs.evolve(request.params, prompt_logprobs=True)
            request = attrs.evolve(request, params=params)
    others = tuple(for_prompt(body, state, request, more) for more in ids[1:])
    fingerprint = system_fingerprint(state, request)
    token_text = None if top is None else _token_text(state.tokenizer)
    tally = usage_tally(body, [request, *others], n)
    encoder = CompletionEncoder(
        state.model_id, fingerprint, include_usage(body), token_text, tally=tally, echoes=echoes
    )
    return Call(request, None, encoder, n, tally, more_prompts=others)


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
        echoes: tuple[str, ...] = (),
    ):
        """token_text: a token id's text, where log-probs were asked for (else None).
        index: the choice this encodes; of: choice 0's encoder, whose answer (its id, clock
        and tally) this is another choice of; tally: where every event carries the usage so
        far; echoes: each choice's prompt text, where `echo` asks the text to start with it."""
        self.token_text = token_text
        self.index = index
        self.pending: list[TokenLogprob] = []  # those of the text that comes next
        self.offset = 0  # characters of the answer so far (each token's text_offset)
        if of is not None:
            self.rid, self.base, self.tally, self.echoes = of.rid, of.base, of.tally, of.echoes
        else:
            self.tally, self.echoes = tally, echoes
            self.rid = "cmpl-" + secrets.token_hex(12)
            self.base = {
                "id": self.rid,
                "object": "text_completion",
                "created": int(time.time()),
                "model": model,
                "system_fingerprint": fingerprint,
            }
        self.echo = self.echoes[index] if self.echoes else None  # not sent yet
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
        text = item.text
        if self.echo is not None:
            text, self.echo = self.echo + text, None
        if self.token_text is None and self.tally is None:
            return [self.text(text)]
        choice = _choice(text, self.index)
        if self.token_text is not None:
            choice["logprobs"], self.pending = self._logprobs(self.pending), []
        return [self._event(choice)]

    def finish(self, done: Finished) -> list[Frame]:
        return [*self.finish_choice(done), *self.finish_answer(done)]

    def finish_choice(self, done: Finished) -> list[Frame]:
        echo = self.feed(Content("")) if self.echo is not None else []  # an empty answer's
        choice = _choice("", self.index, done.reason)
        timings = attrs.asdict(done.timings)
        if self.tally is not None:  # the choice's own count, now final
            usage = usage_dict(done.usage, details=False)
            return [*echo, self._event(choice, timings=timings, usage=usage)]
        return [*echo, self._event(choice, timings=timings)]

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
            "text": (self.echo or "") + answer.text(),
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
        likeliest tokens' (the sampled one always among them) and where its text starts. An
        echoed prompt's first token has neither log-prob nor likeliest (null)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            text = self.token_text(e.token)
            out["tokens"].append(text)
            out["token_logprobs"].append(e.logprob)
            out["top_logprobs"].append(None if e.logprob is None else self._top(e, text))
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    def _top(self, e: TokenLogprob, text: str) -> dict[str, float]:
        top: dict[str, float] = {}
        for t, lp in e.top:  # tokens that spell alike (pieces of characters): the likeliest
            top.setdefault(self.token_text(t), lp)
        top[text] = e.logprob  # the token's own entry, always
        return top


MAX_LOGPROBS = 5  # OpenAI's bound for completions


def _echo(state: ServerState, prompt: str | list[int]) -> str:
    """The text `echo` repeats: the prompt as given, or its token ids' text."""
    return prompt if isinstance(prompt, str) else state.tokenizer.decode(prompt)


def _token_text(tokenizer):
    """A token's text as the answer spells it (U+FFFD for a piece of a character)."""
    return lambda token: tokenizer.token_bytes(token).decode("utf-8", errors="replace")


def _choice(text: str, index: int, finish=None) -> dict:
    return {"index": index, "text": text, "finish_reason": finish}
