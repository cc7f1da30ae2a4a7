"""The KV cache: every slot's keys and values for a whole context, on the device."""

from __future__ import annotations

import math
import mmap

import torch
from torch import Tensor

from ..memory import memory_available
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
        if torch.device(device).type == "cpu":
            check_fits(2 * math.prod(shape) * dtype.itemsize, slots, ctx, memory_available())
        self.k = zeros(shape, device, dtype)
        self.v = zeros(shape, device, dtype)

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


def zeros(shape: tuple[int, ...], device, dtype) -> Tensor:
    """Zeros. On the CPU, anonymous pages that the kernel maps, zeroed, on first write: start-up
    writes no zeros (torch.zeros wrote the default model's 0.75 GB, an 8B model's 4.3 GB), and
    memory goes to the positions slots fill, not to every slot's whole context."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, device=device, dtype=dtype)
    count = math.prod(shape)
    pages = mmap.mmap(-1, max(1, count * dtype.itemsize))  # the tensor keeps it mapped
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)


def check_fits(nbytes: int, slots: int, ctx: int, available: int | None) -> None:
    """Refuse a CPU cache that the machine could not hold once its slots filled up: its pages
    are only taken as they are written, so the kernel would kill the engine mid-answer."""
    if available is None or nbytes <= available:
        return
    raise ValueError(
        f"the KV cache would need {nbytes / 1e9:.1f} GB for {slots} slots of {ctx} positions "
        f"and this machine has {available / 1e9:.1f} GB available: lower --slots or --ctx"
    )
