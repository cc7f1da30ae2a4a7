"""freeze_heap: what a process has alive after loading is out of every full collection's walk."""

from __future__ import annotations

import gc

from mashbox.heap import freeze_heap


def test_what_is_alive_when_frozen_is_not_walked_again():
    loaded = [[i] for i in range(50_000)]  # what loading left alive, as tracked objects
    try:
        frozen = freeze_heap()
        assert frozen >= len(loaded) and gc.get_freeze_count() == frozen
        walked = {id(o) for o in gc.get_objects(generation=2)}
        assert id(loaded) not in walked and id(loaded[0]) not in walked
        later = [[0]]
        gc.collect()
        assert id(later) in {id(o) for o in gc.get_objects(generation=2)}
    finally:
        gc.unfreeze()
