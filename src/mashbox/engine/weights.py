"""Read a model's weights into float32 tensors under GGUF tensor names.

GGUF files are dequantized with `gguf`, a tensor when it is read (`FileTensors`): a model that
reads a matrix's blocks as stored never holds its float32 copy. HF folders are read with
`safetensors` and renamed. Every loader returns the same layout: Q/K rows in Hugging Face
order, so the model applies one RoPE (NeoX, rotate-half) whatever the source.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import TypeVar

import attrs
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from . import gguf_file
from .config import ModelConfig, from_gguf_fields, from_hf_config
from .dequant import dequantize


@attrs.frozen
class RawBlocks:
    """A matrix's quantized blocks as stored: uint8 [rows, blocks per row, block bytes]."""

    qtype: GGMLQuantizationType
    data: torch.Tensor

    def dequantized(self) -> torch.Tensor:
        """The float32 matrix [rows, K] these blocks hold, as the whole tensor's dequantization
        gives it (each block's weights depend on that block alone)."""
        rows, n_blocks, _ = self.data.shape
        block = GGML_QUANT_SIZES[self.qtype][0]
        return dequantize(self.data.numpy(), self.qtype, (rows, n_blocks * block))


def dequantized(parts: list[RawBlocks]) -> torch.Tensor:
    """The float32 matrix of a matrix's parts (e.g. q, k, v), merged along the output dim."""
    return torch.cat([b.dequantized() for b in parts])


T = TypeVar("T")


class FileTensors(Mapping[str, T]):
    """A file's tensors by name, each made by `make` from its mapped bytes when read, and not
    kept: whoever reads one keeps what it needs of it."""

    def __init__(
        self, infos: list[gguf_file.TensorInfo], make: Callable[[gguf_file.TensorInfo], T]
    ):
        self._infos = {t.name: t for t in infos}
        self._make = make

    def __getitem__(self, name: str) -> T:
        return self._make(self._infos[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos)

    def __len__(self) -> int:
        return len(self._infos)


@attrs.frozen
class LoadedWeights:
    """A model's config, its tensors by GGUF name, and what the file holds."""

    config: ModelConfig
    tensors: Mapping[str, torch.Tensor]  # float32; a GGUF file's dequantized when read
    file_bytes: int
    n_params: int

    # The file's own blocks of the matrices whose type was in `keep_blocks` (GGUF only), in
    # the same row order as `tensors`, the mapped file's bytes when read: the int4 decode
    # path loads Q4_0/Q4_1/Q4_K exactly from them.
    blocks: Mapping[str, RawBlocks] = attrs.field(factory=dict)

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.file_bytes / max(self.n_params, 1)


def load(path: Path, keep_blocks: Collection[GGMLQuantizationType] = ()) -> LoadedWeights:
    """Load a .gguf file or a Hugging Face folder."""
    path = Path(path)
    return load_hf_folder(path) if path.is_dir() else load_gguf(path, keep_blocks)


def unpermute_rope_rows(w, n_heads: int):
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE) back to HF's rotate-half order."""
    rows = w.shape[0]
    w = w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2)
    return w.reshape(rows, *w.shape[3:])


def permute_rope_rows(w, n_heads: int):
    """Apply llama.cpp's Q/K row permutation (what its converter writes into GGUF files)."""
    rows = w.shape[0]
    w = w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2)
    return w.reshape(rows, *w.shape[3:])


def load_gguf(path: Path, keep_blocks: Collection[GGMLQuantizationType] = ()) -> LoadedWeights:
    """A GGUF file's tensors, each dequantized to float32 when read, and the raw blocks of the
    matrices whose type is in `keep_blocks`, the mapped file's bytes."""
    fields, infos = gguf_file.read(path)
    names = {t.name for t in infos}
    config = from_gguf_fields(
        fields,
        vocab_size=next(t.shape[0] for t in infos if t.name == "token_embd.weight"),
        tied="output.weight" not in names,
        has_bias="blk.0.attn_q.bias" in names,
    )
    # llama.cpp's converter permutes Q/K rows for its interleaved RoPE (qwen GGUFs are not
    # permuted): the heads each such matrix is undone over.
    rope_heads = {}
    if config.arch in ("llama", "mistral"):
        for i in range(config.n_layers):
            rope_heads[f"blk.{i}.attn_q.weight"] = config.n_heads
            rope_heads[f"blk.{i}.attn_k.weight"] = config.n_kv_heads

    def in_hf_order(name: str, rows: torch.Tensor) -> torch.Tensor:
        return unpermute_rope_rows(rows, rope_heads[name]) if name in rope_heads else rows

    def floats(t: gguf_file.TensorInfo) -> torch.Tensor:
        return in_hf_order(t.name, dequantize(t.data, t.qtype, t.shape))

    def blocks(t: gguf_file.TensorInfo) -> RawBlocks:
        # The mapped bytes themselves: the decode weights read them once, into their own
        # layouts, and keep nothing of them.
        data = torch.from_numpy(t.data).reshape(t.shape[0], -1, GGML_QUANT_SIZES[t.qtype][1])
        # Blocks run along a row: permuting rows moves whole blocks.
        return RawBlocks(t.qtype, in_hf_order(t.name, data))

    kept = [t for t in infos if t.qtype in keep_blocks and len(t.shape) == 2]
    return LoadedWeights(
        config,
        FileTensors(infos, floats),
        file_bytes=path.stat().st_size,
        n_params=sum(math.prod(t.shape) for t in infos),
        blocks=FileTensors(kept, blocks),
    )


_HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_HF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def hf_to_gguf_name(name: str) -> str | None:
    """Map an HF Llama/Qwen tensor name to its GGUF name (None for tensors the model ignores)."""
    if name in _HF_GLOBAL_NAMES:
        return _HF_GLOBAL_NAMES[name]
    m = _HF_LAYER.fullmatch(name)
    if m and m.group(2) in _HF_LAYER_NAMES:
        return f"blk.{m.group(1)}.{_HF_LAYER_NAMES[m.group(2)]}"
    return None


def load_hf_folder(path: Path) -> LoadedWeights:
    """Read config.json and every *.safetensors file of an HF checkpoint folder."""
    from safetensors.torch import load_file  # torch: checkpoints are usually bf16

    config = from_hf_config(json.loads((path / "config.json").read_text()))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no .safetensors files")
    tensors, file_bytes, n_params = {}, 0, 0
    for f in files:
        file_bytes += f.stat().st_size
        for name, array in load_file(f).items():
            target = hf_to_gguf_name(name)
            if target is not None:
                tensors[target] = array.float()
                n_params += array.numel()
    tied = "output.weight" not in tensors
    return LoadedWeights(attrs.evolve(config, tied_embeddings=tied), tensors, file_bytes, n_params)
