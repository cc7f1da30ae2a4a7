"""The KV cache: every slot's keys and values for a whole context, on the device."""

from __future__ import annotations

import torch
from torch import Tensor

from .config import ModelConfig


class KVCache:
    """One whole context per slot: k/v are [layers, slots, kv_heads, ctx, head_dim].

    With scratch_slot, one more slot follows the last (index `slots`), owned by no sequence:
    fixed-shape decode (graph_decode) writes its padding rows there. It costs one slot's
    memory (ctx * bytes_per_token; 1 GiB for an 8B model at ctx 8192)."""

    def __init__(
        self, cfg: ModelConfig, slots: int, ctx: int, device, dtype, *, scratch_slot=False
    ):
        self.slots, self.ctx = slots, ctx
        self.scratch_slot = slots if scratch_slot else None
        shape = (cfg.n_layers, slots + bool(scratch_slot), cfg.n_kv_heads, ctx, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    @property
    def nbytes(self) -> int:
        """Memory the cache holds, the scratch slot included."""
        return 2 * self.k.numel() * self.k.element_size()

    @property
    def bytes_per_token(self) -> int:
        layers, _, heads, _, dim = self.k.shape
        return 2 * layers * heads * dim * self.k.element_size()

    def copy_out(self, slot: int, n: int) -> tuple[Tensor, Tensor]:
        """The first n positions of a slot, copied to host memory."""
        k, v = self.k[:, slot, :, :n], self.v[:, slot, :, :n]
        return k.to("cpu", copy=True), v.to("cpu", copy=True)

    def copy_in(self, slot: int, saved: tuple[Tensor, Tensor], n: int) -> None:
        """Put the first n positions of a saved prefix back into a slot."""
        k, v = saved
        self.k[:, slot, :, :n].copy_(k[:, :, :n])
        self.v[:, slot, :, :n].copy_(v[:, :, :n])

    def copy_prefix(self, source: int, slot: int, n: int) -> None:
        """Copy the first n positions of one slot into another, on the device."""
        self.k[:, slot, :, :n].copy_(self.k[:, source, :, :n])
        self.v[:, slot, :, :n].copy_(self.v[:, source, :, :n])
