"""Host partitioning as the slot manager sees it: one collaborator, told the exclusive CPUs whenever
they change, that also measures foreign CPU time and knows each CPU's interrupt load.

:class:`HostPartitioning` is the seam (tests plug a fake in); :class:`KernelHostPartitioning` is
the real one: a :class:`~nodeagent.isolation.host.HostPartitioner` (None when partitioning is off),
a periodic sweep thread, a :class:`~nodeagent.isolation.foreign.ForeignCpuMeter` and the per-CPU
interrupt counts placement may prefer quiet CPUs by. A failed pass never fails the slot operation
that caused it: the slot's own cpuset is in place either way; the failure is logged and shown in
``status()`` (``GET /v1/node``), and the next sweep tries again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from nodeagent.cgroups import CgroupHost, open_manager
from nodeagent.cpulist import format_cpulist
from nodeagent.devices.cpu import discover_cpu_topology
from nodeagent.errors import NodeAgentError
from nodeagent.isolation.cpus import CpuLayout
from nodeagent.isolation.foreign import ForeignCpu, ForeignCpuMeter
from nodeagent.isolation.host import (
    PARTS,
    HostBackend,
    HostPartitioner,
    HostReport,
    Notifier,
    Part,
    RecordFile,
)
from nodeagent.isolation.host_kernel import (
    CgroupSiblings,
    Interrupts,
    IrqBalance,
    ProcTasks,
    Workqueue,
    interrupt_counts,
    systemd_owns_cgroups,
)
from nodeagent.kernelfs import Procfs, Sysfs

log = logging.getLogger("nodeagent.host")

RECORD_NAME = "host-partition.json"


class HostPartitioning(Protocol):
    def partition(self, exclusive: frozenset[int]) -> None:
        """The exclusive CPUs are now ``exclusive``: confine (or put back) the rest of the host."""
        ...

    def foreign_cpu(self, slot_id: str, cpus: frozenset[int], cgroup: str | None) -> ForeignCpu | None:
        """CPU time others spent on a guaranteed slot's CPUs; None where it cannot be measured."""
        ...

    def slot_released(self, slot_id: str) -> None:
        """Forget what was kept for measuring the slot."""
        ...

    def irq_load(self) -> Mapping[int, int] | None:
        """Device interrupts served per CPU (placement prefers quiet CPUs); None when unknown."""
        ...

    def status(self) -> dict[str, Any]:
        """Mode, parts, the last pass's report and any failure (for GET /v1/node and the doctor)."""
        ...

    def start(self) -> None:
        """Start the periodic sweep."""
        ...

    def close(self, *, exclusive_held: bool) -> None:
        """Stop the sweep; put the host back unless exclusive CPUs are still held."""
        ...


class KernelHostPartitioning:
    """:class:`HostPartitioning` on this host's /proc, /sys and cgroups."""

    def __init__(
        self,
        partitioner: HostPartitioner | None,
        *,
        cgroups: CgroupHost | None,
        meter: ForeignCpuMeter | None = None,
        proc: Path = Path("/proc"),
        sweep_seconds: float = 10.0,
        irq_refresh_seconds: float = 60.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.partitioner = partitioner
        self._cgroups = cgroups
        self._meter = meter or ForeignCpuMeter(proc)
        self._proc = proc
        self._sweep_seconds = sweep_seconds
        self._irq_refresh = irq_refresh_seconds
        self._monotonic = monotonic
        self._irq: tuple[float, dict[int, int]] | None = None
        self._error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- HostPartitioning --------------------------------------------------------------------------

    def partition(self, exclusive: frozenset[int]) -> None:
        if self.partitioner is None:
            return
        previous = self.partitioner.exclusive
        report = self._run(lambda p: p.apply(exclusive), "partition")
        if report is not None and previous != exclusive:
            self._log(report, "host partitioned" if exclusive else "host put back")

    def foreign_cpu(self, slot_id: str, cpus: frozenset[int], cgroup: str | None) -> ForeignCpu | None:
        if cgroup is None or self._cgroups is None or not cpus:
            return None
        try:
            usage = open_manager(self._cgroups, cgroup).stats().cpu_usage_ns
            if usage is None:
                return None
            return self._meter.measure(slot_id, cpus, usage)
        except NodeAgentError as err:
            log.debug("no foreign CPU figure", extra={"slot": slot_id, "reason": str(err)})
            return None

    def irq_load(self) -> Mapping[int, int] | None:
        now = self._monotonic()
        if self._irq is None or now - self._irq[0] >= self._irq_refresh:
            try:
                text = Procfs(self._proc).read_text("interrupts")
            except NodeAgentError:
                return None
            if text is None:
                return None
            self._irq = (now, interrupt_counts(text))
        return self._irq[1]

    def status(self) -> dict[str, Any]:
        p = self.partitioner
        if p is None:
            return {"mode": "off"}
        report = p.last
        return {
            "mode": "auto",
            "parts": [part for part in PARTS if part in p.parts],
            "active": bool(p.exclusive),
            "sweep_seconds": self._sweep_seconds,
            "last": None if report is None else report.to_dict(),
            "error": self._error,
        }

    def start(self) -> None:
        if self.partitioner is None or self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._sweep_loop, name="host-sweep", daemon=True)
        self._thread.start()

    def close(self, *, exclusive_held: bool) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        if self.partitioner is not None and not exclusive_held:
            report = self._run(lambda p: p.restore(), "restore")
            if report is not None and (report.moved or report.immovable):
                self._log(report, "host put back at shutdown")

    def slot_released(self, slot_id: str) -> None:
        self._meter.forget(slot_id)

    # -- internals ------------------------------------------------------------------------------

    def _sweep_loop(self) -> None:
        while not self._stop.wait(self._sweep_seconds):
            try:
                report = self._run(lambda p: p.sweep(), "sweep")
            except Exception:  # a bug in one pass must not end the sweeps for the agent's lifetime
                log.exception("host sweep crashed; the next one runs as planned")
                continue
            if report is not None and report.moved:
                self._log(report, "sweep confined what had moved back")

    def _run(self, step: Callable[[HostPartitioner], HostReport | None], what: str) -> HostReport | None:
        """One pass, its own report (None: nothing done, or it failed and the failure is kept)."""
        assert self.partitioner is not None
        try:
            report = step(self.partitioner)
        except (NodeAgentError, OSError) as err:
            # The slot's own cpuset holds either way; the host stays as it was, and the next sweep retries.
            self._error = f"{what}: {err}"
            log.warning("host partitioning failed", extra={"step": what, "reason": str(err)})
            return None
        self._error = None
        return report

    @staticmethod
    def _log(report: HostReport, message: str) -> None:
        log.info(message, extra={"host": report.to_dict()})


