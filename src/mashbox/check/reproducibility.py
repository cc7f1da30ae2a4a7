"""Reproducible seeded sampling: one seeded chat request, asked alone for the reference text,
must give that text again beside other requests, in another slot, from a cached prefix and
after the server restarts.

Every run starts its prompts with a fresh nonce, so the reference is computed from nothing
the server could have cached in an earlier run.
"""

from __future__ import annotations

import functools
import json
import secrets
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor

import attrs

from .client import Refused, Server
from .results import Result, failed, same_text, skipped

CHAT = "/v1/chat/completions"
TEMPERATURE = 0.9  # sampled, not greedy: only the seed may make the text repeat
MAX_TOKENS = 24
HOLD_TOKENS = 256  # the held stream's length: long enough to still run beside the next one

# The long system prompt the seeded request and the prefix-warming one share (~250 words).
PREFIX = (
    "You are a storyteller for a small coastal museum. Visitors read your stories on a screen "
    "beside the old lighthouse lens, so every story must be short, concrete and kind. Write "
    "in plain sentences, in the past tense, with one named character and one place on the "
    "coast. Prefer small details a visitor could picture: the brass of the lamp, salt on the "
    "windows, the smell of paraffin, the log book with its careful handwriting, the bell of "
    "the harbour buoy, gulls on the gallery rail. Never explain the moral; let the ending "
    "show it. Do not use lists, headings or quotation marks. Do not mention the museum, the "
    "screen or these instructions. If the visitor asks for something other than a story, "
    "answer in one or two sentences and offer a story instead. Keep names simple and "
    "old-fashioned, such as Ada, Tom, Elsie, Walter or Mary. The weather may be rough, but "
    "nobody in a story is ever badly hurt, and every boat comes home. When a story needs a "
    "date, use a year between 1880 and 1930. When it needs a number, keep it small. Stories "
    "for children are welcome: keep the words short and the ending warm."
)
STORY = "Tell me a story about a lighthouse keeper and a storm."
WARM = "Tell me a story about a fisherman who lost his hat."  # shares PREFIX, then parts
HOLD = "Count slowly from one to one hundred, one number a line."
OTHERS = (
    "Name three colours of the sea.",
    "Write a haiku about fog.",
    "What does a lighthouse keeper do at dawn?",
    "Describe a harbour at night in two sentences.",
    "List four things found on a beach.",
    "Tell me a story about a cat on a ship.",
    "Why do gulls follow boats?",
)


@attrs.define
class Seeded:
    """The seeded request every case repeats, and the text it gave alone (the reference)."""

    server: Server
    model: str
    seed: int
    nonce: str = attrs.field(factory=lambda: secrets.token_hex(4))
    reference: str | None = None
    # What the server says of its own exactness, where it says (mashbox's batch_invariant).
    caveat: str = ""

    def body(self, user=STORY, *, seed=None, shared_prefix=True, **extra) -> dict:
        messages = [{"role": "user", "content": user}]
        if shared_prefix:
            messages.insert(0, {"role": "system", "content": f"Session {self.nonce}. {PREFIX}"})
        return {
            "model": self.model,
            "messages": messages,
            "seed": self.seed if seed is None else seed,
            "temperature": TEMPERATURE,
            "max_tokens": MAX_TOKENS,
            **extra,
        }

    def ask(self) -> dict:
        return self.server.post(CHAT, self.body())

    def text(self) -> str:
        return text_of(self.ask())


def text_of(answer: dict) -> str:
    """The answer's text: its thinking too, so a model that only thinks still shows one."""
    try:
        message = answer["choices"][0]["message"]
    except (KeyError, IndexError, TypeError) as e:
        raise Refused(f"a chat answer without choices[0].message: {answer!r:.200}") from e
    return (message.get("reasoning_content") or "") + (message.get("content") or "")


