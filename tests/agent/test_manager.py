"""SlotManager with a fake kernel and a fake launcher: sequencing, idempotency, refusals, and
reconcile of every crash state (pending, releasing, orphans, vanished cgroup, dead worker)."""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import signal
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from nodeagent.agent.manager import SlotManager
from nodeagent.agent.recovery import Manifests, RecoveryMode, UnexplainedSlots
from nodeagent.agent.slot import Slot, SlotState, Worker
from nodeagent.agent.state import StateStore
from nodeagent.devices.synthetic import synthetic_topology
from nodeagent.errors import CgroupError, Conflict, InvalidRequest, NotFound, PlacementError, Unsupported
from nodeagent.isolation.backend import NoIsolation, OwnedSlot
from nodeagent.isolation.isolator import AppliedSlot
from nodeagent.isolation.network import SlotNetwork
from nodeagent.isolation.slot_spec import AllowedHostPort, SlotIsolationSpec, SlotNetworkSpec
from nodeagent.placement import Allocated, Assignment
from nodeagent.runtime.env import SlotDescription
from nodeagent.runtime.launch_request import LaunchRequest
from nodeagent.runtime.logs import LogLine
from nodeagent.runtime.process import ExitRecord
from nodeagent.runtime.sandbox import SandboxSpec
from nodeagent.runtime.supervisor import Supervisor
from nodeagent.runtime.workers import Readoption
from nodeagent.schema.request import ResourcesPatch, parse_slot_request
from nodeagent.schema.worker import WorkerSpec, parse_worker_spec

TOPOLOGY = synthetic_topology(sockets=1, numa_per_socket=2, cores_per_numa=4, threads_per_core=2)
WORKER = {"command": ["/bin/sleep", "1000"], "restart": "always"}


# --------------------------------------------------------------------------- fakes


@dataclass
class FakeProcess:
    pid: int
    exit: ExitRecord | None = None
    signals: list[int] = field(default_factory=list)

    def poll(self, now: float | None = None) -> ExitRecord | None:
        return self.exit

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)
        if sig == signal.SIGTERM:
            self.exit = ExitRecord(None, sig, False, 0.0, "signaled")

    def close(self) -> None:
        return None


@dataclass
class World:
    """The kernel and the processes: what survives when the agent (a SlotManager) dies."""

    cgroups: dict[str, dict[str, Any]] = field(default_factory=dict)
    netns: set[str] = field(default_factory=set)
    processes: dict[str, FakeProcess] = field(default_factory=dict)
    launches: list[str] = field(default_factory=list)
    fail_apply: set[str] = field(default_factory=set)
    #: slot names whose apply fails after their cgroup exists, and whether release fails
    fail_apply_late: set[str] = field(default_factory=set)
    fail_release: bool = False
    #: the cgroups present when the manager prepared the hierarchy (the pool is made true then)
    prepared_with: set[str] | None = None
    next_pid: int = 1000


class FakeIsolation:
    """The kernel side: cgroups and netns are entries in ``world``; ``names`` maps slot ids to names
    (the store's), so tests can make the isolation of a slot they know by name fail."""

    def __init__(
        self,
        world: World,
        names: Callable[[str], str] = lambda slot_id: slot_id,
        degraded: tuple[str, ...] = (),
    ) -> None:
        self.world = world
        self._names = names
        self._degraded = degraded
        #: the last spec applied per slot id: what the manager asked isolation for
        self.specs: dict[str, SlotIsolationSpec] = {}

    @property
    def cgroup_mode(self) -> str:
        return "v1"

    @property
    def isolates(self) -> bool:
        return True

    def degraded(self) -> tuple[str, ...]:
        return self._degraded

    def prepare(self) -> None:
        self.world.prepared_with = set(self.world.cgroups)

    def apply(self, spec: SlotIsolationSpec) -> AppliedSlot:
        self.specs[spec.slot_id] = spec
        name = self._names(spec.slot_id)
        if name in self.world.fail_apply:
            raise CgroupError(f"cannot write cpuset of {spec.slot_id}")
        for other, body in self.world.cgroups.items():
            # A shared slot's cpuset is the pool, which the real isolator shrinks for exclusive CPUs.
            if (
                other != spec.slot_id
                and spec.exclusive
                and body["exclusive"]
                and set(body["cpus"]) & spec.cpus
            ):
                raise AssertionError(f"CPUs of {spec.slot_id} already held by {other} in the kernel")
        cpus = sorted(spec.cpus)
        cgroup = f"test.slice/{spec.slot_id}"
        body: dict[str, Any] = {"cgroup": cgroup, "cpus": cpus, "exclusive": spec.exclusive}
        network = None
        if spec.network is not None:
            self.world.netns.add(spec.slot_id)
            network = fake_network(spec.slot_id)
        self.world.cgroups[spec.slot_id] = body
        if name in self.world.fail_apply_late:
            raise CgroupError(f"cannot write memory limit of {spec.slot_id}")
        applied = fake_applied(spec.slot_id, spec.qos, spec.cpus)
        return dataclasses.replace(applied, mems=spec.mems, memory_max=spec.memory_bytes, network=network)

    def exists(self, applied: AppliedSlot) -> bool:
        return applied.slot_id in self.world.cgroups

    def release(self, slot_id: str) -> None:
        if self.world.fail_release:
            raise CgroupError(f"cannot remove the cgroup of {slot_id}: EBUSY")
        self.world.cgroups.pop(slot_id, None)
        self.world.netns.discard(slot_id)
        process = self.world.processes.get(slot_id)
        if process is not None and process.exit is None:
            process.exit = ExitRecord(None, signal.SIGKILL, False, 0.0, "signaled")

    def owned_slots(self) -> list[OwnedSlot]:
        owned = []
        for slot_id, body in self.world.cgroups.items():
            process = self.world.processes.get(slot_id)
            pids = (process.pid,) if process is not None and process.exit is None else ()
            qos = "guaranteed" if body.get("exclusive") else "burstable"
            applied = fake_applied(slot_id, qos, frozenset(body["cpus"]))
            owned.append(OwnedSlot(slot_id, qos, applied, pids))
        return owned

    def remove_orphans(self, keep: Collection[str]) -> list[str]:
        gone = [s for s in self.world.cgroups if s not in keep]
        for slot_id in gone:
            self.release(slot_id)
        stray = [n for n in self.world.netns if n not in keep]
        self.world.netns -= set(stray)
        return [f"cgroup {s}" for s in gone] + [f"netns {n}" for n in stray]


