"""A model's token embedding (`Embedding`): each token's row as float32, from a float table,
or from a GGUF file's blocks kept compact: int8 values times a float32 scale, plus a float32
offset, per group of 32 weights (16 for Q6_K). That is 1.1-1.25 bytes a weight where float32
takes 4 (qwen2.5-coder-0.5b: 170 MB, not 545), and every row is exactly the file's values: a
product q * scale (exact where an offset follows it: q has at most 5 bits, the scale 17) and
one rounded addition, as gguf's dequantization computes them. The decode stack reads the same
tables (decode_layers.cpp, `Embedding`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .int4 import EXACT_QTYPES, unpack
from .q8_weight import Q8_QTYPES, int8_blocks
from .weights import RawBlocks


def compact_rows(blocks: RawBlocks) -> tuple[Tensor, Tensor, Tensor] | None:
    """A matrix's blocks as int8 q [N, K], float32 scale and offset [N, K / group] (offset
    empty where the format has none: w = q * scale), or None for formats this does not
    hold exactly (floats, Q2_K, Q3_K, the IQ formats)."""
    if blocks.qtype in Q8_QTYPES:  # Q8_0, Q6_K, Q5_0 and Q4_0: int8 values times a scale
        q, scale = int8_blocks(blocks)
        return q, scale.float(), torch.empty(0)
    if blocks.qtype in EXACT_QTYPES:  # Q4_1, Q5_1 and the K-quants: q * d + m, q < 32
        q, scale, offset = unpack(blocks)
        return q.to(torch.int8), scale.float(), offset.float()
    return None


class Embedding:
    """Token ids [T] -> their rows [T, d_model], from `table` (float) or `compact` rows."""

    def __init__(self, table: Tensor | None = None, compact: tuple[Tensor, ...] | None = None):
        self.table, self.compact = table, compact

    @classmethod
    def of(cls, blocks: RawBlocks | None, floats: Callable[[], Tensor]) -> Embedding:
        """Compact where `blocks` allow it, else the float table `floats()`."""
        compact = compact_rows(blocks) if blocks is not None else None
        return cls(compact=compact) if compact is not None else cls(table=floats())

    @property
    def shape(self) -> tuple[int, int]:
        return tuple((self.table if self.table is not None else self.compact[0]).shape)

    def __call__(self, ids: Tensor) -> Tensor:
        if self.table is not None:
            return F.embedding(ids, self.table)
        q, scale, offset = (t[ids] if t.numel() else t for t in self.compact)
        rows, groups = scale.shape
        w = q.float().view(rows, groups, -1) * scale[..., None]
        if offset.numel():
            w = w + offset[..., None]
        return w.view(rows, -1)

    @property
    def tensors(self) -> list[Tensor]:
        """What the decode stack reads: [table], or [q, scale, offset]."""
        return [self.table] if self.table is not None else list(self.compact)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)
