"""The KV cache: every slot's keys and values for a whole context, on the device."""

from __future__ import annotations

import math
import mmap
from pathlib import Path

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


def memory_available() -> int | None:
    """Bytes this process can still take: /proc/meminfo's MemAvailable, or less where a cgroup
    (a container's memory limit) allows less; None where neither says."""
    known = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                known.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    room = cgroup_room()
    if room is not None:
        known.append(room)
    return min(known) if known else None


# cgroup v1 writes "no limit" as the largest page-aligned counter (2**63 - 4096 on x86-64).
_V1_UNLIMITED = 2**62


def cgroup_room(
    mount: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")
) -> int | None:
    """The least room (limit less usage) of this process's memory cgroup and its ancestors,
    v2 (`memory.max`) or v1 (`memory/.../memory.limit_in_bytes`); None where none limits it.
    Inside a container the cgroup's own path may not exist under the mount (its namespace
    shows the container's cgroup as the root): the levels that do exist are read."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        lines = []
    levels: list[tuple[Path, str, str]] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            levels += _ancestors(mount, path, "memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            levels += _ancestors(
                mount / "memory", path, "memory.limit_in_bytes", "memory.usage_in_bytes"
            )
    rooms = []
    for directory, limit_name, usage_name in levels:
        try:
            limit = (directory / limit_name).read_text().strip()
            if limit == "max" or int(limit) >= _V1_UNLIMITED:
                continue
            rooms.append(max(0, int(limit) - int((directory / usage_name).read_text())))
        except (OSError, ValueError):
            continue
    return min(rooms) if rooms else None


def _ancestors(root: Path, path: str, limit: str, usage: str) -> list[tuple[Path, str, str]]:
    """The cgroup directory of `path` under `root` and each directory above it, to the root."""
    parts = [p for p in path.split("/") if p]
    return [(root.joinpath(*parts[:n]), limit, usage) for n in range(len(parts), -1, -1)]


def check_fits(nbytes: int, slots: int, ctx: int, available: int | None) -> None:
    """Refuse a CPU cache that the machine could not hold once its slots filled up: its pages
    are only taken as they are written, so the kernel would kill the engine mid-answer."""
    if available is None or nbytes <= available:
        return
    raise ValueError(
        f"the KV cache would need {nbytes / 1e9:.1f} GB for {slots} slots of {ctx} positions "
        f"and this machine has {available / 1e9:.1f} GB available: lower --slots or --ctx"
    )
