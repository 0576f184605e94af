"""Colocation on a real kernel, shared by the cgroup v1 tests (this host) and the v2 ones (the VM).

Each scenario drives sampler -> decide -> actuator period by period in the test's own thread, on an
isolator of the test's own (a throwaway cgroup parent), with processes it starts and kills itself.
The kernel state (cpusets, quotas, memory.high, kills) and what the kernel enforces are real; the
machine the decisions see is simulated, so that they depend on the test's processes only (this host
is shared, and other work on it would count as online load): the sampler's /proc is the real one
except ``stat`` and ``meminfo``, which the test writes each period from the real cgroups' CPU time
and memory, on a machine of the pool's CPUs and 1 GiB where only the test's slots run. Memory
thresholds are then crossed by a few hundred MiB, and the host's memory is never at risk.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from nodeagent.cgroups import CgroupHost, open_manager
from nodeagent.cpulist import parse_cpulist
from nodeagent.isolation.colocation import Action, ColocationConfig, Decision, LoopState, decide
from nodeagent.isolation.colocation_kernel import Actuator, Sampler, SlotInfo
from nodeagent.isolation.isolator import AppliedSlot, SlotIsolator
from nodeagent.isolation.qos import quota_us
from nodeagent.isolation.slot_spec import SlotIsolationSpec

from ..cgroups.conftest import Child

MiB = 1 << 20
BUSY = "while True:\n    pass\n"
StartIn = Callable[..., Child]


@dataclass
class Runner:
    """sample -> decide -> act, one period per ``step``; evictions are the caller's ``evict``."""

    config: ColocationConfig
    sampler: Sampler
    actuator: Actuator
    slots: list[SlotInfo]
    evict: Callable[[Action], None] = lambda action: None
    state: LoopState = field(default_factory=LoopState)
    decisions: list[Decision] = field(default_factory=list)
    before_sample: Callable[[], None] = lambda: None

    def step(self) -> Decision:
        time.sleep(self.config.period_seconds)
        self.before_sample()
        decision = decide(self.config, self.state, self.sampler.sample(self.slots, time.monotonic()))
        self.state = decision.state
        for action in decision.actions:
            if action.kind in ("evict", "restore"):
                self.evict(action)
            else:
                self.actuator.apply(action)
        self.actuator.tend([s.slot_id for s in self.slots if s.qos == "best-effort"])
        self.decisions.append(decision)
        return decision

    def steps(self, count: int) -> list[Decision]:
        return [self.step() for _ in range(count)]


def _cpu_file(host: CgroupHost, relpath: str, v1_name: str, v2_name: str) -> str:
    if host.mode == "v2":
        assert host.v2_mount is not None
        return (host.v2_mount / relpath / v2_name).read_text().strip()
    controller = "cpuset" if v1_name.startswith("cpuset") else "cpu"
    return (host.v1_mounts[controller] / relpath / v1_name).read_text().strip()


def best_effort_quota_us(host: CgroupHost, relpath: str) -> int | None:
    if host.mode == "v2":
        quota = _cpu_file(host, relpath, "", "cpu.max").split()[0]
        return None if quota == "max" else int(quota)
    value = int(_cpu_file(host, relpath, "cpu.cfs_quota_us", ""))
    return None if value < 0 else value


def cpuset(host: CgroupHost, relpath: str) -> frozenset[int]:
    return parse_cpulist(_cpu_file(host, relpath, "cpuset.cpus", "cpuset.cpus"))


def cpu_seconds(host: CgroupHost, relpath: str) -> float:
    stats = open_manager(host, relpath).stats()
    assert stats.cpu_usage_ns is not None
    return stats.cpu_usage_ns / 1e9


