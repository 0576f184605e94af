"""The agent under systemd, without systemd: where its cgroups go (fake /proc, cgroupfs and systemctl),
what a SIGTERM asks of it, and workers stopped with the agent coming back with the next one."""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from nodeagent.agent.config import AgentConfig, SystemdConfig, apply_overrides, parse_config
from nodeagent.agent.daemon import build_isolation
from nodeagent.agent.manager import SlotManager
from nodeagent.agent.recovery import Manifests
from nodeagent.agent.state import StateStore
from nodeagent.agent.under_systemd import (
    CgroupLayout,
    cgroup_layout,
    check_slot_cgroups,
    remember_stopped_workers,
    stop_requested,
    take_stopped_workers,
)
from nodeagent.cgroups import CgroupHost
from nodeagent.cgroups.delegation import ProcessPlacement
from nodeagent.cgroups.systemd import DelegationLost
from nodeagent.errors import CgroupError, ConfigError
from nodeagent.isolation.backend import NoIsolation
from nodeagent.schema.request import parse_slot_request
from tests.agent.test_manager import TOPOLOGY, WORKER, FakeIsolation, FakeRuntime, World, guaranteed
from tests.trees import write_tree

AGENT_UNIT = "nodeagent.slice/nodeagent.service"
SLOTS_UNIT = "nodeagent.slice/nodeagent-slots.service"
CONTROLLERS = "cpuset cpu io memory pids\n"


class Systemctl:
    def __init__(self, **answers: str) -> None:
        self.answers = answers
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str]) -> str:
        self.calls.append(list(argv))
        verb = argv[0].replace("-", "_")
        if verb not in self.answers:
            raise CgroupError(f"systemctl {argv[0]} failed")
        return self.answers[verb]


def show(slots_cgroup: str = SLOTS_UNIT, slots_active: str = "active") -> str:
    return (
        f"Id=nodeagent.service\nLoadState=loaded\nActiveState=activating\nControlGroup=/{AGENT_UNIT}\n"
        f"Delegate=no\nPartOf=nodeagent-slots.service\n\nId=nodeagent-slots.service\nLoadState=loaded\nActiveState={slots_active}\n"
        f"ControlGroup={'/' + slots_cgroup if slots_cgroup else ''}\nDelegate=yes\n"
    )


@pytest.fixture
def machine(tmp_path: Path) -> dict[str, Path]:
    """A fake host: / with systemd's mark, /proc/self/cgroup, and a pure-v2 cgroupfs in which
    systemd delegated SLOTS_UNIT, with its pin (a pid that is not ours) still in the delegated cgroup."""
    fs_root, proc, cgroupfs = tmp_path / "root", tmp_path / "proc", tmp_path / "cgroup"
    (fs_root / "run/systemd/system").mkdir(parents=True)
    write_tree(proc, {"self/cgroup": f"0::/{AGENT_UNIT}\n"})
    write_tree(
        cgroupfs,
        {
            "cgroup.controllers": CONTROLLERS,
            f"{SLOTS_UNIT}/cgroup.controllers": CONTROLLERS,
            f"{SLOTS_UNIT}/cgroup.subtree_control": "",
            f"{SLOTS_UNIT}/cgroup.procs": "1\n",
            f"{SLOTS_UNIT}/slots/cgroup.controllers": CONTROLLERS,
        },
    )
    return {"root": fs_root, "proc": proc, "cgroupfs": cgroupfs}


def fake_host(cgroupfs: Path) -> CgroupHost:
    return CgroupHost(mode="v2", v2_mount=cgroupfs, can_write=True, all_mounts=(cgroupfs,))


def test_without_systemd_slots_go_under_the_configured_parent(machine: dict[str, Path]) -> None:
    (machine["root"] / "run/systemd/system").rmdir()
    systemctl = Systemctl()
    layout = cgroup_layout(
        AgentConfig(),
        fake_host(machine["cgroupfs"]),
        fs_root=machine["root"],
        proc_root=machine["proc"],
        run=systemctl,
    )
    assert (layout.parent, layout.unit, layout.refused, layout.placement.delegation) == (
        "nodeagent.slice",
        None,
        None,
        None,
    )
    assert systemctl.calls == []


