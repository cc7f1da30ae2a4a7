"""int8 decode weights: a float matrix quantized per output channel at load, for decode steps
that read a quarter of float32's bytes (`Int8Weight`). Every matrix of an "int8" engine, and
those an int4 engine finds no 4-bit or Q8_0 blocks for."""

from __future__ import annotations

import torch
from torch import Tensor

from . import cpu_kernels
from .compact_weight import CompactWeight

INT8_MAX_ROWS = 16  # up to this many rows (decode batches) use the int8 weights


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per output channel: (q [N, K] int8, scale [N] float32), w ~ q * scale."""
    scale = w.float().abs().amax(dim=1).clamp_min(1e-12) / 127.0
    return torch.round(w.float() / scale[:, None]).to(torch.int8), scale.contiguous()


class Int8Weight(CompactWeight):
    """A weight kept twice: float for prefill-sized batches, int8 per output channel for
    decode, where reading the weights is the whole cost (4x fewer bytes)."""

    kind = "int8"
    max_rows = INT8_MAX_ROWS
    activation_bits = 32  # activations are never rounded to integers

    def __init__(self, w: Tensor):
        self.w, self.shape = w, tuple(w.shape)
        q, self.scale = quantize_int8(w)
        self.kernel = cpu_kernels.load() if w.device.type == "cpu" else None
        if self.kernel is not None:  # ours: the packed layout only
            self.packed = cpu_kernels.pack_int8(q)
        else:
            self.q = q.contiguous()
            self.scale_bf16 = self.scale.to(torch.bfloat16)

    def multiply(self, x: Tensor) -> Tensor:
        if self.kernel is not None:  # ours: float32 activations, weights read once
            return self.kernel.int8_linear(x.float().contiguous(), self.packed, self.scale)
        # torch's wants bf16 activations (float32 ones take a scalar path)
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.q, self.scale_bf16)

    @property
    def decode_tensors(self) -> tuple[Tensor, ...]:
        return (self.packed if self.kernel is not None else self.q), self.scale
