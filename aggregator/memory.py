"""Giving memory back to the system after a burst of large requests.

CPython returns large blocks to the C allocator when they are freed, but glibc's
``malloc`` keeps freed memory in its arenas (one per thread that allocated, up to eight
per core) rather than returning it, so a process that parsed many large batches at once
stays at its peak size long after; and the service collects cyclic garbage rarely (an
exception's traceback, holding a rejected body, is such garbage). ``release_memory``
runs a full collection, then glibc's ``malloc_trim(0)``, which hands the free pages of
every arena back (where the C library is not glibc, only the collection is done).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
from collections.abc import Callable

__all__ = ["release_memory"]


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim  # type: ignore[no-any-return]


def release_memory() -> bool:
    """Collect cyclic garbage, then return the allocator's free memory to the system;
    True if anything was returned."""
    gc.collect()
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
