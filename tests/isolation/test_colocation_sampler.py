"""The colocation sampler on fake /proc and cgroupfs trees (v1 and v2), the parsers it uses, and the
actuator tending real processes listed in a fake tree."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from nodeagent.cgroups import CgroupHost, Hierarchy
from nodeagent.cgroups.pressure import parse_pressure, read_node_pressure
from nodeagent.errors import CgroupError
from nodeagent.isolation.colocation import Action, GroupUsage, Stall
from nodeagent.isolation.colocation_kernel import (
    Actuator,
    Sampler,
    SlotInfo,
    parse_meminfo,
    parse_proc_stat,
)
from nodeagent.isolation.qos import QosDefaults
from tests.trees import write_tree

F = frozenset
TICK_NS = 1_000_000_000 // 100
PARENT = "na.slice"

PROC_STAT = (
    "cpu  100 0 50 1000 5 0 0 0 0 0\n"
    "cpu0 10 1 5 500 2 3 4 7 20 0\n"
    "cpu1 90 0 45 500 3 0 0 0 0 0\n"
    "intr 12345\nctxt 999\n"
)
MEMINFO = "MemTotal:       16384 kB\nMemFree:         1024 kB\nMemAvailable:    8192 kB\n"


def psi(some: int, full: int | None = 0) -> str:
    text = f"some avg10=1.50 avg60=0.20 avg300=0.00 total={some}\n"
    return text + (f"full avg10=0.00 avg60=0.00 avg300=0.00 total={full}\n" if full is not None else "")


def test_parse_proc_stat_counts_steal_and_irq_but_not_idle_or_iowait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("nodeagent.isolation.colocation_kernel._CLOCK_TICKS", 100)
    assert parse_proc_stat(PROC_STAT) == {0: (10 + 1 + 5 + 3 + 4 + 7) * TICK_NS, 1: (90 + 45) * TICK_NS}


def test_parse_meminfo() -> None:
    assert parse_meminfo(MEMINFO) == (16384 * 1024, 8192 * 1024)
    with pytest.raises(ValueError, match="MemAvailable"):
        parse_meminfo("MemTotal: 1 kB\n")


def test_parse_pressure() -> None:
    parsed = parse_pressure(psi(1234, 56))
    assert parsed.some.total_us == 1234
    assert parsed.some.avg10 == 1.5
    assert parsed.full is not None
    assert parsed.full.total_us == 56
    assert parse_pressure(psi(7, None)).full is None  # the node cpu file before 5.13
    with pytest.raises(ValueError, match="not a pressure line"):
        parse_pressure("some avg10=x total=1\n")
    with pytest.raises(ValueError, match="no 'some' line"):
        parse_pressure("\n")


def test_node_pressure_missing_is_none_and_garbage_is_an_error(tmp_path: Path) -> None:
    assert read_node_pressure(tmp_path, "cpu") is None
    write_tree(tmp_path, {"pressure/io": "what\n"})
    with pytest.raises(CgroupError, match="pressure/io"):
        read_node_pressure(tmp_path, "io")


def proc_tree(tmp_path: Path) -> Path:
    return write_tree(
        tmp_path / "proc",
        {
            "stat": PROC_STAT,
            "meminfo": MEMINFO,
            "pressure/cpu": psi(100),
            "pressure/memory": psi(200),
            "pressure/io": psi(300),
        },
    )


SLOTS = [
    SlotInfo("g1", "guaranteed"),
    SlotInfo("b1", "burstable"),
    SlotInfo("e1", "best-effort", priority=3, started_at=12.5, memory_high=64 << 20, running=True),
]


def test_sampler_on_cgroup_v2(tmp_path: Path) -> None:
    mount = tmp_path / "cgroup"
    files = {f"{PARENT}/burstable/cpuset.cpus": "1\n"}
    for relpath, usage, memory, pressures in (
        (f"{PARENT}/burstable", 5000, 1 << 30, (10, 20, 30)),
        (f"{PARENT}/g1", 9000, 2 << 30, (11, 21, 31)),
        (f"{PARENT}/best-effort", 7000, 3 << 20, (0, 0, 0)),
        (f"{PARENT}/best-effort/e1", 6000, 2 << 20, (0, 0, 0)),
    ):
        files[f"{relpath}/cpu.stat"] = f"usage_usec {usage}\nuser_usec 1\nsystem_usec 2\n"
        files[f"{relpath}/memory.current"] = f"{memory}\n"
        for name, total in zip(("cpu", "memory", "io"), pressures, strict=True):
            files[f"{relpath}/{name}.pressure"] = psi(total)
    write_tree(mount, files)
    host = CgroupHost(mode="v2", v2_mount=mount, can_write=True)
    sampler = Sampler(
        host, Hierarchy(PARENT), allowed=F({0, 1}), core_of={0: 0, 1: 1}, proc_root=proc_tree(tmp_path)
    )
    sample = sampler.sample(SLOTS, now=42.0)
    assert sample.time == 42.0
    assert sample.pool == F({1})
    assert sample.exclusive == F({0})
    assert sample.memory_total == 16384 * 1024
    assert sample.memory_available == 8192 * 1024
    assert sample.node_stall == Stall(cpu=100, memory=200, io=300)
    assert sample.online == {
        "burstable": GroupUsage(5_000_000, 1 << 30, Stall(10, 20, 30)),
        "g1": GroupUsage(None, 2 << 30, Stall(11, 21, 31)),
    }
    assert sample.best_effort_cpu_ns == 7_000_000
    (slot,) = sample.best_effort
    assert slot.slot_id == "e1"
    assert slot.priority == 3
    assert slot.started_at == 12.5
    assert slot.memory_high == 64 << 20
    assert slot.usage == GroupUsage(6_000_000, 2 << 20, None)
    assert sample.slots_read
    assert sample.best_effort_memory_bytes == 3 << 20

    # A period whose decision needs no slot's own usage: the class totals, every slot listed with
    # an empty usage, and the slot's files not read (one changed in between shows nothing).
    (mount / PARENT / "best-effort" / "e1" / "memory.current").write_text("not a number\n")
    asked: list[bool] = []
    calm = sampler.sample(
        SLOTS, now=43.0, read_slots=lambda partial: asked.append(partial.slots_read) or False
    )
    assert asked == [False]
    assert not calm.slots_read
    assert [(s.slot_id, s.usage) for s in calm.best_effort] == [("e1", GroupUsage())]
    assert calm.best_effort_cpu_ns == 7_000_000
    assert calm.best_effort_memory_bytes == 3 << 20


def test_sampler_on_cgroup_v1_and_a_slot_gone_meanwhile(tmp_path: Path) -> None:
    cpuacct, memory, cpuset = tmp_path / "cpuacct", tmp_path / "memory", tmp_path / "cpuset"
    write_tree(cpuset, {f"{PARENT}/burstable/cpuset.cpus": "0-1\n"})
    write_tree(
        cpuacct,
        {
            f"{PARENT}/burstable/cpuacct.usage": "123\n",
            f"{PARENT}/best-effort/cpuacct.usage": "456\n",
        },
    )
    write_tree(
        memory,
        {
            f"{PARENT}/burstable/memory.usage_in_bytes": "1000\n",
            f"{PARENT}/g1/memory.usage_in_bytes": "2000\n",
        },
    )
    host = CgroupHost(
        mode="hybrid", v1_mounts={"cpuacct": cpuacct, "memory": memory, "cpuset": cpuset}, can_write=True
    )
    sampler = Sampler(host, Hierarchy(PARENT), allowed=F({0, 1}), core_of={}, proc_root=proc_tree(tmp_path))
    sample = sampler.sample(SLOTS, now=1.0)
    assert sample.pool == F({0, 1})
    assert sample.exclusive == F()
    # No per-group PSI on v1: the decision falls back to the node's.
    assert sample.online == {"burstable": GroupUsage(123, 1000, None), "g1": GroupUsage(None, 2000, None)}
    assert sample.best_effort_cpu_ns == 456
    (slot,) = sample.best_effort
    assert slot.usage == GroupUsage(None, None, None)  # e1 was released between listing and reading


def test_sampler_reads_the_slots_again_only_when_their_class_moved(tmp_path: Path) -> None:
    """While the best-effort class used no CPU and its memory did not move, each slot reads as it
    did (nothing in it ran); the class's CPU time or memory moving, or another list of slots, reads
    them again."""
    cpuacct, memory = tmp_path / "cpuacct", tmp_path / "memory"
    slot_cpu, slot_memory = (
        cpuacct / PARENT / "best-effort/e1/cpuacct.usage",
        memory / PARENT / "best-effort/e1/memory.usage_in_bytes",
    )
    class_cpu, class_memory = (
        cpuacct / PARENT / "best-effort/cpuacct.usage",
        memory / PARENT / "best-effort/memory.usage_in_bytes",
    )
    for path, value in ((slot_cpu, 10), (slot_memory, 4096), (class_cpu, 10), (class_memory, 4096)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{value}\n")
    host = CgroupHost(mode="hybrid", v1_mounts={"cpuacct": cpuacct, "memory": memory}, can_write=True)
    sampler = Sampler(host, Hierarchy(PARENT), allowed=F({0, 1}), core_of={}, proc_root=proc_tree(tmp_path))
    slots = [SLOTS[2]]

    def usage(now: float, listed: list[SlotInfo] = slots) -> GroupUsage:
        (slot,) = sampler.sample(listed, now=now).best_effort
        return slot.usage

    assert usage(1.0) == GroupUsage(10, 4096, None)
    slot_cpu.write_text("99\n")  # (a fake: only a class that ran lets a slot's own time move)
    slot_memory.write_text("8192\n")
    assert usage(2.0) == GroupUsage(10, 4096, None)  # the class did not move: not read
    class_memory.write_text("8192\n")
    assert usage(3.0) == GroupUsage(99, 8192, None)  # its memory moved: read
    slot_cpu.write_text("150\n")
    assert usage(4.0) == GroupUsage(99, 8192, None)
    class_cpu.write_text("150\n")
    assert usage(5.0) == GroupUsage(150, 8192, None)  # its CPU time moved: read
    slot_memory.write_text("1024\n")
    assert usage(6.0, list(slots)) == GroupUsage(150, 1024, None)  # another list of slots: read
    assert sampler.sample(slots, now=7.0, read_slots=False).slots_read is False


def test_sampler_counts_best_effort_cgroups_outside_the_agent_with_the_class(tmp_path: Path) -> None:
    """The kubelet's ``besteffort`` pods while NRI places them: their CPU time and memory are the
    class's too; one that does not exist (yet) adds nothing."""
    pods = "kube/kubepods/besteffort"
    write_tree(tmp_path / "cpuset", {f"{PARENT}/burstable/cpuset.cpus": "0-1\n"})
    write_tree(
        tmp_path / "cpuacct",
        {f"{PARENT}/best-effort/cpuacct.usage": "456\n", f"{pods}/cpuacct.usage": "1000\n"},
    )
    write_tree(
        tmp_path / "memory",
        {
            f"{PARENT}/best-effort/memory.usage_in_bytes": "10\n",
            f"{pods}/memory.usage_in_bytes": "20\n",
        },
    )
    host = CgroupHost(
        mode="hybrid",
        v1_mounts={name: tmp_path / name for name in ("cpuacct", "memory", "cpuset")},
        can_write=True,
    )
    sampler = Sampler(
        host,
        Hierarchy(PARENT),
        allowed=F({0, 1}),
        core_of={},
        proc_root=proc_tree(tmp_path),
        also_best_effort=[pods, "kube/kubepods.slice/kubepods-besteffort.slice"],
    )
    sample = sampler.sample(SLOTS, now=1.0)
    assert sample.best_effort_cpu_ns == 1456
    assert sample.best_effort_memory_bytes == 30


