"""Which waiting requests get the free KV slots, and which slot each gets: fair across
tenants, then the longest prefix already in a slot first. Pure choices: the batch core
(`batch.Batch`) does the placing.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable

from .prompt_cache import common_prefix
from .sequence import Sequence, Slot


def pick(
    waiting: collections.deque[Sequence],
    slots: Iterable[Slot],
    n: int,
    tenant_slots: int,
    budget: float = math.inf,
) -> list[Sequence]:
    """Up to n waiting requests, taken off `waiting`, round-robin across tenants: each goes
    to the tenant holding the fewest slots (counting those just picked), the oldest request
    first among equals; a tenant at `tenant_slots` waits. So one tenant's requests, however
    many or slow, never keep another's from the next free slot. Their prompts: at most
    `budget` tokens in all (the next pick past it stays waiting). A later choice waits for
    its prompt's first choice's prefill (`Sequence.waits_for_leader`). In arrival order."""
    holding = collections.Counter(s.seq.request.tenant for s in slots if s.seq)
    picked: list[Sequence] = []
    while len(picked) < n:
        best = None
        for seq in waiting:  # oldest first
            tenant = seq.request.tenant
            if holding[tenant] >= tenant_slots or seq.waits_for_leader:
                continue
            if best is None or holding[tenant] < holding[best.request.tenant]:
                best = seq
        if best is None or len(best.request.prompt_ids) > budget:
            break
        budget -= len(best.request.prompt_ids)
        waiting.remove(best)
        holding[best.request.tenant] += 1
        picked.append(best)
    picked.sort(key=lambda s: s.t_submit)
    return picked


def match(seq: Sequence, slot: Slot) -> int:
    """The prompt tokens the slot still holds for this request (its tenant's; none for one
    that reads every position: pooled, or echo's log-probs)."""
    if seq.request.reads_every_position or slot.tenant != seq.request.tenant:
        return 0
    return common_prefix(slot.tokens, seq.request.prompt_ids)


def pair(batch: list[Sequence], free: list[Slot]) -> list[tuple[Sequence, Slot, int]]:
    """Each request with a free slot (as many slots as requests, at least) and the prefix
    they share, longest matches first (among equals the least recently used slot): in a
    burst, a request whose own prompt a slot still holds gets that slot, not a request that
    came before it and would share less. In the batch's order."""
    pairs = sorted(
        ((match(q, s), -s.last_used, -i, i, s) for i, q in enumerate(batch) for s in free),
        key=lambda pair: pair[:3],
        reverse=True,
    )
    chosen: dict[int, tuple[Slot, int]] = {}
    taken: set[int] = set()
    for shared, _, _, i, slot in pairs:
        if i not in chosen and slot.index not in taken:
            chosen[i] = slot, shared
            taken.add(slot.index)
    return [(seq, *chosen[i]) for i, seq in enumerate(batch)]
