"""Read a tokenizer from a Hugging Face model folder.

tokenizer.json (run by the ``tokenizers`` library as it is) or else a SentencePiece
tokenizer.model; tokenizer_config.json and generation_config.json add the chat template,
the bos/eos tokens, add_bos_token and extra end-of-generation ids.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from .encoders import hf_encoder, spm_encoder
from .vocab import BYTE_TOKEN, TokenizerSpec, TokenType, finish_vocab


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


def read_hf_folder(folder: Path) -> TokenizerSpec:
    """Read tokenizer.json or tokenizer.model, plus tokenizer_config.json."""
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
) -> TokenizerSpec:
    """Read a tokenizer.json; its added tokens become CONTROL or USER_DEFINED tokens."""
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
            if BYTE_TOKEN.fullmatch(text):
                types[i] = TokenType.BYTE
    for added in spec.get("added_tokens") or []:
        i = added.get("id")
        if isinstance(i, int) and 0 <= i < len(tokens):
            tokens[i] = added["content"]
            types[i] = TokenType.CONTROL if added.get("special") else TokenType.USER_DEFINED

    vocab = finish_vocab(
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

    return TokenizerSpec(
        vocab=vocab,
        encode_text=hf_encoder(tok),
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
) -> TokenizerSpec:
    """Read a SentencePiece tokenizer.model and the tokens tokenizer_config.json adds."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    data = path.read_bytes()
    proto = pb.ModelProto()
    proto.ParseFromString(data)
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
    bos_id = _first_index(tokens, bos_text) if bos_text else proto.trainer_spec.bos_id
    eos_id = _first_index(tokens, eos_text) if eos_text else proto.trainer_spec.eos_id
    vocab = finish_vocab(
        tokens,
        types,
        byte_level=False,
        bos_id=bos_id if bos_id is not None and bos_id >= 0 else None,
        eos_id=eos_id if eos_id is not None and eos_id >= 0 else None,
        extra_eog=[i for i in extra_eog if isinstance(i, int)],
    )
    # The model's own normalizer stays; its dummy prefix then applies to each fragment,
    # which is where llama.cpp adds one too.
    encode = spm_encoder(vocab, proto, prefix_space=False)
    return TokenizerSpec(
        vocab=vocab,
        encode_text=encode,
        add_bos=bool(config.get("add_bos_token", True)),
        chat_template=template,
        fingerprint_parts=["tokenizer.model", hashlib.sha256(data).hexdigest()],
    )


def _first_index(tokens: list[str], text: str) -> int | None:
    # A scan, not a map: the vocabulary indexes its texts once it is finished.
    try:
        return tokens.index(text)
    except ValueError:
        return None