def test_the_class_quota_holds_best_effort_cgroups_outside_the_agent_too(tmp_path: Path) -> None:
    pods = "kube/kubepods/besteffort"
    quota = tmp_path / "cpu" / pods / "cpu.cfs_quota_us"
    write_tree(
        tmp_path / "cpu", {f"{pods}/cpu.cfs_quota_us": "-1\n", f"{pods}/cpu.cfs_period_us": "100000\n"}
    )
    host = CgroupHost(mode="v1", v1_mounts={"cpu": tmp_path / "cpu"}, can_write=True)
    limited: list[tuple[frozenset[int] | None, float | None]] = []
    isolator = SimpleNamespace(
        host=host,
        hierarchy=Hierarchy(PARENT),
        config=SimpleNamespace(qos=QosDefaults()),
        limit_best_effort=lambda cpus, quota_cpus: limited.append((cpus, quota_cpus)),
    )
    actuator = Actuator(cast(Any, isolator), sched_idle=False, also_best_effort=[pods, "kube/absent"])
    actuator.apply(Action("cpu_suppress", None, "online load", cpus=F({1}), quota_cpus=0.5))
    assert limited == [(F({1}), 0.5)]
    assert quota.read_text().strip() == "50000"
    actuator.apply(Action("cpu_release", None, "online idle", cpus=None, quota_cpus=None))
    assert quota.read_text().strip() == "-1"
    actuator.apply(Action("cpu_suppress", None, "online load", cpus=F({1}), quota_cpus=1.0))
    actuator.release()  # lifted: the class and the cgroups outside it alike
    assert quota.read_text().strip() == "-1"
    assert not (tmp_path / "cpu" / "kube" / "absent").exists()


