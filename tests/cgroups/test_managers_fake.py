"""The v1 and v2 managers on fake cgroupfs trees: which files they write, what they read back."""

from __future__ import annotations

from pathlib import Path

import pytest

from nodeagent.cgroups import UNLIMITED, CgroupHost, CgroupLimits, DeviceRule, open_manager
from nodeagent.cgroups.resources import shares_to_weight, weight_to_shares
from nodeagent.errors import CgroupError, InvalidRequest, Unsupported
from tests.trees import write_tree

V1_CONTROLLERS = ("cpuset", "cpu", "cpuacct", "memory", "pids", "devices", "freezer", "blkio")
SLOT = "nodeagent.slice/burstable/web"
# Files the kernel creates with every group; writes never create files, so fakes must have them.
V1_WRITABLE = [
    f"cpu/{SLOT}/cpu.shares",
    f"cpu/{SLOT}/cpu.cfs_quota_us",
    f"cpu/{SLOT}/cpu.cfs_period_us",
    f"memory/{SLOT}/memory.soft_limit_in_bytes",
    f"pids/{SLOT}/pids.max",
    f"devices/{SLOT}/devices.allow",
    f"devices/{SLOT}/devices.deny",
]
V2_WRITABLE = [
    "cpu.weight",
    "cpuset.cpus",
    "cpuset.mems",
    "memory.max",
    "memory.high",
    "memory.swap.max",
    "pids.max",
]


def v1_tree(tmp_path: Path, extra: dict[str, str] | None = None) -> CgroupHost:
    files = {
        "cpuset/cpuset.cpus": "0-3\n",
        "cpuset/cpuset.mems": "0\n",
        f"cpuset/{SLOT}/cpuset.cpus": "",
        f"cpuset/{SLOT}/cpuset.mems": "",
        "cpuset/nodeagent.slice/cpuset.cpus": "0-3\n",
        "cpuset/nodeagent.slice/cpuset.mems": "0\n",
        "cpuset/nodeagent.slice/burstable/cpuset.cpus": "",
        "cpuset/nodeagent.slice/burstable/cpuset.mems": "",
        f"memory/{SLOT}/memory.limit_in_bytes": "9223372036854771712\n",
        f"memory/{SLOT}/memory.memsw.limit_in_bytes": "9223372036854771712\n",
        f"memory/{SLOT}/memory.usage_in_bytes": "4096\n",
        f"memory/{SLOT}/memory.max_usage_in_bytes": "8192\n",
        f"memory/{SLOT}/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n",
        f"cpu/{SLOT}/cpu.stat": "nr_periods 10\nnr_throttled 4\nthrottled_time 5000\n",
        f"cpuacct/{SLOT}/cpuacct.usage": "123456\n",
        f"pids/{SLOT}/pids.current": "2\n",
        f"blkio/{SLOT}/blkio.bfq.weight": "100\n",
        f"devices/{SLOT}/devices.list": "a *:* rwm\n",
        **{f"{rel}": "" for rel in V1_WRITABLE},
        **(extra or {}),
    }
    write_tree(tmp_path, files)
    for controller in V1_CONTROLLERS:
        (tmp_path / controller / SLOT).mkdir(parents=True, exist_ok=True)
    return CgroupHost(mode="v1", v1_mounts={c: tmp_path / c for c in V1_CONTROLLERS})


def read(tmp_path: Path, rel: str) -> str:
    return (tmp_path / rel).read_text().strip()


def test_v1_create_fills_empty_cpusets_from_the_parent(tmp_path: Path) -> None:
    manager = open_manager(v1_tree(tmp_path), SLOT)
    manager.create()
    assert read(tmp_path, f"cpuset/{SLOT}/cpuset.cpus") == "0-3"
    assert read(tmp_path, "cpuset/nodeagent.slice/burstable/cpuset.mems") == "0"


def test_v1_create_with_cpus_never_shows_the_parents(tmp_path: Path) -> None:
    # An exclusive slot is made with its own CPUs: copying the parent's first would leave, for a
    # moment a crash could freeze, a slot that seems to hold every CPU of the pool.
    manager = open_manager(v1_tree(tmp_path), SLOT)
    manager.create(frozenset({2}))
    assert read(tmp_path, f"cpuset/{SLOT}/cpuset.cpus") == "2"
    assert read(tmp_path, f"cpuset/{SLOT}/cpuset.mems") == "0"
    assert read(tmp_path, "cpuset/nodeagent.slice/burstable/cpuset.cpus") == "0-3"


