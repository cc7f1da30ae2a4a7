"""Write a GGUF file of a bigger model's shape: random blocks laid out as llama.cpp's Q4_K_M
lays out a model's, and a catalogue model's tokenizer. The model hubs are unreachable here,
and memory, load time and decode speed depend on the shapes, formats and bytes, not on what
the weights say: the text it writes is gibberish.

    python bench/synthetic_gguf.py /tmp/llama-8b.gguf [--shape llama-8b]

Q4_K_M (llama.cpp's `llama_tensor_get_type`): Q4_K everywhere but the output (Q6_K) and the
attn_v and ffn_down matrices of the first and last eighths of the layers and every third
between them (Q6_K). Scales are drawn so a weight's size is about 1 / sqrt(K), as trained
weights are, so activations stay finite over the layers.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from mashbox import registry
from mashbox.engine import gguf_file

# d_model, layers, heads, kv heads, d_ff
SHAPES = {
    "llama-8b": (4096, 32, 32, 8, 14336),  # Llama 3.1 8B's (its 128k vocabulary aside)
    "llama-3b": (3072, 28, 24, 8, 8192),  # Llama 3.2 3B's
    "llama-1b": (2048, 16, 32, 8, 8192),  # Llama 3.2 1B's
}
TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")
# Each format's fp16 scales' offsets in a block, and the RMS of its integer part (a weight
# is about scale * that): Q4_K's d * sc * q (sc 0..63, q 0..15) less dmin * mn, Q6_K's
# d * sc * (q - 32) (sc int8).
SCALES = {Q.Q4_K: ((0, 2), 323.0), Q.Q6_K: ((208,), 1369.0)}


def more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers Q4_K_M gives Q6_K attn_v and ffn_down."""
    eighth = n_layers // 8
    return layer < eighth or layer >= 7 * eighth or (layer - eighth) % 3 == 2


def tensors(shape: tuple[int, ...], vocab: int) -> list[tuple[str, tuple[int, int], Q | None]]:
    """(name, (rows, K), format or None for float32 vectors) in the order llama.cpp writes."""
    d, n_layers, n_heads, n_kv, ff = shape
    kv = d // n_heads * n_kv
    out = [("token_embd.weight", (vocab, d), Q.Q4_K)]
    for i in range(n_layers):
        wide = Q.Q6_K if more_bits(i, n_layers) else Q.Q4_K
        out += [
            (f"blk.{i}.attn_norm.weight", (1, d), None),
            (f"blk.{i}.attn_q.weight", (d, d), Q.Q4_K),
            (f"blk.{i}.attn_k.weight", (kv, d), Q.Q4_K),
            (f"blk.{i}.attn_v.weight", (kv, d), wide),
            (f"blk.{i}.attn_output.weight", (d, d), Q.Q4_K),
            (f"blk.{i}.ffn_norm.weight", (1, d), None),
            (f"blk.{i}.ffn_gate.weight", (ff, d), Q.Q4_K),
            (f"blk.{i}.ffn_up.weight", (ff, d), Q.Q4_K),
            (f"blk.{i}.ffn_down.weight", (d, ff), wide),
        ]
    return out + [("output_norm.weight", (1, d), None), ("output.weight", (vocab, d), Q.Q6_K)]


def random_blocks(rng, qtype: Q, rows: int, k: int) -> np.ndarray:
    """uint8 [rows, K / 256 * block bytes]: random bytes, scales drawn for weights ~ 1/sqrt(K)."""
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, k // block, block_bytes), dtype=np.uint8)
    offsets, rms = SCALES[qtype]
    scale = (rng.choice([-1.0, 1.0], raw.shape[:2]) / (rms * np.sqrt(k))).astype(np.float16)
    for at in offsets:
        raw[..., at : at + 2] = scale[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", choices=SHAPES, default="llama-8b")
    parser.add_argument("--tokenizer", default=registry.DEFAULT_MODEL, help="registry id")
    parser.add_argument("--context", type=int, default=8192)
    args = parser.parse_args()
    source = registry.fetch(registry.resolve(args.tokenizer), registry.default_models_dir())
    meta = gguf_file.read_metadata(source, TOKENIZER_ARRAYS)
    d, n_layers, n_heads, n_kv, ff = SHAPES[args.shape]
    vocab = len(meta["tokenizer.ggml.tokens"])

    writer = gguf.GGUFWriter(str(args.out), "llama")
    writer.add_name(f"synthetic {args.shape} (random Q4_K_M blocks)")
    writer.add_block_count(n_layers)
    writer.add_context_length(args.context)
    writer.add_embedding_length(d)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    for key, value in meta.items():  # the tokenizer and its chat template, as the source's
        if not key.startswith("tokenizer."):
            continue
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_string(key, value)
    plan = tensors(SHAPES[args.shape], vocab)
    for name, (rows, k), qtype in plan:
        if qtype is None:
            writer.add_tensor_info(name, (k,), np.dtype(np.float32), 4 * k)
        else:
            nbytes = rows * k // GGML_QUANT_SIZES[qtype][0] * GGML_QUANT_SIZES[qtype][1]
            writer.add_tensor_info(name, (rows, nbytes // rows), np.dtype(np.uint8), nbytes, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for _, (rows, k), qtype in plan:  # one tensor in memory at a time
        if qtype is None:
            writer.write_tensor_data(np.ones(k, np.float32))
        else:
            writer.write_tensor_data(random_blocks(rng, qtype, rows, k))
    writer.close()
    size = args.out.stat().st_size
    print(f"{args.out}: {args.shape}, vocabulary {vocab}, {size / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
