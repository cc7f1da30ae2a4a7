"""A model's vocabulary as llama.cpp sees it, whichever file it was read from.

A vocabulary reader (`vocab_gguf`, `vocab_hf`) reads token texts, types and special ids and
hands them to `finish_vocab`, which settles the end-of-generation ids the way llama.cpp does
and indexes the tokens once for everything built on them. The reader returns a
`TokenizerSpec`: the vocabulary, an encoder for it and the file's settings.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs


class TokenType(enum.IntEnum):
    """Token types as GGUF's tokenizer.ggml.token_type stores them."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# Token types that are matched whole in text (llama.cpp's special-token cache).
SPECIAL_TYPES = frozenset({TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN})

# A byte token's text (SentencePiece byte fallback).
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")

# Token texts that end generation, as llama.cpp collects them (llama-vocab.cpp).
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<｜end▁of▁sentence｜>",
    }
)
# Fill-in-the-middle pad, repo and file-separator tokens end generation too (and the repo
# and file ones name a repository and its files before the prefix: llama-server's /infill).
_FIM_EOG_TEXTS = (
    ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    ("<|file_sep|>",),
)
# Fill-in-the-middle's three markers, as llama.cpp finds them where the file names none:
# before the prefix, before the suffix, and where the middle is to be written (Qwen2.5-Coder,
# CodeGemma and Granite, StarCoder, DeepSeek-Coder, CodeLlama).
_FIM_TEXTS = (
    ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>"),
    ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>"),
    ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>"),
)
# The token after which Harmony-style templates keep going, unlike the others.
_HARMONY_END = "<|end|>"

# (text, special tokens matched?) -> ids
Encoder = Callable[[str, bool], list[int]]


@attrs.frozen(eq=False)
class SpecialTokens:
    """The texts matched whole as special tokens, and their ids."""

    ids: Mapping[str, int]
    # Longest first, so that "<|im_end|>" wins over a shorter token it starts with; None
    # where there are none.
    pattern: re.Pattern[str] | None

    def split(self, text: str) -> list[str | int]:
        """Cut text into plain fragments and special token ids."""
        if self.pattern is None:
            return [text]
        out: list[str | int] = []
        pos = 0
        for m in self.pattern.finditer(text):
            if m.start() > pos:
                out.append(text[pos : m.start()])
            out.append(self.ids[m.group()])
            pos = m.end()
        if pos < len(text):
            out.append(text[pos:])
        return out


@attrs.frozen
class Vocab:
    """A vocabulary as GGUF describes it: token texts, their types and special ids."""

    tokens: tuple[str, ...]
    types: tuple[TokenType, ...]
    byte_level: bool  # token text spells bytes through GPT-2's table (else SentencePiece's)
    bos_id: int | None
    eos_id: int | None
    eog_ids: frozenset[int]
    # Fill-in-the-middle's (prefix, suffix, middle) marker ids; None where any is missing.
    fim_ids: tuple[int, int, int] | None
    fim_repo_id: int | None  # before the repository's name
    fim_file_id: int | None  # before each file's name
    # The first id of each (non-empty) token text: a vocabulary may repeat a text.
    ids: dict[str, int] = attrs.field(eq=False, repr=False)
    specials: SpecialTokens = attrs.field(eq=False, repr=False)


@attrs.frozen
class TokenizerSpec:
    """Everything a Tokenizer is built from, as a vocabulary reader gives it."""

    vocab: Vocab
    encode_text: Encoder
    add_bos: bool
    chat_template: str | None
    # What else decides the ids (merges, scores, the pre-tokenizer), for the fingerprint.
    fingerprint_parts: Sequence[Any]


def _token_type(value: int) -> TokenType:
    try:
        return TokenType(value)
    except ValueError:
        return TokenType.UNDEFINED


def _first_of(by_text: Mapping[str, int], texts: Iterable[str]) -> int | None:
    return next((by_text[t] for t in texts if t in by_text), None)


def _special_tokens(tokens: Sequence[str], types: Sequence[TokenType]) -> SpecialTokens:
    ids: dict[str, int] = {}
    for i, (text, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind in SPECIAL_TYPES and text:
            ids.setdefault(text, i)
    if not ids:
        return SpecialTokens(ids, None)
    ordered = sorted(ids, key=len, reverse=True)
    return SpecialTokens(ids, re.compile("|".join(re.escape(t) for t in ordered)))


def finish_vocab(
    tokens: Sequence[str],
    types: Sequence[int],
    *,
    byte_level: bool,
    bos_id: int | None,
    eos_id: int | None,
    extra_eog: Iterable[int | None] = (),
    fim_ids: Sequence[int | None] = (None, None, None),
) -> Vocab:
    """Collect end-of-generation ids as llama.cpp does, and make those tokens CONTROL.
    fim_ids: the file's own fill-in-the-middle marker ids, each found by its text where the
    file names none."""
    n = len(tokens)
    kinds = [_token_type(t) for t in types]
    by_text: dict[str, int] = {}
    for i, text in enumerate(tokens):
        if text:
            by_text.setdefault(text, i)
    eog = {i for i, text in enumerate(tokens) if text in _EOG_TEXTS}
    fim_pad, fim_repo, fim_file = (_first_of(by_text, names) for names in _FIM_EOG_TEXTS)
    eog.update(i for i in (fim_pad, fim_repo, fim_file) if i is not None)
    for i in (eos_id, *extra_eog):
        if i is not None and 0 <= i < n:
            eog.add(i)
    # Harmony (gpt-oss) ends a message with <|end|> but the turn with <|return|>/<|call|>.
    texts = {tokens[i] for i in eog}
    if _HARMONY_END in texts and (
        {"<|return|>", "<|call|>"} <= texts or {"<|calls|>", "<|flush|>"} <= texts
    ):
        end = by_text[_HARMONY_END]
        eog.discard(end)
        kinds[end] = TokenType.USER_DEFINED
    for i in eog:
        # llama.cpp overrides a control-looking EOG token's type, so it is never printed.
        if tokens[i] in _EOG_TEXTS or any(tokens[i] in names for names in _FIM_EOG_TEXTS):
            kinds[i] = TokenType.CONTROL
    fim = tuple(
        named if named is not None and 0 <= named < n else _first_of(by_text, texts)
        for named, texts in zip(fim_ids, _FIM_TEXTS, strict=True)
    )
    return Vocab(
        tokens=tuple(tokens),
        types=tuple(kinds),
        byte_level=byte_level,
        bos_id=bos_id if bos_id is not None and 0 <= bos_id < n else None,
        eos_id=eos_id if eos_id is not None and 0 <= eos_id < n else None,
        eog_ids=frozenset(eog),
        fim_ids=None if None in fim else fim,
        fim_repo_id=fim_repo,
        fim_file_id=fim_file,
        ids=by_text,
        specials=_special_tokens(tokens, kinds),
    )
