"""The kernel side of host partitioning: small backends, each with an injectable /proc, /sys or
cgroup root, that read one kind of host state into :mod:`nodeagent.isolation.host`'s plain data and
change one item of it.

- :class:`ProcTasks`: every thread in /proc (flags, parent, start time, affinity, cgroup), and
  ``sched_setaffinity``;
- :class:`Interrupts`: ``/proc/irq/N/smp_affinity_list`` and ``/proc/irq/default_smp_affinity``;
- :class:`Workqueue`: ``/sys/devices/virtual/workqueue/cpumask``;
- :class:`CgroupSiblings`: on cgroup v2, the cpuset of every cgroup beside the path from the root to
  the agent's parent, through systemd (``systemctl set-property --runtime UNIT AllowedCPUs=``) for
  the units it manages, so that systemd does not undo it;
- :class:`IrqBalance`: tells a running irqbalance to ban the exclusive CPUs (its socket, the
  protocol of irqbalance-ui), or warns that it will move interrupts back.

Writes raise OSError as the kernel answered it (ESRCH: the task is gone; EINVAL: pinned; EIO: a
managed interrupt); :class:`~nodeagent.isolation.host.HostPartitioner` turns them into its report.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import struct
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from nodeagent.cgroups.systemd import run_systemctl
from nodeagent.cpulist import format_cpulist, parse_cpulist
from nodeagent.errors import CgroupError, InvalidRequest
from nodeagent.isolation.host import Knob, Task
from nodeagent.kernelfs import Procfs, Sysfs
from nodeagent.procfmt import parse_proc_cgroup

#: systemd unit types that own a cgroup (a directory named like this is a unit's cgroup)
UNIT_SUFFIXES = (".slice", ".scope", ".service", ".socket", ".mount", ".swap")


def parse_mask(text: str) -> frozenset[int]:
    """A kernel hex CPU mask (``"ff"``, ``"00000001,00000000"``) -> CPU ids."""
    value = int(text.strip().replace(",", "") or "0", 16)
    return frozenset(i for i in range(value.bit_length()) if value >> i & 1)


def format_mask(cpus: frozenset[int]) -> str:
    """CPU ids -> the kernel's hex mask, in comma-separated 32-bit words as it prints them."""
    value = sum(1 << c for c in cpus)
    words = max(1, (max(cpus, default=0) // 32) + 1)
    return ",".join(f"{value >> (32 * w) & 0xFFFFFFFF:08x}" for w in reversed(range(words)))


def _read(path: Path) -> str | None:
    """A cgroupfs file (procfs and sysfs are read through nodeagent.kernelfs); None when gone."""
    try:
        return path.read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None


def _write(path: Path, value: str) -> None:
    # One write() of the whole value: the kernel parses a cpulist or mask per write call.
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
    try:
        # An empty write never reaches the kernel's handler: "empty" (a v2 cpuset that follows its
        # parent again) is written as a bare newline.
        os.write(fd, (value or "\n").encode())
    finally:
        os.close(fd)


# =========================================================================== tasks


def parse_stat(text: str) -> tuple[str, list[str]]:
    """``/proc/PID/stat`` -> (comm, fields from field 3 on). The command name may hold spaces and
    parentheses, so the fields start after its last ``)``."""
    head, _, rest = text.rpartition(")")
    return head.partition("(")[2], rest.split()


class ProcTasks:
    """Every thread the host runs, as :class:`~nodeagent.isolation.host.Task`, and its affinity.

    ``slot_parent``: the agent's cgroup parent (relative to the cgroup root); tasks in it are in
    slots. ``left_alone``: further subtrees whose tasks are treated as the slots' (the kubelet's
    pods while NRI gives their containers cpusets). ``covered``: whether a cgroup v2 path is one
    whose cpuset the partitioner sets (its tasks keep their affinity). ``only``: limit the tasks
    to processes for which it is true (a benchmark or a test confining only what it started).
    ``set_affinity`` and ``get_affinity`` default to the system calls when ``proc`` is the real
    /proc, else to the tree's ``Cpus_allowed_list`` (a fake tree in a test).
    """

    def __init__(
        self,
        proc: Path = Path("/proc"),
        *,
        slot_parent: str = "",
        left_alone: Sequence[str] = (),
        covered: Callable[[str], bool] | None = None,
        only: Callable[[int], bool] | None = None,
        set_affinity: Callable[[int, frozenset[int]], None] | None = None,
    ) -> None:
        self.proc = proc
        self._procfs = Procfs(proc)
        self._slot_prefixes = tuple(
            "/" + path.strip("/") for path in (slot_parent, *left_alone) if path.strip("/")
        )
        self._covered = covered
        self._only = only
        real = proc == Path("/proc")
        self._set = set_affinity or (os.sched_setaffinity if real else self._set_in_tree)
        self._get: Callable[[int, Path], frozenset[int] | None] = (
            self._get_syscall if real else self._get_in_tree
        )

    def read(self) -> list[Task]:
        tasks: list[Task] = []
        with os.scandir(self.proc) as entries:
            pids = [int(e.name) for e in entries if e.name.isdigit()]
        for pid in pids:
            if self._only is not None and not self._only(pid):
                continue
            cgroups = self._procfs.read_text(f"{pid}/cgroup")
            if cgroups is None:
                continue  # exited while we looked
            in_slot, v2_path = self._classify(cgroups)
            covered = v2_path is not None and self._covered is not None and self._covered(v2_path)
            try:
                tids = os.listdir(self.proc / str(pid) / "task")
            except (FileNotFoundError, ProcessLookupError):
                continue
            for tid_name in tids:
                task = self._task(pid, int(tid_name), in_slot=in_slot, covered=covered)
                if task is not None:
                    tasks.append(task)
        return tasks

    def write(self, item: Any, cpus: frozenset[int]) -> None:
        task: Task = item
        # A tid can be reused between the read and now; the start time tells the task we saw apart.
        current = self._procfs.read_text(f"{task.pid}/task/{task.tid}/stat")
        if current is None or int(parse_stat(current)[1][19]) != task.start:
            raise ProcessLookupError(errno.ESRCH, f"task {task.tid} exited")
        self._set(task.tid, cpus)

    def _task(self, pid: int, tid: int, *, in_slot: bool, covered: bool) -> Task | None:
        directory = self.proc / str(pid) / "task" / str(tid)
        stat = self._procfs.read_text(f"{pid}/task/{tid}/stat")
        if stat is None:
            return None
        comm, fields = parse_stat(stat)
        cpus = self._get(tid, directory)
        if cpus is None:
            return None
        return Task(
            tid=tid,
            pid=pid,
            ppid=int(fields[1]),
            start=int(fields[19]),
            comm=comm,
            cpus=cpus,
            flags=int(fields[6]),
            in_slot=in_slot,
            cgroup_confined=covered,
        )

    def _classify(self, cgroups: str) -> tuple[bool, str | None]:
        """(in one of the agent's slots, its cgroup v2 path) from /proc/PID/cgroup."""
        in_slot = False
        v2_path = None
        for hierarchy, _controllers, path in parse_proc_cgroup(cgroups):
            if any(path == prefix or path.startswith(prefix + "/") for prefix in self._slot_prefixes):
                in_slot = True
            if hierarchy == "0":
                v2_path = path
        return in_slot, v2_path

    @staticmethod
    def _get_syscall(tid: int, _directory: Path) -> frozenset[int] | None:
        try:
            return frozenset(os.sched_getaffinity(tid))
        except ProcessLookupError:
            return None

    @staticmethod
    def _get_in_tree(_tid: int, directory: Path) -> frozenset[int] | None:
        status = Procfs(directory).read_text("status")
        if status is None:
            return None
        for line in status.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                return parse_cpulist(line.partition(":")[2])
        return None

    def _set_in_tree(self, tid: int, cpus: frozenset[int]) -> None:
        for status in self.proc.glob(f"*/task/{tid}/status"):
            lines = [
                f"Cpus_allowed_list:\t{format_cpulist(cpus)}"
                if line.startswith("Cpus_allowed_list:")
                else line
                for line in status.read_text().splitlines()
            ]
            status.write_text("\n".join(lines) + "\n")
            return
        raise ProcessLookupError(errno.ESRCH, f"task {tid} exited")


# =========================================================================== interrupts and workqueues


def interrupt_names(text: str) -> dict[str, str]:
    """IRQ number -> the device name /proc/interrupts shows for it (its last column)."""
    lines = text.splitlines()
    if not lines:
        return {}
    cpus = len(lines[0].split())
    names: dict[str, str] = {}
    for line in lines[1:]:
        label, _, rest = line.partition(":")
        if label.strip().isdigit():
            tail = rest.split()[cpus:]
            names[label.strip()] = tail[-1] if tail else ""
    return names


def interrupt_counts(text: str) -> dict[int, int]:
    """Device interrupts (numbered lines) served per CPU since boot, from /proc/interrupts."""
    lines = text.splitlines()
    if not lines:
        return {}
    columns = [int(name.removeprefix("CPU")) for name in lines[0].split() if name.startswith("CPU")]
    totals = dict.fromkeys(columns, 0)
    for line in lines[1:]:
        label, _, rest = line.partition(":")
        if not label.strip().isdigit():
            continue  # timer, IPIs and other per-CPU counters are not device interrupts
        for cpu, count in zip(columns, rest.split()[: len(columns)], strict=False):
            totals[cpu] += int(count) if count.isdigit() else 0
    return totals


class Interrupts:
    """Every interrupt's affinity (``irq``) and the one new interrupts start with (``irq-default``)."""

    kinds = ("irq", "irq-default")

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self.proc = proc
        self._procfs = Procfs(proc)

    def read(self) -> list[Knob]:
        irqs = self._procfs.listdir("irq") if self._procfs.is_dir("irq") else None
        if irqs is None:
            return []
        names = interrupt_names(self._procfs.read_text("interrupts") or "")
        knobs: list[Knob] = []
        for irq in sorted(irqs, key=lambda name: (len(name), name)):
            if not irq.isdigit():
                continue
            text = self._procfs.read_text(f"irq/{irq}/smp_affinity_list")
            if text is not None:
                knobs.append(Knob("irq", irq, parse_cpulist(text), names.get(irq, "")))
        default = self._procfs.read_text("irq/default_smp_affinity")
        if default is not None:
            knobs.append(Knob("irq-default", "default", parse_mask(default)))
        return knobs

    def write(self, item: Any, cpus: frozenset[int]) -> None:
        knob: Knob = item
        if knob.kind == "irq-default":
            _write(self.proc / "irq" / "default_smp_affinity", format_mask(cpus))
        else:
            _write(self.proc / "irq" / knob.key / "smp_affinity_list", format_cpulist(cpus))


#: Under /sys: the CPUs of unbound workqueues.
CPUMASK = "devices/virtual/workqueue/cpumask"


class Workqueue:
    """The CPUs unbound workqueues (and their kworkers) may use."""

    kinds = ("workqueue",)

    def __init__(self, sys: Path = Path("/sys")) -> None:
        self._sysfs = Sysfs(sys)
        self.path = Path(self._sysfs.path(CPUMASK))

    def read(self) -> list[Knob]:
        text = self._sysfs.read_text(CPUMASK)
        return [] if text is None else [Knob("workqueue", "unbound", parse_mask(text))]

    def write(self, item: Any, cpus: frozenset[int]) -> None:
        _write(self.path, format_mask(cpus))


# =========================================================================== cgroup v2 and systemd


SystemctlRunner = Callable[[Sequence[str]], None]


def systemctl_write(args: Sequence[str]) -> None:
    """``systemctl ARGS`` through the agent's one runner (cgroups/systemd.py); a refusal becomes
    OSError (EIO) with systemctl's own words, as every write here reports."""
    try:
        run_systemctl(args)
    except CgroupError as err:
        raise OSError(errno.EIO, str(err)) from err


def systemd_owns_cgroups(proc: Path = Path("/proc"), run: Path = Path("/run")) -> bool:
    """systemd is PID 1 and booted the system (sd_booted's test): it owns the cgroup tree."""
    return (run / "systemd" / "system").is_dir() and Procfs(proc).read_text("1/comm") == "systemd"


class CgroupSiblings:
    """cgroup v2: every cgroup beside the path from the root to ``parent`` (the agent's own), with a
    cpuset: on a host where the agent lives in ``nodeagent.slice`` that is every other child of the
    root (``system.slice``, ``user.slice``, ``init.scope``...); where it lives deeper (a delegated
    ``system.slice/nodeagent.service/slots``), the siblings at each level, since an ancestor's
    cpuset bounds the slots below it.

    ``systemctl`` is used for the cgroups of units when ``systemd`` is true (systemd rewrites a unit's
    cpuset from its ``AllowedCPUs=`` on every reload); other cgroups are written directly.

    ``left_alone``: further subtrees kept as they are, with the siblings along their routes confined
    the same way (the kubelet's pods while NRI gives their containers cpusets: a confined ancestor
    would bound an exclusive container's cpuset to the host's CPUs, and v2 would then move it there).
    """

    kinds = ("cgroup",)

    def __init__(
        self,
        mount: Path,
        parent: str,
        *,
        left_alone: Sequence[str] = (),
        systemd: bool = False,
        systemctl: SystemctlRunner = systemctl_write,
    ) -> None:
        self.mount = mount
        route = "/".join(part for part in parent.strip("/").split("/") if part)
        if not route:
            raise InvalidRequest("the agent's cgroup parent must not be the root cgroup")
        #: the subtrees kept whole (the agent's own first), and every cgroup on the way to one
        self._kept = {route} | {
            "/".join(p for p in path.strip("/").split("/") if p) for path in left_alone if path.strip("/")
        }
        self._on_route = {
            "/".join(path.split("/")[:depth])
            for path in self._kept
            for depth in range(1, path.count("/") + 1)
        }
        self._systemd = systemd
        self._systemctl = systemctl

    def siblings(self) -> list[str]:
        """Relative paths of the cgroups beside the routes, with a cpuset of their own."""
        found: list[str] = []
        levels = [""]  # the root, then each cgroup on a route (a kept subtree is not entered)
        while levels:
            prefix = levels.pop(0)
            try:
                with os.scandir(self.mount / prefix if prefix else self.mount) as entries:
                    names = sorted(e.name for e in entries if e.is_dir(follow_symlinks=False))
            except FileNotFoundError:
                continue
            for name in names:
                relpath = f"{prefix}/{name}" if prefix else name
                if relpath in self._kept:
                    continue
                if relpath in self._on_route:
                    levels.append(relpath)
                elif (self.mount / relpath / "cpuset.cpus").is_file():
                    found.append(relpath)
        return found

    def covers(self, v2_path: str) -> bool:
        """Whether a task in cgroup ``v2_path`` (as /proc/PID/cgroup shows it) is confined by one of
        the siblings' cpusets."""
        parts = [p for p in v2_path.strip("/").split("/") if p]
        for depth in range(1, len(parts) + 1):
            above = "/".join(parts[:depth])
            if above in self._kept:
                return False  # in the agent's own subtree or one left alone
            if above not in self._on_route:
                return (self.mount / above / "cpuset.cpus").is_file()
        return False  # in an ancestor of a route (the root cgroup): only its affinity can move it

    def read(self) -> list[Knob]:
        knobs = []
        for relpath in self.siblings():
            text = _read(self.mount / relpath / "cpuset.cpus")
            if text is None:
                continue
            name = relpath.rsplit("/", 1)[-1]
            unit = name if self._systemd and name.endswith(UNIT_SUFFIXES) else ""
            knobs.append(Knob("cgroup", relpath, parse_cpulist(text), unit))
        return knobs

    def write(self, item: Any, cpus: frozenset[int]) -> None:
        knob: Knob = item
        if knob.label:
            if not cpus:
                # Back to "no AllowedCPUs=": systemd would write an empty cpuset, which the kernel
                # refuses for a cgroup with tasks (ENOSPC), leaving them confined. The parent's CPUs,
                # named, first (the same set, and it widens the tasks); then the setting as it was.
                above = (_read(self.mount / knob.key / ".." / "cpuset.cpus.effective") or "").strip()
                if above:
                    self._systemctl(["set-property", "--runtime", knob.label, f"AllowedCPUs={above}"])
            # --runtime: gone at reboot, as the slots are.
            self._systemctl(["set-property", "--runtime", knob.label, f"AllowedCPUs={format_cpulist(cpus)}"])
        else:
            path = self.mount / knob.key / "cpuset.cpus"
            try:
                _write(path, format_cpulist(cpus))
            except OSError as err:
                if cpus or err.errno != errno.ENOSPC:
                    raise
                # An empty cpuset ("the parent's CPUs") cannot be written back while the cgroup has
                # tasks (ENOSPC, kernel 6.1): the parent's CPUs, named, are the same set today.
                parent = path.parent.parent / "cpuset.cpus.effective"
                _write(path, (_read(parent) or "").strip())


# =========================================================================== irqbalance


class IrqBalance:
    """irqbalance would move interrupts back onto exclusive CPUs on its next pass. While it runs it is
    told to ban them, through the socket irqbalance-ui uses (``settings cpus LIST``; ``NULL`` gives
    it back its own configuration); when that socket cannot be reached, the report says how to
    configure it, and the partitioner's sweep keeps moving the interrupts back meanwhile."""

    def __init__(self, proc: Path = Path("/proc"), run: Path = Path("/run")) -> None:
        self.proc = proc
        self._procfs = Procfs(proc)
        self.run = run

    def find(self) -> int | None:
        with os.scandir(self.proc) as entries:
            pids = [e.name for e in entries if e.name.isdigit()]
        for pid in pids:
            if self._procfs.read_text(f"{pid}/comm") == "irqbalance":
                return int(pid)
        return None

    def notify(
        self, exclusive: frozenset[int], record: Mapping[str, Any] | None
    ) -> tuple[Mapping[str, Any] | None, tuple[str, ...]]:
        pid = self.find()
        if pid is None:
            return None, ()
        if not exclusive:
            if record is not None:
                with contextlib.suppress(OSError):
                    self._send(pid, "settings cpus NULL")
            return None, ()
        try:
            self._send(pid, f"settings cpus {format_cpulist(exclusive)}")
        except OSError as err:
            return None, (
                f"irqbalance (pid {pid}) runs and will move interrupts back onto CPU(s) "
                f"{format_cpulist(exclusive)} (its socket: {err.strerror or err}); the agent moves them off "
                f"again at each sweep. Set IRQBALANCE_BANNED_CPULIST={format_cpulist(exclusive)} in its "
                "environment "
                "file (/etc/default/irqbalance) and restart it, or stop it",
            )
        return {"pid": pid, "banned": format_cpulist(exclusive)}, ()

    def _send(self, pid: int, command: str) -> None:
        path = self.run / "irqbalance" / f"irqbalance{pid}.sock"
        address: str | bytes = str(path) if path.exists() else f"\0irqbalance{pid}.sock".encode()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(2.0)
            sock.connect(address)
            # irqbalance accepts commands only from root, and learns who we are from these credentials.
            creds = struct.pack("3i", os.getpid(), os.getuid(), os.getgid())
            sock.sendmsg([command.encode()], [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, creds)])


__all__ = [
    "UNIT_SUFFIXES",
    "CgroupSiblings",
    "Interrupts",
    "IrqBalance",
    "ProcTasks",
    "Workqueue",
    "format_mask",
    "interrupt_counts",
    "interrupt_names",
    "parse_mask",
    "parse_stat",
    "systemctl_write",
    "systemd_owns_cgroups",
]
