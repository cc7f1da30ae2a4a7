"""The host-memory prompt cache's index: which token prefixes are saved, LRU, capped.

The scheduler owns this index and tells the engine exactly what to save, restore and drop
(`Save`, `Restore`, `Drop` in the step protocol); the engine only keeps tensors by entry id.
One index per engine process: a restarted engine starts empty, and so does the index. The
namespace (model, weights, tokenizer, template, policy) is part of every key, so a cache
never answers for another one; so is the tenant, so one tenant's saved prompts never answer
(nor, through `cached_tokens` or time to first token, betray) another's.
"""

from __future__ import annotations

import itertools

import attrs

MIN_TOKENS = 32  # shorter prefixes cost less to prefill than to keep
DEFAULT_CACHE_RAM_MIB = 8192  # llama-server's default: agents resend long prompts every turn


@attrs.define(eq=False)
class Entry:
    id: int
    namespace: str
    tenant: str
    tokens: tuple[int, ...]
    nbytes: int
    last_used: int = 0


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

    @property
    def enabled(self) -> bool:
        return self.cap_bytes > 0

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def best(self, prompt, tenant: str, namespace: str | None = None) -> tuple[Entry | None, int]:
        """The tenant's entry sharing the longest prefix with `prompt`, and that length."""
        namespace = self.namespace if namespace is None else namespace
        best, length = None, 0
        for entry in self.entries.values():
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
        if not self.enabled or len(tokens) < MIN_TOKENS:
            return False
        if len(tokens) * self.bytes_per_token > self.cap_bytes:
            return False
        entry, n = self.best(tokens, tenant)
        return not (entry is not None and n == len(tokens))

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

    def clear(self) -> None:
        """The engine that held the tensors is gone."""
        self.entries.clear()
