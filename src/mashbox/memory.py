"""What memory this machine can still give a process: /proc/meminfo and the memory cgroup's
limits (v1 or v2), for the caches sized at load (the KV cache, the RAM prompt cache). No torch
here: the server process reads it too."""

from __future__ import annotations

from pathlib import Path


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
        if line.count(":") < 2:
            continue
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


def host_cache_cap(asked: int, available: int | None, kv_to_come: int) -> int:
    """The RAM prompt cache's cap: `asked`, or half of what the machine can still give once
    the KV cache's pages (`kv_to_come` bytes, taken as slots fill) are all in, if that is less.
    The cache fills over hours: a cap past the machine's memory would meet the OOM killer."""
    if available is None:
        return asked
    return min(asked, max(0, available - kv_to_come) // 2)
