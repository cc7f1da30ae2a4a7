"""int4 decode weights loaded from a GGUF's own 4-bit blocks, never re-quantized
(`Int4Weight`; its Q8_0 blocks, the same way: q8_weight.py).

A Q4_1 block is 32 weights w = q * d + m (q in 0..15, d and m fp16); a Q4_0 block is
w = (q - 8) * d, that is m = -8 d. A Q4_K block (llama.cpp's k-quants) is 256 weights in 144
bytes: d and dmin (fp16), eight 6-bit scales sc and mins mn packed in 12 bytes, 128 bytes of
nibbles; its sub-block j is w = (d * sc_j) * q - dmin * mn_j, a Q4_1 group whose d and m,
an fp16 times a 6-bit integer (17 significant bits), are exact in float32 but not always in
fp16: kept as float32, 0.75 bytes a weight where the file has 0.5625 (mashbox's kernels
only: torch's would round them to bf16), or, with rounded activations, as the file keeps
them (cpu_kernels.pack_k_scales: 0.58 bytes a weight), the kernels forming the same float32
values. Q5_0, Q5_1 and Q5_K are the same with a fifth bit
per weight (q in 0..31; Q5_0: w = (q - 16) * d, m = -16 d), packed beside the nibbles
(cpu_kernels.pack_q5): 0.75 bytes a weight, 0.875 for Q5_K; mashbox's kernels only. Two
kernels read them:
- mashbox's (blocks_gemm.cpp and rounded_gemm.cpp, where the CPU kernels build): q, d and m
  as stored, times float32 activations, or activations rounded per block of 32 to int16 or
  int8 for exact integer dot products (faster; int8 is llama.cpp's rounding): the file's
  weights exactly.
- torch's `_weight_int4pack_mm_for_cpu`, which computes w = (q - 8) * scale + zero per group
  of 32: scale = d, zero = m + 8 d. In float32 that is exact whenever m + 8 d is (every
  block of SmolLM2), but the kernel is only fast with bf16 activations, and its scales must
  share their dtype: README "Decode weights".
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as Q
from torch import Tensor

from . import block_bits, cpu_kernels
from .compact_weight import CompactWeight
from .weights import RawBlocks, dequantized

GROUP = 32  # the GGUF block: one kernel group
Q5_QTYPES = (Q.Q5_0, Q.Q5_1, Q.Q5_K)  # five bits a weight: mashbox's kernels only
EXACT_QTYPES = (Q.Q4_0, Q.Q4_1, Q.Q4_K, *Q5_QTYPES)
K_QTYPES = (Q.Q4_K, Q.Q5_K)  # whose groups take float32 d and m (or k_scales): ours only
K_GROUPS = 8  # groups of 32 in a K-quant block
# The blocks an int4 engine loads as stored (Q8_0 and Q6_K: q8_weight.py).
KEPT_QTYPES = (*EXACT_QTYPES, Q.Q8_0, Q.Q6_K)
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
# By what the Q4 blocks multiply: int16 activations beat sgemm by 1.55x at 64 rows and 1.32x
# at 96 on the AVX-512 Intel host (par at 128-256), by 2.8-4.8x up to 256 on the EPYC host
# (MKL's sgemm is weaker there); int8 by 1.4-6x up to 256 on both (docs/NOTES.md,
# 2026-12-01). 256 is a whole prefill chunk (--prefill-chunk's default).
Q4_MAX_ROWS = {"float": BLOCKS_MAX_ROWS, "int16": 256, "int8": 256}


def fits(blocks: list[RawBlocks | None]) -> bool:
    """Whether the blocks of a matrix's parts (merged along the output dim) can go int4."""
    if any(b is None or b.qtype not in EXACT_QTYPES for b in blocks):
        return False
    rows = sum(b.data.shape[0] for b in blocks)
    ours = cpu_kernels.load() is not None
    if any(b.qtype in (*K_QTYPES, *Q5_QTYPES) for b in blocks):
        return rows % cpu_kernels.TILE == 0 and ours
    # mashbox's kernels read whole tiles of 32 outputs, torch's int4 kernel groups of 16. On
    # ours a matrix of 16 past a tile goes int8 (padded to the tile), not to torch's kernel,
    # whose bits depend on the batch.
    return rows % (cpu_kernels.TILE if ours else 16) == 0


