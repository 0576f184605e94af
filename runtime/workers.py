"""The runtime side as the agent's slot manager sees it: supervisors for slots, found again after a restart.

:class:`WorkerRuntime` is the seam (the manager's tests plug a fake in); :class:`KeeperRuntime`
is the real one: workers launched through the host keeper (keeper.py, reached through
keeper_client.py), one directory per slot under ``workers_dir``::

    <workers_dir>/<slot id>/view/       what the worker sees: slot.json (NODEAGENT_SLOT_FILE), its
                                        TMPDIR (tmp/) and, sandboxed, its HOME (home/)
    <workers_dir>/<slot id>/run/        the keeper's state file (how :meth:`readopt` finds the
                                        worker) and the worker's stdout/stderr FIFOs
    <workers_dir>/<slot id>/logs/       worker.log: stdout and stderr in one time-ordered stream
    <workers_dir>/<slot id>/probe/      the run directory and log of its exec probes
    <workers_dir>/../released-logs/<slot id>/   a released slot's logs/ and released.json, kept
                                        for [workers] log_retention_seconds

The keeper's own directory (socket, lock, log, custody links) is ``keeper_dir``, by default
``<workers_dir>/../keeper``.

Where a worker goes in the kernel comes from isolation's result for the slot (:class:`AppliedSlot`):
its cgroup.procs files, network namespace and OOM counter; None means the slot is not isolated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import itertools
import json
import logging
import os
import select
import shutil
import signal
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from nodeagent.cgroups import CgroupHost, CgroupManager, open_manager
from nodeagent.errors import WorkerError
from nodeagent.isolation.isolator import AppliedSlot
from nodeagent.runtime.adopt import resume_supervision
from nodeagent.runtime.container import (
    CONTAINERS_CGROUP,
    WORKER_CGROUP,
    ContainerLauncher,
    PodmanConfig,
    container_launch_spec,
    container_slots,
    exec_argv,
    init_path,
    remove_container,
    run_argv,
)
from nodeagent.runtime.env import SlotDescription
from nodeagent.runtime.keeper_client import KeeperClient
from nodeagent.runtime.launch import SlotBinding, build_launch_request
from nodeagent.runtime.launch_request import LaunchRequest
from nodeagent.runtime.logs import LogLine, read_log
from nodeagent.runtime.process import ExitRecord, ProcessIdentity, WorkerProcess
from nodeagent.runtime.sandbox.spec import SandboxSpec
from nodeagent.runtime.supervisor import Launcher, SlotCgroup, Supervisor, WorkerHandle
from nodeagent.runtime.worker_kind import CONTAINER, PROCESS, WorkerKind, kind_of
from nodeagent.schema.worker import Probe, WorkerSpec

log = logging.getLogger("nodeagent.runtime")

#: What a released slot's kept logs say about it (id, name, released_at).
RELEASED_RECORD = "released.json"
#: An exec probe's output is kept small: its last 64 KiB, in one rotation.
PROBE_LOG_BYTES = 64 * 1024
#: After killing a probe that overran its timeout, how long to wait for its record.
PROBE_KILL_WAIT_SECONDS = 5.0


class Readoption(enum.StrEnum):
    """What :meth:`WorkerRuntime.readopt` found of a slot's last worker."""

    ADOPTED = "adopted"  #: alive, and now supervised again
    EXITED = "exited"  #: ended while the agent was away; its restart policy has been applied
    NONE = "none"  #: nothing was ever launched for the slot


