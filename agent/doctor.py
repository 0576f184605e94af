"""Host readiness checks behind ``nodeagent doctor``.

Each check is a function of :class:`HostRoots` (where /proc, /sys, /dev and the cgroup mounts are)
and returns a :class:`Check`: OK, WARN or FAIL, what was found, and what to do. Only what the
agent cannot work without FAILs: usable and writable cpuset, memory and pids controllers, as root
or on a delegated subtree. Everything else is a WARN, because the agent runs without it and only
loses one kind of isolation. Probes that touch the kernel beyond reading files (loading a BPF
program, NVML) are injectable so tests run on fake trees.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from nodeagent.cgroups import fs as cgroupfs
from nodeagent.cgroups.detect import CgroupHost, detect
from nodeagent.devices.gpu import discover_gpus
from nodeagent.devices.pci import discover_fpgas, list_pci_devices
from nodeagent.devices.topology import Fpga, Gpu
from nodeagent.errors import DiscoveryError, NodeAgentError
from nodeagent.isolation.host import PF_KTHREAD, PF_NO_SETAFFINITY, PF_WQ_WORKER
from nodeagent.isolation.host_kernel import IrqBalance, interrupt_names, parse_stat
from nodeagent.isolation.resctrl import Resctrl
from nodeagent.kernelfs import Procfs, Sysfs
from nodeagent.procfmt import meminfo_bytes, parse_meminfo
from nodeagent.runtime.podman_facts import PodmanFacts, podman_facts

Status = Literal["OK", "WARN", "FAIL"]
REQUIRED_CONTROLLERS = ("cpuset", "memory", "pids")
NVIDIA_VENDOR = "0x10de"
CAP_NET_ADMIN, CAP_SYS_ADMIN, CAP_SYS_RESOURCE = 12, 21, 24
NODE_DIR = "devices/system/node"
_NODE_NAME = re.compile(r"node\d+")


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    hint: str = ""


def _default_cache_miss_probe() -> str | None:
    """Open the CPU's last-level cache-miss counter on this thread and close it; None when that
    works, else why not (a VM without a virtual PMU says no hardware counters)."""
    from nodeagent.isolation.memory_traffic import LLC_MISSES, probe  # noqa: PLC0415 - ctypes, only here

    return probe(LLC_MISSES)


def _default_bpf_probe() -> str | None:
    """Load a trivial cgroup device program and close it; None when that works, else why not."""
    try:
        from nodeagent.cgroups.bpf import assemble, load_program  # noqa: PLC0415 - ctypes, only here

        fd = load_program(assemble([]))
    except (NodeAgentError, OSError) as err:
        return str(err)
    os.close(fd)
    return None


def _default_firewall_probe() -> str | None:
    """Send the slot firewall's rules, and the rules that keep slots without a network off other
    local listeners (isolation/api_guard.py), to the kernel in dry-run mode; None when they would
    load."""
    from nodeagent.isolation.api_guard import LocalDeny, guard_commands  # noqa: PLC0415
    from nodeagent.isolation.firewall import LibNftables, NftFirewall  # noqa: PLC0415 - ctypes, only here

    problem = NftFirewall().problem()
    if problem is not None:
        return problem
    commands = guard_commands("nodeagent_doctor", (600000, 665535), api_port=1, local_deny=LocalDeny())
    try:
        LibNftables().run(commands, dry_run=True)
    except (NodeAgentError, OSError) as err:
        return f"the rules for slots without a network do not load: {err}"
    return None


def _default_sandbox_probe() -> dict[str, str]:
    """Try each piece of the worker sandbox in a forked child (runtime.sandbox.probe_live)."""
    from nodeagent.runtime.sandbox import probe_live  # noqa: PLC0415 - forks; only here

    return probe_live()


@dataclass(frozen=True)
class HostRoots:
    """Where the host's interfaces are, plus the probes that go beyond reading files."""

    proc: Path = Path("/proc")
    sys: Path = Path("/sys")
    dev: Path = Path("/dev")
    fs: Path = Path("/")  # prefix for mount points read from mountinfo
    euid: int = field(default_factory=os.geteuid)
    bpf_probe: Callable[[], str | None] = _default_bpf_probe
    cache_miss_probe: Callable[[], str | None] = _default_cache_miss_probe
    firewall_probe: Callable[[], str | None] = _default_firewall_probe
    sandbox_probe: Callable[[], dict[str, str]] = _default_sandbox_probe
    podman_probe: Callable[[str], PodmanFacts] = podman_facts
    which: Callable[[str], str | None] = shutil.which
    gpus: Callable[[Path], tuple[Gpu, ...]] = discover_gpus
    fpgas: Callable[[Path, Path], tuple[Fpga, ...]] = discover_fpgas

    @property
    def procfs(self) -> Procfs:
        return Procfs(self.proc)

    @property
    def sysfs(self) -> Sysfs:
        return Sysfs(self.sys)

    @classmethod
    def under(cls, base: Path, **kwargs: object) -> HostRoots:
        """A host whose whole filesystem is a tree under ``base`` (for fake hosts in tests)."""
        return cls(proc=base / "proc", sys=base / "sys", dev=base / "dev", fs=base, **kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# cgroups: the required part


def _cgroups(roots: HostRoots) -> CgroupHost | Check:
    try:
        return detect(proc_root=roots.proc, fs_root=roots.fs)
    except NodeAgentError as err:
        return Check("cgroup mode", "FAIL", f"cannot detect cgroups: {err}", "mount /proc and /sys/fs/cgroup")


def check_privileges(roots: HostRoots, host: CgroupHost) -> Check:
    if roots.euid == 0:
        if not _effective_caps(roots) & (1 << CAP_SYS_RESOURCE):
            # Some hosts (containers, restricted VMs) withhold it from root.
            return Check(
                "privileges",
                "WARN",
                "running as root without CAP_SYS_RESOURCE: a worker cannot get an OOM score below the "
                "agent's (guaranteed workers keep the agent's protection, no more), nor raise rlimits",
                "give the agent CAP_SYS_RESOURCE (the host or its container runtime withholds it)",
            )
        return Check("privileges", "OK", "running as root")
    if host.delegated:
        return Check(
            "privileges", "OK", f"uid {roots.euid} on a delegated cgroup subtree {host.own_v2_cgroup}"
        )
    return Check(
        "privileges",
        "FAIL",
        f"uid {roots.euid} is not root and owns no delegated cgroup subtree",
        "run as root, or under systemd with Delegate=yes (cgroup v2)",
    )


def check_cgroup_mode(host: CgroupHost) -> Check:
    v2 = str(host.v2_mount) if host.v2_mount else "none"
    if host.mode == "none":
        return Check(
            "cgroup mode", "FAIL", "no cgroup filesystem is mounted", "mount cgroup2 on /sys/fs/cgroup"
        )
    if host.mode == "v2":
        return Check("cgroup mode", "OK", f"v2 (unified) at {v2}")
    v2_note = f"; cgroup2 at {v2} with controllers: {_names(host.v2_controllers)}" if host.v2_mount else ""
    return Check(
        "cgroup mode",
        "WARN",
        f"{host.mode}: v1 controllers {_names(host.v1_mounts)}{v2_note}",
        "boot with systemd.unified_cgroup_hierarchy=1 for cgroup v2 (memory.high, cpu.idle groups, "
        "per-slot PSI); v1 works with fewer controls",
    )


def check_controllers(host: CgroupHost) -> Check:
    missing = [c for c in REQUIRED_CONTROLLERS if c not in host.controllers]
    optional = [c for c in ("cpu", "io" if host.mode == "v2" else "blkio") if c not in host.controllers]
    if missing:
        return Check(
            "cgroup controllers",
            "FAIL",
            f"missing required {_names(missing)} (usable: {_names(host.controllers)})",
            "enable them in the kernel and mount them (v1) or list them in cgroup.subtree_control (v2)",
        )
    if not host.can_write:
        return Check(
            "cgroup controllers",
            "FAIL",
            f"{_names(REQUIRED_CONTROLLERS)} present but not writable",
            "run as root or on a delegated subtree",
        )
    detail = f"usable and writable: {_names(host.controllers)}"
    if optional:
        return Check(
            "cgroup controllers",
            "WARN",
            detail + f"; missing {_names(optional)}",
            "enable them for CPU/IO weights",
        )
    return Check("cgroup controllers", "OK", detail)


def check_cpuset(host: CgroupHost) -> Check:
    if "cpuset" not in host.controllers:
        return Check("cpuset", "FAIL", "no cpuset controller", "enable the cpuset controller")
    if host.mode in ("v1", "hybrid"):
        directory = host.v1_mounts["cpuset"]
        cpus_name, prefix = "cpuset.cpus", "cpuset."
    else:
        assert host.v2_mount is not None
        directory = host.v2_mount
        cpus_name, prefix = "cpuset.cpus.effective", ""
    cpus = cgroupfs.read_optional(directory, cpus_name)
    if cpus is None or not cpus.strip():
        return Check(
            "cpuset", "FAIL", f"{directory / cpus_name} is missing or empty", "mount the cpuset controller"
        )
    if not os.access(directory, os.W_OK):
        return Check(
            "cpuset", "FAIL", f"{directory} is not writable", "run as root or on a delegated subtree"
        )
    exclusive = (
        " (cpuset.cpu_exclusive available)" if cgroupfs.exists(directory, f"{prefix}cpu_exclusive") else ""
    )
    return Check("cpuset", "OK", f"writable at {directory}, CPUs {cpus.strip()}{exclusive}")


# ---------------------------------------------------------------------------------------------
# isolation extras: WARN when missing


def check_device_filter(roots: HostRoots, host: CgroupHost) -> Check:
    name = "device access control"
    v1_devices = "devices" in host.v1_mounts
    if host.v2_mount is None:
        if v1_devices:
            return Check(name, "OK", "v1 devices controller (no cgroup2 mount, so no eBPF filter)")
        return Check(
            name, "WARN", "no v1 devices controller and no cgroup2 mount", "mount the devices controller"
        )
    refusal = _bpf_refusal(roots)
    if refusal is None:
        via = (
            "v1 devices controller; eBPF device programs also load" if v1_devices else "eBPF device programs"
        )
        return Check(name, "OK", via)
    if v1_devices:
        return Check(name, "OK", f"v1 devices controller (eBPF device programs do not load: {refusal})")
    return Check(
        name,
        "WARN",
        f"cgroup v2 needs eBPF device programs, which do not load here: {refusal}",
        "run as root with CONFIG_CGROUP_BPF; slots then see every device",
    )


def _bpf_refusal(roots: HostRoots) -> str | None:
    disabled = roots.procfs.read_text("sys/kernel/unprivileged_bpf_disabled")
    if roots.euid != 0 and disabled is not None and disabled != "0":
        return "not root and kernel.unprivileged_bpf_disabled is set"
    return roots.bpf_probe()


def check_network_namespaces(roots: HostRoots) -> Check:
    name = "network namespaces"
    if not roots.procfs.exists("self/ns/net"):
        return Check(name, "WARN", "no /proc/self/ns/net", "use a kernel with CONFIG_NET_NS")
    caps = _effective_caps(roots)
    lacking = [
        n
        for n, bit in (("CAP_SYS_ADMIN", CAP_SYS_ADMIN), ("CAP_NET_ADMIN", CAP_NET_ADMIN))
        if not caps >> bit & 1
    ]
    if lacking:
        return Check(
            name, "WARN", f"missing {', '.join(lacking)}", "run as root to give slots their own netns"
        )
    ip = roots.which("ip")
    if ip is None:
        return Check(name, "WARN", "netns available but the ip command is missing", "install iproute2")
    return Check(name, "OK", f"available, with {ip}")


def check_network_firewall(roots: HostRoots) -> Check:
    """The slots' default-deny (nftables through libnftables): without it a slot's network reaches
    every host service, so network requests are refused unless allow_unfiltered_network is set."""
    name = "network firewall"
    if roots.euid != 0:
        return Check(name, "WARN", "not root: nftables rules cannot be loaded", "run the agent as root")
    problem = roots.firewall_probe()
    if problem is not None:
        return Check(
            name,
            "WARN",
            problem,
            "install nftables (apt-get install nftables); until then slots that ask for a network are "
            "refused (or run unfiltered with [isolation] allow_unfiltered_network = true), and slots "
            "without one reach the host's and each other's local listeners",
        )
    return Check(
        name,
        "OK",
        "nftables (libnftables JSON API): the kernel accepts the slot rules and those keeping slots "
        "without a network off other local listeners (dry run)",
    )


def check_sandbox(roots: HostRoots) -> Check:
    """The worker sandbox (namespaces, private mounts, hidepid, seccomp): what the kernel offers
    (files under /proc) and, as root, what really works (each piece tried in a forked child)."""
    from nodeagent.runtime.sandbox import probe  # noqa: PLC0415

    name = "worker sandbox"
    support = probe(roots.proc)
    if roots.euid != 0:
        return Check(name, "WARN", "not root: workers run unconfined", "run the agent as root")
    missing = [n for n in ("mount", "ipc", "uts", "pid", "cgroup") if n not in support.namespaces]
    if not support.seccomp_filter:
        missing.append("seccomp filter mode")
    if not support.hidepid:
        missing.append(f"hidepid on a private /proc (Linux 5.8+, this is {support.kernel})")
    failed = {piece: result for piece, result in roots.sandbox_probe().items() if result != "ok"}
    detail = f"namespaces {', '.join(sorted(support.namespaces))}; seccomp filter; hidepid; " + (
        "mount_setattr" if support.mount_setattr else "read-only by remount (no mount_setattr)"
    )
    if missing or failed:
        problems = missing + [f"{piece}: {result}" for piece, result in failed.items()]
        return Check(
            name,
            "WARN",
            f"degraded: {'; '.join(problems)}",
            "a newer kernel (5.8+), or a container runtime that allows namespaces and seccomp; until "
            "then workers that need a missing piece are refused, or set [sandbox] enabled = false (unsafe)",
        )
    return Check(name, "OK", f"tried live: {detail}")


def check_containers(roots: HostRoots, host: CgroupHost | None) -> Check:
    """Container workers (worker.container) need podman, an OCI runtime that takes this host's
    cgroups (runc on v1/hybrid: crun refuses hybrid), a static init for --init, and root."""
    name = "container workers"
    podman = roots.which("podman")
    if podman is None:
        return Check(
            name,
            "WARN",
            "podman is not installed: a container worker fails at launch",
            "apt-get install podman runc catatonit (command workers are not affected)",
        )
    try:
        facts = roots.podman_probe(podman)
    except (OSError, ValueError) as err:
        return Check(name, "WARN", f"{podman} does not answer: {err}", "run `podman info` as root and fix it")
    hybrid = host is not None and host.mode != "v2"
    needs = "runc" if hybrid else facts.runtime
    detail = (
        f"podman {facts.version}, runtime {needs} (podman's default {facts.runtime} {facts.runtime_version})"
    )
    if hybrid and roots.which("runc") is None:
        return Check(
            name,
            "WARN",
            f"{detail}: no runc, and crun refuses this cgroup v1/hybrid host",
            "apt-get install runc",
        )
    if roots.euid != 0:
        return Check(
            name,
            "WARN",
            f"{detail}; not root: container workers need a rootful podman",
            "run the agent as root",
        )
    if roots.which("catatonit") is None and not (roots.fs / "usr/libexec/podman/catatonit").exists():
        return Check(
            name,
            "WARN",
            f"{detail}; no catatonit: containers run without an init as PID 1",
            "apt-get install catatonit",
        )
    return Check(name, "OK", detail)


def _effective_caps(roots: HostRoots) -> int:
    for line in (roots.procfs.read_text("self/status") or "").splitlines():
        key, _, value = line.partition(":")
        if key == "CapEff":
            return int(value.strip(), 16)
    return 0


def check_gpus(roots: HostRoots) -> tuple[Check, Check]:
    """The GPU check and the MIG check."""
    try:
        on_bus = [
            d
            for d in list_pci_devices(roots.sys)
            if d.vendor == NVIDIA_VENDOR and d.class_code.startswith("0x03")
        ]
        gpus = roots.gpus(roots.sys)
    except NodeAgentError as err:
        failed = Check("GPUs", "WARN", f"GPU discovery failed: {err}", "check the NVIDIA driver and NVML")
        return failed, Check("MIG", "WARN", "unknown: GPU discovery failed")
    if not gpus and not on_bus:
        return Check("GPUs", "OK", "no NVIDIA GPUs"), Check("MIG", "OK", "no GPUs to partition")
    if not gpus:
        gpu = Check(
            "GPUs",
            "WARN",
            f"{len(on_bus)} NVIDIA GPU(s) on the PCI bus but NVML reports none",
            "install the NVIDIA driver (NVML, libnvidia-ml.so) and load the nvidia module",
        )
        return gpu, Check("MIG", "WARN", "unknown: NVML is not available")
    return _gpu_check(gpus), _mig_check(gpus)


def _gpu_check(gpus: Sequence[Gpu]) -> Check:
    names = ", ".join(f"{g.index}: {g.name or 'unknown'}" for g in gpus)
    sick = [g for g in gpus if g.healthy is False]
    if sick:
        events = "; ".join(f"GPU {g.index}: {', '.join(g.health_events) or 'unhealthy'}" for g in sick)
        return Check(
            "GPUs", "WARN", f"{len(gpus)} GPU(s) ({names}); unhealthy: {events}", "drain and reset them"
        )
    return Check("GPUs", "OK", f"{len(gpus)} GPU(s): {names}")


def _mig_check(gpus: Sequence[Gpu]) -> Check:
    enabled = [g for g in gpus if g.mig is not None and g.mig.enabled]
    capable = [g for g in gpus if g.mig is not None]
    if enabled:
        parts = ", ".join(
            f"GPU {g.index}: {len(g.mig.instances) if g.mig else 0} instance(s)" for g in enabled
        )
        return Check("MIG", "OK", f"enabled on {parts}")
    if capable:
        return Check(
            "MIG",
            "OK",
            f"supported but off on {len(capable)} GPU(s)",
            "nvidia-smi -mig 1 to slice them for slots",
        )
    return Check("MIG", "OK", "no MIG-capable GPUs")


def check_fpgas(roots: HostRoots) -> Check:
    try:
        fpgas = roots.fpgas(roots.sys, roots.dev)
    except NodeAgentError as err:
        return Check("FPGAs", "WARN", f"FPGA discovery failed: {err}", "check sysfs and the FPGA driver")
    if not fpgas:
        return Check("FPGAs", "OK", "no FPGAs")
    unbound = [f.pci_bus_id for f in fpgas if not f.device_nodes]
    if unbound:
        return Check(
            "FPGAs",
            "WARN",
            f"{len(fpgas)} FPGA(s); without device nodes: {', '.join(unbound)}",
            "bind their driver",
        )
    return Check("FPGAs", "OK", f"{len(fpgas)} FPGA(s): {', '.join(f.pci_bus_id for f in fpgas)}")


def check_resctrl(roots: HostRoots) -> Check:
    name = "cache/memory-bandwidth isolation"
    try:
        support = Resctrl(root=roots.sys / "fs/resctrl", proc_root=roots.proc).detect()
    except NodeAgentError as err:
        return Check(name, "WARN", f"cannot read resctrl: {err}")
    if not support.mounted:
        hint = "mount -t resctrl resctrl /sys/fs/resctrl" if "not mounted" in support.reason else ""
        return Check(name, "WARN", support.reason, hint)
    parts = []
    if support.l3 is not None:
        parts.append(f"L3 CAT {support.l3.ways} ways on domains {list(support.l3_domains)}")
    if support.mb is not None:
        parts.append(f"MBA ({support.mb.unit}) on domains {list(support.mb_domains)}")
    if not parts:
        return Check(name, "WARN", support.reason)
    return Check(name, "OK", f"{', '.join(parts)}; {support.num_closids} CLOSIDs", support.reason)


def check_bandwidth_proxy(roots: HostRoots) -> Check:
    """How best-effort's memory bandwidth is held while online work runs: resctrl MBA where the
    host has it, else the QoS loop's CPU cut of bandwidth hogs where cache misses can be counted."""
    name = "best-effort memory bandwidth"
    try:
        support = Resctrl(root=roots.sys / "fs/resctrl", proc_root=roots.proc).detect()
    except NodeAgentError:
        support = None
    if support is not None and support.mounted and support.mb is not None:
        return Check(name, "OK", "resctrl MBA holds best-effort's share ([qos] best_effort_mb_percent)")
    reason = roots.cache_miss_probe()
    if reason is None:
        return Check(
            name,
            "OK",
            "no resctrl MBA; the QoS loop counts each best-effort slot's last-level cache misses and cuts "
            "the CPU of slots whose traffic would exceed [qos] best_effort_bandwidth_mb_per_s while "
            "online work runs",
        )
    return Check(
        name,
        "WARN",
        f"no resctrl MBA and no cache-miss counter ({reason}): a best-effort slot's memory traffic is "
        "bounded only by its CPU allowance",
        "on a VM, expose the CPU's performance counters to the guest (a virtual PMU, e.g. libvirt "
        "<cpu mode='host-passthrough'> with <pmu state='on'/>); on bare metal, boot with a kernel "
        "that has CONFIG_PERF_EVENTS and the CPU's PMU driver",
    )


def check_psi(roots: HostRoots) -> Check:
    if roots.procfs.read_text("pressure/cpu") is None:
        return Check(
            "PSI",
            "WARN",
            "/proc/pressure/cpu is not readable",
            "boot with psi=1 (CONFIG_PSI); best-effort suppression then falls back to CPU usage",
        )
    return Check("PSI", "OK", "pressure stall information available")


def check_isolcpus(roots: HostRoots) -> Check:
    isolated = roots.sysfs.read_text("devices/system/cpu/isolated")
    if isolated is None:
        return Check("isolcpus", "WARN", "cannot read /sys/devices/system/cpu/isolated")
    if not isolated:
        return Check(
            "isolcpus",
            "OK",
            "no isolated CPUs",
            "optional: isolcpus= / nohz_full= keep kernel noise off the CPUs of exclusive slots",
        )
    return Check(
        "isolcpus",
        "OK",
        f"isolated CPUs {isolated}",
        "the scheduler does not balance load on them: keep them for exclusive slots, out of the shared pool",
    )


def check_numa_balancing(roots: HostRoots) -> Check:
    value = roots.procfs.read_text("sys/kernel/numa_balancing")
    if value is None:
        return Check("NUMA balancing", "OK", "not present (single NUMA node or kernel without it)")
    if value == "0":
        return Check("NUMA balancing", "OK", "off")
    return Check(
        "NUMA balancing",
        "WARN",
        f"on (kernel.numa_balancing = {value}): automatic NUMA balancing can migrate memory "
        "of pinned workers",
        "sysctl -w kernel.numa_balancing=0",
    )


# ---------------------------------------------------------------------------------------------
# what stays on exclusive CPUs whatever the agent does


def check_unmovable(roots: HostRoots) -> Check:
    """What host partitioning cannot move off an exclusive CPU: per-CPU kernel threads, managed
    interrupts, the timer tick; and whether irqbalance would undo the interrupts it moves."""
    name = "exclusive CPU noise"
    parts = []
    per_cpu = _per_cpu_kthreads(roots.proc)
    if per_cpu:
        kinds = ", ".join(sorted(per_cpu)[:6]) + (", ..." if len(per_cpu) > 6 else "")
        parts.append(f"per-CPU kernel threads cannot move ({kinds})")
    managed = _managed_irqs(roots)
    if managed is None:
        parts.append("managed interrupts unknown (mount debugfs to list them)")
    elif managed:
        parts.append("managed interrupts stay where the kernel put them: " + ", ".join(managed[:8]))
    nohz = (roots.sysfs.read_text("devices/system/cpu/nohz_full") or "").strip()
    hint = ""
    if nohz and nohz != "(null)":
        parts.append(f"nohz_full CPUs {nohz}")
    else:
        hint = (
            "for the least noise, boot with nohz_full=CPUS rcu_nocbs=CPUS (the CPUs exclusive slots get) "
            "to take the timer tick and RCU callbacks off them"
        )
    irqbalance = IrqBalance(roots.proc, roots.fs / "run")
    pid = irqbalance.find()
    if pid is not None:
        socket_file = roots.fs / "run" / "irqbalance" / f"irqbalance{pid}.sock"
        if not socket_file.exists():
            return Check(
                name,
                "WARN",
                f"irqbalance (pid {pid}) runs without its control socket: it will move interrupts back onto "
                "exclusive CPUs between the agent's sweeps; " + "; ".join(parts),
                "set IRQBALANCE_BANNED_CPULIST to the CPUs of exclusive slots, or stop irqbalance",
            )
        parts.append(f"irqbalance (pid {pid}) is told to ban exclusive CPUs")
    return Check(name, "OK", "; ".join(parts) or "nothing found that cannot move", hint)


def _per_cpu_kthreads(proc: Path) -> set[str]:
    found: set[str] = set()
    procfs = Procfs(proc)
    for pid in (e for e in procfs.listdir() or [] if e.isdigit()):
        try:
            text = procfs.read_text(f"{pid}/stat")
        except DiscoveryError:
            continue  # it went away between the listing and the read
        if text is None:
            continue
        comm, fields = parse_stat(text)
        flags = int(fields[6]) if len(fields) > 6 else 0
        if flags & PF_KTHREAD and flags & PF_NO_SETAFFINITY and not flags & PF_WQ_WORKER:
            found.add(comm.split("/")[0])
    return found


def _managed_irqs(roots: HostRoots) -> list[str] | None:
    """``IRQ (name)`` of every managed interrupt, from debugfs; None when debugfs is not mounted."""
    debug = roots.sys / "kernel/debug/irq/irqs"
    if not debug.is_dir():
        return None
    names = interrupt_names(roots.procfs.read_text("interrupts") or "")
    managed = []
    for entry in sorted(debug.iterdir(), key=lambda p: (len(p.name), p.name)):
        if "IRQD_AFFINITY_MANAGED" in (roots.sysfs.read_text(f"kernel/debug/irq/irqs/{entry.name}") or ""):
            label = names.get(entry.name)
            managed.append(f"{entry.name} ({label})" if label else entry.name)
    return managed


# ---------------------------------------------------------------------------------------------
# from the agent's API: what `nodeagent doctor` adds when an agent answers


def check_host_partitioning(node: Mapping[str, Any]) -> Check:
    """The agent's host partitioning (``GET /v1/node``'s ``host_partitioning``)."""
    name = "host partitioning"
    status = node.get("host_partitioning")
    if not isinstance(status, Mapping):
        return Check(name, "WARN", "this agent does not partition the host (it isolates no slot)")
    if status.get("mode") == "off":
        return Check(
            name,
            "WARN",
            "off: every process, kernel thread and interrupt may still run on exclusive CPUs",
            'set [isolation] host_partitioning = "auto"',
        )
    last = status.get("last") if isinstance(status.get("last"), Mapping) else None
    error = status.get("error")
    if last is None or not status.get("active"):
        detail = "on; no exclusive CPU is held, the host runs everywhere"
        if error:
            return Check(name, "WARN", f"{detail}; last pass failed: {error}")
        return Check(name, "OK", detail)
    confined = ", ".join(f"{n} {kind}" for kind, n in sorted(dict(last.get("confined") or {}).items()) if n)
    immovable = list(last.get("immovable") or [])
    warnings = list(last.get("warnings") or []) + list(last.get("problems") or [])
    detail = (
        f"exclusive CPUs {last.get('exclusive_cpus')}, the rest of the host on {last.get('host_cpus')}; "
        f"confined: {confined or 'nothing'}"
    )
    if immovable:
        detail += f"; cannot move ({len(immovable)}): " + "; ".join(immovable[:5])
    if error:
        warnings.insert(0, f"last pass failed: {error}")
    if warnings:
        return Check(name, "WARN", detail + "; " + "; ".join(warnings))
    return Check(name, "OK", detail)


#: Above this share of a slot's CPU time taken by others, the doctor warns.
FOREIGN_WARN_FRACTION = 0.01


def check_foreign_cpu(slots: Sequence[Mapping[str, Any]]) -> Check:
    """Foreign CPU time of the guaranteed slots (``GET /v1/slots``)."""
    name = "foreign CPU time"
    measured = [s for s in slots if isinstance(s.get("foreign_cpu"), Mapping)]
    if not measured:
        return Check(name, "OK", "no guaranteed slot to measure")
    lines = []
    noisy = False
    for slot in sorted(measured, key=lambda s: -float(s["foreign_cpu"].get("fraction", 0))):
        foreign = slot["foreign_cpu"]
        fraction = float(foreign.get("fraction", 0.0))
        noisy = noisy or fraction > FOREIGN_WARN_FRACTION
        cpus = (slot.get("assignment") or {}).get("cpuset") or ""
        lines.append(
            f"{slot.get('name')} (CPUs {cpus}): {fraction:.2%} of its CPU time "
            f"({float(foreign.get('seconds', 0)):.2f} s, "
            f"of which interrupts {float(foreign.get('irq_seconds', 0)):.2f} s)"
        )
    detail = "; ".join(lines[:5]) + (f"; and {len(lines) - 5} more" if len(lines) > 5 else "")
    if noisy:
        return Check(
            name,
            "WARN",
            detail,
            f"above {FOREIGN_WARN_FRACTION:.0%}: see `exclusive CPU noise` and `host partitioning` for "
            "what runs there",
        )
    return Check(name, "OK", detail)


def check_kubernetes(node: Mapping[str, Any]) -> Check | None:
    """The Kubernetes integrations the agent runs (``GET /v1/node``'s ``integrations``: the kubelet
    device plugins, the NodeResourceTopology publisher); None when none is on."""
    integrations = node.get("integrations")
    if not isinstance(integrations, Mapping) or not integrations:
        return None
    names = ", ".join(sorted(integrations))
    problems = [f"{name}: {p}" for name, found in sorted(integrations.items()) for p in found or ()]
    if not problems:
        return Check("kubernetes", "OK", f"{names}: working")
    return Check(
        "kubernetes",
        "WARN",
        "; ".join(problems),
        "see the agent's log and docs/kubernetes.md; the agent serves slots regardless",
    )


def agent_checks(node: Mapping[str, Any], slots: Sequence[Mapping[str, Any]]) -> list[Check]:
    """The checks `nodeagent doctor` adds from a running agent's API (node and slot listing)."""
    checks = [
        _guarded("host partitioning", lambda: check_host_partitioning(node)),
        _guarded("foreign CPU time", lambda: check_foreign_cpu(slots)),
    ]
    kubernetes = check_kubernetes(node)
    if kubernetes is not None:
        checks.append(kubernetes)
    return checks


def _meminfo_kib(text: str | None, key: str) -> int | None:
    size = meminfo_bytes(parse_meminfo(text or "").get(key))
    return None if size is None else size // 1024


def check_numa_memory(roots: HostRoots) -> Check:
    """Placement accounts memory per NUMA node, so the nodes must add up to what the host has."""
    host_kib = _meminfo_kib(roots.procfs.read_text("meminfo"), "MemTotal")
    sysfs = roots.sysfs
    nodes = [n for n in sysfs.listdir(NODE_DIR) or [] if _NODE_NAME.fullmatch(n)]
    if host_kib is None or not nodes:
        return Check("NUMA memory", "OK", "no NUMA node information; memory is accounted host-wide")
    node_kib = [_meminfo_kib(sysfs.read_text(f"{NODE_DIR}/{n}/meminfo"), "MemTotal") for n in nodes]
    if any(k is None for k in node_kib):
        return Check(
            "NUMA memory", "WARN", "a NUMA node's meminfo is unreadable; its memory counts as unknown"
        )
    total = sum(k for k in node_kib if k is not None)
    detail = f"{len(nodes)} node(s) hold {total / (1 << 20):.1f} GiB of {host_kib / (1 << 20):.1f} GiB"
    if total >= host_kib * 0.95:
        return Check("NUMA memory", "OK", detail)
    return Check(
        "NUMA memory",
        "WARN",
        f"{detail}: slots can be given only what the nodes report",
        "check for memory that is not online in a node (hot-plugged or lazily initialised memory, "
        "/sys/devices/system/memory/*/online)",
    )


def check_swap(roots: HostRoots) -> Check:
    text = roots.procfs.read_text("swaps")
    if text is None:
        return Check("swap", "WARN", "cannot read /proc/swaps")
    devices = [line.split() for line in text.splitlines()[1:] if line.strip()]
    if not devices:
        return Check("swap", "OK", "off")
    total_kib = sum(int(d[2]) for d in devices if len(d) > 2 and d[2].isdigit())
    return Check(
        "swap",
        "WARN",
        f"on: {len(devices)} device(s), {total_kib / (1 << 20):.1f} GiB; a page-in in a request path "
        "is a latency spike",
        "swapoff -a, or keep slots off swap with memory.swap.max=0 (cgroup v2)",
    )


# ---------------------------------------------------------------------------------------------
# running and reporting


def run_checks(roots: HostRoots | None = None) -> list[Check]:
    """Every check, in the order people read them."""
    roots = roots or HostRoots()
    host = _cgroups(roots)
    checks: list[Check] = []
    if isinstance(host, Check):
        checks.append(host)
    else:
        checks += [
            _guarded("privileges", lambda: check_privileges(roots, host), required=True),
            _guarded("cgroup mode", lambda: check_cgroup_mode(host), required=True),
            _guarded("cgroup controllers", lambda: check_controllers(host), required=True),
            _guarded("cpuset", lambda: check_cpuset(host), required=True),
            _guarded("device access control", lambda: check_device_filter(roots, host)),
        ]
    checks.append(_guarded("network namespaces", lambda: check_network_namespaces(roots)))
    checks.append(_guarded("network firewall", lambda: check_network_firewall(roots)))
    checks.append(_guarded("worker sandbox", lambda: check_sandbox(roots)))
    cgroups = None if isinstance(host, Check) else host
    checks.append(_guarded("container workers", lambda: check_containers(roots, cgroups)))
    try:
        checks += check_gpus(roots)
    except Exception as err:  # noqa: BLE001 - doctor reports every failure instead of crashing
        checks.append(Check("GPUs", "WARN", f"check crashed: {err!r}"))
    for name, fn in (
        ("FPGAs", check_fpgas),
        ("cache/memory-bandwidth isolation", check_resctrl),
        ("best-effort memory bandwidth", check_bandwidth_proxy),
        ("PSI", check_psi),
        ("isolcpus", check_isolcpus),
        ("exclusive CPU noise", check_unmovable),
        ("NUMA balancing", check_numa_balancing),
        ("NUMA memory", check_numa_memory),
        ("swap", check_swap),
    ):
        checks.append(_guarded(name, lambda fn=fn: fn(roots)))  # type: ignore[misc]
    return checks


def _guarded(name: str, fn: Callable[[], Check], *, required: bool = False) -> Check:
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - doctor reports every failure instead of crashing
        return Check(name, "FAIL" if required else "WARN", f"check crashed: {err!r}")


def overall(checks: Sequence[Check]) -> Status:
    statuses = {c.status for c in checks}
    return "FAIL" if "FAIL" in statuses else "WARN" if "WARN" in statuses else "OK"


def exit_code(checks: Sequence[Check]) -> int:
    """Non-zero when a required capability is missing."""
    return 1 if overall(checks) == "FAIL" else 0


def to_json(checks: Sequence[Check]) -> str:
    return json.dumps({"status": overall(checks), "checks": [asdict(c) for c in checks]}, indent=2)


def to_table(checks: Sequence[Check]) -> str:
    width = max((len(c.name) for c in checks), default=0)
    lines = []
    for c in checks:
        lines.append(f"{c.status:<4}  {c.name:<{width}}  {c.detail}")
        if c.hint and c.status != "OK":
            lines.append(f"{'':<4}  {'':<{width}}  -> {c.hint}")
    lines.append(f"overall: {overall(checks)}")
    return "\n".join(lines)


def _names(items: object) -> str:
    names = sorted(items) if isinstance(items, (set, frozenset, dict, list, tuple)) else []
    return ", ".join(str(n) for n in names) or "none"
