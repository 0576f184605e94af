"""The seccomp program, run in an interpreter: every restricted call gets its answer on both
architectures, everything else is allowed, another ABI is killed; the syscall tables agree with
the kernel headers where they are installed."""

from __future__ import annotations

import errno
import re
from pathlib import Path

import pytest

from nodeagent.errors import Unsupported
from nodeagent.runtime.sandbox.seccomp import (
    DEFAULT_PROFILE,
    SECCOMP_RET_ALLOW,
    SECCOMP_RET_ERRNO,
    SECCOMP_RET_KILL_PROCESS,
    Profile,
    build_filter,
    filter_for,
    restricted_syscalls,
)
from nodeagent.runtime.sandbox.syscalls import AARCH64, ARCHITECTURES, X86_64
from tests.runtime.sandbox.bpf_interpreter import run, seccomp_data

EPERM = SECCOMP_RET_ERRNO | errno.EPERM
ENOSYS = SECCOMP_RET_ERRNO | errno.ENOSYS
ARCHES = sorted(ARCHITECTURES)
# Calls a worker makes all the time, per architecture (read, write, openat, mmap, futex, exit_group).
EVERYDAY = {"x86_64": (0, 1, 257, 9, 202, 231), "aarch64": (63, 64, 56, 222, 98, 94)}
CLONE_THREAD_FLAGS = 0x3D0F00  # what glibc's pthread_create passes (VM|FS|FILES|SIGHAND|THREAD|...)
SIGCHLD = 17


def verdict(arch: str, name_or_nr: str | int, *args: int, profile: Profile = DEFAULT_PROFILE) -> int:
    audit, table = ARCHITECTURES[arch]
    nr = table[name_or_nr] if isinstance(name_or_nr, str) else name_or_nr
    return run(build_filter(profile, arch), seccomp_data(nr, audit, args))


@pytest.mark.parametrize("arch", ARCHES)
def test_every_denied_call_the_arch_has_gets_eperm(arch):
    table = ARCHITECTURES[arch][1]
    denied = [name for name in DEFAULT_PROFILE.deny if name in table]
    assert len(denied) > 40
    for name in denied:
        assert verdict(arch, name) == EPERM, name


@pytest.mark.parametrize("arch", ARCHES)
def test_everyday_calls_are_allowed(arch):
    restricted = {ARCHITECTURES[arch][1].get(name) for name in DEFAULT_PROFILE.restricted()}
    for nr in (*EVERYDAY[arch], *range(0, 460)):
        if nr not in restricted:
            assert verdict(arch, nr) == SECCOMP_RET_ALLOW, nr


@pytest.mark.parametrize("arch", ARCHES)
def test_clone3_gets_enosys_so_glibc_falls_back_to_clone(arch):
    assert verdict(arch, "clone3") == ENOSYS


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        pytest.param(SIGCHLD, SECCOMP_RET_ALLOW, id="fork"),
        pytest.param(CLONE_THREAD_FLAGS, SECCOMP_RET_ALLOW, id="thread"),
        pytest.param(0x00020000 | SIGCHLD, EPERM, id="newns"),
        pytest.param(0x10000000 | SIGCHLD, EPERM, id="newuser"),
        pytest.param(0x20000000, EPERM, id="newpid"),
        pytest.param(0x40000000 | CLONE_THREAD_FLAGS, EPERM, id="newnet-thread"),
        pytest.param(0x02000000, EPERM, id="newcgroup"),
        pytest.param(0x04000000 | 0x08000000, EPERM, id="newuts-newipc"),
    ],
)
def test_clone_is_refused_only_with_namespace_flags(arch, flags, expected):
    assert verdict(arch, "clone", flags) == expected


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize(
    ("persona", "expected"),
    [
        pytest.param(0xFFFFFFFF, SECCOMP_RET_ALLOW, id="query"),
        pytest.param(0x0, SECCOMP_RET_ALLOW, id="linux"),
        pytest.param(0x8, SECCOMP_RET_ALLOW, id="linux32"),
        pytest.param(0x0040000, EPERM, id="addr-no-randomize"),
        pytest.param(0x0400000, EPERM, id="read-implies-exec"),
    ],
)
def test_personality_allows_only_the_safe_values(arch, persona, expected):
    assert verdict(arch, "personality", persona) == expected


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize(
    ("family", "expected"),
    [
        pytest.param(40, EPERM, id="vsock"),
        pytest.param(2, SECCOMP_RET_ALLOW, id="inet"),
        pytest.param(1, SECCOMP_RET_ALLOW, id="unix"),
        pytest.param(10, SECCOMP_RET_ALLOW, id="inet6"),
    ],
)
def test_socket_is_refused_only_for_vsock(arch, family, expected):
    assert verdict(arch, "socket", family) == expected


