"""Per-topology tables every decision reads, built once per Topology object.

:class:`PlacementIndex` holds what does not change while the host does not: CPU masks per NUMA
node and per core, each core's L3 group, the SLIT distances and every node's others nearest first,
which nodes have GPUs or FPGAs, and how each GPU is handed out under a ``shareable_gpus`` setting.
:class:`UsableCpus` is what one set of options leaves to placement on it (reserved, isolated and
pool CPUs, and the cores a guaranteed slot may take), memoised per options.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from nodeagent.cpulist import format_cpulist
from nodeagent.devices.topology import Gpu, MigInstance, Topology
from nodeagent.errors import ConfigError
from nodeagent.placement.assignment import mig_key
from nodeagent.placement.bitset import mask_of
from nodeagent.placement.options import PlacementOptions

#: Stands for "unlimited" where the topology does not say how much memory a node has.
UNKNOWN_MEMORY = 1 << 62
_UNKNOWN_DISTANCE = 20


FreeCore = tuple[int, int, tuple[int, int]]
"""(core id, its free (or usable) CPUs as a mask, its L3 group (node, cache id))."""


@dataclass(frozen=True, slots=True)
class UsableCpus:
    """What the options leave to placement on one topology."""

    reserved: int  #: reserved CPUs (mask)
    exclusive_cpus: int  #: CPUs that may be given exclusively (mask)
    pool_base: int  #: CPUs of the shared pool before exclusive slots take theirs (mask)
    cores_by_node: Mapping[int, tuple[FreeCore, ...]]
    """node -> (core, its usable CPUs mask, L3 group), ordered by L3 group then core id."""
    whole_cores: bool


@dataclass(frozen=True, slots=True)
class GpuRoles:
    """How one node's healthy GPUs can be handed out under one ``shareable_gpus`` option."""

    whole: tuple[int, ...] = ()  #: GPU indexes given whole
    shareable: tuple[int, ...] = ()  #: GPU indexes that take gpu_share slots
    mig: tuple[tuple[str, Gpu, MigInstance], ...] = ()  #: (ledger key, GPU, instance) of MIG GPUs


class PlacementIndex:
    """Per-topology tables placement needs on every decision, computed once."""

    def __init__(self, topo: Topology) -> None:
        self.topology = topo
        self.node_ids = tuple(sorted(n.id for n in topo.numa_nodes) or sorted({c.numa for c in topo.cpus}))
        self.online_mask = mask_of(topo.online_cpus)
        self.isolated_mask = mask_of(topo.isolated_cpus) & self.online_mask
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
            core: mask_of(c for c in cpus if topo.cpu_by_id[c].online) for core, cpus in topo.cores.items()
        }
        self.core_l3 = {c.core: (c.numa, -1 if c.l3 is None else c.l3) for c in topo.cpus}
        self.core_node = {c.core: c.numa for c in topo.cpus}
        sizes = [m.bit_count() for m in self.core_mask.values() if m]
        self.threads_per_core = max(set(sizes), key=sizes.count) if sizes else 1
        #: Nodes with a core of fewer online threads than most (a sibling offline): there, which
        #: counts whole cores can make takes a search rather than a division.
        self.short_core_nodes = frozenset(
            self.core_node[core]
            for core, m in self.core_mask.items()
            if m and m.bit_count() != self.threads_per_core
        )
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
        # Nodes with no GPU or FPGA are told apart by free CPUs and memory alone (see LedgerView).
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
        self._usable: dict[tuple[frozenset[int] | None, bool, bool], UsableCpus] = {}
        self._gpu_roles: dict[frozenset[str], dict[int | None, GpuRoles]] = {}
        self._free_cores: dict[tuple[int, int, int, bool], tuple[tuple[FreeCore, ...], int, int]] = {}
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
        self, usable: UsableCpus, node: int, taken: int, whole_cores: bool
    ) -> tuple[tuple[FreeCore, ...], int, int]:
        """Free cores of ``node`` (core, free CPUs mask, L3 group), their CPU count, and how many of
        those CPUs are spare threads of partly used cores (always 0 with ``whole_cores``).

        Memoised on what is taken on that node: between two decisions most nodes do not change.
        """
        key = (id(usable), node, taken & self.node_mask[node], whole_cores)
        hit = self._free_cores.get(key)
        if hit is not None:
            return hit
        cores = []
        count = spare = 0
        for core, cmask, l3 in usable.cores_by_node[node]:
            free = cmask & ~taken
            if free and (free == cmask or not whole_cores):
                cores.append((core, free, l3))
                count += free.bit_count()
                if not whole_cores and free != self.core_mask[core]:
                    spare += free.bit_count()
        if len(self._free_cores) >= 8192:
            self._free_cores.clear()
        found = self._free_cores[key] = (tuple(cores), count, spare)
        return found

    def nearest_first(self, node: int) -> tuple[int, ...]:
        """All nodes, nearest to ``node`` first (SLIT distance, then id)."""
        return self._nearest[node]

    def others_nearest_first(self, node: int) -> tuple[int, ...]:
        """The other nodes, nearest to ``node`` first."""
        return self._others[node]

    def gpu_roles(self, shareable: frozenset[str]) -> Mapping[int | None, GpuRoles]:
        """Per node (None: unknown), the healthy GPUs given whole, shared, or as MIG instances."""
        found = self._gpu_roles.get(shareable)
        if found is None:
            found = self._gpu_roles[shareable] = {
                node: self._roles(gpus, shareable) for node, gpus in self.gpus_by_node.items()
            }
        return found

    def _roles(self, gpus: Iterable[Gpu], shareable: frozenset[str]) -> GpuRoles:
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
        return GpuRoles(tuple(whole), tuple(shared), tuple(mig))

    def default_reserved(self) -> frozenset[int]:
        """The first physical core, on hosts with 4 or more online CPUs (kubelet's usual choice)."""
        online = self.topology.online_cpus
        if len(online) < 4:
            return frozenset()
        first = self.topology.cpu_by_id[min(online)]
        return frozenset(self.topology.cores[first.core])

    def usable(self, options: PlacementOptions) -> UsableCpus:
        key = (options.reserved_cpus, options.use_isolated_cpus, options.whole_cores)
        found = self._usable.get(key)
        if found is None:
            found = self._usable[key] = self._compute_usable(options)
        return found

    def _compute_usable(self, options: PlacementOptions) -> UsableCpus:
        reserved_ids = options.reserved_cpus
        if reserved_ids is None:
            reserved_ids = self.default_reserved()
        stray = sorted(reserved_ids - set(self.topology.cpu_by_id))
        if stray:
            raise ConfigError(
                f"reserved_cpus lists CPUs {format_cpulist(stray)}, which this host does not have; "
                f"its CPUs are {format_cpulist(self.topology.cpu_by_id)}"
            )
        reserved = mask_of(reserved_ids) & self.online_mask
        pool_base = self.online_mask & ~reserved & ~self.isolated_mask
        exclusive = pool_base | (self.isolated_mask & ~reserved if options.use_isolated_cpus else 0)
        cores_by_node: dict[int, list[FreeCore]] = {n: [] for n in self.node_ids}
        for core, cmask in self.core_mask.items():
            usable = cmask & exclusive
            if not usable or (options.whole_cores and usable != cmask):
                continue  # a core with a reserved or isolated sibling is never split
            cores_by_node[self.core_node[core]].append((core, usable, self.core_l3[core]))
        return UsableCpus(
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
