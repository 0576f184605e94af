"""cgroup v2 device access: a tiny BPF assembler for BPF_PROG_TYPE_CGROUP_DEVICE and the bpf(2) calls.

The program is built from an allow-list the way runc and crun build theirs: load
``struct bpf_cgroup_dev_ctx {u32 access_type; u32 major; u32 minor;}`` (the low 16 bits of
access_type are the device type, the high 16 bits the access), then for each rule compare and
return 1 (allow); fall through to return 0 (deny, the open fails with EPERM).

Attaching uses BPF_F_ALLOW_MULTI, and BPF_F_REPLACE with the old program's fd so a new list
replaces the old one atomically (kernel 5.6+); programs already attached are found with
BPF_PROG_QUERY and BPF_PROG_GET_FD_BY_ID, so no state needs to survive an agent restart.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from nodeagent.cgroups.rules import DeviceRule, normalize
from nodeagent.errors import CgroupError, os_error_message
from nodeagent.libc import libc

# bpf(2) commands, program/attach types and flags from include/uapi/linux/bpf.h.
BPF_PROG_LOAD = 5
BPF_PROG_ATTACH = 8
BPF_PROG_DETACH = 9
BPF_PROG_GET_FD_BY_ID = 13
BPF_PROG_QUERY = 16
BPF_PROG_TYPE_CGROUP_DEVICE = 15
BPF_CGROUP_DEVICE = 6
BPF_F_ALLOW_MULTI = 1 << 1
BPF_F_REPLACE = 1 << 2

BPF_DEVCG_ACC_MKNOD, BPF_DEVCG_ACC_READ, BPF_DEVCG_ACC_WRITE = 1, 2, 4
BPF_DEVCG_DEV_BLOCK, BPF_DEVCG_DEV_CHAR = 1, 2

_SYSCALL_BPF = {"x86_64": 321, "aarch64": 280, "riscv64": 280, "ppc64le": 361, "s390x": 351}
_ATTR_SIZE = 128  # covers every field used here; the kernel zero-fills the rest
_LICENSE = b"Apache-2.0\0"  # device programs call no GPL-only helpers

# Instruction classes and operations (include/uapi/linux/bpf_common.h, bpf.h).
_LDX_MEM_W = 0x61
_ALU32_AND_K = 0x54
_ALU32_RSH_K = 0x74
_ALU32_MOV_K = 0xB4
_ALU32_MOV_X = 0xBC
_JMP_JNE_K = 0x55
_JMP_EXIT = 0x95

_ACCESS_BITS = {"m": BPF_DEVCG_ACC_MKNOD, "r": BPF_DEVCG_ACC_READ, "w": BPF_DEVCG_ACC_WRITE}
_TYPE_CODES = {"b": BPF_DEVCG_DEV_BLOCK, "c": BPF_DEVCG_DEV_CHAR}


def insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    """One ``struct bpf_insn`` (8 bytes, little-endian: code, dst|src<<4, off, imm)."""
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def _rule_block(rule: DeviceRule) -> list[bytes]:
    """Instructions that return 1 when the access matches ``rule``, else fall through past the block.

    Registers: R2 device type, R3 access bits, R4 major, R5 minor (loaded by the prologue).
    """
    checks: list[tuple[int, int, int, int]] = []  # (code, dst, imm, is_jump) before offsets are known
    if rule.type != "a":
        checks.append((_JMP_JNE_K, 2, _TYPE_CODES[rule.type], 1))
    allowed = sum(_ACCESS_BITS[c] for c in rule.access)
    if allowed != 7:
        checks += [(_ALU32_MOV_X, 1, 3, 0), (_ALU32_AND_K, 1, ~allowed & 0xFFFF, 0), (_JMP_JNE_K, 1, 0, 1)]
    if rule.major is not None:
        checks.append((_JMP_JNE_K, 4, _as_s32(rule.major), 1))
    if rule.minor is not None:
        checks.append((_JMP_JNE_K, 5, _as_s32(rule.minor), 1))
    block_len = len(checks) + 2
    out: list[bytes] = []
    for index, (code, dst, imm, is_jump) in enumerate(checks):
        if code == _ALU32_MOV_X:
            out.append(insn(code, dst=dst, src=imm))
        elif is_jump:
            out.append(insn(code, dst=dst, off=block_len - index - 1, imm=imm))
        else:
            out.append(insn(code, dst=dst, imm=imm))
    return [*out, insn(_ALU32_MOV_K, dst=0, imm=1), insn(_JMP_EXIT)]


def _as_s32(value: int) -> int:
    # The kernel compares the 32-bit immediate sign-extended against a zero-extended u32 load,
    # so numbers above 2^31 cannot be matched with a K comparison.
    if value >= 2**31:
        raise CgroupError(f"device number {value} is too large for a BPF device rule (limit 2^31-1)")
    return value


def _rule_order(rule: DeviceRule) -> tuple[str, int, int, str]:
    """A fixed order for the program's blocks (any match allows, so it only makes the text stable);
    a wildcard (None) sorts first: rules with and without one cannot be compared as tuples."""
    return (
        rule.type,
        -1 if rule.major is None else rule.major,
        -1 if rule.minor is None else rule.minor,
        rule.access,
    )


def assemble(rules: Iterable[DeviceRule]) -> bytes:
    """The program text (concatenated bpf_insn) that allows exactly ``rules`` and denies the rest."""
    prologue = [
        insn(_LDX_MEM_W, dst=2, src=1, off=0),  # access_type
        insn(_ALU32_AND_K, dst=2, imm=0xFFFF),  # -> type
        insn(_LDX_MEM_W, dst=3, src=1, off=0),
        insn(_ALU32_RSH_K, dst=3, imm=16),  # -> access
        insn(_LDX_MEM_W, dst=4, src=1, off=4),  # major
        insn(_LDX_MEM_W, dst=5, src=1, off=8),  # minor
    ]
    body = [part for rule in sorted(normalize(rules), key=_rule_order) for part in _rule_block(rule)]
    epilogue = [insn(_ALU32_MOV_K, dst=0, imm=0), insn(_JMP_EXIT)]
    return b"".join(prologue + body + epilogue)


class _Bpf:
    """The bpf(2) system call through ctypes."""

    def __init__(self) -> None:
        machine = platform.machine()
        if machine not in _SYSCALL_BPF:
            raise CgroupError(f"bpf(2) syscall number unknown for machine {machine!r}")
        self._nr = _SYSCALL_BPF[machine]
        self._libc = libc

    def call(self, cmd: int, attr: ctypes.Array[ctypes.c_char], action: str) -> int:
        result = int(self._libc.syscall(self._nr, cmd, attr, ctypes.c_uint(len(attr))))
        if result < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), action)
        return result


_bpf: _Bpf | None = None


def _sys() -> _Bpf:
    global _bpf  # noqa: PLW0603 - one lazily-made handle on libc
    if _bpf is None:
        _bpf = _Bpf()
    return _bpf


def _fail(action: str, err: OSError, log: str = "") -> CgroupError:
    message = os_error_message(action, err)
    if log:
        message += f"\nverifier log:\n{log.strip()}"
    return CgroupError(message, errno_=err.errno)


def load_program(program: bytes) -> int:
    """Load a device program; return its fd. On failure, reload with the verifier log for the error."""
    code = ctypes.create_string_buffer(program, len(program))
    license_buf = ctypes.create_string_buffer(_LICENSE, len(_LICENSE))

    def attempt(log_buf: ctypes.Array[ctypes.c_char] | None) -> int:
        attr = ctypes.create_string_buffer(_ATTR_SIZE)
        struct.pack_into(
            "<IIQQII", attr, 0, BPF_PROG_TYPE_CGROUP_DEVICE, len(program) // 8,
            ctypes.addressof(code), ctypes.addressof(license_buf),
            1 if log_buf is not None else 0, len(log_buf) if log_buf is not None else 0,
        )  # fmt: skip
        if log_buf is not None:
            struct.pack_into("<Q", attr, 32, ctypes.addressof(log_buf))
        struct.pack_into("<16s", attr, 48, b"nodeagent_dev")
        struct.pack_into("<I", attr, 68, BPF_CGROUP_DEVICE)  # expected_attach_type
        return _sys().call(BPF_PROG_LOAD, attr, "BPF_PROG_LOAD")

    try:
        return attempt(None)
    except OSError as err:
        log_buf = ctypes.create_string_buffer(1 << 16)
        try:
            return attempt(log_buf)
        except OSError:
            log = log_buf.value.decode(errors="replace")
        raise _fail("loading a cgroup device BPF program", err, log) from err


@contextmanager
def _cgroup_fd(cgroup_dir: Path) -> Iterator[int]:
    try:
        fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        raise _fail(f"opening cgroup {cgroup_dir} for BPF", err) from err
    try:
        yield fd
    finally:
        os.close(fd)


def query(cgroup_dir: Path) -> tuple[int, list[int]]:
    """(attach flags, ids of the device programs attached directly to ``cgroup_dir``)."""
    with _cgroup_fd(cgroup_dir) as cg_fd:
        return _query(cg_fd, cgroup_dir)


def _query(cg_fd: int, cgroup_dir: Path) -> tuple[int, list[int]]:
    ids = (ctypes.c_uint32 * 64)()
    attr = ctypes.create_string_buffer(_ATTR_SIZE)
    struct.pack_into("<IIIIQI", attr, 0, cg_fd, BPF_CGROUP_DEVICE, 0, 0, ctypes.addressof(ids), len(ids))
    try:
        _sys().call(BPF_PROG_QUERY, attr, "BPF_PROG_QUERY")
    except OSError as err:
        raise _fail(f"querying device programs on {cgroup_dir}", err) from err
    flags = struct.unpack_from("<I", attr, 12)[0]
    count = struct.unpack_from("<I", attr, 24)[0]
    return flags, list(ids[:count])


def _prog_fd(prog_id: int) -> int:
    attr = ctypes.create_string_buffer(_ATTR_SIZE)
    struct.pack_into("<I", attr, 0, prog_id)
    try:
        return _sys().call(BPF_PROG_GET_FD_BY_ID, attr, "BPF_PROG_GET_FD_BY_ID")
    except OSError as err:
        raise _fail(f"opening BPF program id {prog_id}", err) from err


def _attach(cg_fd: int, prog_fd: int, flags: int, replace_fd: int, cgroup_dir: Path) -> None:
    attr = ctypes.create_string_buffer(_ATTR_SIZE)
    struct.pack_into("<IIIII", attr, 0, cg_fd, prog_fd, BPF_CGROUP_DEVICE, flags, replace_fd)
    try:
        _sys().call(BPF_PROG_ATTACH, attr, "BPF_PROG_ATTACH")
    except OSError as err:
        raise _fail(f"attaching a device program to {cgroup_dir}", err) from err


def _detach(cg_fd: int, prog_fd: int, cgroup_dir: Path) -> None:
    attr = ctypes.create_string_buffer(_ATTR_SIZE)
    struct.pack_into("<III", attr, 0, cg_fd, prog_fd, BPF_CGROUP_DEVICE)
    try:
        _sys().call(BPF_PROG_DETACH, attr, "BPF_PROG_DETACH")
    except OSError as err:
        if err.errno != errno.ENOENT:
            raise _fail(f"detaching a device program from {cgroup_dir}", err) from err


def set_device_filter(cgroup_dir: Path, rules: Iterable[DeviceRule]) -> None:
    """Make ``rules`` the device allow-list of ``cgroup_dir``: attach, or replace atomically."""
    prog_fd = load_program(assemble(rules))
    try:
        with _cgroup_fd(cgroup_dir) as cg_fd:
            flags, ids = _query(cg_fd, cgroup_dir)
            if not ids:
                _attach(cg_fd, prog_fd, BPF_F_ALLOW_MULTI, 0, cgroup_dir)
            elif not flags & BPF_F_ALLOW_MULTI:
                # A program attached without flags is replaced by the next plain attach.
                _attach(cg_fd, prog_fd, 0, 0, cgroup_dir)
            else:
                _replace_multi(cg_fd, prog_fd, ids, cgroup_dir)
    finally:
        os.close(prog_fd)


def _replace_multi(cg_fd: int, prog_fd: int, ids: list[int], cgroup_dir: Path) -> None:
    first, *rest = ids
    old_fd = _prog_fd(first)
    try:
        _attach(cg_fd, prog_fd, BPF_F_ALLOW_MULTI | BPF_F_REPLACE, old_fd, cgroup_dir)
    finally:
        os.close(old_fd)
    # More than one program means someone attached extras; the slot's list is ours alone.
    for prog_id in rest:
        extra_fd = _prog_fd(prog_id)
        try:
            _detach(cg_fd, extra_fd, cgroup_dir)
        finally:
            os.close(extra_fd)


def clear_device_filter(cgroup_dir: Path) -> int:
    """Detach every device program from ``cgroup_dir``; return how many were detached."""
    with _cgroup_fd(cgroup_dir) as cg_fd:
        _, ids = _query(cg_fd, cgroup_dir)
        for prog_id in ids:
            prog_fd = _prog_fd(prog_id)
            try:
                _detach(cg_fd, prog_fd, cgroup_dir)
            finally:
                os.close(prog_fd)
    return len(ids)
