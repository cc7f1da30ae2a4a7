"""The Python heap of a long-running process (the server's, the engine's)."""

from __future__ import annotations

import gc


def freeze_heap() -> int:
    """Move everything alive after loading out of the collector's reach; return how many.

    A full collection walks every tracked object: with torch loaded, ~180k of them and ~120 ms
    (docs/performance.md), a pause every stream would feel. What loading leaves alive stays
    alive, so only what the steps allocate is walked from then on."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
