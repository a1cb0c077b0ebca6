"""Large buffers freed go back to the system at once, so that a router's RSS follows the
request bodies it holds (issue 34: held bodies within a byte budget).

glibc's malloc gives an allocation of at least its mmap threshold a mapping of its own,
unmapped when freed, and a smaller one a place in the heap, whose free space is kept
for reuse. The threshold starts at 128 KiB and rises to the size of each mapped block
freed (up to 32 MiB): once one 16 MiB body was freed, later ones came from the heap,
and what a burst of them left stayed in RSS. 100 held 16 MiB requests within a 256 MiB
budget grew RSS by 291 MiB so, by 276 MiB with the threshold fixed at `LARGE_BYTES`.
A body or answer of 1 MiB or more is then mapped and unmapped (microseconds beside
reading a MiB); smaller ones come from the heap, as before. Elsewhere than glibc
(musl's mallopt does nothing, other systems have none) nothing changes.
"""

from __future__ import annotations

import ctypes
import sys

LARGE_BYTES = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def return_large_buffers() -> bool:
    """Fix malloc's mmap threshold at `LARGE_BYTES` for this process (idempotent);
    whether the C library took it."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(_M_MMAP_THRESHOLD, LARGE_BYTES))
