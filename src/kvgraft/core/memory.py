"""Giving memory freed by a large transient structure back to the operating system.

Opening a library parses its whole index and builds a retrieval index, and most of what those build is dropped
at once. glibc's allocator keeps such freed memory in its heap for reuse (only memory at the heap's top, or in
chunks above its mmap threshold, goes back by itself), so a process that opened a large library once would stay as
large as the parse was. `malloc_trim(0)` returns every free page it can. Elsewhere (macOS, musl) this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        trim: Callable[[int], int] = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    return trim


def release_free_memory() -> bool:
    """Return the allocator's free pages to the OS. True when glibc did release some."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