def fake_applied(slot_id: str, qos: str, cpus: frozenset[int]) -> AppliedSlot:
    return AppliedSlot(
        slot_id=slot_id,
        qos=qos,
        cgroup=f"test.slice/{slot_id}",
        cgroup_version="v1",
        procs_files=(f"/fake/{slot_id}/cgroup.procs",),
        oom_events=None,
        cpus=cpus,
        mems=None,
        memory_max=None,
        sched_idle=False,
        oom_score_adj=0,
        device_rules=(),
    )


def fake_network(slot_id: str) -> SlotNetwork:
    return SlotNetwork(
        slot_id=slot_id,
        netns=f"na-{slot_id}",
        netns_path=Path(f"/run/netns/na-{slot_id}"),
        host_ifname=f"nah-{slot_id}",
        slot_ifname="eth0",
        subnet=ipaddress.IPv4Network("10.77.0.0/30"),
        host_address=ipaddress.IPv4Address("10.77.0.1"),
        slot_address=ipaddress.IPv4Address("10.77.0.2"),
    )


def shared_pool(world: World) -> set[int]:
    """The CPUs no exclusive cgroup holds, as the real isolator keeps the pool."""
    held = {cpu for body in world.cgroups.values() if body.get("exclusive") for cpu in body["cpus"]}
    return {cpu.id for cpu in TOPOLOGY.cpus} - held


@dataclass
class FakeCgroup:
    world: World
    slot_id: str

    def kill_all(self, timeout: float) -> None:
        process = self.world.processes.get(self.slot_id)
        if process is not None and process.exit is None:
            process.exit = ExitRecord(None, signal.SIGKILL, False, 0.0, "signaled")

    def signal_all(self, sig: int, but: int | None = None) -> None:
        process = self.world.processes.get(self.slot_id)
        if process is not None and process.pid != but:
            process.send_signal(sig)

    def oom_kill_count(self) -> int:
        return 0

    def pids(self) -> list[int]:
        process = self.world.processes.get(self.slot_id)
        return [process.pid] if process is not None and process.exit is None else []


@dataclass
class FakeLauncher:
    world: World
    slot_id: str

    def launch(self, req: LaunchRequest) -> FakeProcess:
        self.world.next_pid += 1
        process = FakeProcess(self.world.next_pid)
        self.world.processes[self.slot_id] = process
        self.world.launches.append(self.slot_id)
        return process


class FakeRuntime:
    def __init__(self, world: World) -> None:
        self.world = world

    def supervisor(
        self,
        slot: SlotDescription,
        applied: AppliedSlot | None,
        spec: WorkerSpec,
        sandbox: SandboxSpec | None = None,
    ) -> Supervisor:
        template = LaunchRequest(
            launch_id=slot.slot_id, argv=spec.command, env={}, run_dir="/x", log_dir="/x"
        )
        cgroup = FakeCgroup(self.world, slot.slot_id)
        return Supervisor(spec, template, FakeLauncher(self.world, slot.slot_id), cgroup)

    def readopt(self, slot_id: str, supervisor: Supervisor) -> Readoption:
        process = self.world.processes.get(slot_id)
        if process is None:
            return Readoption.NONE
        if process.exit is None:
            supervisor.resume(process)
            return Readoption.ADOPTED
        supervisor.resume_exited(process.exit)
        return Readoption.EXITED

    def logs(self, slot_id: str, lines: int) -> list[str]:
        return [line.render() for line in self.log_lines(slot_id, lines)]

    def log_lines(self, slot_id: str, lines: int, *, complete_only: bool = False) -> list[LogLine]:
        return [
            LogLine("stdout", f"{slot_id} line {n}", f"2026-12-03T08:00:0{n % 10}.000000000Z")
            for n in range(lines)
        ]

    def discard(
        self,
        slot_id: str,
        keep_logs_as: str | None = None,
        last_word: str | None = None,
        *,
        kind: object = None,
    ) -> None:
        return None

    def released_logs(self, key: str) -> str | None:
        return None

    def released_word(self, slot_id: str) -> str | None:
        return None

    def prune_released(self, before: float) -> list[str]:
        return []

    def reap(self, keep: Iterable[str]) -> list[str]:
        return []

    def close(self) -> None:
        return None


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def world() -> World:
    return World()


