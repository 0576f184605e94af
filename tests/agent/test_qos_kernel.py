"""The QoS loop with the real SlotManager, keeper and kernel (root): a best-effort worker that
grows is throttled, then evicted through its supervisor (its slot stays), and started again once
memory is calm; the online worker beside it keeps its pid and is never OOM-killed. And the memory
bandwidth proxy: a best-effort slot's counted traffic cuts its CPU quota while online work runs.

The machine the loop sees is simulated as in tests/isolation/colocation_scenarios.py (1 GiB, only
the test's slots), so the thresholds are crossed by a few hundred MiB of the real workers' memory.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from nodeagent.agent.config import AgentConfig, apply_overrides, parse_config
from nodeagent.agent.daemon import build_isolation, build_manager, ensure_state_dir
from nodeagent.agent.manager import SlotManager
from nodeagent.agent.qos_loop import QosLoop
from nodeagent.cgroups import detect, open_manager
from nodeagent.devices.discovery import discover
from nodeagent.isolation.backend import KernelIsolation
from nodeagent.isolation.colocation_kernel import Actuator, Sampler
from nodeagent.isolation.memory_traffic import TASK_CLOCK, MemoryTraffic
from nodeagent.runtime.keeper_client import stop_keeper
from nodeagent.schema.request import parse_slot_request
from tests.isolation.colocation_scenarios import MiB, SimulatedMachine
from tests.workerpy import world_python

pytestmark = [pytest.mark.root, pytest.mark.slow]

PARENT = f"natest{os.getpid()}q.slice"
HOG = (
    "import time\nblocks = []\nwhile len(blocks) < 40:\n    blocks.append(b'x' * (8 << 20))\n"
    "    time.sleep(0.02)\ntime.sleep(600)\n"
)


@pytest.fixture
def config(tmp_path: Path) -> Iterator[AgentConfig]:
    cfg = apply_overrides(
        parse_config(
            {
                "isolation": {"cgroup_parent": PARENT, "firewall_table": f"natest{os.getpid()}q"},
                "qos": {"period_seconds": 0.25, "restore_after_seconds": 1.0, "evict_grace_seconds": 2.0},
                "cdi": {"dir": str(tmp_path / "cdi")},  # not the host's CDI directory
            }
        ),
        state_dir=tmp_path / "state",
    )
    ensure_state_dir(cfg.state_dir)
    yield cfg
    stop_keeper(cfg.state_dir / "keeper")
    kernel = build_isolation(cfg, discover(gpus=False, fpgas=False), detect())
    if isinstance(kernel, KernelIsolation):
        kernel.isolator.remove_all()


def make_loop(config: AgentConfig, manager: SlotManager, machine: SimulatedMachine) -> QosLoop:
    backend = manager.isolation
    assert isinstance(backend, KernelIsolation)
    isolator = backend.isolator
    sampler = Sampler(
        isolator.host, isolator.hierarchy, allowed=isolator.pool.allowed, core_of={}, proc_root=machine.proc
    )
    loop = QosLoop(manager, sampler, Actuator(isolator), config.colocation(), evict_grace_seconds=2.0)
    manager.attach_qos(loop)
    return loop


def worker_phase(manager: SlotManager, name: str) -> str | None:
    worker = manager.get_slot(name).worker
    return None if worker is None else worker.phase


def run_until(
    loop: QosLoop, manager: SlotManager, machine: SimulatedMachine, check, limit: int = 120
) -> None:  # type: ignore[no-untyped-def]
    for _ in range(limit):
        time.sleep(loop.config.period_seconds)
        machine.write()
        loop.run_once()
        manager.tick()
        if check():
            return
    batch = manager.get_slot("batch")
    raise AssertionError(
        f"not within {limit} periods: meminfo {(machine.proc / 'meminfo').read_text()!r}, measured "
        f"{loop.measured}, batch worker {batch.worker}, errors {loop.errors}"
    )


def test_evicted_worker_is_stopped_then_restarted_and_online_is_untouched(
    config: AgentConfig, tmp_path: Path
) -> None:
    manager = build_manager(config, discover(gpus=False, fpgas=False))
    manager.start(supervise=False)
    try:
        online = manager.allocate(
            parse_slot_request(
                {
                    "name": "web",
                    "qos": "burstable",
                    "resources": {"cpus": 0.5, "memory": "128Mi"},
                    "worker": {"command": ["/bin/sleep", "600"], "stop_grace_seconds": 1},
                }
            )
        ).slot
        batch = manager.allocate(
            parse_slot_request(
                {
                    "name": "batch",
                    "qos": "best-effort",
                    "priority": 2,
                    "worker": {
                        "command": [world_python(), "-c", HOG],  # runnable by the slot's own uid
                        "restart": "always",
                        "stop_grace_seconds": 30,
                    },
                }
            )
        ).slot
        assert online.worker is not None
        assert online.cgroup is not None
        assert batch.cgroup is not None
        online_pid = online.worker.pid
        machine = SimulatedMachine(
            detect(),
            tmp_path,
            [0],
            [manager.get_slot("web").applied, manager.get_slot("batch").applied],  # type: ignore[list-item]
            base=520 * MiB,
        )
        loop = make_loop(config, manager, machine)

        def actions() -> list[str]:
            return [a["action"] for a in manager.get_slot("batch").qos_actions]

        # 520 MiB base + the hog's 320 MiB crosses 80% of 1 GiB: held at its size.
        run_until(loop, manager, machine, lambda: "memory_throttle" in actions())
        # Online memory grows by 150 MiB: past 90%, the best-effort worker goes.
        machine.extra = 150 * MiB
        run_until(loop, manager, machine, lambda: manager.get_slot("batch").qos_evicted)
        view = manager.get_slot("batch")
        assert view.to_json()["qos_evicted"] is True
        evict = view.qos_actions[-1]
        assert evict["action"] == "evict"
        assert "evict at 90%" in evict["reason"]
        # Its grace (30 s) is longer than the loop's (2 s): the loop kills it, the slot stays.
        run_until(
            loop,
            manager,
            machine,
            lambda: worker_phase(manager, "batch") == "stopped",
            limit=60,
        )
        assert not open_manager(detect(), batch.cgroup).subtree_pids()
        assert manager.get_slot("batch").state in ("ready", "running")
        # Memory calm again (online shrank back, and its last 320 MiB fit below 75%): after
        # restore_after_seconds it is started again.
        machine.extra = 0
        machine.base = 400 * MiB
        run_until(loop, manager, machine, lambda: "restore" in actions(), limit=80)
        run_until(
            loop,
            manager,
            machine,
            lambda: worker_phase(manager, "batch") == "running",
            limit=40,
        )
        assert not manager.get_slot("batch").qos_evicted
        kinds = [e["kind"] for e in manager.events(batch.id)]
        assert "evict" in kinds
        assert "restore" in kinds
        # The online worker was never touched.
        web = manager.get_slot("web")
        assert web.worker is not None
        assert web.worker.pid == online_pid
        assert web.worker.restarts == 0
        assert not open_manager(detect(), online.cgroup).stats().oom.oom_kill
        body = manager.capacity()["batch"]
        assert body is not None
        assert body["best_effort_used"]["memory_bytes"] >= 0
    finally:
        manager.close()


SPIN = (
    "import threading\n"
    "def spin():\n    while True:\n        pass\n"
    "threading.Thread(target=spin, daemon=True).start()\nspin()\n"
)


def _slot_quota_cpus(manager: SlotManager, name: str) -> float | None:
    """The slot's own CPU quota in CPUs as the kernel has it (None: no quota)."""
    backend = manager.isolation
    assert isinstance(backend, KernelIsolation)
    host = backend.isolator.host
    cgroup = manager.get_slot(name).cgroup
    assert cgroup is not None
    if host.mode == "v2":
        assert host.v2_mount is not None
        quota, period = (host.v2_mount / cgroup / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    mount = host.v1_mounts["cpu"]
    quota_us = int((mount / cgroup / "cpu.cfs_quota_us").read_text())
    period_us = int((mount / cgroup / "cpu.cfs_period_us").read_text())
    return None if quota_us < 0 else quota_us / period_us


def test_the_bandwidth_proxy_cuts_a_hog_through_real_counters_and_lets_go_when_online_stops(
    config: AgentConfig,
) -> None:
    # The hardware event (cache misses) needs a PMU this machine's guest does not have; the same
    # system call, inheritance and wiring are driven by the software clock instead: one "byte" per
    # nanosecond on CPU, so a busy slot "moves" 1000 MB per CPU-second.
    manager = build_manager(config, discover(gpus=False, fpgas=False))
    manager.start(supervise=False)
    traffic = MemoryTraffic(event=TASK_CLOCK, bytes_per_event=1)
    try:
        for name, qos, cpus in (("web", "burstable", 0.5), ("hog", "best-effort", None)):
            resources = {"memory": "64Mi"} | ({"cpus": cpus} if cpus else {})
            manager.allocate(
                parse_slot_request(
                    {
                        "name": name,
                        "qos": qos,
                        "resources": resources,
                        "worker": {"command": [world_python(), "-c", SPIN], "stop_grace_seconds": 1},
                    }
                )
            )
        backend = manager.isolation
        assert isinstance(backend, KernelIsolation)
        isolator = backend.isolator
        sampler = Sampler(
            isolator.host, isolator.hierarchy, allowed=isolator.pool.allowed, core_of={}, traffic=traffic
        )
        colocation = replace(config.colocation(), best_effort_bandwidth_mb_per_s=200.0)
        loop = QosLoop(manager, sampler, Actuator(isolator), colocation, evict_grace_seconds=2.0)
        manager.attach_qos(loop)

        def step_until(check, limit: int = 80) -> None:  # type: ignore[no-untyped-def]
            for _ in range(limit):
                time.sleep(loop.config.period_seconds)
                loop.run_once()
                if check():
                    return
            raise AssertionError(
                f"not within {limit} periods: measured {loop.measured}, errors {loop.errors}, "
                f"actions {manager.get_slot('hog').qos_actions}, quota {_slot_quota_cpus(manager, 'hog')}"
            )

        def cut() -> float | None:
            return _slot_quota_cpus(manager, "hog")

        # Online runs at ~0.5 CPU: the hog's 1000 MB per CPU-second at best-effort's allowance is
        # over the 200 MB/s budget, so its quota is cut to 200 / 1000 = 0.2 CPU.
        step_until(lambda: cut() is not None)
        assert cut() == pytest.approx(0.2, abs=0.02)
        (action,) = [a for a in manager.get_slot("hog").qos_actions if a["action"] == "slot_cpu_quota"]
        assert "MB per CPU-second" in action["reason"]
        assert traffic.open_counters() >= 2  # the worker's two threads (more if it had more)
        batch = manager.capacity()["batch"]
        assert batch is not None
        assert batch["best_effort_memory_traffic"]["budget_bytes_per_second"] == 200_000_000
        # The online worker goes: the cut is lifted once the release window is quiet.
        manager.release("web")
        step_until(lambda: cut() is None)
        assert manager.get_slot("hog").qos_actions[-1]["quota_cpus"] is None
    finally:
        traffic.close()
        manager.close()
