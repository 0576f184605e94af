"""The host keeper's custody of its workers: their output, the end of their trees, their exit
records, and finding them again after a keeper was killed.

A mixin of :class:`~nodeagent.runtime.keeper.Keeper` (one process, one thread, one event loop):
the keeper's side that faces the agent (its socket, arming and launching children) lives in
keeper.py; what it does for workers once they run lives here. See keeper.py for the whole design.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from nodeagent.errors import WorkerError
from nodeagent.runtime.logs import LogStream
from nodeagent.runtime.process import (
    ORPHAN_GRACE_SECONDS,
    STOP_REQUESTED,
    ExitRecord,
    ProcessIdentity,
    WorkerState,
    fd_fired,
    open_verified_pidfd,
    read_oom_kills,
    read_state,
    write_state,
)

#: After a worker's record is final, how long to keep copying output its FIFOs still deliver.
DRAIN_SECONDS = 2.0
#: After SIGKILL, how long to wait for a worker's tree to leave its cgroups before recording anyway.
KILL_WAIT_SECONDS = 5.0
#: Intervals between looks at a worker's cgroups while its tree is being ended.
_TREE_CHECKS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.25)
READ_SIZE = 64 * 1024
IO_DIR = "io"
INDEX_DIR = "workers"


def log(message: str) -> None:
    """One line to keeper.log (the keeper's stderr)."""
    sys.stderr.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} keeper[{os.getpid()}] {message}\n")
    sys.stderr.flush()


def unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class KeptWorker:
    """A worker in the keeper's custody."""

    __slots__ = (
        "custody",
        "exited_at",
        "fifos",
        "finishing",
        "give_up_at",
        "identity",
        "is_child",
        "keeper",
        "kill_at",
        "killed",
        "launch_id",
        "lost",
        "notices",
        "pidfd",
        "recorded",
        "run_dir",
        "started_at",
        "status",
        "streams",
        "tree_check",
    )

    def __init__(self, state: WorkerState, run_dir: Path, *, is_child: bool, notices: list[int]) -> None:
        self.identity = state.worker
        self.launch_id = state.launch_id
        self.keeper = state.keeper
        self.started_at = state.started_at
        self.custody = state.custody
        self.run_dir = Path(os.path.realpath(run_dir))
        self.is_child = is_child
        #: A worker that is not our child: its pidfd, how we learn that it ended (or, for a worker
        #: still kept by a per-worker keeper of an earlier nodeagent, that keeper's pidfd).
        self.pidfd = -1
        #: Write ends of notice pipes whose read ends agents hold; closed once the record is final.
        #: (We keep no read end: an agent's epoll forgets a descriptor only when nobody else holds
        #: its open file description.)
        self.notices = notices
        self.recorded = False
        self.streams: dict[int, str] = {}  # open FIFO read end -> "stdout" / "stderr"
        self.fifos: list[tuple[str, int, int]] = []  # (path, st_dev, st_ino) of the FIFOs we read
        self.status: int | None = None
        self.exited_at = 0.0
        self.lost = False
        self.finishing = False
        self.kill_at = self.give_up_at = 0.0
        self.killed = False
        self.tree_check = 0

    @property
    def final(self) -> bool:
        return self.recorded

    def state(self, record: ExitRecord | None = None) -> WorkerState:
        return WorkerState(self.launch_id, self.identity, self.keeper, self.started_at, record, self.custody)


def _subtree_procs(procs: str) -> set[int]:
    """Every task in the cgroup of ``procs`` and in its child cgroups (a container worker's
    processes live in cgroups podman makes below the slot's: ``<slot>/libpod-<id>``, ``<slot>/conmon``)."""
    pids: set[int] = set()
    for directory, _subdirs, files in os.walk(os.path.dirname(procs)):
        if "cgroup.procs" not in files:
            continue
        try:
            with open(os.path.join(directory, "cgroup.procs")) as handle:
                pids.update(int(line) for line in handle.read().split())
        except OSError:
            continue  # gone meanwhile: nothing of it left there
    return pids


