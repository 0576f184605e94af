"""The process's C library, loaded once for every module that calls it through ctypes.

Python's ``os`` has no mount(2), setns(2), prctl(2), capset(2) or a raw syscall(2); ctypes on the
libc already mapped into the process is the smallest dependable way to reach them. One handle,
made at import: a child the keeper forks later must not run the dynamic loader (a lock another
thread may have held at fork), and ctypes caches each function's wrapper on the handle, so a
prototype set once (runtime/sandbox/_sys.py) serves every caller.
"""

from __future__ import annotations

import ctypes
import os

#: ``use_errno``: ctypes saves errno right after each call, so :func:`check` reads the call's own.
libc = ctypes.CDLL(None, use_errno=True)


def check(result: int, what: str) -> int:
    """Raise OSError(errno, strerror, what) when a libc call returned -1; else pass the result on."""
    if result == -1:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), what)
    return result


def release_freed_memory() -> bool:
    """malloc_trim(3) with no padding: give back to the system the whole pages that freed memory
    left inside malloc's heaps, not only at their top (which free() already does). False where the
    C library has none (not glibc). A long-lived daemon's big, short-lived answers (a 500-slot
    scrape builds ~0.3 MB of text and ten times that in intermediate objects) otherwise keep its
    RSS at their high-water mark between them."""
    try:
        trim = libc.malloc_trim
    except AttributeError:
        return False
    return bool(trim(0))


__all__ = ["check", "libc", "release_freed_memory"]
