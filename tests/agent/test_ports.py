"""Ports as a slot resource: the state store assigns and keeps them, the slot manager refuses a taken
one before anything is placed, binds its worker's spec to them, shows them as endpoints, keeps them
across an agent restart and frees them on release. A fake kernel and launcher (test_manager's)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from nodeagent.agent.manager import SlotManager
from nodeagent.agent.recovery import Manifests
from nodeagent.agent.slot import SlotState
from nodeagent.agent.state import StateStore
from nodeagent.errors import Conflict, InvalidRequest
from nodeagent.isolation.isolator import AppliedSlot
from nodeagent.runtime.env import SlotDescription
from nodeagent.runtime.ports import PortWant, SlotPort
from nodeagent.runtime.sandbox import SandboxSpec
from nodeagent.runtime.supervisor import Supervisor
from nodeagent.schema.request import parse_slot_request
from nodeagent.schema.worker import WorkerSpec, parse_worker_spec
from tests.agent.test_manager import TOPOLOGY, FakeIsolation, FakeRuntime, World, guaranteed, store_name
from tests.agent.test_state import slot as a_slot

FIRST, LAST = 20000, 20009


def nothing_in_use(port: int) -> bool:
    return False


# =========================================================================== the store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StateStore]:
    s = StateStore(tmp_path / "state.db")
    s.insert_slot(a_slot("s1", "one"))
    s.insert_slot(a_slot("s2", "two"))
    yield s
    s.close()


def want(**ports: int | None) -> dict[str, PortWant]:
    return {name: PortWant(name, "grpc" if name == "grpc" else "http", port) for name, port in ports.items()}


def test_free_ports_are_the_lowest_of_the_range_that_nobody_holds(store: StateStore) -> None:
    busy = {FIRST + 1}
    got = store.assign_ports("s1", want(http=None, grpc=None), FIRST, LAST, lambda p: p in busy)
    assert got == [SlotPort("grpc", "grpc", FIRST), SlotPort("http", "http", FIRST + 2)]
    other = store.assign_ports("s2", want(http=None), FIRST, LAST, nothing_in_use)
    assert other == [SlotPort("http", "http", FIRST + 1)]


def test_a_slot_keeps_its_ports_even_while_its_worker_listens_on_them(store: StateStore) -> None:
    first = store.assign_ports("s1", want(http=None), FIRST, LAST, nothing_in_use)
    again = store.assign_ports("s1", want(http=None), FIRST, LAST, lambda p: True)
    assert again == first


def test_a_port_asked_for_that_another_slot_holds_is_refused_by_name(store: StateStore) -> None:
    store.assign_ports("s1", want(http=9000), FIRST, LAST, nothing_in_use)
    with pytest.raises(Conflict, match=r"host port 9000 is held by slot 'one' \(its port 'http'\)"):
        store.assign_ports("s2", want(metrics=None, web=9000), FIRST, LAST, nothing_in_use)
    assert store.slot_ports("s2") == []  # nothing of the refused call stays


def test_a_port_asked_for_that_the_host_uses_is_refused(store: StateStore) -> None:
    with pytest.raises(Conflict, match="host port 9000 is in use on this host"):
        store.assign_ports("s1", want(http=9000), FIRST, LAST, lambda p: p == 9000)


def test_a_used_up_range_is_refused(store: StateStore) -> None:
    store.assign_ports("s1", want(a=None, b=None), FIRST, FIRST + 1, nothing_in_use)
    with pytest.raises(Conflict, match=r"no free port left in \[workers\] port_range 20000-20001"):
        store.assign_ports("s2", want(http=None), FIRST, FIRST + 1, nothing_in_use)


def test_names_no_longer_wanted_are_freed_and_a_new_number_replaces_the_old(store: StateStore) -> None:
    store.assign_ports("s1", want(http=None, grpc=None), FIRST, LAST, nothing_in_use)
    got = store.assign_ports("s1", want(http=9000), FIRST, LAST, nothing_in_use)
    assert got == [SlotPort("http", "http", 9000)]
    assert store.assign_ports("s2", want(x=None), FIRST, LAST, nothing_in_use)[0].port == FIRST


def test_ports_go_with_the_slots_row_and_survive_a_reopen(tmp_path: Path, store: StateStore) -> None:
    store.assign_ports("s1", want(http=None), FIRST, LAST, nothing_in_use)
    store.assign_ports("s2", want(http=None), FIRST, LAST, nothing_in_use)
    store.delete_slot("s1")
    store.close()
    reopened = StateStore(tmp_path / "state.db")
    try:
        assert reopened.slot_ports("s1") == []
        assert reopened.slot_ports("s2") == [SlotPort("http", "http", FIRST + 1)]
    finally:
        reopened.close()


# =========================================================================== the manager


class RecordingRuntime(FakeRuntime):
    """The fake runtime, remembering the spec each supervisor runs (presets resolved, ports bound)."""

    def __init__(self, world: World) -> None:
        super().__init__(world)
        self.specs: dict[str, WorkerSpec] = {}

    def supervisor(
        self,
        slot: SlotDescription,
        applied: AppliedSlot | None,
        spec: WorkerSpec,
        sandbox: SandboxSpec | None = None,
    ) -> Supervisor:
        self.specs[slot.slot_id] = spec
        return super().supervisor(slot, applied, spec, sandbox)


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Callable[..., tuple[SlotManager, RecordingRuntime]]]:
    world = World()
    managers: list[SlotManager] = []

    def build(
        in_use: Callable[[int], bool] = nothing_in_use, find: Any = None, recovery: Any = None
    ) -> tuple[SlotManager, RecordingRuntime]:
        store = StateStore(tmp_path / "state.db", manifests=Manifests(tmp_path / "slots"))
        runtime = RecordingRuntime(world)
        isolation = FakeIsolation(world, names=lambda slot_id: store_name(store, slot_id))
        manager = SlotManager(
            store,
            TOPOLOGY,
            isolation,
            runtime,
            port_range=(FIRST, LAST),
            port_in_use=in_use,
            find_program=find,
            **({} if recovery is None else {"recovery": recovery}),
        )
        managers.append(manager)
        manager.start(supervise=False)
        return manager, runtime

    yield build
    for manager in managers:
        manager.close()


TRITON = {"preset": "triton", "model_repository": "/models", "model_name": "m", "command": None}


def server(name: str, cpus: int = 1, **worker: Any) -> Any:
    spec = {
        "command": ["/srv/serve", "--http={port:http}", "--grpc={port:grpc}"],
        "ports": {"http": {}, "grpc": {}},
        "readiness": {"http": {"port": "http", "path": "/ready"}},
        **worker,
    }
    return parse_slot_request({**guaranteed(name, cpus), "worker": spec})


def endpoints(manager: SlotManager, name: str) -> list[tuple[str, str, str, int]]:
    return [(e.name, e.protocol, e.address, e.port) for e in manager.get_slot(name).endpoints]


def test_two_slots_of_one_server_get_their_own_ports(make: Any) -> None:
    manager, runtime = make()
    a = manager.allocate(server("a")).slot
    b = manager.allocate(server("b")).slot
    assert endpoints(manager, "a") == [
        ("grpc", "grpc", "127.0.0.1", FIRST),
        ("http", "http", "127.0.0.1", FIRST + 1),
    ]
    assert endpoints(manager, "b") == [
        ("grpc", "grpc", "127.0.0.1", FIRST + 2),
        ("http", "http", "127.0.0.1", FIRST + 3),
    ]
    assert runtime.specs[a.id].command == ("/srv/serve", f"--http={FIRST + 1}", f"--grpc={FIRST}")
    assert runtime.specs[b.id].command == ("/srv/serve", f"--http={FIRST + 3}", f"--grpc={FIRST + 2}")
    readiness = runtime.specs[b.id].readiness
    assert readiness is not None
    assert readiness.port == FIRST + 3
    assert manager.get_slot("a").to_json()["endpoints"][1] == {
        "name": "http",
        "protocol": "http",
        "address": "127.0.0.1",
        "port": FIRST + 1,
    }


def test_a_preset_gets_its_servers_ports(make: Any) -> None:
    manager, runtime = make()
    body = {**guaranteed("t", 1), "worker": {k: v for k, v in TRITON.items() if v is not None}}
    slot = manager.allocate(parse_slot_request(body)).slot
    assert [(n, p) for n, _, _, p in endpoints(manager, "t")] == [
        ("grpc", FIRST),
        ("http", FIRST + 1),
        ("metrics", FIRST + 2),
    ]
    command = runtime.specs[slot.id].command
    assert command is not None
    assert f"--http-port={FIRST + 1}" in command


def test_a_taken_port_refuses_the_allocate_before_anything_is_placed(make: Any) -> None:
    manager, _ = make(in_use=lambda p: p == 9000)
    with pytest.raises(Conflict, match="host port 9000 is in use"):
        manager.allocate(server("a", ports={"http": {"port": 9000}, "grpc": {}}))
    assert manager.list_slots() == []
    assert manager.capacity()["slots"]["pending"] == 0
    manager.allocate(server("a", cpus=8))  # every CPU is still free


def test_a_port_another_slot_holds_refuses_the_allocate(make: Any) -> None:
    manager, _ = make()
    manager.allocate(server("a", ports={"http": {"port": 9000}, "grpc": {}}))
    with pytest.raises(Conflict, match="held by slot 'a'"):
        manager.allocate(server("b", ports={"http": {"port": 9000}, "grpc": {}}))
    assert [s.name for s in manager.list_slots()] == ["a"]


def test_ports_survive_an_agent_restart_and_are_freed_on_release(make: Any) -> None:
    first, _ = make()
    first.allocate(server("a"))
    before = endpoints(first, "a")
    first.close()
    # The restarted agent re-adopts the worker, which listens on its ports: they stay its own.
    second, runtime = make(in_use=lambda p: True)
    assert second.report is not None
    assert second.report.workers_adopted == ["a"]
    assert endpoints(second, "a") == before
    slot = second.get_slot("a")
    assert runtime.specs[slot.id].command == ("/srv/serve", f"--http={FIRST + 1}", f"--grpc={FIRST}")
    second.release("a")
    second.close()
    third, _ = make()
    third.allocate(server("b"))
    assert endpoints(third, "b") == before  # the same numbers again: they were freed


def test_a_new_worker_keeps_the_ports_it_names_again(make: Any) -> None:
    manager, runtime = make()
    slot = manager.allocate(server("a")).slot
    manager.stop_worker("a")
    while manager.get_slot("a").worker.phase != "stopped":  # type: ignore[union-attr]
        manager.tick()
    spec = parse_worker_spec({"command": ["/srv/other", "{port:http}"], "ports": {"http": {}, "admin": {}}})
    manager.start_worker("a", spec)
    assert [(n, p) for n, _, _, p in endpoints(manager, "a")] == [("admin", FIRST), ("http", FIRST + 1)]
    assert runtime.specs[slot.id].command == ("/srv/other", str(FIRST + 1))
    assert manager.get_slot("a").state in (SlotState.READY, SlotState.RUNNING)


def test_endpoints_name_the_slots_own_address_when_it_has_a_network(make: Any) -> None:
    manager, _ = make()
    worker = {"command": ["/srv/serve", "{port:http}"], "ports": {"http": {}}}
    request = parse_slot_request({**guaranteed("n", 1, network={}), "worker": worker})
    slot = manager.allocate(request).slot
    assert slot.network is not None
    assert {e.address for e in manager.get_slot("n").endpoints} == {str(slot.network.slot_address)}


def test_a_missing_program_refuses_the_allocate_before_anything_is_placed(make: Any) -> None:
    manager, _ = make(find=lambda name, path: None)
    with pytest.raises(InvalidRequest, match="program '/srv/serve' not found"):
        manager.allocate(server("a"))
    assert manager.list_slots() == []


def test_a_found_program_runs_by_the_path_it_was_found_at(make: Any) -> None:
    manager, runtime = make(find=lambda name, path: f"/found/{name.rsplit('/', 1)[-1]}")
    slot = manager.allocate(server("a")).slot
    command = runtime.specs[slot.id].command
    assert command is not None
    assert command[0] == "/found/serve"


def test_ports_come_back_from_the_manifest_when_the_database_is_lost(tmp_path: Path, make: Any) -> None:
    from nodeagent.agent.recovery import RecoveryMode
    from tests.agent.test_manager import lose_the_database

    first, _ = make()
    first.allocate(server("a", ports={"http": {}, "grpc": {"port": 9001}}))
    before = endpoints(first, "a")
    first.close()
    lose_the_database(tmp_path)
    second, runtime = make(recovery=RecoveryMode.RECOVER)
    assert second.report is not None
    assert second.report.workers_adopted == ["a"]
    assert endpoints(second, "a") == before
    slot = second.get_slot("a")
    assert runtime.specs[slot.id].command == ("/srv/serve", f"--http={FIRST}", "--grpc=9001")
