"""Turn text into token ids and back, the way llama.cpp does for the same GGUF file.

Two kinds of vocabulary are supported. Byte-level BPE (GGUF ``tokenizer.ggml.model = gpt2``,
or a Hugging Face ``tokenizer.json``) is run by the ``tokenizers`` library with the
pre-tokenizer llama.cpp picks for ``tokenizer.ggml.pre``. SentencePiece vocabularies
(``llama``, or a ``tokenizer.model``) are run by ``sentencepiece`` on a model rebuilt from
the GGUF tokens, scores and types.

Text is turned back into bytes token by token (``token_bytes``), so that a stream can be
decoded incrementally (``Detokenizer``) and gives exactly what decoding all ids at once
gives.
"""

from __future__ import annotations

import codecs
import enum
import functools
import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import gguf

logger = logging.getLogger(__name__)


class TokenType(enum.IntEnum):
    """Token types as GGUF's tokenizer.ggml.token_type stores them."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# Put by `Tokenizer.defuse` inside a special token's text that a client wrote: a Unicode
# noncharacter, which no text needs.
DEFUSE = "\ufdd0"

# Token types that are matched whole in text (llama.cpp's special-token cache).
_SPECIAL_TYPES = frozenset({TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN})

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
# Fill-in-the-middle pad, repo and file-separator tokens end generation too.
_FIM_EOG_TEXTS = (
    ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    ("<|file_sep|>",),
)
# The token after which Harmony-style templates keep going, unlike the others.
_HARMONY_END = "<|end|>"

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


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

# Pre-tokenizer regexes per llama.cpp pre-tokenizer type (llama-vocab.cpp); each splits the
# pieces the previous one left, and text between matches stays a piece of its own.
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3_RE = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_RE = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER_LOWER = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+{c}"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*{c}"
)
# onig (the tokenizers regex engine) has \p{Lu}, so these are the tokenizer.json originals
# that llama.cpp rewrites with look-aheads.
_TEKKEN_RE = (
    _UPPER_LOWER.replace("{c}", "") + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_RE = (
    _UPPER_LOWER.replace("{c}", _CONTRACTIONS + "?")
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK3_RE = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BLOOM_RE = r" ?[^(\s|.,!?…。，、।۔،)]+"


@attrs.frozen
class _PreTokenizer:
    """How llama.cpp pre-splits text for one family of BPE vocabularies."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a word that is a whole token is taken as is
    add_bos: bool = False  # default for tokenizer.ggml.add_bos_token


