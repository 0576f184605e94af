"""The supervision loop: one thread that drives every slot's :class:`Supervisor`.

One epoll set holds every live worker's exit descriptor (the keeper's notice pipe, readable once the
worker's exit record is final, or the keeper died), so an idle loop makes no per-slot system call:
it wakes for an exit, for the earliest timed work (a probe, a stop deadline, a restart), or after
``tick_seconds`` at the latest, and then ticks only the supervisors concerned. Due times sit in a
heap; an entry superseded by a later schedule is skipped when it comes up (``_due`` holds the
current one per slot).

Probes run in a small pool of threads of their own (``probe_threads``), never on this thread
and never under the lock: a check that waits for its timeout (a server that accepts and does not
answer) holds up neither the other slots nor the API. A due probe is submitted at a tick; its
result pokes the loop (:meth:`SupervisionLoop.poke`), which ticks that slot again to record it.

The loop shares a lock with its owner (the agent's slot manager), so a tick never interleaves
with an allocate, a release or a stop of the same slot. What a tick learns goes to ``on_status``
(persist it; True when something changed) and, once per wake-up with changes, to ``on_change``.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import select
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from nodeagent.errors import NodeAgentError
from nodeagent.runtime.process import fd_fired
from nodeagent.runtime.supervisor import ALIVE_PHASES, Supervisor, WorkerStatus

log = logging.getLogger("nodeagent.supervision")


class SupervisionLoop:
    def __init__(
        self,
        lock: threading.RLock,
        on_status: Callable[[str, WorkerStatus], bool],
        on_change: Callable[[], None],
        *,
        tick_seconds: float = 0.5,
        probe_threads: int = 4,
    ) -> None:
        self._lock = lock
        self._probe_threads = probe_threads
        self._probes: ThreadPoolExecutor | None = None
        #: Slots whose probe finished, to tick at the next wake-up (written from probe threads).
        self._poked: set[str] = set()
        self._poke_lock = threading.Lock()
        self._on_status = on_status
        self._on_change = on_change
        self._tick_seconds = tick_seconds
        self._supervisors: dict[str, Supervisor] = {}
        self._due: dict[str, float] = {}
        self._agenda: list[tuple[float, int, str]] = []
        self._agenda_order = itertools.count()
        self._watch: select.epoll | None = None
        self._wake_fd = -1
        self._fd_slots: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ life cycle

    def open(self) -> None:
        """Create the epoll set (before supervisors are added, so their exit descriptors get armed)."""
        if self._watch is None:
            self._watch = select.epoll()
            self._wake_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
            self._watch.register(self._wake_fd, select.EPOLLIN)
            self._probes = ThreadPoolExecutor(self._probe_threads, thread_name_prefix="nodeagent-probe")

    def start(self) -> None:
        """Run the loop in its own thread."""
        self.open()
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="nodeagent-supervision", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop the thread (workers keep running: they outlive the agent)."""
        self._stop.set()
        if self._wake_fd >= 0:
            os.eventfd_write(self._wake_fd, 1)
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        if self._probes is not None:
            # Checks under way end by their own timeouts; nothing waits for their results any more.
            self._probes.shutdown(wait=False, cancel_futures=True)
            self._probes = None
        if self._watch is not None:
            self._watch.close()
            with self._poke_lock:  # a late probe result must not write to a closed (reused) fd
                fd, self._wake_fd = self._wake_fd, -1
            os.close(fd)
            self._watch = None

    # ------------------------------------------------------------------ membership (caller holds the lock)

    def add(self, slot_id: str, supervisor: Supervisor) -> None:
        """Supervise ``supervisor`` for ``slot_id`` from now on (replacing any previous one)."""
        self._supervisors[slot_id] = supervisor
        if self._probes is not None:
            supervisor.attach(self._probes, lambda: self.poke(slot_id))
        self.schedule(slot_id)

    def poke(self, slot_id: str) -> None:
        """Tick ``slot_id`` at the next wake-up, and wake the loop now (any thread; takes no lock the
        ticks hold)."""
        with self._poke_lock:
            self._poked.add(slot_id)
            if self._wake_fd >= 0:
                os.eventfd_write(self._wake_fd, 1)

    def remove(self, slot_id: str) -> Supervisor | None:
        """Stop supervising ``slot_id``; returns the supervisor it had."""
        self._due.pop(slot_id, None)
        return self._supervisors.pop(slot_id, None)

    def get(self, slot_id: str) -> Supervisor | None:
        return self._supervisors.get(slot_id)

    def items(self) -> Iterable[tuple[str, Supervisor]]:
        return list(self._supervisors.items())

    # ------------------------------------------------------------------ ticking

    def tick_all(self) -> None:
        """Advance every supervisor once and persist what changed (a full sweep)."""
        with self._lock:
            changed = False
            for slot_id in list(self._supervisors):
                changed |= self._tick(slot_id)
        if changed:
            self._on_change()

    def schedule(self, slot_id: str) -> None:
        """Put a supervisor on the agenda after anything touched it: arm its exit fd, note when it is due."""
        supervisor = self._supervisors.get(slot_id)
        if supervisor is None:
            return
        due_in = supervisor.due_in()
        fd = supervisor.exit_fd()
        if (fd is None or not self._watch_exit(fd, slot_id)) and supervisor.phase in ALIVE_PHASES:
            # Nothing will say when this worker exits (or it has, and its exit is still being
            # written down): poll it every tick, as a fixed-tick loop would.
            due_in = self._tick_seconds if due_in is None else min(due_in, self._tick_seconds)
        if due_in is None:
            self._due.pop(slot_id, None)
            return
        when = time.monotonic() + due_in
        self._due[slot_id] = when
        heapq.heappush(self._agenda, (when, next(self._agenda_order), slot_id))
        if self._wake_fd >= 0 and threading.current_thread() is not self._thread:
            # The loop may be asleep for up to a tick with an older agenda (a worker just launched:
            # its first readiness probe is due now, not at the next tick); the loop's own
            # scheduling happens before it computes its next wait and needs no wake-up.
            os.eventfd_write(self._wake_fd, 1)
        if len(self._agenda) > 2 * len(self._due) + 64:
            # Superseded entries are dropped as they come up; rescheduling far ahead of that
            # (full sweeps, long backoffs) would let them pile up, so rebuild from _due.
            self._agenda = [(t, next(self._agenda_order), s) for s, t in self._due.items()]
            heapq.heapify(self._agenda)

    def _tick(self, slot_id: str) -> bool:
        supervisor = self._supervisors[slot_id]
        changed = self._on_status(slot_id, supervisor.tick())
        self.schedule(slot_id)
        return changed

    def _run(self) -> None:
        watch = self._watch
        assert watch is not None
        while not self._stop.is_set():
            try:
                events = watch.poll(self._wait_seconds())
                self._tick_due([fd for fd, _ in events])
            except NodeAgentError as err:  # expected (a full disk, say): one line, no traceback
                log.warning("supervision tick failed: %s", err, extra={"code": err.code})
                self._stop.wait(self._tick_seconds)
            except Exception:  # the loop must survive any one bad tick; this one is a bug
                log.exception("supervision tick failed")
                self._stop.wait(self._tick_seconds)

    def _tick_due(self, fired: Iterable[int]) -> None:
        """Tick the supervisors whose worker exited (``fired`` exit fds) or whose timed work is due."""
        changed = False
        with self._lock:
            due: set[str] = set()
            for fd in fired:
                if fd == self._wake_fd:
                    with contextlib.suppress(BlockingIOError):
                        os.eventfd_read(fd)
                elif (slot_id := self._fd_slots.pop(fd, None)) is not None:
                    due.add(slot_id)
            with self._poke_lock:
                due |= self._poked
                self._poked.clear()
            now = time.monotonic()
            while self._agenda and self._agenda[0][0] <= now:
                when, _, slot_id = heapq.heappop(self._agenda)
                if self._due.get(slot_id) == when:
                    del self._due[slot_id]
                    due.add(slot_id)
            for slot_id in due:
                if slot_id in self._supervisors:
                    changed |= self._tick(slot_id)
        if changed:
            self._on_change()

    def _wait_seconds(self) -> float:
        with self._lock:
            while self._agenda and self._due.get(self._agenda[0][2]) != self._agenda[0][0]:
                heapq.heappop(self._agenda)  # superseded or released
            if not self._agenda:
                return self._tick_seconds
            return min(self._tick_seconds, max(0.0, self._agenda[0][0] - time.monotonic()))

    def _watch_exit(self, fd: int, slot_id: str) -> bool:
        """Arm a one-shot wake-up for this exit fd; False when it cannot serve (no loop, already fired)."""
        watch = self._watch
        if watch is None or fd_fired(fd):
            # A fired exit fd stays readable: armed, it would wake the loop again and again.
            return False
        self._fd_slots[fd] = slot_id
        flags = select.EPOLLIN | select.EPOLLONESHOT
        try:
            watch.register(fd, flags)
        except FileExistsError:
            watch.modify(fd, flags)  # one-shot: fired once, re-armed here
        except OSError:
            return False
        return True


__all__ = ["SupervisionLoop"]
