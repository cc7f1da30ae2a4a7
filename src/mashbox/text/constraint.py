"""Constrained decoding with llguidance: the token mask that keeps an answer inside a grammar.

llguidance (the engine behind OpenAI's, llama.cpp's and vLLM's structured output) compiles
a grammar (Lark, with JSON schemas embedded by `%json`) against the model's vocabulary and,
after each token, gives the set of tokens that may come next. The server checks each
request's grammar here (a 400 names what is wrong); the engine keeps one matcher per
constrained sequence and masks its logits before sampling. Both compile a grammar once and
keep it by its text, so a repeated schema costs a copy.
"""

from __future__ import annotations

import collections
import threading

import llguidance

from .tokenizer import Tokenizer

# Bounds on one grammar's compile and each mask's work, so no request can hold a step or a
# server thread for long: llguidance's own defaults (about 20 ms of lexer work a mask, and
# 50 ms to compile), with the grammar's size capped below its default.
LIMITS = dict(
    max_items_in_row=2000,
    initial_lexer_fuel=1_000_000,
    step_lexer_fuel=200_000,
    step_max_items=50_000,
    max_lexer_states=250_000,
    max_grammar_size=200_000,
)

NOTHING = 'start: ""'  # the grammar of an empty answer: only the end of turn may come

CACHED_GRAMMARS = 256  # compiled grammars kept by text, the least recently used dropped


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads: each token's bytes, and an encoder for
    forced text. A token that prints nothing (control, unknown) is its name behind a 0xff
    byte, which no text can spell; a user-defined tag such as <tool_call> prints its text
    and is text here too, as the output parser reads it."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else 0
        self.bos_token_id = tokenizer.bos_id
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = [i for i, b in enumerate(self.tokens) if not b]
        for i in self.special_token_ids:
            self.tokens[i] = b"\xff" + tokenizer.token_text(i).encode()
        self._ids = {b: i for i, b in reversed(list(enumerate(self.tokens))) if b}  # first id
        self._longest = max(map(len, self._ids), default=1)

    def __call__(self, text) -> list[int]:
        """Token ids for text the grammar forces. Where the model's encoder adds what the
        text lacks (SentencePiece's space before a text's start), the longest tokens that
        spell exactly its bytes instead."""
        data = text if isinstance(text, bytes) else text.encode()
        ids = self._tokenizer.encode(data.decode("utf-8", errors="replace"))
        if b"".join(self.tokens[i] for i in ids) == data:
            return ids
        return self._greedy(data)

    def _greedy(self, data: bytes) -> list[int]:
        out, at = [], 0
        while at < len(data):
            for end in range(min(len(data), at + self._longest), at, -1):
                if (i := self._ids.get(data[at:end])) is not None:
                    out.append(i)
                    at = end
                    break
            else:
                at += 1  # a byte no token spells: nothing can force it anyway
        return out


def ll_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """The model's vocabulary as llguidance sees it; any end-of-generation token ends a
    grammar's answer (~0.1 s for 50k tokens)."""
    ends = sorted(tokenizer.eog_ids) or [tokenizer.eos_id or 0]
    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(_Vocabulary(tokenizer)), eos_token=ends
    )


def _limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**LIMITS)


class Grammars:
    """Grammars compiled against one vocabulary, kept by their text; thread-safe."""

    def __init__(self, tokenizer: Tokenizer):
        self.vocab = ll_tokenizer(tokenizer)
        self._compiled: collections.OrderedDict[str, llguidance.LLMatcher] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()

    def error(self, grammar: str) -> str:
        """Why the grammar cannot be used ("" when it can): its first error, as llguidance
        words it (an unsupported schema keyword is named)."""
        try:
            self._template(grammar)
        except GrammarError as exc:
            return str(exc)
        return ""

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher at the grammar's start; GrammarError if it does not compile."""
        return self._template(grammar).deep_copy()

    def _template(self, grammar: str) -> llguidance.LLMatcher:
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
                return compiled
        # Compiling drops the GIL; two threads may compile the same text once each.
        compiled = llguidance.LLMatcher(self.vocab, grammar, log_level=0, limits=_limits())
        if compiled.is_error():
            raise GrammarError(compiled.get_error())
        with self._lock:
            self._compiled[grammar] = compiled
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return compiled


class GrammarError(ValueError):
    """A grammar that does not compile; the message says why."""