@pytest.fixture
def make(tmp_path: Path, world: World) -> Iterator[Any]:
    managers: list[SlotManager] = []

    def build(kernel: Any = None, recovery: RecoveryMode = RecoveryMode.REFUSE) -> SlotManager:
        store = StateStore(tmp_path / "state.db", manifests=Manifests(tmp_path / "slots"))
        isolation = kernel or FakeIsolation(world, names=lambda slot_id: store_name(store, slot_id))
        manager = SlotManager(store, TOPOLOGY, isolation, FakeRuntime(world), recovery=recovery)
        managers.append(manager)
        try:
            manager.start(supervise=False)
        except BaseException:
            store.close()
            managers.remove(manager)
            raise
        return manager

    yield build
    for manager in managers:
        manager.close()


def store_name(store: StateStore, slot_id: str) -> str:
    slot = store.get_slot(slot_id)
    return slot_id if slot is None else slot.name


def guaranteed(name: str = "web", cpus: int = 2, **extra: Any) -> dict[str, Any]:
    return {"name": name, "qos": "guaranteed", "resources": {"cpus": cpus, "memory": "1Gi", **extra}}


def held_cpus(manager: SlotManager) -> list[int]:
    cpus: list[int] = []
    for view in manager.list_slots():
        if view.state in (SlotState.PENDING, SlotState.READY, SlotState.RUNNING, SlotState.RELEASING):
            assert view.assignment is not None
            if view.assignment.exclusive:
                cpus += view.assignment.cpus
    return cpus


# --------------------------------------------------------------------------- allocate / idempotency


def test_allocate_applies_isolation_and_records_ready(make: Any, world: World) -> None:
    manager = make()
    result = manager.allocate(parse_slot_request(guaranteed()))
    assert result.created
    slot = result.slot
    assert slot.state is SlotState.READY
    assert slot.cgroup == f"test.slice/{slot.id}"
    assert slot.assignment is not None
    assert len(list(slot.assignment.cpus)) == 2
    assert world.cgroups[slot.id]["cpus"] == list(slot.assignment.cpus)
    assert manager.get_slot("web") == manager.get_slot(slot.id)
    assert not set(slot.assignment.cpus) & shared_pool(world)  # exclusive CPUs left the shared pool


def test_every_slot_event_is_one_structured_line_of_the_agents_log(
    make: Any, caplog: pytest.LogCaptureFixture
) -> None:
    manager = make()
    with caplog.at_level(logging.INFO, logger="nodeagent.events"):
        slot = manager.allocate(parse_slot_request(guaranteed())).slot
        manager.release(slot.id)
    told = [(r.event, r.slot, r.getMessage()) for r in caplog.records if r.name == "nodeagent.events"]  # type: ignore[attr-defined]
    assert [(kind, slot_id) for kind, slot_id, _ in told] == [("allocate", slot.id), ("release", slot.id)]
    assert told[-1][2] == "slot 'web' released"


def test_an_explicit_memory_of_0_is_refused_not_taken_for_unlimited(make: Any) -> None:
    manager = make()
    zero = {"name": "be", "qos": "best-effort", "resources": {"cpus": 0.5, "memory": 0}}
    with pytest.raises(InvalidRequest, match="0 is not a limit"):
        manager.allocate(parse_slot_request(zero))
    unbounded = manager.allocate(parse_slot_request({"name": "be", "qos": "best-effort"})).slot
    with pytest.raises(InvalidRequest, match="0 is not a limit"):
        manager.resize(unbounded.id, ResourcesPatch.model_validate({"memory": 0}))
    assert manager.get_slot("be").request.resources.memory == 0  # left as it was, unbounded


def test_rlimits_the_launch_could_not_set_are_refused_at_submit(make: Any, world: World) -> None:
    manager = make()
    worker = {"command": ["/bin/sleep", "60"], "rlimits": {"nofile": [1024, 10**32]}}
    with pytest.raises(InvalidRequest, match=r"worker\.rlimits\.nofile: the hard limit"):
        manager.allocate(parse_slot_request({**guaranteed(), "worker": worker}))
    assert manager.list_slots() == []


def test_a_private_tmpfs_larger_than_the_host_is_refused_at_submit(make: Any) -> None:
    manager = make()
    worker = {"command": ["/bin/sleep", "60"], "sandbox": {"tmp_size": "1Ei"}}
    with pytest.raises(InvalidRequest, match=r"worker\.sandbox\.tmp_size: 1Ei is more than this host"):
        manager.allocate(parse_slot_request({**guaranteed(), "worker": worker}))
    assert manager.list_slots() == []


def test_same_request_is_idempotent_and_different_is_conflict(make: Any) -> None:
    manager = make()
    first = manager.allocate(parse_slot_request(guaranteed()))
    again = manager.allocate(parse_slot_request(guaranteed()))
    assert not again.created
    assert again.slot.id == first.slot.id
    with pytest.raises(Conflict, match="different request"):
        manager.allocate(parse_slot_request(guaranteed(cpus=4)))
    assert len(manager.list_slots()) == 1