def q4_k_scales(packed: Tensor) -> tuple[Tensor, Tensor]:
    """Each Q4_K block's 8 six-bit scales and mins, uint8 [..., 8] each, from its 12 bytes:
    sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 in
    the nibbles of bytes 8-11 (low: scale, high: min), their top 2 bits in the top 2 bits of
    bytes 0-3 (scales) and 4-7 (mins)."""
    low, high, mixed = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = torch.cat([low & 0x3F, (mixed & 0x0F) | ((low >> 2) & 0x30)], dim=-1)
    mins = torch.cat([high & 0x3F, (mixed >> 4) | ((high >> 2) & 0x30)], dim=-1)
    return scales, mins


def k_scales(b: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Q4_K or Q5_K blocks uint8 [N, K / 256, ..]: their scales as stored, sc and mn uint8
    [N, K / 32] (six bits each) and fp16 d and dmin [N, K / 256]."""
    n = b.shape[0]
    d = b[..., 0:2].contiguous().view(torch.float16).reshape(n, -1)
    dmin = b[..., 2:4].contiguous().view(torch.float16).reshape(n, -1)
    sc, mn = q4_k_scales(b[..., 4:16].contiguous())  # strided uint8 ops are slow
    return sc.reshape(n, -1), mn.reshape(n, -1), d, dmin


def k_group_scales(sc: Tensor, mn: Tensor, d: Tensor, dmin: Tensor) -> tuple[Tensor, Tensor]:
    """k_scales' as float32 d * sc and m = -dmin * mn [N, K / 32], both exact (an fp16 times
    six bits): w = q * d + m (gguf's d * q - dm)."""
    d, dmin = (t.float().repeat_interleave(K_GROUPS, 1) for t in (d, dmin))
    return d * sc.float(), -(dmin * mn.float())


def scales(blocks: RawBlocks) -> tuple[Tensor, Tensor]:
    """Each block's d and m, fp16 [N, K / 32] as stored (Q4_0: m = -8 d, Q5_0: m = -16 d, exact
    in fp16 where finite), or float32 for the K-quants' groups of 32 (k_group_scales) and
    where Q5_0's -16 d overflows fp16: w = q * d + m."""
    b = blocks.data
    if blocks.qtype in K_QTYPES:
        return k_group_scales(*k_scales(b))
    d = b[..., 0:2].contiguous().view(torch.float16)[..., 0]
    if blocks.qtype in (Q.Q4_1, Q.Q5_1):
        return d, b[..., 2:4].contiguous().view(torch.float16)[..., 0]
    offset = 16 if blocks.qtype == Q.Q5_0 else 8
    m = d * -offset
    if not m.isfinite().all():  # |d| >= 2^12: -16 d is exact in float32 only
        return d.float(), d.float() * -offset
    return d, m


def unpack(blocks: RawBlocks) -> tuple[Tensor, Tensor, Tensor]:
    """The blocks' q uint8 [N, K] (block_bits: 0..15, or 0..31 for Q5) with their d and m
    (`scales`): w = q * d + m."""
    return block_bits.bits([blocks]), *scales(blocks)


class Int4Weight(CompactWeight):
    """A matrix's 4-bit (or 5-bit) blocks as the file stores them, read by decode steps, where
    reading the weights is the whole cost, and by prefill chunks where the activations are
    rounded to integers; the float matrix too where they are not (past `max_rows` rows)."""

    def __init__(
        self, blocks: list[RawBlocks], dtype=torch.bfloat16, ours=True, activations="float"
    ):
        """`blocks`: the parts of the matrix (e.g. q, k, v) in order. mashbox's kernel where it
        builds and `ours`, taking `activations` float32, or rounded per block of 32 to "int16"
        (q4a16) or "int8" (q4a8); else torch's, with activations and scales in `dtype` (bf16
        is its fast one; float32 is exact but takes a scalar path)."""
        self.shape = block_bits.shape(blocks)
        self.dtype = dtype
        tiled = self.shape[0] % cpu_kernels.TILE == 0
        self.kernel = cpu_kernels.load() if ours and tiled else None
        self.activations = activations if self.kernel is not None else "float"
        if self.kernel is not None:
            five = any(b.qtype in Q5_QTYPES for b in blocks)
            parts = block_bits.kernel_args(blocks)
            # pack_q4's or pack_q5's qs, in one pass over the blocks
            self.qs = self.kernel.pack_blocks(*parts, 1 if five else 0)
            if self.activations != "float" and all(b.qtype in K_QTYPES for b in blocks):
                # The K-quants' scales as stored (pack_k_scales of k_scales'): 20 bytes an
                # output and 256 weights where float32 d and m take 64 (the float32 kernels
                # read only those).
                self.dm = self.kernel.blocks_k_scales(*parts)
            else:
                d, m = self._scales(blocks)
                # Q4_0's m = -8 d and Q5_0's -16 d are the kernels' to derive: d alone is read
                derived = all(b.qtype == (Q.Q5_0 if five else Q.Q4_0) for b in blocks)
                self.dm = cpu_kernels.pack_scales(d, None if derived else m)
        else:
            d, m = self._scales(blocks)
            q = block_bits.bits(blocks).to(torch.int32)
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            # [K / 32, N, 2]: the kernel's layout; w = (q - 8) * d + (m + 8 d).
            zero = m.float() + 8 * d.float()
            self.scales_and_zeros = torch.stack([d.T, zero.T], dim=-1).to(dtype).contiguous()
        if self.activations == "float":  # past 48 rows (16 on torch's kernel) sgemm wins
            self.w = dequantized(blocks)

    @staticmethod
    def _scales(blocks: list[RawBlocks]) -> tuple[Tensor, Tensor]:
        """The parts' d and m: fp16 where every part has them, float32 (exactly the same
        values) with the K-quants, or where fp16 overflowed (Q5_0's -16 d)."""
        d, m = (torch.cat(p) for p in zip(*(scales(b) for b in blocks), strict=True))
        return d, m

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
        """Rows up to which a call multiplies by the blocks at once; more take the float path,
        or the blocks in pieces (compact_weight.py)."""
        return Q4_MAX_ROWS[self.activations] if self.kernel is not None else INT4_MAX_ROWS

    def multiply(self, x: Tensor) -> Tensor:
        if self.kernel is not None:
            matmul = getattr(self.kernel, KERNELS[self.activations])
            return matmul(x.float().contiguous(), self.qs, self.dm)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(self.dtype), self.packed, GROUP, self.scales_and_zeros
        )

    @property
    def decode_tensors(self) -> tuple[Tensor, ...]:
        return (
            (self.qs, self.dm) if self.kernel is not None else (self.packed, self.scales_and_zeros)
        )

    def dequantized(self) -> Tensor:
        """The weights the kernel multiplies by, [N, K] (x = identity): float32 from ours,
        self.dtype from torch's."""
        k = self.shape[1]
        if self.kernel is not None:  # read by float32 x = identity, the scales as float32
            dm = self.dm
            if dm.dtype == torch.uint8:  # the K-quants' as stored, back to their d and m
                sc, mn, d, dmin = cpu_kernels.unpack_k_scales(dm)
                dm = cpu_kernels.pack_scales(*k_group_scales(sc, mn, d, dmin))
            return self.kernel.q4_linear(torch.eye(k), self.qs, dm).T
        eye = torch.eye(k, dtype=self.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            eye, self.packed, GROUP, self.scales_and_zeros
        ).T
