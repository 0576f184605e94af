"""Placement decisions on named topologies: which CPUs and devices, and the words of each refusal.

CPU numbering (Linux's usual): on a host of C cores with 2 threads, core k has CPUs k and C+k.
By default the first physical core (CPU 0 and its sibling) is reserved for the system.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from nodeagent.devices.synthetic import GIB, synthetic_topology
from nodeagent.devices.topology import Topology
from nodeagent.errors import ConfigError, Conflict, InvalidRequest, PlacementError
from nodeagent.placement import (
    Allocated,
    Assignment,
    PlacementOptions,
    capacity,
    count_fits,
    plan,
)
from nodeagent.schema.request import parse_slot_request

TOPOLOGIES: dict[str, Topology] = {
    # 4 cores: CPUs 0-3 and siblings 4-7.
    "single-socket-ht": synthetic_topology(1, 1, 4, 2),
    # node 0: cores 0-3 = CPUs 0-3,8-11; node 1: cores 4-7 = CPUs 4-7,12-15.
    "dual-socket-ht": synthetic_topology(2, 1, 4, 2, memory_per_numa=4 * GIB),
    # 2 sockets x 2 nodes x 4 cores: node n has cores 4n..4n+3; core k = CPUs k, 16+k.
    "4-numa": synthetic_topology(2, 2, 4, 2),
    # 2 nodes x 8 cores (core k = CPUs k, 16+k); GPUs 0-3 on node 0, 4-7 on node 1.
    "8-gpu-2-numa": synthetic_topology(2, 1, 8, 2, gpus_per_numa=4),
    # the GPUs all on node 1.
    "gpus-on-node-1": synthetic_topology(2, 1, 8, 2, gpu_numa=[1, 1, 1, 1]),
    # core 2 (CPUs 2,6) isolated; CPU 7 (sibling of 3) offline.
    "offline-isolated": synthetic_topology(1, 1, 4, 2, offline={7}, isolated={2, 6}),
    # one node, 8 cores, two L3 caches: cores 0-3 and cores 4-7 (core k = CPUs k, 8+k).
    "two-l3": synthetic_topology(1, 1, 8, 2, l3_per_numa=2),
    # GPU 0 in MIG mode with three instances, GPU 1 whole.
    "mig": synthetic_topology(1, 1, 4, 2, gpu_numa=[0, 0], mig={0: ["1g.10gb", "1g.10gb", "3g.40gb"]}),
}


def request(qos: str = "guaranteed", name: str = "a", **resources: Any) -> Any:
    return parse_slot_request({"name": name, "qos": qos, "resources": resources})


def place(
    topo: str,
    *,
    taken: tuple[int, ...] = (),
    gpus_taken: tuple[int, ...] = (),
    options: tuple[str, ...] = (),
    qos: str = "guaranteed",
    **resources: Any,
) -> Assignment:
    allocated = Allocated(cpus=frozenset(taken), gpus=frozenset(gpus_taken))
    return plan(
        TOPOLOGIES[topo], allocated, request(qos, **resources), PlacementOptions.from_strings(options)
    )


# --------------------------------------------------------------------------- exclusive CPUs

CPU_CASES = [
    pytest.param(
        "single-socket-ht", {}, (), {"cpus": 2}, (1, 5), id="ht: one whole core, not the reserved one"
    ),
    pytest.param(
        "single-socket-ht", {}, (), {"cpus": 3}, (1, 2, 5, 6), id="ht: odd request rounds up to 2 cores"
    ),
    pytest.param(
        "single-socket-ht",
        {},
        ("whole_cores=false",),
        {"cpus": 3},
        (1, 2, 5),
        id="ht: threads when whole_cores off",
    ),
    pytest.param(
        "single-socket-ht",
        {"taken": (3,)},
        ("whole_cores=false",),
        {"cpus": 3},
        (1, 5, 7),
        id="ht: threads fill half-used cores first",
    ),
    pytest.param(
        "single-socket-ht",
        {},
        ("reserved_cpus=",),
        {"cpus": 8},
        tuple(range(8)),
        id="ht: nothing reserved, all",
    ),
    pytest.param(
        "single-socket-ht",
        {},
        ("reserved_cpus=0-1,4-5",),
        {"cpus": 2},
        (2, 6),
        id="ht: configured reservation",
    ),
    pytest.param(
        "dual-socket-ht",
        {"taken": (1, 9)},
        (),
        {"cpus": 4},
        (2, 3, 10, 11),
        id="2s: best fit node 0 (4 left)",
    ),
    pytest.param(
        "dual-socket-ht",
        {},
        (),
        {"cpus": 6, "numa": "single"},
        (1, 2, 3, 9, 10, 11),
        id="2s: exact fit on node 0",
    ),
    pytest.param(
        "dual-socket-ht",
        {},
        (),
        {"cpus": 10},
        (1, 4, 5, 6, 7, 9, 12, 13, 14, 15),
        id="2s: prefer spans, whole node 1 first then 1 core",
    ),
    pytest.param(
        "4-numa",
        {},
        (),
        {"cpus": 16},
        (*range(8, 16), *range(24, 32)),
        id="4numa: socket-sized request fills the free socket",
    ),
    pytest.param(
        "4-numa",
        {},
        (),
        {"cpus": 12},
        (1, 2, 4, 5, 6, 7, 17, 18, 20, 21, 22, 23),
        id="4numa: packs 8+4 on the nearest pair",
    ),
    pytest.param(
        "4-numa",
        {},
        ("distribute_across_numa=true",),
        {"cpus": 12},
        (1, 2, 3, 4, 5, 6, 17, 18, 19, 20, 21, 22),
        id="4numa: distribute splits 6+6",
    ),
    pytest.param(
        "two-l3", {}, (), {"cpus": 6}, (1, 2, 3, 9, 10, 11), id="l3: fills the partly reserved cache"
    ),
    pytest.param("two-l3", {}, (), {"cpus": 8}, (4, 5, 6, 7, 12, 13, 14, 15), id="l3: whole free cache"),
    pytest.param(
        "two-l3", {"taken": (5, 13)}, (), {"cpus": 6}, (1, 2, 3, 9, 10, 11), id="l3: best-fit cache"
    ),
    pytest.param("offline-isolated", {}, (), {"cpus": 3}, (1, 3, 5), id="offline sibling: 1+2 exactly"),
    pytest.param(
        "offline-isolated",
        {},
        ("use_isolated_cpus=true",),
        {"cpus": 4},
        (1, 2, 5, 6),
        id="isolated when allowed",
    ),
    pytest.param(
        "gpus-on-node-1",
        {"taken": (8, 9, 10, 11, 24, 25, 26, 27)},
        (),
        {"cpus": 4},
        (1, 2, 17, 18),
        id="cpu-only slot keeps off the GPU node",
    ),
]


@pytest.mark.parametrize(("topo", "state", "options", "resources", "cpus"), CPU_CASES)
def test_exclusive_cpus(
    topo: str,
    state: dict[str, Any],
    options: tuple[str, ...],
    resources: dict[str, Any],
    cpus: tuple[int, ...],
) -> None:
    a = place(topo, options=options, **state, **resources)
    assert a.cpus == cpus
    assert a.exclusive
    assert a.cpu_quota_millis == len(cpus) * 1000


def test_numa_nodes_and_memory_follow_the_cpus() -> None:
    a = place("dual-socket-ht", cpus=10, memory="6Gi")
    assert a.numa_nodes == (0, 1)
    assert a.memory_by_node == {1: 4 * GIB, 0: 2 * GIB}
    assert a.memory_bytes == 6 * GIB


def test_numa_none_does_not_bind_memory() -> None:
    a = place("dual-socket-ht", cpus=2, memory="6Gi", numa="none")
    assert a.memory_by_node == {}
    assert a.numa_nodes == (0,)


def test_unbound_memory_counts_against_slots_that_span_nodes() -> None:
    # Found by the churn property test: a numa "none" slot holds memory on no particular node, so a
    # later slot spanning both nodes must not be given the same memory again.
    topo = synthetic_topology(2, 1, 2, 1, memory_per_numa=16 * GIB)
    opts = PlacementOptions(reserved_cpus=frozenset())
    first = plan(topo, Allocated(), request(name="a", cpus=1, memory="20Gi", numa="none"), opts)
    held = Allocated().add(first)
    with pytest.raises(PlacementError, match="free"):
        plan(topo, held, request(name="b", cpus=1, memory="20Gi", numa="prefer"), opts)


def test_reasons_explain_the_choice() -> None:
    a = place("single-socket-ht", cpus=3)
    assert "rounded 3 CPUs up to whole cores (2 threads per core)" in a.reasons
    assert any("best fit" in r for r in a.reasons)


# --------------------------------------------------------------------------- refusals, word for word

REFUSALS = [
    pytest.param(
        "dual-socket-ht",
        {},
        (),
        {"cpus": 10, "numa": "single"},
        "slot 'a': need 10 exclusive CPUs on one NUMA node; the largest free set is 8, on node 1 "
        "(node 0: 6 CPUs; node 1: 8 CPUs); ask for fewer CPUs, use numa prefer, or release a slot",
        id="single: largest free set named",
    ),
    pytest.param(
        "dual-socket-ht",
        {},
        (),
        {"cpus": 16},
        "slot 'a': need 16 exclusive CPUs; the host does not have that much free "
        "(node 0: 6 CPUs; node 1: 8 CPUs); CPUs 0,8 are reserved for the system; "
        "ask for less or release a slot",
        id="prefer: host too small, reserved named",
    ),
    pytest.param(
        "dual-socket-ht",
        {"taken": (4, 5, 6, 7, 12, 13, 14, 15)},
        (),
        {"cpus": 8},
        "slot 'a': need 8 exclusive CPUs; the host does not have that much free "
        "(node 0: 6 CPUs; node 1: nothing free); CPUs 0,8 are reserved for the system; "
        "ask for less or release a slot",
        id="prefer: full nodes collapsed",
    ),
    pytest.param(
        "single-socket-ht",
        {},
        ("round_up_to_cores=false",),
        {"cpus": 3},
        "slot 'a': 3 CPUs is not a whole number of cores (2 threads per core); ask for 2 or 4, "
        "or set round_up_to_cores=true or whole_cores=false",
        id="odd request refused when rounding is off",
    ),
    pytest.param(
        "8-gpu-2-numa",
        {"gpus_taken": (0, 1, 2, 4, 5, 6)},
        (),
        {"cpus": 4, "gpus": 2, "numa": "single"},
        "slot 'a': need 4 exclusive CPUs, 2 GPUs on one NUMA node; no node has all of it "
        "(node 0: 14 CPUs, 1 GPU; node 1: 16 CPUs, 1 GPU); ask for less, use numa prefer, or release a slot",
        id="single: GPUs split over nodes",
    ),
    pytest.param(
        "dual-socket-ht",
        {},
        (),
        {"cpus": 2, "memory": "6Gi", "numa": "single"},
        "slot 'a': need 2 exclusive CPUs, 6Gi memory on one NUMA node; no node has all of it "
        "(node 0: 6 CPUs, 4Gi memory; node 1: 8 CPUs, 4Gi memory); ask for less, use numa prefer, "
        "or release a slot",
        id="single: memory per node",
    ),
    pytest.param(
        "offline-isolated",
        {},
        (),
        {"cpus": 4},
        "slot 'a': need 4 exclusive CPUs; the host does not have that much free (node 0: 3 CPUs); "
        "CPUs 0,4 are reserved for the system; ask for less or release a slot",
        id="isolated and offline CPUs are not offered",
    ),
    pytest.param(
        "mig",
        {},
        (),
        {"cpus": 1, "gpus": 3, "gpu_profile": "1g.10gb"},
        "slot 'a': need 1 exclusive CPUs, 3 MIG instances of profile 1g.10gb; the host does not have "
        "that much free (node 0: 6 CPUs, 2 MIG instances); CPUs 0,4 are reserved for the system; "
        "ask for less or release a slot",
        id="mig: not enough instances of the profile",
    ),
    pytest.param(
        "single-socket-ht",
        {},
        (),
        {"cpus": 1, "devices": ["/dev/fuse"]},
        "slot 'a': device /dev/fuse is not in the allow-list (empty); add it to the allowed_devices option",
        id="device not allowed",
    ),
]


@pytest.mark.parametrize(("topo", "state", "options", "resources", "message"), REFUSALS)
def test_refusal_says_what_was_asked_and_what_is_free(
    topo: str, state: dict[str, Any], options: tuple[str, ...], resources: dict[str, Any], message: str
) -> None:
    with pytest.raises(PlacementError) as err:
        place(topo, options=options, **state, **resources)
    assert str(err.value) == message


# --------------------------------------------------------------------------- devices

GPU_CASES = [
    pytest.param(
        {"cpus": 4, "gpus": 1, "numa": "single"}, (), (0,), (1, 2, 17, 18), id="gpu local to the cpus"
    ),
    pytest.param({"cpus": 4, "gpus": 1}, (0, 1, 2, 3), (4,), (8, 9, 24, 25), id="node 0 gpus taken: node 1"),
    pytest.param(
        {"cpus": 4, "gpus": 2}, (0, 1, 2, 4, 5, 6), (3, 7), (1, 2, 17, 18), id="prefer spans for the gpus"
    ),
    pytest.param({"cpus": 2, "gpus": 4}, (), (0, 1, 2, 3), (1, 17), id="four gpus of one node"),
]


@pytest.mark.parametrize(("resources", "gpus_taken", "gpus", "cpus"), GPU_CASES)
def test_whole_gpus(
    resources: dict[str, Any], gpus_taken: tuple[int, ...], gpus: tuple[int, ...], cpus: tuple[int, ...]
) -> None:
    a = place("8-gpu-2-numa", gpus_taken=gpus_taken, **resources)
    assert (a.gpus, a.cpus) == (gpus, cpus)
    assert a.gpu_uuids == tuple(TOPOLOGIES["8-gpu-2-numa"].gpus[i].uuid for i in gpus)


def test_unhealthy_gpu_is_never_assigned() -> None:
    topo = synthetic_topology(1, 1, 4, 2, gpus_per_numa=2, unhealthy_gpus={0})
    a = plan(topo, Allocated(), request(cpus=1, gpus=1))
    assert a.gpus == (1,)
    with pytest.raises(PlacementError, match="need 2 exclusive CPUs, 2 GPUs"):
        plan(topo, Allocated(), request(cpus=2, gpus=2))


def test_mig_instances_by_profile_pack_and_run_out() -> None:
    topo = TOPOLOGIES["mig"]
    ledger = Allocated()
    first = plan(topo, ledger, request(cpus=1, gpu_profile="1g.10gb"))
    assert [(m.gpu_index, m.gpu_instance_id, m.profile) for m in first.mig] == [(0, 1, "1g.10gb")]
    assert first.gpus == ()
    ledger = ledger.add(first)
    second = plan(topo, ledger, request(name="b", cpus=1, gpu_profile="1g.10gb"))
    assert [m.gpu_instance_id for m in second.mig] == [2]
    ledger = ledger.add(second)
    with pytest.raises(PlacementError, match=r"1 MIG instance of profile 1g\.10gb"):
        plan(topo, ledger, request(name="c", cpus=1, gpu_profile="1g.10gb"))
    # A whole GPU never comes from a MIG-enabled one.
    assert plan(topo, ledger, request(name="d", cpus=1, gpus=1)).gpus == (1,)


def test_gpu_shares_pack_within_the_limits() -> None:
    topo = synthetic_topology(1, 1, 4, 2, gpus_per_numa=2)
    options = PlacementOptions.from_strings(["shareable_gpus=1", "max_shares_per_gpu=3"])
    ledger = Allocated()
    got = []
    for i in range(3):
        a = plan(topo, ledger, request("burstable", name=f"s{i}", cpus=0.5, gpu_share=0.3), options)
        got.append([(s.gpu_index, s.millis) for s in a.gpu_shares])
        ledger = ledger.add(a)
    assert got == [[(1, 300)]] * 3
    assert ledger.gpu_shares == {1: (900, 3)}
    with pytest.raises(PlacementError, match=r"a 0\.1 share of a GPU"):
        plan(topo, ledger, request("burstable", name="s4", cpus=0.5, gpu_share=0.1), options)
    # GPU 0 is not shareable, so it still goes whole.
    assert plan(topo, ledger, request(name="w", cpus=1, gpus=1), options).gpus == (0,)


def test_fpgas_are_numa_local() -> None:
    topo = synthetic_topology(2, 1, 4, 2, fpgas_per_numa=1)
    a = plan(topo, Allocated(cpus=frozenset({1, 2, 3, 9, 10, 11})), request(cpus=2, fpgas=1, numa="single"))
    assert (a.fpgas, a.numa_nodes) == (("fpga1",), (1,))


def test_named_devices_exclusive_unless_shared() -> None:
    topo = TOPOLOGIES["single-socket-ht"]
    options = PlacementOptions.from_strings(
        ["allowed_devices=/dev/fuse,/dev/kvm", "shared_devices=/dev/fuse"]
    )
    a = plan(topo, Allocated(), request(cpus=1, devices=["/dev/kvm", "/dev/fuse"]), options)
    assert [(d.path, d.exclusive) for d in a.devices] == [("/dev/kvm", True), ("/dev/fuse", False)]
    ledger = Allocated().add(a)
    assert plan(topo, ledger, request(name="b", cpus=1, devices=["/dev/fuse"]), options).devices
    with pytest.raises(PlacementError, match="device /dev/kvm is held by another slot"):
        plan(topo, ledger, request(name="c", cpus=1, devices=["/dev/kvm"]), options)


# --------------------------------------------------------------------------- shared pool


def test_burstable_gets_the_pool_as_a_quota() -> None:
    a = place("offline-isolated", qos="burstable", cpus=1.5)
    # Pool: online CPUs minus reserved (0,4) and isolated (2,6); CPU 7 is offline.
    assert (a.cpus, a.exclusive, a.cpu_quota_millis) == ((1, 3, 5), False, 1500)


def test_burstable_quota_is_capped_by_overcommit() -> None:
    topo = TOPOLOGIES["offline-isolated"]
    ledger = Allocated().add(plan(topo, Allocated(), request("burstable", cpus=2)))
    with pytest.raises(PlacementError) as err:
        plan(topo, ledger, request("burstable", name="b", cpus=1.5))
    assert str(err.value) == (
        "slot 'b': need a 1.5 CPU quota on the shared pool; the pool has 3 CPUs (x1 overcommit for "
        "burstable = 3) and 2 are promised already; release a slot or raise the overcommit option"
    )
    options = PlacementOptions.from_strings(["burstable_overcommit=1.5"])
    assert plan(topo, ledger, request("burstable", name="b", cpus=1.5), options).cpu_quota_millis == 1500


def test_exclusive_slot_may_not_starve_burstable_quota() -> None:
    topo = TOPOLOGIES["dual-socket-ht"]
    ledger = Allocated().add(plan(topo, Allocated(), request("burstable", name="web", cpus=6)))
    with pytest.raises(PlacementError) as err:
        plan(topo, ledger, request(cpus=10))
    assert str(err.value) == (
        "slot 'a': taking 10 exclusive CPUs would leave 4 CPUs in the shared pool, below the 6 CPUs of "
        "quota burstable slots hold (overcommit 1); release or shrink a burstable slot first"
    )
    options = PlacementOptions.from_strings(["burstable_overcommit=2"])
    assert len(plan(topo, ledger, request(cpus=10), options).cpus) == 10


def test_burstable_single_numa_runs_on_that_nodes_pool() -> None:
    a = place("8-gpu-2-numa", gpus_taken=(0, 1, 2, 3), qos="burstable", cpus=2, gpus=1, numa="single")
    assert a.gpus == (4,)
    assert a.numa_nodes == (1,)
    assert a.cpus == (*range(8, 16), *range(24, 32))


def test_best_effort_overcommits_more() -> None:
    topo = TOPOLOGIES["single-socket-ht"]
    ledger = Allocated()
    for i in range(4):
        ledger = ledger.add(plan(topo, ledger, request("best-effort", name=f"be{i}", cpus=6)))
    assert ledger.quota_millis == {"best-effort": 24000}
    with pytest.raises(PlacementError, match="x4 overcommit for best-effort = 24"):
        plan(topo, ledger, request("best-effort", name="more", cpus=1))


# --------------------------------------------------------------------------- ledger and accounting


def test_ledger_refuses_double_booking_and_unknown_release() -> None:
    topo = TOPOLOGIES["single-socket-ht"]
    a = plan(topo, Allocated(), request(cpus=2))
    ledger = Allocated().add(a)
    with pytest.raises(Conflict, match=r"CPUs \[1, 5\] are already held"):
        ledger.add(a)
    with pytest.raises(Conflict, match="cannot release"):
        Allocated().remove(a)
    assert ledger.remove(a) == Allocated()


def test_assignment_round_trips_through_json() -> None:
    a = place("mig", cpus=2, memory="1Gi", gpu_profile="3g.40gb")
    assert Assignment.from_dict(a.to_dict()) == a
    with pytest.raises(InvalidRequest, match="assignment: malformed JSON"):
        Assignment.from_dict({"name": "x"})


def test_allocated_file_names_gpus_by_index_or_uuid() -> None:
    topo = TOPOLOGIES["8-gpu-2-numa"]
    ledger = Allocated.from_dict(
        {"cpus": [1, 17], "gpus": [0, topo.gpus[5].uuid], "memory_bytes": {"1": 1024}}, topo
    )
    assert (ledger.cpus, ledger.gpus, ledger.memory_by_node) == (
        frozenset({1, 17}),
        frozenset({0, 5}),
        {1: 1024},
    )
    assert Allocated.from_dict(ledger.to_dict(), topo) == ledger


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        pytest.param(
            {"cpus": [999]}, r"cpus lists \[999\], which this topology does not have", id="stray-cpu"
        ),
        pytest.param({"gpus": ["GPU-nope"]}, "neither a GPU index nor a GPU UUID", id="unknown-gpu"),
        pytest.param(
            {"memory_bytes": {"7": 1}}, "names NUMA node 7, which does not exist", id="unknown-node"
        ),
        pytest.param({"cpu": [1]}, "unknown key 'cpu'; known keys: cpus", id="unknown-key"),
        pytest.param({"cpus": "1-3"}, "cpus must be a list", id="cpus-not-list"),
    ],
)
def test_allocated_file_refusals(obj: Any, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        Allocated.from_dict(obj, TOPOLOGIES["8-gpu-2-numa"])


def test_capacity_per_resource_and_node() -> None:
    topo = TOPOLOGIES["8-gpu-2-numa"]
    ledger = Allocated().add(plan(topo, Allocated(), request(cpus=4, gpus=1, memory="1Gi")))
    cap = capacity(topo, ledger).to_dict()
    assert cap["resources"]["cpus"] == {
        "total": 32,
        "reserved": 2,
        "allocatable": 30,
        "allocated": 4,
        "free": 26,
    }
    assert cap["by_numa"]["0"]["cpus"] == {
        "total": 16,
        "reserved": 2,
        "allocatable": 14,
        "allocated": 4,
        "free": 10,
    }
    assert cap["resources"]["gpus"]["free"] == 7
    assert cap["by_numa"]["0"]["memory_bytes"]["allocated"] == GIB
    assert cap["shared_pool"]["cpus"] == 26


def test_capacity_counts_the_memory_of_every_class_as_placement_does() -> None:
    topo = TOPOLOGIES["8-gpu-2-numa"]
    ledger = Allocated()
    for slot in (
        request(cpus=2, memory="1Gi"),
        request("burstable", name="b", cpus=0.5, memory="2Gi", numa="none"),
        request("best-effort", name="c", memory="3Gi", numa="none"),
    ):
        ledger = ledger.add(plan(topo, ledger, slot))
    cap = capacity(topo, ledger).to_dict()
    memory = cap["resources"]["memory_bytes"]
    assert memory["allocated"] == 6 * GIB  # bound (1Gi on a node) and unbound (2Gi + 3Gi) alike
    assert memory["free"] == memory["allocatable"] - 6 * GIB
    assert sum(node["memory_bytes"]["allocated"] for node in cap["by_numa"].values()) == GIB
    assert cap["by_qos"] == {
        "guaranteed": {"slots": 1, "cpus": 2, "memory_bytes": GIB},
        "burstable": {"slots": 1, "cpus": 0.5, "memory_bytes": 2 * GIB},
        "best-effort": {"slots": 1, "cpus": 0.0, "memory_bytes": 3 * GIB},
    }


def test_capacity_counts_mig_profiles() -> None:
    cap = capacity(TOPOLOGIES["mig"], Allocated(mig=frozenset({"MIG-00000000-0000-0000-0000-000000000001"})))
    assert cap.resources["mig/1g.10gb"].free == 1
    assert cap.resources["mig/3g.40gb"].free == 1


@pytest.mark.parametrize(
    ("topo", "shape", "fits"),
    [
        pytest.param("dual-socket-ht", {"cpus": 2}, 7, id="2-cpu slots on 7 free cores"),
        pytest.param("dual-socket-ht", {"cpus": 4, "numa": "single"}, 3, id="4-cpu single: 1 + 2"),
        pytest.param(
            "8-gpu-2-numa", {"cpus": 4, "gpus": 1, "numa": "single"}, 7, id="gpu slots bound by cpus"
        ),
        pytest.param("8-gpu-2-numa", {"cpus": 2, "gpus": 2}, 4, id="gpu slots bound by gpus"),
    ],
)
def test_count_fits(topo: str, shape: dict[str, Any], fits: int) -> None:
    req = {"name": "shape", "qos": "guaranteed", "resources": shape}
    assert count_fits(TOPOLOGIES[topo], Allocated(), req) == fits


# --------------------------------------------------------------------------- options


def test_options_parse_from_cli_strings() -> None:
    opts = PlacementOptions.from_strings(
        ["whole_cores=false", "distribute_across_numa=yes", "reserved_cpus=0-3", "shareable_gpus=0,GPU-x"]
    )
    assert (opts.whole_cores, opts.distribute_across_numa) == (False, True)
    assert opts.reserved_cpus == frozenset({0, 1, 2, 3})
    assert opts.shareable_gpus == frozenset({"0", "GPU-x"})
    assert PlacementOptions.from_strings(["reserved_cpus="]).reserved_cpus == frozenset()


@pytest.mark.parametrize(
    ("item", "message"),
    [
        pytest.param(
            "wholecores=false",
            "unknown placement option 'wholecores'; known options: allowed_devices",
            id="typo",
        ),
        pytest.param("whole_cores", "is not KEY=VALUE", id="no-equals"),
        pytest.param("whole_cores=maybe", "expected true or false", id="bad-bool"),
        pytest.param("reserved_cpus=a-b", "expected a cpulist", id="bad-cpulist"),
        pytest.param("burstable_overcommit=-1", "expected a ratio above 0", id="negative-ratio"),
        pytest.param("burstable_overcommit=nan", "expected a ratio above 0", id="nan-ratio"),
    ],
)
def test_bad_options_are_config_errors(item: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        PlacementOptions.from_strings([item])


def test_reserved_cpus_must_exist() -> None:
    with pytest.raises(ConfigError, match="reserved_cpus lists CPUs 64, which this host does not have"):
        place("single-socket-ht", options=("reserved_cpus=64",), cpus=1)


def test_small_hosts_reserve_nothing_by_default() -> None:
    topo = synthetic_topology(1, 1, 1, 2)
    assert plan(topo, Allocated(), request(cpus=2)).cpus == (0, 1)


# --------------------------------------------------------------------------- ledgers handed down

# Ledgers made by add/remove carry per-node caches forward; they must decide exactly like a ledger
# rebuilt from scratch, or a stale cache would hand out a CPU or device twice.
HANDED_DOWN_TOPOLOGY = synthetic_topology(
    2, 3, 4, 2, gpu_numa=[0, 0, 3, None], mig={1: ["1g.10gb", "1g.10gb", "3g.40gb"]}
)
EXTRAS: list[dict[str, Any]] = [
    {},
    {"gpus": 1},
    {"gpu_profile": "1g.10gb"},
    {"gpu_share": 0.5},
    {"memory": "20Gi"},
]


def _outcome(ledger: Allocated, req: Any, options: PlacementOptions) -> Any:
    try:
        return plan(HANDED_DOWN_TOPOLOGY, ledger, req, options).to_dict()
    except PlacementError as err:
        return str(err)


@pytest.mark.parametrize("seed", range(20))
def test_handed_down_ledgers_decide_like_fresh_ones(seed: int) -> None:
    rng = random.Random(seed)
    options = PlacementOptions(shareable_gpus=frozenset({"3"}), whole_cores=rng.random() < 0.7)
    ledger, held = Allocated(), []
    for i in range(60):
        if held and rng.random() < 0.4:
            ledger = ledger.remove(held.pop(rng.randrange(len(held))))
            continue
        resources = {"cpus": rng.choice([1, 2, 4, 6, 8]), "numa": rng.choice(["single", "prefer", "none"])}
        req = parse_slot_request(
            {"name": f"s{i}", "qos": "guaranteed", "resources": {**resources, **rng.choice(EXTRAS)}}
        )
        got = _outcome(ledger, req, options)
        assert got == _outcome(Allocated.from_dict(ledger.to_dict(), HANDED_DOWN_TOPOLOGY), req, options)
        if isinstance(got, dict):
            assignment = plan(HANDED_DOWN_TOPOLOGY, ledger, req, options)
            ledger = ledger.add(assignment)
            held.append(assignment)
