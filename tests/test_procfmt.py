"""nodeagent.procfmt: the procfs text formats, parsed in one place."""

from __future__ import annotations

from nodeagent.procfmt import (
    IRQ,
    STEAL,
    MountInfo,
    meminfo_bytes,
    parse_cpu_ticks,
    parse_meminfo,
    parse_mountinfo,
    parse_proc_cgroup,
)


def test_cpu_ticks_per_cpu_without_the_total() -> None:
    text = (
        "cpu  10 0 5 100 1 2 3 4 0 0\n"
        "cpu0 10 0 5 100 1 2 3 4 0 0\n"
        "cpu12 1 2 3\n"  # an older kernel prints fewer counters
        "intr 12345 0 0\n"
        "ctxt 99\n"
    )
    ticks = parse_cpu_ticks(text)
    assert sorted(ticks) == [0, 12]
    assert ticks[0][IRQ] == 2
    assert ticks[0][STEAL] == 4
    assert ticks[12] == (1, 2, 3)


def test_meminfo_host_and_node_files_give_the_same_keys() -> None:
    host = parse_meminfo("MemTotal:       16384 kB\nHugePages_Total:       0\n")
    node = parse_meminfo("Node 0 MemTotal:        8192 kB\nNode 0 MemFree: 1 kB\n")
    assert host == {"MemTotal": "16384 kB", "HugePages_Total": "0"}
    assert meminfo_bytes(host["MemTotal"]) == 16384 * 1024
    assert meminfo_bytes(node["MemTotal"]) == 8192 * 1024
    assert meminfo_bytes(host["HugePages_Total"]) is None  # a count, not a size
    assert meminfo_bytes(None) is None
    assert meminfo_bytes("lots kB") is None


def test_mountinfo_fields_and_escapes() -> None:
    text = (
        "25 20 0:22 / /mnt/my\\040cgroup rw,nosuid shared:9 - cgroup2 cgroup2 rw,nsdelegate\n"
        "26 25 0:23 /sub\\134dir /srv/data rw - ext4 /dev/sda1 rw\n"
        "27 25 0:24 / /srv/été ro - tmpfs tmpfs rw\n"
        "not a mountinfo line\n"
    )
    mounts = parse_mountinfo(text)
    assert mounts[0] == MountInfo("/", "/mnt/my cgroup", "rw,nosuid", "cgroup2", "cgroup2", "rw,nsdelegate")
    assert mounts[1].root == "/sub\\dir"
    assert mounts[2].mount_point == "/srv/été"  # the kernel escapes only space, tab, newline, backslash
    assert [m.fstype for m in mounts] == ["cgroup2", "ext4", "tmpfs"]


def test_proc_cgroup_lines() -> None:
    text = "12:cpu,cpuacct:/system.slice/x.service\n1:name=systemd:/a:b\n0::/\nbroken line\n"
    assert parse_proc_cgroup(text) == [
        ("12", "cpu,cpuacct", "/system.slice/x.service"),
        ("1", "name=systemd", "/a:b"),  # a colon in a cgroup's name stays in its path
        ("0", "", "/"),
    ]