_GPT2 = _PreTokenizer((_GPT2_RE,))
_LLAMA3 = _PreTokenizer((_LLAMA3_RE,), ignore_merges=True, add_bos=True)
_QWEN2 = _PreTokenizer((_QWEN2_RE,))
_STARCODER = _PreTokenizer((r"\p{N}", _GPT2_RE))
_PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    "default": _PreTokenizer(
        (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]")
    ),
    **dict.fromkeys(
        (
            "gpt-2", "gpt2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v1-en",
            "jina-v2-es", "jina-v2-de", "jina-v2-code", "roberta-bpe", "a.x-4.0", "mellum",
            "modern-bert", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4",
        ),
        _GPT2,
    ),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
         "lfm2"),
        _LLAMA3,
    ),
    **dict.fromkeys(
        ("dbrx", "smaug-bpe", "chatglm-bpe", "glm4"), _PreTokenizer((_LLAMA3_RE,))
    ),
    **dict.fromkeys(
        ("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "hunyuan", "solar-open",
         "grok-2", "kormo"),
        _QWEN2,
    ),
    "qwen35": _PreTokenizer((_QWEN35_RE,)),
    **dict.fromkeys(
        ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b",
         "mellum2"),
        _STARCODER,
    ),
    "deepseek-coder": _PreTokenizer(
        ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}")
    ),
    **dict.fromkeys(
        ("deepseek-v3", "hunyuan-dense"),
        _PreTokenizer((r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+", _DEEPSEEK3_RE)),
    ),
    "falcon": _PreTokenizer(
        (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_RE, r"[0-9][0-9][0-9]")
    ),
    **dict.fromkeys(("bloom", "poro-chat", "gpt3-finnish"), _PreTokenizer((_BLOOM_RE,))),
    "viking": _PreTokenizer((_BLOOM_RE, r"\p{N}")),
    "tekken": _PreTokenizer((_TEKKEN_RE,), ignore_merges=True, add_bos=True),
    **dict.fromkeys(
        ("gpt-4o", "llama4", "minimax-m2", "kanana2"), _PreTokenizer((_GPT4O_RE,))
    ),
    "seed-coder": _PreTokenizer(
        (
            _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+",
        )
    ),
}  # fmt: skip


@attrs.frozen
class _Vocab:
    """A vocabulary as GGUF describes it: token texts, their types and special ids."""

    tokens: tuple[str, ...]
    types: tuple[TokenType, ...]
    byte_level: bool  # token text spells bytes through GPT-2's table (else SentencePiece's)
    bos_id: int | None
    eos_id: int | None
    eog_ids: frozenset[int]


class Tokenizer:
    """Encode text to token ids and decode ids to text for one model."""

    def __init__(
        self,
        *,
        vocab: _Vocab,
        encode_text: Callable[[str, bool], list[int]],
        add_bos: bool,
        chat_template: str | None,
        fingerprint_parts: Sequence[Any],
    ) -> None:
        # Built by from_gguf / from_hf_folder; the arguments are not a stable interface.
        self._vocab = vocab
        self._encode_text = encode_text  # (text, special tokens matched?) -> ids
        self._specials, self._special_ids = _special_pattern(vocab)
        self._fingerprint_parts = fingerprint_parts
        self._piece_bytes = _token_bytes_table(vocab)
        self._ids: dict[str, int] = {}
        for i, text in enumerate(vocab.tokens):
            if text:
                self._ids.setdefault(text, i)
        self.vocab_size: int = len(vocab.tokens)
        self.bos_id: int | None = vocab.bos_id
        self.eos_id: int | None = vocab.eos_id
        self.eog_ids: frozenset[int] = vocab.eog_ids
        self.add_bos: bool = add_bos
        self.chat_template: str | None = chat_template
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
        import gguf

        # Parsing a GGUF header takes seconds for a large vocabulary; a caller that has a
        # reader open already can hand it over.
        reader = path if isinstance(path, gguf.GGUFReader) else gguf.GGUFReader(path)
        return _from_gguf_fields(_GGUFFields(reader))

    @classmethod
    def from_hf_folder(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load the tokenizer from a Hugging Face model folder.

        Uses tokenizer.json if there is one, else a SentencePiece tokenizer.model; takes
        the chat template, bos/eos tokens and add_bos_token from tokenizer_config.json.
        """
        return _from_hf_folder(Path(path))

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
        if self._specials is None:
            return text
        return self._specials.sub(lambda m: m.group()[0] + DEFUSE + m.group()[1:], text)

    def encode_rendered(self, text: str, *, add_bos: bool = False) -> list[int]:
        """The ids of a prompt rendered from defused client text: only the special tokens
        the template itself wrote become control ids; client text is encoded with special
        tokens off, so a message cannot forge a system or tool turn."""
        if DEFUSE not in text:
            return self.encode(text, add_bos=add_bos)
        ids: list[int] = []
        for piece in _split_specials(self._specials, self._special_ids, text):
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
        return self._ids.get(text)

    def is_special(self, id: int) -> bool:
        """Tell whether token id is a control, user-defined or unknown token."""
        return 0 <= id < self.vocab_size and self._vocab.types[id] in _SPECIAL_TYPES

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


# --- building the vocabulary ----------------------------------------------------------------


def _token_bytes_table(vocab: _Vocab) -> list[bytes]:
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
        elif kind == TokenType.BYTE and (m := _BYTE_TOKEN.fullmatch(text)):
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


def _token_type(value: int) -> TokenType:
    try:
        return TokenType(value)
    except ValueError:
        return TokenType.UNDEFINED


def _finish_vocab(
    tokens: Sequence[str],
    types: Sequence[int],
    *,
    byte_level: bool,
    bos_id: int | None,
    eos_id: int | None,
    extra_eog: Iterable[int | None] = (),
) -> _Vocab:
    """Collect end-of-generation ids as llama.cpp does, and make those tokens CONTROL."""
    n = len(tokens)
    kinds = [_token_type(t) for t in types]
    by_text: dict[str, int] = {}
    for i, text in enumerate(tokens):
        by_text.setdefault(text, i)
    eog = {i for i, text in enumerate(tokens) if text in _EOG_TEXTS}
    for names in _FIM_EOG_TEXTS:
        found = [by_text[t] for t in names if t in by_text]
        eog.update(found[:1])
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
    return _Vocab(
        tokens=tuple(tokens),
        types=tuple(kinds),
        byte_level=byte_level,
        bos_id=bos_id if bos_id is not None and 0 <= bos_id < n else None,
        eos_id=eos_id if eos_id is not None and 0 <= eos_id < n else None,
        eog_ids=frozenset(eog),
    )


# --- GGUF -----------------------------------------------------------------------------------


class _GGUFFields:
    """Read tokenizer metadata values from a gguf.GGUFReader."""

    def __init__(self, reader: Any) -> None:
        self._fields = reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()


def _from_gguf_fields(f: _GGUFFields) -> Tokenizer:
    """Build a Tokenizer from GGUF tokenizer.* metadata."""
    model = f.get("tokenizer.ggml.model")
    tokens = f.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError("GGUF file has no tokenizer.ggml.tokens")
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    types = f.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens)
    template = f.get("tokenizer.chat_template")

    def special(key: str, default: int | None = None) -> int | None:
        value = f.get(f"tokenizer.ggml.{key}_token_id")
        return default if value is None or not 0 <= value < len(tokens) else int(value)

    extra_eog = (special("eot"), special("eom"))
    if model == "gpt2":
        pre_name = f.get("tokenizer.ggml.pre")
        if not pre_name:
            logger.warning("GGUF file names no pre-tokenizer: using llama.cpp's 'default'")
            pre_name = "default"
        pre = _PRE_TOKENIZERS.get(pre_name)
        if pre is None:
            logger.warning("unknown pre-tokenizer %r: using GPT-2's", pre_name)
            pre = _GPT2
        vocab = _finish_vocab(
            tokens, types, byte_level=True, bos_id=special("bos"), eos_id=special("eos"),
            extra_eog=extra_eog,
        )  # fmt: skip
        merges = f.get("tokenizer.ggml.merges") or []
        encode = _bpe_encoder(vocab, merges, pre)
        add_bos = bool(f.get("tokenizer.ggml.add_bos_token", pre.add_bos))
        parts: list[Any] = ["gpt2", list(pre.regexes), pre.ignore_merges, merges]
    elif model == "llama":
        vocab = _finish_vocab(
            tokens, types, byte_level=False, bos_id=special("bos", 1), eos_id=special("eos", 2),
            extra_eog=extra_eog,
        )  # fmt: skip
        scores = [float(s) for s in f.get("tokenizer.ggml.scores") or [0.0] * len(tokens)]
        prefix = bool(f.get("tokenizer.ggml.add_space_prefix", True))
        proto = _spm_proto_from_vocab(vocab, scores, unk_id=special("unknown"))
        encode = _spm_encoder(vocab, proto, prefix_space=prefix)
        add_bos = bool(f.get("tokenizer.ggml.add_bos_token", True))
        parts = ["llama", scores, prefix]
    else:
        raise ValueError(f"unsupported tokenizer model {model!r} (need 'gpt2' or 'llama')")
    return Tokenizer(
        vocab=vocab,
        encode_text=encode,
        add_bos=add_bos,
        chat_template=template,
        fingerprint_parts=parts,
    )


def _bpe_encoder(
    vocab: _Vocab, merges: Sequence[str], pre: _PreTokenizer
) -> Callable[[str], list[int]]:
    """Build a byte-level BPE encoder with llama.cpp's pre-tokenizer for this vocabulary."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    ids: dict[str, int] = {}
    for i, text in enumerate(vocab.tokens):
        ids.setdefault(text, i)
    pairs = []
    for merge in merges:
        # llama.cpp splits at the first space after the first character.
        cut = merge.find(" ", 1)
        if cut > 0:
            pairs.append((merge[:cut], merge[cut + 1 :]))
    tok = tokenizers.Tokenizer(models.BPE(vocab=ids, merges=pairs, ignore_merges=pre.ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(tokenizers.Regex(r), behavior="isolated") for r in pre.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.add_special_tokens(
        [
            tokenizers.AddedToken(text, special=True, normalized=False)
            for i, (text, kind) in enumerate(zip(vocab.tokens, vocab.types, strict=True))
            if kind in _SPECIAL_TYPES and ids[text] == i
        ]
    )

    return _hf_encoder(tok)


def _hf_encoder(tok) -> Callable[[str, bool], list[int]]:
    """An encoder over a `tokenizers` tokenizer, and a copy of it that reads special tokens'
    texts as plain text (`encode_special_tokens`)."""
    import tokenizers

    plain = tokenizers.Tokenizer.from_str(tok.to_str())
    plain.encode_special_tokens = True

    def encode(text: str, special: bool) -> list[int]:
        return (tok if special else plain).encode(text, add_special_tokens=False).ids

    return encode


def _spm_proto_from_vocab(vocab: _Vocab, scores: Sequence[float], *, unk_id: int | None) -> Any:
    """Rebuild a SentencePiece BPE ModelProto from GGUF tokens, scores and types."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    n = len(vocab.tokens)
    has_bytes = {
        int(m.group(1), 16)
        for text, kind in zip(vocab.tokens, vocab.types, strict=True)
        if kind == TokenType.BYTE and (m := _BYTE_TOKEN.fullmatch(text))
    }
    # SentencePiece refuses byte pieces unless all 256 exist for byte fallback.
    byte_fallback = len(has_bytes) == 256
    if unk_id is None or vocab.types[unk_id] != TokenType.UNKNOWN:
        unk_id = next((i for i, k in enumerate(vocab.types) if k == TokenType.UNKNOWN), None)

    proto = pb.ModelProto()
    proto.trainer_spec.model_type = pb.TrainerSpec.BPE
    proto.trainer_spec.vocab_size = n
    proto.trainer_spec.byte_fallback = byte_fallback
    proto.trainer_spec.unk_id = n if unk_id is None else unk_id
    proto.trainer_spec.bos_id = -1
    proto.trainer_spec.eos_id = -1
    proto.trainer_spec.pad_id = -1
    # llama.cpp neither normalizes nor drops whitespace; the dummy prefix is added per
    # text fragment by the encoder, as llama.cpp does it.
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = False
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True

    seen: set[str] = set()
    piece_type = pb.ModelProto.SentencePiece
    for i, (text, kind) in enumerate(zip(vocab.tokens, vocab.types, strict=True)):
        p = proto.pieces.add()
        p.piece = text if text not in seen else f"[DUPLICATE_{i}]"
        seen.add(text)
        p.score = scores[i] if i < len(scores) else 0.0
        if i == unk_id:
            p.type = piece_type.UNKNOWN
        elif kind == TokenType.BYTE and byte_fallback:
            p.type = piece_type.BYTE
        elif kind in (TokenType.CONTROL, TokenType.UNKNOWN):
            p.type = piece_type.CONTROL
        elif kind == TokenType.USER_DEFINED:
            p.type = piece_type.USER_DEFINED
        elif kind in (TokenType.UNUSED, TokenType.BYTE) or p.piece != text:
            p.type = piece_type.UNUSED
        else:
            p.type = piece_type.NORMAL
    if unk_id is None:
        # SentencePiece needs an unknown piece; this one is past the vocabulary and
        # dropped from the output, as llama.cpp drops what it cannot encode.
        p = proto.pieces.add()
        p.piece = "[MASHBOX_UNK]"
        p.type = piece_type.UNKNOWN
    return proto


def _spm_encoder(vocab: _Vocab, proto: Any, *, prefix_space: bool) -> Callable[[str], list[int]]:
    """Build a SentencePiece encoder that splits special tokens out first, as llama.cpp does.

    Every text fragment at the start or right after a special token gets a leading space
    when prefix_space is set (llama.cpp's add_space_prefix; HF "legacy" Llama tokenizers do
    the same).
    """
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_proto=proto.SerializeToString())
    n = len(vocab.tokens)
    pattern, specials = _special_pattern(vocab)

    def encode(text: str, special: bool) -> list[int]:
        out: list[int] = []
        prev_special = True
        for piece in _split_specials(pattern, specials, text) if special else [text]:
            if isinstance(piece, int):
                out.append(piece)
                prev_special = True
                continue
            if prefix_space and prev_special:
                piece = " " + piece
            out.extend(i for i in sp.encode(piece) if i < n)
            prev_special = False
        return out

    return encode


def _special_pattern(vocab: _Vocab) -> tuple[re.Pattern | None, dict[str, int]]:
    """The texts matched whole as special tokens (longest first, so that "<|im_end|>" wins
    over a shorter token it starts with) and their ids; None where there are none."""
    specials: dict[str, int] = {}
    for i, (text, kind) in enumerate(zip(vocab.tokens, vocab.types, strict=True)):
        if kind in _SPECIAL_TYPES and text:
            specials.setdefault(text, i)
    if not specials:
        return None, specials
    ordered = sorted(specials, key=len, reverse=True)
    return re.compile("|".join(re.escape(t) for t in ordered)), specials


def _split_specials(pattern, specials: dict[str, int], text: str) -> list[str | int]:
    """Cut text into plain fragments and special token ids."""
    if pattern is None:
        return [text]
    out: list[str | int] = []
    pos = 0
    for m in pattern.finditer(text):
        if m.start() > pos:
            out.append(text[pos : m.start()])
        out.append(specials[m.group()])
        pos = m.end()
    if pos < len(text):
        out.append(text[pos:])
    return out


# --- Hugging Face folders -------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_content(value: Any) -> str | None:
    """Return a token's text from tokenizer_config.json (a string or an AddedToken dict)."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _hf_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """Return the default chat template of a Hugging Face folder, wherever it is kept."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template") or _read_json(folder / "chat_template.json").get(
        "chat_template"
    )
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _from_hf_folder(folder: Path) -> Tokenizer:
    """Build a Tokenizer from tokenizer.json or tokenizer.model plus tokenizer_config.json."""
    config = _read_json(folder / "tokenizer_config.json")
    generation = _read_json(folder / "generation_config.json")
    template = _hf_chat_template(folder, config)
    bos_text = _token_content(config.get("bos_token"))
    eos_text = _token_content(config.get("eos_token"))
    extra_eog = generation.get("eos_token_id")
    extra_eog = extra_eog if isinstance(extra_eog, list) else [extra_eog]

    if (folder / "tokenizer.json").is_file():
        return _from_tokenizer_json(
            folder / "tokenizer.json", config, template, bos_text, eos_text, extra_eog
        )
    if (folder / "tokenizer.model").is_file():
        return _from_spm_model(
            folder / "tokenizer.model", config, template, bos_text, eos_text, extra_eog
        )
    raise FileNotFoundError(f"no tokenizer.json or tokenizer.model in {folder}")


def _from_tokenizer_json(
    path: Path,
    config: dict[str, Any],
    template: str | None,
    bos_text: str | None,
    eos_text: str | None,
    extra_eog: list[Any],
) -> Tokenizer:
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(path))
    spec = json.loads(path.read_text(encoding="utf-8"))
    ids = tok.get_vocab(with_added_tokens=True)
    tokens = [""] * (max(ids.values(), default=-1) + 1)
    types = [int(TokenType.UNUSED)] * len(tokens)
    for text, i in ids.items():
        tokens[i] = text
        types[i] = TokenType.NORMAL
    model = spec.get("model") or {}
    unk = model.get("unk_token")
    if unk in ids:
        types[ids[unk]] = TokenType.UNKNOWN
    byte_level = "ByteLevel" in json.dumps([spec.get("decoder"), spec.get("pre_tokenizer")])
    if not byte_level:
        for i, text in enumerate(tokens):
            if _BYTE_TOKEN.fullmatch(text):
                types[i] = TokenType.BYTE
    for added in spec.get("added_tokens") or []:
        i = added.get("id")
        if isinstance(i, int) and 0 <= i < len(tokens):
            tokens[i] = added["content"]
            types[i] = TokenType.CONTROL if added.get("special") else TokenType.USER_DEFINED

    vocab = _finish_vocab(
        tokens,
        types,
        byte_level=byte_level,
        bos_id=ids.get(bos_text) if bos_text else None,
        eos_id=ids.get(eos_text) if eos_text else None,
        extra_eog=[i for i in extra_eog if isinstance(i, int)],
    )
    add_bos = config.get("add_bos_token")
    if add_bos is None:
        # No flag: the post-processor decides (Llama 3's template adds bos itself).
        first = tok.encode("", add_special_tokens=True).ids[:1]
        add_bos = vocab.bos_id is not None and first == [vocab.bos_id]

    return Tokenizer(
        vocab=vocab,
        encode_text=_hf_encoder(tok),
        add_bos=bool(add_bos),
        chat_template=template,
        fingerprint_parts=["tokenizer.json", tok.to_str()],
    )


def _from_spm_model(
    path: Path,
    config: dict[str, Any],
    template: str | None,
    bos_text: str | None,
    eos_text: str | None,
    extra_eog: list[Any],
) -> Tokenizer:
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString(path.read_bytes())
    # SentencePiece and GGUF number the piece types alike.
    tokens = [p.piece for p in proto.pieces]
    types = [int(p.type) for p in proto.pieces]
    # Tokens added on top of the SentencePiece model (e.g. ChatML markers).
    for key, added in (config.get("added_tokens_decoder") or {}).items():
        i = int(key)
        while len(tokens) <= i:
            tokens.append(f"[PAD_{len(tokens)}]")
            types.append(int(TokenType.UNUSED))
        tokens[i] = added["content"]
        types[i] = TokenType.CONTROL if added.get("special") else TokenType.USER_DEFINED
    by_text = {t: i for i, t in reversed(list(enumerate(tokens)))}
    bos_id = by_text.get(bos_text) if bos_text else proto.trainer_spec.bos_id
    eos_id = by_text.get(eos_text) if eos_text else proto.trainer_spec.eos_id
    vocab = _finish_vocab(
        tokens,
        types,
        byte_level=False,
        bos_id=bos_id if bos_id is not None and bos_id >= 0 else None,
        eos_id=eos_id if eos_id is not None and eos_id >= 0 else None,
        extra_eog=[i for i in extra_eog if isinstance(i, int)],
    )
    # The model's own normalizer stays; its dummy prefix then applies to each fragment,
    # which is where llama.cpp adds one too.
    encode = _spm_encoder(vocab, proto, prefix_space=False)
    return Tokenizer(
        vocab=vocab,
        encode_text=encode,
        add_bos=bool(config.get("add_bos_token", True)),
        chat_template=template,
        fingerprint_parts=["tokenizer.model", hashlib.sha256(path.read_bytes()).hexdigest()],
    )
