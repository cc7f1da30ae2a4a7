"""Dequantize GGUF blocks to float32 with torch (the common formats) or gguf's numpy code."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as Q


def _f16(block: torch.Tensor, start: int) -> torch.Tensor:
    return block[:, start : start + 2].contiguous().view(torch.float16).float()


def _q8_0(b: torch.Tensor) -> torch.Tensor:  # d, 32 x int8
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b, 0)


def _q4_0(b: torch.Tensor) -> torch.Tensor:  # d, 16 bytes of nibbles (low: 0-15, high: 16-31)
    qs = b[:, 2:]
    return (torch.cat([qs & 0x0F, qs >> 4], dim=1).float() - 8.0) * _f16(b, 0)


def _q4_1(b: torch.Tensor) -> torch.Tensor:  # d, m, 16 bytes of nibbles
    qs = b[:, 4:]
    return torch.cat([qs & 0x0F, qs >> 4], dim=1).float() * _f16(b, 0) + _f16(b, 2)


def fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """A Q5_0 / Q5_1 block's 32 high bits (4 bytes, little-endian) as 0 or 16 per weight,
    uint8 [..., 32]: bit j is weight j's."""
    bits = (qh[..., :, None] >> torch.arange(8, dtype=torch.uint8)) & 1  # [..., 4, 8]
    return bits.reshape(*qh.shape[:-1], 32) << 4


def _q5_0(b: torch.Tensor) -> torch.Tensor:  # d, qh[4], 16 bytes of nibbles
    qs = b[:, 6:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1) | fifth_bits(b[:, 2:6])
    return (q.float() - 16.0) * _f16(b, 0)


def _q5_1(b: torch.Tensor) -> torch.Tensor:  # d, m, qh[4], 16 bytes of nibbles
    qs = b[:, 8:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1) | fifth_bits(b[:, 4:8])
    return q.float() * _f16(b, 0) + _f16(b, 2)


_TORCH = {Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1}


# Blocks dequantized at a time: a tensor's intermediates (several bytes a weight) stay ~10 MB,
# so a load's peak is its float32 result, not several times it.
CHUNK_BLOCKS = 1 << 16


def dequantize(data: np.ndarray, qtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor's raw GGUF data as a float32 torch tensor of `shape` (a private copy)."""
    if qtype in (Q.F32, Q.F16, Q.BF16):
        # Raw file bytes or typed arrays alike: view them as the stored float type.
        if qtype == Q.BF16:
            raw = torch.from_numpy(np.array(data).view(np.int16)).view(torch.bfloat16)
        else:
            raw = torch.from_numpy(
                np.array(data).view(np.float32 if qtype == Q.F32 else np.float16)
            )
        return raw.float().reshape(shape)
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = np.asarray(data, dtype=np.uint8).reshape(-1, block_bytes)
    out = torch.empty(blocks.shape[0], block)
    for start in range(0, blocks.shape[0], CHUNK_BLOCKS):
        chunk = blocks[start : start + CHUNK_BLOCKS]
        if qtype in _TORCH:
            values = _TORCH[qtype](torch.from_numpy(chunk.copy()))
        else:
            values = torch.from_numpy(np.asarray(quants.dequantize(chunk, qtype), np.float32))
        out[start : start + len(chunk)] = values.reshape(len(chunk), block)
    return out.reshape(shape)
