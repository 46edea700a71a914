"""Giving the process's free heap memory back to the operating system.

glibc's ``malloc`` keeps the memory that freed blocks leave inside its heaps (and blocks
smaller than its ``mmap`` threshold, which grows each time a large block is freed, live
there): after a burst of allocations (a model's graphs built and checked, a first step whose
values had no buffers yet) hundreds of MiB stay resident, free, until ``malloc_trim`` returns
them. Elsewhere (another C library, another system) :func:`trim` does nothing.

Example:
    >>> trim()  # after loading a model
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        function = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    return function  # type: ignore[no-any-return]


def trim() -> bool:
    """Return the free memory of the C heap to the operating system (glibc's
    ``malloc_trim(0)``). Returns whether the C library has the call."""
    function = _malloc_trim()
    if function is None:
        return False
    function(0)
    return True