def test_placement_refusal_changes_nothing(make: Any, world: World) -> None:
    manager = make()
    with pytest.raises(PlacementError):
        manager.allocate(parse_slot_request(guaranteed(cpus=64)))
    assert manager.list_slots() == []
    assert world.cgroups == {}


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"name": "x", "qos": "gold"}, id="bad-qos"),
        pytest.param({"name": "../x", "qos": "burstable"}, id="bad-name"),
        pytest.param({**guaranteed(), "worker": {"command": "not-a-list"}}, id="bad-worker"),
    ],
)
def test_invalid_requests_are_refused_before_placement(make: Any, body: dict[str, Any]) -> None:
    manager = make()
    with pytest.raises(InvalidRequest):
        manager.allocate(parse_slot_request(body))
    assert manager.list_slots() == []


def test_isolation_failure_rolls_back_and_frees_resources(make: Any, world: World) -> None:
    manager = make()
    world.fail_apply.add("web")
    with pytest.raises(CgroupError):
        manager.allocate(parse_slot_request(guaranteed(cpus=8)))
    # No trace: the client has the error; the event log keeps why.
    assert manager.list_slots() == []
    assert any("isolation failed" in event["message"] for event in manager.events())
    assert world.cgroups == {}
    # Nothing is held: the same CPUs go to another slot, and a retry succeeds.
    assert manager.allocate(parse_slot_request(guaranteed("other", cpus=8))).created
    manager.release("other")
    world.fail_apply.clear()
    assert manager.allocate(parse_slot_request(guaranteed(cpus=8))).slot.state is SlotState.READY


def test_a_rollback_that_cannot_remove_the_cgroup_keeps_its_cpus(make: Any, world: World) -> None:
    manager = make()
    world.fail_apply_late.add("web")
    world.fail_release = True
    with pytest.raises(CgroupError):
        manager.allocate(parse_slot_request(guaranteed(cpus=8)))
    stuck = manager.get_slot("web")
    assert stuck.state is SlotState.RELEASING
    assert "removing its kernel objects failed too" in (stuck.reason or "")
    assert stuck.id in world.cgroups
    # Its CPUs are still in a cgroup, so they are not free: a slot wanting every CPU is refused.
    with pytest.raises(PlacementError):
        manager.allocate(parse_slot_request(guaranteed("big", cpus=len(TOPOLOGY.cpus) - 2)))
    world.fail_release = False
    manager.release("web")  # DELETE retries the release
    assert world.cgroups == {}
    assert manager.allocate(parse_slot_request(guaranteed("big", cpus=len(TOPOLOGY.cpus) - 2))).created


def test_no_cpu_is_handed_out_twice(make: Any) -> None:
    manager = make()

    def fill() -> None:
        for n in range(len(TOPOLOGY.cpus)):
            manager.allocate(parse_slot_request(guaranteed(f"s{n}", cpus=2)))

    with pytest.raises(PlacementError):  # fill the host until placement says no
        fill()
    cpus = held_cpus(manager)
    assert len(cpus) == len(set(cpus)) >= 8


def test_degraded_kernel_refuses_allocation(tmp_path: Path, world: World) -> None:
    store = StateStore(tmp_path / "db")
    kernel = NoIsolation(["cgroups are read-only: not root"])
    manager = SlotManager(store, TOPOLOGY, kernel, FakeRuntime(world))
    manager.start(supervise=False)
    try:
        assert manager.node().degraded == ("cgroups are read-only: not root",)
        with pytest.raises(Unsupported, match="allow_unisolated"):
            manager.allocate(parse_slot_request(guaranteed()))
    finally:
        manager.close()


def test_a_missing_mechanism_is_reported_but_does_not_stop_other_slots(make: Any, world: World) -> None:
    # A host without the network firewall still isolates everything else: the reason shows in
    # the node's degraded list, slots without a network are placed and isolated as usual, and
    # reconcile still removes orphans (it did nothing of that while any reason was listed).
    world.cgroups["orphan"] = {"cpus": [], "qos": "burstable"}
    reason = "network filtering: libnftables.so.1 cannot be loaded"
    manager = make(FakeIsolation(world, degraded=(reason,)))
    assert "orphan" not in world.cgroups
    assert manager.node().degraded == (reason,)
    slot = manager.allocate(parse_slot_request(guaranteed())).slot
    assert slot.state is SlotState.READY
    assert slot.cgroup is not None


def test_network_access_of_the_request_reaches_isolation(make: Any, world: World) -> None:
    kernel = FakeIsolation(world)
    manager = make(kernel)
    network = {"egress": "nat", "host_ports": [{"port": 9100}, {"port": 53, "protocol": "udp"}]}
    request = {"name": "web", "qos": "burstable", "resources": {"cpus": 1, "network": network}}
    slot = manager.allocate(parse_slot_request(request)).slot
    spec = kernel.specs[slot.id].network
    assert spec == SlotNetworkSpec(None, "nat", (AllowedHostPort(53, "udp"), AllowedHostPort(9100, "tcp")))
    plain = manager.allocate(parse_slot_request({**request, "name": "quiet", "resources": {"network": {}}}))
    assert kernel.specs[plain.slot.id].network == SlotNetworkSpec()


def test_degraded_kernel_with_unisolated_allowed(tmp_path: Path, world: World) -> None:
    store = StateStore(tmp_path / "db")
    manager = SlotManager(
        store, TOPOLOGY, NoIsolation(["no root"]), FakeRuntime(world), allow_unisolated=True
    )
    manager.start(supervise=False)
    try:
        slot = manager.allocate(parse_slot_request(guaranteed())).slot
        assert slot.state is SlotState.READY
        assert slot.cgroup is None
    finally:
        manager.close()