def build_host_partitioning(
    host: CgroupHost,
    *,
    enabled: bool,
    state_dir: Path,
    cgroup_parent: str,
    left_alone: Sequence[str] = (),
    parts: Collection[Part] = PARTS,
    sweep_seconds: float = 10.0,
    proc: Path = Path("/proc"),
    sys: Path = Path("/sys"),
    run: Path = Path("/run"),
    only: Callable[[int], bool] | None = None,
) -> KernelHostPartitioning:
    """The real collaborator for this host: the backends its cgroup mode calls for."""
    if not enabled:
        if (state_dir / RECORD_NAME).exists():
            # Turned off after it had confined the host: what the record names goes back now.
            leftover = host_partitioner(
                host,
                state_dir=state_dir,
                cgroup_parent=cgroup_parent,
                left_alone=left_alone,
                proc=proc,
                sys=sys,
                run=run,
            )
            report = leftover.restore()
            log.info("host put back: host partitioning is off", extra={"host": report.to_dict()})
        return KernelHostPartitioning(None, cgroups=host, proc=proc, sweep_seconds=sweep_seconds)
    return KernelHostPartitioning(
        host_partitioner(
            host,
            state_dir=state_dir,
            cgroup_parent=cgroup_parent,
            left_alone=left_alone,
            parts=parts,
            proc=proc,
            sys=sys,
            run=run,
            only=only,
        ),
        cgroups=host,
        proc=proc,
        sweep_seconds=sweep_seconds,
    )


def host_partitioner(
    host: CgroupHost,
    *,
    state_dir: Path,
    cgroup_parent: str,
    left_alone: Sequence[str] = (),
    parts: Collection[Part] = PARTS,
    proc: Path = Path("/proc"),
    sys: Path = Path("/sys"),
    run: Path = Path("/run"),
    only: Callable[[int], bool] | None = None,
) -> HostPartitioner:
    """A :class:`HostPartitioner` for this host. On cgroup v2 with the cpuset controller, processes
    are confined through the cgroups beside the agent's (systemd's AllowedCPUs= where systemd owns
    them), and only tasks in the root cgroup through their affinity; elsewhere (v1, hybrid) every
    task outside the slots through its affinity. ``left_alone``: cgroup subtrees kept as the slots
    are (the kubelet's pods while NRI places their containers)."""
    siblings: CgroupSiblings | None = None
    # ``only`` (a benchmark or test confining what it started) never touches other cgroups.
    if only is None and host.mode == "v2" and host.v2_mount is not None and "cpuset" in host.controllers:
        siblings = CgroupSiblings(
            host.v2_mount, cgroup_parent, left_alone=left_alone, systemd=systemd_owns_cgroups(proc, run)
        )
    tasks = ProcTasks(
        proc,
        slot_parent=cgroup_parent,
        left_alone=left_alone,
        covered=None if siblings is None else siblings.covers,
        only=only,
    )
    knobs: list[HostBackend] = [Interrupts(proc), Workqueue(sys)]
    if siblings is not None:
        knobs.append(siblings)
    notifiers: list[Notifier] = [IrqBalance(proc, run)]
    return HostPartitioner(
        lambda: CpuLayout.of(discover_cpu_topology(Sysfs(sys))).online,
        tasks,
        knobs,
        RecordFile(state_dir / RECORD_NAME),
        parts=parts,
        notifiers=notifiers,
    )


def describe(report: HostReport) -> str:
    """One line for logs and the doctor."""
    moved = ", ".join(f"{n} {kind}" for kind, n in sorted(report.moved.items())) or "nothing"
    return (
        f"exclusive CPUs {format_cpulist(report.exclusive) or 'none'}, "
        f"host on {format_cpulist(report.host_cpus)}; "
        f"moved {moved}; {len(report.immovable)} item(s) cannot move"
    )


__all__ = [
    "RECORD_NAME",
    "HostPartitioning",
    "KernelHostPartitioning",
    "build_host_partitioning",
    "describe",
    "host_partitioner",
]
