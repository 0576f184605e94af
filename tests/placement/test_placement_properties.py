"""Properties of placement over random topologies and random allocate/release sequences.

The fit oracle here is written independently of the placement code: it counts free whole cores,
memory and GPUs per node from the topology and the assignments made so far.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nodeagent.devices.synthetic import GIB, synthetic_topology
from nodeagent.devices.topology import Topology
from nodeagent.errors import PlacementError
from nodeagent.placement import Allocated, Assignment, PlacementOptions, capacity, plan
from nodeagent.schema.request import parse_slot_request

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class Host:
    topo: Topology
    options: PlacementOptions
    reserved: frozenset[int]


@st.composite
def hosts(draw: st.DrawFn, whole_cores: bool | None = None) -> Host:
    """A random host; ``whole_cores`` fixes that option (None: drawn too)."""
    sockets = draw(st.integers(1, 2))
    per_socket = draw(st.integers(1, 3))
    cores = draw(st.integers(1, 4))
    threads = draw(st.sampled_from([1, 2, 4]))
    total = sockets * per_socket * cores * threads
    # CPU 0 always stays online, like on Linux.
    cpu_ids = st.integers(1, max(1, total - 1))
    topo = synthetic_topology(
        sockets,
        per_socket,
        cores,
        threads,
        gpus_per_numa=draw(st.integers(0, 2)),
        memory_per_numa=16 * GIB,
        offline=draw(st.frozensets(cpu_ids, max_size=2)) if total > 1 else frozenset(),
        isolated=draw(st.frozensets(cpu_ids, max_size=2)) if total > 1 else frozenset(),
        l3_per_numa=draw(st.integers(1, 2)),
    )
    reserved = draw(st.sampled_from([None, frozenset(), frozenset({0})]))
    options = PlacementOptions(
        reserved_cpus=reserved,
        distribute_across_numa=draw(st.booleans()),
        whole_cores=draw(st.booleans()) if whole_cores is None else whole_cores,
    )
    online = topo.online_cpus
    if reserved is None:
        reserved = (
            frozenset(topo.cores[topo.cpu_by_id[min(online)].core]) if len(online) >= 4 else frozenset()
        )
    return Host(topo, options, reserved & online)


@st.composite
def guaranteed_requests(draw: st.DrawFn, name: str) -> Any:
    return parse_slot_request(
        {
            "name": name,
            "qos": "guaranteed",
            "resources": {
                "cpus": draw(st.integers(1, 8)),
                "memory": draw(st.sampled_from([0, GIB, 6 * GIB, 20 * GIB])),
                "gpus": draw(st.integers(0, 2)),
                "numa": draw(st.sampled_from(["single", "prefer", "none"])),
            },
        }
    )


# --------------------------------------------------------------------------- the oracle


def usable_cores(host: Host, held: frozenset[int]) -> dict[int, list[tuple[int, ...]]]:
    """node -> free units (a whole core's online CPUs, or single CPUs when whole_cores is off)."""
    topo, out = host.topo, {n.id: [] for n in host.topo.numa_nodes}  # type: dict[int, list[tuple[int, ...]]]
    for cpus in topo.cores.values():
        online = tuple(c for c in cpus if topo.cpu_by_id[c].online)
        ok = [c for c in online if c not in host.reserved and c not in topo.isolated_cpus and c not in held]
        if not online:
            continue
        node = topo.cpu_by_id[online[0]].numa
        if host.options.whole_cores:
            if len(ok) == len(online):
                out[node].append(online)
        else:
            out[node].extend((c,) for c in ok)
    return out


def fits(host: Host, slots: list[Assignment], req: Any) -> bool:
    held = frozenset(c for a in slots for c in a.cpus)
    gpus_held = {g for a in slots for g in a.gpus}
    res = req.resources
    free_cpus = {n: sum(len(u) for u in units) for n, units in usable_cores(host, held).items()}
    free_mem = {
        n.id: 16 * GIB - sum(a.memory_by_node.get(n.id, 0) for a in slots) for n in host.topo.numa_nodes
    }
    unbound = sum(a.memory_bytes for a in slots if not a.memory_by_node)
    host_mem = sum(free_mem.values()) - unbound
    free_gpus = dict.fromkeys(free_cpus, 0)
    for g in host.topo.gpus:
        if g.index not in gpus_held and g.numa is not None:
            free_gpus[g.numa] += 1
    need = (res.whole_cpus, res.memory_bytes, res.gpus)
    if res.numa == "single":
        return any(
            free_cpus[n] >= need[0] and min(free_mem[n], host_mem) >= need[1] and free_gpus[n] >= need[2]
            for n in free_cpus
        )
    return sum(free_cpus.values()) >= need[0] and host_mem >= need[1] and sum(free_gpus.values()) >= need[2]


def check_invariants(host: Host, slots: list[Assignment], a: Assignment, req: Any) -> None:
    topo = host.topo
    others = {c for s in slots for c in s.cpus}
    assert not (set(a.cpus) & others), "a CPU is in two slots"
    assert not (set(a.gpus) & {g for s in slots for g in s.gpus}), "a GPU is in two slots"
    assert not (set(a.cpus) & host.reserved), "a reserved CPU was assigned"
    assert all(topo.cpu_by_id[c].online for c in a.cpus)
    assert not (set(a.cpus) & topo.isolated_cpus)
    assert len(a.cpus) >= req.resources.whole_cpus
    if host.options.whole_cores:
        for cpus in topo.cores.values():
            online = {c for c in cpus if topo.cpu_by_id[c].online}
            inside = online & set(a.cpus)
            assert not inside or inside == online, f"core {sorted(online)} split: slot has {sorted(inside)}"
        # Rounding never takes a whole extra core.
        assert len(a.cpus) < req.resources.whole_cpus + max(len(c) for c in topo.cores.values())
    else:
        assert len(a.cpus) == req.resources.whole_cpus
    check_fewest_splits(host, slots, a)
    assert sum(a.memory_by_node.values()) in (0, a.memory_bytes)
    assert len(a.gpus) == req.resources.gpus
    assert all(topo.gpus[g].healthy is not False for g in a.gpus)
    if req.resources.numa == "single":
        assert len(a.numa_nodes) <= 1
        node = a.numa_nodes[0]
        assert {topo.cpu_by_id[c].numa for c in a.cpus} == {node}
        assert {topo.gpus[g].numa for g in a.gpus} <= {node}
        assert set(a.memory_by_node) <= {node}


def check_fewest_splits(host: Host, slots: list[Assignment], a: Assignment) -> None:
    """The slot splits a core that was entirely free only where its count leaves no other way.

    On each node it uses: no split if that node's entirely free cores (any subset of them) plus the
    free threads of its partly used cores could make up the CPUs the slot took there, else one.
    Over the whole slot, on hosts whose cores all have every thread online: at most one split, and
    none for a whole number of cores when no core was partly used.
    """
    topo = host.topo
    unavailable = host.reserved | topo.isolated_cpus | {c for s in slots if s.exclusive for c in s.cpus}
    mine = set(a.cpus)
    whole_sizes: dict[int, list[int]] = {n.id: [] for n in topo.numa_nodes}
    spare = dict.fromkeys(whole_sizes, 0)
    splits = dict.fromkeys(whole_sizes, 0)
    for siblings in topo.cores.values():
        online = [c for c in siblings if topo.cpu_by_id[c].online]
        if not online:
            continue
        node = topo.cpu_by_id[online[0]].numa
        free = [c for c in online if c not in unavailable]
        if len(free) < len(online):
            spare[node] += len(free)
            continue
        whole_sizes[node].append(len(online))
        if 0 < len(mine & set(online)) < len(online):
            splits[node] += 1
    for node, count in Counter(topo.cpu_by_id[c].numa for c in a.cpus).items():
        sums = {0}
        for size in whole_sizes[node]:
            sums |= {s + size for s in sums if s + size <= count}
        needed = 0 if any(count - spare[node] <= s for s in sums) else 1
        assert splits[node] <= needed, (
            f"node {node}: {splits[node]} free cores split for {count} CPUs; {needed} needed "
            f"(whole free cores of sizes {whole_sizes[node]}, {spare[node]} spare threads)"
        )
    if all(topo.cpu_by_id[c].online for c in topo.cpu_by_id):
        threads = max(len(s) for s in topo.cores.values())
        assert sum(splits.values()) <= 1, f"{sum(splits.values())} free cores split for one slot"
        if len(a.cpus) % threads == 0 and not any(spare.values()):
            assert sum(splits.values()) == 0, f"{len(a.cpus)} CPUs are whole cores, yet a core was split"
        # A whole number of cores takes whole free cores before a thread beside another slot, on one
        # node or several, wherever the slot's nodes have enough of them (distribute_across_numa
        # fixes the count per node, so it may have to).
        nodes = {topo.cpu_by_id[c].numa for c in a.cpus}
        if len(a.cpus) % threads == 0 and not host.options.distribute_across_numa and (
            sum(sum(whole_sizes[n]) for n in nodes) >= len(a.cpus)
        ):
            beside = sorted(c for c in a.cpus if unavailable & set(topo.cores[topo.cpu_by_id[c].core]))
            assert beside == [], f"{len(a.cpus)} CPUs are whole cores, yet {beside} share a core"


# --------------------------------------------------------------------------- properties


@SETTINGS
@given(host=hosts(), data=st.data())
def test_random_churn_keeps_every_invariant(host: Host, data: st.DataObject) -> None:
    ledger, slots = Allocated(), []
    empty_capacity = capacity(host.topo, ledger, host.options)
    for step in range(data.draw(st.integers(1, 25), label="steps")):
        if slots and data.draw(st.booleans(), label="release?"):
            gone = slots.pop(data.draw(st.integers(0, len(slots) - 1), label="which"))
            ledger = ledger.remove(gone)
            continue
        req = data.draw(guaranteed_requests(f"s{step}"), label="request")
        expected_fit = fits(host, slots, req)
        try:
            a = plan(host.topo, ledger, req, host.options)
        except PlacementError as err:
            refusal = str(err)
        else:
            refusal = ""
        assert not (refusal and expected_fit), f"refused a request that fits: {refusal}"
        if refusal:
            continue
        assert expected_fit, f"placed a request the oracle says does not fit: {a}"
        check_invariants(host, slots, a, req)
        ledger = ledger.add(a)
        slots.append(a)
    for a in slots:
        ledger = ledger.remove(a)
    assert ledger == Allocated()
    assert capacity(host.topo, ledger, host.options) == empty_capacity


@SETTINGS
@given(host=hosts(), data=st.data())
def test_shared_pool_never_overlaps_exclusive_cpus(host: Host, data: st.DataObject) -> None:
    ledger, slots = Allocated(), []
    for step in range(data.draw(st.integers(1, 15), label="steps")):
        qos = data.draw(st.sampled_from(["guaranteed", "burstable", "best-effort"]), label="qos")
        cpus = (
            data.draw(st.integers(1, 6))
            if qos == "guaranteed"
            else data.draw(st.sampled_from([0, 0.5, 1.5, 3]))
        )
        req = parse_slot_request({"name": f"s{step}", "qos": qos, "resources": {"cpus": cpus}})
        try:
            a = plan(host.topo, ledger, req, host.options)
        except PlacementError:
            continue
        exclusive = {c for s in slots if s.exclusive for c in s.cpus}
        if a.exclusive:
            assert not (set(a.cpus) & exclusive)
        else:
            assert not (set(a.cpus) & (exclusive | host.reserved | host.topo.isolated_cpus))
            assert a.cpus, "a shared slot with no CPU to run on"
        ledger = ledger.add(a)
        slots.append(a)
        pool = capacity(host.topo, ledger, host.options).shared_pool
        assert pool["burstable_quota"] <= pool["burstable_capacity"] + 1e-9
        if ledger.shared_slots:
            assert pool["cpus"] > 0, "exclusive slots emptied the pool under running shared slots"


@SETTINGS
@given(host=hosts(whole_cores=False), data=st.data())
def test_threads_split_no_more_cores_than_needed(host: Host, data: st.DataObject) -> None:
    # With whole_cores off, cores end up partly used as slots come and go; a new slot must still
    # take whole cores first and use spare threads before splitting a free core.
    ledger, slots = Allocated(), []
    for step in range(data.draw(st.integers(1, 20), label="steps")):
        if slots and data.draw(st.integers(0, 2), label="release?") == 0:
            ledger = ledger.remove(slots.pop(data.draw(st.integers(0, len(slots) - 1), label="which")))
            continue
        numa = data.draw(st.sampled_from(["single", "prefer", "none"]), label="numa")
        cpus = data.draw(st.integers(1, 9), label="cpus")
        req = parse_slot_request(
            {"name": f"s{step}", "qos": "guaranteed", "resources": {"cpus": cpus, "numa": numa}}
        )
        try:
            a = plan(host.topo, ledger, req, host.options)
        except PlacementError:
            continue
        check_fewest_splits(host, slots, a)
        ledger = ledger.add(a)
        slots.append(a)
