"""Encoders: text to ids for a vocabulary, as llama.cpp splits and merges it.

Byte-level BPE runs on the ``tokenizers`` library (with the pre-tokenizer llama.cpp picks);
SentencePiece vocabularies run on ``sentencepiece``, from a model rebuilt out of the GGUF
tokens, scores and types. Both libraries are imported when an encoder is built, not before.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from .pretokenize import PreTokenizer
from .vocab import BYTE_TOKEN, SPECIAL_TYPES, Encoder, TokenType, Vocab


def bpe_encoder(vocab: Vocab, merges: Sequence[str], pre: PreTokenizer) -> Encoder:
    """Build a byte-level BPE encoder with llama.cpp's pre-tokenizer for this vocabulary."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    pairs = []
    for merge in merges:
        # llama.cpp splits at the first space after the first character.
        cut = merge.find(" ", 1)
        if cut > 0:
            pairs.append((merge[:cut], merge[cut + 1 :]))
    tok = tokenizers.Tokenizer(
        models.BPE(vocab=vocab.ids, merges=pairs, ignore_merges=pre.ignore_merges)
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(tokenizers.Regex(r), behavior="isolated") for r in pre.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.add_special_tokens(
        [
            tokenizers.AddedToken(text, special=True, normalized=False)
            for i, (text, kind) in enumerate(zip(vocab.tokens, vocab.types, strict=True))
            if kind in SPECIAL_TYPES and vocab.ids.get(text) == i
        ]
    )

    return hf_encoder(tok)


def hf_encoder(tok) -> Encoder:
    """An encoder over a `tokenizers` tokenizer, and a copy of it that reads special tokens'
    texts as plain text (`encode_special_tokens`), made when first needed: only client text
    that spells a special token takes it, and copying qwen2.5's 152k vocabulary takes 0.5 s
    of every start (the engine process's vocabulary never needs it)."""
    import tokenizers

    plain = []
    lock = threading.Lock()

    def encode(text: str, special: bool) -> list[int]:
        if special:
            return tok.encode(text, add_special_tokens=False).ids
        with lock:
            if not plain:
                copy = tokenizers.Tokenizer.from_str(tok.to_str())
                copy.encode_special_tokens = True
                plain.append(copy)
        return plain[0].encode(text, add_special_tokens=False).ids

    return encode


def spm_proto_from_vocab(vocab: Vocab, scores: Sequence[float], *, unk_id: int | None) -> Any:
    """Rebuild a SentencePiece BPE ModelProto from GGUF tokens, scores and types."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    n = len(vocab.tokens)
    has_bytes = {
        int(m.group(1), 16)
        for text, kind in zip(vocab.tokens, vocab.types, strict=True)
        if kind == TokenType.BYTE and (m := BYTE_TOKEN.fullmatch(text))
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


def spm_encoder(vocab: Vocab, proto: Any, *, prefix_space: bool) -> Encoder:
    """Build a SentencePiece encoder that splits special tokens out first, as llama.cpp does.

    Every text fragment at the start or right after a special token gets a leading space
    when prefix_space is set (llama.cpp's add_space_prefix; HF "legacy" Llama tokenizers do
    the same).
    """
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_proto=proto.SerializeToString())
    n = len(vocab.tokens)

    def encode(text: str, special: bool) -> list[int]:
        out: list[int] = []
        prev_special = True
        for piece in vocab.specials.split(text) if special else [text]:
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
