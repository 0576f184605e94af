"""Capabilities: what a worker keeps, and the calls that take the rest away.

A worker keeps no capability unless its spec names some. Before setuid (while the child is still
full root) :func:`drop_bounding_set` removes every capability not kept from the bounding set, so
nothing the worker execs can gain it back, and :func:`clear_ambient` empties the ambient set.
After setuid :func:`set_capabilities` sets effective, permitted and inheritable to the kept set
with capset(2), and for a non-root worker raises the kept ones into the ambient set so they
survive exec (a non-root process otherwise loses every capability at exec). Keeping capabilities
across the setuid itself needs :func:`keep_across_setuid` first; without it setuid clears them.

Numbers and prctl options are from include/uapi/linux/capability.h and prctl.h.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import re
from collections.abc import Iterable
from pathlib import Path

from nodeagent.errors import InvalidRequest
from nodeagent.kernelfs import Procfs
from nodeagent.runtime.sandbox._sys import check, libc

#: Capability names in kernel order (CAP_CHOWN is 0); kernels may know more than these.
CAPABILITY_NAMES = (
    "CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID",
    "SETPCAP", "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW",
    "IPC_LOCK", "IPC_OWNER", "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT",
    "SYS_ADMIN", "SYS_BOOT", "SYS_NICE", "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD",
    "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP", "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG",
    "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF", "CHECKPOINT_RESTORE",
)  # fmt: skip

#: The set an opted-in root worker keeps: the container runtimes' default set (moby/containerd)
#: without MKNOD and NET_RAW. Why each one stays:
#:   CHOWN, FOWNER, FSETID, DAC_OVERRIDE  server images run as root and fix up ownership and modes
#:       of their own caches and model directories at start; a root worker has a read-only root
#:       and a pid namespace, so these reach only its own writable mounts (/tmp, /dev/shm, HOME).
#:       DAC_OVERRIDE would also let it read other users' files that are readable at all, which is
#:       why homes live under the hidden state directory.
#:   SETUID, SETGID, SETPCAP  entrypoints that start as root and drop to a service user
#:       (gosu/su-exec style); SETPCAP only lets it shed more of its own bounding set.
#:   SETFCAP  package post-install steps set file capabilities; no_new_privs keeps them inert.
#:   KILL  signal its own helpers whatever their uid; the pid namespace bounds whom it can name.
#:   NET_BIND_SERVICE  HTTP/gRPC servers that bind ports below 1024.
#:   SYS_CHROOT  some servers chroot their helpers; seccomp still denies pivot_root and mount.
#:   AUDIT_WRITE  PAM-using tools (su, login shells) in images write audit records.
#: Left out on purpose: MKNOD (the private /dev holds every node the slot may use), NET_RAW (raw
#: packets on a slot that may share the host's network; ping works through ICMP datagram
#: sockets), and everything outside the runtimes' default set, notably SYS_ADMIN, SYS_PTRACE,
#: SYS_MODULE, SYS_RAWIO, NET_ADMIN, DAC_READ_SEARCH and SYS_BOOT (see NEVER_FOR_ROOT).
ROOT_CAPABILITIES = (
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "NET_BIND_SERVICE",
    "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
)  # fmt: skip
#: Each of these undoes the slot as a boundary: mount and namespace control (SYS_ADMIN), reading
#: other processes' memory (SYS_PTRACE), kernel code (SYS_MODULE), raw I/O ports and /dev/mem
#: (SYS_RAWIO), the host's network configuration (NET_ADMIN), open_by_handle_at escapes from any
#: mount (DAC_READ_SEARCH), rebooting the host (SYS_BOOT), making device nodes (MKNOD).
NEVER_FOR_ROOT = (
    "SYS_ADMIN", "SYS_PTRACE", "SYS_MODULE", "SYS_RAWIO", "NET_ADMIN", "DAC_READ_SEARCH", "SYS_BOOT", "MKNOD",
)  # fmt: skip

PR_CAPBSET_DROP = 24
PR_SET_KEEPCAPS = 8
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_RAISE = 2
PR_CAP_AMBIENT_CLEAR_ALL = 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))


class _CapData(ctypes.Structure):
    _fields_ = (
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    )


#: Version 3 takes two words (capabilities 0-31 and 32-63). Made once: building a ctypes array
#: type costs ~0.1 ms, which a forked child would otherwise pay at every launch.
_CapDataPair = _CapData * 2


def capability_number(name: str) -> int:
    """The number of capability ``name`` ("NET_BIND_SERVICE"; a ``CAP_`` prefix is accepted)."""
    bare = name.upper().removeprefix("CAP_")
    if bare not in CAPABILITY_NAMES:
        raise InvalidRequest(f"unknown capability {name!r}; known: {', '.join(CAPABILITY_NAMES)}")
    return CAPABILITY_NAMES.index(bare)


def capability_mask(names: Iterable[str]) -> int:
    mask = 0
    for name in names:
        mask |= 1 << capability_number(name)
    return mask


def last_capability(proc_root: Path = Path("/proc")) -> int:
    """The highest capability this kernel knows (/proc/sys/kernel/cap_last_cap, Linux 3.2+)."""
    last = Procfs(proc_root).read_int("sys/kernel/cap_last_cap")
    if last is None:
        raise FileNotFoundError(
            errno.ENOENT, "Linux 3.2 or later is needed", str(proc_root / "sys/kernel/cap_last_cap")
        )
    return last


def drop_bounding_set(keep_mask: int, last_cap: int) -> None:
    """Remove from the bounding set every capability up to ``last_cap`` not in ``keep_mask``.
    Needs CAP_SETPCAP, so it runs before setuid."""
    for cap in range(last_cap + 1):
        if not keep_mask & (1 << cap):
            result = libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
            if result == -1:  # the message is built only then: this loop runs on every launch
                check(result, f"prctl(PR_CAPBSET_DROP, {cap})")


def clear_ambient() -> None:
    check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "prctl(PR_CAP_AMBIENT_CLEAR_ALL)")


def keep_across_setuid() -> None:
    """Keep the permitted set through the coming setuid (SECBIT_KEEP_CAPS; cleared again at exec)."""
    check(libc.prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0), "prctl(PR_SET_KEEPCAPS)")


def set_capabilities(keep_mask: int, *, ambient: bool) -> None:
    """Effective = permitted = inheritable = ``keep_mask`` (capset(2), version 3); with ``ambient``
    also raise each into the ambient set, which is how a non-root process keeps one across exec."""
    header, data = capset_arguments(keep_mask)
    if libc.capset(header, data) == -1:  # the message is built only then, off the launch path
        check(-1, f"capset({keep_mask:#x})")
    if ambient:
        for cap in _bits(keep_mask):
            check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, cap, 0, 0), f"raise ambient cap {cap}")


@functools.lru_cache(maxsize=8)
def capset_arguments(keep_mask: int) -> tuple[ctypes._Pointer[_CapHeader], ctypes.Array[_CapData]]:
    """capset(2)'s two arguments for ``keep_mask``, made once: the keeper makes the empty set's
    before it forks (sandbox.warm_up), so a launching child only passes them to the kernel, which
    reads and never writes them."""
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = _CapDataPair()
    for index in range(2):
        word = (keep_mask >> (32 * index)) & 0xFFFFFFFF
        data[index].effective = data[index].permitted = data[index].inheritable = word
    return ctypes.pointer(header), data  # a pointer keeps its structure alive


def _bits(mask: int) -> list[int]:
    return [bit for bit in range(mask.bit_length()) if mask & (1 << bit)]


_STATUS_CAP = re.compile(r"^(Cap(?:Inh|Prm|Eff|Bnd|Amb)):\s*([0-9a-f]+)$", re.MULTILINE)


def read_capability_sets(status_text: str) -> dict[str, int]:
    """CapInh, CapPrm, CapEff, CapBnd and CapAmb from the text of /proc/PID/status, as masks."""
    return {key: int(value, 16) for key, value in _STATUS_CAP.findall(status_text)}


def names_of(mask: int) -> tuple[str, ...]:
    return tuple(CAPABILITY_NAMES[bit] if bit < len(CAPABILITY_NAMES) else str(bit) for bit in _bits(mask))
