"""The process's limit on open files, raised to what the system allows.

Every connection holds a descriptor until it closes, and a peer that opens many and sends
slowly keeps each for up to the stall timeout (a stalled request body). At a desktop's usual
soft limit of 1024 a few hundred such connections left no descriptor to accept anyone else:
every client was refused until they timed out. The hard limit is usually 512k or more.
"""

from __future__ import annotations

import resource

# Below this many, a burst of slow peers can still use every descriptor: say so at start.
LOW = 4096
# Where the hard limit is "unlimited", ask for this (macOS refuses more than OPEN_MAX).
UNLIMITED_ASK = (1 << 20, 10240)


def raise_limit() -> tuple[int, int]:
    """Raise the soft limit on open files to the hard one; (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    asks = UNLIMITED_ASK if hard == resource.RLIM_INFINITY else (hard,)
    for want in asks:
        if want <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            continue
        return soft, want
    return soft, soft
