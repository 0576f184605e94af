"""Finding the cgroup systemd delegates (pure decisions on what systemctl and /proc say), and placing
processes in it: on fake v2 trees, and on this host's real cgroup v1 hierarchies."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from nodeagent.cgroups import CgroupHost, open_manager, remove_subtree
from nodeagent.cgroups.delegation import Delegation, ProcessPlacement, prepare
from nodeagent.cgroups.systemd import (
    DelegationLost,
    NoDelegation,
    UnitState,
    booted,
    discover,
    own_cgroup,
    parse_show,
    pending_job,
    resolve,
    show_units,
    unit_of,
)
from nodeagent.errors import CgroupError
from tests.cgroups.conftest import unique_name
from tests.trees import write_tree

AGENT_UNIT = "nodeagent.slice/nodeagent.service"
SLOTS_UNIT = "nodeagent.slice/nodeagent-slots.service"


def unit(
    name: str, cgroup: str = "", *, delegate: bool = True, active: str = "active", part_of: str = ""
) -> UnitState:
    return UnitState(name, "loaded", active, cgroup, delegate, tuple(part_of.split()))


def agent_unit(**extra: Any) -> UnitState:
    """nodeagent.service as installed: part of the slots unit."""
    return unit("nodeagent.service", AGENT_UNIT, part_of="nodeagent-slots.service", **extra)


SLOTS_ACTIVE = unit("nodeagent-slots.service", SLOTS_UNIT)


# --------------------------------------------------------------------------- resolve


@pytest.mark.parametrize(
    ("own", "own_unit", "slots_unit", "expected"),
    [
        pytest.param(
            f"{AGENT_UNIT}/agent",
            unit("nodeagent.service", AGENT_UNIT),
            None,
            Delegation(AGENT_UNIT, "nodeagent.service", agent_leaf="agent"),
            id="own-unit-put-us-in-a-subgroup",
        ),
        pytest.param(
            "system.slice/run-r1.scope",
            unit("run-r1.scope", "system.slice/run-r1.scope"),
            SLOTS_ACTIVE,
            Delegation("system.slice/run-r1.scope", "run-r1.scope", agent_leaf="agent"),
            id="delegated-scope-wins-over-the-slots-unit",
        ),
        pytest.param(
            AGENT_UNIT,
            agent_unit(),
            SLOTS_ACTIVE,
            Delegation(SLOTS_UNIT, "nodeagent-slots.service", pinned=True),
            id="delegated-service-in-its-own-cgroup-uses-the-slots-unit",
        ),
        pytest.param(
            AGENT_UNIT,
            agent_unit(delegate=False),
            SLOTS_ACTIVE,
            Delegation(SLOTS_UNIT, "nodeagent-slots.service", pinned=True),
            id="plain-service-uses-the-slots-unit",
        ),
        pytest.param(
            "elsewhere.slice/x.service",
            agent_unit(),
            SLOTS_ACTIVE,
            Delegation(SLOTS_UNIT, "nodeagent-slots.service", pinned=True),
            id="own-cgroup-outside-own-unit-is-not-a-subgroup",
        ),
    ],
)
def test_resolve(own: str, own_unit: UnitState, slots_unit: UnitState | None, expected: Delegation) -> None:
    assert resolve(own, own_unit, slots_unit) == expected


@pytest.mark.parametrize(
    ("own_unit", "slots_unit", "error", "says"),
    [
        pytest.param(
            unit("nodeagent.service", AGENT_UNIT),
            UnitState("nodeagent-slots.service", "not-found", "inactive", "", False),
            NoDelegation,
            "nodeagent-slots.service \\(not-found",
            id="delegated-service-without-slots-unit",
        ),
        pytest.param(
            agent_unit(),
            unit("nodeagent-slots.service", "", active="inactive"),
            NoDelegation,
            "systemctl start nodeagent",
            id="slots-unit-inactive",
        ),
        pytest.param(
            agent_unit(),
            unit("nodeagent-slots.service", SLOTS_UNIT, delegate=False),
            NoDelegation,
            "no Delegate=",
            id="slots-unit-not-delegated",
        ),
        pytest.param(
            agent_unit(),
            unit("nodeagent-slots.service", ""),
            DelegationLost,
            "systemctl restart nodeagent-slots.service",
            id="slots-unit-active-but-its-cgroup-was-removed",
        ),
        pytest.param(
            unit("session-3.scope", "user.slice/user-0.slice/session-3.scope", delegate=False),
            SLOTS_ACTIVE,
            NoDelegation,
            "which is not PartOf= nodeagent-slots.service",
            id="an-agent-from-a-shell-never-takes-the-services-slots",
        ),
        pytest.param(
            None,
            SLOTS_ACTIVE,
            NoDelegation,
            "\\(no unit\\), which is not PartOf=",
            id="an-agent-outside-any-unit-neither",
        ),
    ],
)
def test_resolve_refuses_with_what_to_do(
    own_unit: UnitState | None, slots_unit: UnitState, error: type[Exception], says: str
) -> None:
    with pytest.raises(error, match=says):
        resolve(AGENT_UNIT, own_unit, slots_unit)


def test_a_subgroup_named_like_the_agents_own_leaves_is_refused() -> None:
    with pytest.raises(CgroupError, match="names agent, keeper, pin and slots are the agent's own"):
        resolve(f"{AGENT_UNIT}/slots", unit("nodeagent.service", AGENT_UNIT), None)


def test_delegation_of_the_root_is_refused() -> None:
    with pytest.raises(CgroupError, match="the cgroup root itself"):
        Delegation("/", "weird.service")


def test_delegation_paths() -> None:
    delegation = Delegation("/" + SLOTS_UNIT + "/", "nodeagent-slots.service", pinned=True)
    assert delegation.root == SLOTS_UNIT
    assert delegation.slots_parent == f"{SLOTS_UNIT}/slots"
    assert delegation.leaf("keeper") == f"{SLOTS_UNIT}/keeper"
    assert delegation.contains(f"{SLOTS_UNIT}/slots/burstable/x")
    assert not delegation.contains(f"{SLOTS_UNIT}-other/slots")
    with pytest.raises(CgroupError, match="not a process leaf"):
        delegation.leaf("slots")


# --------------------------------------------------------------------------- what systemd and /proc say


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("0::/nodeagent.slice/nodeagent.service\n", AGENT_UNIT, id="v2"),
        pytest.param(
            "12:memory:/x\n1:name=systemd:/system.slice/a.service\n0::/system.slice/a.service\n",
            "system.slice/a.service",
            id="hybrid",
        ),
        pytest.param(
            "3:cpu,cpuacct:/\n1:name=systemd:/system.slice/a.service\n", "system.slice/a.service", id="v1"
        ),
        pytest.param("0::/\n", "", id="root"),
        pytest.param("4:memory:/\n", None, id="no-systemd-hierarchy"),
    ],
)
def test_own_cgroup(text: str, expected: str | None) -> None:
    assert own_cgroup(text) == expected


@pytest.mark.parametrize(
    ("cgroup", "expected"),
    [
        (AGENT_UNIT, "nodeagent.service"),
        (f"{AGENT_UNIT}/agent", "nodeagent.service"),
        ("user.slice/user-0.slice/user@0.service/app.slice/x.service", "user@0.service"),
        ("init.scope", "init.scope"),
        ("system.slice", None),
        ("", None),
        ("natest.slice/raw-dir", None),
    ],
)
def test_unit_of(cgroup: str, expected: str | None) -> None:
    assert unit_of(cgroup) == expected


def test_parse_show_reads_every_block() -> None:
    text = (
        "Id=nodeagent.service\nLoadState=loaded\nActiveState=active\n"
        f"ControlGroup=/{AGENT_UNIT}\nDelegate=no\nPartOf=nodeagent-slots.service other.service\n\n"
        "Id=nodeagent-slots.service\nLoadState=not-found\nActiveState=inactive\nControlGroup=\nDelegate=no\n"
    )
    assert parse_show(text) == [
        UnitState(
            "nodeagent.service",
            "loaded",
            "active",
            AGENT_UNIT,
            False,
            ("nodeagent-slots.service", "other.service"),
        ),
        UnitState("nodeagent-slots.service", "not-found", "inactive", "", False),
    ]


class Systemctl:
    """A stand-in for systemctl: records each argv, answers from a table of argv prefixes."""

    def __init__(self, answers: dict[str, str]) -> None:
        self.answers = answers
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str]) -> str:
        self.calls.append(list(argv))
        for prefix, answer in self.answers.items():
            if argv[0] == prefix:
                return answer
        raise CgroupError(f"unexpected systemctl {argv}")


def test_show_units_asks_once_for_every_unit() -> None:
    systemctl = Systemctl(
        {"show": "Id=a.service\nLoadState=loaded\nActiveState=active\nControlGroup=/x/a.service\n"}
    )
    units = show_units(["a.service", "b.service", "a.service"], systemctl)
    assert systemctl.calls == [
        [
            "show",
            "--property=Id,LoadState,ActiveState,ControlGroup,Delegate,PartOf",
            "--",
            "a.service",
            "b.service",
        ]
    ]
    assert units == {"a.service": UnitState("a.service", "loaded", "active", "x/a.service", False)}


def test_discover_reads_proc_and_asks_systemd(tmp_path: Path) -> None:
    write_tree(tmp_path, {"self/cgroup": f"0::/{AGENT_UNIT}\n"})
    systemctl = Systemctl(
        {
            "show": (
                f"Id=nodeagent.service\nLoadState=loaded\nActiveState=active\nControlGroup=/{AGENT_UNIT}\n"
                f"Delegate=no\nPartOf=nodeagent-slots.service\n\nId=nodeagent-slots.service\nLoadState=loaded\nActiveState=active\n"
                f"ControlGroup=/{SLOTS_UNIT}\nDelegate=yes\n"
            )
        }
    )
    delegation, own = discover(tmp_path, run=systemctl)
    assert own == "nodeagent.service"
    assert delegation == Delegation(SLOTS_UNIT, "nodeagent-slots.service", pinned=True)


@pytest.mark.parametrize(
    ("listing", "expected"),
    [
        ("57 nodeagent.service restart running\n", "restart"),
        ("79 nodeagent.service stop running\n", "stop"),
        ("80 other.service stop waiting\n", None),
        ("", None),
    ],
)
def test_pending_job(listing: str, expected: str | None) -> None:
    systemctl = Systemctl({"list-jobs": listing})
    assert pending_job("nodeagent.service", systemctl) == expected
    assert systemctl.calls == [["list-jobs", "--no-legend", "--no-pager", "--", "nodeagent.service"]]


def test_booted_is_the_sd_booted_mark(tmp_path: Path) -> None:
    assert not booted(tmp_path)
    (tmp_path / "run/systemd/system").mkdir(parents=True)
    assert booted(tmp_path)


# --------------------------------------------------------------------------- placing processes (v2 fakes)


def v2_host(tmp_path: Path, root_procs: Sequence[int] = (), pin: Sequence[int] = ()) -> CgroupHost:
    """A fake pure-v2 tree in which systemd delegated SLOTS_UNIT (controllers available, none enabled)."""
    controllers = "cpuset cpu io memory pids\n"
    write_tree(
        tmp_path,
        {
            "cgroup.controllers": controllers,
            "cgroup.subtree_control": controllers,
            "nodeagent.slice/cgroup.controllers": controllers,
            "nodeagent.slice/cgroup.subtree_control": controllers,
            f"{SLOTS_UNIT}/cgroup.controllers": controllers,
            f"{SLOTS_UNIT}/cgroup.subtree_control": "",
            f"{SLOTS_UNIT}/cgroup.procs": "".join(f"{pid}\n" for pid in root_procs),
            f"{SLOTS_UNIT}/pin/cgroup.procs": "".join(f"{pid}\n" for pid in pin),
            f"{SLOTS_UNIT}/keeper/cgroup.procs": "",
            f"{SLOTS_UNIT}/slots/cgroup.controllers": controllers,
            f"{SLOTS_UNIT}/slots/cgroup.subtree_control": "",
        },
    )
    return CgroupHost(
        mode="v2",
        v2_mount=tmp_path,
        controllers=frozenset(controllers.split()),
        v2_controllers=frozenset(controllers.split()),
        can_write=True,
        delegation_root=SLOTS_UNIT,
        all_mounts=(tmp_path,),
    )


def test_prepare_moves_the_pin_out_of_the_delegated_cgroup_then_enables_controllers(tmp_path: Path) -> None:
    host = v2_host(tmp_path, root_procs=[4242])
    placement = ProcessPlacement(host, Delegation(SLOTS_UNIT, "nodeagent-slots.service", pinned=True))
    assert prepare(placement) == [4242]
    assert (tmp_path / SLOTS_UNIT / "pin/cgroup.procs").read_text() == "4242\n"
    # The controllers the slots need, enabled on the delegated cgroup (one write per controller) ...
    assert (tmp_path / SLOTS_UNIT / "cgroup.subtree_control").read_text() == "+pids"
    # ... and never above it: those are systemd's.
    assert (tmp_path / "nodeagent.slice/cgroup.subtree_control").read_text() == "cpuset cpu io memory pids\n"


def test_prepare_moves_the_agent_into_its_leaf(tmp_path: Path) -> None:
    host = v2_host(tmp_path, root_procs=[os.getpid()])
    write_tree(tmp_path, {f"{SLOTS_UNIT}/agent/cgroup.procs": ""})
    placement = ProcessPlacement(host, Delegation(SLOTS_UNIT, "x.scope", agent_leaf="agent"))
    assert prepare(placement) == [os.getpid()]
    assert (tmp_path / SLOTS_UNIT / "agent/cgroup.procs").read_text() == f"{os.getpid()}\n"


def test_without_a_delegation_processes_stay_where_they_start(tmp_path: Path) -> None:
    placement = ProcessPlacement(v2_host(tmp_path), None)
    assert placement.procs_files("keeper") == ()
    assert placement.command("keeper", ["/bin/true"]) == ["/bin/true"]
    assert prepare(placement) == []


def test_a_helper_starts_inside_its_leaf(tmp_path: Path) -> None:
    """The wrapper writes the pid that then becomes the helper: the helper never runs elsewhere."""
    placement = ProcessPlacement(v2_host(tmp_path), Delegation(SLOTS_UNIT, "nodeagent-slots.service"))
    argv = placement.command("keeper", ["/bin/sh", "-c", "echo $$"])
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30).stdout
    assert (tmp_path / SLOTS_UNIT / "keeper/cgroup.procs").read_text() == out


def test_a_helper_whose_leaf_refuses_it_does_not_run(tmp_path: Path) -> None:
    placement = ProcessPlacement(v2_host(tmp_path), Delegation(SLOTS_UNIT, "nodeagent-slots.service"))
    argv = placement.command("keeper", ["/bin/sh", "-c", "echo ran"])
    (tmp_path / SLOTS_UNIT / "keeper/cgroup.procs").unlink()
    (tmp_path / SLOTS_UNIT / "keeper/cgroup.procs").mkdir()  # a write fails, whoever tries
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)
    assert (proc.returncode, proc.stdout) == (126, "")


def test_the_v2_manager_never_creates_above_the_delegated_cgroup(tmp_path: Path) -> None:
    host = v2_host(tmp_path)
    (tmp_path / SLOTS_UNIT / "slots/cgroup.controllers").unlink()
    for name in ("cgroup.controllers", "cgroup.subtree_control", "cgroup.procs"):
        (tmp_path / SLOTS_UNIT / name).unlink()
    for leaf in ("pin", "keeper", "slots"):
        for child in (tmp_path / SLOTS_UNIT / leaf).iterdir():
            child.unlink()
        (tmp_path / SLOTS_UNIT / leaf).rmdir()
    (tmp_path / SLOTS_UNIT).rmdir()  # systemd removed the delegated cgroup
    with pytest.raises(CgroupError, match=r"is the delegated cgroup .* or lies above it"):
        open_manager(host, f"{SLOTS_UNIT}/slots/web").create()
    assert not (tmp_path / SLOTS_UNIT).exists()


# --------------------------------------------------------------------------- placing processes (real v1)


@pytest.mark.root
@pytest.mark.kernel
def test_a_helper_joins_its_leaf_in_every_v1_hierarchy(real_host: CgroupHost) -> None:
    """This host's kernel runs cgroup v1 (hybrid): the leaf is made in each controller hierarchy, the
    cpuset one with its parent's CPUs, and the helper is in all of them from its first instruction."""
    if not real_host.v1_mounts:
        pytest.skip(f"no cgroup v1 hierarchies here (mode {real_host.mode})")
    root = f"{unique_name()}.slice/nodeagent-slots.service"
    placement = ProcessPlacement(real_host, Delegation(root, "nodeagent-slots.service", pinned=True))
    process = subprocess.Popen(placement.command("keeper", ["/bin/sleep", "60"]))
    try:
        deadline = time.monotonic() + 10
        # Once the helper runs (the wrapper exec'd it), every join is done.
        while not Path(f"/proc/{process.pid}/cmdline").read_bytes().startswith(b"/bin/sleep\0"):
            assert time.monotonic() < deadline, "the helper never started"
            time.sleep(0.01)
        lines = {
            line.split(":")[1]: line.split(":")[2]
            for line in Path(f"/proc/{process.pid}/cgroup").read_text().split()
        }
        for controller in ("cpuset", "memory", "pids"):
            key = next(k for k in lines if controller in k.split(","))
            assert lines[key] == f"/{root}/keeper", controller
        assert placement.pids("keeper") == [process.pid]
    finally:
        process.kill()
        process.wait()
        remove_subtree(real_host, root.split("/", 1)[0])
