"""One placement decision: ``plan(topology, allocated, request, options)`` -> :class:`Assignment`.

The planner chooses the NUMA node (or the fewest, nearest nodes) that holds everything the request
asks for, then the cores inside each node (:mod:`nodeagent.placement.cores`), memory and devices;
a refusal says what was asked, what is free and where. docs/placement.md explains the choices.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from nodeagent.cpulist import format_cpulist
from nodeagent.devices.topology import Gpu, Topology
from nodeagent.errors import PlacementError
from nodeagent.placement.assignment import Assignment, DeviceAssignment, GpuShare, MigAssignment
from nodeagent.placement.bitset import ids_of, mask_of
from nodeagent.placement.cores import (
    ThreadPick,
    needs_split,
    order_by_l3,
    pick_threads,
    pick_whole_cores,
    quietest_first,
)
from nodeagent.placement.index import GpuRoles, placement_index
from nodeagent.placement.ledger import NO_DEVICES, Allocated, FreeDevices
from nodeagent.placement.options import PlacementOptions
from nodeagent.placement.shortfall import Demand, host_shortfall, plural, single_node_shortfall
from nodeagent.schema.request import MILLI, Resources, SlotRequest, format_quantity

_SHARE_CAPACITY = MILLI  # one GPU, in thousandths


class _Planner:
    """One decision: the request against the free resources. Build, call :meth:`plan`, discard."""

    def __init__(
        self,
        topo: Topology,
        allocated: Allocated,
        request: SlotRequest,
        options: PlacementOptions,
        irq_load: Mapping[int, int] | None = None,
    ) -> None:
        self.index = placement_index(topo)
        self.irq_load = irq_load
        self.usable = self.index.usable(options)
        self.alloc = allocated
        self.request = request
        self.res: Resources = request.resources
        self.options = options
        self.reasons: list[str] = []
        self.pool = self.usable.pool_base & ~allocated.cpu_mask
        self.demand = self._demand()
        self.host_memory_free = self.index.host_memory - allocated.memory_total
        self.free = allocated.free_view(self.index, self.usable)
        #: Free CPUs per node for this request: whole free cores if guaranteed, else the pool's.
        self.cpus = self.free.cpus if request.guaranteed else self.free.pool
        #: Only exclusive CPUs with whole_cores off can split a core; otherwise :meth:`_splits` is 0.
        self.may_split = request.guaranteed and not options.whole_cores
        kinds = self.free.devices
        if len(kinds) >= 64:
            kinds.clear()
        self._free_devices_by_node = kinds.setdefault(self._request_device_kind(), {})
        self.floating = self.devices(None)

    # ------------------------------------------------------------------ demand and supply

    def _demand(self) -> Demand:
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
        return Demand(
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

    def devices(self, node: int | None) -> FreeDevices:
        """The free devices of ``node`` for this request, worked out once per ledger and kind."""
        if node is not None and node not in self.index.device_node_set:
            return NO_DEVICES
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

    def _free_devices(self, node: int | None) -> FreeDevices:
        d, alloc, opts = self.demand, self.alloc, self.options
        roles = self.index.gpu_roles(opts.shareable_gpus).get(node, GpuRoles())
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
        return FreeDevices(gpus, tuple(mig), tuple(shares), fpgas, stranded, counts)

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
            self._splits(node, d.cpus),
            self._halves(node, d.cpus),
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
        """The best fit among nodes without devices: there the score comes down to (splits, free
        CPUs, id), and splits are 0 everywhere unless whole_cores is off."""
        if any(n > 0 for n in need[2:]):
            return None
        need_cpus, need_memory = need[0], need[1]
        ranked = self.free.plain_by_cpus if self.request.guaranteed else self.free.plain_by_pool
        # The tightest node that takes the request as whole free cores; failing that, the tightest
        # with the fewest splits, then the fewest threads beside another slot.
        fallback: tuple[tuple[int, int], int] | None = None
        for _, node in itertools.islice(ranked, bisect.bisect_left(ranked, (need_cpus,)), None):
            if need_memory > 0 and self.memory(node) < need_memory:
                continue
            if not self.may_split:
                return node
            cost = (self._splits(node, need_cpus), self._halves(node, need_cpus))
            if cost == (0, 0):
                return node
            if fallback is None or cost < fallback[0]:
                fallback = (cost, node)
        return None if fallback is None else fallback[1]

    def _splits(self, node: int, want: int) -> int:
        """1 if taking ``want`` exclusive CPUs on ``node`` must split a free core, else 0.

        Only with whole_cores off (with it on, cores are never split) and for guaranteed slots.
        """
        if not self.may_split or want <= 0:
            return 0
        spare = self.free.spare[node]
        if node not in self.index.short_core_nodes:
            # Every whole core has the same size: take as many as fit, the rest must be spare.
            tpc = self.index.threads_per_core
            whole = (self.cpus[node] - spare) // tpc
            return int(want - min(whole, want // tpc) * tpc > spare)
        return int(needs_split(self.free.cores[node], want, self.index.core_mask))

    def _halves(self, node: int, want: int) -> int:
        """Threads of partly used cores that ``want`` exclusive CPUs on ``node`` must take although
        they are a whole number of cores: 0 where the node's whole free cores hold them.

        With whole_cores off, a request of whole cores still takes whole free cores before the
        spare threads beside another slot (a shared core is a noisy one); only the remainder of an
        odd request is meant for a spare thread. Nodes whose cores differ in size count 0 here
        (their pick already prefers whole cores within the node).
        """
        if not self.may_split or want <= 0 or node in self.index.short_core_nodes:
            return 0
        tpc = self.index.threads_per_core
        whole_cpus = (self.cpus[node] - self.free.spare[node]) // tpc * tpc
        return max(0, want - want % tpc - whole_cpus)

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
            cpus=_sorted_ids(cpus),
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
                raise host_shortfall(self)
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
            raise single_node_shortfall(self)
        nodes = self._best_node_set()
        if nodes is None:
            raise host_shortfall(self)
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
        if parts is None and self.may_split and not set(nodes) & self.index.short_core_nodes:
            parts = self._whole_cores_parts(nodes)
        if parts is None:
            parts = _pack_parts(nodes, free, n, self._splits)
        return {node: self._take_on_node(node, want) for node, want in parts.items() if want}

    def _whole_cores_parts(self, nodes: list[int]) -> dict[int, int]:
        """whole_cores off, several nodes of equal-sized cores: the parts that take whole free cores
        first (packed as :func:`_pack_parts` packs: whole nodes first, then the best fit), then the
        spare threads of partly used cores, and split a free core only for what is left.

        Packing the free CPUs alone would fill the first node with its spare threads and split a
        core on the next for the remainder, where the same count was whole cores on both.
        """
        tpc = self.index.threads_per_core
        spare = {x: self.free.spare[x] for x in nodes}
        whole = {x: self.cpus[x] - spare[x] for x in nodes}
        n = self.demand.cpus
        parts: dict[int, int] = {}
        remaining = min(n - n % tpc, sum(whole.values()) // tpc * tpc)
        while remaining > 0:
            unused = [x for x in nodes if x not in parts and whole[x] > 0]
            fitting = [x for x in unused if whole[x] >= remaining]
            if fitting:
                parts[min(fitting, key=lambda x: (whole[x], -spare[x], x))] = remaining
                break
            # The node with the most whole cores whole (of equals, the one whose spare threads can
            # then take an odd remainder), as _pack_parts does with free CPUs.
            biggest = max(unused, key=lambda x: (whole[x], spare[x], -x))
            parts[biggest] = whole[biggest]
            remaining -= whole[biggest]
        remaining = n - sum(parts.values())
        # The rest on spare threads, the nodes already holding a part first.
        for x in sorted(nodes, key=lambda x: (x not in parts, -spare[x], x)):
            take = min(remaining, spare[x])
            if take:
                parts[x] = parts.get(x, 0) + take
                remaining -= take
        # What is still missing splits one free core (an odd count, or no spare thread left).
        for x in sorted(nodes, key=lambda x: (x not in parts, x)):
            take = min(remaining, whole[x] + spare[x] - parts.get(x, 0))
            if take > 0:
                parts[x] = parts.get(x, 0) + take
                remaining -= take
        return parts

    def _distributed_parts(self, nodes: list[int]) -> dict[int, int] | None:
        """Even split over as few nodes as can take it (kubelet's distribute-cpus-across-numa).

        The parts are whole cores even with whole_cores off: splitting 6 CPUs 3+3 would split a
        core on each node where 4+2 splits none. Only the remainder of an odd request is a part
        that is not a whole number of cores.
        """
        tpc = self.index.threads_per_core
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
            # The remainder of an odd request rounds up on one node only (or is the one partial
            # core): one of the nodes with the larger part, preferably where it splits no core.
            larger = chosen if extra == 0 else chosen[:extra]
            last = larger[-1]
            if overshoot:
                last = min(reversed(larger), key=lambda n: self._splits(n, parts[n] - overshoot))
            parts[last] -= overshoot
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
        if not self.options.whole_cores:
            return self._take_threads_on_node(node, want)
        cores = quietest_first(order_by_l3(self.free.cores[node], want), self.irq_load)
        picked = pick_whole_cores(cores, want, self.index.threads_per_core, self.options.round_up_to_cores)
        if picked is None:
            raise PlacementError(
                f"slot {self.request.name!r}: {want} CPUs cannot be made of whole free cores on node {node}; "
                "ask for a multiple of the core size or set round_up_to_cores=true"
            )
        groups = sorted({c[2][1] for c in cores if c[1] & picked})
        self.reasons.append(
            f"node {node}: {picked.bit_count()} CPUs as whole cores from L3 "
            f"cache{'s' if len(groups) > 1 else ''} "
            + ",".join(map(str, groups))
            + ("; the cores serving the fewest interrupts first" if self.irq_load else "")
        )
        return ids_of(picked)

    def _take_threads_on_node(self, node: int, want: int) -> tuple[int, ...]:
        """whole_cores off: whole cores first, then spare threads of partly used cores, then a split."""
        uniform = node not in self.index.short_core_nodes
        cores = quietest_first(self.free.cores[node], self.irq_load)
        pick = pick_threads(cores, want, self.index.core_mask, uniform=uniform)
        if pick is None:  # the node's free count was checked when the nodes were chosen
            raise PlacementError(
                f"slot {self.request.name!r}: {want} CPUs are not free on node {node} "
                f"({self.cpus[node]} are); re-plan against the current ledger"
            )
        self.reasons.append(f"node {node}: {plural(want, 'CPU')} as {_describe_pick(pick)}")
        return ids_of(pick.cpus)

    def _check_pool_after(self, cpus: frozenset[int]) -> None:
        promised = self.alloc.quota_millis.get("burstable", 0)
        left = (self.pool & ~mask_of(cpus)).bit_count()
        if left == 0 and self.alloc.shared_slots:
            raise PlacementError(
                f"slot {self.request.name!r}: taking {len(cpus)} exclusive CPUs would empty the shared pool, "
                f"where {plural(self.alloc.shared_slots, 'burstable or best-effort slot')} run; "
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
                raise single_node_shortfall(self)
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
        raise host_shortfall(self)

    def _shared_cpus(self, nodes: list[int]) -> frozenset[int]:
        pool = self.pool
        if self.res.numa == "single":
            pool &= self.index.node_mask[nodes[0]]
        self.reasons.append(
            f"{self.request.qos}: a {self.res.cpus:g} CPU quota on shared-pool CPUs "
            f"{format_cpulist(ids_of(pool))} (the pool changes as exclusive slots come and go)"
        )
        return frozenset(ids_of(pool))

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

        def sups() -> Iterator[FreeDevices]:
            yield from map(self.devices, order)  # lazily: most requests are served by the first node
            yield self.floating

        gpus = _take(sups(), lambda s: s.gpus, d.gpus)
        migs = _take(sups(), lambda s: s.mig, d.mig)
        shares = _take(sups(), lambda s: s.shares, d.share)
        fpgas = _take(sups(), lambda s: s.fpgas, d.fpgas)
        got = (len(gpus), len(migs), len(shares), len(fpgas))
        if got != (d.gpus, d.mig, d.share, d.fpgas):
            raise single_node_shortfall(self) if self.res.numa == "single" else host_shortfall(self)
        if not shares and self.res.gpu_share_millis:
            raise host_shortfall(self)
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


# =========================================================================== helpers


@functools.lru_cache(maxsize=256)
def _sorted_ids(cpus: frozenset[int]) -> tuple[int, ...]:
    """One tuple per distinct CPU set: the slots on the shared pool (all of them, on a host of
    best-effort workers) share it instead of each holding a copy of the pool's list."""
    return tuple(sorted(cpus))


def _covers(total: Sequence[int], need: Sequence[int]) -> bool:
    return len(total) == len(need) and all(map(operator.ge, total, need))


def _accumulate(total: list[int], more: Sequence[int]) -> None:
    for i, v in enumerate(more):
        total[i] += v


def _pack_parts(
    nodes: list[int], free: Mapping[int, int], n: int, splits: Callable[[int, int], int]
) -> dict[int, int]:
    """Whole nodes first (largest first), then the remainder on the best-fitting node, among those
    that can take it without splitting a core (``splits(node, count)``) if there are any."""
    parts: dict[int, int] = {}
    remaining = n
    while remaining > 0:
        unused = [x for x in nodes if x not in parts and free[x] > 0]
        if not unused:
            break
        fitting = [x for x in unused if free[x] >= remaining]
        if fitting:
            parts[min(fitting, key=lambda x: (splits(x, remaining), free[x], x))] = remaining
            break
        biggest = max(unused, key=lambda x: (free[x], -x))
        parts[biggest] = free[biggest]
        remaining -= free[biggest]
    return parts


def _describe_pick(pick: ThreadPick) -> str:
    made_of = []
    if pick.whole_cores:
        made_of.append(plural(pick.whole_cores, "whole core"))
    if pick.spare_threads:
        made_of.append(plural(pick.spare_threads, "thread") + " of partly used cores")
    if pick.split_core is not None:
        made_of.append(
            plural(pick.split_threads, "thread")
            + f" of core {pick.split_core}, split because nothing else made up the count"
        )
    caches = sorted({cache for _, cache in pick.l3_groups})
    listed = ", ".join(made_of[:-1]) + (" and " if len(made_of) > 1 else "") + made_of[-1]
    return f"{listed}; from L3 cache{'s' if len(caches) > 1 else ''} " + ",".join(map(str, caches))


def _take(
    sups: Iterable[FreeDevices], items: Callable[[FreeDevices], Sequence[Any]], count: int
) -> list[Any]:
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
    *,
    irq_load: Mapping[int, int] | None = None,
) -> Assignment:
    """Decide what ``request`` gets on ``topology`` given what ``allocated`` holds already.

    ``irq_load``: device interrupts per CPU (as counted in /proc/interrupts); among cores the rules
    rank equal, an exclusive slot gets the ones that serve the fewest. Pure: the same inputs give the
    same Assignment. Raises PlacementError (does not fit), ConfigError (options that do not match the
    topology).
    """
    return _Planner(topology, allocated, request, options or PlacementOptions(), irq_load).plan()
