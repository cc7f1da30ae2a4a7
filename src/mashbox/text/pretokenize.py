"""How llama.cpp pre-splits text before byte-level BPE, per family of vocabularies.

GGUF names the family in ``tokenizer.ggml.pre``; the regexes below are llama.cpp's for
each name (llama-vocab.cpp), and `pre_tokenizer_for` picks them.
"""

from __future__ import annotations

import logging

import attrs

logger = logging.getLogger(__name__)

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
class PreTokenizer:
    """How llama.cpp pre-splits text for one family of BPE vocabularies."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a word that is a whole token is taken as is
    add_bos: bool = False  # default for tokenizer.ggml.add_bos_token


_GPT2 = PreTokenizer((_GPT2_RE,))
_LLAMA3 = PreTokenizer((_LLAMA3_RE,), ignore_merges=True, add_bos=True)
_QWEN2 = PreTokenizer((_QWEN2_RE,))
_STARCODER = PreTokenizer((r"\p{N}", _GPT2_RE))
_PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": PreTokenizer(
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
        ("dbrx", "smaug-bpe", "chatglm-bpe", "glm4"), PreTokenizer((_LLAMA3_RE,))
    ),
    **dict.fromkeys(
        ("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "hunyuan", "solar-open",
         "grok-2", "kormo"),
        _QWEN2,
    ),
    "qwen35": PreTokenizer((_QWEN35_RE,)),
    **dict.fromkeys(
        ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b",
         "mellum2"),
        _STARCODER,
    ),
    "deepseek-coder": PreTokenizer(
        ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}")
    ),
    **dict.fromkeys(
        ("deepseek-v3", "hunyuan-dense"),
        PreTokenizer((r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+", _DEEPSEEK3_RE)),
    ),
    "falcon": PreTokenizer(
        (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_RE, r"[0-9][0-9][0-9]")
    ),
    **dict.fromkeys(("bloom", "poro-chat", "gpt3-finnish"), PreTokenizer((_BLOOM_RE,))),
    "viking": PreTokenizer((_BLOOM_RE, r"\p{N}")),
    "tekken": PreTokenizer((_TEKKEN_RE,), ignore_merges=True, add_bos=True),
    **dict.fromkeys(
        ("gpt-4o", "llama4", "minimax-m2", "kanana2"), PreTokenizer((_GPT4O_RE,))
    ),
    "seed-coder": PreTokenizer(
        (
            _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+",
        )
    ),
}  # fmt: skip


def pre_tokenizer_for(name: str | None) -> PreTokenizer:
    """The pre-tokenizer llama.cpp uses for a GGUF file's tokenizer.ggml.pre."""
    if not name:
        logger.warning("GGUF file names no pre-tokenizer: using llama.cpp's 'default'")
        name = "default"
    pre = _PRE_TOKENIZERS.get(name)
    if pre is None:
        logger.warning("unknown pre-tokenizer %r: using GPT-2's", name)
        pre = _GPT2
    return pre