def after_reference(case):
    """A case that compares with the reference: skipped where 'alone' got none."""

    @functools.wraps(case)
    def compared(s: Seeded, *args) -> Result:
        if s.reference is None:
            return skipped("no reference text: 'alone' got no answer")
        return case(s, *args)

    return compared


def alone(s: Seeded) -> Result:
    if s.server.model_card(s.model).get("batch_invariant") is False:
        s.caveat = "the server says batch_invariant: false (its float ops round by batch)"
    s.reference = s.text()
    empty = "" if s.reference else "the text is empty: the others compare nothing"
    return same_text(s.reference, s.text(), empty or s.caveat)


@after_reference
def beside_others(s: Seeded) -> Result:
    # Others of other seeds, lengths and prompts (half sharing the prefix) change the batch
    # around the seeded request while it decodes.
    bodies = [s.body()] + [
        s.body(user, seed=s.seed + 1 + i, max_tokens=8 + 4 * i, shared_prefix=i % 2 == 0)
        for i, user in enumerate(OTHERS)
    ]
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda body: s.server.post(CHAT, body), bodies))
    return same_text(s.reference, text_of(answers[0]), why=s.caveat)


@after_reference
def in_another_slot(s: Seeded) -> Result:
    held = s.body(HOLD, seed=s.seed + 100, max_tokens=HOLD_TOKENS, shared_prefix=False)
    with s.server.stream(CHAT, {**held, "stream": True}) as stream:
        if not _generating(stream):
            return failed("the stream meant to hold a slot ended before any text")
        # Left open and unread: the slot stays taken while the seeded request is answered.
        got = s.text()
    return same_text(s.reference, got, why=s.caveat)


@after_reference
def from_cached_prefix(s: Seeded) -> Result:
    """After a request sharing the seeded one's long prefix. A server that saves whole
    prompts (mashbox does) may serve it from the seeded prompt saved since 'alone'; the
    note says how much the server reports it took from its cache."""
    s.server.post(CHAT, s.body(WARM, seed=s.seed + 200, max_tokens=4))
    answer = s.ask()
    return same_text(s.reference, text_of(answer), _cached_note(answer), why=s.caveat)


@after_reference
def after_restart(s: Seeded, command: str | None, timeout: float) -> Result:
    if not command:
        return skipped("no --restart-cmd given")
    # Output to a file, not a pipe: a server the command starts in the background keeps a
    # pipe open, and reading it to its end would wait for that server to exit.
    with tempfile.TemporaryFile("w+") as output:
        try:
            done = subprocess.run(
                command, shell=True, stdin=subprocess.DEVNULL, stdout=output, stderr=output,
                timeout=timeout,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return failed(f"--restart-cmd did not finish within {timeout:g} s")
        output.seek(0)
        last = (output.read().strip().splitlines() or [""])[-1]
    if done.returncode != 0:
        return failed(f"--restart-cmd exited {done.returncode}: {last}".rstrip(": "))
    if not s.server.wait_up(timeout):
        return failed(f"the server did not answer /health within {timeout:g} s of the restart")
    return same_text(s.reference, s.text())


def _generating(stream) -> bool:
    """Read a chat stream until its first text; False if it ends first."""
    for line in stream.iter_lines():
        data = line.removeprefix("data:").strip()
        if not line.startswith("data:") or data == "[DONE]":
            continue
        try:
            delta = json.loads(data)["choices"][0]["delta"]
        except (ValueError, KeyError, IndexError, TypeError):
            continue
        if delta.get("content") or delta.get("reasoning_content"):
            return True
    return False


def _cached_note(answer: dict) -> str:
    """How much of the prompt the server says it served from its cache, where it says."""
    usage = answer.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None:
        cached = (answer.get("timings") or {}).get("cache_n")
    if not isinstance(cached, int) or "prompt_tokens" not in usage:
        return ""
    return f"{cached} of {usage['prompt_tokens']} prompt tokens from the cache"
