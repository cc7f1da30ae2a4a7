"""`mashbox-tiny`: a model that needs no download and loads in about a second, for other
projects' tests (`mashbox.testing`) and quick tries.

A 2-layer Llama with seeded random weights (Q8_0) and a SentencePiece vocabulary trained on
a few lines of text, written on first use into the models folder. It answers gibberish, but
deterministically: the protocols, the seeds, the limits and the errors are all real.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

TINY_ID = "mashbox-tiny"
FILENAME = "mashbox-tiny.gguf"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>"]
TRAIN_TEXT = """\
The capital of France is Paris. Berlin is the capital of Germany, Madrid of Spain.
The quick brown fox jumps over the lazy dog; the dog does not mind at all.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 99 100 256 1024. Math: 2 + 2 = 4, 7 * 6 = 42.
Punctuation matters! Does it? Yes... "quotes", 'apostrophes', [brackets] and {braces}.
def add(a, b):
    return a + b
The weather today is sunny with a high of 21 degrees and a low of 12 degrees.
Once upon a time, a small model learned to answer questions, one piece at a time.
A café serves crème brûlée; Zoë visited Besançon and Nîmes; straße, größer, schön.
"""
D_MODEL, N_LAYERS, N_HEADS, N_KV_HEADS, D_FF, CONTEXT = 64, 2, 4, 2, 128, 4096


def ensure(model_dir: Path) -> Path:
    """The model's GGUF file in model_dir, written first if it is not there yet (the caller
    holds the folder's lock)."""
    final = model_dir / FILENAME
    if final.is_file():
        return final
    model_dir.mkdir(parents=True, exist_ok=True)
    partial = final.with_suffix(".partial")
    spm_model = train_spm(model_dir / "spm")
    _write_gguf(partial, spm_model)
    os.replace(partial, final)  # whole or absent, whoever looks
    return final


def train_spm(
    workdir: Path, *, text: str = TRAIN_TEXT, vocab_size: int = 400, name: str = "tiny"
) -> Path:
    """Train a SentencePiece BPE vocabulary with byte fallback on `text`; return its path.
    The normalizer is the identity and extra whitespace is kept, as llama.cpp tokenizes, so
    the model and one rebuilt from GGUF metadata encode text alike; one thread: the same
    model every time. (The tests' tiny models are trained with it too.)"""
    import sentencepiece as spm

    workdir.mkdir(parents=True, exist_ok=True)
    prefix = workdir / name
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text.splitlines()),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        user_defined_symbols=SPECIAL_TOKENS,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        # Rare characters fall back to bytes, so a small vocabulary still fits.
        character_coverage=0.98,
        split_digits=True,
        num_threads=1,
        minloglevel=2,
    )
    return prefix.with_suffix(".model")


def _write_gguf(path: Path, spm_model: Path) -> None:
    import gguf
    import sentencepiece as spm

    logging.getLogger("gguf").setLevel(logging.WARNING)  # its writer narrates every file

    sp = spm.SentencePieceProcessor(model_file=str(spm_model))
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(TINY_ID)
    writer.add_block_count(N_LAYERS)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(D_MODEL)
    writer.add_feed_forward_length(D_FF)
    writer.add_head_count(N_HEADS)
    writer.add_head_count_kv(N_KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    add_spm_vocabulary(writer, sp)
    # (Random Q and K rows need no llama.cpp row order: any order is as random.)
    for name, array in random_weights(vocab=sp.get_piece_size()).items():
        if array.ndim == 2:
            q = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_spm_vocabulary(
    writer,
    sp,
    *,
    chat_template: str = CHATML_TEMPLATE,
    user_defined: frozenset[str] = frozenset(),
    add_space_prefix: bool = True,
) -> int:
    """Write a SentencePiece model's tokenizer.ggml.* keys as llama.cpp's converter does: the
    special tokens are CONTROL, `user_defined` pieces (tags shown as text) USER_DEFINED, eos is
    <|im_end|>. Return the vocabulary size. (The tests' tiny models are written with it too.)"""
    import gguf

    kinds = gguf.TokenType
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        if sp.is_unknown(i):
            kind = kinds.UNKNOWN
        elif sp.is_control(i) or piece in SPECIAL_TOKENS:
            kind = kinds.CONTROL
        elif piece in user_defined:
            kind = kinds.USER_DEFINED
        elif sp.is_unused(i):
            kind = kinds.UNUSED
        elif sp.is_byte(i):
            kind = kinds.BYTE
        else:
            kind = kinds.NORMAL
        tokens.append(piece.encode("utf-8"))
        scores.append(sp.get_score(i))
        types.append(kind)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.piece_to_id("<|im_end|>"))
    writer.add_unk_token_id(sp.unk_id())
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(add_space_prefix)
    writer.add_chat_template(chat_template)
    return len(tokens)


def random_weights(
    *,
    vocab: int,
    d_model: int = D_MODEL,
    n_layers: int = N_LAYERS,
    n_heads: int = N_HEADS,
    n_kv_heads: int = N_KV_HEADS,
    d_ff: int = D_FF,
    qkv_bias: bool = False,
    tied: bool = False,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Seeded random float32 weights under GGUF names, Q/K in Hugging Face (rotate-half) order.
    (The tests' tiny models are made with it too.)"""
    rng = np.random.default_rng(seed)
    head_dim = d_model // n_heads

    def mat(rows, cols, scale=None):
        return (rng.standard_normal((rows, cols)) * (scale or cols**-0.5)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"token_embd.weight": mat(vocab, d_model, 1.0), "output_norm.weight": norm(d_model)}
    if not tied:
        w["output.weight"] = mat(vocab, d_model)
    for i in range(n_layers):
        p = f"blk.{i}."
        w[p + "attn_norm.weight"] = norm(d_model)
        w[p + "attn_q.weight"] = mat(n_heads * head_dim, d_model)
        w[p + "attn_k.weight"] = mat(n_kv_heads * head_dim, d_model)
        w[p + "attn_v.weight"] = mat(n_kv_heads * head_dim, d_model)
        if qkv_bias:
            for name, n in (("q", n_heads), ("k", n_kv_heads), ("v", n_kv_heads)):
                bias = 0.1 * rng.standard_normal(n * head_dim)
                w[p + f"attn_{name}.bias"] = bias.astype(np.float32)
        w[p + "attn_output.weight"] = mat(d_model, n_heads * head_dim)
        w[p + "ffn_norm.weight"] = norm(d_model)
        w[p + "ffn_gate.weight"] = mat(d_ff, d_model)
        w[p + "ffn_up.weight"] = mat(d_ff, d_model)
        w[p + "ffn_down.weight"] = mat(d_model, d_ff)
    return w
