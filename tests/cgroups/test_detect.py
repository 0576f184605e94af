"""Detection of the cgroup mode from fake /proc trees (and this host's, on the real kernel)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nodeagent.cgroups import detect
from nodeagent.cgroups.detect import parse_mountinfo, parse_own_v2_cgroup
from tests.trees import write_tree

HYBRID_MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
36 31 0:33 / /sys/fs/cgroup/devices rw,relatime - cgroup cgroup rw,devices
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
38 31 0:35 / /sys/fs/cgroup/blkio rw,relatime - cgroup cgroup rw,blkio
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
V1_COMOUNTED = """\
25 20 0:22 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct
26 20 0:23 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory
27 20 0:24 / /sys/fs/cgroup/net_cls rw - cgroup cgroup rw,net_cls
"""
V2_ONLY = "36 23 0:33 / /sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw,nsdelegate\n"
PROC_CGROUPS = """\
#subsys_name\thierarchy\tnum_cgroups\tenabled
cpuset\t3\t1\t1
cpu\t1\t1\t1
cpuacct\t2\t1\t1
blkio\t7\t1\t1
memory\t4\t24\t1
devices\t5\t1\t1
freezer\t6\t1\t1
pids\t8\t1\t1
"""


@pytest.mark.parametrize(
    ("mountinfo", "extra", "mode", "controllers"),
    [
        pytest.param(
            HYBRID_MOUNTINFO,
            {"sys/fs/cgroup/unified/cgroup.controllers": "\n"},
            "hybrid",
            {"cpuset", "cpu", "cpuacct", "memory", "devices", "freezer", "blkio", "pids"},
            id="hybrid",
        ),
        pytest.param(V1_COMOUNTED, {}, "v1", {"cpu", "cpuacct", "memory"}, id="v1-comounted"),
        pytest.param(
            V2_ONLY,
            {"sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory hugetlb pids\n"},
            "v2",
            {"cpuset", "cpu", "io", "memory", "hugetlb", "pids"},
            id="v2",
        ),
        pytest.param("", {}, "none", set(), id="none"),
    ],
)
def test_detect_mode_and_controllers(
    tmp_path: Path, mountinfo: str, extra: dict[str, str], mode: str, controllers: set[str]
) -> None:
    write_tree(
        tmp_path,
        {
            "proc/self/mountinfo": mountinfo,
            "proc/cgroups": PROC_CGROUPS,
            "proc/self/cgroup": "0::/\n",
            **extra,
        },
    )
    host = detect(proc_root=tmp_path / "proc", fs_root=tmp_path)
    assert host.mode == mode
    assert host.controllers == controllers


def test_comounted_controllers_share_one_hierarchy(tmp_path: Path) -> None:
    write_tree(tmp_path, {"proc/self/mountinfo": V1_COMOUNTED, "proc/cgroups": PROC_CGROUPS})
    host = detect(proc_root=tmp_path / "proc", fs_root=tmp_path)
    assert host.v1_mounts["cpu"] == host.v1_mounts["cpuacct"] == tmp_path / "sys/fs/cgroup/cpu,cpuacct"


def test_disabled_controller_is_not_usable(tmp_path: Path) -> None:
    proc_cgroups = PROC_CGROUPS.replace("memory\t4\t24\t1", "memory\t4\t24\t0")
    write_tree(tmp_path, {"proc/self/mountinfo": HYBRID_MOUNTINFO, "proc/cgroups": proc_cgroups})
    assert "memory" not in detect(proc_root=tmp_path / "proc", fs_root=tmp_path).controllers


def test_mount_points_with_escapes_are_decoded() -> None:
    mounts = parse_mountinfo("25 20 0:22 / /mnt/my\\040cgroup rw - cgroup2 cgroup2 rw\n")
    assert mounts[0].mount_point == "/mnt/my cgroup"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("0::/user.slice/app\n", "/user.slice/app", id="v2-line"),
        pytest.param("4:memory:/x\n0::/\n", "/", id="hybrid-root"),
        pytest.param("4:memory:/x\n", None, id="v1-only"),
    ],
)
def test_own_v2_cgroup(text: str, expected: str | None) -> None:
    assert parse_own_v2_cgroup(text) == expected


def test_delegated_subtree_is_detected_when_we_own_our_cgroup(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        {
            "proc/self/mountinfo": V2_ONLY,
            "proc/self/cgroup": "0::/user.slice/app.service\n",
            "sys/fs/cgroup/cgroup.controllers": "cpu memory pids\n",
            "sys/fs/cgroup/user.slice/app.service/cgroup.procs": "",
        },
    )
    (tmp_path / "sys/fs/cgroup").chmod(0o555)  # the root is not ours to write
    try:
        host = detect(proc_root=tmp_path / "proc", fs_root=tmp_path)
    finally:
        (tmp_path / "sys/fs/cgroup").chmod(0o755)
    assert host.own_v2_cgroup == "/user.slice/app.service"
    # As root, access checks pass everywhere, so the mount itself counts as writable.
    assert host.can_write
    assert host.delegated == (not _is_root())


def _is_root() -> bool:
    import os

    return os.geteuid() == 0