def cpu_scenario(isolator: SlotIsolator, start_in: StartIn, tmp_path: Path) -> None:
    """A best-effort CPU hog beside an online burstable slot: the hog's quota is cut within two
    periods of the online load starting, to at most what the online load leaves, and grows back
    after it stops."""
    host, hierarchy = isolator.host, isolator.hierarchy
    web = isolator.apply(SlotIsolationSpec("web", "burstable", memory_bytes=256 * MiB))
    hog = isolator.apply(SlotIsolationSpec("hog", "best-effort", memory_bytes=256 * MiB))
    pool = isolator.pool.pool()
    assert len(pool) >= 2, f"needs a shared pool of two CPUs or more, got {sorted(pool)}"
    # A wide margin: on a two-CPU pool best-effort holds one CPU until the allowance falls below
    # one, and on a shared host the online loop may get only part of a CPU; the cut must show.
    config = ColocationConfig(period_seconds=0.5, cpu_release_periods=2, cpu_margin=0.4)
    machine = SimulatedMachine(host, tmp_path, sorted(pool), [web, hog])
    runner = Runner(
        config,
        Sampler(
            host,
            hierarchy,
            allowed=isolator.pool.allowed,
            core_of={cpu: cpu for cpu in pool},
            proc_root=machine.proc,
        ),
        Actuator(isolator),
        [SlotInfo("web", "burstable"), SlotInfo("hog", "best-effort", running=True)],
        before_sample=machine.write,
    )
    for _ in range(len(pool)):
        start_in(hog, BUSY)
    runner.steps(3)
    quiet = runner.state.cpu_limit
    assert quiet is not None
    online = start_in(web, BUSY)
    # On a shared host the online loop may wait for CPU a while: from the first period the loop
    # measures it, best-effort must be cut within two periods.
    seen = _until(runner, lambda d: d.measured is not None and d.measured.online_cpu >= 0.2, 40)
    assert seen.measured is not None
    online_cpu = seen.measured.online_cpu
    if not any(a.kind == "cpu_suppress" for a in seen.actions):
        runner.step()
    busy = runner.state.cpu_limit
    assert busy is not None
    assert busy.quota < quiet.quota, (quiet, busy)
    assert busy.quota <= len(pool) * (1 - config.cpu_margin) - online_cpu + 0.1, (quiet, busy, online_cpu)
    # The kernel holds what was decided: the class quota, and the cpuset of the class and the slot.
    class_parent = hierarchy.class_parent("best-effort")
    assert best_effort_quota_us(host, class_parent) == quota_us(busy.quota, 100_000)
    assert cpuset(host, class_parent) == busy.cpus
    assert cpuset(host, hog.cgroup) == busy.cpus
    assert cpuset(host, web.cgroup) == pool  # online work keeps the whole pool
    # The hog gets no more than its quota (a little slack for the period boundaries).
    began = cpu_seconds(host, hog.cgroup)
    time.sleep(1.0)
    assert cpu_seconds(host, hog.cgroup) - began <= busy.quota * 1.0 + 0.15
    online.stop()
    released = _until(runner, lambda d: any(a.kind == "cpu_release" for a in d.actions), 40)
    after = released.state.cpu_limit
    assert after is not None
    assert after.quota > busy.quota, (busy, after)


HOG = """
import time
blocks = []
while True:
    if len(blocks) * 8 < {limit_mib}:
        blocks.append(b"x" * (8 << 20))
    time.sleep(0.02)
"""


class SimulatedMachine:
    """A /proc for the sampler in which only ``slots`` run: per-CPU busy time is their CPU time
    spread over ``cpus``, memory is ``base`` (and ``extra``) plus theirs out of ``total``; the
    pressure files are the kernel's."""

    def __init__(
        self,
        host: CgroupHost,
        tmp_path: Path,
        cpus: list[int],
        slots: list[AppliedSlot],
        *,
        total: int = 1024 * MiB,
        base: int = 300 * MiB,
    ) -> None:
        self.host, self.cpus, self.slots = host, cpus, slots
        self.total, self.base, self.extra = total, base, 0
        self.proc = tmp_path / "proc"
        self.proc.mkdir()
        (self.proc / "pressure").symlink_to("/proc/pressure")
        self.write()

    def write(self) -> None:
        stats = [open_manager(self.host, slot.cgroup).stats() for slot in self.slots]
        busy_ns = sum(s.cpu_usage_ns or 0 for s in stats)
        ticks = busy_ns * os.sysconf("SC_CLK_TCK") // 1_000_000_000 // len(self.cpus)
        lines = [f"cpu{cpu} {ticks} 0 0 0 0 0 0 0 0 0" for cpu in self.cpus]
        (self.proc / "stat").write_text("\n".join(lines) + "\n")
        used = self.base + self.extra + sum(s.memory_current or 0 for s in stats)
        (self.proc / ".meminfo").write_text(
            f"MemTotal: {self.total // 1024} kB\nMemAvailable: {max(0, self.total - used) // 1024} kB\n"
        )
        (self.proc / ".meminfo").replace(self.proc / "meminfo")  # whole or not at all


