"""Exclusive CPUs and the shared pool that stays true to them.

Which CPU runs what, in the agent's cgroup tree::

    <parent>/                 online CPUs minus reserved ones ("allowed"): no slot ever runs on a
    │                         reserved CPU, whatever its class
    ├── <guaranteed slot>/    its own exclusive CPUs (a subset of allowed)
    ├── burstable/            the shared pool: allowed minus every exclusive slot's CPUs
    │   └── <slot>/           the pool, or the pool's CPUs on the slot's NUMA nodes when bound
    └── best-effort/          the same pool
        └── <slot>/

Exclusivity that other slots can still run on is not exclusivity, so the pool shrinks *before* an
exclusive slot gets its CPUs and grows only *after* the slot is gone. Cgroup v1 adds a rule of its
own: a cpuset must stay a subset of its parent's, so a shrink goes children first and a grow goes
parent first. :func:`plan_cpuset_writes` orders any change (even a mixed one, as after a crash)
that way: grow every group to ``current | target`` top-down, then cut to ``target`` bottom-up.
Cgroup v2 does not insist on the order (a parent's cpuset.cpus.effective bounds its children), and
the same plan is valid there.

The kernel is the record: exclusive CPUs are read back from the guaranteed slots' cpusets, and a
shared slot's NUMA binding from its cpuset.mems, so an agent that restarts needs nothing else.

The colocation loop may hold best-effort to part of the pool (:attr:`SharedPool.best_effort_limit`):
the best-effort class parent and its slots then get the pool's CPUs within the limit, and every
sync (an exclusive slot coming or going, a new best-effort slot) keeps to it, so the pool's own
updates never undo a suppression.

A cpuset that changes reaches the slot's tasks through :func:`follow_affinity`: the kernel (6.2 and
later) keeps each task's own ``sched_setaffinity`` mask and intersects every later cpuset with it,
so a worker launched on a one-CPU pool (the launch pins it to its cpuset) would never run on the
CPUs its slot gains. Every cpuset write therefore reads its tasks' CPUs first and, after the
write, widens each task that ran on all of the old cpuset to all of the new one; a task its
program narrowed keeps what is left of its choice.

An empty pool is allowed while no shared slot exists: v1 accepts an empty cpuset in a group without
tasks; in v2 an empty cpuset.cpus means "as the parent", which only matters once a task is there,
and a new shared slot is refused (Conflict) while the pool is empty.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from nodeagent.cgroups import CgroupHost, CgroupLimits, Hierarchy, open_manager
from nodeagent.cgroups import fs as cgroupfs
from nodeagent.cgroups.hierarchy import CLASS_DIRS
from nodeagent.cpulist import parse_cpulist
from nodeagent.devices.cpu import CpuTopology
from nodeagent.devices.topology import Topology
from nodeagent.errors import ConfigError, Conflict, Unsupported


@dataclass(frozen=True)
class CpuLayout:
    """The host's online CPUs and the online CPUs of each NUMA node."""

    online: frozenset[int]
    node_cpus: Mapping[int, frozenset[int]]

    @classmethod
    def of(cls, topology: Topology | CpuTopology) -> CpuLayout:
        """The layout in what devices' discovery found, so the host's sysfs is read once, there.
        A kernel without NUMA shows as one node 0 holding every CPU, which is what this needs."""
        online = frozenset(cpu.id for cpu in topology.cpus if cpu.online)
        return cls(online, {node.id: frozenset(node.cpus) & online for node in topology.numa_nodes})

    @property
    def nodes(self) -> frozenset[int]:
        return frozenset(self.node_cpus)

    def cpus_of(self, nodes: Iterable[int]) -> frozenset[int]:
        return frozenset().union(*(self.node_cpus.get(node, frozenset()) for node in nodes))


# --------------------------------------------------------------------------- pure decisions


def shared_pool(
    online: frozenset[int], reserved: frozenset[int], exclusive_by_slot: Mapping[str, frozenset[int]]
) -> frozenset[int]:
    """The CPUs burstable and best-effort slots share: online, not reserved, held by no exclusive slot."""
    return online - reserved - frozenset().union(*exclusive_by_slot.values())


def shared_slot_cpus(pool: frozenset[int], mems: frozenset[int] | None, layout: CpuLayout) -> frozenset[int]:
    """A shared slot's cpuset: the pool, narrowed to its NUMA nodes' CPUs when its memory is bound."""
    if mems is None or mems >= layout.nodes:
        return pool
    return pool & layout.cpus_of(mems)


def limit_cpus(cpus: frozenset[int], limit: frozenset[int] | None) -> frozenset[int]:
    """``cpus`` narrowed to ``limit`` (None: no limit). When none of them is in the limit, their
    highest CPU: a group with tasks must keep one, and the high end is where best-effort is held."""
    if limit is None or not cpus:
        return cpus
    return (cpus & limit) or frozenset({max(cpus)})


@dataclass(frozen=True)
class CpusetGroup:
    """One cgroup's cpuset as it is now and as it should be."""

    relpath: str
    current: frozenset[int]
    target: frozenset[int]

    @property
    def depth(self) -> int:
        return self.relpath.count("/")


