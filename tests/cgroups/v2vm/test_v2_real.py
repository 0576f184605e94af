"""The v2 manager on a real unified-only kernel: every controller the agent uses, for real."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterator

import pytest

from nodeagent.cgroups import (
    CgroupHost,
    CgroupLimits,
    CgroupManager,
    apply_device_rules,
    detect,
    open_manager,
)
from nodeagent.errors import Unsupported

from ..conftest import unique_name, wait_for
from ..test_v1_real import _open_results, _rule

MiB = 1 << 20


@pytest.fixture
def v2_host() -> CgroupHost:
    host = detect()
    if host.mode != "v2":
        pytest.skip(f"needs a pure cgroup v2 host; this one is {host.mode}")
    return host


@pytest.fixture
def group(v2_host: CgroupHost) -> Iterator[CgroupManager]:
    top = unique_name()
    manager = open_manager(v2_host, f"{top}/slot")
    try:
        manager.create()
        yield manager
    finally:
        top_manager = open_manager(v2_host, top)
        top_manager.kill(timeout=10)
        top_manager.delete(timeout=10)
        assert not top_manager.exists()


def read(group: CgroupManager, name: str) -> str:
    return (group.paths()["unified"] / name).read_text().strip()


def test_controllers_are_enabled_for_the_slot(group: CgroupManager) -> None:
    assert {"cpuset", "cpu", "memory", "pids"} <= set(read(group, "cgroup.controllers").split())


def test_cpu_and_cpuset_settings_take_effect(group: CgroupManager, spawn) -> None:
    group.set(CgroupLimits(cpuset_cpus=frozenset({0}), cpuset_mems=frozenset({0}), cpu_weight=300,
                        cpu_quota_us=10_000, cpu_period_us=100_000, cpu_idle=False))  # fmt: skip
    assert read(group, "cpu.max") == "10000 100000"
    assert read(group, "cpu.weight") == "300"
    spinner = spawn("while True: pass")
    group.add_pid(spinner.pid)
    spinner.release()
    assert os.sched_getaffinity(spinner.pid) == {0}
    assert wait_for(lambda: (group.stats().cpu_throttled_ns or 0) > 0, timeout=30)
    stats = group.stats()
    assert stats.cpu_usage_ns
    assert stats.cpu_throttled_periods
    assert stats.pids_current == 1


def test_memory_hog_is_oom_killed_and_reported_through_memory_events(group: CgroupManager, spawn) -> None:
    group.set(CgroupLimits(memory_max=64 * MiB, memory_swap_max=0))
    bystander = spawn("import time\ntime.sleep(60)")
    bystander.release()
    hog = spawn("chunks = []\nwhile True: chunks.append(bytearray(8 << 20))")
    group.add_pid(hog.pid)
    before = group.stats()  # the hog waits to be released: its run and its death come after this
    with group.oom_watcher() as watcher:
        hog.release()
        assert hog.proc.wait(timeout=60) == -9
        events = watcher.wait(timeout=10) or watcher.counts()
    assert events.oom_kill
    assert events.oom_kill >= 1
    assert group.oom_events().oom_kill >= 1
    # A scrape that carries what cannot move while a group is idle still sees the kill and the peak.
    since = group.stats(since=before)
    assert since.oom == group.oom_events()
    assert (since.memory_peak or 0) > 32 * MiB
    # The kernel may overshoot memory.max by one charge batch (64 pages) before it reclaims or kills.
    assert group.stats().memory_peak <= 64 * MiB + 64 * os.sysconf("SC_PAGE_SIZE")
    assert bystander.proc.poll() is None


def test_fork_bomb_stops_at_pids_max(group: CgroupManager, spawn) -> None:
    group.set(CgroupLimits(pids_max=10))
    bomb = spawn(
        "import os, time\nmade = 0\nwhile made < 100:\n    try:\n        pid = os.fork()\n"
        "    except BlockingIOError:\n        break\n    made += 1\n    if pid == 0:\n        made = 100\n"
        "time.sleep(60)\n"
    )
    group.add_pid(bomb.pid)
    bomb.release()
    assert wait_for(lambda: group.stats().pids_current == 10, timeout=30)
    group.kill(timeout=10)
    assert group.subtree_pids() == []


def test_io_weight(group: CgroupManager) -> None:
    try:
        group.set(CgroupLimits(io_weight=300))
    except Unsupported as err:
        pytest.skip(f"this kernel has no io weight interface: {err}")
    name = "io.weight" if (group.paths()["unified"] / "io.weight").exists() else "io.bfq.weight"
    assert "300" in read(group, name)


def test_freeze_thaw_and_cgroup_kill(group: CgroupManager, spawn) -> None:
    children = [spawn("import time\ntime.sleep(60)") for _ in range(3)]
    for child in children:
        group.add_pid(child.pid)
        child.release()
    group.freeze()
    assert "frozen 1" in read(group, "cgroup.events")
    group.thaw()
    start = time.monotonic()
    group.kill(timeout=10)
    assert [c.proc.wait(timeout=5) for c in children] == [-9, -9, -9]
    assert time.monotonic() - start < 10


def test_ebpf_device_filter(group: CgroupManager, spawn) -> None:
    apply_device_rules(group, [_rule("/dev/null")])
    child = spawn(_open_results(["/dev/null", "/dev/zero"]))
    group.add_pid(child.pid)
    child.release()
    assert child.finish()[1].split() == ["ok", str(errno.EPERM)]
