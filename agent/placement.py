"""Which CPUs, memory, GPUs, MIG instances, FPGAs and devices a slot gets. Pure: no I/O.

``plan(topology, allocated, request, options)`` returns an :class:`Assignment` or raises
PlacementError saying what was asked, what is free and where. ``Allocated`` is the caller's ledger
of what slots hold (``add``/``remove`` return new ledgers). docs/placement.md explains the choices;
in short:

- guaranteed slots get exclusive whole physical cores (siblings never shared between slots) from
  one NUMA node when they fit (best fit: the node, then the L3 cache, that leaves the least free
  behind, avoiding nodes whose devices the slot does not use), else from the fewest, nearest nodes
  (whole nodes first), or spread evenly with ``distribute_across_numa``;
- burstable and best-effort slots get a CPU quota on the shared pool (neither reserved, isolated
  nor exclusive), within an overcommit ratio per class; exclusive slots may not shrink the pool
  below the quota burstable slots were promised;
- memory is accounted per NUMA node and bound to the slot's nodes unless its policy is ``none``;
- devices (whole GPUs, MIG instances by profile, GPU shares, FPGAs) come from the slot's nodes.

Speed: a :class:`PlacementIndex` is built once per Topology object and CPU sets are ints used as
bitsets. What a ledger leaves free per node (free whole cores, pool CPUs, nodes without devices
sorted by free CPUs, free devices) is a view kept on the ledger; ``add``/``remove`` hand it to the
new ledger with only the touched nodes recomputed. A decision therefore looks at the nodes that
hold devices and at a handful of others, not at every node or CPU: a few tens of microseconds
whether the host has 16 CPUs or 1024 (bench/placement.py).
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, NamedTuple

from nodeagent.cpulist import format_cpulist, parse_cpulist
from nodeagent.devices.topology import Gpu, MigInstance, Topology
from nodeagent.errors import ConfigError, Conflict, InvalidRequest, PlacementError
from nodeagent.schema.request import MILLI, Resources, SlotRequest, format_quantity, parse_slot_request

#: Stands for "unlimited" where the topology does not say how much memory a node has.
UNKNOWN_MEMORY = 1 << 62
_SHARE_CAPACITY = MILLI  # one GPU, in thousandths
_UNKNOWN_DISTANCE = 20


# =========================================================================== options


@dataclass(frozen=True)
class PlacementOptions:
    whole_cores: bool = True  #: never split a physical core's hyperthreads between two slots
    round_up_to_cores: bool = True  #: with whole_cores, an odd request takes whole cores (else: refused)
    distribute_across_numa: bool = False  #: wide guaranteed slots: spread evenly over the fewest nodes
    reserved_cpus: frozenset[int] | None = None  #: None: the first physical core on hosts with >= 4 CPUs
    use_isolated_cpus: bool = False  #: hand isolcpus CPUs to guaranteed slots (never to the pool)
    burstable_overcommit: float = 1.0  #: burstable quota may reach pool CPUs x this
    best_effort_overcommit: float = 4.0  #: best effort yields to everyone, so it may overcommit more
    shareable_gpus: frozenset[str] = frozenset()  #: GPU indexes or UUIDs that take gpu_share slots
    max_shares_per_gpu: int = 4
    allowed_devices: frozenset[str] = frozenset()  #: device paths a request may name
    shared_devices: frozenset[str] = frozenset()  #: allowed paths many slots may hold at once

    @classmethod
    def from_strings(cls, items: Iterable[str]) -> PlacementOptions:
        """Parse ``KEY=VALUE`` strings (the CLI's ``--option``); ConfigError names bad ones."""
        values: dict[str, Any] = {}
        for item in items:
            key, sep, raw = item.partition("=")
            key = key.strip()
            if not sep:
                raise ConfigError(f"placement option {item!r} is not KEY=VALUE; e.g. whole_cores=false")
            if key not in _OPTION_PARSERS:
                raise ConfigError(
                    f"unknown placement option {key!r}; known options: {', '.join(sorted(_OPTION_PARSERS))}"
                )
            parse, expected = _OPTION_PARSERS[key]
            try:
                values[key] = parse(raw.strip())
            except (ValueError, InvalidRequest):
                raise ConfigError(f"placement option {key}={raw!r}: expected {expected}") from None
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return {
            "whole_cores": self.whole_cores,
            "round_up_to_cores": self.round_up_to_cores,
            "distribute_across_numa": self.distribute_across_numa,
            "reserved_cpus": None if self.reserved_cpus is None else format_cpulist(self.reserved_cpus),
            "use_isolated_cpus": self.use_isolated_cpus,
            "burstable_overcommit": self.burstable_overcommit,
            "best_effort_overcommit": self.best_effort_overcommit,
            "shareable_gpus": sorted(self.shareable_gpus),
            "max_shares_per_gpu": self.max_shares_per_gpu,
            "allowed_devices": sorted(self.allowed_devices),
            "shared_devices": sorted(self.shared_devices),
        }


def _parse_bool(raw: str) -> bool:
    lowered = raw.lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise ValueError(raw)


def _parse_ratio(raw: str) -> float:
    value = float(raw)
    if not math.isfinite(value) or not 0 < value <= 1000:
        raise ValueError(raw)
    return value


def _parse_count(raw: str) -> int:
    value = int(raw)
    if not 1 <= value <= 1000:
        raise ValueError(raw)
    return value


def _parse_words(raw: str) -> frozenset[str]:
    return frozenset(w.strip() for w in raw.split(",") if w.strip())


_OPTION_PARSERS: dict[str, tuple[Callable[[str], Any], str]] = {
    "whole_cores": (_parse_bool, "true or false"),
    "round_up_to_cores": (_parse_bool, "true or false"),
    "distribute_across_numa": (_parse_bool, "true or false"),
    "reserved_cpus": (parse_cpulist, "a cpulist such as 0,1 or 0-3 (empty for none)"),
    "use_isolated_cpus": (_parse_bool, "true or false"),
    "burstable_overcommit": (_parse_ratio, "a ratio above 0, such as 1.0 or 1.5"),
    "best_effort_overcommit": (_parse_ratio, "a ratio above 0, such as 4"),
    "shareable_gpus": (_parse_words, "comma-separated GPU indexes or UUIDs"),
    "max_shares_per_gpu": (_parse_count, "a whole number from 1 to 1000"),
    "allowed_devices": (_parse_words, "comma-separated device paths"),
    "shared_devices": (_parse_words, "comma-separated device paths"),
}


# =========================================================================== assignment


@dataclass(frozen=True, slots=True)
class MigAssignment:
    gpu_index: int
    uuid: str | None
    gpu_instance_id: int
    compute_instance_id: int | None
    profile: str

    @property
    def key(self) -> str:
        return mig_key(self.gpu_index, self.uuid, self.gpu_instance_id, self.compute_instance_id)


@dataclass(frozen=True, slots=True)
class GpuShare:
    gpu_index: int
    millis: int  #: thousandths of the GPU


@dataclass(frozen=True, slots=True)
class DeviceAssignment:
    path: str
    exclusive: bool


@dataclass(frozen=True)
class Assignment:
    name: str
    qos: str
    cpus: tuple[int, ...]  #: exclusive CPUs, or the shared pool when the plan was made
    exclusive: bool
    cpu_quota_millis: int
    numa_nodes: tuple[int, ...]
    memory_bytes: int
    memory_by_node: Mapping[int, int]  #: empty: memory not bound to a node
    gpus: tuple[int, ...] = ()
    gpu_uuids: tuple[str | None, ...] = ()
    mig: tuple[MigAssignment, ...] = ()
    gpu_shares: tuple[GpuShare, ...] = ()
    fpgas: tuple[str, ...] = ()
    devices: tuple[DeviceAssignment, ...] = ()
    reasons: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "qos": self.qos,
            "cpus": list(self.cpus),
            "cpuset": format_cpulist(self.cpus),
            "exclusive": self.exclusive,
            "cpu_quota": self.cpu_quota_millis / MILLI,
            "numa_nodes": list(self.numa_nodes),
            "memory_bytes": self.memory_bytes,
            "memory_bytes_by_node": {str(k): v for k, v in sorted(self.memory_by_node.items())},
            "gpus": list(self.gpus),
            "gpu_uuids": list(self.gpu_uuids),
            "mig": [
                {
                    "gpu_index": m.gpu_index,
                    "uuid": m.uuid,
                    "gpu_instance_id": m.gpu_instance_id,
                    "compute_instance_id": m.compute_instance_id,
                    "profile": m.profile,
                }
                for m in self.mig
            ],
            "gpu_shares": [{"gpu_index": s.gpu_index, "share": s.millis / MILLI} for s in self.gpu_shares],
            "fpgas": list(self.fpgas),
            "devices": [{"path": d.path, "exclusive": d.exclusive} for d in self.devices],
            "reasons": list(self.reasons),
        }

    @classmethod
    def from_dict(cls, obj: Any) -> Assignment:
        """Read back :meth:`to_dict` (as stored in the state database); InvalidRequest if malformed."""
        try:
            return cls(
                name=str(obj["name"]),
                qos=str(obj["qos"]),
                cpus=tuple(int(c) for c in obj["cpus"]),
                exclusive=bool(obj["exclusive"]),
                cpu_quota_millis=round(float(obj["cpu_quota"]) * MILLI),
                numa_nodes=tuple(int(n) for n in obj["numa_nodes"]),
                memory_bytes=int(obj["memory_bytes"]),
                memory_by_node={int(k): int(v) for k, v in obj["memory_bytes_by_node"].items()},
                gpus=tuple(int(g) for g in obj["gpus"]),
                gpu_uuids=tuple(None if u is None else str(u) for u in obj["gpu_uuids"]),
                mig=tuple(
                    MigAssignment(
                        gpu_index=int(m["gpu_index"]),
                        uuid=m["uuid"],
                        gpu_instance_id=int(m["gpu_instance_id"]),
                        compute_instance_id=m["compute_instance_id"],
                        profile=str(m["profile"]),
                    )
                    for m in obj["mig"]
                ),
                gpu_shares=tuple(
                    GpuShare(int(s["gpu_index"]), round(float(s["share"]) * MILLI)) for s in obj["gpu_shares"]
                ),
                fpgas=tuple(str(f) for f in obj["fpgas"]),
                devices=tuple(DeviceAssignment(str(d["path"]), bool(d["exclusive"])) for d in obj["devices"]),
                reasons=tuple(str(r) for r in obj.get("reasons", ())),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise InvalidRequest(f"assignment: malformed JSON ({type(err).__name__}: {err})") from err


def mig_key(gpu_index: int, uuid: str | None, gi: int, ci: int | None) -> str:
    """How the ledger names a MIG instance: its UUID, else gpu:gi:ci."""
    return uuid if uuid is not None else f"{gpu_index}:{gi}:{ci}"


# =========================================================================== ledger


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

    @cached_property
    def cpu_mask(self) -> int:
        return _mask(self.cpus)

    @cached_property
    def memory_total(self) -> int:
        return sum(self.memory_by_node.values()) + self.memory_unbound

    def _view(self, index: PlacementIndex, usable: _Usable) -> _LedgerView:
        """What this ledger leaves free under ``usable``, per node: worked out once per ledger.

        Ledgers made by :meth:`add` and :meth:`remove` inherit their parent's views with only the
        nodes the slot's CPUs sit on recomputed, so a decision does not pay for every node.
        """
        views: dict[int, _LedgerView] = self.__dict__.setdefault("_views", {})
        view = views.get(id(usable))  # the view holds ``usable``, so its id is not reused
        if view is None:
            if len(views) >= 4:
                views.clear()
            view = views[id(usable)] = _LedgerView.build(index, usable, self.cpu_mask)
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
        )
        self._hand_down(ledger, a, sign)
        return ledger

    def _hand_down(self, child: Allocated, a: Assignment, sign: int) -> None:
        """Give ``child`` (this ledger changed by ``a``) this ledger's views, brought up to date."""
        if "cpu_mask" not in self.__dict__:
            return
        changed = _mask(a.cpus) if a.exclusive else 0
        taken = self.cpu_mask | changed if sign > 0 else self.cpu_mask & ~changed
        child.__dict__["cpu_mask"] = taken
        views: dict[int, _LedgerView] = self.__dict__.get("_views", {})
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