@pytest.mark.parametrize(
    ("resources", "expected"),
    [
        pytest.param(
            CgroupLimits(cpuset_cpus=frozenset({0, 1, 2, 5})), {"cpuset/cpuset.cpus": "0-2,5"}, id="cpuset"
        ),
        pytest.param(CgroupLimits(cpu_weight=100), {"cpu/cpu.shares": "1024"}, id="weight-default"),
        pytest.param(CgroupLimits(cpu_weight=1), {"cpu/cpu.shares": "10"}, id="weight-min"),
        pytest.param(
            CgroupLimits(cpu_quota_us=20000, cpu_period_us=100000),
            {"cpu/cpu.cfs_quota_us": "20000", "cpu/cpu.cfs_period_us": "100000"},
            id="quota",
        ),
        pytest.param(CgroupLimits(cpu_quota_us=UNLIMITED), {"cpu/cpu.cfs_quota_us": "-1"}, id="no-quota"),
        pytest.param(CgroupLimits(cpu_idle=True), {"cpu/cpu.idle": "1"}, id="idle"),
        pytest.param(
            CgroupLimits(memory_max=1 << 30, memory_swap_max=0),
            {
                "memory/memory.limit_in_bytes": str(1 << 30),
                "memory/memory.memsw.limit_in_bytes": str(1 << 30),
            },
            id="memory-no-swap",
        ),
        pytest.param(
            CgroupLimits(memory_high=1 << 29), {"memory/memory.soft_limit_in_bytes": str(1 << 29)}, id="high"
        ),
        pytest.param(CgroupLimits(pids_max=UNLIMITED), {"pids/pids.max": "max"}, id="pids-unlimited"),
        pytest.param(
            CgroupLimits(io_weight=5000), {"blkio/blkio.bfq.weight": "1000"}, id="io-weight-clamped"
        ),
    ],
)
def test_v1_set_writes_the_v1_files(
    tmp_path: Path, resources: CgroupLimits, expected: dict[str, str]
) -> None:
    host = v1_tree(tmp_path, {f"cpu/{SLOT}/cpu.idle": "0\n"})
    open_manager(host, SLOT).set(resources)
    for rel, value in expected.items():
        controller, name = rel.split("/")
        assert read(tmp_path, f"{controller}/{SLOT}/{name}") == value


def test_v1_swap_without_swap_accounting_is_unsupported(tmp_path: Path) -> None:
    host = v1_tree(tmp_path)
    (tmp_path / "memory" / SLOT / "memory.memsw.limit_in_bytes").unlink()
    with pytest.raises(Unsupported, match="swapaccount"):
        open_manager(host, SLOT).set(CgroupLimits(memory_max=1 << 30, memory_swap_max=0))


def test_v1_stats_read_every_hierarchy(tmp_path: Path) -> None:
    stats = open_manager(v1_tree(tmp_path), SLOT).stats()
    assert (stats.cpu_usage_ns, stats.cpu_periods, stats.cpu_throttled_periods, stats.cpu_throttled_ns) == (
        123456, 10, 4, 5000,
    )  # fmt: skip
    assert (stats.memory_current, stats.memory_peak, stats.pids_current) == (4096, 8192, 2)
    assert stats.oom.oom_kill == 3


def test_v1_stats_without_pids_leave_pids_current_unread(tmp_path: Path) -> None:
    host = v1_tree(tmp_path)
    (tmp_path / "pids" / SLOT / "pids.current").write_text("unreadable\n")  # a read would raise
    stats = open_manager(host, SLOT).stats(pids=False)
    assert (stats.cpu_usage_ns, stats.memory_current, stats.pids_current) == (123456, 4096, None)


def test_v1_device_rules_that_do_not_read_back_are_an_error(tmp_path: Path) -> None:
    # A fake devices.list does not change when written to: the read-back check must notice.
    manager = open_manager(v1_tree(tmp_path), SLOT)
    with pytest.raises(CgroupError, match="did not take"):
        manager.set_devices([DeviceRule("c", 1, 3)])
    assert read(tmp_path, f"devices/{SLOT}/devices.allow") == "c 1:3 rwm"


def test_v1_procs_files_one_per_hierarchy(tmp_path: Path) -> None:
    files = open_manager(v1_tree(tmp_path), SLOT).procs_files()
    assert [f.parent.parent.parent.parent.name for f in files] == sorted(V1_CONTROLLERS)


@pytest.mark.parametrize("relpath", ["", "/", "../x", "a/../../b"], ids=repr)
def test_manager_refuses_the_root_and_escapes(tmp_path: Path, relpath: str) -> None:
    with pytest.raises(CgroupError):
        open_manager(v1_tree(tmp_path), relpath)


