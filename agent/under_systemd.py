"""The agent on a host whose service manager is systemd: which cgroups it may write, where its own
processes go, and what a SIGTERM asks of it (docs/systemd.md).

``cgroup_layout`` runs once at start-up, before anything touches the kernel's cgroups:

- without systemd (or with ``[systemd] delegation = "off"``) slots go under ``[isolation]
  cgroup_parent`` and the agent's processes stay where they start, as before;
- under systemd the agent finds the cgroup a unit delegates to it (:mod:`nodeagent.cgroups.systemd`),
  moves what must move into leaves (:func:`nodeagent.cgroups.delegation.prepare`), and slots go under
  its ``slots/``; without such a cgroup the agent runs unisolated and says why, rather than write to
  cgroups systemd owns.

``stop_requested`` answers, on SIGTERM, whether the agent is being stopped (``[workers] on_agent_stop``
applies) or restarted, killed by ``systemctl kill``, or stopped by anything else (workers keep running).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
from dataclasses import dataclass
from pathlib import Path

from nodeagent.agent import notify
from nodeagent.agent.config import AgentConfig
from nodeagent.agent.manager import SlotManager
from nodeagent.agent.state import StateStore
from nodeagent.atomicfile import write_atomic
from nodeagent.cgroups import CgroupHost
from nodeagent.cgroups.delegation import ProcessPlacement, prepare
from nodeagent.cgroups.systemd import (
    DelegationLost,
    NoDelegation,
    Runner,
    booted,
    discover,
    own_cgroup,
    pending_job,
    run_systemctl,
    unit_of,
)
from nodeagent.errors import CgroupError, ConfigError, DiscoveryError, NodeAgentError
from nodeagent.kernelfs import Procfs

log = logging.getLogger("nodeagent.systemd")

#: Slot ids whose workers the agent stopped when it was stopped: the next start brings them back.
STOPPED_WITH_AGENT = "workers-stopped-with-agent.json"


@dataclass(frozen=True)
class CgroupLayout:
    """Where the agent's cgroups go on this host.

    ``host``: the detected host, with ``delegation_root`` set under systemd. ``parent``: the cgroup
    every slot lives under. ``placement``: where the agent's helpers go. ``unit``: the agent's own
    systemd unit (None without systemd). ``refused``: why no cgroup may be created here (systemd
    delegates none), or None.
    """

    host: CgroupHost
    parent: str
    placement: ProcessPlacement
    unit: str | None = None
    refused: str | None = None


def own_unit(proc_root: Path = Path("/proc")) -> str | None:
    """The systemd unit this process runs in, read from /proc/self/cgroup (None when none)."""
    try:
        text = Procfs(proc_root).read_text("self/cgroup")
    except DiscoveryError:
        return None
    cgroup = None if text is None else own_cgroup(text)
    return None if cgroup is None else unit_of(cgroup)


def cgroup_layout(
    config: AgentConfig,
    host: CgroupHost,
    *,
    fs_root: Path = Path("/"),
    proc_root: Path = Path("/proc"),
    run: Runner = run_systemctl,
) -> CgroupLayout:
    """Decide (and prepare) where the agent's cgroups go; see the module docstring."""
    under_systemd = booted(fs_root)
    unit = own_unit(proc_root) if under_systemd else None
    legacy = CgroupLayout(host, config.isolation.cgroup_parent, ProcessPlacement(host, None), unit)
    if not under_systemd or config.systemd.delegation == "off" or not host.can_write:
        return legacy
    try:
        delegation, unit = discover(proc_root, config.systemd.slots_unit, run)
    except DelegationLost as err:
        # Nothing is left in that cgroup to lose: restarting the unit gives it a fresh one (and a pin),
        # and restarts the agent with it (PartOf=); until then this agent cannot place a slot.
        log.error("the delegated cgroup is gone; restarting its unit", extra={"reason": str(err)})
        try:
            run(["restart", "--no-block", "--", config.systemd.slots_unit])
        except CgroupError as restart_err:
            log.error("could not restart the slots unit", extra={"reason": str(restart_err)})
        raise
    except NoDelegation as err:
        log.warning("no delegated cgroup: slots cannot be isolated", extra={"reason": str(err)})
        return dataclasses.replace(legacy, refused=str(err))
    host = dataclasses.replace(host, delegation_root=delegation.root)
    placement = ProcessPlacement(host, delegation)
    moved = prepare(placement)
    log.info(
        "cgroups delegated by systemd",
        extra={
            "unit": delegation.unit,
            "delegated_cgroup": "/" + delegation.root,
            "slots_parent": "/" + delegation.slots_parent,
            "agent_unit": unit,
            "moved_pids": moved,
        },
    )
    return CgroupLayout(host, delegation.slots_parent, placement, unit)


