"""Log probabilities of a chat answer's tokens: which parsed item each generated token belongs
to, and OpenAI's per-token entries (chat `logprobs.content`, Responses `output_text.logprobs`).

A token belongs to the item that holds the first of its characters that any item holds; a
token none of whose characters an item holds (a think or tool-call tag, whitespace between
blocks, text cut at a stop string) belongs to none. Only content carries its tokens' entries
(and tool-call markup that did not parse, which is given out as content): reasoning and tool
calls do not, as in vLLM.
"""

from __future__ import annotations

import codecs
import collections
from collections.abc import Callable

import attrs

from ..events import TextDelta, TokenLogprob
from ..text.parser import Content, InvalidToolCall, ToolCall

MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat and Responses


@attrs.frozen
class Logprobs:
    """The log-probabilities of the tokens whose text comes next (the next content item; the
    next text of plain completions)."""

    entries: tuple[TokenLogprob, ...]


class ItemTokens:
    """One answer's generated tokens, placed in the parsed items their text falls in."""

    def __init__(self, token_bytes: Callable[[int], bytes] | None, start: int):
        """token_bytes: a token id's bytes (None: no log-probs were asked for); start: where
        the answer's first character is in the text the parser was fed (after a forced
        call's prefix)."""
        self.token_bytes = token_bytes
        # The text the scheduler's detokenizer makes of the same bytes, so the same offsets.
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = start
        self.waiting: collections.deque = collections.deque()  # (entry, first char, end)

    def add(self, delta: TextDelta) -> None:
        """The tokens a delta's text is of (the text is fed to the parser next)."""
        if self.token_bytes is None:
            return
        for entry in delta.logprobs:
            raw = self.token_bytes(entry.token)
            first = self.chars
            if self.decoder.getstate()[0] and raw and raw[0] & 0xC0 != 0x80:
                first += 1  # what the last token left of a character is void: U+FFFD, its own
            self.chars += len(self.decoder.decode(raw))
            # A piece of a character (or a token with no text) holds the character at first.
            self.waiting.append((entry, first, max(self.chars, first + 1)))

    def place(self, items: list) -> list:
        """The parser's items in order, each content item after the Logprobs of the tokens
        it holds (where it holds any)."""
        if not self.waiting:
            return items
        out = []
        for item in items:
            if item.start is not None:  # None: a call read from held content (bare JSON)
                text = item.raw if isinstance(item, ToolCall) else item.text
                held = self._take(item.start, item.start + len(text))
                if held and isinstance(item, Content | InvalidToolCall):
                    out.append(Logprobs(held))
            out.append(item)
        return out

    def _take(self, start: int, end: int) -> tuple[TokenLogprob, ...]:
        """The waiting tokens that the item at [start, end) holds; those before it are in
        no item (items come in the order of their text)."""
        waiting, held = self.waiting, []
        while waiting and waiting[0][2] <= start:
            waiting.popleft()
        while waiting and waiting[0][1] < end:
            held.append(waiting.popleft()[0])
        return tuple(held)


def openai_entries(entries, token_bytes: Callable[[int], bytes]) -> list[dict]:
    """OpenAI's entry per token: its text (its bytes decoded, U+FFFD for a piece of a
    character, as completions spell tokens), log-prob and bytes, and the likeliest tokens'
    at its position, likeliest first."""

    def entry(token: int, logprob: float) -> dict:
        raw = token_bytes(token)
        text = raw.decode("utf-8", errors="replace")
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    return [
        {**entry(e.token, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top]}
        for e in entries
    ]
