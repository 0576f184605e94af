"""The ledger of what slots hold (:class:`Allocated`) and what it leaves free per node (:class:`LedgerView`).

A ledger is immutable: ``add`` and ``remove`` return new ledgers and refuse double booking. What a
ledger leaves free under one :class:`~nodeagent.placement.index.UsableCpus` is worked out once and
kept on it; the ledgers ``add``/``remove`` make inherit it with only the touched nodes recomputed.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, NamedTuple

from nodeagent.devices.topology import Gpu, MigInstance, Topology
from nodeagent.errors import Conflict, InvalidRequest
from nodeagent.placement.assignment import Assignment
from nodeagent.placement.bitset import ids_of, mask_of
from nodeagent.placement.index import FreeCore, PlacementIndex, UsableCpus
from nodeagent.schema.request import MILLI


def _frozen_map(items: Mapping[Any, int]) -> dict[Any, int]:
    return {k: v for k, v in sorted(items.items()) if v}


@dataclass(frozen=True)
class Allocated:
    """What the node's slots hold. Immutable: ``add``/``remove`` return a new ledger."""

    cpus: frozenset[int] = frozenset()  #: exclusive CPUs
    gpus: frozenset[int] = frozenset()  #: whole GPUs, by index
    mig: frozenset[str] = frozenset()  #: MIG instances, by :func:`mig_key`
    gpu_shares: Mapping[int, tuple[int, int]] = field(default_factory=dict)  #: gpu -> (millis, slots)
    fpgas: frozenset[str] = frozenset()
    devices: frozenset[str] = frozenset()  #: exclusively held device paths
    memory_by_node: Mapping[int, int] = field(default_factory=dict)
    memory_unbound: int = 0
    quota_millis: Mapping[str, int] = field(default_factory=dict)  #: shared-pool quota per QoS class
    shared_slots: int = 0  #: burstable and best-effort slots, which need at least one pool CPU
    #: per QoS class: slots, and the memory they were granted (bound to a node or not)
    slots_by_qos: Mapping[str, int] = field(default_factory=dict)
    memory_by_qos: Mapping[str, int] = field(default_factory=dict)

    @cached_property
    def cpu_mask(self) -> int:
        return mask_of(self.cpus)

    @cached_property
    def memory_total(self) -> int:
        return sum(self.memory_by_node.values()) + self.memory_unbound

    def free_view(self, index: PlacementIndex, usable: UsableCpus) -> LedgerView:
        """What this ledger leaves free under ``usable``, per node: worked out once per ledger.

        Ledgers made by :meth:`add` and :meth:`remove` inherit their parent's views with only the
        nodes the slot's CPUs sit on recomputed, so a decision does not pay for every node.
        """
        views: dict[int, LedgerView] = self.__dict__.setdefault("_views", {})
        view = views.get(id(usable))  # the view holds ``usable``, so its id is not reused
        if view is None:
            if len(views) >= 4:
                views.clear()
            view = views[id(usable)] = LedgerView.build(index, usable, self.cpu_mask)
        return view

    def add(self, a: Assignment) -> Allocated:
        """The ledger with ``a`` held too; Conflict if it overlaps what is held already."""
        exclusive_cpus = frozenset(a.cpus) if a.exclusive else frozenset()
        taken: list[tuple[str, frozenset[Any]]] = [
            ("CPUs", exclusive_cpus & self.cpus),
            ("GPUs", frozenset(a.gpus) & self.gpus),
            ("MIG instances", frozenset(m.key for m in a.mig) & self.mig),
            ("FPGAs", frozenset(a.fpgas) & self.fpgas),
            ("devices", frozenset(d.path for d in a.devices if d.exclusive) & self.devices),
        ]
        for what, overlap in taken:
            if overlap:
                raise Conflict(
                    f"slot {a.name!r}: {what} {sorted(overlap)} are already held by another slot; "
                    "re-plan it against the current ledger"
                )
        return self._apply(a, +1)

    def remove(self, a: Assignment) -> Allocated:
        """The ledger without ``a``; Conflict if ``a`` is not (entirely) held."""
        exclusive_cpus = frozenset(a.cpus) if a.exclusive else frozenset()
        missing = (
            exclusive_cpus - self.cpus
            or frozenset(a.gpus) - self.gpus
            or frozenset(m.key for m in a.mig) - self.mig
            or frozenset(a.fpgas) - self.fpgas
        )
        if missing:
            raise Conflict(
                f"slot {a.name!r}: cannot release {sorted(missing)}: the ledger does not hold them"
            )
        return self._apply(a, -1)

    def _apply(self, a: Assignment, sign: int) -> Allocated:
        def change(s: frozenset[Any], items: Iterable[Any]) -> frozenset[Any]:
            return s | frozenset(items) if sign > 0 else s - frozenset(items)

        memory = dict(self.memory_by_node)
        for node, amount in a.memory_by_node.items():
            memory[node] = memory.get(node, 0) + sign * amount
        shares = dict(self.gpu_shares)
        for s in a.gpu_shares:
            millis, count = shares.get(s.gpu_index, (0, 0))
            shares[s.gpu_index] = (millis + sign * s.millis, count + sign)
        quota = dict(self.quota_millis)
        if not a.exclusive:
            quota[a.qos] = quota.get(a.qos, 0) + sign * a.cpu_quota_millis
        unbound = 0 if a.memory_by_node else a.memory_bytes
        slots_by_qos = dict(self.slots_by_qos)
        slots_by_qos[a.qos] = slots_by_qos.get(a.qos, 0) + sign
        memory_by_qos = dict(self.memory_by_qos)
        memory_by_qos[a.qos] = memory_by_qos.get(a.qos, 0) + sign * a.memory_bytes
        ledger = Allocated(
            cpus=change(self.cpus, a.cpus if a.exclusive else ()),
            gpus=change(self.gpus, a.gpus),
            mig=change(self.mig, (m.key for m in a.mig)),
            gpu_shares={k: v for k, v in sorted(shares.items()) if v[1] > 0},
            fpgas=change(self.fpgas, a.fpgas),
            devices=change(self.devices, (d.path for d in a.devices if d.exclusive)),
            memory_by_node=_frozen_map(memory),
            memory_unbound=self.memory_unbound + sign * unbound,
            quota_millis=_frozen_map(quota),
            shared_slots=self.shared_slots + (0 if a.exclusive else sign),
            slots_by_qos=_frozen_map(slots_by_qos),
            memory_by_qos=_frozen_map(memory_by_qos),
        )
        self._hand_down(ledger, a, sign)
        return ledger

    def _hand_down(self, child: Allocated, a: Assignment, sign: int) -> None:
        """Give ``child`` (this ledger changed by ``a``) this ledger's views, brought up to date."""
        if "cpu_mask" not in self.__dict__:
            return
        changed = mask_of(a.cpus) if a.exclusive else 0
        taken = self.cpu_mask | changed if sign > 0 else self.cpu_mask & ~changed
        child.__dict__["cpu_mask"] = taken
        views: dict[int, LedgerView] = self.__dict__.get("_views", {})
        if views:
            # A snapshot of the items: another thread may be planning on this ledger.
            child.__dict__["_views"] = {
                key: view.after(a, changed, taken) for key, view in list(views.items())
            }

    @classmethod
    def from_assignments(cls, assignments: Iterable[Assignment]) -> Allocated:
        ledger = cls()
        for a in assignments:
            ledger = ledger.add(a)
        return ledger

    def to_dict(self) -> dict[str, Any]:
        return {
            "cpus": sorted(self.cpus),
            "gpus": sorted(self.gpus),
            "mig": sorted(self.mig),
            "gpu_shares": {str(k): {"share": m / MILLI, "slots": c} for k, (m, c) in self.gpu_shares.items()},
            "fpgas": sorted(self.fpgas),
            "devices": sorted(self.devices),
            "memory_bytes": {str(k): v for k, v in self.memory_by_node.items()},
            "memory_unbound_bytes": self.memory_unbound,
            "cpu_quota": {k: v / MILLI for k, v in self.quota_millis.items()},
            "shared_slots": self.shared_slots,
        }

    @classmethod
    def from_dict(cls, obj: Any, topology: Topology) -> Allocated:
        """Read the ``--allocated`` file: ``{"cpus": [...], "gpus": [...], "memory_bytes": {...}}``."""
        return _allocated_from_dict(obj, topology)


