"""``nodeagent uninstall``: hand the host back once no slot is left.

What a stopped agent leaves behind on purpose (its workers keep running across restarts, and the
next start takes everything over) is, once no slot is left, only clutter: the empty ``burstable/``
and ``best-effort/`` parents under the agent's cgroup parent in every hierarchy, its nftables
table, the CDI specs it wrote, its idle host keeper, and — when the last exclusive slot went while
no agent ran — a host still confined by host partitioning. Uninstalling removes all of it and says
what it removed.

It takes the state directory's lock first, so it refuses while an agent runs there (that agent
would make it all again). It refuses while slots exist (in the database, or as cgroups in the
kernel) unless told to release them: then their workers are killed with their cgroups, network
namespaces and firewall opt-ins, and the slots leave the database. The database, the API token and
the logs stay (``--purge`` removes the state directory too).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from typing import Any

from nodeagent.agent.config import AgentConfig
from nodeagent.agent.daemon import build_cdi, build_isolation, lock_state_dir
from nodeagent.agent.slot_cdi import DEVICE_KEYS
from nodeagent.agent.state import StateStore
from nodeagent.cgroups import detect
from nodeagent.devices.discovery import discover
from nodeagent.errors import Conflict
from nodeagent.isolation.api_guard import ApiGuard, table_name
from nodeagent.isolation.backend import KernelIsolation
from nodeagent.isolation.colocation_kernel import hold_cpu_quota
from nodeagent.isolation.firewall import LibNftables, NftFirewall
from nodeagent.isolation.partitioning import describe, host_partitioner
from nodeagent.runtime.keeper_client import stop_keeper


@dataclass
class UninstallReport:
    """What uninstalling removed (empty fields: there was nothing of that kind)."""

    released: list[str] = field(default_factory=list)
    kernel_objects: list[str] = field(default_factory=list)
    cgroup_parent: str | None = None
    firewall_table: str | None = None
    host: str = ""
    cdi_specs: list[str] = field(default_factory=list)
    keeper_pid: int | None = None
    purged: str | None = None

    def lines(self) -> list[str]:
        """For people: one line per kind of thing, in the order they were removed."""
        out = []
        if self.released:
            out.append(f"released slots: {', '.join(self.released)}")
        if self.keeper_pid is not None:
            out.append(f"stopped the host keeper (pid {self.keeper_pid})")
        out += [f"removed {what}" for what in self.kernel_objects]
        if self.cgroup_parent is not None:
            out.append(f"removed the cgroup parent {self.cgroup_parent} (with burstable/ and best-effort/)")
        if self.firewall_table is not None:
            out.append(f"removed the nftables table {self.firewall_table}")
        if self.cdi_specs:
            out.append(f"removed CDI specs: {', '.join(self.cdi_specs)}")
        out.append(f"host partitioning: {self.host}")
        if self.purged is not None:
            out.append(f"removed the state directory {self.purged}")
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "released": self.released,
            "kernel_objects": self.kernel_objects,
            "cgroup_parent": self.cgroup_parent,
            "firewall_table": self.firewall_table,
            "host": self.host,
            "cdi_specs": self.cdi_specs,
            "keeper_pid": self.keeper_pid,
            "purged": self.purged,
        }


def known_slots(config: AgentConfig) -> list[tuple[str, str]]:
    """(id, name) of every slot in the database; none when there is no database (it is not made)."""
    if not config.database_path.exists():
        return []
    store = StateStore(config.database_path)
    try:
        return [(slot.id, slot.name) for slot in store.list_slots()]
    finally:
        store.close()


def forget_slots(config: AgentConfig, slot_ids: list[str]) -> None:
    if not slot_ids or not config.database_path.exists():
        return
    from nodeagent.agent.recovery import Manifests  # noqa: PLC0415 - only for forgetting slots

    store = StateStore(config.database_path, manifests=Manifests(config.state_dir / "slots"))
    try:
        with store.transaction():
            for slot_id in slot_ids:
                store.delete_slot(slot_id)
    finally:
        store.close()


def uninstall(config: AgentConfig, *, release_slots: bool = False, purge: bool = False) -> UninstallReport:
    """Remove what the agent of ``config`` left on this host; see the module docstring."""
    report = UninstallReport()
    state_dir = config.state_dir
    if state_dir.exists():
        lock_state_dir(state_dir)  # refuses while an agent runs there
    host = detect()
    isolation = build_isolation(config, discover(), host)
    kernel = isolation if isinstance(isolation, KernelIsolation) else None
    slots = known_slots(config)
    in_kernel = sorted({owned.slot_id for owned in kernel.owned_slots()} if kernel else set())
    ids = sorted({slot_id for slot_id, _ in slots} | set(in_kernel))
    if ids and not release_slots:
        names = [f"{name} ({slot_id})" for slot_id, name in slots] + [
            f"{slot_id} (in the kernel only)" for slot_id in in_kernel if slot_id not in dict(slots)
        ]
        raise Conflict(
            f"{len(ids)} slot(s) still exist: {', '.join(names)}; release them first "
            "(`nodeagent slots release ID` while the agent runs), or give --release-slots to kill their "
            "workers and remove them"
        )
    keeper = stop_keeper(state_dir / "keeper") if (state_dir / "keeper").exists() else None
    report.keeper_pid = None if keeper is None else keeper.pid
    if kernel is not None:
        isolator = kernel.isolator
        parent_existed = any(
            (mount / isolator.hierarchy.parent).exists() for mount in host.controller_roots()
        )
        table = isolator.config.network.nft_table
        firewall = isolator.network.firewall
        had_table = isinstance(firewall, NftFirewall) and firewall.read_table().exists
        removed = isolator.remove_all()
        # The QoS loop's quota on the kubelet's best-effort pods (NRI): theirs again, unlimited.
        hold_cpu_quota(host, config.kubernetes.best_effort_cgroups(), None, isolator.config.qos.cfs_period_us)
        report.kernel_objects = (
            [f"cgroup {path}" for path in removed.cgroups.values()]
            + [f"netns {name}" for name in removed.network.netns]
            + [f"veth {name}" for name in removed.network.host_veths]
            + [f"resctrl group {name}" for name in removed.resctrl_groups]
        )
        report.cgroup_parent = isolator.hierarchy.parent if parent_existed else None
        report.firewall_table = f"inet {table}" if had_table else None
        guard = ApiGuard(LibNftables(), table_name(config.isolation.firewall_table))
        if guard.installed():  # a crashed agent's rules for slots without a network
            guard.remove()
            report.kernel_objects.append(f"nftables table inet {guard.table}")
    report.released = ids
    forget_slots(config, [slot_id for slot_id, _ in slots])
    cdi = build_cdi(config, can_isolate=kernel is not None)
    if cdi is not None:
        report.cdi_specs = [f"slot {slot_id}" for slot_id in cdi.remove_stale(())]
        report.cdi_specs += [f"{key} devices" for key in DEVICE_KEYS if cdi.specs.remove(key)]
    partitioner = host_partitioner(
        host,
        state_dir=state_dir,
        cgroup_parent=config.isolation.cgroup_parent,
        left_alone=config.kubernetes.partitioning_left_alone(),
    )
    report.host = describe(partitioner.restore()) if state_dir.exists() else "nothing recorded"
    if purge and state_dir.exists():
        shutil.rmtree(state_dir)
        report.purged = str(state_dir)
    return report


__all__ = ["UninstallReport", "known_slots", "uninstall"]
