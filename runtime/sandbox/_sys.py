"""The system calls the sandbox makes through libc, loaded once so a forked child does no loading.

Python's ``os`` module has no mount(2), unshare(2) (before 3.12), capset(2) or prctl(2); ctypes on
the process's own libc is the smallest dependable way to reach them. Every call goes through
:func:`check`, which turns a -1 return into an ``OSError`` naming what was attempted, so the
exec path can report ``step\\0errno\\0message`` as it does for every other step.
"""

from __future__ import annotations

import ctypes
import platform

# The process's one libc handle (nodeagent/libc.py), loaded in the parent at import time: a child
# forked later must not run the dynamic loader. Re-exported: the sandbox's modules take it from here,
# where its prototypes are set.
from nodeagent.libc import check, libc

# ctypes looks a function up (dlsym) and builds its wrapper on first use, then caches it on the
# handle; doing that here, once, keeps it off every forked child's launch path (~20 µs each).
for _name in ("mount", "umount2", "unshare", "setns", "sethostname", "prctl", "capset", "syscall"):
    getattr(libc, _name)
# A typed prototype halves the cost of a call (~2.5 instead of ~5 µs here), and dropping the
# bounding set is one prctl per capability: 41 calls on every launch.
libc.prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)
libc.prctl.restype = ctypes.c_int

# clone(2)/unshare(2) namespace flags (include/uapi/linux/sched.h).
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000

# System call numbers that glibc has no wrapper for, or only in versions newer than Debian 12's.
# x86_64: arch/x86/entry/syscalls/syscall_64.tbl; aarch64: include/uapi/asm-generic/unistd.h.
_MOUNT_SETATTR = {"x86_64": 442, "aarch64": 442}


def machine() -> str:
    return platform.machine()


def mount_setattr_number() -> int | None:
    return _MOUNT_SETATTR.get(machine())


__all__ = [
    "CLONE_NEWCGROUP",
    "CLONE_NEWIPC",
    "CLONE_NEWNS",
    "CLONE_NEWPID",
    "CLONE_NEWUTS",
    "check",
    "libc",
    "machine",
    "mount_setattr_number",
]