class WorkerRuntime(Protocol):
    def supervisor(
        self,
        slot: SlotDescription,
        applied: AppliedSlot | None,
        spec: WorkerSpec,
        sandbox: SandboxSpec | None = None,
    ) -> Supervisor:
        """A supervisor (not started) for ``spec`` in ``slot``, which isolation built as ``applied``;
        its worker (and its exec probes) run in ``sandbox`` when given."""
        ...

    def readopt(self, slot_id: str, supervisor: Supervisor) -> Readoption:
        """Resume the worker last launched for ``slot_id`` into ``supervisor``."""
        ...

    def logs(self, slot_id: str, lines: int) -> list[str]:
        """The last ``lines`` lines of the slot's worker output, stdout and stderr in time order,
        stderr lines marked ``[stderr] ``."""
        ...

    def log_lines(self, slot_id: str, lines: int, *, complete_only: bool = False) -> list[LogLine]:
        """The same lines with their stream and time; also of a released slot whose logs are kept.
        NotFound when there are none."""
        ...

    def discard(
        self,
        slot_id: str,
        keep_logs_as: str | None = None,
        last_word: str | None = None,
        *,
        kind: WorkerKind = PROCESS,
    ) -> None:
        """The slot is gone: remove its worker directory (and, for a slot allocated for a ``kind``
        that needs a container runtime, its container); ``keep_logs_as`` (its name): keep its
        logs among the released ones (:meth:`released_logs`) until :meth:`prune_released`, with
        ``last_word`` (the agent's last word on its worker), also when the worker never wrote
        anything (it never launched)."""
        ...

    def released_logs(self, key: str) -> str | None:
        """The slot id of the newest kept logs of a released slot with this id or name."""
        ...

    def released_word(self, slot_id: str) -> str | None:
        """The agent's last word on a released slot's worker, kept with its logs."""
        ...

    def prune_released(self, before: float) -> list[str]:
        """Remove kept logs of slots released before ``before`` (Unix time); their slot ids."""
        ...

    def reap(self, keep: Iterable[str]) -> list[str]:
        """Remove the worker directories of slots other than ``keep`` (what a release the agent did
        not finish left behind: its row went, the directory did not); their slot ids."""
        ...

    def close(self) -> None: ...


def slot_binding(applied: AppliedSlot | None) -> SlotBinding:
    """Where a worker of the slot must go: its cgroups, network namespace and OOM counter."""
    if applied is None:
        return SlotBinding(cgroup_procs=())
    return SlotBinding(
        cgroup_procs=applied.procs_files,
        netns=applied.netns_path,
        oom_events=applied.oom_events,
        oom_score_adj=applied.oom_score_adj,
    )


class ManagedCgroup:
    """Supervision's view of a slot's cgroup (:class:`SlotCgroup`) over a cgroups manager."""

    __slots__ = ("_manager",)  # one per slot

    def __init__(self, manager: CgroupManager) -> None:
        self._manager = manager

    def kill_all(self, timeout: float) -> None:
        if self._manager.exists():
            self._manager.kill(timeout)

    def signal_all(self, sig: int, but: int | None = None) -> None:
        for pid in self.pids():
            if pid != but:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)

    def oom_kill_count(self) -> int:
        if not self._manager.exists():
            return 0
        return self._manager.oom_events().oom_kill or 0

    def pids(self) -> list[int]:
        return self._manager.subtree_pids() if self._manager.exists() else []


class NoCgroup:
    """A slot without a cgroup (the agent runs unisolated): nothing to kill or count."""

    def kill_all(self, timeout: float) -> None:
        return None

    def signal_all(self, sig: int, but: int | None = None) -> None:
        return None  # no cgroup to find them by: the main process alone gets the stop signal

    def oom_kill_count(self) -> int:
        return 0

    def pids(self) -> list[int]:
        return []