def test_delegation_off_keeps_the_configured_parent_under_systemd(machine: dict[str, Path]) -> None:
    config = apply_overrides(AgentConfig(), systemd_delegation="off")
    layout = cgroup_layout(
        config, fake_host(machine["cgroupfs"]), fs_root=machine["root"], proc_root=machine["proc"]
    )
    assert (layout.parent, layout.unit, layout.placement.delegation) == (
        "nodeagent.slice",
        "nodeagent.service",
        None,
    )


def test_under_systemd_slots_go_below_the_delegated_cgroup(machine: dict[str, Path]) -> None:
    cgroupfs = machine["cgroupfs"]
    layout = cgroup_layout(
        AgentConfig(),
        fake_host(cgroupfs),
        fs_root=machine["root"],
        proc_root=machine["proc"],
        run=Systemctl(show=show()),
    )
    assert layout.parent == f"{SLOTS_UNIT}/slots"
    assert layout.unit == "nodeagent.service"
    assert layout.host.delegation_root == SLOTS_UNIT
    assert layout.placement.procs_files("keeper") == (cgroupfs / SLOTS_UNIT / "keeper/cgroup.procs",)
    # systemd's pin left the delegated cgroup, which then enabled controllers for the slots.
    assert (cgroupfs / SLOTS_UNIT / "pin/cgroup.procs").read_text() == "1\n"
    assert (cgroupfs / SLOTS_UNIT / "cgroup.subtree_control").read_text() == "+pids"
    assert (cgroupfs / SLOTS_UNIT / "slots").is_dir()


def test_no_delegation_means_no_isolation_and_says_why(machine: dict[str, Path]) -> None:
    host = fake_host(machine["cgroupfs"])
    run = Systemctl(show=show(slots_active="inactive"))
    layout = cgroup_layout(AgentConfig(), host, fs_root=machine["root"], proc_root=machine["proc"], run=run)
    assert layout.refused is not None
    assert "delegates none to the agent" in layout.refused
    isolation = build_isolation(AgentConfig(), TOPOLOGY, host, layout)
    assert isinstance(isolation, NoIsolation)
    assert isolation.degraded() == (layout.refused,)
    assert not (machine["cgroupfs"] / SLOTS_UNIT / "slots/cgroup.procs").exists()


def test_a_removed_delegated_cgroup_restarts_its_unit(machine: dict[str, Path]) -> None:
    run = Systemctl(show=show(slots_cgroup=""), restart="")
    with pytest.raises(DelegationLost):
        cgroup_layout(
            AgentConfig(),
            fake_host(machine["cgroupfs"]),
            fs_root=machine["root"],
            proc_root=machine["proc"],
            run=run,
        )
    assert run.calls[-1] == ["restart", "--no-block", "--", "nodeagent-slots.service"]


# --------------------------------------------------------------------------- slots made elsewhere


@pytest.fixture
def manager(tmp_path: Path) -> Any:
    world = World()
    managers: list[SlotManager] = []

    def build(restart: frozenset[str] = frozenset()) -> SlotManager:
        store = StateStore(tmp_path / "state.db", manifests=Manifests(tmp_path / "slots"))
        made = SlotManager(store, TOPOLOGY, FakeIsolation(world), FakeRuntime(world))
        managers.append(made)
        made.start(supervise=False, restart_workers=restart)
        return made

    build.world = world  # type: ignore[attr-defined]
    yield build
    for made in managers:
        made.close()


def test_slots_made_outside_the_parent_are_refused_by_name(manager: Any, tmp_path: Path) -> None:
    first = manager()
    first.allocate(parse_slot_request(guaranteed("web")))
    store = StateStore(tmp_path / "state.db")
    try:
        check_slot_cgroups(store, "test.slice")  # where they are: fine
        with pytest.raises(ConfigError, match=r"outside the cgroup parent .*slots: web \(test.slice/"):
            check_slot_cgroups(store, f"{SLOTS_UNIT}/slots")
    finally:
        store.close()


# --------------------------------------------------------------------------- what a SIGTERM asks


