"""What every decode weight offers (`DecodeWeight`), whatever it stores: int8 per channel
(int8_weight.py), a GGUF's own 4-bit blocks (int4.py), Q6_K blocks (q6_weight.py), Q8_0
blocks (q8_weight.py), or parts of several kinds (`SplitWeight`); which one a matrix gets
(`decode_weight_for`); and the helpers that take a matrix either as a float tensor or as a
decode weight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor

from . import int4
from .int8_weight import Int8Weight
from .q6_weight import Q6Weight, fits_q6
from .q8_weight import Q8Weight, fits_q8
from .weights import RawBlocks


@runtime_checkable
class DecodeWeight(Protocol):
    """A matrix in a compact form for decode steps, where reading the weights is the whole
    cost, and prefill chunks (compact_weight.py)."""

    shape: tuple[int, int]  # [N, K]
    w: Tensor | None  # the float weights [N, K], kept where calls past `max_rows` take them
    kernel: object | None  # mashbox's CPU kernels where this weight runs on them, else None
    max_rows: int  # rows up to which a call reads the compact form
    kind: str  # "int8", "q8_0", "q6_k", "int4", "int4a16" or "int4a8": what Engine reports
    activation_bits: int  # what activations are rounded to per block of 32 (32: not rounded)

    def __call__(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """x @ w.T (+ bias), for x [rows, K]."""
        ...

    @property
    def decode_tensors(self) -> tuple[Tensor, ...]:
        """What a decode step reads, as the kernels take it (DecodeStack reads these too)."""
        ...


def decode_weight_for(
    blocks: list[RawBlocks | None],
    kind: str,
    float_matrix: Callable[[], Tensor],
    prefill_rows: bool = True,
) -> DecodeWeight:
    """int4: the file's own 4-bit (or, on mashbox's kernels, Q8_0) blocks where every part
    has them, int8 otherwise; int4a16 / int4a8: the same, the 4-bit blocks taking int16 /
    int8 activations and the Q6_K and Q8 blocks int16 ones. Parts that no one kind holds
    together but each some kind holds alone keep their own (`SplitWeight`). `float_matrix()`
    makes the float matrix, called only where the int8 form is chosen (it is quantized from
    it). `prefill_rows`: whether prefill chunks multiply by the whole matrix (not the output
    head): Q6_K keeps a faster form for them."""
    whole = block_weight(blocks, kind, prefill_rows)
    if whole is not None:
        return whole
    if len(blocks) > 1:
        parts = [block_weight([b], kind, prefill_rows) for b in blocks]
        if all(p is not None for p in parts):
            return SplitWeight(parts)
    return Int8Weight(float_matrix())


def block_weight(
    blocks: list[RawBlocks | None], kind: str, prefill_rows: bool = True
) -> DecodeWeight | None:
    """The decode weight of `kind` that reads these parts' blocks as stored, if one can."""
    activations = int4.BLOCK_KINDS.get(kind)
    if activations and int4.fits(blocks):
        return int4.Int4Weight(blocks, activations=activations)
    if activations in ("int16", "int8") and fits_q6(blocks):
        return Q6Weight(blocks, prefill_rows)
    if activations and fits_q8(blocks):
        return Q8Weight(blocks, activations="float" if activations == "float" else "int16")
    return None


class SplitWeight:
    """A matrix of parts along its outputs (q, k and v) that keep decode weights of different
    kinds, the file's blocks each, where no one kind holds them all (a Q4_K_M file's Q6_K v
    beside Q4_K q and k): a call joins the parts' outputs, and the decode stack runs the
    parts one after another (decode_layers.cpp, `Parts`)."""

    w = None

    def __init__(self, parts: list[DecodeWeight]):
        self.parts = parts
        self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
        kernels = {p.kernel for p in parts}
        self.kernel = kernels.pop() if len(kernels) == 1 else None
        self.max_rows = min(p.max_rows for p in parts)
        self.kind = most_compact_kind(parts)
        self.activation_bits = min(p.activation_bits for p in parts)

    def __call__(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        y = torch.cat([p(x) for p in self.parts], dim=1)
        return y + bias if bias is not None else y

    @property
    def decode_tensors(self) -> tuple[Tensor, ...]:
        return tuple(t for p in self.parts for t in p.decode_tensors)

    def dequantized(self) -> Tensor:
        return torch.cat([p.dequantized() for p in self.parts])


# How compact each kind is, the smallest first (a model's 4-bit matrices share one kind).
COMPACTNESS = {**dict.fromkeys(int4.BLOCK_KINDS, 0), "q6_k": 1, "q8_0": 2, "int8": 3}


def most_compact_kind(weights: Iterable) -> str:
    """The most compact kind among the decode weights in `weights` (the first such where
    several tie), or "float" if there are none."""
    kinds = (w.kind for w in weights if isinstance(w, DecodeWeight))
    return min(kinds, key=COMPACTNESS.__getitem__, default="float")


def nbytes(w: Tensor | DecodeWeight) -> int:
    """Bytes a decode step reads of one weight: a tensor, or a decode weight's
    `decode_tensors`."""
    parts = [w] if isinstance(w, Tensor) else w.decode_tensors
    return sum(t.numel() * t.element_size() for t in parts)


def linear(x: Tensor, w: Tensor | DecodeWeight, bias: Tensor | None = None) -> Tensor:
    """F.linear for a float tensor, the decode weight's own call otherwise."""
    return F.linear(x, w, bias) if isinstance(w, Tensor) else w(x, bias)
