"""The real SlotManager on this host's kernel: real isolator, real keeper, a throwaway cgroup parent."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent.agent.config import apply_overrides, parse_config
from nodeagent.agent.daemon import build_isolation, build_manager, ensure_state_dir
from nodeagent.agent.manager import SlotManager
from nodeagent.agent.slot import SlotState
from nodeagent.cgroups import detect
from nodeagent.cpulist import parse_cpulist
from nodeagent.devices.discovery import discover
from nodeagent.isolation.backend import KernelIsolation
from nodeagent.runtime.keeper_client import stop_keeper
from nodeagent.schema.request import parse_slot_request
from tests.daemon import HOST_OFF

pytestmark = pytest.mark.root

CGROUP_ROOT = Path("/sys/fs/cgroup")
PARENT = f"natest{os.getpid()}.slice"
REQUEST = {
    "name": "kern",
    "qos": "guaranteed",
    "resources": {"cpus": 1, "memory": "64Mi"},
    "worker": {"command": ["/bin/sleep", "300"], "restart": "on-failure", "stop_grace_seconds": 2},
}


@pytest.fixture
def config(tmp_path: Path) -> Iterator[object]:
    cfg = apply_overrides(
        # Its own firewall table too: remove_all() below deletes the configured one.
        parse_config(
            {
                "isolation": {"cgroup_parent": PARENT, "firewall_table": f"natest{os.getpid()}m", **HOST_OFF},
                "cdi": {"dir": str(tmp_path / "cdi")},  # not the host's CDI directory
            }
        ),
        state_dir=tmp_path / "state",
    )
    ensure_state_dir(cfg.state_dir)
    yield cfg
    stop_keeper(cfg.state_dir / "keeper")  # the host keeper outlives the managers of the test
    kernel = build_isolation(cfg, discover(gpus=False, fpgas=False), detect())
    if isinstance(kernel, KernelIsolation):
        kernel.isolator.remove_all()  # kills anything left in the slots, removes the parent


def make(config: object) -> SlotManager:
    manager = build_manager(config, discover(gpus=False, fpgas=False))  # type: ignore[arg-type]
    manager.start(supervise=False)
    return manager


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_allocate_readopt_release_on_the_real_kernel(config: object) -> None:
    first = make(config)
    slot = first.allocate(parse_slot_request(REQUEST)).slot
    assert slot.state is SlotState.RUNNING
    assert slot.assignment is not None
    assert slot.cgroup == f"{PARENT}/{slot.id}"
    cpuset_dir = CGROUP_ROOT / "cpuset" / slot.cgroup
    assert parse_cpulist((cpuset_dir / "cpuset.cpus").read_text()) == frozenset(slot.assignment.cpus)
    assert (CGROUP_ROOT / "memory" / slot.cgroup / "memory.limit_in_bytes").read_text().strip() == str(
        64 << 20
    )
    assert slot.worker is not None
    pid = slot.worker.pid
    assert str(pid) in (cpuset_dir / "tasks").read_text().split()
    # The shared pool (the parent's other groups) no longer has the slot's CPUs.
    pool = parse_cpulist((CGROUP_ROOT / "cpuset" / PARENT / "burstable" / "cpuset.cpus").read_text())
    assert not pool & frozenset(slot.assignment.cpus)
    first.close()

    assert alive(pid)  # workers outlive the agent
    second = make(config)
    try:
        assert second.report is not None
        assert second.report.workers_adopted == ["kern"]
        assert second.report.orphans_removed == []
        view = second.get_slot("kern")
        assert view.worker is not None
        assert view.worker.pid == pid
        began = time.monotonic()
        second.release("kern")
        print(f"release with a running worker: {(time.monotonic() - began) * 1000:.1f} ms")
        assert not cpuset_dir.exists()
        assert not (CGROUP_ROOT / "memory" / slot.cgroup).exists()
        deadline = time.monotonic() + 5
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not alive(pid)
        assert second.list_slots() == []
    finally:
        second.close()


def test_orphan_cgroup_is_removed_on_start(config: object) -> None:
    first = make(config)
    slot = first.allocate(parse_slot_request({**REQUEST, "worker": None})).slot
    first.close()
    # A crash after the kernel object was made but with the row lost: delete the row behind its back.
    import sqlite3

    db = sqlite3.connect(config.database_path)  # type: ignore[attr-defined]
    db.execute("DELETE FROM slots WHERE id = ?", (slot.id,))
    db.commit()
    db.close()
    second = make(config)
    try:
        assert second.report is not None
        assert f"cgroup {PARENT}/{slot.id}" in second.report.orphans_removed
        assert not (CGROUP_ROOT / "cpuset" / PARENT / slot.id).exists()
    finally:
        second.close()


def test_start_survives_a_leftover_shared_slot_on_an_empty_pool(config: object) -> None:
    # Every CPU in guaranteed slots, plus a burstable cgroup no row knows (a slot whose rollback
    # was cut short by a crash): the pool cannot be made true until that leftover is gone, so
    # start-up must remove orphans before it sets the pool up, or the daemon never starts.
    first = make(config)
    online = sorted(discover(gpus=False, fpgas=False).online_cpus)
    for n in range(len(online)):
        first.allocate(parse_slot_request({**REQUEST, "name": f"g{n}", "worker": None}))
    first.close()
    leftover = "sleftover0001"
    for controller in ("cpuset", "cpu", "memory", "pids"):
        (CGROUP_ROOT / controller / PARENT / "burstable" / leftover).mkdir()
    second = make(config)
    try:
        assert second.report is not None
        assert f"cgroup {PARENT}/burstable/{leftover}" in second.report.orphans_removed
        assert [s.state for s in second.list_slots()] == [SlotState.READY] * len(online)
    finally:
        second.close()


def test_allocate_release_latency(config: object) -> None:
    """Figures, not assertions: median allocate+release through the manager (no worker)."""
    manager = make(config)
    try:
        samples = []
        for n in range(30):
            began = time.perf_counter()
            slot = manager.allocate(parse_slot_request({**REQUEST, "name": f"lat{n}", "worker": None})).slot
            manager.release(slot.id)
            samples.append(time.perf_counter() - began)
        samples.sort()
        print(
            f"allocate+release (guaranteed, 1 CPU, cgroup v1): "
            f"median {samples[len(samples) // 2] * 1000:.2f} ms, "
            f"max {samples[-1] * 1000:.2f} ms over {len(samples)}"
        )
        assert manager.list_slots() == []
    finally:
        manager.close()
