"""Q8 decode weights: int8 values times a scale per block, read as stored by mashbox's kernel
(blocks_gemm.cpp), never re-quantized (`Q8Weight`). An int4 engine's choice for the matrices
the file keeps in Q8_0 (w = q * d per block of 32, q int8, d fp16) or Q6_K, and for those
whose parts mix either with Q5_0 or Q4_0 (int4.py holds the matrices that are 4 or 5 bits
throughout):
- Q5_0 and Q4_0 blocks are Q8_0 blocks with small values: q - 16 or q - 8, the same d.
- Q6_K (256 weights: 6-bit q, an int8 scale sc per 16, fp16 d) is w = (d * sc) * (q - 32):
  int8 q - 32 in groups of 16 with float32 d * sc, exact (an fp16 times an int8 has at most
  19 significant bits). 1.25 bytes a weight where the file has 0.82 and int8 per channel ~1;
  q6_weight.py reads them as stored where a matrix is Q6_K throughout and its activations
  are rounded to integers (int4a16, int4a8).
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as Q
from torch import Tensor

from . import cpu_kernels
from .compact_weight import CompactWeight
from .int4 import BLOCKS_MAX_ROWS, Q4_MAX_ROWS, unpack
from .q6_weight import q6_k_as_int8, unpack_q6_k
from .weights import RawBlocks, dequantized

Q8_QTYPES = (Q.Q8_0, Q.Q6_K, Q.Q5_0, Q.Q4_0)  # whose weights are int8 values times a scale


def fits_q8(blocks: list[RawBlocks | None]) -> bool:
    """Whether a matrix's parts are all blocks of int8 values times a scale (Q8_QTYPES) that
    mashbox's kernel can read."""
    if any(b is None or b.qtype not in Q8_QTYPES for b in blocks):
        return False
    rows = sum(b.data.shape[0] for b in blocks)
    return rows % cpu_kernels.TILE == 0 and cpu_kernels.load() is not None


def int8_blocks(blocks: RawBlocks) -> tuple[Tensor, Tensor]:
    """A part's weights as int8 q [N, K] and scales: fp16 d [N, K / 32] (Q8_0, Q5_0, Q4_0) or
    float32 d [N, K / 16] (Q6_K): w = q * d."""
    b = blocks.data
    if blocks.qtype == Q.Q6_K:
        return q6_k_as_int8(*unpack_q6_k(blocks))
    if blocks.qtype == Q.Q8_0:
        d = b[..., 0:2].contiguous().view(torch.float16)[..., 0]
        return b[..., 2:].contiguous().view(torch.int8).reshape(b.shape[0], -1), d
    q, d, _ = unpack(blocks)  # Q5_0 / Q4_0: w = (q - 16) * d or (q - 8) * d
    offset = 16 if blocks.qtype == Q.Q5_0 else 8
    return (q.to(torch.int16) - offset).to(torch.int8), d


class Q8Weight(CompactWeight):
    """A matrix's int8 values times a scale per block of 32 (fp16) or 16 (float32, where a part
    is Q6_K), as the file stores them; the float matrix too where the activations are float
    (past `max_rows` rows)."""

    kind = "q8_0"

    def __init__(self, blocks: list[RawBlocks], activations: str = "float"):
        """`activations`: float32, or "int16": rounded per block of 32 for exact integer
        dot products (int4a16 and int4a8 decode weights: near float32, 1.4-1.6x the speed)."""
        parts = [int8_blocks(b) for b in blocks]
        if any(d.dtype == torch.float32 for _, d in parts):  # groups of 16 for all
            parts = [(q, d.float().repeat_interleave(q.shape[1] // d.shape[1] // 16, 1))
                     for q, d in parts]  # fmt: skip
        q, d = (torch.cat(p) for p in zip(*parts, strict=True))
        self.shape = tuple(q.shape)
        self.kernel = cpu_kernels.load()
        self.qs, self.d = cpu_kernels.pack_q8(q, d)
        self.activations = activations
        self.activation_bits = 16 if activations == "int16" else 32
        # Rows up to which a call uses the blocks: with int16 activations a whole prefill
        # chunk (3.1-4.6x sgemm at 48-256 rows on qwen2.5's and SmolLM2's shapes, EPYC host,
        # docs/performance.md), as the Q4 blocks do.
        self.max_rows = Q4_MAX_ROWS["int16"] if activations == "int16" else BLOCKS_MAX_ROWS
        if activations == "float":  # past 48 rows sgemm wins
            self.w = dequantized(blocks)

    def multiply(self, x: Tensor) -> Tensor:
        matmul = self.kernel.q8a16_linear if self.activations == "int16" else self.kernel.q8_linear
        return matmul(x.float().contiguous(), self.qs, self.d)

    @property
    def decode_tensors(self) -> tuple[Tensor, ...]:
        return self.qs, self.d

    def dequantized(self) -> Tensor:
        """The weights the kernel multiplies by, float32 [N, K] (x = identity)."""
        return self.kernel.q8_linear(torch.eye(self.shape[1]), self.qs, self.d).T
