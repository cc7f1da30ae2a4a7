"""int4 decode weights loaded from a GGUF's own 4-bit blocks, never re-quantized
(`Int4Weight`; its Q8_0 blocks, the same way: q8_weight.py).

A Q4_1 block is 32 weights w = q * d + m (q in 0..15, d and m fp16); a Q4_0 block is
w = (q - 8) * d, that is m = -8 d. Two kernels read them:
- mashbox's (blocks_gemm.cpp, where the CPU kernels build): q, d and m as stored, times
  float32 activations, or activations rounded per block of 32 to int16 or int8 for exact
  integer dot products (faster; int8 is llama.cpp's rounding): the file's weights exactly.
- torch's `_weight_int4pack_mm_for_cpu`, which computes w = (q - 8) * scale + zero per group
  of 32: scale = d, zero = m + 8 d. In float32 that is exact whenever m + 8 d is (every
  block of SmolLM2), but the kernel is only fast with bf16 activations, and its scales must
  share their dtype: README "Decode weights".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from torch import Tensor

from . import cpu_kernels
from .weights import RawBlocks

GROUP = 32  # the GGUF block: one kernel group
EXACT_QTYPES = (Q.Q4_0, Q.Q4_1)
KEPT_QTYPES = (*EXACT_QTYPES, Q.Q8_0)  # the blocks an int4 engine loads as stored
# Decode weights that read those blocks, and what their 4-bit matrices multiply: float32
# activations, or activations rounded per block of 32 to int16 (near float32) or int8.
BLOCK_KINDS = {"int4": "float", "int4a16": "int16", "int4a8": "int8"}
KIND_OF_ACTIVATIONS = {activations: kind for kind, activations in BLOCK_KINDS.items()}
ACTIVATION_BITS = {"float": 32, "int16": 16, "int8": 8}
KERNELS = {"float": "q4_linear", "int16": "q4a16_linear", "int8": "q4a8_linear"}
INT4_MAX_ROWS = 16  # up to this many rows (decode batches) use torch's int4 kernel
# and mashbox's block kernels, short prefill chunks too: on the AVX-512 host they beat
# float32 sgemm at 24 rows (1.35x) and 48 (1.12x), not from ~96 (bench in docs/NOTES.md).
BLOCKS_MAX_ROWS = 48
# By what the Q4 blocks multiply: int16 activations beat sgemm by 1.55x at 64 rows and
# 1.32x at 96 (par from 128), int8 by 1.4-3.6x up to 256 (docs/NOTES.md, 2026-12-01).
Q4_MAX_ROWS = {"float": BLOCKS_MAX_ROWS, "int16": 96, "int8": 256}


def fits(blocks: list[RawBlocks | None]) -> bool:
    """Whether the blocks of a matrix's parts (merged along the output dim) can go int4."""
    if any(b is None or b.qtype not in EXACT_QTYPES for b in blocks):
        return False
    # The kernel packs output rows in groups of 16.
    return sum(b.data.shape[0] for b in blocks) % 16 == 0


def unpack(blocks: RawBlocks) -> tuple[Tensor, Tensor, Tensor]:
    """Nibbles uint8 [N, K] and each block's d and m, fp16 [N, K / 32], as stored (Q4_0:
    m = -8 d, exact in fp16): w = q * d + m."""
    b = blocks.data
    d = b[..., 0:2].contiguous().view(torch.float16)[..., 0]
    if blocks.qtype == Q.Q4_1:
        m = b[..., 2:4].contiguous().view(torch.float16)[..., 0]
        qs = b[..., 4:]
    else:
        m = d * -8
        qs = b[..., 2:]
    # Byte j of a block holds weight j (low nibble) and weight j + 16 (high nibble).
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(b.shape[0], -1)
    return q, d, m


class Int4Weight:
    """A weight kept twice: float for prefill-sized batches, and the file's 4-bit blocks for
    decode, where reading the weights is the whole cost."""

    def __init__(
        self, w: Tensor, blocks: list[RawBlocks], dtype=torch.bfloat16, ours=True,
        activations="float",
    ):  # fmt: skip
        """`blocks`: the parts of w (e.g. q, k, v) in order. mashbox's kernel where it builds
        and `ours`, taking `activations` float32, or rounded per block of 32 to "int16"
        (q4a16) or "int8" (q4a8); else torch's, with activations and scales in `dtype` (bf16
        is its fast one; float32 is exact but takes a scalar path)."""
        if w.device.type != "cpu":
            raise ValueError("int4 decode weights run on the CPU only")
        parts = [unpack(b) for b in blocks]
        q, d, m = (torch.cat(p) for p in zip(*parts, strict=True))
        if q.shape != w.shape:
            raise ValueError(f"blocks of shape {tuple(q.shape)} for a weight {tuple(w.shape)}")
        self.w = w
        self.dtype = dtype
        self.kernel = cpu_kernels.load() if ours and q.shape[0] % cpu_kernels.TILE == 0 else None
        self.activations = activations if self.kernel is not None else "float"
        if self.kernel is not None:
            self.qs, self.dm = cpu_kernels.pack_q4(q, d, m)
            if self.activations == "int8":
                self.qs = cpu_kernels.pack_q4a8(q)
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
            # [K / 32, N, 2]: the kernel's layout; w = (q - 8) * d + (m + 8 d).
            zero = m.float() + 8 * d.float()
            self.scales_and_zeros = torch.stack([d.T, zero.T], dim=-1).to(dtype).contiguous()

    @property
    def kind(self) -> str:
        """The decode weights this is: "int4", "int4a16" or "int4a8", by its activations."""
        return KIND_OF_ACTIVATIONS[self.activations]

    @property
    def activation_bits(self) -> int:
        """What activations are rounded to per block of 32 before the multiply (32: not)."""
        return ACTIVATION_BITS[self.activations]

    @property
    def max_rows(self) -> int:
        """Rows up to which a call uses the int4 weights; more take the float path."""
        return Q4_MAX_ROWS[self.activations] if self.kernel is not None else INT4_MAX_ROWS

    def __call__(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        if x.shape[0] > self.max_rows:
            return F.linear(x, self.w, bias)
        if self.kernel is not None:
            matmul = getattr(self.kernel, KERNELS[self.activations])
            y = matmul(x.float().contiguous(), self.qs, self.dm).to(x.dtype)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(self.dtype), self.packed, GROUP, self.scales_and_zeros
            ).to(x.dtype)
        return y + bias if bias is not None else y

    @property
    def decode_tensors(self) -> tuple[Tensor, ...]:
        return (
            (self.qs, self.dm) if self.kernel is not None else (self.packed, self.scales_and_zeros)
        )

    def dequantized(self) -> Tensor:
        """The weights the kernel multiplies by, [N, K] (x = identity): float32 from ours,
        self.dtype from torch's."""
        k = self.w.shape[1]
        if self.activations == "int8":  # from the packed tensors (x = identity would round)
            dm = self.dm.permute(0, 3, 1, 2).reshape(-1, k // GROUP, 2).float()
            q = cpu_kernels.unpack_q4a8(self.qs).float().view(-1, k // GROUP, GROUP)
            return (q * dm[..., :1] + dm[..., 1:]).reshape(-1, k)
        if self.kernel is not None:
            return self.kernel.q4_linear(torch.eye(k), self.qs, self.dm).T
        eye = torch.eye(k, dtype=self.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            eye, self.packed, GROUP, self.scales_and_zeros
        ).T
