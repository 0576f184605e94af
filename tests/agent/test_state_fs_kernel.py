"""The state file system against a slot that floods it: the agent's reserve holds, release and a
restart work. The state directory lies on a small tmpfs of the test's own (48 MiB, reserve
16 MiB), and a real worker writes 100 MiB of output through the host keeper, more than the whole
file system."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent.agent.config import AgentConfig, StateConfig
from nodeagent.agent.daemon import build_manager
from nodeagent.agent.manager import SlotManager
from nodeagent.devices.discovery import discover
from nodeagent.errors import NotFound
from nodeagent.schema.request import parse_slot_request
from tests.escape.harness import config_for, tear_down, wait_until

pytestmark = [pytest.mark.root, pytest.mark.slow]

RESERVE = 16 << 20
FLOOD = "head -c 100000000 /dev/zero | tr '\\0' x | fold -w 1000; echo FLOOD-DONE; exec sleep 300"


@pytest.fixture
def small_state(tmp_path: Path) -> Iterator[AgentConfig]:
    where = tmp_path / "statefs"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m,mode=0700", "tmpfs", str(where)], check=True)
    try:
        cfg = config_for(where, "r")
        cfg = dataclasses.replace(cfg, state=StateConfig(dir=str(cfg.state_dir), reserve=f"{RESERVE}"))
        try:
            yield cfg
        finally:
            tear_down(cfg)
    finally:
        subprocess.run(["umount", "--lazy", str(where)], check=True)


def started(cfg: AgentConfig) -> SlotManager:
    manager = build_manager(cfg, discover(gpus=False, fpgas=False))
    manager.start(supervise=False)
    return manager


def free(path: Path) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def test_a_flooding_slot_keeps_to_the_reserve_and_release_and_restart_work(small_state: AgentConfig) -> None:
    cfg = small_state
    manager = started(cfg)
    try:
        flooder = manager.allocate(
            parse_slot_request(
                {
                    "name": "flooder",
                    "qos": "burstable",
                    "resources": {"cpus": 0.5, "memory": "64Mi"},
                    "worker": {"command": ["/bin/sh", "-c", FLOOD], "stop_grace_seconds": 1},
                }
            )
        ).slot

        def done() -> bool:
            manager.tick()
            try:
                return any(line.endswith("FLOOD-DONE") for line in manager.logs(flooder.id, 3))
            except NotFound:
                return False  # nothing written yet

        wait_until("the flood to be written", done, 120)
        # The log gave up its own rotations rather than take the agent's reserve.
        assert free(cfg.state_dir) >= RESERVE - (1 << 20)
        assert not [d for d in manager.node().degraded if "reserve" in d]
        other = manager.allocate(
            parse_slot_request(
                {"name": "after", "qos": "burstable", "resources": {"cpus": 0.1, "memory": "32Mi"}}
            )
        ).slot
        manager.release(flooder.id)
        manager.release(other.id)
    finally:
        manager.close()
    again = started(cfg)  # a restart works on the same file system
    try:
        assert again.list_slots() == []
    finally:
        again.close()


def test_with_the_disk_filled_from_outside_the_slots_a_restart_and_a_release_still_work(
    small_state: AgentConfig,
) -> None:
    """Something outside every slot (here: root) fills the state file system to its last block; the
    agent's ballast is the room its restart (SQLite recreates its WAL) and a release need."""
    cfg = small_state
    manager = started(cfg)
    ballast = cfg.state_dir / "ballast"
    try:
        assert ballast.exists()
        held = manager.allocate(
            parse_slot_request(
                {
                    "name": "held",
                    "qos": "burstable",
                    "resources": {"cpus": 0.1, "memory": "32Mi"},
                    "worker": {"command": ["/bin/sleep", "300"], "stop_grace_seconds": 1},
                }
            )
        ).slot
    finally:
        manager.close()
    filler = cfg.state_dir.parent / "filler"
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={filler}", "bs=1M", "count=64"], capture_output=True, check=False
    )
    try:
        assert free(cfg.state_dir) < 1 << 20
        manager = started(cfg)  # opens the database in the ballast's room
        try:
            assert not ballast.exists()
            assert [d for d in manager.node().degraded if "reserve" in d]
            manager.release(held.id)
            assert manager.list_slots() == []
        finally:
            manager.close()
    finally:
        filler.unlink()
    manager = started(cfg)
    try:
        assert ballast.exists()  # made again once there is room
    finally:
        manager.close()
