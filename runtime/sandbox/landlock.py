"""Landlock scoping: a sandboxed worker cannot connect to abstract unix sockets made outside it.

Abstract unix sockets (``\\0name``) have no file, so neither mount namespaces nor file modes
hide them: they belong to the network namespace, and a worker in the host's network namespace
could connect to every other slot's and the host's (a D-Bus or X11 listener, another worker's
control socket). Landlock ABI 6 (Linux 6.12) scopes them: after ``landlock_restrict_self`` with
``LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET``, the process and its descendants may connect (and send
datagrams) only to abstract sockets made inside the same Landlock domain, that is by the worker
and its own children. Sockets with a path, the network and the file system are not affected (the
ruleset handles no file-system or network access).

The worker's domain is made in the child just before exec (after no_new_privs, which Landlock
requires of a process without CAP_SYS_ADMIN, and before the seccomp filter, which may not allow
the Landlock calls). A kernel older than ABI 6 (or one booted without ``lsm=landlock``) gets no
scope: :func:`abi` says what the kernel has, for doctor and the docs' matrix.
"""

from __future__ import annotations

import ctypes
import functools
import os

from nodeagent.runtime.sandbox._sys import check, libc, machine

#: include/uapi/linux/landlock.h
LANDLOCK_CREATE_RULESET_VERSION = 1 << 0
LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0
#: The first ABI with scopes.
SCOPE_ABI = 6

# landlock_create_ruleset, landlock_restrict_self: the same numbers on x86_64 and aarch64.
_CREATE_RULESET = {"x86_64": 444, "aarch64": 444}
_RESTRICT_SELF = {"x86_64": 446, "aarch64": 446}


class _RulesetAttr(ctypes.Structure):
    _fields_ = (
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    )


@functools.cache
def abi() -> int:
    """The kernel's Landlock ABI version; 0 where there is none (or the architecture is unknown)."""
    number = _CREATE_RULESET.get(machine())
    if number is None:
        return 0
    version = libc.syscall(number, None, ctypes.c_size_t(0), ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    return max(int(version), 0)


def scope_supported() -> bool:
    return abi() >= SCOPE_ABI


def scope_abstract_unix_sockets() -> bool:
    """Restrict this process (and what it will exec and fork) to its own abstract unix sockets.

    Needs no_new_privs (or CAP_SYS_ADMIN). Returns False, doing nothing, where the kernel has no
    scopes; raises OSError when the kernel has them and refuses."""
    if not scope_supported():
        return False
    arch = machine()
    attr = _RulesetAttr(0, 0, LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET)
    fd = check(
        libc.syscall(_CREATE_RULESET[arch], ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)), 0),
        "landlock_create_ruleset",
    )
    try:
        check(libc.syscall(_RESTRICT_SELF[arch], fd, 0), "landlock_restrict_self")
    finally:
        os.close(fd)
    return True


__all__ = ["SCOPE_ABI", "abi", "scope_abstract_unix_sockets", "scope_supported"]
