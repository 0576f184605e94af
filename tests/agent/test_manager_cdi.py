"""The slot manager keeps each slot's CDI spec: written when the slot is ready, again on resize and
when its worker changes, removed on release and rollback, and reconciled at start (no spec of a
slot the agent does not hold survives a crash)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from nodeagent.agent.manager import SlotManager
from nodeagent.agent.recovery import Manifests
from nodeagent.agent.slot_cdi import SlotCdiSpecs
from nodeagent.agent.state import StateStore
from nodeagent.devices.synthetic import synthetic_topology
from nodeagent.errors import NotFound, Unsupported
from nodeagent.isolation.cdi import CONTAINER_SLOT_FILE, CdiSpecDir
from nodeagent.schema.request import ResourcesPatch, parse_slot_request
from nodeagent.schema.worker import parse_worker_spec
from tests.agent.test_manager import (
    WORKER,
    FakeIsolation,
    FakeRuntime,
    World,
    crash_with,
    guaranteed,
    store_name,
)
from tests.isolation.cdi_schema import cdi_schema

TOPOLOGY = synthetic_topology(
    sockets=1, numa_per_socket=2, cores_per_numa=4, threads_per_core=2, gpus_per_numa=1
)


@pytest.fixture
def cdi(tmp_path: Path) -> SlotCdiSpecs:
    return SlotCdiSpecs(CdiSpecDir(tmp_path / "run-cdi"), tmp_path / "state" / "cdi")


@pytest.fixture
def make(tmp_path: Path, cdi: SlotCdiSpecs) -> Iterator[Any]:
    managers: list[SlotManager] = []

    def build(with_cdi: bool = True) -> SlotManager:
        world = World()
        store = StateStore(tmp_path / "state.db", manifests=Manifests(tmp_path / "slots"))
        isolation = FakeIsolation(world, names=lambda slot_id: store_name(store, slot_id))
        manager = SlotManager(store, TOPOLOGY, isolation, FakeRuntime(world), cdi=cdi if with_cdi else None)
        managers.append(manager)
        manager.start(supervise=False)
        return manager

    yield build
    for manager in managers:
        manager.close()


def env_of(spec: dict[str, Any]) -> dict[str, str]:
    return dict(entry.split("=", 1) for entry in spec["devices"][0]["containerEdits"]["env"])


def test_a_ready_slot_has_a_valid_spec_with_its_devices_env_and_slot_file(
    make: Any, cdi: SlotCdiSpecs
) -> None:
    manager = make()
    slot = manager.allocate(parse_slot_request(guaranteed("mlp", cpus=2, gpus=1))).slot
    spec = manager.cdi_spec("mlp")
    jsonschema.validate(spec, cdi_schema(spec["cdiVersion"]))
    assert spec == json.loads(cdi.specs.path_for(slot.id).read_text())
    assert [d["name"] for d in spec["devices"]] == ["mlp", slot.id]
    edits = spec["devices"][0]["containerEdits"]
    assert edits["deviceNodes"][0] == {"path": "/dev/nvidia0"}  # the slot's GPU, by its minor
    env = env_of(spec)
    assert env["OMP_NUM_THREADS"] == "2"
    assert env["NODEAGENT_SLOT_ID"] == slot.id
    assert env["NODEAGENT_SLOT_FILE"] == CONTAINER_SLOT_FILE
    assert env["CUDA_VISIBLE_DEVICES"] != ""
    mount = edits["mounts"][0]
    assert mount["containerPath"] == CONTAINER_SLOT_FILE
    described = json.loads(Path(mount["hostPath"]).read_text())
    assert described["slot_id"] == slot.id
    assert slot.assignment is not None
    assert described["cpus"] == list(slot.assignment.cpus)


def test_resize_rewrites_and_release_removes(make: Any, cdi: SlotCdiSpecs) -> None:
    manager = make()
    slot = manager.allocate(parse_slot_request(guaranteed("web", cpus=2))).slot
    manager.resize(slot.id, ResourcesPatch.model_validate({"cpus": 4}))
    assert env_of(manager.cdi_spec(slot.id))["OMP_NUM_THREADS"] == "4"
    assert len(json.loads(cdi.slot_file(slot.id).read_text())["cpus"]) == 4
    manager.release(slot.id)
    assert cdi.specs.keys() == set()
    assert not cdi.slot_file(slot.id).exists()
    with pytest.raises(NotFound):
        manager.cdi_spec(slot.id)


def test_the_workers_env_wins_over_the_slots_wiring(make: Any) -> None:
    # A runtime applies a CDI device's env after its own --env: the spec's own values must be the
    # ones written, or a container worker would lose what a command worker keeps.
    manager = make()
    worker = {**WORKER, "env": {"OMP_NUM_THREADS": "1", "MODEL": "resnet"}}
    slot = manager.allocate(parse_slot_request({**guaranteed("web", cpus=2), "worker": worker})).slot
    env = env_of(manager.cdi_spec(slot.id))
    assert env["OMP_NUM_THREADS"] == "1"
    assert "MODEL" not in env  # not the slot's wiring: the worker gets it through its own env
    manager.stop_worker(slot.id)
    manager.tick()
    manager.start_worker(slot.id, parse_worker_spec({**WORKER, "env": {"OMP_NUM_THREADS": "3"}}))
    assert env_of(manager.cdi_spec(slot.id))["OMP_NUM_THREADS"] == "3"


def test_start_removes_the_specs_of_slots_it_does_not_hold(
    tmp_path: Path, make: Any, cdi: SlotCdiSpecs
) -> None:
    manager = make()
    kept = manager.allocate(parse_slot_request(guaranteed("kept", cpus=2))).slot
    manager.close()
    # What a crash can leave: a spec (and slot file) of a slot whose row is gone, and a half write.
    stale = "s00000000dead"
    cdi.specs.write(stale, manager_spec := json.loads(cdi.specs.path_for(kept.id).read_text()))
    assert manager_spec
    cdi.slot_file(stale).write_text("{}")
    stray = cdi.specs.directory / f".{cdi.specs.prefix}{stale}.json.tmp"
    stray.write_text("{")
    os.utime(stray, (1, 1))
    # Another agent's spec, same directory and prefix: it mounts a slot file of its own state.
    foreign = json.loads(cdi.specs.path_for(kept.id).read_text())
    foreign["devices"][0]["containerEdits"]["mounts"][0]["hostPath"] = (
        "/var/lib/other-agent/cdi/s0000000f0e1.json"
    )
    foreign["devices"] = foreign["devices"][:1]
    cdi.specs.write("s0000000f0e1", foreign)
    cdi.specs.remove(kept.id)  # and a held slot's spec lost: written again
    again = make()
    assert cdi.specs.keys() == {kept.id, "s0000000f0e1"}
    assert not cdi.slot_file(stale).exists()
    assert not stray.exists()
    assert again.report is not None
    assert again.report.cdi_removed == [stale]


def test_a_crashed_pending_slot_gets_its_spec_when_finished(
    tmp_path: Path, make: Any, cdi: SlotCdiSpecs
) -> None:
    from tests.agent.test_manager import planned

    crash_with(tmp_path, planned("half", "pending", "s000000000aaa"))
    manager = make()
    assert manager.get_slot("half").state == "ready"
    assert cdi.specs.keys() == {"s000000000aaa"}


def test_without_cdi_the_spec_is_unsupported(make: Any) -> None:
    manager = make(with_cdi=False)
    slot = manager.allocate(parse_slot_request(guaranteed("web"))).slot
    with pytest.raises(Unsupported, match=r"\[cdi\]"):
        manager.cdi_spec(slot.id)


def test_a_container_worker_needs_a_slot_allocated_with_one(make: Any) -> None:
    from nodeagent.errors import Conflict

    manager = make()
    slot = manager.allocate(parse_slot_request(guaranteed("plain"))).slot
    with pytest.raises(Conflict, match="allocated without a container worker"):
        manager.start_worker(slot.id, parse_worker_spec({"container": {"image": "localhost/x:1"}}))


def test_device_specs_for_the_hosts_gpus_and_fpgas(tmp_path: Path) -> None:
    topology = synthetic_topology(sockets=1, numa_per_socket=1, gpus_per_numa=2, fpgas_per_numa=1)
    cdi = SlotCdiSpecs(CdiSpecDir(tmp_path / "cdi"), tmp_path / "files", device_specs=True)
    written = sorted(p.name for p in cdi.write_device_specs(topology))
    assert written == ["nodeagent-slot-fpga.json", "nodeagent-slot-gpu.json"]
    gpu = cdi.specs.read("gpu")
    assert gpu is not None
    jsonschema.validate(gpu, cdi_schema(gpu["cdiVersion"]))
    assert gpu["kind"] == "nodeagent.io/gpu"
    names = [d["name"] for d in gpu["devices"]]
    assert {"0", "1"} <= set(names)
    # Kept at start-up beside the slots' specs; without GPUs the file goes.
    assert cdi.remove_stale(set()) == []
    assert cdi.write_device_specs(synthetic_topology(sockets=1, numa_per_socket=1)) == []
    assert cdi.specs.keys() == set()


def test_a_device_spec_for_the_allowed_devices_that_are_there(tmp_path: Path) -> None:
    """``nodeagent.io/device=<name>`` for each allowed device present (the device plugin's CDI
    answer for ``nodeagent.io/device-<name>``); one that is missing has no entry."""
    cdi = SlotCdiSpecs(
        CdiSpecDir(tmp_path / "cdi"),
        tmp_path / "files",
        device_specs=True,
        allowed_devices=("/dev/null", "/dev/nodeagent-missing"),
    )
    written = [p.name for p in cdi.write_device_specs(synthetic_topology(sockets=1, numa_per_socket=1))]
    assert written == ["nodeagent-slot-device.json"]
    spec = cdi.specs.read("device")
    assert spec is not None
    jsonschema.validate(spec, cdi_schema(spec["cdiVersion"]))
    assert spec["kind"] == "nodeagent.io/device"
    assert [(d["name"], d["containerEdits"]["deviceNodes"]) for d in spec["devices"]] == [
        ("null", [{"path": "/dev/null"}])
    ]
    assert cdi.remove_stale(set()) == []  # kept beside the slots' specs


def test_a_container_worker_without_cdi_specs_is_refused_at_once(make: Any) -> None:
    manager = make(with_cdi=False)
    request = {**guaranteed("ctr"), "worker": {"container": {"image": "localhost/x:1"}}}
    with pytest.raises(Unsupported, match=r"container workers need the slot's CDI spec"):
        manager.allocate(parse_slot_request(request))
    assert manager.list_slots() == []