class WorkerCustody:
    """What the keeper does for the workers in its custody (mixed into Keeper, which provides the
    event loop: ``_watch``, ``_unwatch``, ``_after``)."""

    dir: Path
    identity: ProcessIdentity
    _workers: dict[ProcessIdentity, KeptWorker]
    _child_workers: dict[int, KeptWorker]
    #: log dir -> (its stream, or None when it cannot be written; workers using it)
    _logs: dict[str, tuple[LogStream | None, int]]

    def _watch(self, fd: int, handler: Callable[[], None]) -> None:
        raise NotImplementedError

    def _unwatch(self, fd: int) -> None:
        raise NotImplementedError

    def _after(self, seconds: float, action: Callable[[], None]) -> None:
        raise NotImplementedError

    def _attach_output(self, worker: KeptWorker, ends: dict[int, str]) -> None:
        assert worker.custody is not None
        custody = worker.custody
        if custody.log_dir in self._logs:
            stream, users = self._logs[custody.log_dir]
        else:
            users = 0
            try:
                stream = LogStream(
                    Path(custody.log_dir),
                    custody.log_max_bytes,
                    custody.log_backups,
                    reserve_bytes=custody.log_reserve_bytes,
                )
            except OSError as err:
                log(
                    f"cannot open the log in {custody.log_dir}: {err}; the output of worker "
                    f"{worker.identity.pid} is read and dropped"
                )
                stream = None
        self._logs[custody.log_dir] = (stream, users + 1)
        for end, name in ends.items():
            worker.streams[end] = name
            info = os.fstat(end)
            path = custody.stdout_fifo if name == "stdout" else custody.stderr_fifo
            worker.fifos.append((path, info.st_dev, info.st_ino))
            self._watch(end, functools.partial(self._pump, worker, end))

    def _pump(self, worker: KeptWorker, end: int) -> None:
        try:
            data = os.read(end, READ_SIZE)
        except BlockingIOError:
            return
        if data:
            self._pump_data(worker, end, data)
        else:
            self._close_output(worker, end)

    def _pump_data(self, worker: KeptWorker, end: int, data: bytes) -> None:
        assert worker.custody is not None
        stream = self._logs[worker.custody.log_dir][0]
        if stream is None:
            return
        try:
            stream.write(worker.streams[end], data)
        except OSError as err:
            # Keep reading whatever happens to the file: a worker must never wait on us.
            log(f"cannot write the log of {worker.run_dir}: {err}")

    def _close_output(self, worker: KeptWorker, end: int) -> None:
        self._unwatch(end)
        os.close(end)
        del worker.streams[end]
        if not worker.streams:
            self._release_log(worker)
            if worker.final:
                self._forget(worker)

    def _release_log(self, worker: KeptWorker) -> None:
        if worker.custody is None or worker.custody.log_dir not in self._logs:
            return
        stream, users = self._logs[worker.custody.log_dir]
        if users <= 1:
            if stream is not None:
                stream.close()
            del self._logs[worker.custody.log_dir]
        else:
            self._logs[worker.custody.log_dir] = (stream, users - 1)

    def _link(self, worker: KeptWorker) -> None:
        link = self.dir / INDEX_DIR / f"{worker.identity.pid}-{worker.identity.start_time}"
        try:
            if not link.is_symlink():
                link.symlink_to(worker.run_dir)
        except OSError as err:
            log(f"cannot link {link} to {worker.run_dir}: {err}; a later keeper will not find it by itself")

    def _record(self, worker: KeptWorker, record: ExitRecord | None = None) -> None:
        try:
            write_state(worker.run_dir, worker.state(record), durable=record is not None)
        except OSError as err:
            log(f"cannot write the state of worker {worker.identity.pid} in {worker.run_dir}: {err}")

    def _on_pidfd(self, worker: KeptWorker) -> None:
        """A worker that is not our child ended (we watch it by pidfd since we re-adopted it)."""
        if not fd_fired(worker.pidfd):
            return  # an event meant for an earlier descriptor of that number, closed in this batch
        self._unwatch(worker.pidfd)
        os.close(worker.pidfd)
        worker.pidfd = -1
        self._main_exited(worker, None)

    def _main_exited(self, worker: KeptWorker, status: int | None) -> None:
        """The worker's main process ended: end what is left of its tree, then record."""
        worker.status = status
        worker.exited_at = time.time()
        worker.finishing = True
        self._end_tree(worker)

    def _tree(self, worker: KeptWorker) -> set[int]:
        """What is left of the worker's tree: every task in its slot's cgroups, or (a slot without
        cgroups) the worker's process group, which the pid keeps naming while anyone is in it."""
        custody = worker.custody
        if custody is not None and custody.cgroup_procs:
            pids: set[int] = set()
            for procs in custody.cgroup_procs:
                pids.update(_subtree_procs(procs))
            pids.discard(os.getpid())
            return pids
        if worker.lost:
            return set()  # it ended long ago, maybe: its pid (and group id) may be a stranger's now
        try:
            os.killpg(worker.identity.pid, 0)
        except (ProcessLookupError, PermissionError):
            return set()
        return {-worker.identity.pid}  # negative: the process group

    @staticmethod
    def _stop_was_asked(worker: KeptWorker) -> bool:
        """Whether the agent asked this launch to stop (runtime.process.STOP_REQUESTED)."""
        try:
            return (worker.run_dir / STOP_REQUESTED).read_text() == worker.launch_id
        except OSError:
            return False

    @staticmethod
    def _signal(pids: set[int], sig: int) -> None:
        for pid in pids:
            try:
                if pid < 0:
                    os.killpg(-pid, sig)
                else:
                    os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def _end_tree(self, worker: KeptWorker) -> None:
        if worker.final:
            return
        pids = self._tree(worker)
        now = time.monotonic()
        if not pids:
            self._finalize(worker)
            return
        if worker.kill_at == 0.0:
            grace = worker.custody.stop_grace_seconds if worker.custody is not None else 30.0
            if not self._stop_was_asked(worker):
                grace = min(grace, ORPHAN_GRACE_SECONDS)
            worker.kill_at = now + grace
            self._signal(pids, signal.SIGTERM)
        elif not worker.killed and now >= worker.kill_at:
            worker.killed = True
            worker.give_up_at = now + KILL_WAIT_SECONDS
            self._signal(pids, signal.SIGKILL)
        elif worker.killed and now >= worker.give_up_at:
            log(f"worker {worker.identity.pid}'s tree ({sorted(pids)}) did not end after SIGKILL; recording")
            self._finalize(worker)
            return
        wait = _TREE_CHECKS[min(worker.tree_check, len(_TREE_CHECKS) - 1)]
        worker.tree_check += 1
        if not worker.killed:
            wait = min(wait, max(0.0, worker.kill_at - now))
        self._after(wait, lambda: self._end_tree(worker))

    def _finalize(self, worker: KeptWorker, *, write: bool = True) -> None:
        custody = worker.custody
        oom_kills = 0
        if custody is not None:
            oom_kills = max(0, read_oom_kills(custody.oom_events) - custody.oom_before)
        if worker.status is not None:
            record = ExitRecord.from_wait_status(
                worker.status, oom_kills=oom_kills, finished_at=worker.exited_at
            )
        elif worker.lost:
            record = ExitRecord.lost(worker.exited_at)
        else:
            record = ExitRecord.unknown(oom_kills=oom_kills, finished_at=worker.exited_at)
        if write:
            self._record(worker, record)
        unlink(str(self.dir / INDEX_DIR / f"{worker.identity.pid}-{worker.identity.start_time}"))
        # Last: this is what wakes the agent, which then reads the record just written.
        for end in worker.notices:
            os.close(end)
        worker.notices = []
        worker.recorded = True
        worker.finishing = False
        if worker.streams:
            self._after(DRAIN_SECONDS, lambda: self._drain(worker))
        else:
            self._forget(worker)

    def _drain(self, worker: KeptWorker) -> None:
        """Copy what the FIFOs still hold and stop reading (a writer that escaped the slot must not
        keep us reading forever)."""
        for end in list(worker.streams):
            while worker.streams.get(end) is not None:
                try:
                    data = os.read(end, READ_SIZE)
                except BlockingIOError:
                    data = b""
                if not data:
                    self._close_output(worker, end)
                    break
                self._pump_data(worker, end, data)

    def _forget(self, worker: KeptWorker) -> None:
        self._workers.pop(worker.identity, None)
        for path, dev, ino in worker.fifos:
            try:
                info = os.stat(path)
            except OSError:
                continue
            if (info.st_dev, info.st_ino) == (dev, ino):  # not a later worker's FIFO at that path
                unlink(path)

    # ------------------------------------------------------------------ re-adoption

    def _adopt(
        self, run_dir: Path, *, identity: ProcessIdentity | None = None, launch_id: str | None = None
    ) -> KeptWorker | None:
        """Take custody of the worker last launched from ``run_dir`` (not our child), if it still
        needs a keeper; None when its record is final or it is not the one asked for."""
        try:
            state = read_state(run_dir)
        except WorkerError as err:
            log(str(err))
            return None
        if state is None or state.exit is not None:
            return None
        if (identity is not None and state.worker != identity) or (
            launch_id is not None and state.launch_id != launch_id
        ):
            return None
        known = self._workers.get(state.worker)
        if known is not None:
            return known
        worker = KeptWorker(state, run_dir, is_child=False, notices=[])
        self._workers[worker.identity] = worker
        self._link(worker)
        if state.custody is None:
            # Started by an earlier nodeagent's per-worker keeper, which records its exit itself
            # while it lives: wait for that keeper, then look again.
            keeper_pidfd = open_verified_pidfd(state.keeper)
            if keeper_pidfd is not None and not fd_fired(keeper_pidfd):  # (a zombie has exited)
                worker.pidfd = keeper_pidfd
                self._watch(keeper_pidfd, lambda: self._on_legacy_keeper(worker))
                return worker
            if keeper_pidfd is not None:
                os.close(keeper_pidfd)
        else:
            ends = {}
            for path, name in ((state.custody.stdout_fifo, "stdout"), (state.custody.stderr_fifo, "stderr")):
                try:
                    ends[os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)] = name
                except OSError as err:
                    log(f"cannot reopen {path} of worker {worker.identity.pid}: {err}; output not carried")
            self._attach_output(worker, ends)
        pidfd = open_verified_pidfd(state.worker)
        if pidfd is None:
            # It ended while no keeper watched it (or its pid names a stranger now): nobody knows
            # how or when. Its tree is still ended before the record is final.
            worker.lost = True
            self._main_exited(worker, None)
        else:
            worker.pidfd = pidfd
            self._watch(pidfd, lambda: self._on_pidfd(worker))
        return worker

    def _on_legacy_keeper(self, worker: KeptWorker) -> None:
        """The earlier per-worker keeper is gone: its record is final, or the worker is ours now."""
        if not fd_fired(worker.pidfd):
            return
        self._unwatch(worker.pidfd)
        os.close(worker.pidfd)
        worker.pidfd = -1
        self._finalize(worker, write=False)  # wakes the agent, which asks again (watch)
        self._workers.pop(worker.identity, None)
        self._adopt(worker.run_dir, identity=worker.identity)

    def _adopt_all(self) -> int:
        adopted = 0
        for link in sorted((self.dir / INDEX_DIR).iterdir()):
            pid, _, start_time = link.name.partition("-")
            try:
                identity = ProcessIdentity(int(pid), int(start_time))
                run_dir = Path(os.readlink(link))
            except (ValueError, OSError):
                unlink(str(link))
                continue
            worker = self._adopt(run_dir, identity=identity)
            if worker is None:
                unlink(str(link))  # final, or the directory moved on to a later worker
            else:
                adopted += 1
        return adopted

    def _clean_io(self) -> None:
        """FIFOs of children that an earlier keeper armed and never launched."""
        used = {
            p
            for w in self._workers.values()
            if w.custody
            for p in (w.custody.stdout_fifo, w.custody.stderr_fifo)
        }
        for entry in (self.dir / IO_DIR).iterdir():
            if str(entry) not in used:
                unlink(str(entry))