def plan_cpuset_writes(groups: Iterable[CpusetGroup]) -> list[tuple[str, frozenset[int]]]:
    """Writes (relpath, cpus), in order, that take every group from current to target while each
    stays a subset of its parent: grow top-down to current | target, then cut bottom-up."""
    ordered = sorted(groups, key=lambda g: (g.depth, g.relpath))
    writes: list[tuple[str, frozenset[int]]] = []
    widened: dict[str, frozenset[int]] = {}
    for group in ordered:
        widened[group.relpath] = group.current | group.target
        if widened[group.relpath] != group.current:
            writes.append((group.relpath, widened[group.relpath]))
    for group in reversed(ordered):
        if group.target != widened[group.relpath]:
            writes.append((group.relpath, group.target))
    return writes


def follow_affinity(seen: frozenset[int], old: frozenset[int], new: frozenset[int]) -> frozenset[int]:
    """The CPUs a task runs on once its cgroup's cpuset went from ``old`` to ``new`` (both as the
    kernel applies them), given the CPUs ``seen`` it ran on before: a task that ran on all of the
    old cpuset follows the slot to all of the new one; a task its program narrowed keeps what is
    left of its choice, or all of the new cpuset when nothing is (as the kernel itself falls back)."""
    if seen >= old:
        return new
    return (seen & new) or new


# --------------------------------------------------------------------------- the kernel edge