# --------------------------------------------------------------------------- release / resize / workers


def test_release_stops_the_worker_and_removes_everything(make: Any, world: World) -> None:
    manager = make()
    events: list[int] = []
    manager.subscribe(lambda: events.append(1))
    slot = manager.allocate(parse_slot_request({**guaranteed(), "worker": WORKER})).slot
    assert slot.worker is not None
    assert slot.worker.phase == "running"
    assert manager.get_slot(slot.id).state is SlotState.RUNNING
    process = world.processes[slot.id]
    manager.release(slot.id)
    assert signal.SIGTERM in process.signals
    assert world.cgroups == {}
    assert manager.list_slots() == []
    assert held_cpus(manager) == []
    assert events
    with pytest.raises(NotFound):
        manager.release(slot.id)


def test_resize_replans_and_reapplies(make: Any, world: World) -> None:
    manager = make()
    slot = manager.allocate(parse_slot_request(guaranteed(cpus=2))).slot
    resized = manager.resize(slot.id, ResourcesPatch.model_validate({"cpus": 4}))
    assert resized.assignment is not None
    assert len(list(resized.assignment.cpus)) == 4
    assert world.cgroups[slot.id]["cpus"] == list(resized.assignment.cpus)
    assert resized.request.resources.cpus == 4
    with pytest.raises(PlacementError):
        manager.resize(slot.id, ResourcesPatch.model_validate({"cpus": 64}))
    assert manager.get_slot(slot.id).assignment == resized.assignment


def test_resize_rolls_back_when_isolation_fails(make: Any, world: World) -> None:
    manager = make()
    slot = manager.allocate(parse_slot_request(guaranteed(cpus=2))).slot
    world.fail_apply.add("web")
    with pytest.raises(CgroupError):
        manager.resize(slot.id, ResourcesPatch.model_validate({"cpus": 4}))
    assert manager.get_slot(slot.id).assignment == slot.assignment
    assert len(held_cpus(manager)) == 2


class Crash(BaseException):
    """The agent dying at this instant: nothing of its own error handling runs."""


def test_a_resize_cut_short_by_a_crash_is_finished_at_start(make: Any, world: World) -> None:
    first = make()
    slot = first.allocate(parse_slot_request(guaranteed(cpus=2))).slot
    old_cpus = world.cgroups[slot.id]["cpus"]

    def die(spec: SlotIsolationSpec) -> AppliedSlot:
        raise Crash

    first.isolation.apply = die  # type: ignore[method-assign]
    with pytest.raises(Crash):  # the new assignment is committed, the kernel not yet changed
        first.resize(slot.id, ResourcesPatch.model_validate({"cpus": 4}))
    first.close()
    assert world.cgroups[slot.id]["cpus"] == old_cpus
    second = make()
    assert second.report.resized == ["web"]
    assignment = second.get_slot(slot.id).assignment
    assert assignment is not None
    assert len(assignment.cpus) == 4
    assert world.cgroups[slot.id]["cpus"] == sorted(assignment.cpus)
    third = make()  # a clean start after that finds nothing to finish
    assert third.report.resized == []


def test_worker_start_stop_and_restart_policy(make: Any, world: World) -> None:
    manager = make()
    slot = manager.allocate(parse_slot_request(guaranteed())).slot
    with pytest.raises(InvalidRequest, match="no worker"):
        manager.start_worker(slot.id, None)
    view = manager.start_worker(slot.id, parse_worker_spec({"command": ["/bin/true"], "restart": "never"}))
    assert view.state is SlotState.RUNNING
    world.processes[slot.id].exit = ExitRecord(1, None, False, 0.0, "exited")
    manager.tick()
    view = manager.get_slot(slot.id)
    assert view.state is SlotState.READY
    assert view.worker is not None
    assert view.worker.phase == "failed"
    assert view.worker.last_exit.code == 1
    assert manager.logs(slot.id, 3) == [
        f"{slot.id} line 1",
        f"{slot.id} line 2",
        "[agent] worker failed: worker exited with status 1",
    ]


def test_a_supervisor_keeps_the_clients_spec_unless_resolving_changed_more_than_argv(
    make: Any, world: World
) -> None:
    manager = make()
    plain = manager.allocate(parse_slot_request({**guaranteed("plain", cpus=1), "worker": WORKER})).slot
    served = {"command": ["/bin/srv", "--port={port:http}"], "ports": {"http": {}}}
    port = manager.allocate(parse_slot_request({**guaranteed("port", cpus=1), "worker": served})).slot
    supervisors = dict(manager._workers.alive())
    # One spec per slot where one serves: the request's own object, not a copy.
    assert supervisors[plain.id].spec is plain.request.worker
    # A port's number is the resolved spec's: the supervisor keeps that one.
    assert supervisors[port.id].spec is not port.request.worker
    assert "NODEAGENT_PORT_HTTP" in supervisors[port.id].spec.env


def test_stop_worker(make: Any, world: World) -> None:
    manager = make()
    slot = manager.allocate(parse_slot_request({**guaranteed(), "worker": WORKER})).slot
    view = manager.stop_worker(slot.id)
    assert view.worker is not None
    assert view.worker.phase == "stopped"
    assert signal.SIGTERM in world.processes[slot.id].signals