class _RecordedTraffic:
    """A stand-in for the cache-miss counters: per slot, the bytes counted so far per pid."""

    def __init__(self, per_pid: dict[int, int]) -> None:
        self.per_pid = per_pid
        self.asked: list[tuple[str, list[int]]] = []
        self.kept: list[list[str]] = []

    def read(self, slot_id: str, pids: list[int]) -> int | None:
        self.asked.append((slot_id, list(pids)))
        return sum(self.per_pid.get(pid, 0) for pid in pids) if pids else None

    def forget(self, keep: list[str]) -> None:
        self.kept.append(list(keep))


def test_sampler_counts_running_best_effort_slots_memory_traffic_in_periods_that_read_them(
    tmp_path: Path,
) -> None:
    mount = tmp_path / "cgroup"
    files = {f"{PARENT}/burstable/cpuset.cpus": "0-1\n"}
    for relpath in (f"{PARENT}/burstable", f"{PARENT}/best-effort", f"{PARENT}/best-effort/e1"):
        files[f"{relpath}/cpu.stat"] = "usage_usec 1\n"
        files[f"{relpath}/memory.current"] = "4096\n"
    files[f"{PARENT}/best-effort/e1/cgroup.procs"] = "41\n42\n"
    write_tree(mount, files)
    traffic = _RecordedTraffic({41: 640, 42: 64})
    sampler = Sampler(
        CgroupHost(mode="v2", v2_mount=mount, can_write=True),
        Hierarchy(PARENT),
        allowed=F({0, 1}),
        core_of={0: 0, 1: 1},
        proc_root=proc_tree(tmp_path),
        traffic=traffic,  # type: ignore[arg-type]
    )
    slots = [*SLOTS, SlotInfo("e2", "best-effort", running=False, evicted=True)]
    sample = sampler.sample(slots, now=1.0)
    assert sample.traffic_counted
    by_id = {s.slot_id: s for s in sample.best_effort}
    assert by_id["e1"].memory_traffic_bytes == 704
    assert by_id["e2"].memory_traffic_bytes is None  # evicted: no processes, no counters
    assert traffic.asked == [("e1", [41, 42])]
    assert traffic.kept == [["e1"]]  # the counters of every other slot are closed
    calm = sampler.sample(slots, now=2.0, read_slots=False)
    assert calm.traffic_counted
    assert traffic.asked == [("e1", [41, 42])]  # a period that reads no slot reads no counter
    assert all(s.memory_traffic_bytes is None for s in calm.best_effort)