class SlotExecProbe:
    """Exec probes run where their worker runs, never as the agent: launched through the keeper
    like a worker (a pre-armed child, one request), into the slot's cgroups and network namespace,
    as the worker's uid with its capabilities and seccomp filter, and inside the worker's own
    namespaces (setns through the worker's pidfd: its private /tmp, /dev, /proc and hidden paths;
    its pid namespace for a root worker). The exit status is the result; a probe still running at
    its timeout is killed with its process group. Its output goes to ``<dir>/logs`` (small,
    rotated), not to the worker's log.

    Why not fork and setns from the agent: the agent is multi-threaded and never forks Python code
    (runtime.md); the keeper's children already know how to enter a slot, and the keeper's custody
    gives the probe's exit status and ends its tree, also if the agent dies mid-probe."""

    # One per worker, probes or not: its directory is kept as the text the requests carry.
    __slots__ = ("_dir", "_keeper", "_numbers", "_prefix", "_template")

    def __init__(
        self,
        template: LaunchRequest,
        keeper: KeeperClient,
        directory: str | os.PathLike[str],
        prefix: tuple[str, ...] = (),
    ) -> None:
        """``prefix``: put before the probe's argv (``podman exec <container>`` for a container
        worker, whose namespaces are the container's, not a sandbox the keeper can join)."""
        self._template = template
        self._keeper = keeper
        self._dir = os.fspath(directory)
        self._prefix = prefix
        self._numbers = itertools.count(1)

    def __call__(self, probe: Probe, handle: WorkerHandle) -> bool:
        identity = getattr(handle, "identity", None)
        join = None
        if self._template.sandbox is not None:
            if not isinstance(identity, ProcessIdentity):
                return False  # no verified process to join: the probe cannot run where it must
            join = (identity.pid, identity.start_time)
        req = dataclasses.replace(
            self._template,
            launch_id=f"{self._template.launch_id}-probe-{next(self._numbers)}",
            argv=(*self._prefix, *probe.argv),
            run_dir=os.path.join(self._dir, "run"),
            log_dir=os.path.join(self._dir, "logs"),
            join=join,
            end_slot_on_exit=False,
            stop_grace_seconds=0.0,
            log_max_bytes=PROBE_LOG_BYTES,
            log_backups=1,
        )
        try:
            process = self._keeper.launch(req)
        except WorkerError:
            return False
        try:
            record = _wait_for_record(process, probe.timeout_seconds)
            if record is None:
                process.send_signal(signal.SIGKILL)
                record = _wait_for_record(process, PROBE_KILL_WAIT_SECONDS)
            return record is not None and record.code == 0
        finally:
            process.close()


def _wait_for_record(process: WorkerProcess, timeout: float) -> ExitRecord | None:
    deadline = time.monotonic() + timeout
    while True:
        record = process.poll()
        if record is not None:
            return record
        left = deadline - time.monotonic()
        fd = process.exit_fd
        if left <= 0 or fd is None:
            return None
        select.select([fd], [], [], left)


