"""Read a tokenizer from a GGUF file's tokenizer.* metadata, as llama.cpp does.

The vocabulary, merges, scores, token types, special ids and chat template are read with
the engine's lean GGUF reader (`engine.gguf_file`): gguf's `GGUFReader` takes seconds to
build an object per token of a large vocabulary.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .encoders import bpe_encoder, spm_encoder, spm_proto_from_vocab
from .pretokenize import pre_tokenizer_for
from .vocab import TokenizerSpec, TokenType, finish_vocab

# The metadata arrays a tokenizer needs (the rest, e.g. per-layer sizes, are skipped).
_ARRAYS = frozenset(
    {
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.scores",
    }
)


def read_gguf(source: str | os.PathLike[str] | Any) -> TokenizerSpec:
    """Read a GGUF file's tokenizer (or an open gguf.GGUFReader's)."""
    from ..engine import gguf_file  # (numpy and gguf load with it, when a file is read)

    if hasattr(source, "fields"):  # a gguf.GGUFReader a caller had open already
        fields = {
            key: field.contents()
            for key, field in source.fields.items()
            if key.startswith("tokenizer.")
        }
    else:
        fields = gguf_file.read_metadata(Path(source), _ARRAYS)
    return _spec_from_fields(fields)


def _spec_from_fields(f: dict[str, Any]) -> TokenizerSpec:
    """Build a tokenizer's spec from GGUF tokenizer.* metadata."""
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
    # Newer files name the markers fim_pre/suf/mid, older ones prefix/suffix/middle.
    fim_ids = tuple(
        special(new) if special(new) is not None else special(old)
        for new, old in (("fim_pre", "prefix"), ("fim_suf", "suffix"), ("fim_mid", "middle"))
    )
    if model == "gpt2":
        pre = pre_tokenizer_for(f.get("tokenizer.ggml.pre"))
        vocab = finish_vocab(
            tokens, types, byte_level=True, bos_id=special("bos"), eos_id=special("eos"),
            extra_eog=extra_eog, fim_ids=fim_ids,
        )  # fmt: skip
        merges = f.get("tokenizer.ggml.merges") or []
        encode = bpe_encoder(vocab, merges, pre)
        add_bos = bool(f.get("tokenizer.ggml.add_bos_token", pre.add_bos))
        parts: list[Any] = ["gpt2", list(pre.regexes), pre.ignore_merges, merges]
    elif model == "llama":
        vocab = finish_vocab(
            tokens, types, byte_level=False, bos_id=special("bos", 1), eos_id=special("eos", 2),
            extra_eog=extra_eog, fim_ids=fim_ids,
        )  # fmt: skip
        scores = [float(s) for s in f.get("tokenizer.ggml.scores") or [0.0] * len(tokens)]
        prefix = bool(f.get("tokenizer.ggml.add_space_prefix", True))
        proto = spm_proto_from_vocab(vocab, scores, unk_id=special("unknown"))
        encode = spm_encoder(vocab, proto, prefix_space=prefix)
        add_bos = bool(f.get("tokenizer.ggml.add_bos_token", True))
        parts = ["llama", scores, prefix]
    else:
        raise ValueError(f"unsupported tokenizer model {model!r} (need 'gpt2' or 'llama')")
    return TokenizerSpec(
        vocab=vocab,
        encode_text=encode,
        add_bos=add_bos,
        chat_template=template,
        fingerprint_parts=parts,
    )
