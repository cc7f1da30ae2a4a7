"""The KV cache's memory on the CPU: pages taken as positions are written (none at start), and
a cache the machine could not hold refused before anything is mapped."""

from __future__ import annotations

import pytest
import torch

from mashbox import memory
from mashbox.engine import kv_cache
from mashbox.engine.config import ModelConfig
from mashbox.engine.kv_cache import KVCache

SMOLLM2 = ModelConfig(
    arch="llama", n_layers=30, d_model=576, n_heads=9, n_kv_heads=3, head_dim=64,
    d_ff=1536, vocab_size=49152, max_context=8192,
)  # fmt: skip


def resident_mib() -> float:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def test_the_cpu_cache_takes_memory_only_as_positions_are_written():
    """The default model's default cache, 0.75 GB: nothing resident until written; a written
    slot's first 256 positions take about their own bytes; the rest still reads zeros."""
    before = resident_mib()
    cache = KVCache(SMOLLM2, 4, 8192, "cpu", torch.float16)
    assert cache.nbytes == 754_974_720
    assert resident_mib() - before < 16
    keys = torch.randn(30, 3, 256, 64).half()
    cache.k[:, 1, :, :256] = keys
    cache.v[:, 1, :, :256] = -keys
    written = 2 * keys.numel() * 2 / 2**20  # 5.6 MiB, in whole pages of each (layer, head)
    assert resident_mib() - before < written + 16
    assert torch.equal(cache.k[:, 1, :, :256], keys) and torch.equal(cache.v[:, 1, :, :256], -keys)
    assert not cache.k[:, 1, :, 256:].any() and not cache.v[:, 0].any()
    assert not cache.k[:, 2].any() and not cache.v[:, 3].any()


def test_the_cpu_caches_pages_go_back_with_its_last_view():
    """An engine's cache, written whole, then dropped: its memory returns to the system, even
    where a view of it outlived the cache (nothing stays mapped)."""
    before = resident_mib()
    cache = KVCache(SMOLLM2, 2, 4096, "cpu", torch.float16)  # 2 x 90 MiB
    cache.k.fill_(1)
    cache.v.fill_(2)
    assert resident_mib() - before > 170
    view = cache.k[3]
    del cache
    assert 85 < resident_mib() - before < 100  # the view holds the keys' pages...
    del view
    assert resident_mib() - before < 8  # ...until it goes


def test_the_cpu_cache_is_one_contiguous_page_aligned_block_per_tensor():
    cache = KVCache(SMOLLM2, 2, 64, "cpu", torch.float32, scratch_slot=True)
    for t in (cache.k, cache.v):
        assert t.shape == (30, 3, 3, 64, 64) and t.dtype == torch.float32
        assert t.is_contiguous() and t.data_ptr() % 4096 == 0


def test_a_cache_larger_than_the_memory_available_is_refused_naming_the_flags():
    available = memory.memory_available()
    assert available is not None and available > 0  # Linux says, in /proc/meminfo
    per_slot = 2 * 30 * 3 * 8192 * 64 * 2
    slots = available // per_slot + 1
    with pytest.raises(ValueError) as refused:
        KVCache(SMOLLM2, slots, 8192, "cpu", torch.float16)
    message = str(refused.value)
    assert f"for {slots} slots of 8192 positions" in message
    assert message.endswith("available: lower --slots or --ctx")
    kv_cache.check_fits(per_slot, 1, 8192, per_slot)  # exactly what is there: taken
    kv_cache.check_fits(per_slot, 1, 8192, None)  # nothing says: not refused


def cgroup_tree(tmp_path, membership: str, files: dict[str, str]):
    """A cgroup mount and /proc/self/cgroup as the kernel lays them out, under tmp_path."""
    for name, text in files.items():
        (tmp_path / "fs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs" / name).write_text(text)
    (tmp_path / "cgroup").write_text(membership)
    return tmp_path / "fs", tmp_path / "cgroup"


def test_a_cgroup_v2_limit_on_the_process_or_any_parent_bounds_the_room(tmp_path):
    mount, membership = cgroup_tree(
        tmp_path,
        "0::/system.slice/app.service\n",
        {
            "memory.max": "max\n",  # the root has no limit
            "system.slice/memory.max": str(6 << 30),
            "system.slice/memory.current": str(1 << 30),
            "system.slice/app.service/memory.max": "max\n",
            "system.slice/app.service/memory.current": str(1 << 30),
        },
    )
    assert memory.cgroup_room(mount, membership) == 5 << 30


def test_a_cgroup_v1_limit_bounds_the_room_and_its_no_limit_does_not(tmp_path):
    membership = "12:pids:/\n4:memory:/docker/abc\n1:cpu,cpuacct:/\n0::/\n"
    limited = {
        "memory/docker/abc/memory.limit_in_bytes": str(4 << 30),
        "memory/docker/abc/memory.usage_in_bytes": str(3 << 30),
    }
    assert memory.cgroup_room(*cgroup_tree(tmp_path / "a", membership, limited)) == 1 << 30
    unlimited = {  # what this machine's container shows: 2**63 - 4096, "no limit"
        "memory/memory.limit_in_bytes": "9223372036854771712\n",
        "memory/memory.usage_in_bytes": str(5 << 30),
    }
    assert memory.cgroup_room(*cgroup_tree(tmp_path / "b", membership, unlimited)) is None


def test_inside_a_container_the_mount_root_is_its_cgroup(tmp_path):
    """A cgroup namespace shows the container's own cgroup as the mount's root while
    /proc/self/cgroup may still name a path that is not there: the root's limit counts."""
    mount, membership = cgroup_tree(
        tmp_path,
        "4:memory:/process_api/691c\n",
        {"memory/memory.limit_in_bytes": str(2 << 30), "memory/memory.usage_in_bytes": "0"},
    )
    assert memory.cgroup_room(mount, membership) == 2 << 30
    assert memory.cgroup_room(mount, tmp_path / "absent") is None
    (tmp_path / "odd").write_text("garbage\n4:memory:/\n")  # a line it cannot read is skipped
    assert memory.cgroup_room(mount, tmp_path / "odd") == 2 << 30