class FakeQos:
    """What the QoS loop shows the manager (agent.qos_loop.QosLoop implements it)."""

    def __init__(self) -> None:
        self.admitted: list[tuple[str, float, int]] = []
        self.refuse = False

    def batch(self) -> dict[str, Any] | None:
        return {"cpus": 1.5, "memory_bytes": 1 << 30}

    def slot_view(self, slot_id: str) -> tuple[tuple[dict[str, Any], ...], bool]:
        return ({"action": "evict", "slot_id": slot_id},), True

    def admit(self, request: Any, best_effort_cpus: float, best_effort_memory: int) -> None:
        self.admitted.append((request.name, best_effort_cpus, best_effort_memory))
        if self.refuse:
            raise PlacementError(f"best-effort slot {request.name!r} does not fit batch capacity")


def test_qos_view_reaches_capacity_slots_and_best_effort_admission(make: Any) -> None:
    manager = make()
    assert manager.capacity()["batch"] is None  # no loop attached
    qos = FakeQos()
    manager.attach_qos(qos)
    manager.allocate(parse_slot_request(guaranteed()))  # online slots are not the loop's to admit
    first = manager.allocate(
        parse_slot_request({"name": "e1", "qos": "best-effort", "resources": {"cpus": 2, "memory": "1Gi"}})
    ).slot
    assert first.to_json()["qos_actions"] == [{"action": "evict", "slot_id": first.id}]
    assert first.to_json()["qos_evicted"] is True
    qos.refuse = True
    with pytest.raises(PlacementError, match="does not fit batch"):
        manager.allocate(parse_slot_request({"name": "e2", "qos": "best-effort", "resources": {"cpus": 1}}))
    assert qos.admitted == [("e1", 0.0, 0), ("e2", 2.0, 1 << 30)]
    assert manager.capacity()["batch"] == {"cpus": 1.5, "memory_bytes": 1 << 30}


def test_evict_and_restore_a_worker_for_the_qos_loop(make: Any, world: World) -> None:
    manager = make()
    slot = manager.allocate(
        parse_slot_request({"name": "e1", "qos": "best-effort", "worker": WORKER, "priority": 3})
    ).slot
    first = world.processes[slot.id]
    assert manager.evict_worker(slot.id, "node memory 91% used") is True
    assert signal.SIGTERM in first.signals
    manager.tick()
    view = manager.get_slot(slot.id)
    assert view.worker is not None
    assert view.worker.phase == "stopped"
    assert view.state is SlotState.READY  # the slot stays
    assert manager.evict_worker(slot.id, "again") is False  # nothing alive to evict
    assert any(
        e["kind"] == "evict" and "node memory 91% used" in e["message"] for e in manager.events(slot.id)
    )
    assert manager.restore_worker(slot.id, "memory calm") is True
    assert world.processes[slot.id] is not first
    assert manager.get_slot(slot.id).worker.phase == "running"  # type: ignore[union-attr]
    assert manager.restore_worker(slot.id, "twice") is False  # already running
    manager.stop_worker(slot.id)
    assert manager.restore_worker(slot.id, "operator stopped it") is False
    kinds = [e["kind"] for e in manager.events(slot.id)]
    assert "evict" in kinds
    assert "restore" in kinds


# --------------------------------------------------------------------------- reconcile after a crash


def crash_with(tmp_path: Path, *records: Slot) -> None:
    """Write the database as a crashed agent would have left it."""
    store = StateStore(tmp_path / "state.db")
    for record in records:
        store.insert_slot(record)
    store.close()


def planned(name: str, state: str, slot_id: str) -> Slot:
    from nodeagent.placement import plan
    from nodeagent.schema.request import parse_slot_request

    req = parse_slot_request(guaranteed(name))
    assignment = plan(TOPOLOGY, Allocated(), req)
    return Slot(slot_id, name, SlotState(state), req, assignment)


def test_reconcile_finishes_a_pending_slot(tmp_path: Path, make: Any, world: World) -> None:
    crash_with(tmp_path, planned("web", "pending", "sa"))
    manager = make()
    assert manager.report.finished_pending == ["web"]
    assert manager.get_slot("sa").state is SlotState.READY
    assert "sa" in world.cgroups
    assert manager.ready()
    again = manager.allocate(parse_slot_request(guaranteed("web")))  # the client's retry finds it
    assert (again.created, again.slot.id) == (False, "sa")


def test_reconcile_fails_a_pending_slot_that_cannot_be_applied(
    tmp_path: Path, make: Any, world: World
) -> None:
    crash_with(tmp_path, planned("web", "pending", "sa"))
    world.fail_apply.add("web")
    manager = make()
    assert manager.report.failed == ["web"]
    assert manager.get_slot("sa").state is SlotState.FAILED
    assert world.cgroups == {}
    assert held_cpus(manager) == []


def test_reconcile_finishes_a_release(tmp_path: Path, make: Any, world: World) -> None:
    crash_with(tmp_path, planned("web", "releasing", "sa"))
    world.cgroups["sa"] = {"cgroup": "test.slice/sa", "cpus": []}
    manager = make()
    assert manager.report.finished_releasing == ["web"]
    assert manager.list_slots() == []
    assert world.cgroups == {}


