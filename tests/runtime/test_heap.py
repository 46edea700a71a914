"""Giving the C heap's free memory back to the operating system (:mod:`traingraph.runtime.heap`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import pytest

from traingraph.runtime import heap


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not heap.trim(),
    reason="malloc_trim is glibc's, and resident pages are read from Linux's /proc",
)
def test_trim_returns_the_pages_of_freed_small_blocks():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    # 48 MiB of 4 KiB blocks, each below malloc's mmap threshold and written, then freed
    # but for the last, which keeps the heap's top in use: free alone returns none of it
    blocks = [libc.malloc(4096) for _ in range(12 * 1024)]
    for block in blocks:
        ctypes.memset(block, 1, 4096)
    for block in blocks[:-1]:
        libc.free(block)
    freed = _resident_bytes()
    assert heap.trim()
    trimmed = _resident_bytes()
    libc.free(blocks[-1])
    assert freed - trimmed > 32 << 20, (freed, trimmed)
