"""The cgroupfs gateway: paths stay under the root, errors quote file and value."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from nodeagent.cgroups import fs
from nodeagent.errors import CgroupError


@pytest.mark.parametrize(
    "relpath",
    [
        pytest.param("../etc/passwd", id="dotdot-first"),
        pytest.param("slot/../../x", id="dotdot-inside"),
        pytest.param("/etc/passwd", id="absolute"),
    ],
)
def test_write_outside_the_root_is_refused(tmp_path: Path, relpath: str) -> None:
    root = tmp_path / "cg"
    root.mkdir()
    with pytest.raises(CgroupError, match="refusing"):
        fs.write_file(root, relpath, "1")
    assert not (tmp_path / "x").exists()


def test_symlink_escape_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    outside = tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "slot").symlink_to(outside)
    with pytest.raises(CgroupError, match="outside the cgroup root") as caught:
        fs.write_file(root, "slot/memory.max", "1")
    assert caught.value.errno == errno.EXDEV
    assert not (outside / "memory.max").exists()


def test_write_error_quotes_value_and_file_and_keeps_errno(tmp_path: Path) -> None:
    with pytest.raises(CgroupError) as caught:
        fs.write_file(tmp_path, "missing/cpu.max", "50000 100000")
    assert caught.value.errno == errno.ENOENT
    assert "'50000 100000'" in str(caught.value)
    assert "missing/cpu.max" in str(caught.value)


def test_make_and_remove_dir_are_idempotent(tmp_path: Path) -> None:
    assert fs.make_dir(tmp_path, "a") is True
    assert fs.make_dir(tmp_path, "a") is False
    assert fs.remove_dir(tmp_path, "a") is True
    assert fs.remove_dir(tmp_path, "a") is False


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("max\n", None, id="max"),
        pytest.param("42\n", 42, id="number"),
    ],
)
def test_read_int(tmp_path: Path, text: str, expected: int | None) -> None:
    (tmp_path / "pids.max").write_text(text)
    assert fs.read_int(tmp_path, "pids.max") == expected


def test_read_keyed_and_pids(tmp_path: Path) -> None:
    (tmp_path / "memory.events").write_text("low 0\nhigh 3\nmax 7\noom 2\noom_kill 1\n")
    (tmp_path / "cgroup.procs").write_text("10\n11\n")
    assert fs.read_keyed(tmp_path, "memory.events")["oom_kill"] == 1
    assert fs.read_pids(tmp_path, "cgroup.procs") == [10, 11]
    assert fs.read_pids(tmp_path, "gone/cgroup.procs") == []


def test_join_skips_empty_parts() -> None:
    assert fs.join("", "cgroup.procs") == "cgroup.procs"
    assert fs.join("a/b/", "c") == "a/b/c"


MOUNTINFO = (
    "22 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
    "25 22 0:21 / /sys rw,nosuid shared:7 - sysfs sysfs rw\n"
    "26 25 0:22 / /sys/fs/cgroup ro,nosuid shared:8 - tmpfs tmpfs ro,mode=755\n"
    "27 26 0:23 / /sys/fs/cgroup/unified rw shared:9 - cgroup2 cgroup2 rw\n"
    "30 26 0:26 / /sys/fs/cgroup/cpu,cpuacct rw shared:12 - cgroup cgroup rw,cpu,cpuacct\n"
    "31 22 0:40 / /mnt/with\\040space rw - cgroup2 none rw\n"
)


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        pytest.param("/sys/fs/cgroup/unified", "cgroup2", id="v2-mount"),
        pytest.param("/sys/fs/cgroup/cpu,cpuacct/nodeagent.slice", "cgroup", id="inside-v1-mount"),
        pytest.param("/sys/fs/cgroup", "tmpfs", id="the-tmpfs-above-them"),
        pytest.param("/sys/fs/cgroupX", "sysfs", id="a-prefix-is-not-a-parent"),
        pytest.param("/tmp/fake-tree", "ext4", id="a-fake-tree"),
        pytest.param("/mnt/with space/x", "cgroup2", id="escaped-mount-point"),
    ],
)
def test_mount_fs_type_takes_the_innermost_mount(tmp_path: Path, path: str, expected: str) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(MOUNTINFO)
    assert fs.mount_fs_type(path, mountinfo) == expected


def test_the_real_cgroup_mount_skips_the_realpath_check_and_a_fake_tree_does_not(tmp_path: Path) -> None:
    assert fs.mount_fs_type(str(tmp_path)) not in ("cgroup", "cgroup2")
    assert fs._root_facts(str(tmp_path))[1] is False  # so a symlink in a fake tree is still refused


def test_a_checked_file_reads_afresh_and_none_once_gone(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    (root / "slot").mkdir(parents=True)
    (root / "slot" / "cpuacct.usage").write_text("12\n")
    file = fs.resolve_file(root, "slot/cpuacct.usage")
    assert fs.read_checked(file) == "12\n"
    (root / "slot" / "cpuacct.usage").write_text("34\n")
    assert fs.read_checked(file) == "34\n"
    (root / "slot" / "cpuacct.usage").unlink()
    assert fs.read_checked(file) is None
    with pytest.raises(CgroupError, match="refusing"):
        fs.resolve_file(root, "../outside")


def test_a_checked_small_file_takes_one_read_and_a_long_one_is_read_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "cg"
    (root / "slot").mkdir(parents=True)
    (root / "slot" / "cpu.stat").write_text("nr_periods 3\n")
    long_text = "x" * (3 * fs.SMALL_FILE_BYTES + 5)
    (root / "slot" / "memory.stat").write_text(long_text)
    reads: list[int] = []
    real_read = os.read

    def counted(fd: int, n: int) -> bytes:
        reads.append(n)
        return real_read(fd, n)

    small, long = fs.resolve_file(root, "slot/cpu.stat"), fs.resolve_file(root, "slot/memory.stat")
    monkeypatch.setattr(fs.os, "read", counted)
    assert fs.read_checked(small) == "nr_periods 3\n"
    assert len(reads) == 1  # a short first read was the whole file: no read to see the end
    assert fs.read_checked(long) == long_text