def check_slot_cgroups(store: StateStore, parent: str) -> None:
    """Refuse to start when a stored slot's cgroup lies outside ``parent``.

    That happens after an upgrade from a version that made its cgroups behind systemd's back (at
    ``/sys/fs/cgroup/nodeagent.slice``), or after ``[isolation] cgroup_parent`` changed: the agent
    would neither find those slots' cgroups to resize or release them, nor keep the shared pool off
    their CPUs.
    """
    prefix = parent.strip("/") + "/"
    foreign = {
        slot.name: slot.cgroup
        for slot in store.list_slots()
        if slot.cgroup is not None and not slot.cgroup.strip("/").startswith(prefix)
    }
    if foreign:
        listed = ", ".join(f"{name} ({cgroup})" for name, cgroup in sorted(foreign.items()))
        raise ConfigError(
            f"slots outside the cgroup parent {parent}: {listed}. An earlier version or configuration "
            "made them. Release them with the agent and configuration that made them (for cgroups made "
            'behind systemd\'s back: [systemd] delegation = "off" and the old [isolation] cgroup_parent), '
            "then start this one"
        )


def stop_requested(unit: str | None, signum: int | None, run: Runner = run_systemctl) -> bool:
    """Whether the signal that ends the agent asks it to stop rather than to restart.

    Under systemd: only when systemd runs a stop job on the agent's unit (``systemctl stop``, shutdown).
    A restart job, ``systemctl kill`` or a plain ``kill`` carry none: the agent comes back (Restart=).
    Without systemd: SIGTERM and SIGINT are stops. When systemd cannot be asked, workers are kept.
    """
    if signum not in (signal.SIGTERM, signal.SIGINT):
        return False
    if unit is None:
        return True
    try:
        job = pending_job(unit, run)
    except NodeAgentError as err:
        log.warning("cannot ask systemd why the agent stops; keeping workers", extra={"reason": str(err)})
        return False
    return job == "stop"


def stop_workers_with_agent(state_dir: Path, manager: SlotManager) -> list[str]:
    """``[workers] on_agent_stop = "stop"``: stop every worker before the agent exits (slots stay);
    the next agent starts them again. Returns the slots whose workers were stopped."""
    grace = manager.longest_stop_grace() + 10
    notify.extend_timeout(grace + 5)  # TimeoutStopSec= must not cut the workers' grace short
    notify.stopping(f"stopping workers (up to {grace:g}s), then the agent")
    remember_stopped_workers(state_dir, manager.running_worker_slots())
    stopped = manager.stop_workers(grace)
    log.info("workers stopped with the agent", extra={"slots": stopped})
    return stopped


def remember_stopped_workers(state_dir: Path, slot_ids: list[str]) -> None:
    """Record the slots whose workers the agent is about to stop (before it stops them: a crash
    half-way still brings back those it stopped)."""
    write_atomic(state_dir / STOPPED_WITH_AGENT, json.dumps(sorted(slot_ids)))


def take_stopped_workers(state_dir: Path) -> frozenset[str]:
    """The slots whose workers the last agent stopped when it was stopped; the record is consumed."""
    path = state_dir / STOPPED_WITH_AGENT
    try:
        ids = json.loads(path.read_text())
    except FileNotFoundError:
        return frozenset()
    except (OSError, ValueError) as err:
        log.warning("unreadable record of workers stopped with the agent", extra={"reason": str(err)})
        ids = []
    path.unlink(missing_ok=True)
    return frozenset(i for i in ids if isinstance(i, str))


__all__ = [
    "STOPPED_WITH_AGENT",
    "CgroupLayout",
    "cgroup_layout",
    "check_slot_cgroups",
    "own_unit",
    "remember_stopped_workers",
    "stop_requested",
    "stop_workers_with_agent",
    "take_stopped_workers",
]
