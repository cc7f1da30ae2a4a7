"""The prompt cache's index: which token prefixes are saved, in host memory and on disk.

The scheduler owns this index and tells the engine exactly what to save, restore and drop
(`Save`, `Restore`, `Drop` in the step protocol); the engine only keeps tensors by entry id.
One index per engine process: a restarted engine starts empty, and so does the index's
host-memory part. With --cache-dir the index also holds the prefixes on disk
(`engine/disk_cache.py`), which outlive the engine: the engine reports them when it starts, and
a prefix that repeats (reused from a slot or the host cache) is written there, unless the
disk already holds half of it or more. The namespace (model, weights, tokenizer, template,
policy) is part of every key, so a cache never answers for another one; so is the tenant, so
one tenant's saved prompts never answer (nor, through `cached_tokens` or time to first token,
betray) another's. A file's name hashes the engine's disk key (model checksum, KV layout)
with the tenant and the tokens.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from array import array

import attrs

MIN_TOKENS = 32  # shorter prefixes cost less to prefill than to keep
DEFAULT_CACHE_RAM_MIB = 8192  # llama-server's default: agents resend long prompts every turn
# A prefix this long is worth a file: an agent's system prompt and tools are thousands.
MIN_DISK_TOKENS = 256
DEFAULT_CACHE_DIR_MIB = 16384  # a 20k-token prompt of qwen2.5-coder-0.5b is ~0.5 GB (float32)


def disk_name(key: str, tenant: str, tokens) -> str:
    """A disk cache file's name: a hash of the engine's disk key, the tenant and the tokens,
    so neither a prompt nor a tenant shows in a directory listing."""
    digest = hashlib.sha256(json.dumps([key, tenant]).encode())
    digest.update(array("q", tokens).tobytes())
    return digest.hexdigest()


def disk_bytes(n: int, bytes_per_token: int, tenant: str) -> int:
    """At least what a file of n tokens takes: the KV, the token ids in its header (up to 12
    bytes each as JSON), the rest of the header."""
    return n * (bytes_per_token + 12) + len(tenant.encode()) + 1024


@attrs.define(eq=False)
class Entry:
    id: int
    namespace: str
    tenant: str
    tokens: tuple[int, ...]
    nbytes: int
    last_used: int = 0
    file: str = ""  # on disk under this name (disk_name), not in host memory


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class PromptCache:
    """Saved KV prefixes, least recently used evicted first when over `cap_bytes`."""

    def __init__(self, cap_bytes: int, bytes_per_token: int, namespace: str = ""):
        self.cap_bytes = cap_bytes
        self.bytes_per_token = bytes_per_token
        self.namespace = namespace
        self.entries: dict[int, Entry] = {}
        self.evictions = 0
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        self.disk: dict[int, Entry] = {}  # entries on disk (`use_disk`)
        self.disk_cap_bytes = 0
        self.disk_key = ""
        self.disk_evictions = 0

    @property
    def enabled(self) -> bool:
        return self.cap_bytes > 0 or self.disk_enabled

    @property
    def disk_enabled(self) -> bool:
        return self.disk_cap_bytes > 0 and bool(self.disk_key)

    @property
    def disk_nbytes(self) -> int:
        return sum(e.nbytes for e in self.disk.values())

    def use_disk(self, cap_bytes: int, key: str, found=()) -> None:
        """Index the disk cache: its cap, the engine's key and the entries it found there
        (`protocol.DiskEntry`s, least recently used first)."""
        self.disk_cap_bytes, self.disk_key = cap_bytes, key
        for d in found:
            size = disk_bytes(len(d.tokens), self.bytes_per_token, d.tenant)
            entry = Entry(next(self._ids), self.namespace, d.tenant, d.tokens, size, file=d.name)
            self.touch(entry)
            self.disk[entry.id] = entry

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def best(
        self, prompt, tenant: str, namespace: str | None = None, *, disk: bool = True
    ) -> tuple[Entry | None, int]:
        """The tenant's entry sharing the longest prefix with `prompt`, and that length; one
        in host memory before one on disk as long (disk=False: host memory only)."""
        namespace = self.namespace if namespace is None else namespace
        best, length = None, 0
        pools = (self.entries, self.disk) if disk else (self.entries,)
        for entry in itertools.chain.from_iterable(p.values() for p in pools):
            if entry.namespace != namespace or entry.tenant != tenant:
                continue
            n = common_prefix(entry.tokens, prompt)
            if n > length:
                best, length = entry, n
        return best, length

    def touch(self, entry: Entry) -> None:
        entry.last_used = next(self._clock)

    def worth_saving(self, tokens, tenant: str) -> bool:
        """Long enough, fits at all, and not already saved (a saved copy counts once)."""
        if self.cap_bytes <= 0 or len(tokens) < MIN_TOKENS:
            return False
        if len(tokens) * self.bytes_per_token > self.cap_bytes:
            return False
        entry, n = self.best(tokens, tenant, disk=False)
        return not (entry is not None and n == len(tokens))

    def worth_persisting(self, tokens, tenant: str) -> bool:
        """A prefix that repeats goes to disk if long enough, it fits, and the disk does not
        hold half of it or more already: a conversation's later turns extend what is there,
        and rewriting it every turn would cost more than prefilling the difference."""
        if not self.disk_enabled or len(tokens) < MIN_DISK_TOKENS:
            return False
        if disk_bytes(len(tokens), self.bytes_per_token, tenant) > self.disk_cap_bytes:
            return False
        held = max(
            (common_prefix(e.tokens, tokens) for e in self.disk.values() if e.tenant == tenant),
            default=0,
        )
        return 2 * held < len(tokens)

    def add_disk(self, tokens, tenant: str) -> tuple[Entry, list[Entry]]:
        """Record a prefix of the tenant's that goes to disk; return it and the entries whose
        files go for room (its own prefixes, then the least recently used past the cap)."""
        tokens = tuple(tokens)
        size = disk_bytes(len(tokens), self.bytes_per_token, tenant)
        name = disk_name(self.disk_key, tenant, tokens)
        entry = Entry(next(self._ids), self.namespace, tenant, tokens, size, file=name)
        self.touch(entry)
        evicted = [e for e in self.disk.values() if e.tenant == tenant and _starts(tokens, e)]
        for old in evicted:
            del self.disk[old.id]
        while self.disk_nbytes + size > self.disk_cap_bytes and self.disk:
            lru = min(self.disk.values(), key=lambda e: e.last_used)
            evicted.append(self.disk.pop(lru.id))
            self.disk_evictions += 1
        self.disk[entry.id] = entry
        return entry, evicted

    def add(self, tokens, tenant: str) -> tuple[Entry, list[Entry]]:
        """Record a saved prefix of the tenant's; return it and the entries evicted for room."""
        size = len(tokens) * self.bytes_per_token
        entry = Entry(next(self._ids), self.namespace, tenant, tuple(tokens), size)
        self.touch(entry)
        evicted = []
        # A saved prefix of the new one is now redundant: the new entry covers it.
        for old in list(self.entries.values()):
            same_scope = (old.namespace, old.tenant) == (entry.namespace, entry.tenant)
            if same_scope and entry.tokens[: len(old.tokens)] == old.tokens:
                evicted.append(self.entries.pop(old.id))
        while self.nbytes + entry.nbytes > self.cap_bytes and self.entries:
            lru = min(self.entries.values(), key=lambda e: e.last_used)
            evicted.append(self.entries.pop(lru.id))
            self.evictions += 1
        self.entries[entry.id] = entry
        return entry, evicted

    def forget_disk(self, names) -> None:
        """Files the engine found damaged or gone when it restored them (and prefilled)."""
        names = set(names)
        for entry in [e for e in self.disk.values() if e.file in names]:
            del self.disk[entry.id]

    def clear(self) -> None:
        """The engine that held the tensors is gone (the files on disk stay)."""
        self.entries.clear()


def _starts(tokens: tuple, entry: Entry) -> bool:
    """Whether `entry` holds a prefix of `tokens`."""
    return tokens[: len(entry.tokens)] == entry.tokens
