"""The integer weights of a matrix's GGUF blocks (`bits`), q uint8 [N, K]: 0..15 for Q4_0,
Q4_1 and Q4_K, 0..31 for Q5_0, Q5_1 and Q5_K, 0..63 for Q6_K. What each block scales and
offsets them by is the decode weights' (int4.py, q6_weight.py).

mashbox's kernels make them in one pass over the bytes (block_repack.cpp), and pack them into
their own layouts in the same pass (`pack_blocks`). `torch_bits` defines them, and runs where
the kernels do not build: its small strided uint8 ops took most of the 42 s an 8B-shaped
Q4_K_M file took to load.
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from torch import Tensor

from . import cpu_kernels
from .dequant import fifth_bits
from .weights import RawBlocks

BITS_QTYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)


def bits(parts: list[RawBlocks]) -> Tensor:
    """The integer weights of a matrix's parts, stacked along the outputs: uint8 [N, K]."""
    kernel = cpu_kernels.load()
    if kernel is None:
        return torch.cat([torch_bits(b) for b in parts])
    return kernel.block_bits(*kernel_args(parts))


def kernel_args(parts: list[RawBlocks]) -> tuple[list[Tensor], list[int]]:
    """The parts as the kernels' block_bits, pack_blocks and pack_blocks_q8 take them: their
    blocks and their GGML types."""
    return [b.data.contiguous() for b in parts], [int(b.qtype) for b in parts]


def shape(parts: list[RawBlocks]) -> tuple[int, int]:
    """[N, K] of a matrix's parts stacked along the outputs."""
    b = parts[0]
    return sum(p.data.shape[0] for p in parts), b.data.shape[1] * GGML_QUANT_SIZES[b.qtype][0]


def torch_bits(blocks: RawBlocks) -> Tensor:
    """One part's integer weights, uint8 [N, K], in torch."""
    b, n = blocks.data, blocks.data.shape[0]
    if blocks.qtype in (Q.Q4_K, Q.Q5_K):
        # 32 bytes per pair of sub-blocks: sub-block 2i in their low nibbles, 2i + 1 in the
        # high; Q5_K's fifth bit of sub-block j, weight l is bit j of qh[l].
        qs = b[..., 48 if blocks.qtype == Q.Q5_K else 16 :].reshape(n, -1, 4, 1, 32)
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-2).reshape(n, -1, 8, 32)
        if blocks.qtype == Q.Q5_K:
            qh = b[..., 16:48]  # [N, K / 256, 32]
            q = q | ((qh[..., None, :] >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1) << 4
        return q.reshape(n, -1)
    if blocks.qtype == Q.Q6_K:
        # Weight 128h + 64s + j (j < 64) has nibble s of ql[64h + j] as its low four bits;
        # weight 128h + 32s + j (j < 32) bits 2s, 2s + 1 of qh[32h + j] as its top two.
        ql = b[..., :128].reshape(n, -1, 2, 1, 64)
        low = torch.cat([ql & 0x0F, ql >> 4], dim=-2).reshape(n, -1, 256)
        qh = b[..., 128:192].reshape(n, -1, 2, 1, 32)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
        high = ((qh >> shifts) & 3).reshape(n, -1, 256)
        return (low | (high << 4)).reshape(n, -1)
    if blocks.qtype not in BITS_QTYPES:
        raise ValueError(f"no integer weights for {blocks.qtype.name}")
    # Byte j of a block's nibbles holds weight j (low) and weight j + 16 (high); the Q5s'
    # fifth bit of weight j is bit j of the little-endian word before them.
    at = 4 if blocks.qtype in (Q.Q4_1, Q.Q5_1) else 2
    five = blocks.qtype in (Q.Q5_0, Q.Q5_1)
    qs = b[..., at + 4 * five :]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1)
    if five:
        q = q | fifth_bits(b[..., at : at + 4])
    return q.reshape(n, -1)
