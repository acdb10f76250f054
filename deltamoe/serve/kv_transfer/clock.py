"""Which monotonic clock this process reads: a hand-off is timed across two servers only on one.

On Linux every process of one boot reads the same CLOCK_MONOTONIC (`time.monotonic()`), and the
kernel names the boot (`/proc/sys/kernel/random/boot_id`, random per boot). A prefill server
reports its boot id with the moments its hand-off's prefill finished and its write ended; the
decode server times the hand-off from those moments when its own boot id is the same (the two
servers share a host), and leaves it untimed otherwise (clocks of two hosts do not compare).
"""

from __future__ import annotations

import functools
from pathlib import Path

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@functools.cache
def monotonic_clock_id() -> str | None:
    """This host's boot id (the monotonic clock's identity), or None where the kernel has none."""
    try:
        return BOOT_ID.read_text().strip() or None
    except OSError:
        return None
