"""The v1 manager on the real kernel (root): limits that bite, OOM kills, fork bombs, device rules."""

from __future__ import annotations

import errno
import os
import time

import pytest

from nodeagent.cgroups import (
    CgroupHost,
    CgroupLimits,
    CgroupManager,
    DeviceRule,
    Hierarchy,
    apply_device_rules,
    detect,
    ensure_parents,
    list_owned,
    open_manager,
    remove_subtree,
)
from nodeagent.errors import CgroupError

from .conftest import unique_name, wait_for

pytestmark = pytest.mark.root

MiB = 1 << 20


@pytest.mark.kernel
def test_this_host_is_detected_as_hybrid() -> None:
    host = detect()
    if host.mode != "hybrid":
        pytest.skip(f"this test describes the hybrid CI host; here the mode is {host.mode}")
    assert {"cpuset", "cpu", "cpuacct", "memory", "devices", "freezer", "blkio", "pids"} <= host.controllers
    assert host.v2_mount is not None
    assert host.v2_mount.name == "unified"
    assert host.can_write


def test_an_empty_cpuset_is_really_emptied(v1_group: CgroupManager) -> None:
    # "" is a zero-length write that the kernel never sees: the old CPUs would silently stay.
    v1_group.create()
    v1_group.set(CgroupLimits(cpuset_cpus=frozenset({0})))
    v1_group.set(CgroupLimits(cpuset_cpus=frozenset()))
    assert (v1_group.paths()["cpuset"] / "cpuset.cpus").read_text().strip() == ""


def test_lifecycle_create_set_add_stats_freeze_kill_delete(v1_group: CgroupManager, spawn) -> None:
    v1_group.create()
    v1_group.create()  # idempotent
    assert v1_group.exists()
    cpus = frozenset({0})
    v1_group.set(CgroupLimits(cpuset_cpus=cpus, cpu_weight=200, cpu_quota_us=50_000, cpu_period_us=100_000,
                           memory_max=256 * MiB, pids_max=64))  # fmt: skip
    paths = v1_group.paths()
    assert (paths["cpuset"] / "cpuset.cpus").read_text().strip() == "0"
    assert (paths["cpu"] / "cpu.shares").read_text().strip() == "2048"
    assert (paths["cpu"] / "cpu.cfs_quota_us").read_text().strip() == "50000"
    assert int((paths["memory"] / "memory.limit_in_bytes").read_text()) == 256 * MiB
    assert (paths["pids"] / "pids.max").read_text().strip() == "64"

    # Memory is charged where it is first touched, so the child allocates after joining.
    child = spawn("buf = bytearray(8 << 20)\nwhile True: sum(range(1000))")
    v1_group.add_pid(child.pid)
    child.release()
    assert v1_group.procs() == [child.pid]
    assert os.sched_getaffinity(child.pid) == cpus
    assert wait_for(lambda: (v1_group.stats().cpu_usage_ns or 0) > 0)
    stats = v1_group.stats()
    assert stats.pids_current == 1
    assert wait_for(lambda: (v1_group.stats().memory_current or 0) >= 8 << 20)

    v1_group.freeze()
    frozen_usage = v1_group.stats().cpu_usage_ns
    time.sleep(0.05)
    assert v1_group.stats().cpu_usage_ns == frozen_usage
    v1_group.thaw()

    v1_group.kill(timeout=5)
    assert child.proc.wait(timeout=5) == -9
    assert v1_group.procs() == []
    v1_group.delete()
    assert not v1_group.exists()
    v1_group.delete()  # already gone is fine


