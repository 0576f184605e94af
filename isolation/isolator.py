"""Turning a slot's isolation spec into kernel state, and taking it down again.

:class:`SlotIsolator` is the one place that sequences the mechanisms of this package for a slot:

1. everything that can be refused without touching the kernel is checked first: the spec, the
   device paths (resolved to numbers), resctrl support, exclusive CPUs already held by another
   slot, the QoS parameters;
2. for an exclusive slot the shared pool is cut *before* the slot gets its CPUs (see
   :mod:`nodeagent.isolation.cpus`);
3. the slot's cgroup is created and configured (cpuset, memory, pids, CPU weight/quota/idle),
   then its device allow-list, then its network namespace and resctrl group if asked;
4. on any failure, whatever this call created is removed again and the pool restored before the
   error propagates.

Release kills the slot's processes, removes its cgroup, netns and resctrl group (whatever of them
exists), then grows the pool. The kernel is the record: the isolator keeps no state of its own,
so an agent that restarts can list what it owns and remove orphans.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import ipaddress
import socket
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from nodeagent.cgroups import (
    UNLIMITED,
    CgroupHost,
    CgroupLimits,
    CgroupManager,
    Hierarchy,
    QosClass,
    apply_device_rules,
    ensure_parents,
    open_manager,
    remove_subtree,
)
from nodeagent.cgroups.hierarchy import CLASS_DIRS
from nodeagent.cgroups.resources import CPU_SHARES_MIN, CPU_WEIGHT_MIN
from nodeagent.cpulist import shared_ids
from nodeagent.devices.cpu import discover_cpu_topology
from nodeagent.errors import (
    CgroupError,
    Conflict,
    DiscoveryError,
    InvalidRequest,
    NetworkError,
    NotFound,
    Unsupported,
)
from nodeagent.isolation.cpus import CpuLayout, SharedPool
from nodeagent.isolation.devices import slot_device_rules
from nodeagent.isolation.firewall import NftFirewall
from nodeagent.isolation.network import (
    NET_CLASS,
    NetworkBackend,
    OwnedNetwork,
    SlotNetwork,
    SlotNetworkConfig,
    allocate_subnet,
    default_backend,
    host_veth_name,
    netns_name,
    netns_path,
    plan_slot_network,
    validate_slot_id,
)
from nodeagent.isolation.qos import (
    QOS_CLASSES,
    QosClassName,
    QosParameters,
    cpu_idle_supported,
    qos_parameters,
    quota_us,
)
from nodeagent.isolation.resctrl import Resctrl
from nodeagent.isolation.slot_spec import IsolatorConfig, SlotIsolationSpec
from nodeagent.kernelfs import Sysfs

Undo = Callable[[], object]


#: A standby's cgroup as :meth:`SlotIsolator.frozen` finds it.
Frozen = Literal["gone", "empty", "thawed", "frozen"]


# Slotted: each slot's record holds one for the slot's life.
@dataclass(frozen=True, slots=True)
class AppliedSlot:
    """What the isolator built for a slot: what the launcher needs, and what the agent stores.

    ``cpus`` of a shared slot is the pool at the time of the call; its cpuset follows the pool.
    ``sched_idle``: put the slot's processes under SCHED_IDLE (best-effort where cpu.idle is missing).
    ``resctrl_tasks``: the file a launcher writes each worker pid to, when the slot has a resctrl group.
    """

    slot_id: str
    qos: str
    cgroup: str
    cgroup_version: str
    procs_files: tuple[str, ...]
    oom_events: str | None
    cpus: frozenset[int]
    mems: frozenset[int] | None
    memory_max: int | None
    sched_idle: bool
    oom_score_adj: int
    device_rules: tuple[str, ...]
    network: SlotNetwork | None = None
    resctrl_group: str | None = None
    resctrl_tasks: str | None = None

    @property
    def netns_path(self) -> str | None:
        return None if self.network is None else str(self.network.netns_path)

    def to_json(self) -> dict[str, Any]:
        return {
            "slot_id": self.slot_id,
            "qos": self.qos,
            "cgroup": self.cgroup,
            "cgroup_version": self.cgroup_version,
            "procs_files": list(self.procs_files),
            "oom_events": self.oom_events,
            "cpus": sorted(self.cpus),
            "mems": None if self.mems is None else sorted(self.mems),
            "memory_max": self.memory_max,
            "sched_idle": self.sched_idle,
            "oom_score_adj": self.oom_score_adj,
            "device_rules": list(self.device_rules),
            "network": None if self.network is None else self.network.to_json(),
            "resctrl_group": self.resctrl_group,
            "resctrl_tasks": self.resctrl_tasks,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AppliedSlot:
        try:
            mems = data["mems"]
            network = data.get("network")
            return cls(
                slot_id=data["slot_id"],
                qos=data["qos"],
                cgroup=data["cgroup"],
                cgroup_version=data["cgroup_version"],
                procs_files=tuple(data["procs_files"]),
                oom_events=data.get("oom_events"),
                cpus=frozenset(data["cpus"]),
                mems=None if mems is None else frozenset(mems),
                memory_max=data.get("memory_max"),
                sched_idle=bool(data["sched_idle"]),
                oom_score_adj=int(data["oom_score_adj"]),
                device_rules=tuple(data["device_rules"]),
                network=None if network is None else SlotNetwork.from_json(network),
                resctrl_group=data.get("resctrl_group"),
                resctrl_tasks=data.get("resctrl_tasks"),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise InvalidRequest(f"malformed applied-slot record {data!r}: {err}") from None


@dataclass(frozen=True)
class OwnedSlot:
    """A slot cgroup under the agent's parent, as the kernel shows it (start-up's evidence)."""

    slot_id: str
    qos: str
    #: what is known of its kernel objects: the cgroup and what it confines (no limits, rules or netns)
    applied: AppliedSlot
    #: processes running in it now
    pids: tuple[int, ...]


@dataclass(frozen=True)
class OwnedIsolation:
    """Kernel objects carrying the isolator's marks: cgroups under its parent, netns and veths with
    the network prefixes, resctrl groups with the resctrl prefix."""

    cgroups: Mapping[str, str]  # slot id -> cgroup relpath
    network: OwnedNetwork
    resctrl_groups: tuple[str, ...]

    @property
    def empty(self) -> bool:
        return not self.cgroups and self.network.empty and not self.resctrl_groups


def slot_resources(
    spec: SlotIsolationSpec, params: QosParameters, cpus: frozenset[int], *, swap_limit: bool
) -> CgroupLimits:
    """The cgroup settings for ``spec`` (pure): QoS parameters onto the managers' CgroupLimits."""
    return CgroupLimits(
        cpuset_cpus=cpus,
        cpuset_mems=spec.mems,
        # The kernel refuses a weight on an idle group (EINVAL): idle already means "least".
        cpu_weight=None if params.cpu_idle else params.cpu_weight,
        cpu_quota_us=UNLIMITED if params.cpu_quota_us is None else params.cpu_quota_us,
        cpu_period_us=params.cpu_period_us,
        cpu_idle=True if params.cpu_idle else None,
        memory_max=UNLIMITED if params.memory_max is None else params.memory_max,
        memory_high=params.memory_high,
        memory_swap_max=params.memory_swap_max if swap_limit else None,
        pids_max=spec.pids_max or params.pids_max,
    )