def _fake_isolator(host: CgroupHost) -> Any:
    """What the actuator reads of an isolator when it only tends processes."""
    return SimpleNamespace(host=host, hierarchy=Hierarchy(PARENT))


@pytest.mark.parametrize("has_cpu_idle", [False, True], ids=["no-cpu-idle", "cpu-idle"])
def test_tend_puts_best_effort_threads_under_sched_idle_where_the_kernel_has_no_cpu_idle(
    tmp_path: Path, has_cpu_idle: bool
) -> None:
    script = "import threading, time\nthreading.Thread(target=time.sleep, args=(30,)).start()\n"
    script += "time.sleep(30)\n"
    child = subprocess.Popen([sys.executable, "-c", script])
    try:
        task = Path(f"/proc/{child.pid}/task")
        deadline = time.monotonic() + 10
        while len(os.listdir(task)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        files = {f"memory/{PARENT}/best-effort/e1/cgroup.procs": f"{child.pid}\n"}
        files[f"cpu/{PARENT}/best-effort/cpu.shares"] = "2\n"
        if has_cpu_idle:
            files[f"cpu/{PARENT}/best-effort/cpu.idle"] = "1\n"
        write_tree(tmp_path, files)
        host = CgroupHost(mode="v1", v1_mounts={"memory": tmp_path / "memory", "cpu": tmp_path / "cpu"})
        actuator = Actuator(_fake_isolator(host))
        assert actuator.tend(["e1"]) == 1
        policies = {os.sched_getscheduler(int(tid)) for tid in os.listdir(task)}
        assert policies == ({os.SCHED_OTHER} if has_cpu_idle else {os.SCHED_IDLE})
        assert Path(f"/proc/{child.pid}/oom_score_adj").read_text().strip() == "1000"
        assert actuator.tend(["e1"]) == 0  # each process once
    finally:
        child.kill()  # our own child, by pid
        child.wait()