def test_memory_hog_is_oom_killed_inside_the_group_and_reported(v1_group: CgroupManager, spawn) -> None:
    v1_group.create()
    limit = 64 * MiB
    resources = CgroupLimits(memory_max=limit)
    if (v1_group.paths()["memory"] / "memory.memsw.limit_in_bytes").exists():
        resources = CgroupLimits(memory_max=limit, memory_swap_max=0)
    v1_group.set(resources)
    bystander = spawn("import time\ntime.sleep(60)")
    bystander.release()
    hog = spawn("chunks = []\nwhile True: chunks.append(bytearray(8 << 20))")
    v1_group.add_pid(hog.pid)
    before = v1_group.stats()  # the hog waits to be released: its run and its death come after this
    with v1_group.oom_watcher() as watcher:
        hog.release()
        events = watcher.wait(timeout=30)
        assert events is not None
        assert events.oom
        assert events.oom >= 1
        assert hog.proc.wait(timeout=30) == -9
    assert wait_for(lambda: (v1_group.oom_events().oom_kill or 0) >= 1)
    # A scrape that carries what cannot move while a group is idle still sees the kill and the peak.
    since = v1_group.stats(since=before)
    assert since.oom.oom_kill == v1_group.oom_events().oom_kill
    assert (since.memory_peak or 0) > 32 * MiB
    assert v1_group.stats().memory_peak is not None
    assert v1_group.stats().memory_peak <= limit
    assert bystander.proc.poll() is None  # nothing outside the group was touched


def test_fork_bomb_is_stopped_by_pids_max(v1_group: CgroupManager, spawn) -> None:
    v1_group.create()
    v1_group.set(CgroupLimits(pids_max=20))
    # Bounded bomb: every process forks until EAGAIN (hard stop at 200 forks), then sleeps.
    bomb = spawn(
        "import os, sys, time\n"
        "made = 0\n"
        "while made < 200:\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except BlockingIOError:\n"
        "        break\n"
        "    made += 1\n"
        "    if pid == 0:\n"
        "        made = 200\n"
        "        break\n"
        "if made < 200:\n"
        "    print('refused', flush=True)\n"
        "time.sleep(60)\n"
    )
    v1_group.add_pid(bomb.pid)
    bomb.release()
    assert wait_for(lambda: v1_group.stats().pids_current == 20)
    time.sleep(0.2)
    assert v1_group.stats().pids_current == 20
    events = (v1_group.paths()["pids"] / "pids.events").read_text()
    assert int(events.split()[1]) >= 1  # "max N": forks refused
    v1_group.kill(timeout=10)
    assert bomb.proc.wait(timeout=5) == -9
    assert v1_group.subtree_pids() == []


def _open_results(paths: list[str]) -> str:
    return (
        "import os\n"
        "out = []\n"
        f"for p in {paths!r}:\n"
        "    try:\n"
        "        os.close(os.open(p, os.O_RDONLY))\n"
        "        out.append('ok')\n"
        "    except OSError as e:\n"
        "        out.append(str(e.errno))\n"
        "print(' '.join(out), flush=True)\n"
    )


def _rdev(path: str) -> tuple[str, int, int]:
    st = os.stat(path)
    return ("c" if os.path.stat.S_ISCHR(st.st_mode) else "b", os.major(st.st_rdev), os.minor(st.st_rdev))


def _rule(path: str, access: str = "rw") -> DeviceRule:
    dev_type, major, minor = _rdev(path)
    return DeviceRule(dev_type, major, minor, access)


@pytest.mark.parametrize(
    ("allowed", "probe", "expected"),
    [
        pytest.param(["/dev/null"], ["/dev/null", "/dev/zero"], ["ok", str(errno.EPERM)], id="null-not-zero"),
        pytest.param(
            ["/dev/loop0"], ["/dev/loop0", "/dev/loop1"], ["ok", str(errno.EPERM)], id="loop0-not-loop1"
        ),
        pytest.param(
            ["/dev/null", "/dev/loop-control"],
            ["/dev/loop-control", "/dev/null", "/dev/zero"],
            ["ok", "ok", str(errno.EPERM)],
            id="loop-control-and-null",
        ),
    ],
)
def test_v1_device_rules_allow_listed_devices_only(
    v1_group: CgroupManager, spawn, allowed: list[str], probe: list[str], expected: list[str]
) -> None:
    if not all(os.path.exists(p) for p in probe):
        pytest.skip(f"device nodes missing: {probe}")
    v1_group.create()
    apply_device_rules(v1_group, [_rule(p) for p in allowed])
    listed = (v1_group.paths()["devices"] / "devices.list").read_text().split("\n")
    assert sorted(filter(None, listed)) == sorted(str(_rule(p)) for p in allowed)
    child = spawn(_open_results(probe))
    v1_group.add_pid(child.pid)
    child.release()
    code, out, err = child.finish()
    assert code == 0, err
    assert out.split() == expected