# =========================================================================== topology index


def _mask(ids: Iterable[int]) -> int:
    m = 0
    for i in ids:
        m |= 1 << i
    return m


_BITS_OF_BYTE = tuple(tuple(bit for bit in range(8) if value >> bit & 1) for value in range(256))


def _ids(mask: int) -> tuple[int, ...]:
    out: list[int] = []
    if mask.bit_count() <= 8:
        while mask:
            low = mask & -mask
            out.append(low.bit_length() - 1)
            mask ^= low
        return tuple(out)
    # Dense masks (a shared pool of hundreds of CPUs): a byte at a time rather than a bit at a time.
    for pos, byte in enumerate(mask.to_bytes((mask.bit_length() + 7) // 8, "little")):
        if byte:
            base = pos * 8
            out.extend(base + bit for bit in _BITS_OF_BYTE[byte])
    return tuple(out)


_Core = tuple[int, int, tuple[int, int]]
"""(core id, its free (or usable) CPUs as a mask, its L3 group (node, cache id))."""


@dataclass(frozen=True, slots=True)
class _Usable:
    """What the options leave to placement on one topology."""

    reserved: int  #: reserved CPUs (mask)
    exclusive_cpus: int  #: CPUs that may be given exclusively (mask)
    pool_base: int  #: CPUs of the shared pool before exclusive slots take theirs (mask)
    cores_by_node: Mapping[int, tuple[_Core, ...]]
    """node -> (core, its usable CPUs mask, L3 group), ordered by L3 group then core id."""
    whole_cores: bool


@dataclass(frozen=True, slots=True)
class _GpuRoles:
    """How one node's healthy GPUs can be handed out under one ``shareable_gpus`` option."""

    whole: tuple[int, ...] = ()  #: GPU indexes given whole
    shareable: tuple[int, ...] = ()  #: GPU indexes that take gpu_share slots
    mig: tuple[tuple[str, Gpu, MigInstance], ...] = ()  #: (ledger key, GPU, instance) of MIG GPUs


class _Devices(NamedTuple):
    """The devices one NUMA node (or, for node None, no node in particular) has free for a request."""

    gpus: tuple[int, ...]
    mig: tuple[tuple[Gpu, MigInstance], ...]
    shares: tuple[int, ...]
    fpgas: tuple[str, ...]
    stranded: int  #: free devices here that the request does not use (placing it here strands them)
    counts: tuple[int, int, int, int]  #: how many GPUs, MIG instances, shareable GPUs, FPGAs


_NO_DEVICES = _Devices((), (), (), (), 0, (0, 0, 0, 0))


@dataclass(frozen=True, slots=True)
class _LedgerView:
    """What one ledger leaves free under one :class:`_Usable`, per NUMA node.

    The CPU tables (free cores an exclusive slot may take, their CPU count, free pool CPUs, and
    the nodes without devices sorted by each count) are never changed once built; :meth:`after`
    makes the view of a ledger that differs by one slot, recomputing only the nodes it touches.
    ``devices`` caches free devices per (request kind, node) and is shared by the views of ledgers
    that hold the same devices.
    """

    index: PlacementIndex
    usable: _Usable
    cores: dict[int, tuple[_Core, ...]]
    cpus: dict[int, int]
    pool: dict[int, int]
    plain_by_cpus: list[tuple[int, int]]  #: (free CPUs, node) of nodes without devices, ascending
    plain_by_pool: list[tuple[int, int]]  #: (free pool CPUs, node) of the same nodes, ascending
    devices: dict[tuple[Any, ...], dict[int | None, _Devices]]  #: request kind -> node -> free

    @classmethod
    def build(cls, index: PlacementIndex, usable: _Usable, taken: int) -> _LedgerView:
        view = cls(index, usable, {}, {}, {}, [], [], {})
        view._refresh(index.node_ids, taken)
        return view

    def after(self, a: Assignment, changed: int, taken: int) -> _LedgerView:
        """The view once ``a`` is added or removed: ``changed`` its CPUs, ``taken`` all held now."""
        devices = self._devices_after(a)
        if not changed:
            return self if devices is self.devices else replace(self, devices=devices)
        node_of = self.index.cpu_node
        nodes = {node_of[c] for c in _ids(changed) if c in node_of}
        view = _LedgerView(
            self.index,
            self.usable,
            dict(self.cores),
            dict(self.cpus),
            dict(self.pool),
            list(self.plain_by_cpus),
            list(self.plain_by_pool),
            devices,
        )
        view._refresh(nodes, taken)
        return view

    def _devices_after(self, a: Assignment) -> dict[tuple[Any, ...], dict[int | None, _Devices]]:
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
            cores, cpus = index.free_cores(usable, node, taken, usable.whole_cores)
            pool = (free_pool & index.node_mask[node]).bit_count()
            if node not in index.device_node_set:
                _resort(self.plain_by_cpus, node, self.cpus.get(node), cpus)
                _resort(self.plain_by_pool, node, self.pool.get(node), pool)
            self.cores[node], self.cpus[node], self.pool[node] = cores, cpus, pool


def _resort(ranked: list[tuple[int, int]], node: int, old: int | None, new: int) -> None:
    if old is not None:
        del ranked[bisect.bisect_left(ranked, (old, node))]
    bisect.insort(ranked, (new, node))


class PlacementIndex:
    """Per-topology tables placement needs on every decision, computed once."""

    def __init__(self, topo: Topology) -> None:
        self.topology = topo
        self.node_ids = tuple(sorted(n.id for n in topo.numa_nodes) or sorted({c.numa for c in topo.cpus}))
        self.online_mask = _mask(topo.online_cpus)
        self.isolated_mask = _mask(topo.isolated_cpus) & self.online_mask
        self.node_mask = dict.fromkeys(self.node_ids, 0)
        for c in topo.cpus:
            if c.online:
                self.node_mask[c.numa] |= 1 << c.id
        self.node_socket = {c.numa: c.socket for c in topo.cpus}
        self.distance = self._distances(topo)
        self.node_memory = {
            n.id: UNKNOWN_MEMORY if n.memory_bytes is None else n.memory_bytes for n in topo.numa_nodes
        }
        self.memory_known = all(n.memory_bytes is not None for n in topo.numa_nodes)
        self.host_memory = (
            topo.memory_bytes
            if topo.memory_bytes is not None
            else (sum(self.node_memory.values()) if self.memory_known else UNKNOWN_MEMORY)
        )
        self.core_mask = {
            core: _mask(c for c in cpus if topo.cpu_by_id[c].online) for core, cpus in topo.cores.items()
        }
        self.core_l3 = {c.core: (c.numa, -1 if c.l3 is None else c.l3) for c in topo.cpus}
        self.core_node = {c.core: c.numa for c in topo.cpus}
        sizes = [m.bit_count() for m in self.core_mask.values() if m]
        self.threads_per_core = max(set(sizes), key=sizes.count) if sizes else 1
        self.gpu_by_index = {g.index: g for g in topo.gpus}
        self.gpus_by_node: dict[int | None, tuple[Gpu, ...]] = {}
        for g in topo.gpus:
            self.gpus_by_node[g.numa] = (*self.gpus_by_node.get(g.numa, ()), g)
        self.fpgas_by_node: dict[int | None, tuple[str, ...]] = {}
        for f in topo.fpgas:
            if f.healthy is not False:
                self.fpgas_by_node[f.numa] = (*self.fpgas_by_node.get(f.numa, ()), f.id)
        self.fpga_numa = {f.id: f.numa for f in topo.fpgas}
        self.cpu_node = {c.id: c.numa for c in topo.cpus if c.online}
        # Nodes with no GPU or FPGA are told apart by free CPUs and memory alone (see _LedgerView).
        self.device_nodes = tuple(
            n for n in self.node_ids if n in self.gpus_by_node or n in self.fpgas_by_node
        )
        self.device_node_set = frozenset(self.device_nodes)
        self.mig_keys = {
            g.index: tuple(
                mig_key(g.index, i.uuid, i.gpu_instance_id, i.compute_instance_id) for i in g.mig.instances
            )
            for g in topo.gpus
            if g.mig is not None
        }
        self.mig_node = {key: g.numa for g in topo.gpus for key in self.mig_keys.get(g.index, ())}
        self._usable: dict[tuple[frozenset[int] | None, bool, bool], _Usable] = {}
        self._gpu_roles: dict[frozenset[str], dict[int | None, _GpuRoles]] = {}
        self._free_cores: dict[tuple[int, int, int, bool], tuple[tuple[_Core, ...], int]] = {}
        self._nearest = {n: self._by_distance_from(n) for n in self.node_ids}
        self._others = {n: tuple(o for o in self._nearest[n] if o != n) for n in self.node_ids}

    def _by_distance_from(self, node: int) -> tuple[int, ...]:
        row = self.distance[node]
        return tuple(sorted(self.node_ids, key=lambda other: (row[other], other)))

    def _distances(self, topo: Topology) -> dict[int, dict[int, int]]:
        ids = [n.id for n in topo.numa_nodes]
        out: dict[int, dict[int, int]] = {}
        for n in topo.numa_nodes:
            row = n.distances
            out[n.id] = {
                other: (
                    row[pos]
                    if row is not None and pos < len(row)
                    else (10 if other == n.id else _UNKNOWN_DISTANCE)
                )
                for pos, other in enumerate(ids)
            }
        return out

    def free_cores(
        self, usable: _Usable, node: int, taken: int, whole_cores: bool
    ) -> tuple[tuple[_Core, ...], int]:
        """Free cores of ``node`` (core, free CPUs mask, L3 group) and their CPU count.

        Memoised on what is taken on that node: between two decisions most nodes do not change.
        """
        key = (id(usable), node, taken & self.node_mask[node], whole_cores)
        hit = self._free_cores.get(key)
        if hit is not None:
            return hit
        cores = []
        count = 0
        for core, cmask, l3 in usable.cores_by_node[node]:
            free = cmask & ~taken
            if free and (free == cmask or not whole_cores):
                cores.append((core, free, l3))
                count += free.bit_count()
        if len(self._free_cores) >= 8192:
            self._free_cores.clear()
        found = self._free_cores[key] = (tuple(cores), count)
        return found

    def nearest_first(self, node: int) -> tuple[int, ...]:
        """All nodes, nearest to ``node`` first (SLIT distance, then id)."""
        return self._nearest[node]

    def others_nearest_first(self, node: int) -> tuple[int, ...]:
        """The other nodes, nearest to ``node`` first."""
        return self._others[node]

    def gpu_roles(self, shareable: frozenset[str]) -> Mapping[int | None, _GpuRoles]:
        """Per node (None: unknown), the healthy GPUs given whole, shared, or as MIG instances."""
        found = self._gpu_roles.get(shareable)
        if found is None:
            found = self._gpu_roles[shareable] = {
                node: self._roles(gpus, shareable) for node, gpus in self.gpus_by_node.items()
            }
        return found

    def _roles(self, gpus: Iterable[Gpu], shareable: frozenset[str]) -> _GpuRoles:
        whole, shared, mig = [], [], []
        for g in gpus:
            if g.healthy is False:
                continue
            if g.mig is not None and g.mig.enabled:
                mig += [
                    (key, g, inst) for key, inst in zip(self.mig_keys[g.index], g.mig.instances, strict=True)
                ]
            elif str(g.index) in shareable or (g.uuid is not None and g.uuid in shareable):
                shared.append(g.index)
            else:
                whole.append(g.index)
        return _GpuRoles(tuple(whole), tuple(shared), tuple(mig))

    def default_reserved(self) -> frozenset[int]:
        """The first physical core, on hosts with 4 or more online CPUs (kubelet's usual choice)."""
        online = self.topology.online_cpus
        if len(online) < 4:
            return frozenset()
        first = self.topology.cpu_by_id[min(online)]
        return frozenset(self.topology.cores[first.core])

    def usable(self, options: PlacementOptions) -> _Usable:
        key = (options.reserved_cpus, options.use_isolated_cpus, options.whole_cores)
        found = self._usable.get(key)
        if found is None:
            found = self._usable[key] = self._compute_usable(options)
        return found

    def _compute_usable(self, options: PlacementOptions) -> _Usable:
        reserved_ids = options.reserved_cpus
        if reserved_ids is None:
            reserved_ids = self.default_reserved()
        stray = sorted(reserved_ids - set(self.topology.cpu_by_id))
        if stray:
            raise ConfigError(
                f"reserved_cpus lists CPUs {format_cpulist(stray)}, which this host does not have; "
                f"its CPUs are {format_cpulist(self.topology.cpu_by_id)}"
            )
        reserved = _mask(reserved_ids) & self.online_mask
        pool_base = self.online_mask & ~reserved & ~self.isolated_mask
        exclusive = pool_base | (self.isolated_mask & ~reserved if options.use_isolated_cpus else 0)
        cores_by_node: dict[int, list[_Core]] = {n: [] for n in self.node_ids}
        for core, cmask in self.core_mask.items():
            usable = cmask & exclusive
            if not usable or (options.whole_cores and usable != cmask):
                continue  # a core with a reserved or isolated sibling is never split
            cores_by_node[self.core_node[core]].append((core, usable, self.core_l3[core]))
        return _Usable(
            reserved=reserved,
            exclusive_cpus=exclusive,
            pool_base=pool_base,
            cores_by_node={n: tuple(sorted(v, key=lambda t: (t[2], t[0]))) for n, v in cores_by_node.items()},
            whole_cores=options.whole_cores,
        )


_INDEX_CACHE: dict[int, tuple[weakref.ref[Topology], PlacementIndex]] = {}


def placement_index(topo: Topology) -> PlacementIndex:
    """The index of ``topo``, built on first use and kept while the Topology object lives."""
    key = id(topo)
    hit = _INDEX_CACHE.get(key)
    if hit is not None and hit[0]() is topo:
        return hit[1]
    index = PlacementIndex(topo)

    def forget(ref: weakref.ref[Topology], cache: dict[int, Any] = _INDEX_CACHE) -> None:
        # Bound as a default: at interpreter exit the module's globals may already be gone.
        if key in cache and cache[key][0] is ref:
            del cache[key]

    _INDEX_CACHE[key] = (weakref.ref(topo, forget), index)
    return index


# =========================================================================== supply and demand


@dataclass(frozen=True, slots=True)
class _Demand:
    cpus: int  #: exclusive CPUs (guaranteed) or pool CPUs needed on the node (others, policy single)
    memory: int
    gpus: int
    mig: int
    share: int
    fpgas: int

    def describe(self, request: SlotRequest) -> str:
        parts = []
        if self.cpus:
            parts.append(f"{self.cpus} exclusive CPUs" if request.guaranteed else f"{self.cpus} shared CPUs")
        if self.memory:
            parts.append(f"{format_quantity(self.memory)} memory")
        if self.gpus:
            parts.append(_plural(self.gpus, "GPU"))
        if self.mig:
            parts.append(_plural(self.mig, "MIG instance") + f" of profile {request.resources.gpu_profile}")
        if self.share:
            parts.append(f"a {request.resources.gpu_share:g} share of a GPU")
        if self.fpgas:
            parts.append(_plural(self.fpgas, "FPGA"))
        return ", ".join(parts) or "nothing"


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


class _Planner:
    """One decision: the request against the free resources. Build, call :meth:`plan`, discard."""

    def __init__(
        self, topo: Topology, allocated: Allocated, request: SlotRequest, options: PlacementOptions
    ) -> None:
        self.index = placement_index(topo)
        self.usable = self.index.usable(options)
        self.alloc = allocated
        self.request = request
        self.res: Resources = request.resources
        self.options = options
        self.reasons: list[str] = []
        self.pool = self.usable.pool_base & ~allocated.cpu_mask
        self.demand = self._demand()
        self.host_memory_free = self.index.host_memory - allocated.memory_total
        self.free = allocated._view(self.index, self.usable)
        #: Free CPUs per node for this request: whole free cores if guaranteed, else the pool's.
        self.cpus = self.free.cpus if request.guaranteed else self.free.pool
        kinds = self.free.devices
        if len(kinds) >= 64:
            kinds.clear()
        self._free_devices_by_node = kinds.setdefault(self._request_device_kind(), {})
        self.floating = self.devices(None)

    # ------------------------------------------------------------------ demand and supply

    def _demand(self) -> _Demand:
        res = self.res
        if self.request.guaranteed:
            cpus = res.whole_cpus
        elif res.numa == "single":
            cpus = max(1, math.ceil(res.cpu_millis / MILLI))
        else:
            cpus = 0
        bound_memory = (
            res.memory_bytes
            if res.numa != "none" and (self.request.guaranteed or res.numa == "single")
            else 0
        )
        return _Demand(
            cpus=cpus,
            memory=bound_memory,
            gpus=0 if res.gpu_profile else res.gpus,
            mig=res.gpus if res.gpu_profile else 0,
            share=1 if res.gpu_share_millis else 0,
            fpgas=res.fpgas,
        )

    def memory(self, node: int) -> int:
        """Memory this node can still give (never more than the host has left)."""
        node_free = self.index.node_memory[node] - self.alloc.memory_by_node.get(node, 0)
        return max(0, min(node_free, self.host_memory_free))

    def devices(self, node: int | None) -> _Devices:
        """The free devices of ``node`` for this request, worked out once per ledger and kind."""
        if node is not None and node not in self.index.device_node_set:
            return _NO_DEVICES
        known = self._free_devices_by_node
        found = known.get(node)
        if found is None:
            found = known[node] = self._free_devices(node)
        return found

    def _request_device_kind(self) -> tuple[Any, ...]:
        """Everything besides the ledger that :meth:`_free_devices` depends on."""
        d, opts = self.demand, self.options
        return (
            opts.shareable_gpus,
            opts.max_shares_per_gpu,
            d.gpus > 0,
            self.res.gpu_profile if d.mig else None,
            self.res.gpu_share_millis,
            d.fpgas > 0,
        )

    def _free_devices(self, node: int | None) -> _Devices:
        d, alloc, opts = self.demand, self.alloc, self.options
        roles = self.index.gpu_roles(opts.shareable_gpus).get(node, _GpuRoles())
        gpus = tuple(i for i in roles.whole if i not in alloc.gpus)
        mig = [
            (g, inst)
            for key, g, inst in roles.mig
            if key not in alloc.mig and (not d.mig or inst.profile == self.res.gpu_profile)
        ]
        if mig:
            # Pack MIG instances onto GPUs that are already partly used.
            mig.sort(key=lambda t: (-self._mig_used(t[0]), t[0].index, t[1].gpu_instance_id))
        shares = [i for i in roles.shareable if i not in alloc.gpus and self._share_fits(i)]
        # Best fit for shares: the fullest GPU that still takes this one.
        shares.sort(key=lambda i: (-alloc.gpu_shares.get(i, (0, 0))[0], i))
        fpgas = tuple(f for f in self.index.fpgas_by_node.get(node, ()) if f not in alloc.fpgas)
        stranded = (
            (len(gpus) if not d.gpus else 0)
            + (len(mig) if not d.mig else 0)
            + (len(fpgas) if not d.fpgas else 0)
        )
        counts = (len(gpus), len(mig), len(shares), len(fpgas))
        return _Devices(gpus, tuple(mig), tuple(shares), fpgas, stranded, counts)

    def _share_fits(self, gpu: int) -> bool:
        millis, count = self.alloc.gpu_shares.get(gpu, (0, 0))
        return (
            millis + self.res.gpu_share_millis <= _SHARE_CAPACITY and count < self.options.max_shares_per_gpu
        )

    def _mig_used(self, gpu: Gpu) -> int:
        return sum(key in self.alloc.mig for key in self.index.mig_keys[gpu.index])

    # ------------------------------------------------------------------ fitting node sets

    def _vector(self, node: int) -> tuple[int, ...]:
        return (self.cpus[node], self.memory(node), *self.devices(node).counts)

    def _need(self, with_cpus: bool = True, with_devices: bool = True) -> tuple[int, ...]:
        d, fl = self.demand, self.floating
        if not with_devices:
            return (d.cpus if with_cpus else 0, d.memory, 0, 0, 0, 0)
        return (
            d.cpus if with_cpus else 0,
            d.memory,
            d.gpus - len(fl.gpus),
            d.mig - len(fl.mig),
            d.share - len(fl.shares),
            d.fpgas - len(fl.fpgas),
        )

    def _fits_host(self, *, with_cpus: bool = True, with_devices: bool = True) -> bool:
        """Whether all nodes together (and the devices on no node) cover the request."""
        need = self._need(with_cpus, with_devices)
        total = [sum(self.cpus.values()), 0, 0, 0, 0, 0]
        if need[1] > 0:  # free memory is never negative, so a zero need is always covered
            total[1] = sum(self.memory(n) for n in self.index.node_ids)
        for n in self.index.device_nodes:
            _accumulate(total, (0, 0, *self.devices(n).counts))
        return _covers(total, need)

    def _single_node_score(self, node: int) -> tuple[int, ...]:
        dev, d = self.devices(node), self.demand
        return (
            dev.stranded,
            self.cpus[node] - d.cpus,
            len(dev.gpus) - d.gpus,
            len(dev.mig) - d.mig,
            len(dev.fpgas) - d.fpgas,
            node,
        )

    def _best_single_node(self, **fit: bool) -> int | None:
        """The fitting node with the lowest :meth:`_single_node_score`."""
        need = self._need(**fit)
        need_cpus, need_memory, need_devices = need[0], need[1], need[2:]
        best = self._best_plain_node(need)
        best_score = None if best is None else self._single_node_score(best)
        for node in self.index.device_nodes:
            if self.cpus[node] < need_cpus:
                continue
            dev = self.devices(node)
            # Stranding comes first in the score: a node that strands more than the best so far loses.
            if best_score is not None and dev.stranded > best_score[0]:
                continue
            if not _covers(dev.counts, need_devices) or (need_memory > 0 and self.memory(node) < need_memory):
                continue
            score = self._single_node_score(node)
            if best_score is None or score < best_score:
                best, best_score = node, score
        return best

    def _best_plain_node(self, need: tuple[int, ...]) -> int | None:
        """The best fit among nodes without devices: there the score comes down to (free CPUs, id)."""
        if any(n > 0 for n in need[2:]):
            return None
        need_cpus, need_memory = need[0], need[1]
        ranked = self.free.plain_by_cpus if self.request.guaranteed else self.free.plain_by_pool
        for _, node in itertools.islice(ranked, bisect.bisect_left(ranked, (need_cpus,)), None):
            if need_memory <= 0 or self.memory(node) >= need_memory:
                return node
        return None

    def _best_node_set(self, **fit: bool) -> list[int] | None:
        """Fewest nodes, then the nearest (sum of SLIT distances), then the least left over."""
        ids = self.index.node_ids
        if not self._fits_host(**fit):
            return None
        need = self._need(**fit)
        dist = self.index.distance
        free_cpus = self.cpus
        vectors = {n: self._vector(n) for n in ids}
        largest_first = sorted(ids, key=lambda n: (-free_cpus[n], n))
        candidates = [self._grow(largest_first, need, vectors)]
        for start in ids:
            # Greedy from each node: add the node nearest to those chosen; stop once larger than the best.
            chosen = [start]
            total = list(vectors[start])
            cost = dict(dist[start])
            limit = min(len(c) for c in candidates)
            while not _covers(total, need) and len(chosen) < limit:
                nxt = min((n for n in ids if n not in chosen), key=lambda n: (cost[n], -free_cpus[n], n))
                chosen.append(nxt)
                _accumulate(total, vectors[nxt])
                for n in ids:
                    cost[n] += dist[nxt][n]
            if _covers(total, need):
                candidates.append(chosen)
        return min(
            candidates,
            key=lambda c: (
                len(c),
                sum(dist[a][b] for a, b in itertools.combinations(c, 2)),
                sum(free_cpus[n] for n in c) - self.demand.cpus,
                sorted(c),
            ),
        )

    @staticmethod
    def _grow(
        order: Sequence[int], need: tuple[int, ...], vectors: Mapping[int, tuple[int, ...]]
    ) -> list[int]:
        chosen: list[int] = []
        total = [0] * len(need)
        for n in order:
            if _covers(total, need):
                break
            chosen.append(n)
            _accumulate(total, vectors[n])
        return chosen

    # ------------------------------------------------------------------ the decision

    def plan(self) -> Assignment:
        # Host-wide first: memory not bound to a node (numa "none") is held somewhere, so per-node
        # figures alone would let a slot spanning nodes promise memory the host no longer has.
        self._check_host_memory()
        if self.request.guaranteed:
            nodes = self._guaranteed_nodes()
            cpus_by_node = self._take_cpus(nodes)
            cpus = frozenset(itertools.chain.from_iterable(cpus_by_node.values()))
            self._check_pool_after(cpus)
            cpu_nodes = [n for n in nodes if cpus_by_node.get(n)]
            order = sorted(nodes, key=lambda n: -len(cpus_by_node.get(n, ())))
            spill = self._others_by_distance(order) if self.res.numa == "prefer" else []
            memory = self._take_memory(order + spill) if self.res.numa != "none" else {}
            quota = len(cpus) * MILLI
        else:
            nodes = self._shared_nodes()
            cpus = self._shared_cpus(nodes)
            cpu_nodes = sorted(nodes) if self.res.numa == "single" else []
            order = list(nodes)
            memory = self._take_memory(order) if self.demand.memory else {}
            quota = self.res.cpu_millis
        gpus, mig, shares, fpgas = self._take_devices(order)
        devices = self._named_devices()
        node_set = set(cpu_nodes) | set(memory)
        node_set |= {g for g in (self.index.gpu_by_index[i].numa for i in gpus) if g is not None}
        node_set |= {n for n in (self.index.gpu_by_index[m.gpu_index].numa for m in mig) if n is not None}
        node_set |= {n for n in (self.index.gpu_by_index[s.gpu_index].numa for s in shares) if n is not None}
        node_set |= {n for n in (self.index.fpga_numa[f] for f in fpgas) if n is not None}
        return Assignment(
            name=self.request.name,
            qos=self.request.qos,
            cpus=tuple(sorted(cpus)),
            exclusive=self.request.guaranteed,
            cpu_quota_millis=quota,
            numa_nodes=tuple(sorted(node_set)),
            memory_bytes=self.res.memory_bytes,
            memory_by_node=memory,
            gpus=gpus,
            gpu_uuids=tuple(self.index.gpu_by_index[i].uuid for i in gpus),
            mig=mig,
            gpu_shares=shares,
            fpgas=fpgas,
            devices=devices,
            reasons=tuple(self.reasons),
        )

    # ------------------------------------------------------------------ guaranteed CPUs

    def _guaranteed_nodes(self) -> list[int]:
        self._check_whole_cores()
        policy = self.res.numa
        if policy == "none":
            single = self._best_single_node(with_devices=False)
            if single is not None:
                self.reasons.append(f"numa none: CPUs fit on node {single} (best fit)")
                return [single]
            nodes = self._best_node_set(with_devices=False)
            if nodes is None:
                raise self._host_shortfall()
            return nodes
        single = self._best_single_node()
        if single is not None:
            stranded = self.devices(single).stranded
            self.reasons.append(
                f"numa {policy}: everything fits on node {single}; best fit leaves "
                f"{self.cpus[single] - self.demand.cpus} free CPUs there"
                + (f" and strands {stranded} devices" if stranded else "")
            )
            return [single]
        if policy == "single":
            raise self._single_shortfall()
        nodes = self._best_node_set()
        if nodes is None:
            raise self._host_shortfall()
        self.reasons.append(
            f"numa prefer: no single node fits; spanning the {len(nodes)} nearest nodes {sorted(nodes)}"
        )
        return nodes

    def _check_whole_cores(self) -> None:
        n, tpc = self.demand.cpus, self.index.threads_per_core
        if not self.options.whole_cores or tpc == 1 or n % tpc == 0:
            return
        if not self.options.round_up_to_cores:
            lower = n - n % tpc
            raise PlacementError(
                f"slot {self.request.name!r}: {n} CPUs is not a whole number of cores "
                f"({tpc} threads per core); ask for {lower or tpc} or {lower + tpc}, "
                "or set round_up_to_cores=true or whole_cores=false"
            )
        self.reasons.append(f"rounded {n} CPUs up to whole cores ({tpc} threads per core)")

    def _take_cpus(self, nodes: list[int]) -> dict[int, tuple[int, ...]]:
        n = self.demand.cpus
        free = {node: self.cpus[node] for node in nodes}
        parts = (
            self._distributed_parts(nodes) if self.options.distribute_across_numa and len(nodes) > 1 else None
        )
        if parts is None:
            parts = _pack_parts(nodes, free, n)
        return {node: self._take_on_node(node, want) for node, want in parts.items() if want}

    def _distributed_parts(self, nodes: list[int]) -> dict[int, int] | None:
        """Even split over as few nodes as can take it (kubelet's distribute-cpus-across-numa)."""
        tpc = self.index.threads_per_core if self.options.whole_cores else 1
        units = math.ceil(self.demand.cpus / tpc)
        ranked = sorted(self.index.node_ids, key=lambda n: (n not in nodes, -self.cpus[n], n))
        for k in range(2, len(ranked) + 1):
            base, extra = divmod(units, k)
            eligible = [n for n in ranked if self.cpus[n] >= (base + (extra > 0)) * tpc]
            if len(eligible) < k:
                continue
            chosen = self._nearest_subset(eligible, k)
            parts = {n: (base + (i < extra)) * tpc for i, n in enumerate(chosen)}
            overshoot = sum(parts.values()) - self.demand.cpus
            last = chosen[-1] if extra == 0 else chosen[extra - 1]
            parts[last] -= overshoot  # the remainder of an odd request rounds up on one node only
            nodes[:] = chosen
            self.reasons.append(
                f"distribute_across_numa: {self.demand.cpus} CPUs split evenly over nodes {sorted(chosen)}"
            )
            return parts
        return None

    def _nearest_subset(self, eligible: list[int], k: int) -> list[int]:
        dist = self.index.distance
        best: list[int] = eligible[:k]
        best_cost = sum(dist[a][b] for a, b in itertools.combinations(best, 2))
        for start in eligible:
            chosen = [start]
            while len(chosen) < k:
                chosen.append(
                    min(
                        (n for n in eligible if n not in chosen),
                        key=lambda n: sum(dist[c][n] for c in chosen),
                    )
                )
            cost = sum(dist[a][b] for a, b in itertools.combinations(chosen, 2))
            if cost < best_cost:
                best, best_cost = chosen, cost
        return best

    def _take_on_node(self, node: int, want: int) -> tuple[int, ...]:
        cores = _order_by_l3(self.free.cores[node], want)
        if not self.options.whole_cores:
            # Fill half-used cores first so that whole cores stay whole for others.
            cores.sort(key=lambda c: c[1] == self.index.core_mask[c[0]])
            return _first_cpus(cores, want)
        picked = _pick_whole_cores(cores, want, self.index.threads_per_core, self.options.round_up_to_cores)
        if picked is None:
            raise PlacementError(
                f"slot {self.request.name!r}: {want} CPUs cannot be made of whole free cores on node {node}; "
                "ask for a multiple of the core size or set round_up_to_cores=true"
            )
        groups = sorted({c[2][1] for c in cores if c[1] & picked})
        self.reasons.append(
            f"node {node}: {picked.bit_count()} CPUs as whole cores from L3 "
            f"cache{'s' if len(groups) > 1 else ''} " + ",".join(map(str, groups))
        )
        return _ids(picked)

    def _check_pool_after(self, cpus: frozenset[int]) -> None:
        promised = self.alloc.quota_millis.get("burstable", 0)
        left = (self.pool & ~_mask(cpus)).bit_count()
        if left == 0 and self.alloc.shared_slots:
            raise PlacementError(
                f"slot {self.request.name!r}: taking {len(cpus)} exclusive CPUs would empty the shared pool, "
                f"where {_plural(self.alloc.shared_slots, 'burstable or best-effort slot')} run; "
                "ask for fewer CPUs or release those slots first"
            )
        if left * MILLI * self.options.burstable_overcommit < promised:
            raise PlacementError(
                f"slot {self.request.name!r}: taking {len(cpus)} exclusive CPUs would leave {left} CPUs "
                f"in the shared pool, below the {promised / MILLI:g} CPUs of quota burstable slots hold "
                f"(overcommit {self.options.burstable_overcommit:g}); "
                "release or shrink a burstable slot first"
            )

    # ------------------------------------------------------------------ shared pool

    def _shared_nodes(self) -> list[int]:
        ratio = (
            self.options.burstable_overcommit
            if self.request.qos == "burstable"
            else self.options.best_effort_overcommit
        )
        pool_cpus = self.pool.bit_count()
        held = self.alloc.quota_millis.get(self.request.qos, 0)
        capacity = int(pool_cpus * MILLI * ratio)
        if pool_cpus == 0 or held + self.res.cpu_millis > capacity or self.res.cpu_millis > pool_cpus * MILLI:
            raise PlacementError(
                f"slot {self.request.name!r}: need a {self.res.cpus:g} CPU quota on the shared pool; "
                f"the pool has {pool_cpus} CPUs (x{ratio:g} overcommit for {self.request.qos} = "
                f"{capacity / MILLI:g}) and {held / MILLI:g} are promised already; "
                "release a slot or raise the overcommit option"
            )
        policy = self.res.numa
        needs_node = any(
            (self.demand.memory, self.demand.gpus, self.demand.mig, self.demand.share, self.demand.fpgas)
        )
        if policy == "single":
            node = self._best_single_node()
            if node is None:
                raise self._single_shortfall()
            self.reasons.append(f"numa single: pool CPUs, memory and devices on node {node}")
            return [node]
        if not needs_node:
            return []
        if policy == "prefer":
            node = self._best_single_node(with_cpus=False)
            if node is not None:
                return [node]
            nodes = self._best_node_set(with_cpus=False)
            if nodes is not None:
                return nodes
        elif self._fits_host(with_cpus=False):
            return []
        raise self._host_shortfall()

    def _shared_cpus(self, nodes: list[int]) -> frozenset[int]:
        pool = self.pool
        if self.res.numa == "single":
            pool &= self.index.node_mask[nodes[0]]
        self.reasons.append(
            f"{self.request.qos}: a {self.res.cpus:g} CPU quota on shared-pool CPUs "
            f"{format_cpulist(_ids(pool))} (the pool changes as exclusive slots come and go)"
        )
        return frozenset(_ids(pool))

    # ------------------------------------------------------------------ memory and devices

    def _take_memory(self, order: list[int]) -> dict[int, int]:
        need = self.res.memory_bytes
        out: dict[int, int] = {}
        for node in order:
            if need <= 0:
                break
            take = min(need, self.memory(node))
            if take:
                out[node] = take
                need -= take
        if need > 0:
            raise PlacementError(
                f"slot {self.request.name!r}: need {format_quantity(self.res.memory_bytes)} memory on "
                f"NUMA nodes {sorted(order)}; they have {format_quantity(self.res.memory_bytes - need)} free"
            )
        return out

    def _check_host_memory(self) -> None:
        if self.res.memory_bytes > self.host_memory_free:
            raise PlacementError(
                f"slot {self.request.name!r}: need {format_quantity(self.res.memory_bytes)} memory; "
                f"the host has {format_quantity(max(0, self.host_memory_free))} free"
            )

    def _others_by_distance(self, order: list[int]) -> list[int]:
        if len(order) == 1:
            return list(self.index.others_nearest_first(order[0]))
        dist = self.index.distance
        rest = [n for n in self.index.node_ids if n not in order]
        return sorted(rest, key=lambda n: (min((dist[o][n] for o in order), default=0), n))

    def _take_devices(
        self, order: list[int]
    ) -> tuple[tuple[int, ...], tuple[MigAssignment, ...], tuple[GpuShare, ...], tuple[str, ...]]:
        d = self.demand
        if not (d.gpus or d.mig or d.share or d.fpgas):
            return (), (), (), ()
        if self.res.numa != "single":
            order = order + self._others_by_distance(order)

        def sups() -> Iterator[_Devices]:
            yield from map(self.devices, order)  # lazily: most requests are served by the first node
            yield self.floating

        gpus = _take(sups(), lambda s: s.gpus, d.gpus)
        migs = _take(sups(), lambda s: s.mig, d.mig)
        shares = _take(sups(), lambda s: s.shares, d.share)
        fpgas = _take(sups(), lambda s: s.fpgas, d.fpgas)
        got = (len(gpus), len(migs), len(shares), len(fpgas))
        if got != (d.gpus, d.mig, d.share, d.fpgas):
            raise self._single_shortfall() if self.res.numa == "single" else self._host_shortfall()
        if not shares and self.res.gpu_share_millis:
            raise self._host_shortfall()
        return (
            tuple(gpus),
            tuple(
                MigAssignment(g.index, i.uuid, i.gpu_instance_id, i.compute_instance_id, i.profile)
                for g, i in migs
            ),
            tuple(GpuShare(i, self.res.gpu_share_millis) for i in shares),
            tuple(fpgas),
        )

    def _named_devices(self) -> tuple[DeviceAssignment, ...]:
        out = []
        for path in self.res.devices:
            if path not in self.options.allowed_devices:
                raise PlacementError(
                    f"slot {self.request.name!r}: device {path} is not in the allow-list "
                    f"({', '.join(sorted(self.options.allowed_devices)) or 'empty'}); "
                    "add it to the allowed_devices option"
                )
            exclusive = path not in self.options.shared_devices
            if exclusive and path in self.alloc.devices:
                raise PlacementError(
                    f"slot {self.request.name!r}: device {path} is held by another slot; "
                    "release it or list it in shared_devices"
                )
            out.append(DeviceAssignment(path, exclusive))
        return tuple(out)

    # ------------------------------------------------------------------ refusals

    def _free_by_node(self) -> str:
        d = self.demand
        parts: list[str] = []
        empty: list[int] = []
        for n in self.index.node_ids:
            s = self.devices(n)
            have = []
            if d.cpus:
                have.append(f"{self.cpus[n]} CPUs")
            if d.memory:
                have.append(f"{format_quantity(self.memory(n))} memory")
            if d.gpus:
                have.append(_plural(len(s.gpus), "GPU"))
            if d.mig:
                have.append(_plural(len(s.mig), "MIG instance"))
            if d.share:
                have.append(_plural(len(s.shares), "shareable GPU"))
            if d.fpgas:
                have.append(_plural(len(s.fpgas), "FPGA"))
            if any(not h.startswith("0 ") for h in have):
                parts.append(f"node {n}: " + ", ".join(have))
            else:
                empty.append(n)
        if empty:
            parts.append(f"node{'s' if len(empty) > 1 else ''} {format_cpulist(empty)}: nothing free")
        return "; ".join(parts)

    def _cpu_only(self) -> bool:
        d = self.demand
        return not any((d.memory, d.gpus, d.mig, d.share, d.fpgas))

    def _single_shortfall(self) -> PlacementError:
        name, d = self.request.name, self.demand
        if self._cpu_only() and self.request.guaranteed:
            best = max(self.index.node_ids, key=lambda n: (self.cpus[n], -n))
            return PlacementError(
                f"slot {name!r}: need {d.cpus} exclusive CPUs on one NUMA node; the largest free set is "
                f"{self.cpus[best]}, on node {best} ({self._free_by_node()}); "
                "ask for fewer CPUs, use numa prefer, or release a slot"
            )
        return PlacementError(
            f"slot {name!r}: need {d.describe(self.request)} on one NUMA node; no node has all of it "
            f"({self._free_by_node()}{self._floating_note()}); "
            "ask for less, use numa prefer, or release a slot"
        )

    def _host_shortfall(self) -> PlacementError:
        reserved = _ids(self.usable.reserved)
        note = (
            f"; CPUs {format_cpulist(reserved)} are reserved for the system"
            if reserved and self.demand.cpus
            else ""
        )
        return PlacementError(
            f"slot {self.request.name!r}: need {self.demand.describe(self.request)}; the host does not have "
            f"that much free ({self._free_by_node()}{self._floating_note()}){note}; "
            "ask for less or release a slot"
        )

    def _floating_note(self) -> str:
        fl, d = self.floating, self.demand
        count = (
            (len(fl.gpus) if d.gpus else 0)
            + (len(fl.mig) if d.mig else 0)
            + (len(fl.fpgas) if d.fpgas else 0)
        )
        return f"; {count} more on no known node" if count else ""


# =========================================================================== helpers


def _covers(total: Sequence[int], need: Sequence[int]) -> bool:
    return len(total) == len(need) and all(map(operator.ge, total, need))


def _accumulate(total: list[int], more: Sequence[int]) -> None:
    for i, v in enumerate(more):
        total[i] += v


def _pack_parts(nodes: list[int], free: Mapping[int, int], n: int) -> dict[int, int]:
    """Whole nodes first (largest first), then the remainder on the best-fitting node."""
    parts: dict[int, int] = {}
    remaining = n
    while remaining > 0:
        unused = [x for x in nodes if x not in parts and free[x] > 0]
        if not unused:
            break
        fitting = [x for x in unused if free[x] >= remaining]
        if fitting:
            parts[min(fitting, key=lambda x: (free[x], x))] = remaining
            break
        biggest = max(unused, key=lambda x: (free[x], -x))
        parts[biggest] = free[biggest]
        remaining -= free[biggest]
    return parts


def _order_by_l3(cores: Sequence[_Core], want: int) -> list[_Core]:
    """Cores from the fewest L3 caches: best fit if one cache holds ``want``, else largest first."""
    groups: dict[tuple[int, int], list[_Core]] = {}
    for c in cores:
        groups.setdefault(c[2], []).append(c)
    if len(groups) == 1:
        return list(cores)
    size = {g: sum(c[1].bit_count() for c in members) for g, members in groups.items()}
    order: list[tuple[int, int]] = []
    remaining = want
    while remaining > 0 and len(order) < len(groups):
        left = [g for g in groups if g not in order]
        fitting = [g for g in left if size[g] >= remaining]
        pick = min(fitting, key=lambda g: (size[g], g)) if fitting else max(left, key=lambda g: (size[g], g))
        order.append(pick)
        remaining -= size[pick]
    order += [g for g in groups if g not in order]
    return [c for g in order for c in groups[g]]


def _pick_whole_cores(cores: Sequence[_Core], want: int, tpc: int, round_up: bool) -> int | None:
    picked = 0
    remaining = want
    used: set[int] = set()
    # Full-size cores first, then smaller ones (siblings offline) to hit the count exactly.
    for full_only in (True, False):
        for core, cmask, _ in cores:
            size = cmask.bit_count()
            if remaining <= 0:
                break
            if core in used or size > remaining or (full_only and size != tpc):
                continue
            picked |= cmask
            used.add(core)
            remaining -= size
    if remaining > 0 and round_up:
        spare = [c for c in cores if c[0] not in used]
        spare.sort(key=lambda c: c[1].bit_count())
        for _, cmask, _ in spare:
            if remaining <= 0:
                break
            picked |= cmask
            remaining -= cmask.bit_count()
    return picked if remaining <= 0 else None


def _first_cpus(cores: Sequence[_Core], want: int) -> tuple[int, ...]:
    out: list[int] = []
    for _, free, _ in cores:
        for cpu in _ids(free):
            if len(out) == want:
                return tuple(out)
            out.append(cpu)
    return tuple(out)


def _take(sups: Iterable[_Devices], items: Callable[[_Devices], Sequence[Any]], count: int) -> list[Any]:
    out: list[Any] = []
    if count == 0:
        return out
    for s in sups:
        for item in items(s):
            if len(out) == count:
                return out
            out.append(item)
    return out


# =========================================================================== public API


def plan(
    topology: Topology,
    allocated: Allocated,
    request: SlotRequest,
    options: PlacementOptions | None = None,
) -> Assignment:
    """Decide what ``request`` gets on ``topology`` given what ``allocated`` holds already.

    Pure: the same inputs give the same Assignment. Raises PlacementError (does not fit),
    ConfigError (options that do not match the topology).
    """
    return _Planner(topology, allocated, request, options or PlacementOptions()).plan()


@dataclass(frozen=True, slots=True)
class ResourceCapacity:
    total: int | float
    reserved: int | float
    allocatable: int | float
    allocated: int | float
    free: int | float

    def to_dict(self) -> dict[str, int | float]:
        return {
            "total": self.total,
            "reserved": self.reserved,
            "allocatable": self.allocatable,
            "allocated": self.allocated,
            "free": self.free,
        }


@dataclass(frozen=True)
class Capacity:
    """Totals, reserved, allocatable, allocated and free per resource, host-wide and per NUMA node."""

    resources: Mapping[str, ResourceCapacity]
    by_numa: Mapping[int, Mapping[str, ResourceCapacity]]
    shared_pool: Mapping[str, int | float]

    def to_dict(self) -> dict[str, Any]:
        return {
            "resources": {k: v.to_dict() for k, v in self.resources.items()},
            "by_numa": {str(n): {k: v.to_dict() for k, v in r.items()} for n, r in self.by_numa.items()},
            "shared_pool": dict(self.shared_pool),
        }


def capacity(topology: Topology, allocated: Allocated, options: PlacementOptions | None = None) -> Capacity:
    """What the host has and what is left, as the controller wants it reported."""
    opts = options or PlacementOptions()
    index = placement_index(topology)
    usable = index.usable(opts)
    by_numa: dict[int, dict[str, ResourceCapacity]] = {}
    for node in index.node_ids:
        by_numa[node] = _node_capacity(topology, index, usable, allocated, node)
    resources = {
        kind: _sum_capacity([by_numa[n][kind] for n in index.node_ids])
        for kind in ("cpus", "memory_bytes", "gpus", "fpgas")
    }
    floating = _node_capacity(topology, index, usable, allocated, None)
    for kind in ("gpus", "fpgas"):
        resources[kind] = _sum_capacity([resources[kind], floating[kind]])
    pool = usable.pool_base & ~allocated.cpu_mask
    pool_cpus = pool.bit_count()
    shared_pool: dict[str, int | float] = {
        "cpus": pool_cpus,
        "burstable_quota": allocated.quota_millis.get("burstable", 0) / MILLI,
        "burstable_capacity": pool_cpus * opts.burstable_overcommit,
        "best_effort_quota": allocated.quota_millis.get("best-effort", 0) / MILLI,
        "best_effort_capacity": pool_cpus * opts.best_effort_overcommit,
    }
    mig_total: dict[str, int] = {}
    mig_free: dict[str, int] = {}
    for g in topology.gpus:
        if g.mig is None or not g.mig.enabled or g.healthy is False:
            continue
        for inst in g.mig.instances:
            mig_total[inst.profile] = mig_total.get(inst.profile, 0) + 1
            held = (
                mig_key(g.index, inst.uuid, inst.gpu_instance_id, inst.compute_instance_id) in allocated.mig
            )
            mig_free[inst.profile] = mig_free.get(inst.profile, 0) + (not held)
    for profile, total in sorted(mig_total.items()):
        resources[f"mig/{profile}"] = ResourceCapacity(
            total, 0, total, total - mig_free[profile], mig_free[profile]
        )
    return Capacity(resources=resources, by_numa=by_numa, shared_pool=shared_pool)


def _node_capacity(
    topo: Topology, index: PlacementIndex, usable: _Usable, alloc: Allocated, node: int | None
) -> dict[str, ResourceCapacity]:
    out: dict[str, ResourceCapacity] = {}
    if node is not None:
        node_mask = index.node_mask[node]
        total = node_mask.bit_count()
        reserved = (usable.reserved & node_mask).bit_count()
        allocatable = (usable.exclusive_cpus & node_mask).bit_count()
        held = (alloc.cpu_mask & node_mask).bit_count()
        out["cpus"] = ResourceCapacity(total, reserved, allocatable, held, allocatable - held)
        mem = index.node_memory[node]
        mem_held = alloc.memory_by_node.get(node, 0)
        out["memory_bytes"] = ResourceCapacity(mem, 0, mem, mem_held, max(0, mem - mem_held))
    gpus = [g for g in topo.gpus if g.numa == node]
    good = [g for g in gpus if g.healthy is not False and not (g.mig is not None and g.mig.enabled)]
    gpu_held = sum(g.index in alloc.gpus or g.index in alloc.gpu_shares for g in good)
    out["gpus"] = ResourceCapacity(
        len(gpus), len(gpus) - len(good), len(good), gpu_held, len(good) - gpu_held
    )
    fpgas = [f for f in topo.fpgas if f.numa == node]
    good_f = [f for f in fpgas if f.healthy is not False]
    f_held = sum(f.id in alloc.fpgas for f in good_f)
    out["fpgas"] = ResourceCapacity(
        len(fpgas), len(fpgas) - len(good_f), len(good_f), f_held, len(good_f) - f_held
    )
    return out


def _sum_capacity(items: Sequence[ResourceCapacity]) -> ResourceCapacity:
    return ResourceCapacity(
        total=sum(i.total for i in items),
        reserved=sum(i.reserved for i in items),
        allocatable=sum(i.allocatable for i in items),
        allocated=sum(i.allocated for i in items),
        free=sum(i.free for i in items),
    )


def count_fits(
    topology: Topology,
    allocated: Allocated,
    request_shape: SlotRequest | Mapping[str, Any],
    options: PlacementOptions | None = None,
    *,
    limit: int = 4096,
) -> int:
    """How many more slots of this shape fit, placing them one after another as ``plan`` would.

    Each placement costs about one decision: the ledgers it makes hand their per-node views on.
    """
    shape = (
        request_shape if isinstance(request_shape, SlotRequest) else parse_slot_request(dict(request_shape))
    )
    shape = shape.model_copy(update={"name": "fit"})  # the name only words reasons and refusals
    planner_options = options or PlacementOptions()
    ledger = allocated
    for count in range(limit):
        try:
            a = _Planner(topology, ledger, shape, planner_options).plan()
        except PlacementError:
            return count
        ledger = ledger.add(a)
    return limit


__all__ = [
    "Allocated",
    "Assignment",
    "Capacity",
    "DeviceAssignment",
    "GpuShare",
    "MigAssignment",
    "PlacementIndex",
    "PlacementOptions",
    "ResourceCapacity",
    "capacity",
    "count_fits",
    "mig_key",
    "placement_index",
    "plan",
]
