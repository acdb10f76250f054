"""The process's memory allocator as a benchmark condition: glibc malloc kept from handing freed
memory back to the kernel, and the minor page faults of a call.

Under glibc's defaults a freed block at the top of the heap beyond the trim threshold goes back to
the kernel, and blocks above the (dynamic) mmap threshold are mapped and unmapped per allocation;
the next allocation then touches fresh pages, each a minor fault the kernel zeroes. How often that
happens depends on everything the process allocated before (a peer's multi-GiB temporaries raise
the thresholds, a compile changes the heap's layout), so a path's time depends on which paths ran
before it. `keep_freed_memory` turns both off for the whole process (mallopt), so that every path
runs on memory the process already holds once it has run once, whatever ran before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import resource

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4

ALLOCATORS = ("steady", "default")


def keep_freed_memory() -> str:
    """Make glibc malloc keep freed memory in the process (no trimming, no mmap'ed blocks).

    Returns the allocator condition to record with the results: "steady" where applied,
    "default (not glibc)" where the C library has no mallopt (the benchmark then runs as it is).
    """
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt"):
        return "default (not glibc)"
    if libc.mallopt(_M_MMAP_MAX, 0) != 1 or libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) != 1:
        raise RuntimeError("mallopt refused M_MMAP_MAX = 0 or M_TRIM_THRESHOLD = 2^31 - 1")
    return "steady"


def minor_faults() -> int:
    """The process's minor page faults so far (fresh pages touched)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
