"""Turn text into token ids and back, the way llama.cpp does for the same GGUF file.

Two kinds of vocabulary are supported. Byte-level BPE (GGUF ``tokenizer.ggml.model = gpt2``,
or a Hugging Face ``tokenizer.json``) is run by the ``tokenizers`` library with the
pre-tokenizer llama.cpp picks for ``tokenizer.ggml.pre``. SentencePiece vocabularies
(``llama``, or a ``tokenizer.model``) are run by ``sentencepiece`` on a model rebuilt from
the GGUF tokens, scores and types. Reading the files is `vocab_gguf`'s and `vocab_hf`'s job,
building the encoders `encoders`'s; this module is the `Tokenizer` made from what they read.

Text is turned back into bytes token by token (``token_bytes``), so that a stream can be
decoded incrementally (``Detokenizer``) and gives exactly what decoding all ids at once
gives.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from .vocab import BYTE_TOKEN, SPECIAL_TYPES, TokenizerSpec, TokenType, Vocab
from .vocab_gguf import read_gguf
from .vocab_hf import read_hf_folder

if TYPE_CHECKING:
    import gguf

# Put by `Tokenizer.defuse` inside a special token's text that a client wrote: a Unicode
# noncharacter, which no text needs.
DEFUSE = "\ufdd0"


class Tokenizer:
    """Encode text to token ids and decode ids to text for one model."""

    def __init__(self, spec: TokenizerSpec) -> None:
        # Built by from_gguf / from_hf_folder; the argument is not a stable interface.
        vocab = spec.vocab
        self._vocab = vocab
        self._encode_text = spec.encode_text  # (text, special tokens matched?) -> ids
        self._fingerprint_parts = spec.fingerprint_parts
        self._piece_bytes = _token_bytes_table(vocab)
        self.vocab_size: int = len(vocab.tokens)
        self.bos_id: int | None = vocab.bos_id
        self.eos_id: int | None = vocab.eos_id
        self.eog_ids: frozenset[int] = vocab.eog_ids
        # (prefix, suffix, middle) markers of fill-in-the-middle, where the model has them,
        # and the tokens before a repository's and a file's name.
        self.fim_ids: tuple[int, int, int] | None = vocab.fim_ids
        self.fim_repo_id: int | None = vocab.fim_repo_id
        self.fim_file_id: int | None = vocab.fim_file_id
        self.add_bos: bool = spec.add_bos
        # What a prompt assembled from pieces starts with: the bos, where the model wants one.
        self.bos_first: tuple[int, ...] = (
            (self.bos_id,) if self.add_bos and self.bos_id is not None else ()
        )
        self.chat_template: str | None = spec.chat_template
        # No token stands for more characters than this: a longer text than ctx times it
        # cannot fit a context, and is refused before any tokenizing.
        self.max_token_chars: int = max(
            max(map(len, vocab.tokens), default=1), max(map(len, self._piece_bytes), default=1)
        )
        self.bos_token: str = "" if self.bos_id is None else vocab.tokens[self.bos_id]
        self.eos_token: str = "" if self.eos_id is None else vocab.tokens[self.eos_id]

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str] | gguf.GGUFReader) -> Tokenizer:
        """Load the tokenizer from a GGUF file's metadata (or an open gguf.GGUFReader)."""
        return cls(read_gguf(path))

    @classmethod
    def from_hf_folder(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load the tokenizer from a Hugging Face model folder.

        Uses tokenizer.json if there is one, else a SentencePiece tokenizer.model; takes
        the chat template, bos/eos tokens and add_bos_token from tokenizer_config.json.
        """
        return cls(read_hf_folder(Path(path)))

    @classmethod
    def for_model(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load the tokenizer of a model: a Hugging Face folder, else a GGUF file."""
        path = Path(path)
        return cls.from_hf_folder(path) if path.is_dir() else cls.from_gguf(path)

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """Return the token ids of text; special tokens written in it become single ids.

        With add_bos, bos_id is put first unless the ids already start with it.
        """
        ids = self._encode_text(text, True) if text else []
        return self._with_bos(ids) if add_bos else ids

    def defuse(self, text: str) -> str:
        """Client text made safe to put into a template: each special token's text in it gets
        DEFUSE after its first character, so `encode_rendered` reads it as the plain text it
        is. (DEFUSE itself, a noncharacter, is dropped from client text.)"""
        text = text.replace(DEFUSE, "")
        pattern = self._vocab.specials.pattern
        if pattern is None:
            return text
        return pattern.sub(lambda m: m.group()[0] + DEFUSE + m.group()[1:], text)

    def encode_rendered(self, text: str, *, add_bos: bool = False) -> list[int]:
        """The ids of a prompt rendered from defused client text: only the special tokens
        the template itself wrote become control ids; client text is encoded with special
        tokens off, so a message cannot forge a system or tool turn."""
        if DEFUSE not in text:
            return self.encode(text, add_bos=add_bos)
        ids: list[int] = []
        for piece in self._vocab.specials.split(text):
            if isinstance(piece, int):
                ids.append(piece)
            else:
                ids.extend(self._encode_text(piece.replace(DEFUSE, ""), False))
        return self._with_bos(ids) if add_bos else ids

    def _with_bos(self, ids: list[int]) -> list[int]:
        if self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Return the text of ids: their token_bytes joined, decoded with U+FFFD for errors."""
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self, id: int) -> bytes:
        """Return the exact bytes token id adds to the text (b"" for control tokens)."""
        if 0 <= id < len(self._piece_bytes):
            return self._piece_bytes[id]
        return b""

    def token_text(self, id: int) -> str:
        """Return the vocabulary's text for token id, as the GGUF file spells it."""
        return self._vocab.tokens[id]

    def token_id(self, text: str) -> int | None:
        """Return the id of the token whose vocabulary text is text, or None."""
        return self._vocab.ids.get(text)

    def is_special(self, id: int) -> bool:
        """Tell whether token id is a control, user-defined or unknown token."""
        return 0 <= id < self.vocab_size and self._vocab.types[id] in SPECIAL_TYPES

    @functools.cached_property
    def _fingerprint(self) -> str:
        h = hashlib.sha256()
        for part in (
            self._vocab.tokens,
            [int(t) for t in self._vocab.types],
            *self._fingerprint_parts,
            self.chat_template,
            self.bos_id,
            self.eos_id,
            sorted(self.eog_ids),
            self.add_bos,
        ):
            h.update(json.dumps(part, ensure_ascii=False).encode("utf-8"))
            h.update(b"\x00")
        return h.hexdigest()

    def fingerprint(self) -> str:
        """Return a sha256 hex digest over the vocabulary, merges/scores, types and template."""
        return self._fingerprint


class Detokenizer:
    """Incremental detokenizer: never emits half a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        """Add one token; return the text it completes (may be '')."""
        return self._decoder.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """Return what is left at the end; incomplete bytes become U+FFFD."""
        return self._decoder.decode(b"", final=True)


# --- the bytes each token stands for --------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """Return GPT-2's table mapping each byte to the printable character that stands for it."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def _token_bytes_table(vocab: Vocab) -> list[bytes]:
    """Return, per token id, the bytes it contributes to decoded text (llama.cpp's piece)."""
    out = []
    for text, kind in zip(vocab.tokens, vocab.types, strict=True):
        if kind in (TokenType.NORMAL, TokenType.UNDEFINED):
            if vocab.byte_level:
                out.append(_byte_level_bytes(text))
            else:
                out.append(text.replace("▁", " ").encode("utf-8"))
        elif kind == TokenType.USER_DEFINED:
            out.append(text.encode("utf-8"))
        elif kind == TokenType.BYTE and (m := BYTE_TOKEN.fullmatch(text)):
            out.append(bytes([int(m.group(1), 16)]))
        else:  # control, unknown, unused
            out.append(b"")
    return out


def _byte_level_bytes(text: str) -> bytes:
    """Map a byte-level BPE token's characters back to the bytes they stand for."""
    try:
        return bytes(_UNICODE_TO_BYTE[c] for c in text)
    except KeyError:
        # A character outside GPT-2's table stands for itself (llama.cpp writes a marker).
        return b"".join(
            bytes([_UNICODE_TO_BYTE[c]]) if c in _UNICODE_TO_BYTE else c.encode("utf-8")
            for c in text
        )