def test_reconcile_removes_orphans(tmp_path: Path, make: Any, world: World) -> None:
    crash_with(tmp_path, planned("web", "ready", "sa"))
    world.cgroups["sa"] = {"cgroup": "test.slice/sa", "cpus": []}
    world.cgroups["sorphan"] = {"cgroup": "test.slice/sorphan", "cpus": []}
    world.netns.add("sgone")
    manager = make()
    assert sorted(manager.report.orphans_removed) == ["cgroup sorphan", "netns sgone"]
    assert set(world.cgroups) == {"sa"}
    # Gone before the pool was set up: a leftover shared slot could make that impossible.
    assert world.prepared_with == {"sa"}
    assert world.netns == set()
    assert [e["kind"] for e in manager.events()][-1] == "reconcile"


def test_reconcile_recreates_a_vanished_cgroup(tmp_path: Path, make: Any, world: World) -> None:
    crash_with(tmp_path, planned("web", "ready", "sa"))
    manager = make()
    assert manager.report.recreated == ["web"]
    assert "sa" in world.cgroups
    assert manager.get_slot("sa").state is SlotState.READY


def test_restart_readopts_a_live_worker(make: Any, world: World) -> None:
    first = make()
    slot = first.allocate(parse_slot_request({**guaranteed(), "worker": WORKER})).slot
    pid = world.processes[slot.id].pid
    first.close()  # the agent goes away; the worker does not
    second = make()
    assert second.report.workers_adopted == ["web"]
    view = second.get_slot(slot.id)
    assert view.worker is not None
    assert view.worker.pid == pid
    assert world.launches == [slot.id]  # not launched twice


def test_restart_applies_the_restart_policy_to_a_dead_worker(make: Any, world: World) -> None:
    first = make()
    slot = first.allocate(parse_slot_request({**guaranteed(), "worker": WORKER})).slot
    first.close()
    world.processes[slot.id].exit = ExitRecord(None, signal.SIGKILL, False, 0.0, "signaled")
    second = make()
    assert second.report.workers_exited == ["web"]
    view = second.get_slot(slot.id)
    assert view.worker is not None
    assert view.worker.phase == "backoff"
    assert view.worker.last_exit.signal == signal.SIGKILL


def test_restart_launches_a_worker_that_was_never_launched(tmp_path: Path, make: Any, world: World) -> None:
    crash_with(tmp_path, planned("web", "ready", "sa"))
    store = StateStore(tmp_path / "state.db")
    store.put_worker(Worker(slot_id="sa", spec=parse_worker_spec(WORKER)))
    store.close()
    world.cgroups["sa"] = {"cgroup": "test.slice/sa", "cpus": []}
    manager = make()
    assert manager.report.workers_started == ["web"]
    assert world.launches == ["sa"]


def test_ledger_is_rebuilt_from_the_database(tmp_path: Path, make: Any) -> None:
    first = make()
    first.allocate(parse_slot_request(guaranteed("a", cpus=4)))
    first.close()
    second = make()
    cpus_a = second.get_slot("a").assignment
    assert cpus_a is not None
    b = second.allocate(parse_slot_request(guaranteed("b", cpus=4))).slot
    assert b.assignment is not None
    assert not set(cpus_a.cpus) & set(b.assignment.cpus)
    capacity = second.capacity()
    assert capacity["resources"]["cpus"]["allocated"] == 8
    assert capacity["slots"]["ready"] == 2


def test_assignment_round_trip_is_what_the_ledger_reads() -> None:
    record = planned("web", "ready", "sa")
    assert record.assignment is not None
    assert Assignment.from_dict(record.assignment.to_dict()) == record.assignment


# --------------------------------------------------------------------------- start-up with a lost database


def lose_the_database(tmp_path: Path, *, manifests_too: bool = False) -> None:
    for suffix in ("", "-wal", "-shm"):
        (tmp_path / f"state.db{suffix}").unlink(missing_ok=True)
    if manifests_too:
        for manifest in (tmp_path / "slots").glob("*.json"):
            manifest.unlink()


def running_slot(make: Any) -> Slot:
    first = make()
    slot = first.allocate(parse_slot_request({**guaranteed(), "worker": WORKER})).slot
    first.close()
    return slot


def test_a_busy_slot_the_database_does_not_name_stops_the_start_and_is_left_alone(
    tmp_path: Path, make: Any, world: World
) -> None:
    slot = running_slot(make)
    lose_the_database(tmp_path)
    with pytest.raises(UnexplainedSlots, match=r"missing or empty.*--recover.*--discard-orphans"):
        make()
    assert slot.id in world.cgroups
    assert world.processes[slot.id].exit is None  # its worker was not killed


def test_recover_rebuilds_a_lost_slot_from_its_manifest_and_readopts_its_worker(
    tmp_path: Path, make: Any, world: World
) -> None:
    slot = running_slot(make)
    lose_the_database(tmp_path)
    manager = make(recovery=RecoveryMode.RECOVER)
    assert manager.report.recovered == ["web"]
    assert manager.report.workers_adopted == ["web"]
    again = manager.get_slot("web")
    assert (again.id, again.assignment, again.request) == (slot.id, slot.assignment, slot.request)
    assert world.processes[slot.id].exit is None
    assert world.launches == [slot.id]  # adopted, not launched again


