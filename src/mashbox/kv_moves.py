"""Where a newly placed request's prompt prefix comes from, and the KV moves that bring it:
the tenant's prefix copied from a slot in use (`Share`), restored from the host prompt cache
(`Restore`, from host memory or --cache-dir), and what a slot held saved there before it is
overwritten (`Save`, `drops`); a prefix that repeats is also written to disk (`Persist`,
`disk_drops`). The moves go out with the next step planned on the engine's latest state.
"""

from __future__ import annotations

from .prompt_cache import PromptCache, common_prefix
from .protocol import Persist, Restore, Save, Share
from .sequence import Slot


class KVMoves:
    """The prompt cache's index and the moves the next step must carry."""

    def __init__(self, slots: list[Slot], prompt_cache: PromptCache):
        self.slots = slots
        self.prompt_cache = prompt_cache
        self.saves: list[Save] = []
        self.restores: list[Restore] = []
        self.shares: list[Share] = []  # prefixes copied from slots in use
        self.drops: list[int] = []
        self.persists: list[Persist] = []
        self.disk_drops: list[str] = []

    def __bool__(self) -> bool:
        return bool(
            self.saves
            or self.restores
            or self.shares
            or self.drops
            or self.persists
            or self.disk_drops
        )

    def take(self) -> dict[str, tuple]:
        """The moves, as a `Step`'s fields; the next step starts with none."""
        moves = {
            "saves": tuple(self.saves),
            "restores": tuple(self.restores),
            "shares": tuple(self.shares),
            "drops": tuple(self.drops),
            "persists": tuple(self.persists),
            "disk_drops": tuple(self.disk_drops),
        }
        self.clear()
        return moves

    def clear(self) -> None:
        self.saves, self.restores, self.shares, self.drops = [], [], [], []
        self.persists, self.disk_drops = [], []

    def forget_all(self) -> None:
        """The engine process is gone, and every KV copy with it: slots and host cache (the
        files on disk stay; one whose write the fault cut short is prefilled instead)."""
        self.clear()
        self.prompt_cache.clear()  # the host copies lived in the engine process too
        for slot in self.slots:
            slot.tokens.clear()  # a new engine process starts with empty caches

    def bring_prefix(self, slot: Slot, tenant: str, prompt, shared: int, reusable: int) -> int:
        """Save what the slot holds before it is overwritten, then bring in the longest
        prefix of the prompt the tenant holds elsewhere, if it beats the slot's own: a slot
        in use (a copy on the device) or the prompt cache (host memory or disk). A prefix
        reused is one that repeats: it goes to disk if worth it. Return the shared length."""
        cache = self.prompt_cache
        if (
            cache.enabled
            and shared < len(slot.tokens)
            and cache.worth_saving(slot.tokens, slot.tenant)
        ):
            entry, evicted = cache.add(slot.tokens, slot.tenant)
            self.saves.append(Save(slot.index, entry.id, len(slot.tokens)))
            self.drops.extend(e.id for e in evicted)
        # A source must hold its prefix when the step starts: shares run before restores,
        # so a slot still waiting for its own share or restore is no source.
        arriving = {m.slot for m in self.shares} | {m.slot for m in self.restores}
        live = [
            s
            for s in self.slots
            if s.seq is not None
            and s is not slot
            and s.tenant == tenant
            and s.index not in arriving
        ]
        from_live, source = max(
            ((common_prefix(s.tokens, prompt), s) for s in live),
            key=lambda pair: pair[0],
            default=(0, None),
        )
        from_live = min(from_live, reusable)
        entry, from_cache = cache.best(prompt, tenant) if cache.enabled else (None, 0)
        from_cache = min(from_cache, reusable)
        if max(from_live, from_cache) <= shared:
            self._persist(slot, tenant, prompt[: min(shared, reusable)])
            return shared
        if from_live >= from_cache:
            self.shares.append(Share(source.index, slot.index, from_live))
            slot.tokens[:] = source.tokens[:from_live]
            self._persist(slot, tenant, prompt[:from_live])
            return from_live
        cache.touch(entry)
        if entry.file:  # on disk: the engine prefills the tokens should the file fail
            tokens = tuple(prompt[:from_cache])
            self.restores.append(Restore(slot.index, entry.id, from_cache, entry.file, tokens))
        else:
            self.restores.append(Restore(slot.index, entry.id, from_cache))
        slot.tokens[:] = entry.tokens[:from_cache]
        self._persist(slot, tenant, prompt[:from_cache])
        return from_cache

    def _persist(self, slot: Slot, tenant: str, prefix) -> None:
        """Write the slot's `prefix` (held there once this step's moves ran) to disk if worth
        it; the files of what it replaces go."""
        cache = self.prompt_cache
        if not cache.worth_persisting(prefix, tenant):
            return
        entry, evicted = cache.add_disk(prefix, tenant)
        self.persists.append(Persist(slot.index, entry.file, tenant, entry.tokens))
        self.disk_drops.extend(e.file for e in evicted)