class _Keep:
    """Leave this limit as it is (:meth:`SlotIsolator.hold_best_effort_slot`)."""


KEEP = _Keep()


def _with_held(resources: CgroupLimits, held: CgroupLimits | None) -> CgroupLimits:
    """The slot's own limits with what the colocation loop holds it to in their place."""
    if held is None:
        return resources
    if held.memory_high is not None:
        own = resources.memory_high
        resources = dataclasses.replace(
            resources, memory_high=held.memory_high if own is None else min(own, held.memory_high)
        )
    if held.cpu_quota_us is not None:
        resources = dataclasses.replace(
            resources, cpu_quota_us=held.cpu_quota_us, cpu_period_us=held.cpu_period_us
        )
    return resources


def slot_cpu_request(spec: SlotIsolationSpec) -> float | None:
    """The CPU count the QoS class sizes weights and quotas from."""
    if spec.qos == "guaranteed":
        return float(len(spec.cpus))
    return spec.cpu_quota if spec.qos == "burstable" else None


class SlotIsolator:
    """Creates, resizes and releases slots' kernel state under ``config.cgroup_parent``.

    Thread-safe (one lock); one isolator per host and parent. ``network_backend`` defaults to
    :func:`~nodeagent.isolation.network.default_backend` and ``resctrl`` to the host's resctrl
    filesystem, both created on first use; ``layout`` (online CPUs per NUMA node) is best
    ``CpuLayout.of(topology)`` of the topology the caller discovered already; without it, devices'
    discovery reads ``config.sys_root`` on first use.
    """

    def __init__(
        self,
        host: CgroupHost,
        config: IsolatorConfig | None = None,
        network_backend: NetworkBackend | None = None,
        resctrl: Resctrl | None = None,
        layout: CpuLayout | None = None,
    ) -> None:
        self.host = host
        self.config = config or IsolatorConfig()
        self.hierarchy = self.config.hierarchy
        self._network = network_backend
        self._firewall_problem: str | None = None
        self._resctrl = resctrl
        self._layout = layout
        self._pool: SharedPool | None = None
        self._ready = False
        self._lock = threading.RLock()
        #: What the colocation loop holds a best-effort slot to (memory.high, CPU quota), by slot id:
        #: the isolator is the one writer of a slot's cgroup, so a resize or a re-apply keeps the
        #: loop's limit instead of writing the slot's own over it (:meth:`hold_best_effort_slot`).
        self._held_by_qos: dict[str, CgroupLimits] = {}
        #: Whether this process has synced the pool with the best-effort limit it holds now (the
        #: kernel may keep another from an earlier run until the first sync).
        self._best_effort_limit_synced = False

    # -- collaborators, created on first use ----------------------------------------------------

    @property
    def pool(self) -> SharedPool:
        if self._pool is None:
            layout = self._layout or CpuLayout.of(discover_cpu_topology(Sysfs(self.config.sys_root)))
            self._pool = SharedPool(self.host, self.hierarchy, layout, self.config.reserved_cpus)
        return self._pool

    @property
    def network(self) -> NetworkBackend:
        """The network backend; by default with the nftables firewall where this host can run it."""
        if self._network is None:
            firewall = NftFirewall(self.config.network)
            self._firewall_problem = firewall.problem()
            self._network = default_backend(self.config.network, None if self._firewall_problem else firewall)
        return self._network

    @property
    def firewall_problem(self) -> str | None:
        """Why slots' networks would go unfiltered here (None: they are filtered)."""
        if self.network.firewall is not None:
            return None
        return self._firewall_problem or "the network backend has no firewall"

    def degraded(self) -> tuple[str, ...]:
        """Isolation this host cannot give (slots are still isolated in every other way)."""
        problem = self.firewall_problem
        if problem is None:
            return ()
        if self.config.allow_unfiltered_network:
            return (
                f"network filtering: {problem}; slots with a network run unfiltered (they reach every "
                "service of the host) because allow_unfiltered_network is set",
            )
        return (
            f"network filtering: {problem}; slots that ask for a network are refused (install "
            "nftables, or set [isolation] allow_unfiltered_network = true to run them unfiltered)",
        )

    @property
    def resctrl(self) -> Resctrl:
        if self._resctrl is None:
            self._resctrl = Resctrl(self.config.resctrl_root)
        return self._resctrl

    # -- the hierarchy --------------------------------------------------------------------------

    def ensure_hierarchy(self) -> None:
        """Create the parent and class parents (idempotent), make the pool true, idle best-effort."""
        with self._lock:
            if not self.host.can_write:
                raise CgroupError(
                    f"cannot create cgroups here (mode {self.host.mode}): run the agent as root or on a "
                    "delegated cgroup v2 subtree"
                )
            ensure_parents(self.host, self.hierarchy)
            self.pool.sync()
            best_effort = open_manager(self.host, self.hierarchy.class_parent("best-effort"))
            # cpu.idle works between siblings, so it is the class parent that must be idle for
            # best-effort to yield to burstable and guaranteed slots; a weight is refused once idle.
            idle = _has_file(best_effort, "cpu", "cpu.idle")
            best_effort.set(CgroupLimits(cpu_idle=True) if idle else CgroupLimits(cpu_weight=1))
            self._ready = True

    def ensure_firewall(self) -> None:
        """At the agent's start: where slot veths exist, make sure the firewall's table does too
        (a ruleset flush while the agent was down would leave them unfiltered until the next
        slot's setup). A host without slot networks gets no table and loads no library."""
        with self._lock:
            prefix = self.config.network.veth_prefix
            if not any(name.startswith(prefix) for name in _interface_names()):
                return
            if self.network.firewall is not None:
                self.network.firewall.ensure()

    # -- slots ----------------------------------------------------------------------------------

    def apply(self, spec: SlotIsolationSpec) -> AppliedSlot:
        """Make the slot's kernel state match ``spec`` (idempotent); roll back this call's work on failure."""
        with self._lock:
            return self._apply(spec, must_exist=False)

    def resize(self, spec: SlotIsolationSpec) -> AppliedSlot:
        """Change an existing slot's CPUs and limits in place (same order of pool updates as apply)."""
        with self._lock:
            return self._apply(spec, must_exist=True)

    def freeze(self, slot_id: str, qos: QosClassName) -> None:
        """Freeze every process of the slot (a warm pool's standby: no CPU, memory kept)."""
        validate_slot_id(slot_id)
        open_manager(self.host, self.hierarchy.slot_path(slot_id, qos)).freeze(self.config.kill_timeout_s)

    def thaw(self, slot_id: str, qos: QosClassName) -> None:
        validate_slot_id(slot_id)
        open_manager(self.host, self.hierarchy.slot_path(slot_id, qos)).thaw()

    def frozen(self, slot_id: str, qos: QosClassName) -> Frozen:
        """How a warm pool's standby stands in the kernel: its cgroup gone, without a process
        (its worker died), thawed, or frozen."""
        validate_slot_id(slot_id)
        manager = open_manager(self.host, self.hierarchy.slot_path(slot_id, qos))
        if not manager.exists():
            return "gone"
        if not manager.subtree_pids():
            return "empty"
        return "frozen" if manager.is_frozen() else "thawed"

    def change_class(self, spec: SlotIsolationSpec, from_qos: QosClassName) -> AppliedSlot:
        """Give a slot that exists as ``from_qos`` the kernel state of ``spec`` in another QoS class
        (a warm pool's standby, burstable while it waits, taken as a guaranteed slot): the new
        cgroup is built as :meth:`apply` builds it, every process moves over (a frozen one thaws as
        it enters its new, thawed cgroup), and the old cgroup goes. The netns and resctrl group
        are the slot id's and stay. On failure the processes are moved back and the new cgroup
        removed, so the slot is as it was."""
        validate_slot_id(spec.slot_id)
        old = self.hierarchy.slot_path(spec.slot_id, from_qos)
        new = self.hierarchy.slot_path(spec.slot_id, spec.qos)
        if old == new:
            return self.apply(spec)
        with self._lock:
            source = open_manager(self.host, old)
            if not source.exists():
                # Moved already (an agent killed after the move, before it stored the result):
                # what is left is to make the new cgroup right.
                return self._apply(spec, must_exist=False)
            if source.children():
                raise Conflict(
                    f"slot {spec.slot_id} has cgroups below {old} (a container runtime's); cannot move it"
                )
            applied = self._apply(spec, must_exist=False, moving_from=old)
            target = open_manager(self.host, new)
            try:
                for _ in range(100):  # forks racing the move land in the old group: go again
                    pids = source.procs()
                    if not pids:
                        break
                    for pid in pids:
                        with contextlib.suppress(ProcessLookupError, CgroupError):
                            target.add_pid(pid)
                else:
                    raise Conflict(
                        f"slot {spec.slot_id}: processes kept appearing in {old} while moving them"
                    )
                target.thaw()
            except BaseException:
                for pid in target.procs():
                    with contextlib.suppress(ProcessLookupError, CgroupError):
                        source.add_pid(pid)
                remove_subtree(self.host, new, self.config.kill_timeout_s)
                self.pool.sync()
                raise
            # The pool does not change: the standby's cgroup was a shared slot, which never cuts it.
            source.delete(self.config.kill_timeout_s)
            return applied

    def release(self, slot_id: str) -> None:
        """Kill everything in the slot and remove its cgroup, netns and resctrl group; grow the pool.

        Idempotent: objects already gone are fine.
        """
        validate_slot_id(slot_id)
        with self._lock:
            for relpath in self._candidate_paths(slot_id):
                remove_subtree(self.host, relpath, self.config.kill_timeout_s)
            self._held_by_qos.pop(slot_id, None)
            if self._has_network(slot_id):
                self.network.teardown(slot_id)
            if self._resctrl_mounted():
                self.resctrl.delete_group(self.config.resctrl_group(slot_id))
            if self._ready or open_manager(self.host, self.hierarchy.parent).exists():
                self.pool.sync()

    def limit_best_effort(self, cpus: frozenset[int] | None, quota_cpus: float | None) -> frozenset[int]:
        """Hold the best-effort class to ``cpus`` of the shared pool (None: all of it) and
        ``quota_cpus`` CPUs of CFS quota (None: none), as the colocation loop decides; pool updates
        and new best-effort slots keep to the limit. Returns the class's cpuset now."""
        with self._lock:
            if not self._ready:
                self.ensure_hierarchy()
            if not self._best_effort_limit_synced or cpus != self.pool.best_effort_limit:
                # A change of quota alone writes the class parent only: syncing the pool reads
                # every shared slot's cpuset (~90 ms of CPU at 500 slots) to change none of them.
                # Every other change of the pool (allocate, release, resize) syncs with the
                # limit in force.
                self.pool.best_effort_limit = cpus
                self.pool.sync()
                self._best_effort_limit_synced = True
            relpath = self.hierarchy.class_parent("best-effort")
            period = self.config.qos.cfs_period_us
            quota = UNLIMITED if quota_cpus is None else quota_us(quota_cpus, period)
            open_manager(self.host, relpath).set(CgroupLimits(cpu_quota_us=quota, cpu_period_us=period))
            return self.pool.read_cpus(relpath)

    def list_owned(self) -> OwnedIsolation:
        """Every slot object the isolator's marks identify (to find orphans after a crash)."""
        with self._lock:
            cgroups = {slot_id: relpath for slot_id, (_, relpath) in self._owned_cgroups().items()}
            resctrl_groups: tuple[str, ...] = ()
            if self._resctrl_mounted():
                prefix = self.config.resctrl_prefix
                resctrl_groups = tuple(g for g in self.resctrl.groups() if g.startswith(prefix))
            return OwnedIsolation(cgroups, self.network.list_owned(), resctrl_groups)

    def owned_slots(self) -> list[OwnedSlot]:
        """Every slot cgroup under the parent, what it confines and the processes in it now."""
        with self._lock:
            found = []
            for slot_id, (qos, relpath) in self._owned_cgroups().items():
                manager = open_manager(self.host, relpath)
                try:
                    mems, cpus = self.pool.read_ids(relpath, "cpuset.mems"), self.pool.read_cpus(relpath)
                except CgroupError as err:
                    if err.errno != errno.ENOENT:
                        raise
                    # Made or removed only part of the way across the v1 hierarchies when the agent
                    # died (children() is their union): no cpuset here, but the slot is still ours to
                    # explain, rebuild or remove.
                    mems, cpus = frozenset(), frozenset()
                applied = AppliedSlot(
                    slot_id=slot_id,
                    qos=qos,
                    cgroup=relpath,
                    cgroup_version=manager.version,
                    procs_files=tuple(str(p) for p in manager.procs_files()),
                    oom_events=_oom_events_file(manager),
                    cpus=cpus,
                    mems=mems or None,
                    memory_max=None,
                    sched_idle=False,
                    oom_score_adj=0,
                    device_rules=(),
                )
                found.append(OwnedSlot(slot_id, qos, applied, tuple(manager.subtree_pids())))
            return found

    def _owned_cgroups(self) -> dict[str, tuple[QosClassName, str]]:
        """slot id -> (QoS class, cgroup relpath) of every slot cgroup under the parent."""
        cgroups: dict[str, tuple[QosClassName, str]] = {}
        if not open_manager(self.host, self.hierarchy.parent).exists():
            return cgroups
        for qos in QOS_CLASSES:
            class_path = self.hierarchy.class_parent(qos)
            for name in open_manager(self.host, class_path).children():
                if qos != "guaranteed" or name not in CLASS_DIRS.values():
                    cgroups[name] = (qos, f"{class_path}/{name}")
        return cgroups

    def remove_orphans(self, known_slot_ids: Iterable[str]) -> OwnedIsolation:
        """Remove every owned object that belongs to none of ``known_slot_ids``; return what went."""
        known = frozenset(known_slot_ids)
        with self._lock:
            owned = self.list_owned()
            cgroups = {slot: path for slot, path in owned.cgroups.items() if slot not in known}
            for relpath in cgroups.values():
                remove_subtree(self.host, relpath, self.config.kill_timeout_s)
            network = _orphan_network(owned.network, self.config.network, known)
            if not network.empty:
                self.network.remove_owned(network)
            prefix = self.config.resctrl_prefix
            resctrl = tuple(g for g in owned.resctrl_groups if g.removeprefix(prefix) not in known)
            for group in resctrl:
                self.resctrl.delete_group(group)
            if cgroups and open_manager(self.host, self.hierarchy.parent).exists():
                self.pool.sync()
            return OwnedIsolation(cgroups, network, resctrl)

    def remove_all(self) -> OwnedIsolation:
        """Remove every slot, the agent's parent cgroups and its firewall table (uninstall, and
        tests' clean-up)."""
        with self._lock:
            removed = self.remove_orphans(())
            remove_subtree(self.host, self.hierarchy.parent, self.config.kill_timeout_s)
            if self.network.firewall is not None:
                self.network.firewall.remove_all()
            self._ready = False
            self._best_effort_limit_synced = False
            return removed

    # -- internals ------------------------------------------------------------------------------

    def hold_best_effort_slot(
        self,
        slot_id: str,
        *,
        memory_high: int | _Keep | None = KEEP,
        cpu_quota_us: int | _Keep | None = KEEP,
        own_memory_high: int | None = None,
    ) -> None:
        """What the colocation loop holds a best-effort slot to, written now and kept by every
        later apply or resize of the slot until lifted or the slot is released: ``memory_high``
        (its throttle; None lifts it, back to ``own_memory_high``, the slot's own memory.high) and
        ``cpu_quota_us`` (None lifts it). A slot that is gone meanwhile is not an error."""
        validate_slot_id(slot_id)
        with self._lock:
            held = self._held_by_qos.get(slot_id, CgroupLimits())
            write = CgroupLimits()
            if not isinstance(memory_high, _Keep):
                held = dataclasses.replace(held, memory_high=memory_high)
                value = own_memory_high if memory_high is None else memory_high
                write = dataclasses.replace(write, memory_high=UNLIMITED if value is None else value)
            if not isinstance(cpu_quota_us, _Keep):
                period = self.config.qos.cfs_period_us
                held = dataclasses.replace(held, cpu_quota_us=cpu_quota_us, cpu_period_us=period)
                quota = UNLIMITED if cpu_quota_us is None else cpu_quota_us
                write = dataclasses.replace(write, cpu_quota_us=quota, cpu_period_us=period)
            if held.memory_high is None and held.cpu_quota_us is None:
                self._held_by_qos.pop(slot_id, None)
            else:
                self._held_by_qos[slot_id] = held
            manager = open_manager(self.host, self.hierarchy.slot_path(slot_id, "best-effort"))
            try:
                manager.set(write)
            except CgroupError as err:
                if err.errno not in (errno.ENOENT, errno.ENODEV):
                    raise
                self._held_by_qos.pop(slot_id, None)  # released meanwhile: nothing to hold

    def _apply(
        self, spec: SlotIsolationSpec, *, must_exist: bool, moving_from: str | None = None
    ) -> AppliedSlot:
        rules = slot_device_rules(spec, self.config)
        if spec.l3 is not None:
            self.resctrl.require(l3=True)
        if spec.network is not None:
            self._check_network_filter(spec.slot_id)
        if not self._ready:
            self.ensure_hierarchy()
        relpath = self.hierarchy.slot_path(spec.slot_id, spec.qos)
        manager = open_manager(self.host, relpath)
        existed = self._check_existing(spec, relpath, manager, must_exist=must_exist, moving_from=moving_from)
        params = self._parameters(spec)
        undo: list[Undo] = []
        try:
            cpus = self._prepare_cpus(spec, relpath, existed)
            if existed:
                # With a container's cgroups below it, if any, and the tasks along (a shared slot's
                # CPUs change too when its NUMA binding does).
                self.pool.follow(relpath, cpus)
            manager.create(cpus if spec.exclusive else None)
            if not existed:
                undo.append(lambda: remove_subtree(self.host, relpath, self.config.kill_timeout_s))
            resources = slot_resources(spec, params, cpus, swap_limit=_swap_limit_supported(manager))
            manager.set(_with_held(resources, self._held_by_qos.get(spec.slot_id)))
            _set_io_weight(manager, params.io_weight)
            apply_device_rules(manager, rules)
            if spec.exclusive and existed:
                self.pool.sync()  # give back CPUs a resized slot let go
            network = self._apply_network(spec, undo)
            resctrl_group = self._apply_resctrl(spec, undo)
        except BaseException:
            self._roll_back(undo, spec.exclusive)
            raise
        return self._describe(
            spec,
            manager=manager,
            params=params,
            cpus=cpus,
            rules=rules,
            network=network,
            resctrl_group=resctrl_group,
        )

    def _check_existing(
        self,
        spec: SlotIsolationSpec,
        relpath: str,
        manager: CgroupManager,
        *,
        must_exist: bool,
        moving_from: str | None = None,
    ) -> bool:
        others = [p for p in self._candidate_paths(spec.slot_id) if p not in (relpath, moving_from)]
        clash = [p for p in others if open_manager(self.host, p).exists()]
        if clash:
            raise Conflict(
                f"slot {spec.slot_id} already exists as cgroup {clash[0]}, not as {spec.qos}; a slot "
                "cannot change its QoS class: release it and apply it again"
            )
        existed = manager.exists()
        if must_exist and not existed:
            raise NotFound(f"slot {spec.slot_id} has no cgroup {relpath} to resize; apply it first")
        return existed

    def _prepare_cpus(self, spec: SlotIsolationSpec, relpath: str, existed: bool) -> frozenset[int]:
        """The slot's cpuset, with the pool already cut for an exclusive slot."""
        if not spec.exclusive:
            cpus = self.pool.shared_slot_target(relpath, self.pool.pool(), spec.mems)
            if not cpus:
                raise Conflict(
                    f"slot {spec.slot_id} ({spec.qos}) would have no CPU: the shared pool is "
                    f"{sorted(self.pool.pool())} and its memory is bound to nodes {sorted(spec.mems or ())}; "
                    "release an exclusive slot first"
                )
            return cpus
        self._check_exclusive(spec)
        current = self.pool.read_cpus(relpath) if existed else frozenset()
        self.pool.sync({spec.slot_id: current | spec.cpus})
        return spec.cpus

    def _check_exclusive(self, spec: SlotIsolationSpec) -> None:
        outside = spec.cpus - self.pool.allowed
        if outside:
            raise InvalidRequest(
                f"guaranteed slot {spec.slot_id} asks for CPUs {sorted(outside)}, which are offline or "
                f"reserved; slots may use {sorted(self.pool.allowed)}"
            )
        for other, cpus in self.pool.exclusive_by_slot().items():
            if other != spec.slot_id and cpus & spec.cpus:
                raise Conflict(
                    f"guaranteed slot {spec.slot_id} asks for CPUs {sorted(spec.cpus)}, but "
                    f"{sorted(cpus & spec.cpus)} belong to slot {other}; release it first"
                )

    def _parameters(self, spec: SlotIsolationSpec) -> QosParameters:
        params = qos_parameters(
            spec.qos,
            cpus=slot_cpu_request(spec),
            memory_bytes=spec.memory_bytes,
            cpu_idle_available=class_has_cpu_idle(self.host, self.hierarchy, spec.qos),
            defaults=self.config.qos,
        )
        if spec.background:
            # The lowest weight, not cpu.idle/SCHED_IDLE: a standby must still start on a busy
            # host, only after everything else there.
            params = dataclasses.replace(params, cpu_weight=CPU_WEIGHT_MIN, cpu_shares=CPU_SHARES_MIN)
        return params

    def _check_network_filter(self, slot_id: str) -> None:
        problem = self.firewall_problem
        if problem is not None and not self.config.allow_unfiltered_network:
            raise Unsupported(
                f"slot {slot_id} asks for a network namespace, but this host cannot filter slot traffic: "
                f"{problem}. Install nftables (libnftables1) and restart the agent, or set [isolation] "
                "allow_unfiltered_network = true to give such slots a network without the default-deny "
                "(they then reach every service of the host)"
            )

    def _apply_network(self, spec: SlotIsolationSpec, undo: list[Undo]) -> SlotNetwork | None:
        if spec.network is None:
            return None
        config = self.config.network
        access = spec.network.access
        subnets = _host_veth_subnets(config)
        existing = subnets.get(host_veth_name(config, spec.slot_id))
        firewall = self.network.firewall
        if existing is not None and netns_path(config, spec.slot_id).exists():
            plan = plan_slot_network(
                config,
                spec.slot_id,
                existing,
                spec.network.bandwidth_mbit,
                access=access,
                filtered=firewall is not None,
            )
            if firewall is not None:
                # Converges the opt-ins (a resize may change them) and restores the rules if the
                # table went away meanwhile; a failure here leaves the slot denied, never open.
                firewall.apply(plan)
            return plan
        self.network.teardown(spec.slot_id)  # a half-built leftover of a crash
        subnet = allocate_subnet(config, subnets.values())
        network = self.network.setup(spec.slot_id, subnet, spec.network.bandwidth_mbit, access=access)
        undo.append(lambda: self.network.teardown(spec.slot_id))
        return network

    def _apply_resctrl(self, spec: SlotIsolationSpec, undo: list[Undo]) -> str | None:
        if spec.l3 is None:
            return None
        group = self.config.resctrl_group(spec.slot_id)
        if group not in self.resctrl.groups():
            self.resctrl.create_group(group, l3=spec.l3)
            undo.append(lambda: self.resctrl.delete_group(group))
        return group

    def _roll_back(self, undo: list[Undo], exclusive: bool) -> None:
        # The caller needs the original error; a step that fails here leaves an object that
        # remove_orphans finds later, so its error is not allowed to replace the first one.
        for step in reversed(undo):
            with contextlib.suppress(Exception):
                step()
        if exclusive:
            with contextlib.suppress(Exception):
                self.pool.sync()

    def _describe(
        self,
        spec: SlotIsolationSpec,
        *,
        manager: CgroupManager,
        params: QosParameters,
        cpus: frozenset[int],
        rules: Iterable[object],
        network: SlotNetwork | None,
        resctrl_group: str | None,
    ) -> AppliedSlot:
        return AppliedSlot(
            slot_id=spec.slot_id,
            qos=spec.qos,
            cgroup=manager.relpath,
            cgroup_version=manager.version,
            procs_files=tuple(str(p) for p in manager.procs_files()),
            oom_events=_oom_events_file(manager),
            cpus=shared_ids(cpus),
            mems=spec.mems,
            memory_max=params.memory_max,
            sched_idle=params.sched_idle,
            oom_score_adj=params.oom_score_adj,
            device_rules=tuple(str(rule) for rule in rules),
            network=network,
            resctrl_group=resctrl_group,
            resctrl_tasks=None if resctrl_group is None else str(self.resctrl.root / resctrl_group / "tasks"),
        )

    def _candidate_paths(self, slot_id: str) -> tuple[str, ...]:
        return self.hierarchy.candidate_paths(slot_id)

    def _has_network(self, slot_id: str) -> bool:
        config = self.config.network
        return netns_path(config, slot_id).exists() or Sysfs().exists(
            f"{NET_CLASS}/{host_veth_name(config, slot_id)}"
        )

    def _resctrl_mounted(self) -> bool:
        return (self.resctrl.root / "info").is_dir()


