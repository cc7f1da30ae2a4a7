"""Build tiny random-weight models as real GGUF files (and HF folders) for the tests.

The weights are written the way llama.cpp's converter writes them (Q/K rows permuted for
`llama`), so the tests exercise the real loading path.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np

from mashbox.engine.weights import permute_rope_rows
from mashbox.protocol import Admit, Decode, Prefill, SamplingParams, Step
from mashbox.tiny import random_weights


def write_gguf(
    path: Path,
    weights: dict[str, np.ndarray],
    add_tokenizer,
    *,
    arch: str = "llama",
    n_heads: int = 4,
    n_kv_heads: int = 2,
    context: int = 512,
    quantize: bool = False,
    qtype_of=None,
) -> Path:
    """Write `weights` as a GGUF file; add_tokenizer(writer) adds the tokenizer metadata.

    quantize writes the matrices as Q8_0; qtype_of(name) -> a GGMLQuantizationType (or None
    for float32) picks each matrix's type instead."""
    d_model = weights["token_embd.weight"].shape[1]
    n_layers = sum(1 for k in weights if k.endswith("attn_norm.weight"))
    d_ff = weights["blk.0.ffn_gate.weight"].shape[0]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(n_layers)
    writer.add_context_length(context)
    writer.add_embedding_length(d_model)
    writer.add_feed_forward_length(d_ff)
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    add_tokenizer(writer)
    for name, array in weights.items():
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            array = permute_rope_rows(array, n_heads if "attn_q" in name else n_kv_heads)
        # Q8_0 keeps tiny models' outputs close to the float weights while testing dequant.
        qtype = qtype_of(name) if qtype_of else gguf.GGMLQuantizationType.Q8_0 if quantize else None
        if qtype is not None and array.ndim == 2 and array.shape[1] % 32 == 0:
            q = gguf.quants.quantize(array, qtype)
            writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def build_tiny_llama(workdir: Path, *, quantize: bool = False, seed: int = 0) -> Path:
    """A 2-layer Llama with a trained SentencePiece vocabulary, as GGUF."""
    from . import tinytok

    workdir.mkdir(parents=True, exist_ok=True)
    spm = tinytok.train_spm(workdir)
    import sentencepiece

    vocab = sentencepiece.SentencePieceProcessor(model_file=str(spm)).get_piece_size()
    weights = random_weights(vocab=vocab, seed=seed)
    return write_gguf(
        workdir / "tiny-llama.gguf",
        weights,
        lambda w: tinytok.add_spm_tokenizer(w, spm),
        quantize=quantize,
    )


def build_tiny_qwen2(
    workdir: Path,
    *,
    seed: int = 1,
    more_special: tuple[str, ...] = (),
    add_bos: bool = False,
    varied: bool = False,
) -> Path:
    """A 2-layer Qwen2 (qkv bias, tied embeddings) with a byte-level BPE vocabulary, as GGUF
    (with `more_special` tokens, and a bos put first where add_bos). varied: the embedding
    scaled down, so the tied head stops reading the input token back and text varies (as
    build_tiny_model does)."""
    from . import tinytok

    workdir.mkdir(parents=True, exist_ok=True)
    tok = tinytok.train_bpe(workdir, more_special=more_special)
    weights = random_weights(vocab=tok.get_vocab_size(), qkv_bias=True, tied=True, seed=seed)
    if varied:
        weights["token_embd.weight"] *= 0.1
    return write_gguf(
        workdir / "tiny-qwen2.gguf",
        weights,
        lambda w: tinytok.add_bpe_tokenizer(w, tok, pre="qwen2", add_bos=add_bos),
        arch="qwen2",
    )


def write_hf_folder(folder: Path, weights: dict[str, np.ndarray], tok, *, n_heads=4, n_kv=2):
    """Write weights as an HF Llama checkpoint folder (safetensors + config + tokenizer)."""
    import torch
    from safetensors.torch import save_file

    from mashbox.engine.weights import _HF_GLOBAL_NAMES, _HF_LAYER_NAMES

    from . import tinytok

    folder.mkdir(parents=True, exist_ok=True)
    reverse = {v: k for k, v in _HF_GLOBAL_NAMES.items()}
    layer_reverse = {v: k for k, v in _HF_LAYER_NAMES.items()}
    out = {}
    for name, array in weights.items():
        if name in reverse:
            hf = reverse[name]
        else:
            _, i, rest = name.split(".", 2)
            hf = f"model.layers.{i}.{layer_reverse[rest]}"
        out[hf] = torch.from_numpy(array).to(torch.bfloat16)
    save_file(out, str(folder / "model.safetensors"))
    d_model = weights["token_embd.weight"].shape[1]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": d_model,
        "intermediate_size": weights["blk.0.ffn_gate.weight"].shape[0],
        "num_hidden_layers": sum(1 for k in weights if k.endswith("attn_norm.weight")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "vocab_size": weights["token_embd.weight"].shape[0],
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": "output.weight" not in weights,
    }
    (folder / "config.json").write_text(json.dumps(config))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": tinytok.CHATML_TEMPLATE,
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "add_bos_token": False,
            }
        )
    )
    return folder


