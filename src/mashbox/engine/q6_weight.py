"""Q6_K decode weights read as stored (`Q6Weight`): the file's 6-bit q, int8 scale per 16
weights and fp16 d per 256, 0.82 bytes a weight where q8_weight.py's int8 q - 32 with float32
d * sc per 16 read 1.25 (qwen2.5-coder-0.5b's Q6_K ffn_down: 65 MB a step that are 43 here).
The activations are rounded to int16 per block of 32, and the kernel (rounded_gemm.cpp,
q6a16) gives the same bits as Q8Weight's over the same matrix. Prefill chunks take Q8Weight's
form (kept too, but for the output head): unpacking six bits costs more than reading them
once the rows are many.
Calls of more rows than a chunk take them in pieces (compact_weight.py): no float matrix.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as Q
from torch import Tensor

from . import block_bits, cpu_kernels
from .compact_weight import CompactWeight
from .int4 import Q4_MAX_ROWS
from .weights import RawBlocks


def fits_q6(blocks: list[RawBlocks | None]) -> bool:
    """Whether a matrix's parts are all Q6_K blocks that mashbox's kernel can read."""
    if not blocks or any(b is None or b.qtype != Q.Q6_K for b in blocks):
        return False
    rows = sum(b.data.shape[0] for b in blocks)
    return rows % cpu_kernels.TILE == 0 and cpu_kernels.load() is not None


def q6_k_scales(b: Tensor) -> tuple[Tensor, Tensor]:
    """Q6_K blocks uint8 [N, K / 256, 210] (ql[128], qh[64], int8 scales[16], fp16 d): their
    int8 sc [N, K / 16] and fp16 d [N, K / 256]."""
    n = b.shape[0]
    sc = b[..., 192:208].contiguous().view(torch.int8).reshape(n, -1)
    d = b[..., 208:210].contiguous().view(torch.float16).reshape(n, -1)
    return sc, d


def unpack_q6_k(blocks: RawBlocks) -> tuple[Tensor, Tensor, Tensor]:
    """Q6_K blocks as q uint8 [N, K] in 0..63 (block_bits), int8 sc [N, K / 16] and fp16 d
    [N, K / 256]: w = d * sc * (q - 32)."""
    return block_bits.bits([blocks]), *q6_k_scales(blocks.data)


def q6_k_as_int8(q: Tensor, sc: Tensor, d: Tensor) -> tuple[Tensor, Tensor]:
    """unpack_q6_k's q, sc and d as int8 q - 32 [N, K] and float32 d * sc [N, K / 16]
    (`group_scales`): Q8Weight's groups of 16."""
    return q.to(torch.int8) - 32, group_scales(sc, d)


def group_scales(sc: Tensor, d: Tensor) -> Tensor:
    """Q6_K's d * sc per 16 weights, float32 [N, K / 16], exact (an fp16 times an int8 has at
    most 19 significant bits)."""
    return d.float().repeat_interleave(16, 1) * sc.float()


class Q6Weight(CompactWeight):
    """A matrix kept twice: int8 q - 32 in groups of 16 (pack_q8, as Q8Weight) for prefill
    chunks, and the file's Q6_K blocks (pack_q6) for decode steps (up to `DECODE_ROWS` rows):
    the same bits from both. The int8 copy is left out where calls of many rows are rare
    (`prefill_rows` False: the output head, whose prefill rows are a chunk's last ones):
    they then read the six bits too."""

    kind = "q6_k"
    activation_bits = 16
    max_rows = Q4_MAX_ROWS["int16"]
    # Up to how many rows the six bits are read: on qwen2.5's ffn_down the 6-bit kernel took
    # 0.65-0.72x the int8 one's time at 1 row, 0.80-0.85x at 2-4, and 1.2-1.3x at 8-256 in
    # most runs (unpacking is compute-bound there; bench/kquant_rows.py). A decode step's
    # rows (DecodeStack) always take them.
    DECODE_ROWS = 4

    def __init__(self, blocks: list[RawBlocks], prefill_rows: bool = True):
        self.shape = block_bits.shape(blocks)
        self.kernel = cpu_kernels.load()
        parts = block_bits.kernel_args(blocks)
        # pack_q6's qs and scales (pack_q6_scales of q6_k_scales')
        self.qs = self.kernel.pack_blocks(*parts, 2)
        self.scales = self.kernel.blocks_q6_scales(*parts)
        self.qs8 = self.d8 = None
        if prefill_rows:  # pack_q8's of q6_k_as_int8's
            self.qs8 = self.kernel.pack_blocks_q8(*parts, 32)
            self.d8 = self.kernel.blocks_q6_group_scales(*parts)

    def multiply(self, x: Tensor) -> Tensor:
        x32 = x.float().contiguous()
        if x.shape[0] > self.DECODE_ROWS and self.qs8 is not None:
            return self.kernel.q8a16_linear(x32, self.qs8, self.d8)
        return self.kernel.q6a16_linear(x32, self.qs, self.scales)

    @property
    def decode_tensors(self) -> tuple[Tensor, ...]:
        return self.qs, self.scales

    def dequantized(self) -> Tensor:
        """The weights the kernel multiplies by, float32 [N, K], read back from its packing."""
        q = cpu_kernels.unpack_q4(self.qs).float() - 32
        sc, d = cpu_kernels.unpack_q6(self.scales)
        scale = d.float().repeat_interleave(16, 1) * sc.float()
        return q * scale.repeat_interleave(16, 1)
