"""Keep freed memory in the process instead of handing it back to the OS after every training step.

Every step of an expert frees and re-allocates tensors of tens of MB (gradients, activations). With glibc's
defaults such blocks are ``mmap``ed and returned on free, or trimmed from the top of the heap, and each new one
costs a page fault per 4 KiB page, all of them zero-filled by the kernel, which slows an expert server markedly
(benchmarks/README.md, "Figures behind design choices"). Threads other than the main one are worse, as their
arenas' heaps are capped at 64 MB, and the server computes on a thread.

:func:`keep_freed_memory` serves such blocks from the heap of one arena and never trims it: the process keeps its
peak footprint (which it needs again at the next step) and stops faulting. Programs call it at start-up; it only
changes process-wide allocator settings, so the library never calls it on its own.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

# mallopt parameters of glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
#: glibc's upper limit for M_MMAP_THRESHOLD on 64-bit systems: larger blocks are always mmap-ed
MMAP_THRESHOLD_MAX = 32 * 2**20


def keep_freed_memory(trim_threshold: int = 2**30) -> bool:
    """Tells glibc's malloc to serve blocks up to 32 MiB from one heap and to return at most ``trim_threshold``
    bytes of free heap top to the OS. Call it at start-up, before the threads that compute are started (it
    applies to allocations made after the call). Returns False (and changes nothing) where the C library is not
    glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        logger.debug("no mallopt in this C library: allocator settings left as they are")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = [mallopt(_M_ARENA_MAX, 1), mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX),
               mallopt(_M_TRIM_THRESHOLD, min(trim_threshold, 2**31 - 1))]
    if not all(applied):
        logger.warning("mallopt refused some allocator settings (%s): steps may page-fault more", applied)
    return all(applied)