# --------------------------------------------------------------------------- helpers


def _oom_events_file(manager: CgroupManager) -> str | None:
    """Where the slot's OOM kills are counted: v1 memory.oom_control, v2 memory.events."""
    paths = manager.paths()
    if "memory" in paths:
        return str(paths["memory"] / "memory.oom_control")
    return str(paths["unified"] / "memory.events") if "unified" in paths else None


def _controller_dir(manager: CgroupManager, controller: str) -> Path | None:
    paths = manager.paths()
    return paths.get(controller) or paths.get("unified")


def _has_file(manager: CgroupManager, controller: str, name: str) -> bool:
    directory = _controller_dir(manager, controller)
    return directory is not None and (directory / name).is_file()


def class_has_cpu_idle(host: CgroupHost, hierarchy: Hierarchy, qos: QosClass) -> bool:
    """Whether the class parent of ``qos`` offers ``cpu.idle`` (Linux 5.15+). Where it does not,
    best-effort processes run under SCHED_IDLE instead (the slot's ``sched_idle``, which the
    colocation actuator applies as it tends them)."""
    directory = _controller_dir(open_manager(host, hierarchy.class_parent(qos)), "cpu")
    return directory is not None and cpu_idle_supported(directory)


def _swap_limit_supported(manager: CgroupManager) -> bool:
    """Swap accounting is a boot option (v1 memsw) or a v2 file; without it the swap limit is skipped."""
    return _has_file(manager, "memory", "memory.memsw.limit_in_bytes") or _has_file(
        manager, "memory", "memory.swap.max"
    )