@pytest.mark.parametrize(
    ("jobs", "signum", "expected"),
    [
        pytest.param("79 nodeagent.service stop running\n", signal.SIGTERM, True, id="systemctl-stop"),
        pytest.param("57 nodeagent.service restart running\n", signal.SIGTERM, False, id="systemctl-restart"),
        pytest.param("", signal.SIGTERM, False, id="systemctl-kill"),
        pytest.param("79 nodeagent.service stop running\n", None, False, id="no-signal"),
        pytest.param(None, signal.SIGTERM, False, id="systemctl-fails-keep"),
    ],
)
def test_stop_requested_under_systemd(jobs: str | None, signum: int | None, expected: bool) -> None:
    run = Systemctl() if jobs is None else Systemctl(list_jobs=jobs)
    assert stop_requested("nodeagent.service", signum, run) is expected


@pytest.mark.parametrize(
    ("signum", "expected"), [(signal.SIGTERM, True), (signal.SIGINT, True), (None, False)]
)
def test_stop_requested_without_systemd(signum: int | None, expected: bool) -> None:
    assert stop_requested(None, signum, Systemctl()) is expected


def test_the_record_of_stopped_workers_is_read_once(tmp_path: Path) -> None:
    assert take_stopped_workers(tmp_path) == frozenset()
    remember_stopped_workers(tmp_path, ["b", "a"])
    assert take_stopped_workers(tmp_path) == frozenset({"a", "b"})
    assert take_stopped_workers(tmp_path) == frozenset()
    (tmp_path / "workers-stopped-with-agent.json").write_text("{not json")
    assert take_stopped_workers(tmp_path) == frozenset()


@pytest.mark.parametrize("restart", [True, False], ids=["stopped-with-agent", "exited-on-its-own"])
def test_workers_stopped_with_the_agent_come_back_with_the_next_one(manager: Any, restart: bool) -> None:
    first = manager()
    body = {**guaranteed("web"), "worker": {**WORKER, "restart": "never"}}
    slot = first.allocate(parse_slot_request(body)).slot
    process = manager.world.processes[slot.id]
    assert first.running_worker_slots() == [slot.id]
    assert first.stop_workers(timeout=5) == [slot.id]
    assert process.signals == [signal.SIGTERM]
    assert first.get_slot(slot.id).worker.phase == "stopped"
    first.close()
    second = manager(frozenset({slot.id}) if restart else frozenset())
    # A worker the agent stopped comes back; one that ended by itself keeps its restart policy (never).
    assert second.report.workers_started == (["web"] if restart else [])
    assert manager.world.launches == [slot.id] * (2 if restart else 1)


def test_config_keys_and_their_errors() -> None:
    config = parse_config(
        {"workers": {"on_agent_stop": "stop"}, "systemd": {"slots_unit": "x-slots.service"}}
    )
    assert config.workers.on_agent_stop == "stop"
    assert config.systemd == SystemdConfig(delegation="auto", slots_unit="x-slots.service")
    for section, key, value, says in [
        ("workers", "on_agent_stop", "pause", 'expected "keep"'),
        ("systemd", "delegation", "yes", 'expected "auto"'),
        ("systemd", "slots_unit", "x.slice", "expected a service unit name"),
    ]:
        with pytest.raises(ConfigError, match=f"{section}.{key} is '{value}'; {says}"):
            parse_config({section: {key: value}})
    with pytest.raises(ConfigError, match="--on-agent-stop is 'pause'"):
        apply_overrides(AgentConfig(), on_agent_stop="pause")
    assert apply_overrides(AgentConfig(), on_agent_stop="stop").workers.on_agent_stop == "stop"


def test_a_layout_is_only_what_it_says(machine: dict[str, Path]) -> None:
    """build_isolation takes the slots' parent from the layout, not from the configuration."""
    host = dataclasses.replace(fake_host(machine["cgroupfs"]), delegation_root=SLOTS_UNIT)
    layout = CgroupLayout(host, f"{SLOTS_UNIT}/slots", ProcessPlacement(host, None), "nodeagent.service")
    if os.geteuid() != 0:
        pytest.skip("build_isolation isolates only as root")
    isolation = build_isolation(AgentConfig(), TOPOLOGY, host, layout)
    assert isolation.isolator.hierarchy.parent == f"{SLOTS_UNIT}/slots"  # type: ignore[attr-defined]