def v2_tree(tmp_path: Path, extra: dict[str, str] | None = None) -> CgroupHost:
    files = {
        "cgroup.controllers": "cpuset cpu io memory hugetlb pids\n",
        "cgroup.subtree_control": "memory\n",
        "nodeagent.slice/cgroup.controllers": "cpuset cpu io memory pids\n",
        "nodeagent.slice/cgroup.subtree_control": "",
        "nodeagent.slice/burstable/cgroup.controllers": "cpuset cpu io memory pids\n",
        "nodeagent.slice/burstable/cgroup.subtree_control": "",
        f"{SLOT}/cpu.max": "max 100000\n",
        f"{SLOT}/cpu.stat": "usage_usec 7\nuser_usec 5\nsystem_usec 2\nnr_periods 3\nnr_throttled 1\n"
        "throttled_usec 9\n",
        f"{SLOT}/memory.current": "4096\n",
        f"{SLOT}/memory.peak": "8192\n",
        f"{SLOT}/memory.events": "low 0\nhigh 0\nmax 5\noom 2\noom_kill 1\n",
        f"{SLOT}/pids.current": "3\n",
        f"{SLOT}/io.weight": "default 100\n",
        **{f"{SLOT}/{name}": "" for name in V2_WRITABLE},
        **(extra or {}),
    }
    write_tree(tmp_path, files)
    return CgroupHost(mode="v2", v2_mount=tmp_path, controllers=frozenset({"cpu", "memory"}))


def test_v2_create_enables_missing_controllers_top_down(tmp_path: Path) -> None:
    # A real cgroupfs would replace subtree_control's content; the fake keeps the last write.
    open_manager(v2_tree(tmp_path), SLOT).create()
    assert read(tmp_path, "cgroup.subtree_control") == "+pids"  # cpu, cpuset, io, then pids; memory was on
    assert read(tmp_path, "nodeagent.slice/cgroup.subtree_control") == "+pids"
    assert read(tmp_path, "nodeagent.slice/burstable/cgroup.subtree_control") == "+pids"


def test_v2_create_does_not_touch_levels_above_a_delegated_subtree(tmp_path: Path) -> None:
    host = v2_tree(tmp_path)
    delegated = CgroupHost(mode="v2", v2_mount=tmp_path, own_v2_cgroup="/nodeagent.slice", delegated=True)
    open_manager(delegated, SLOT).create()
    assert read(tmp_path, "cgroup.subtree_control") == "memory"
    assert host.v2_mount == tmp_path


@pytest.mark.parametrize(
    ("resources", "expected"),
    [
        pytest.param(CgroupLimits(cpu_weight=250), {"cpu.weight": "250"}, id="weight"),
        pytest.param(CgroupLimits(cpu_quota_us=50000), {"cpu.max": "50000 100000"}, id="quota-keeps-period"),
        pytest.param(CgroupLimits(cpu_period_us=20000), {"cpu.max": "max 20000"}, id="period-keeps-quota"),
        pytest.param(
            CgroupLimits(cpu_quota_us=UNLIMITED, cpu_period_us=10000), {"cpu.max": "max 10000"}, id="max"
        ),
        pytest.param(CgroupLimits(cpuset_mems=frozenset({0, 1})), {"cpuset.mems": "0-1"}, id="mems"),
        pytest.param(
            CgroupLimits(memory_max=1 << 30, memory_high=1 << 29, memory_swap_max=0),
            {"memory.max": str(1 << 30), "memory.high": str(1 << 29), "memory.swap.max": "0"},
            id="memory",
        ),
        pytest.param(CgroupLimits(memory_max=UNLIMITED), {"memory.max": "max"}, id="memory-unlimited"),
        pytest.param(CgroupLimits(pids_max=100), {"pids.max": "100"}, id="pids"),
        pytest.param(CgroupLimits(io_weight=500), {"io.weight": "default 500"}, id="io-weight"),
    ],
)
def test_v2_set_writes_the_unified_files(
    tmp_path: Path, resources: CgroupLimits, expected: dict[str, str]
) -> None:
    open_manager(v2_tree(tmp_path), SLOT).set(resources)
    for name, value in expected.items():
        assert read(tmp_path, f"{SLOT}/{name}") == value


def test_v2_missing_cpu_idle_is_unsupported(tmp_path: Path) -> None:
    with pytest.raises(Unsupported, match=r"cpu\.idle"):
        open_manager(v2_tree(tmp_path), SLOT).set(CgroupLimits(cpu_idle=True))