def _set_io_weight(manager: CgroupManager, weight: int) -> None:
    # An I/O weight needs the bfq scheduler or blk-iocost; without them the slot runs unweighted
    # (nodeagent doctor reports it), which is no reason to refuse the slot.
    with contextlib.suppress(Unsupported):
        manager.set(CgroupLimits(io_weight=weight))


def _interface_names() -> list[str]:
    try:
        return Sysfs().listdir("class/net") or []
    except DiscoveryError:
        return []


def _host_veth_subnets(config: SlotNetworkConfig) -> dict[str, ipaddress.IPv4Network]:
    """host veth name -> its slot subnet, for every veth carrying our prefix."""
    from pyroute2 import IPRoute  # noqa: PLC0415 - only slots with a network need netlink

    try:
        with IPRoute() as ipr:
            names = {msg["index"]: msg.get("ifname") or "" for msg in ipr.link("dump")}
            found: dict[str, ipaddress.IPv4Network] = {}
            for msg in ipr.addr("dump", family=socket.AF_INET):
                name = names.get(msg["index"], "")
                if name.startswith(config.veth_prefix) and msg.get("address"):
                    found[name] = ipaddress.IPv4Interface(f"{msg.get('address')}/{msg['prefixlen']}").network
            return found
    except OSError as err:
        raise NetworkError(f"listing the slot veths' addresses: {err}", errno_=err.errno) from err


def _orphan_network(owned: OwnedNetwork, config: SlotNetworkConfig, known: frozenset[str]) -> OwnedNetwork:
    keep_netns = {netns_name(config, slot) for slot in known}
    keep_veths = {host_veth_name(config, slot) for slot in known}
    return OwnedNetwork(
        netns=tuple(n for n in owned.netns if n not in keep_netns),
        host_veths=tuple(v for v in owned.host_veths if v not in keep_veths),
        rule_ifnames=tuple(r for r in owned.rule_ifnames if r not in keep_veths),
        firewall_ifnames=tuple(f for f in owned.firewall_ifnames if f not in keep_veths),
    )
