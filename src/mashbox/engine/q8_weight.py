"""Q8_0 decode weights: a GGUF's own Q8_0 blocks (w = q * d per block of 32, q int8, d fp16)
read as stored by mashbox's kernel (blocks_gemm.cpp), never re-quantized (`Q8Weight`). An
int4 engine's choice for the matrices the file keeps in Q8_0 (int4.py holds the 4-bit ones)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from torch import Tensor

from . import cpu_kernels
from .int4 import BLOCKS_MAX_ROWS
from .weights import RawBlocks


def fits_q8(blocks: list[RawBlocks | None]) -> bool:
    """Whether a matrix's parts are all Q8_0 blocks that mashbox's kernel can read."""
    if any(b is None or b.qtype != Q.Q8_0 for b in blocks):
        return False
    rows = sum(b.data.shape[0] for b in blocks)
    return rows % cpu_kernels.TILE == 0 and cpu_kernels.load() is not None


class Q8Weight:
    """A weight kept twice: float for prefill-sized batches, and the file's Q8_0 blocks
    (w = q * d per block of 32, q int8, d fp16) as stored, for mashbox's kernel."""

    kind = "q8_0"
    max_rows = BLOCKS_MAX_ROWS  # rows up to which a call uses the Q8_0 blocks
    activation_bits = 32  # activations are never rounded to integers

    def __init__(self, w: Tensor, blocks: list[RawBlocks]):
        b = torch.cat([part.data for part in blocks])  # [N, K / 32, 34]
        d = b[..., 0:2].contiguous().view(torch.float16)[..., 0]
        q = b[..., 2:].contiguous().view(torch.int8).reshape(b.shape[0], -1)
        if q.shape != w.shape:
            raise ValueError(f"blocks of shape {tuple(q.shape)} for a weight {tuple(w.shape)}")
        self.w = w
        self.kernel = cpu_kernels.load()
        self.qs, self.d = cpu_kernels.pack_q8(q, d)

    def __call__(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        if x.shape[0] > self.max_rows:
            return F.linear(x, self.w, bias)
        y = self.kernel.q8_linear(x.float().contiguous(), self.qs, self.d).to(x.dtype)
        return y + bias if bias is not None else y

    @property
    def decode_tensors(self) -> tuple[Tensor, ...]:
        return self.qs, self.d

    def dequantized(self) -> Tensor:
        """The weights the kernel multiplies by, float32 [N, K] (x = identity)."""
        return self.kernel.q8_linear(torch.eye(self.w.shape[1]), self.qs, self.d).T