def test_v1_device_rules_change_as_a_minimal_diff(v1_group: CgroupManager, spawn) -> None:
    v1_group.create()
    apply_device_rules(v1_group, [_rule("/dev/null"), _rule("/dev/zero")])
    apply_device_rules(v1_group, [_rule("/dev/zero", "r")])
    listed = (v1_group.paths()["devices"] / "devices.list").read_text().split()
    assert listed == str(_rule("/dev/zero", "r")).split()
    child = spawn(_open_results(["/dev/zero", "/dev/null"]))
    v1_group.add_pid(child.pid)
    child.release()
    assert child.finish()[1].split() == ["ok", str(errno.EPERM)]


def test_child_cannot_allow_more_than_its_parent(real_host: CgroupHost) -> None:
    top = unique_name()
    parent = open_manager(real_host, top)
    child = open_manager(real_host, f"{top}/inner")
    try:
        parent.create()
        apply_device_rules(parent, [_rule("/dev/null")])
        child.create()  # the kernel refuses to change a parent's default once it has children
        with pytest.raises(CgroupError) as caught:
            apply_device_rules(child, [_rule("/dev/null"), _rule("/dev/zero")])
        assert "devices.allow" in str(caught.value) or "did not take" in str(caught.value)
    finally:
        remove_subtree(real_host, top)


def test_hierarchy_parents_slots_and_orphan_listing(real_host: CgroupHost, spawn) -> None:
    layout = Hierarchy(parent=unique_name())
    try:
        ensure_parents(real_host, layout)
        slots = {
            layout.slot_path("g1", "guaranteed"),
            layout.slot_path("b1", "burstable"),
            layout.slot_path("e1", "best-effort"),
        }
        for path in slots:
            open_manager(real_host, path).create()
        assert set(list_owned(real_host, layout)) == slots
        survivor = spawn("import time\ntime.sleep(60)")
        open_manager(real_host, layout.slot_path("b1", "burstable")).add_pid(survivor.pid)
        survivor.release()
        remove_subtree(real_host, layout.parent)
        assert survivor.proc.wait(timeout=5) == -9
        assert list_owned(real_host, layout) == []
        assert not open_manager(real_host, layout.parent).exists()
    finally:
        remove_subtree(real_host, layout.parent)


def test_delete_waits_while_a_group_is_busy_then_fails_with_the_path(v1_group: CgroupManager, spawn) -> None:
    v1_group.create()
    sleeper = spawn("import time\ntime.sleep(60)")
    v1_group.add_pid(sleeper.pid)
    sleeper.release()
    with pytest.raises(CgroupError) as caught:
        v1_group.delete(timeout=0.05)
    assert caught.value.errno == errno.EBUSY
    assert v1_group.relpath in str(caught.value)


def test_procs_files_name_every_hierarchy(v1_group: CgroupManager, real_host: CgroupHost) -> None:
    v1_group.create()
    files = v1_group.procs_files()
    assert len(files) == len(set(real_host.v1_mounts.values()))
    assert all(f.name == "cgroup.procs" and f.exists() for f in files)


def test_remove_subtree_also_clears_the_hierarchies_without_controllers(real_host: CgroupHost) -> None:
    """runc below a slot on a hybrid host makes groups in name=systemd and the cgroup2 mount too,
    with the ancestors they need; removing the agent's parent removes those as well."""
    untracked = [m for m in real_host.all_mounts if m not in set(real_host.v1_mounts.values())]
    if real_host.mode == "v2" or not untracked:
        pytest.skip("needs a v1 or hybrid host with a controller-less hierarchy")
    parent = unique_name() + ".slice"
    open_manager(real_host, f"{parent}/slot").create()
    made = [mount / parent / "slot" / "libpod-x" for mount in untracked]
    try:
        for path in made:
            path.mkdir(parents=True)
        remove_subtree(real_host, parent)
        assert [m for m in real_host.all_mounts if (m / parent).exists()] == []
    finally:
        for path in made:
            for leftover in (path, path.parent, path.parent.parent):
                if leftover.exists():
                    leftover.rmdir()