@pytest.mark.parametrize("arch", ARCHES)
def test_another_abi_is_killed(arch):
    other = next(audit for name, (audit, _) in ARCHITECTURES.items() if name != arch)
    assert run(build_filter(DEFAULT_PROFILE, arch), seccomp_data(0, other)) == SECCOMP_RET_KILL_PROCESS
    i386 = 0x40000003
    assert run(build_filter(DEFAULT_PROFILE, arch), seccomp_data(0, i386)) == SECCOMP_RET_KILL_PROCESS


def test_x32_numbers_are_killed_on_x86_64():
    assert verdict("x86_64", 0x40000000 | 1) == SECCOMP_RET_KILL_PROCESS


@pytest.mark.parametrize("arch", ARCHES)
def test_opt_outs_allow_just_the_named_calls(arch):
    loosened = DEFAULT_PROFILE.without(["ptrace", "clone", "clone3", "personality"])
    assert verdict(arch, "ptrace", profile=loosened) == SECCOMP_RET_ALLOW
    assert verdict(arch, "clone", 0x20000000, profile=loosened) == SECCOMP_RET_ALLOW
    assert verdict(arch, "clone3", profile=loosened) == SECCOMP_RET_ALLOW
    assert verdict(arch, "personality", 0x0040000, profile=loosened) == SECCOMP_RET_ALLOW
    assert verdict(arch, "mount", profile=loosened) == EPERM
    assert verdict(arch, "process_vm_readv", profile=loosened) == EPERM


def test_filter_for_names_and_unconfined():
    assert filter_for("unconfined") is None
    assert filter_for("default", (), "x86_64") == build_filter(DEFAULT_PROFILE, "x86_64")
    assert filter_for("default", ("mount",), "aarch64") == build_filter(
        DEFAULT_PROFILE.without(["mount"]), "aarch64"
    )
    assert "clone3" in restricted_syscalls("default")
    assert restricted_syscalls("unconfined") == frozenset()


def test_unknown_architecture_is_refused_clearly():
    with pytest.raises(Unsupported, match="'riscv64'"):
        build_filter(DEFAULT_PROFILE, "riscv64")


def test_moby_namespace_and_mount_calls_are_in_the_profile():
    # The list, by name; a profile that forgot one of them would pass every other test.
    named = {
        "mount", "umount2", "pivot_root", "ptrace", "process_vm_readv", "process_vm_writev", "kexec_load",
        "kexec_file_load", "init_module", "finit_module", "delete_module", "bpf", "perf_event_open",
        "keyctl", "add_key", "request_key", "unshare", "setns", "open_by_handle_at",
        "name_to_handle_at", "reboot", "swapon", "swapoff", "acct", "settimeofday", "clock_settime",
        "adjtimex", "quotactl", "lookup_dcookie", "userfaultfd", "iopl", "ioperm", "create_module",
        "syslog", "personality", "clone", "clone3",
        "fsopen", "fsmount", "move_mount", "open_tree",
    }  # fmt: skip
    assert named <= DEFAULT_PROFILE.restricted()


def test_every_profile_name_is_in_some_table():
    known = set(X86_64) | set(AARCH64)
    assert DEFAULT_PROFILE.restricted() <= known


def _header_numbers(path: Path) -> dict[str, int]:
    found: dict[str, int] = {}
    for name, number in re.findall(r"#define __NR(?:3264)?_(\w+)\s+(\d+)", path.read_text()):
        found.setdefault(name, int(number))
    return found


@pytest.mark.parametrize(
    ("table", "header"),
    [
        pytest.param(X86_64, "/usr/include/x86_64-linux-gnu/asm/unistd_64.h", id="x86_64"),
        pytest.param(AARCH64, "/usr/include/asm-generic/unistd.h", id="aarch64"),
    ],
)
def test_tables_agree_with_installed_kernel_headers(table, header):
    path = Path(header)
    if not path.exists():
        pytest.skip(f"{header} is not installed (linux-libc-dev)")
    numbers = _header_numbers(path)
    for name, number in table.items():
        assert numbers.get(name) == number, name
