"""A seccomp filter for workers, written as classic BPF by hand.

Why by hand: there is no maintained seccomp binding on PyPI (libseccomp's own Python bindings are
not published there), and the filter is small: check the architecture, look the syscall number
up in a sorted table, return. Assembling it here keeps it pure (:func:`build_filter` returns the
bytes, tested in an interpreter and in forked children) and leaves the exec path with one
prctl(2) call (:func:`install`).

The ``default`` profile is modelled on the container runtimes' default (moby/containerd): it is
written as the calls that profile does not allow a container without extra capabilities, since
everything else is allowed. Calls are denied with EPERM, except ``clone3``, which gets ENOSYS: its
flags sit in a struct a classic filter cannot read, so, as runc does, the filter makes glibc fall
back to ``clone``, whose flags it can check. Departures from moby's list: mbind, set_mempolicy,
get_mempolicy and move_pages stay allowed (moby ties them to CAP_SYS_NICE; here the slot's
cpuset.mems already bounds them, and NUMA-aware servers call them); io_uring is denied as in
moby since 2023. Syscall numbers are in :mod:`.syscalls`.

Layout of the program:

    ld  arch;  jeq AUDIT_ARCH_<native> ? next : kill   (another ABI's numbers mean other calls)
    ld  nr;    [x86_64] jge 0x40000000 ? kill : next   (x32 ABI shares AUDIT_ARCH_X86_64)
    binary search over the sorted restricted numbers (jge + ja), each leaf a jeq to its action
    ret ALLOW

A foreign architecture or x32 kills the process: the tables say nothing about its numbers, so any
answer but "stop" could allow what the profile denies.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field

from nodeagent.errors import InvalidRequest, Unsupported
from nodeagent.runtime.sandbox._sys import check, libc, machine
from nodeagent.runtime.sandbox.syscalls import ARCHITECTURES

# Classic BPF opcodes (include/uapi/linux/filter.h, bpf_common.h).
BPF_LD_W_ABS = 0x20
BPF_JMP_JA = 0x05
BPF_JMP_JEQ_K = 0x15
BPF_JMP_JGE_K = 0x35
BPF_JMP_JSET_K = 0x45
BPF_RET_K = 0x06

# Return values (include/uapi/linux/seccomp.h).
SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_ALLOW = 0x7FFF0000

# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6].
# Both supported architectures are little-endian, so an argument's low 32 bits come first.
OFFSET_NR = 0
OFFSET_ARCH = 4
OFFSET_ARGS = 16
X32_SYSCALL_BIT = 0x40000000

PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2

#: clone(2) flags that create namespaces: NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
#: (moby's mask). CLONE_NEWTIME is 0x80, which clone(2) reads as part of the exit signal.
CLONE_NAMESPACE_FLAGS = 0x7E020000
#: personality(2) values moby allows: PER_LINUX, PER_LINUX32, UNAME26, both, and the query.
SAFE_PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)
#: socket(2)'s address family for virtio/VMCI sockets (include/linux/socket.h).
AF_VSOCK = 40

_LEAF_SIZE = 4


@dataclass(frozen=True)
class Profile:
    """Calls to deny (EPERM), to answer ENOSYS, and argument rules; everything else is allowed."""

    deny: frozenset[str]
    enosys: frozenset[str] = frozenset()
    #: syscall -> namespace-flag mask: deny when any bit of arg 0 is set (clone).
    deny_flags: dict[str, int] = field(default_factory=dict)
    #: syscall -> the only arg 0 values allowed (personality).
    allow_values: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: syscall -> arg 0 values denied, every other allowed (socket families).
    deny_values: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def restricted(self) -> frozenset[str]:
        return (
            self.deny
            | self.enosys
            | frozenset(self.deny_flags)
            | frozenset(self.allow_values)
            | frozenset(self.deny_values)
        )

    def without(self, names: Iterable[str]) -> Profile:
        """This profile with the named calls opted out of (allowed whatever their arguments)."""
        drop = frozenset(names)
        return Profile(
            deny=self.deny - drop,
            enosys=self.enosys - drop,
            deny_flags={k: v for k, v in self.deny_flags.items() if k not in drop},
            allow_values={k: v for k, v in self.allow_values.items() if k not in drop},
            deny_values={k: v for k, v in self.deny_values.items() if k not in drop},
        )


DEFAULT_PROFILE = Profile(
    deny=frozenset(
        {
            # Mounts and the new mount API: the private /tmp, /dev and hidden paths stay as made.
            "mount",
            "umount2",
            "pivot_root",
            "open_tree",
            "move_mount",
            "fsopen",
            "fsconfig",
            "fsmount",
            "fspick",
            "mount_setattr",
            # Namespaces: no way out of (setns) or around (unshare) the slot's.
            "unshare",
            "setns",
            # Other processes' memory and descriptors.
            "ptrace",
            "process_vm_readv",
            "process_vm_writev",
            "kcmp",
            "pidfd_getfd",
            "process_madvise",
            # Kernel code and kernel-wide state.
            "kexec_load",
            "kexec_file_load",
            "init_module",
            "finit_module",
            "delete_module",
            "create_module",
            "get_kernel_syms",
            "query_module",
            "bpf",
            "perf_event_open",
            "syslog",
            "lookup_dcookie",
            "nfsservctl",
            "uselib",
            "ustat",
            "sysfs",
            "_sysctl",
            "vhangup",
            "fanotify_init",
            "userfaultfd",
            "iopl",
            "ioperm",
            # The kernel keyring is not namespaced.
            "keyctl",
            "add_key",
            "request_key",
            # File handles bypass the mount a path would go through (the "shocker" escape).
            "open_by_handle_at",
            "name_to_handle_at",
            # Host-wide switches.
            "reboot",
            "swapon",
            "swapoff",
            "acct",
            "quotactl",
            "quotactl_fd",
            "settimeofday",
            "clock_settime",
            "clock_adjtime",
            "adjtimex",
            # A large, often-patched kernel surface (moby denies it too).
            "io_uring_setup",
            "io_uring_enter",
            "io_uring_register",
        }
    ),
    enosys=frozenset({"clone3"}),
    deny_flags={"clone": CLONE_NAMESPACE_FLAGS},
    allow_values={"personality": SAFE_PERSONALITIES},
    # AF_VSOCK talks to the hypervisor and other VMs of the host, past every network rule of the
    # slot (moby's profile denies it the same way).
    deny_values={"socket": (AF_VSOCK,)},
)

#: Profiles by name; ``unconfined`` installs no filter (an opt-out the configuration must allow).
PROFILES: dict[str, Profile | None] = {"default": DEFAULT_PROFILE, "unconfined": None}


@functools.lru_cache(maxsize=8)
def restricted_syscalls(profile_name: str) -> frozenset[str]:
    """Names the profile denies or filters: the names a slot may opt out of (cached: every launch
    request's spec checks its opt-outs against it in the launching child)."""
    profile = PROFILES.get(profile_name)
    return profile.restricted() if profile is not None else frozenset()


def native_arch() -> str:
    arch = machine()
    if arch not in ARCHITECTURES:
        raise Unsupported(
            f"no seccomp syscall table for architecture {arch!r}; supported: {', '.join(ARCHITECTURES)} "
            "(use seccomp_profile 'unconfined' where the configuration allows it)"
        )
    return arch


def _stmt(code: int, k: int) -> bytes:
    # struct sock_filter: __u16 code; __u8 jt; __u8 jf; __u32 k
    return struct.pack("<HBBI", code, 0, 0, k & 0xFFFFFFFF)


def _jump(code: int, k: int, jt: int, jf: int) -> bytes:
    if not (0 <= jt <= 255 and 0 <= jf <= 255):
        raise ValueError(f"classic BPF jump offset out of range ({jt}, {jf})")
    return struct.pack("<HBBI", code, jt, jf, k & 0xFFFFFFFF)


def _ret(value: int) -> bytes:
    return _stmt(BPF_RET_K, value)


def _action(name: str, profile: Profile) -> list[bytes]:
    """Instructions run once the number matched ``name``; each path ends in a return."""
    if name in profile.enosys:
        return [_ret(SECCOMP_RET_ERRNO | errno.ENOSYS)]
    if name in profile.deny_flags:
        return [
            _stmt(BPF_LD_W_ABS, OFFSET_ARGS),
            _jump(BPF_JMP_JSET_K, profile.deny_flags[name], 0, 1),
            _ret(SECCOMP_RET_ERRNO | errno.EPERM),
            _ret(SECCOMP_RET_ALLOW),
        ]
    if name in profile.allow_values:
        values = profile.allow_values[name]
        out = [_stmt(BPF_LD_W_ABS, OFFSET_ARGS)]
        out += [_jump(BPF_JMP_JEQ_K, value, len(values) - index, 0) for index, value in enumerate(values)]
        return [*out, _ret(SECCOMP_RET_ERRNO | errno.EPERM), _ret(SECCOMP_RET_ALLOW)]
    if name in profile.deny_values:
        values = profile.deny_values[name]
        out = [_stmt(BPF_LD_W_ABS, OFFSET_ARGS)]
        out += [_jump(BPF_JMP_JEQ_K, value, len(values) - index, 0) for index, value in enumerate(values)]
        return [*out, _ret(SECCOMP_RET_ALLOW), _ret(SECCOMP_RET_ERRNO | errno.EPERM)]
    return [_ret(SECCOMP_RET_ERRNO | errno.EPERM)]


def _search(entries: list[tuple[int, list[bytes]]]) -> list[bytes]:
    """A binary search over ``entries`` (sorted by number) with the accumulator holding the number.
    Jumps only go forward, as classic BPF requires; ``ja`` carries the long ones."""
    if len(entries) <= _LEAF_SIZE:
        out: list[bytes] = []
        for number, action in entries:
            out.append(_jump(BPF_JMP_JEQ_K, number, 0, len(action)))
            out += action
        return [*out, _ret(SECCOMP_RET_ALLOW)]
    middle = len(entries) // 2
    below = _search(entries[:middle])
    above = _search(entries[middle:])
    return [_jump(BPF_JMP_JGE_K, entries[middle][0], 0, 1), _stmt(BPF_JMP_JA, len(below)), *below, *above]


def build_filter(profile: Profile, arch: str) -> bytes:
    """The filter program (concatenated ``struct sock_filter``) for ``profile`` on ``arch``."""
    if arch not in ARCHITECTURES:
        raise Unsupported(f"no seccomp syscall table for architecture {arch!r}")
    audit_arch, table = ARCHITECTURES[arch]
    entries = sorted((table[name], _action(name, profile)) for name in profile.restricted() if name in table)
    program = [
        _stmt(BPF_LD_W_ABS, OFFSET_ARCH),
        _jump(BPF_JMP_JEQ_K, audit_arch, 1, 0),
        _ret(SECCOMP_RET_KILL_PROCESS),
        _stmt(BPF_LD_W_ABS, OFFSET_NR),
    ]
    if arch == "x86_64":
        program += [_jump(BPF_JMP_JGE_K, X32_SYSCALL_BIT, 0, 1), _ret(SECCOMP_RET_KILL_PROCESS)]
    program += _search(entries)
    return b"".join(program)


def filter_for(profile_name: str, allow: Iterable[str] = (), arch: str | None = None) -> bytes | None:
    """The program for a named profile less the opt-outs ``allow``; None for ``unconfined``."""
    if profile_name not in PROFILES:
        raise InvalidRequest(
            f"unknown seccomp profile {profile_name!r}; known: {', '.join(sorted(PROFILES))}"
        )
    profile = PROFILES[profile_name]
    if profile is None:
        return None
    return build_filter(profile.without(allow), arch or native_arch())


class _SockFprog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))


class Installable:
    """A filter program with its ``struct sock_fprog`` built around it once (in the keeper, before
    it forks): installing it in a launching child is then two prctl(2) calls, and no Python object
    is made (nor a page of the keeper's copied) for it on the launch path."""

    __slots__ = ("_address", "_buffer", "_fprog", "program")

    def __init__(self, program: bytes) -> None:
        if not program or len(program) % 8:
            raise ValueError("a seccomp program is a non-empty sequence of 8-byte instructions")
        self.program = program
        self._buffer = ctypes.create_string_buffer(program, len(program))
        self._fprog = _SockFprog(len(program) // 8, ctypes.addressof(self._buffer))
        self._address = ctypes.addressof(self._fprog)

    def install(self) -> None:
        """Set no_new_privs (the kernel refuses a filter from an unprivileged task without it, and
        it keeps set-id binaries from shedding the filter's effect) and install the program on the
        calling thread. The filter is inherited by every child and kept across exec."""
        check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, self._address, 0, 0), "prctl(PR_SET_SECCOMP)")


def install(program: bytes) -> None:
    """Install ``program`` on the calling thread, no_new_privs first (see :meth:`Installable.install`)."""
    Installable(program).install()
