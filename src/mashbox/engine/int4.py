"""int4 decode weights loaded from a GGUF's own 4-bit blocks, for torch's CPU int4 kernel.

A Q4_1 block is 32 weights w = q * d + m (q in 0..15, d and m fp16); a Q4_0 block is
w = (q - 8) * d. The kernel computes w = (q - 8) * scale + zero per group of 32, so both load
without re-quantizing: scale = d, zero = m + 8 * d (Q4_1) or 0 (Q4_0). In float32 that is
exact whenever m + 8 * d is (every block of SmolLM2: (q - 8) * d is exact, so the sum rounds
once, like q * d + m), but the kernel is only fast with bf16 activations, and its scales
must share their dtype: README "Decode weights".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from torch import Tensor

from .weights import RawBlocks

GROUP = 32  # the GGUF block: one kernel group
EXACT_QTYPES = (Q.Q4_0, Q.Q4_1)
INT4_MAX_ROWS = 16  # up to this many rows (decode batches) use the int4 weights


def fits(blocks: list[RawBlocks | None]) -> bool:
    """Whether the blocks of a matrix's parts (merged along the output dim) can go int4."""
    if any(b is None or b.qtype not in EXACT_QTYPES for b in blocks):
        return False
    # The kernel packs output rows in groups of 16.
    return sum(b.data.shape[0] for b in blocks) % 16 == 0


def unpack(blocks: RawBlocks) -> tuple[Tensor, Tensor, Tensor]:
    """Nibbles int32 [N, K] and per-group scale and zero float32 [N, K / 32], such that
    w = (q - 8) * scale + zero reproduces the file's dequantized weights."""
    b = blocks.data
    d = b[..., 0:2].contiguous().view(torch.float16)[..., 0].float()
    if blocks.qtype == Q.Q4_1:
        zero = b[..., 2:4].contiguous().view(torch.float16)[..., 0].float() + 8.0 * d
        qs = b[..., 4:]
    else:
        zero = torch.zeros_like(d)
        qs = b[..., 2:]
    # Byte j of a block holds weight j (low nibble) and weight j + 16 (high nibble).
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(b.shape[0], -1).to(torch.int32)
    return q, d, zero


class Int4Weight:
    """A weight kept twice: float for prefill-sized batches, and the file's 4-bit blocks packed
    for torch's int4 kernel for decode, where reading the weights is the whole cost."""

    def __init__(self, w: Tensor, blocks: list[RawBlocks], dtype=torch.bfloat16):
        """`blocks`: the parts of w (e.g. q, k, v) in order; dtype: of activations and scales
        in the kernel (bf16 is the fast one; float32 is exact but takes a scalar path)."""
        if w.device.type != "cpu":
            raise ValueError("int4 decode weights run on the CPU only")
        parts = [unpack(b) for b in blocks]
        q, scale, zero = (torch.cat(p) for p in zip(*parts, strict=True))
        if q.shape != w.shape:
            raise ValueError(f"blocks of shape {tuple(q.shape)} for a weight {tuple(w.shape)}")
        self.w = w
        self.dtype = dtype
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        # [K / 32, N, 2]: the kernel's layout.
        self.scales_and_zeros = torch.stack([scale.T, zero.T], dim=-1).to(dtype).contiguous()

    def __call__(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        if x.shape[0] > INT4_MAX_ROWS:
            return F.linear(x, self.w, bias)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(self.dtype), self.packed, GROUP, self.scales_and_zeros
        ).to(x.dtype)
        return y + bias if bias is not None else y

    @property
    def decode_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales_and_zeros))

    def dequantized(self) -> Tensor:
        """The weights the kernel multiplies by, [N, K] in self.dtype (x = identity)."""
        k = self.w.shape[1]
        eye = torch.eye(k, dtype=self.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            eye, self.packed, GROUP, self.scales_and_zeros
        ).T