def test_recover_without_a_manifest_rebuilds_the_slot_from_its_cgroup(
    tmp_path: Path, make: Any, world: World
) -> None:
    slot = running_slot(make)
    assert slot.assignment is not None
    lose_the_database(tmp_path, manifests_too=True)
    manager = make(recovery=RecoveryMode.RECOVER)
    again = manager.get_slot(slot.id)
    assert again.name == f"recovered-{slot.id}"
    assert again.assignment is not None
    assert again.assignment.cpus == slot.assignment.cpus  # its CPUs stay held
    assert world.processes[slot.id].exit is None
    with pytest.raises(PlacementError):  # ... so nobody else gets them
        manager.allocate(parse_slot_request(guaranteed("other", cpus=len(TOPOLOGY.cpus) - 1)))
    manager.release(slot.id)
    assert slot.id not in world.cgroups


def test_discard_orphans_removes_them_and_what_runs_there(tmp_path: Path, make: Any, world: World) -> None:
    slot = running_slot(make)
    lose_the_database(tmp_path)
    manager = make(recovery=RecoveryMode.DISCARD)
    assert slot.id not in world.cgroups
    assert world.processes[slot.id].exit is not None
    assert manager.list_slots() == []


def test_empty_leftovers_of_a_crash_are_removed_without_asking(
    tmp_path: Path, make: Any, world: World
) -> None:
    world.cgroups["sempty"] = {"cgroup": "test.slice/sempty", "cpus": []}
    manager = make()
    assert manager.report.orphans_removed == ["cgroup sempty"]


class _CountingValidator:
    """A model's validator that counts its calls (the house: a request is validated once, at the edge)."""

    def __init__(self, inner: Any, calls: list[str], name: str) -> None:
        self._inner, self._calls, self._name = inner, calls, name

    def __getattr__(self, attr: str) -> Any:
        found = getattr(self._inner, attr)
        if not attr.startswith("validate"):
            return found

        def counted(*args: Any, **kwargs: Any) -> Any:
            self._calls.append(self._name)
            return found(*args, **kwargs)

        return counted


def test_an_allocate_validates_nothing_again_and_derives_isolation_once(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the edge parsed the request, an allocate with a worker (and a restart of its worker)
    neither validates the request or worker spec again (rows read back reuse the parsed spec) nor
    derives what isolation builds more than once."""
    import nodeagent.agent.parts as parts_module
    from nodeagent.schema.request import SlotRequest

    manager = make()
    request = parse_slot_request({**guaranteed(), "worker": {"command": ["/bin/sleep", "100"]}})
    calls: list[str] = []
    for model in (SlotRequest, WorkerSpec):
        counting = _CountingValidator(model.__pydantic_validator__, calls, model.__name__)
        monkeypatch.setattr(model, "__pydantic_validator__", counting)
    derived = parts_module.isolation_spec

    def derive(*args: Any) -> Any:
        calls.append("isolation_spec")
        return derived(*args)

    monkeypatch.setattr(parts_module, "isolation_spec", derive)
    slot = manager.allocate(request).slot
    assert calls == ["isolation_spec"]
    calls.clear()
    manager.stop_worker(slot.id)
    manager.start_worker(slot.id, None)
    assert calls == []


def test_an_allocate_reads_no_uid_or_port_table_back(make: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The slots' uids and ports are kept write-through: once read, an allocate, a worker's restart
    and a release write them without reading either table again (at 500 slots each read was the
    whole table)."""
    manager = make()
    worker = {"command": ["/bin/sleep", "100"], "ports": {"http": {}}}
    manager.allocate(parse_slot_request({**guaranteed("first", cpus=1), "worker": worker}))
    store = manager.store
    reads: list[str] = []
    real_read = store._read

    def read(sql: str, *args: Any) -> Any:
        reads.append(sql)
        return real_read(sql, *args)

    monkeypatch.setattr(store, "_read", read)
    slot = manager.allocate(parse_slot_request({**guaranteed("second", cpus=1), "worker": worker})).slot
    manager.stop_worker(slot.id)
    manager.start_worker(slot.id, None)
    manager.release(slot.id)
    assert not [sql for sql in reads if "sandbox_ids" in sql or "slot_ports" in sql]
    (first,) = manager.list_slots()
    assert [e.port for e in first.endpoints] == [p.port for p in store.slot_ports(first.id)]
    assert store.slot_ports(slot.id) == []


def test_a_slots_view_sets_its_live_parts_and_keeps_every_other_field() -> None:
    # Slot.viewed builds the slot field by field, in order: a field added, moved or renamed
    # without it would be lost or shifted here.
    stored = Slot(
        id="s1", name="web", state=SlotState.RUNNING,
        request=parse_slot_request({"name": "web", "qos": "best-effort"}),
        assignment=None, reason="why", created_at=1.0, updated_at=2.0,
    )  # fmt: skip
    live: dict[str, Any] = {
        "worker": "a worker's status",  # stand-ins: each field must land where it is named
        "foreign_cpu": "foreign CPU time",
        "sandbox_uid": 4242,
        "endpoints": ("an endpoint",),
        "qos_actions": ({"action": "throttle"},),
        "qos_evicted": True,
    }
    assert stored.viewed(**live) == dataclasses.replace(stored, **live)
    assert {f.name for f in dataclasses.fields(Slot)} - set(live) == {
        "id", "name", "state", "request", "assignment", "applied", "reason", "created_at", "updated_at",
    }  # fmt: skip