class KeeperRuntime:
    """The real :class:`WorkerRuntime` (see the module docstring for the directory layout)."""

    def __init__(
        self,
        workers_dir: Path,
        host: CgroupHost | None,
        keeper: KeeperClient | None = None,
        podman: PodmanConfig | None = None,
        *,
        log_reserve_bytes: int = 0,
    ) -> None:
        """``keeper``: the connection to the host keeper; by default one for ``<workers_dir>/../keeper``,
        which connects (starting the keeper if none runs) at the first launch or re-adoption.
        ``podman``: how container workers are run (runtime/container.py). ``log_reserve_bytes``:
        free space the workers' logs leave on the state file system ([state] reserve)."""
        self._dir = workers_dir
        #: Logs of released slots, kept for [workers] log_retention_seconds.
        self._released = workers_dir.parent / "released-logs"
        self._host = host
        self._keeper = keeper or KeeperClient(workers_dir.parent / "keeper")
        self._podman = podman or PodmanConfig()
        self._log_reserve = log_reserve_bytes

    def supervisor(
        self,
        slot: SlotDescription,
        applied: AppliedSlot | None,
        spec: WorkerSpec,
        sandbox: SandboxSpec | None = None,
    ) -> Supervisor:
        worker_dir = self._dir / slot.slot_id
        # A worker in its own network namespace listens on the slot's address, which the host
        # reaches over the slot's veth; 127.0.0.1 here would be the host's loopback, not the slot's.
        network = applied.network if applied is not None else None
        probe_host = str(network.slot_address) if network is not None else "127.0.0.1"
        build = self._container_supervisor if kind_of(spec) is CONTAINER else self._process_supervisor
        return build(
            slot=slot,
            applied=applied,
            spec=spec,
            sandbox=sandbox,
            worker_dir=worker_dir,
            probe_host=probe_host,
        )

    def _process_supervisor(
        self,
        *,
        slot: SlotDescription,
        applied: AppliedSlot | None,
        spec: WorkerSpec,
        sandbox: SandboxSpec | None,
        worker_dir: Path,
        probe_host: str,
    ) -> Supervisor:
        """The keeper launches the worker, in ``sandbox`` when given."""
        binding = slot_binding(applied)
        if self._has_worker_leaf(applied):
            # A slot allocated for a container worker on v2 (below): its own cgroup holds no process.
            binding = dataclasses.replace(binding, cgroup_leaf=WORKER_CGROUP)
        template = build_launch_request(
            spec, slot, binding, worker_dir, sandbox, log_reserve_bytes=self._log_reserve
        )
        return Supervisor(
            spec,
            template,
            self._keeper,
            self._cgroup(applied),
            probe_host=probe_host,
            exec_probe=SlotExecProbe(
                template, self._keeper, os.path.join(os.path.dirname(template.run_dir), "probe")
            ),
        )

    def _container_supervisor(
        self,
        *,
        slot: SlotDescription,
        applied: AppliedSlot | None,
        spec: WorkerSpec,
        sandbox: SandboxSpec | None,
        worker_dir: Path,
        probe_host: str,
    ) -> Supervisor:
        """``podman run`` is the worker (runtime/container.py): it runs as root without the keeper's
        sandbox (podman needs mounts and namespaces of its own); the container gets the sandbox's
        identity and capabilities instead."""
        assert spec.container is not None
        binding = slot_binding(applied)
        podman = self._podman.binary()
        parent = applied.cgroup if applied is not None else None
        prepare = None
        if applied is not None and self._host is not None and applied.cgroup_version == "v2":
            # v2 allows no process in a cgroup whose controllers are enabled for its children
            # ("no internal processes"): podman runs in a leaf of the slot, <slot>/worker, and its
            # container (and conmon) below another, <slot>/containers (docs/containers.md).
            binding = dataclasses.replace(binding, cgroup_leaf=WORKER_CGROUP)
            parent = f"{applied.cgroup}/{CONTAINERS_CGROUP}"
            prepare = self._leaves_maker(applied.cgroup)
        argv = run_argv(
            podman or self._podman.podman or "podman",
            self._podman,
            spec,
            spec.container,
            slot_id=slot.slot_id,
            cgroup=parent,
            sandbox=sandbox,
            init=init_path(),
        )
        template = build_launch_request(
            container_launch_spec(spec, argv),
            slot,
            binding,
            worker_dir,
            None,
            log_reserve_bytes=self._log_reserve,
        )
        launcher: Launcher = ContainerLauncher(
            self._keeper, podman, self._podman, spec.container.image, prepare=prepare
        )
        prefix = exec_argv(podman or "podman", self._podman, slot.slot_id, ())
        return Supervisor(
            spec,
            template,
            launcher,
            self._cgroup(applied),
            probe_host=probe_host,
            exec_probe=SlotExecProbe(template, self._keeper, worker_dir / "probe", prefix),
        )

    def _has_worker_leaf(self, applied: AppliedSlot | None) -> bool:
        """The slot is a v2 slot made ready for a container worker: its worker runs in a leaf."""
        if applied is None or self._host is None or applied.cgroup_version != "v2":
            return False
        return open_manager(self._host, f"{applied.cgroup}/{WORKER_CGROUP}").exists()

    def _leaves_maker(self, cgroup: str) -> Callable[[], None]:
        host = self._host
        assert host is not None

        def make() -> None:
            # Creating them enables the slot's controllers for its children (cgroups/v2.py), which
            # the kernel refuses while a process sits in the slot's cgroup itself (EBUSY).
            for leaf in (WORKER_CGROUP, CONTAINERS_CGROUP):
                manager = open_manager(host, f"{cgroup}/{leaf}")
                if not manager.exists():
                    manager.create()

        return make

    def _cgroup(self, applied: AppliedSlot | None) -> SlotCgroup:
        if applied is None or self._host is None:
            return NoCgroup()
        return ManagedCgroup(open_manager(self._host, applied.cgroup))

    def readopt(self, slot_id: str, supervisor: Supervisor) -> Readoption:
        found = resume_supervision(supervisor, self._dir / slot_id / "run", self._keeper)
        if found.process is not None:
            return Readoption.ADOPTED
        return Readoption.EXITED if found.exit is not None else Readoption.NONE

    def logs(self, slot_id: str, lines: int) -> list[str]:
        return [line.render() for line in self.log_lines(slot_id, lines)]

    def log_lines(self, slot_id: str, lines: int, *, complete_only: bool = False) -> list[LogLine]:
        live = self._dir / slot_id / "logs"
        where = live if live.is_dir() else self._released / slot_id / "logs"
        return read_log(where, lines, complete_only=complete_only)

    def discard(
        self,
        slot_id: str,
        keep_logs_as: str | None = None,
        last_word: str | None = None,
        *,
        kind: WorkerKind = PROCESS,
    ) -> None:
        if kind.needs_container_runtime:
            # Its container normally went with its worker (--rm); one whose podman was killed is
            # still in podman's store.
            self._remove_containers([slot_id])
        logs = self._dir / slot_id / "logs"
        if keep_logs_as is not None and (logs.is_dir() or last_word):
            kept = self._released / slot_id
            try:
                self._released.mkdir(exist_ok=True, mode=0o700)
                kept.mkdir(exist_ok=True, mode=0o700)
                shutil.rmtree(kept / "logs", ignore_errors=True)
                if logs.is_dir():
                    os.replace(logs, kept / "logs")
                else:  # it never launched: the agent's word on why is all there is to keep
                    (kept / "logs").mkdir(mode=0o700)
                record = {
                    "id": slot_id,
                    "name": keep_logs_as,
                    "released_at": time.time(),
                    "last_word": last_word,
                }
                (kept / RELEASED_RECORD).write_text(json.dumps(record) + "\n")
            except OSError as err:  # the release goes on; only the kept copy is lost
                log.warning("worker logs not kept", extra={"slot": slot_id, "reason": str(err)})
        shutil.rmtree(self._dir / slot_id, ignore_errors=True)

    def _released_records(self) -> list[dict[str, Any]]:
        found = []
        if self._released.is_dir():
            for kept in self._released.iterdir():
                try:
                    record = json.loads((kept / RELEASED_RECORD).read_text())
                except (OSError, ValueError):
                    record = {"id": kept.name, "name": None, "released_at": 0.0}  # half-written: oldest
                if isinstance(record, dict):
                    found.append(record)
        return found

    def released_word(self, slot_id: str) -> str | None:
        try:
            record = json.loads((self._released / slot_id / RELEASED_RECORD).read_text())
        except (OSError, ValueError):
            return None
        word = record.get("last_word") if isinstance(record, dict) else None
        return word if isinstance(word, str) and word else None

    def released_logs(self, key: str) -> str | None:
        matches = [r for r in self._released_records() if key in (r.get("id"), r.get("name"))]
        if not matches:
            return None
        return str(max(matches, key=lambda r: float(r.get("released_at") or 0.0))["id"])

    def prune_released(self, before: float) -> list[str]:
        gone = []
        for record in self._released_records():
            if float(record.get("released_at") or 0.0) < before:
                shutil.rmtree(self._released / str(record["id"]), ignore_errors=True)
                gone.append(str(record["id"]))
        return gone

    def reap(self, keep: Iterable[str]) -> list[str]:
        kept = set(keep)
        try:
            found = [entry.name for entry in self._dir.iterdir() if entry.is_dir() and not entry.is_symlink()]
        except FileNotFoundError:
            return []
        gone = sorted(name for name in found if name not in kept)
        if gone:
            # Slots nobody knows any more: their kind is unknown too, so ask podman (once) which
            # of them left a container behind.
            self._remove_containers(self._leftover_containers(gone))
        for slot_id in gone:
            self.discard(slot_id)
        return gone

    def _leftover_containers(self, slot_ids: Iterable[str]) -> list[str]:
        podman = self._podman.binary()
        if podman is None:
            return []
        try:
            present = set(container_slots(podman, self._podman))
        except WorkerError as err:
            log.warning("containers of leftover slots not looked for", extra={"reason": str(err)})
            return []
        return [slot_id for slot_id in slot_ids if slot_id in present]

    def _remove_containers(self, slot_ids: Iterable[str]) -> None:
        podman = self._podman.binary()
        if podman is None:
            return
        for slot_id in slot_ids:
            try:
                remove_container(podman, self._podman, slot_id)
            except WorkerError as err:
                # The slot is gone already; a container left in podman's store holds nothing of
                # it (its cgroups went with the slot's) and --replace takes its name next time.
                log.warning("container not removed", extra={"slot": slot_id, "reason": str(err)})

    def close(self) -> None:
        # The keeper and its workers live on; the next agent re-attaches to them.
        self._keeper.close()


__all__ = [
    "KeeperRuntime",
    "ManagedCgroup",
    "NoCgroup",
    "Readoption",
    "SlotExecProbe",
    "WorkerRuntime",
    "slot_binding",
]