def memory_scenario(isolator: SlotIsolator, start_in: StartIn, tmp_path: Path) -> None:
    """A best-effort memory hog on a simulated 1 GiB machine: held at its size when memory passes
    80%, evicted when online memory growth takes the node past 90%; the online slot is untouched."""
    host, hierarchy = isolator.host, isolator.hierarchy
    web = isolator.apply(SlotIsolationSpec("web", "burstable", memory_bytes=256 * MiB))
    hog = isolator.apply(SlotIsolationSpec("hog", "best-effort"))
    online = start_in(web, "x = b'y' * (32 << 20)\nimport time\ntime.sleep(120)")
    start_in(hog, HOG.format(limit_mib=600))
    machine = SimulatedMachine(host, tmp_path, sorted(isolator.pool.pool()), [web, hog])

    def memory_of(applied: AppliedSlot) -> int:
        return open_manager(host, applied.cgroup).stats().memory_current or 0

    evicted: list[Action] = []

    def evict(action: Action) -> None:
        assert action.kind == "evict", action
        evicted.append(action)
        isolator_kill(isolator, hog)
        runner.slots = [
            replace(s, running=False, evicted=True) if s.slot_id == "hog" else s for s in runner.slots
        ]

    runner = Runner(
        ColocationConfig(period_seconds=0.25),
        Sampler(host, hierarchy, allowed=isolator.pool.allowed, core_of={}, proc_root=machine.proc),
        Actuator(isolator),
        [SlotInfo("web", "burstable"), SlotInfo("hog", "best-effort", running=True)],
        evict=evict,
        before_sample=machine.write,
    )
    throttle = _until(runner, lambda d: any(a.kind == "memory_throttle" for a in d.actions), 80)
    (action,) = [a for a in throttle.actions if a.kind == "memory_throttle"]
    assert action.slot_id == "hog"
    assert action.memory_high is not None
    assert action.memory_high >= 400 * MiB  # it crossed 80% of the simulated 1 GiB with the base
    assert memory_high(host, hog.cgroup) == action.memory_high
    assert oom_score_adj(online.pid) == 0
    assert set(best_effort_oom_scores(host, hog)) == {1000}  # the kernel's OOM killer takes it first
    time.sleep(1.0)
    if host.mode == "v2":
        # memory.high holds the hog where it is: the kernel throttles it (and counts it) instead of
        # letting it grow towards its 600 MiB.
        assert memory_of(hog) <= action.memory_high + 16 * MiB
        events = (host.v2_mount / hog.cgroup / "memory.events").read_text()  # type: ignore[operator]
        assert int(events.split("high ")[1].split()[0]) > 0
    # Online memory grows: past 90%, the hog goes; the online slot stays.
    machine.extra = 200 * MiB
    _until(runner, lambda d: bool(evicted), 40)
    assert evicted[0].slot_id == "hog"
    assert "evict at 90%" in evicted[0].reason
    assert not open_manager(host, hog.cgroup).subtree_pids()
    assert online.proc.poll() is None
    stats = open_manager(host, web.cgroup).stats()
    assert not stats.oom.oom_kill


def isolator_kill(isolator: SlotIsolator, applied: AppliedSlot) -> None:
    open_manager(isolator.host, applied.cgroup).kill(timeout=5.0)


def memory_high(host: CgroupHost, relpath: str) -> int | None:
    if host.mode == "v2":
        assert host.v2_mount is not None
        text = (host.v2_mount / relpath / "memory.high").read_text().strip()
    else:
        text = (host.v1_mounts["memory"] / relpath / "memory.soft_limit_in_bytes").read_text().strip()
    return None if text == "max" else int(text)


def oom_score_adj(pid: int) -> int:
    return int(Path(f"/proc/{pid}/oom_score_adj").read_text())


def _until(runner: Runner, done: Callable[[Decision], bool], limit: int) -> Decision:
    for _ in range(limit):
        decision = runner.step()
        if done(decision):
            return decision
    raise AssertionError(
        f"not within {limit} periods; last actions {[d.actions for d in runner.decisions[-3:]]}"
    )


def best_effort_oom_scores(host: CgroupHost, applied: AppliedSlot) -> list[int]:
    return [
        oom_score_adj(pid)
        for pid in open_manager(host, applied.cgroup).subtree_pids()
        if os.path.exists(f"/proc/{pid}")
    ]