def no_tokenizer(writer) -> None:
    """For write_gguf: models read by the engine only, with no vocabulary of their own."""
    writer.add_tokenizer_model("gpt2")


def step_by_step(
    engine, prompts: list[tuple[int, ...]], n: int, params: SamplingParams | None = None
) -> list[list[int]]:
    """n tokens for each prompt (prompt i in slot i; greedy unless `params` say otherwise),
    all decoded as one batch, each step planned after the one before's result."""
    params = params or SamplingParams()
    first = engine.step(
        Step(
            admits=tuple(Admit(s, params, p) for s, p in enumerate(prompts)),
            prefills=tuple(Prefill(s, 0, p, True) for s, p in enumerate(prompts)),
        )
    )
    seqs = [[first.tokens[s]] for s in range(len(prompts))]
    for _ in range(n - 1):
        decodes = tuple(
            Decode(s, seq[-1], len(p) + len(seq) - 1)
            for s, (p, seq) in enumerate(zip(prompts, seqs, strict=True))
        )
        tokens = engine.step(Step(decodes=decodes)).tokens
        for s, seq in enumerate(seqs):
            seq.append(tokens[s])
    return seqs


# What sets each architecture the engine loads apart in a GGUF file. llama.cpp's converter
# permutes the Llama-style ones' Q/K rows (write_gguf does it for "llama" only); Qwen3 has
# per-head RMS norms on q and k; the small Qwen models tie their embeddings.
FAMILIES = {
    "llama": {"qkv_bias": False, "qk_norm": False, "tied": False, "permuted": True},
    "mistral": {"qkv_bias": False, "qk_norm": False, "tied": False, "permuted": True},
    "qwen2": {"qkv_bias": True, "qk_norm": False, "tied": True, "permuted": False},
    "qwen3": {"qkv_bias": False, "qk_norm": True, "tied": True, "permuted": False},
}

# How build_tiny_model stores the matrices: float32, Q8_0, or the 4-bit blocks the int4
# decode kinds read exactly (Q4_1, and Q4_0 for the embedding and head, so both are read).
QUANTS = ("f32", "q8_0", "q4")


def _qtype_for(quant: str):
    Q = gguf.GGMLQuantizationType
    if quant == "f32":
        return None
    if quant == "q8_0":
        return lambda name: Q.Q8_0
    if quant == "q4":
        return lambda name: Q.Q4_0 if name in ("token_embd.weight", "output.weight") else Q.Q4_1
    raise ValueError(f"unknown quant {quant!r} ({', '.join(QUANTS)})")


def build_tiny_model(
    workdir: Path, *, family: str, tokenizer: str, quant: str = "q8_0", seed: int = 2
) -> Path:
    """A 2-layer model of any family in FAMILIES with a tiny vocabulary of either kind
    (tinytok.TOKENIZER_KINDS), its matrices stored as `quant` (QUANTS), as GGUF. The default
    seed gives every family varied greedy text (many seeds repeat one token)."""
    from . import tinytok

    traits = FAMILIES[family]
    qtype_of = _qtype_for(quant)
    workdir.mkdir(parents=True, exist_ok=True)
    vocab, add_tokenizer = tinytok.train_tokenizer(workdir, tokenizer)
    n_heads, n_kv_heads = 4, 2
    weights = random_weights(
        vocab=vocab,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        qkv_bias=traits["qkv_bias"],
        tied=traits["tied"],
        seed=seed,
    )
    if traits["tied"]:
        # A head as large as the embedding reads its input token back, every step.
        weights["token_embd.weight"] *= 0.1
    n_layers = sum(1 for k in weights if k.endswith("attn_norm.weight"))
    head_dim = weights["token_embd.weight"].shape[1] // n_heads
    rng = np.random.default_rng(seed + 1)
    for i in range(n_layers):
        p = f"blk.{i}."
        if traits["qk_norm"]:
            for name in ("attn_q_norm.weight", "attn_k_norm.weight"):
                weights[p + name] = (1.0 + 0.1 * rng.standard_normal(head_dim)).astype(np.float32)
        if traits["permuted"] and family != "llama":
            q, k = p + "attn_q.weight", p + "attn_k.weight"
            weights[q] = permute_rope_rows(weights[q], n_heads)
            weights[k] = permute_rope_rows(weights[k], n_kv_heads)
    return write_gguf(
        workdir / f"tiny-{family}-{tokenizer}-{quant}.gguf",
        weights,
        add_tokenizer,
        arch=family,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        qtype_of=qtype_of,
    )
