"""A bound on how many of one thing each tenant holds at once (prompts being tokenized, open
WebSockets): past it, the caller's error, so one tenant's flood cannot take what everyone
shares."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator

from .errors import ApiError


class PerTenant:
    """Each tenant's count of held things, at most `most` each."""

    def __init__(self, most: int):
        self.most = most
        self._held: collections.Counter[str] = collections.Counter()

    @contextlib.contextmanager
    def hold(self, tenant: str, refused: Callable[[int], ApiError]) -> Iterator[None]:
        """Hold one for the block; raise refused(most) instead where the tenant holds `most`."""
        if self._held[tenant] >= self.most:
            raise refused(self.most)
        self._held[tenant] += 1
        try:
            yield
        finally:
            self._held[tenant] -= 1
            if not self._held[tenant]:
                del self._held[tenant]  # (not one entry for every tenant ever seen)
