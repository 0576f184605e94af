"""The device-filter assembler (pure) and the eBPF program on the real cgroup2 mount (root)."""

from __future__ import annotations

import errno
import struct

import pytest

from nodeagent.cgroups import CgroupManager, DeviceRule, apply_device_rules, bpf
from nodeagent.errors import CgroupError

from .test_v1_real import _open_results, _rule


def decode(program: bytes) -> list[tuple[int, int, int, int, int]]:
    out = []
    for i in range(0, len(program), 8):
        code, regs, off, imm = struct.unpack_from("<BBhi", program, i)
        out.append((code, regs & 0xF, regs >> 4, off, imm))
    return out


def run(program: bytes, dev_type: int, access: int, major: int, minor: int) -> int:
    """A tiny interpreter for exactly the instructions the assembler emits."""
    regs = [0] * 11
    ctx = (access << 16 | dev_type, major, minor)
    insns = decode(program)
    pc = 0
    while True:
        code, dst, src, off, imm = insns[pc]
        pc += 1
        if code == 0x61:
            regs[dst] = ctx[off // 4]
        elif code == 0x54:
            regs[dst] &= imm & 0xFFFFFFFF
        elif code == 0x74:
            regs[dst] >>= imm
        elif code == 0xB4:
            regs[dst] = imm
        elif code == 0xBC:
            regs[dst] = regs[src]
        elif code == 0x55:
            if regs[dst] != imm:
                pc += off
        elif code == 0x95:
            return regs[0]
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")


CHAR, BLOCK = bpf.BPF_DEVCG_DEV_CHAR, bpf.BPF_DEVCG_DEV_BLOCK
R, W, M = bpf.BPF_DEVCG_ACC_READ, bpf.BPF_DEVCG_ACC_WRITE, bpf.BPF_DEVCG_ACC_MKNOD


@pytest.mark.parametrize(
    ("rules", "request_", "allowed"),
    [
        pytest.param([], (CHAR, R, 1, 3), 0, id="empty-list-denies"),
        pytest.param([DeviceRule("c", 1, 3, "rw")], (CHAR, R, 1, 3), 1, id="exact-read"),
        pytest.param([DeviceRule("c", 1, 3, "rw")], (CHAR, R | W, 1, 3), 1, id="exact-read-write"),
        pytest.param([DeviceRule("c", 1, 3, "rw")], (CHAR, M, 1, 3), 0, id="mknod-not-granted"),
        pytest.param([DeviceRule("c", 1, 3, "rw")], (CHAR, R, 1, 5), 0, id="other-minor"),
        pytest.param([DeviceRule("c", 1, 3, "rw")], (BLOCK, R, 1, 3), 0, id="block-vs-char"),
        pytest.param([DeviceRule("c", 7, None, "r")], (CHAR, R, 7, 42), 1, id="any-minor"),
        pytest.param([DeviceRule("c", None, None, "m")], (CHAR, M, 9, 9), 1, id="mknod-any-char"),
        pytest.param([DeviceRule("a", None, None, "rwm")], (BLOCK, W, 8, 0), 1, id="allow-all"),
        pytest.param(
            [DeviceRule("b", 7, 0, "r"), DeviceRule("c", 1, 5, "rwm")], (CHAR, W, 1, 5), 1, id="second-rule"
        ),
    ],
)
def test_assembled_program_decides_like_the_rules(
    rules: list[DeviceRule], request_: tuple[int, int, int, int], allowed: int
) -> None:
    dev_type, access, major, minor = request_
    assert run(bpf.assemble(rules), dev_type, access, major, minor) == allowed


def test_program_is_prologue_rules_and_default_deny() -> None:
    program = decode(bpf.assemble([DeviceRule("c", 1, 3, "rwm")]))
    assert len(program) == 6 + 5 + 2  # prologue, (type, major, minor, mov, exit), deny
    assert program[-2:] == [(0xB4, 0, 0, 0, 0), (0x95, 0, 0, 0, 0)]


def test_wildcards_and_numbers_together_assemble_and_decide() -> None:
    # A container slot's list: mknod of any node beside numbered ones (a wildcard cannot be
    # compared with a number, so the blocks are ordered by a key, not by the rules themselves).
    rules = [
        DeviceRule("c", 1, 3, "rwm"),
        DeviceRule("c", None, None, "m"),
        DeviceRule("b", None, None, "m"),
        DeviceRule("c", 136, None, "rw"),
        DeviceRule("c", 5, 1, "rw"),
    ]
    program = bpf.assemble(rules)
    assert program == bpf.assemble(reversed(rules))
    assert run(program, BLOCK, M, 7, 0) == 1
    assert run(program, BLOCK, R, 7, 0) == 0
    assert run(program, CHAR, R | W, 136, 4) == 1
    assert run(program, CHAR, R, 5, 1) == 1
    assert run(program, CHAR, R, 5, 2) == 0


def test_device_numbers_beyond_s32_are_refused() -> None:
    with pytest.raises(CgroupError, match="too large"):
        bpf.assemble([DeviceRule("c", 2**31, 0)])


@pytest.mark.root
def test_ebpf_filter_allows_listed_devices_replaces_atomically_and_detaches(
    unified_group: CgroupManager, spawn
) -> None:
    unified_group.create()
    cgroup_dir = unified_group.paths()["unified"]
    apply_device_rules(unified_group, [_rule("/dev/null")])
    flags, first_ids = bpf.query(cgroup_dir)
    assert flags & bpf.BPF_F_ALLOW_MULTI
    assert len(first_ids) == 1

    probe = ["/dev/null", "/dev/zero", "/dev/loop-control"]
    child = spawn(_open_results(probe))
    unified_group.add_pid(child.pid)
    child.release()
    assert child.finish()[1].split() == ["ok", str(errno.EPERM), str(errno.EPERM)]

    apply_device_rules(unified_group, [_rule("/dev/null"), _rule("/dev/zero", "r")])
    _, second_ids = bpf.query(cgroup_dir)
    assert len(second_ids) == 1
    assert second_ids != first_ids
    child = spawn(_open_results(probe))
    unified_group.add_pid(child.pid)
    child.release()
    assert child.finish()[1].split() == ["ok", "ok", str(errno.EPERM)]

    assert bpf.clear_device_filter(cgroup_dir) == 1
    assert bpf.query(cgroup_dir) == (0, [])
    child = spawn(_open_results(probe))
    unified_group.add_pid(child.pid)
    child.release()
    assert child.finish()[1].split() == ["ok", "ok", "ok"]


@pytest.mark.root
def test_unified_group_freezes_and_is_emptied_by_cgroup_kill(unified_group: CgroupManager, spawn) -> None:
    unified_group.create()
    sleepers = [spawn("import time\ntime.sleep(60)") for _ in range(3)]
    for child in sleepers:
        unified_group.add_pid(child.pid)
        child.release()
    unified_group.freeze()
    unified_group.thaw()
    unified_group.kill(timeout=5)
    assert [child.proc.wait(timeout=5) for child in sleepers] == [-9, -9, -9]
    apply_device_rules(unified_group, [_rule("/dev/null")])
    unified_group.delete()  # detaches the program, then removes the group
    assert not unified_group.exists()


@pytest.mark.root
def test_verifier_log_is_in_the_error() -> None:
    bad = bpf.insn(0xB4, dst=0, imm=1)  # no exit: the verifier must refuse it
    with pytest.raises(CgroupError) as caught:
        bpf.load_program(bad)
    assert "verifier log" in str(caught.value)
