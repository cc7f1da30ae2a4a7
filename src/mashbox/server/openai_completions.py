"""OpenAI Completions as a codec: a prompt string in, the text out unparsed, whole or as
`text_completion` events (driver.py runs both)."""

from __future__ import annotations

import secrets
import time

import attrs

from ..events import Finished
from .chat import Answer
from .driver import Call, Frame, OneFieldFrame, frame
from .errors import bad_request
from .generation import build_request, check_model, encode_prompt, system_fingerprint
from .openai_chat import error_frame, include_usage, usage_dict
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


async def parse(state: ServerState, body: Body, tenant: str) -> Call:
    check_model(body, state)
    body.refuse("logprobs", "log probabilities are not returned")
    ids = await encode_prompt(state, completion_prompt(body), "prompt", tenant=tenant)
    request = build_request(body, state, ids, tenant)
    fingerprint = system_fingerprint(state, request)
    encoder = CompletionEncoder(state.model_id, fingerprint, include_usage(body))
    return Call(request, None, encoder)


class CompletionEncoder:
    """One answer as a text_completion, whole or in events."""

    ping_every = None
    waits_for_admission = False

    def __init__(self, model: str, fingerprint: str, usage_chunk: bool):
        self.rid = "cmpl-" + secrets.token_hex(12)
        self.base = {
            "id": self.rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": fingerprint,
        }
        self.usage_chunk = usage_chunk
        self.text = OneFieldFrame(lambda text: frame({**self.base, "choices": [_choice(text)]}))

    def start(self, cached: int | None) -> list[Frame]:
        return []

    def feed(self, item) -> list[Frame]:
        return [self.text(item.text)]

    def finish(self, done: Finished) -> list[Frame]:
        timings = attrs.asdict(done.timings)
        out = [frame({**self.base, "choices": [_choice("", done.reason)], "timings": timings})]
        if self.usage_chunk:
            usage = usage_dict(done.usage, details=False)
            out.append(frame({**self.base, "choices": [], "usage": usage}))
        return [*out, frame("[DONE]")]

    def fail(self, message: str, status: int) -> list[Frame]:
        return [error_frame(self.rid, message)]

    def whole(self, answer: Answer) -> dict:
        done = answer.done
        return {
            **self.base,
            "choices": [{"index": 0, "text": answer.text(), "finish_reason": done.reason}],
            "usage": usage_dict(done.usage, details=False),
            "timings": attrs.asdict(done.timings),
        }


def _choice(text: str, finish=None) -> dict:
    return {"index": 0, "text": text, "finish_reason": finish}