class SharedPool:
    """Reads the agent's cpuset tree and rewrites it so the shared pool excludes exclusive CPUs."""

    def __init__(
        self, host: CgroupHost, hierarchy: Hierarchy, layout: CpuLayout, reserved: frozenset[int]
    ) -> None:
        self.host = host
        self.hierarchy = hierarchy
        self.layout = layout
        self.reserved = reserved
        self.allowed = layout.online - reserved
        if not self.allowed:
            raise ConfigError(
                f"reserved CPUs {sorted(reserved)} leave none of the online CPUs {sorted(layout.online)} "
                "for slots; reserve fewer"
            )
        self._mount = _cpuset_mount(host)
        #: Best-effort's share of the pool as the colocation loop holds it (None: the whole pool).
        self.best_effort_limit: frozenset[int] | None = None

    @property
    def best_effort_parent(self) -> str:
        return f"{self.hierarchy.parent}/{CLASS_DIRS['best-effort']}"

    def shared_slot_target(
        self, relpath: str, pool: frozenset[int], mems: frozenset[int] | None
    ) -> frozenset[int]:
        """A shared slot's cpuset: the pool (on its NUMA nodes), within the best-effort limit for a
        best-effort slot."""
        cpus = shared_slot_cpus(pool, mems, self.layout)
        if relpath.startswith(self.best_effort_parent + "/"):
            return limit_cpus(cpus, self.best_effort_limit)
        return cpus

    def class_parents(self) -> tuple[str, ...]:
        return tuple(f"{self.hierarchy.parent}/{d}" for d in CLASS_DIRS.values())

    def exclusive_by_slot(self) -> dict[str, frozenset[int]]:
        """Each guaranteed slot's CPUs, as its cpuset says."""
        parent = self.hierarchy.parent
        names = cgroupfs.child_dirs(self._mount, parent)
        return {name: self.read_cpus(f"{parent}/{name}") for name in names if name not in CLASS_DIRS.values()}

    def shared_slots(self) -> dict[str, frozenset[int] | None]:
        """relpath -> NUMA binding (None: unbound) of every burstable and best-effort slot."""
        found: dict[str, frozenset[int] | None] = {}
        for class_parent in self.class_parents():
            for name in cgroupfs.child_dirs(self._mount, class_parent):
                relpath = f"{class_parent}/{name}"
                mems = self.read_ids(relpath, "cpuset.mems")
                found[relpath] = None if not mems or mems >= self.layout.nodes else mems
        return found

    def pool(self, overrides: Mapping[str, frozenset[int]] | None = None) -> frozenset[int]:
        """The pool given the guaranteed slots in the kernel, with ``overrides`` (slot -> CPUs) on top."""
        return shared_pool(
            self.layout.online, self.reserved, {**self.exclusive_by_slot(), **(overrides or {})}
        )

    def sync(self, overrides: Mapping[str, frozenset[int]] | None = None) -> frozenset[int]:
        """Make the parent, the class parents and every shared slot hold what they should; return the pool.

        ``overrides`` names guaranteed slots whose CPUs differ from their cpusets for now: a slot about
        to be created or resized (give it old | new CPUs so the pool is cut before the slot widens).
        """
        pool = self.pool(overrides)
        groups = [CpusetGroup(self.hierarchy.parent, self.read_cpus(self.hierarchy.parent), self.allowed)]
        best_effort = self.best_effort_parent
        groups += [CpusetGroup(p, self.read_cpus(p), pool) for p in self.class_parents() if p != best_effort]
        # The best-effort parent holds its limit and whatever its slots need (v1's subset rule).
        best_effort_cpus = limit_cpus(pool, self.best_effort_limit)
        for relpath, mems in self.shared_slots().items():
            if not shared_slot_cpus(pool, mems, self.layout):
                binding = f"memory bound to NUMA nodes {sorted(mems)}" if mems else "memory unbound"
                raise Conflict(
                    f"shared slot cgroup {relpath} ({binding}) would be left with no CPU: the shared pool "
                    f"would be {sorted(pool)}; free a CPU for the pool first (release an exclusive slot) or "
                    "place the exclusive slot elsewhere"
                )
            target = self.shared_slot_target(relpath, pool, mems)
            if relpath.startswith(best_effort + "/"):
                best_effort_cpus |= target
            groups.append(CpusetGroup(relpath, self.read_cpus(relpath), target))
            groups += self._below(relpath, target)
        groups.append(CpusetGroup(best_effort, self.read_cpus(best_effort), best_effort_cpus))
        self._write_all(groups)
        return pool

    def follow(self, relpath: str, cpus: frozenset[int]) -> None:
        """Give the slot at ``relpath`` the CPUs ``cpus`` together with the cgroups a container
        runtime made below it, in an order v1 accepts."""
        self._write_all([CpusetGroup(relpath, self.read_cpus(relpath), cpus), *self._below(relpath, cpus)])

    def _write_all(self, groups: list[CpusetGroup]) -> None:
        for relpath, cpus in plan_cpuset_writes(groups):
            self._write(relpath, cpus)

    def _write(self, relpath: str, cpus: frozenset[int]) -> None:
        """Write one cpuset and take its tasks along (:func:`follow_affinity`). Threads are tasks:
        v1's ``tasks`` and v2's ``cgroup.threads`` list every thread id."""
        old = self._effective(relpath)
        seen = {tid: found for tid in self._tids(relpath) if (found := _affinity(tid)) is not None}
        open_manager(self.host, relpath).set(CgroupLimits(cpuset_cpus=cpus))
        if not seen:
            return
        new = self._effective(relpath)
        for tid, before in seen.items():
            wanted = follow_affinity(before, old, new)
            if wanted != _affinity(tid):
                _set_affinity(tid, wanted)

    def _effective(self, relpath: str) -> frozenset[int]:
        """The CPUs the kernel gives the cgroup's tasks (v2: within its parents' too)."""
        name = "cpuset.cpus.effective" if self.host.mode == "v2" else "cpuset.effective_cpus"
        text = cgroupfs.read_optional(self._mount, cgroupfs.join(relpath, name))
        return parse_cpulist(text) if text is not None else self.read_cpus(relpath)

    def _tids(self, relpath: str) -> list[int]:
        name = "cgroup.threads" if self.host.mode == "v2" else "tasks"
        text = cgroupfs.read_optional(self._mount, cgroupfs.join(relpath, name)) or ""
        return [int(line) for line in text.split()]

    def _below(self, relpath: str, target: frozenset[int]) -> list[CpusetGroup]:
        """The cgroups below a slot's (a container worker's: ``libpod-<id>``, ``conmon``), which
        follow the slot's CPUs. v1 refuses to cut a cpuset below what a child holds (EBUSY), and the
        runtime copied the slot's CPUs into its cgroups when it made them."""
        found = []
        pending = [relpath]
        while pending:
            parent = pending.pop()
            for name in cgroupfs.child_dirs(self._mount, parent):
                child = f"{parent}/{name}"
                if cgroupfs.exists(self._mount, cgroupfs.join(child, "cpuset.cpus")):  # v2: if enabled
                    found.append(CpusetGroup(child, self.read_cpus(child), target))
                    pending.append(child)
        return found

    def read_cpus(self, relpath: str) -> frozenset[int]:
        return self.read_ids(relpath, "cpuset.cpus")

    def read_ids(self, relpath: str, name: str) -> frozenset[int]:
        return parse_cpulist(cgroupfs.read_file(self._mount, cgroupfs.join(relpath, name)))


def _affinity(tid: int) -> frozenset[int] | None:
    """A thread's CPUs; None once it is gone."""
    try:
        return frozenset(os.sched_getaffinity(tid))
    except (ProcessLookupError, PermissionError):
        return None


def _set_affinity(tid: int, cpus: frozenset[int]) -> None:
    """Set a thread's CPUs; a thread that ended meanwhile, or a cpuset that moved again under the
    call (EINVAL: no CPU of ``cpus`` allowed any more), is left to the next write."""
    try:
        os.sched_setaffinity(tid, cpus)
    except ProcessLookupError:
        return
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise


def _cpuset_mount(host: CgroupHost) -> Path:
    if host.mode == "v2" and host.v2_mount is not None:
        return host.v2_mount
    if "cpuset" in host.v1_mounts:
        return host.v1_mounts["cpuset"]
    raise Unsupported(
        f"no cpuset controller on this host (cgroup mode {host.mode}); exclusive CPUs and the shared pool "
        "need it: mount the v1 cpuset hierarchy or enable cpuset in cgroup v2"
    )