def test_v2_stats_and_oom_events(tmp_path: Path) -> None:
    manager = open_manager(v2_tree(tmp_path), SLOT)
    stats = manager.stats()
    assert (stats.cpu_usage_ns, stats.cpu_periods, stats.cpu_throttled_periods, stats.cpu_throttled_ns) == (
        7000, 3, 1, 9000,
    )  # fmt: skip
    assert (stats.memory_current, stats.memory_peak, stats.pids_current) == (4096, 8192, 3)
    assert (stats.oom.oom, stats.oom.oom_kill) == (2, 1)
    (tmp_path / SLOT / "pids.current").write_text("unreadable\n")  # a read would raise
    stats = manager.stats(pids=False)
    assert (stats.cpu_usage_ns, stats.memory_current, stats.pids_current) == (7000, 4096, None)


# Where each tree keeps a group's CPU time, memory in use, peak, and the figures that only move
# while the group runs (throttling and OOM counts), with the content each takes later.
_SINCE_FILES = {
    "v1": {
        "usage": (f"cpuacct/{SLOT}/cpuacct.usage", "223456\n"),
        "current": (f"memory/{SLOT}/memory.usage_in_bytes", "16384\n"),
        "peak": (f"memory/{SLOT}/memory.max_usage_in_bytes", "16384\n"),
        "quiet": {
            f"cpu/{SLOT}/cpu.stat": "nr_periods 99\nnr_throttled 98\nthrottled_time 97\n",
            f"memory/{SLOT}/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 77\n",
        },
    },
    "v2": {
        # v2 keeps throttling beside the CPU time, in the one file always read.
        "usage": (f"{SLOT}/cpu.stat", "usage_usec 9\nnr_periods 99\nnr_throttled 98\nthrottled_usec 97\n"),
        "current": (f"{SLOT}/memory.current", "16384\n"),
        "peak": (f"{SLOT}/memory.peak", "16384\n"),
        "quiet": {f"{SLOT}/memory.events": "oom 78\noom_kill 77\n"},
    },
}


@pytest.mark.parametrize("mode", ["v1", "v2"])
def test_stats_since_a_snapshot_read_only_what_can_have_moved(tmp_path: Path, mode: str) -> None:
    files = _SINCE_FILES[mode]
    manager = open_manager((v1_tree if mode == "v1" else v2_tree)(tmp_path), SLOT)
    first = manager.stats(pids=False)
    assert first.memory_peak == 8192
    assert first.oom.oom_kill in (1, 3)
    for rel, later in files["quiet"].items():
        (tmp_path / rel).write_text(later)
    peak_file, peak_later = files["peak"]
    (tmp_path / peak_file).write_text(peak_later)

    # No CPU used since: only the CPU time and the memory in use are read; the rest is carried.
    assert manager.stats(pids=False, since=first) == first

    # Memory in use above the old peak: the peak is read again, and nothing else.
    current_file, current_later = files["current"]
    (tmp_path / current_file).write_text(current_later)
    grown = manager.stats(pids=False, since=first)
    assert (grown.memory_current, grown.memory_peak) == (16384, 16384)
    assert grown.oom == first.oom

    # CPU used: everything is read again.
    usage_file, usage_later = files["usage"]
    (tmp_path / usage_file).write_text(usage_later)
    ran = manager.stats(pids=False, since=first)
    assert (ran.cpu_periods, ran.cpu_throttled_periods, ran.oom.oom_kill) == (99, 98, 77)
    assert ran.cpu_usage_ns != first.cpu_usage_ns


def test_v2_oom_watcher_reads_counts(tmp_path: Path) -> None:
    with open_manager(v2_tree(tmp_path), SLOT).oom_watcher() as watcher:
        assert watcher.counts().oom_kill == 1
        (tmp_path / SLOT / "memory.events").write_text("oom 3\noom_kill 2\n")
        assert watcher.counts().oom_kill == 2


@pytest.mark.parametrize(
    ("weight", "shares"), [(1, 10), (100, 1024), (200, 2048), (10000, 102400)], ids=lambda v: str(v)
)
def test_weight_shares_mapping_keeps_defaults_aligned(weight: int, shares: int) -> None:
    assert weight_to_shares(weight) == shares
    assert shares_to_weight(shares) == weight


@pytest.mark.parametrize(
    "kwargs",
    [{"cpu_weight": 0}, {"cpu_weight": 10001}, {"memory_max": -5}, {"cpu_quota_us": 10}, {"io_weight": 0}],
    ids=lambda k: next(iter(k)),
)
def test_resources_are_validated(kwargs: dict[str, int]) -> None:
    with pytest.raises(InvalidRequest):
        CgroupLimits(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("shares", "weight"),
    [(2, 1), (512, 50), (1024, 100), (10240, 1000), (262_144, 10_000)],
    ids=["min", "half", "default", "ten-cpus", "max"],
)
def test_shares_to_weight_keeps_default_to_default_within_the_kernel_ranges(shares: int, weight: int) -> None:
    assert shares_to_weight(shares) == weight
