"""The kernel's cgroup filesystems (v1, v2, hybrid) behind one small manager interface.

Public API (everything else is internal)::

    host = detect(proc_root=Path("/proc"))         # -> CgroupHost: mode "v1"|"v2"|"hybrid"|"none",
                                                   #    v1_mounts, v2_mount, controllers, can_write, delegated
    layout = Hierarchy(parent="nodeagent.slice")   # slot_path(name, qos), class_parent(qos), parents()
    ensure_parents(host, layout)                   # the agent parent + burstable/ + best-effort/
    m = open_manager(host, layout.slot_path("web", "burstable"))   # -> CgroupManager (V1Manager|V2Manager)
    m.create()                                     # idempotent, creates missing ancestors
    m.set(CgroupLimits(cpuset_cpus=frozenset({2, 3}), cpu_weight=200, memory_max=1 << 30, pids_max=512))
    m.add_pid(pid); m.procs(); m.procs_files()     # procs_files: each cgroup.procs a launcher joins
    m.freeze(timeout); m.thaw(); m.kill(timeout)   # kill: cgroup.kill, else freeze + SIGKILL until empty
    m.stats() -> CgroupStats; m.oom_events() -> OomEvents; m.oom_watcher() -> OomWatcher (fileno, wait)
    apply_device_rules(m, [DeviceRule("c", 1, 3, "rwm")])   # v1 devices diff + verify; v2 eBPF program
    m.delete(timeout)                              # leaf first, waits on EBUSY, ENOENT is fine
    list_owned(host, layout) -> [relpath]          # slot groups under the parent (orphans after a crash)
    remove_subtree(host, relpath, timeout)         # kill + delete

Under systemd (nodeagent.cgroups.systemd, nodeagent.cgroups.delegation)::

    delegation, unit = discover()                  # the cgroup a unit delegates to the agent (systemctl show)
    host = replace(host, delegation_root=delegation.root)   # managers never write at or above it
    placement = ProcessPlacement(host, delegation) # where the agent's processes go: agent/, keeper/, pin/
    prepare(placement)                             # processes out of the delegated cgroup, slots/ made
    placement.command("keeper", argv)              # argv that starts inside <root>/keeper
    layout = Hierarchy(parent=delegation.slots_parent)

Every cgroupfs access goes through :mod:`nodeagent.cgroups.fs`, which keeps paths under the mount
and raises :class:`~nodeagent.errors.CgroupError` (with ``errno``) quoting the file and value.
Settings a host cannot honour raise :class:`~nodeagent.errors.Unsupported`.
"""

from nodeagent.cgroups.base import CgroupManager
from nodeagent.cgroups.detect import CgroupHost, detect
from nodeagent.cgroups.factory import apply_device_rules, open_manager, remove_subtree
from nodeagent.cgroups.hierarchy import DEFAULT_PARENT, Hierarchy, QosClass, ensure_parents, list_owned
from nodeagent.cgroups.oom import OomWatcher
from nodeagent.cgroups.resources import UNLIMITED, CgroupLimits, CgroupStats, OomEvents
from nodeagent.cgroups.rules import DeviceRule

__all__ = [
    "DEFAULT_PARENT",
    "UNLIMITED",
    "CgroupHost",
    "CgroupLimits",
    "CgroupManager",
    "CgroupStats",
    "DeviceRule",
    "Hierarchy",
    "OomEvents",
    "OomWatcher",
    "QosClass",
    "apply_device_rules",
    "detect",
    "ensure_parents",
    "list_owned",
    "open_manager",
    "remove_subtree",
]