_ALLOCATED_KEYS = (
    "cpus",
    "gpus",
    "mig",
    "gpu_shares",
    "fpgas",
    "devices",
    "memory_bytes",
    "memory_unbound_bytes",
    "cpu_quota",
    "shared_slots",
)


def _allocated_from_dict(obj: Any, topo: Topology) -> Allocated:
    def bad(what: str) -> InvalidRequest:
        return InvalidRequest(f"allocated: {what}")

    if not isinstance(obj, dict):
        raise bad('must be a JSON object such as {"cpus": [2, 3], "gpus": [0]}')
    unknown = sorted(set(obj) - set(_ALLOCATED_KEYS))
    if unknown:
        raise bad(f"unknown key {unknown[0]!r}; known keys: {', '.join(_ALLOCATED_KEYS)}")
    cpus = _int_list(obj.get("cpus", []), "cpus", bad)
    stray = sorted(set(cpus) - set(topo.cpu_by_id))
    if stray:
        raise bad(f"cpus lists {stray}, which this topology does not have")
    by_uuid = {g.uuid: g.index for g in topo.gpus if g.uuid}
    indexes = {g.index for g in topo.gpus}
    gpus: set[int] = set()
    for g in _list(obj.get("gpus", []), "gpus", bad):
        if isinstance(g, str) and g in by_uuid:
            gpus.add(by_uuid[g])
        elif isinstance(g, int) and not isinstance(g, bool) and g in indexes:
            gpus.add(g)
        else:
            raise bad(f"gpus lists {g!r}, which is neither a GPU index nor a GPU UUID of this topology")
    memory = _int_map(obj.get("memory_bytes", {}), "memory_bytes", bad)
    nodes = {n.id for n in topo.numa_nodes}
    if set(memory) - nodes:
        raise bad(f"memory_bytes names NUMA node {sorted(set(memory) - nodes)[0]}, which does not exist")
    shares_obj = obj.get("gpu_shares", {})
    if not isinstance(shares_obj, dict):
        raise bad('gpu_shares must be an object {"<gpu index>": {"share": 0.5, "slots": 2}}')
    try:
        shares = {int(k): (round(float(v["share"]) * MILLI), int(v["slots"])) for k, v in shares_obj.items()}
        quota = {str(k): round(float(v) * MILLI) for k, v in dict(obj.get("cpu_quota", {})).items()}
    except (KeyError, TypeError, ValueError) as err:
        raise bad(f"gpu_shares or cpu_quota is malformed ({err})") from None
    unbound = obj.get("memory_unbound_bytes", 0)
    shared = obj.get("shared_slots", 0)
    for key, value in (("memory_unbound_bytes", unbound), ("shared_slots", shared)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise bad(f"{key} must be a non-negative integer")
    return Allocated(
        cpus=frozenset(cpus),
        gpus=frozenset(gpus),
        mig=frozenset(str(m) for m in _list(obj.get("mig", []), "mig", bad)),
        gpu_shares=shares,
        fpgas=frozenset(str(f) for f in _list(obj.get("fpgas", []), "fpgas", bad)),
        devices=frozenset(str(d) for d in _list(obj.get("devices", []), "devices", bad)),
        memory_by_node=_frozen_map(memory),
        memory_unbound=unbound,
        quota_millis=_frozen_map(quota),
        shared_slots=shared,
    )


def _list(value: Any, key: str, bad: Callable[[str], InvalidRequest]) -> list[Any]:
    if not isinstance(value, list):
        raise bad(f"{key} must be a list")
    return value


def _int_list(value: Any, key: str, bad: Callable[[str], InvalidRequest]) -> list[int]:
    items = _list(value, key, bad)
    for v in items:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise bad(f"{key} must hold non-negative integers, got {v!r}")
    return items


def _int_map(value: Any, key: str, bad: Callable[[str], InvalidRequest]) -> dict[int, int]:
    if not isinstance(value, dict):
        raise bad(f'{key} must be an object {{"<numa id>": bytes}}')
    out: dict[int, int] = {}
    for k, v in value.items():
        if not str(k).isdigit() or isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise bad(f"{key} must map NUMA ids to non-negative byte counts, got {k!r}: {v!r}")
        out[int(k)] = v
    return out


class FreeDevices(NamedTuple):
    """The devices one NUMA node (or, for node None, no node in particular) has free for a request."""

    gpus: tuple[int, ...]
    mig: tuple[tuple[Gpu, MigInstance], ...]
    shares: tuple[int, ...]
    fpgas: tuple[str, ...]
    stranded: int  #: free devices here that the request does not use (placing it here strands them)
    counts: tuple[int, int, int, int]  #: how many GPUs, MIG instances, shareable GPUs, FPGAs


NO_DEVICES = FreeDevices((), (), (), (), 0, (0, 0, 0, 0))


@dataclass(frozen=True, slots=True)
class LedgerView:
    """What one ledger leaves free under one :class:`UsableCpus`, per NUMA node.

    The CPU tables (free cores an exclusive slot may take, their CPU count, free pool CPUs, and
    the nodes without devices sorted by each count) are never changed once built; :meth:`after`
    makes the view of a ledger that differs by one slot, recomputing only the nodes it touches.
    ``devices`` caches free devices per (request kind, node) and is shared by the views of ledgers
    that hold the same devices.
    """

    index: PlacementIndex
    usable: UsableCpus
    cores: dict[int, tuple[FreeCore, ...]]
    cpus: dict[int, int]
    spare: dict[int, int]  #: of ``cpus``, those in partly used cores (whole_cores off; else empty)
    pool: dict[int, int]
    plain_by_cpus: list[tuple[int, int]]  #: (free CPUs, node) of nodes without devices, ascending
    plain_by_pool: list[tuple[int, int]]  #: (free pool CPUs, node) of the same nodes, ascending
    devices: dict[tuple[Any, ...], dict[int | None, FreeDevices]]  #: request kind -> node -> free

    @classmethod
    def build(cls, index: PlacementIndex, usable: UsableCpus, taken: int) -> LedgerView:
        view = cls(index, usable, {}, {}, {}, {}, [], [], {})
        view._refresh(index.node_ids, taken)
        return view

    def after(self, a: Assignment, changed: int, taken: int) -> LedgerView:
        """The view once ``a`` is added or removed: ``changed`` its CPUs, ``taken`` all held now."""
        devices = self._devices_after(a)
        if not changed:
            return self if devices is self.devices else replace(self, devices=devices)
        node_of = self.index.cpu_node
        nodes = {node_of[c] for c in ids_of(changed) if c in node_of}
        view = LedgerView(
            self.index,
            self.usable,
            dict(self.cores),
            dict(self.cpus),
            dict(self.spare),
            dict(self.pool),
            list(self.plain_by_cpus),
            list(self.plain_by_pool),
            devices,
        )
        view._refresh(nodes, taken)
        return view

    def _devices_after(self, a: Assignment) -> dict[tuple[Any, ...], dict[int | None, FreeDevices]]:
        """The device cache without the nodes whose devices ``a`` takes or gives back."""
        index = self.index
        gpus = {*a.gpus, *(s.gpu_index for s in a.gpu_shares)}
        stale = {index.gpu_by_index[i].numa for i in gpus if i in index.gpu_by_index}
        stale |= {index.mig_node[m.key] for m in a.mig if m.key in index.mig_node}
        stale |= {index.fpga_numa[f] for f in a.fpgas if f in index.fpga_numa}
        if not stale:
            return self.devices
        # Snapshots of the items: planners on other ledgers that share this cache may add to it.
        return {
            kind: {node: dev for node, dev in list(by_node.items()) if node not in stale}
            for kind, by_node in list(self.devices.items())
        }

    def _refresh(self, nodes: Iterable[int], taken: int) -> None:
        """Recompute ``nodes`` (only while this view is being made)."""
        index, usable = self.index, self.usable
        free_pool = usable.pool_base & ~taken
        for node in nodes:
            cores, cpus, spare = index.free_cores(usable, node, taken, usable.whole_cores)
            pool = (free_pool & index.node_mask[node]).bit_count()
            if node not in index.device_node_set:
                _resort(self.plain_by_cpus, node, self.cpus.get(node), cpus)
                _resort(self.plain_by_pool, node, self.pool.get(node), pool)
            self.cores[node], self.cpus[node], self.pool[node] = cores, cpus, pool
            if not usable.whole_cores:
                self.spare[node] = spare


def _resort(ranked: list[tuple[int, int]], node: int, old: int | None, new: int) -> None:
    if old is not None:
        del ranked[bisect.bisect_left(ranked, (old, node))]
    bisect.insort(ranked, (new, node))
