"""Supervising one slot's worker: restart policy with backoff, probes, graceful stop, exit causes.

The supervisor is a state machine driven by ``tick()``; it does no waiting of its own, so the
agent's loop (or a test with a fake clock) decides when time passes::

    starting ──ready──> running <──ready / not ready──> unready
       │                   │                               │
       └──── exit / liveness failure / stop() ─────────────┴──> stopping ──exit──> stopped
    exit ──policy says restart──> backoff (crashloop after repeated failures) ──delay──> starting
    exit ──policy says no──> exited (success) | failed

A worker is ``running`` only while its readiness probe passes. Stopping sends SIGTERM, waits the
grace period, then kills everything in the slot's cgroup; after any exit, whatever the worker left
behind in the slot (forked helpers) is killed too (the keeper has done so already, after the
worker's grace period, unless the slot has no cgroup), and a launch starts from an empty slot.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import logging
import signal
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, Protocol

from nodeagent.errors import WorkerError
from nodeagent.runtime.launch_request import LaunchRequest
from nodeagent.runtime.probes import ProbeResult, call_http, run_probe
from nodeagent.runtime.process import ExitRecord
from nodeagent.runtime.worker_kind import kind_of
from nodeagent.schema.worker import PreStop, Probe, ProbeKind, RestartPolicy, WorkerSpec

log = logging.getLogger("nodeagent.supervisor")

#: How long kill_all may take after the grace period (or after an exit, for leftovers).
KILL_TIMEOUT_SECONDS = 5.0


class SlotCgroup(Protocol):
    """What supervision needs from the slot's cgroup (the cgroups package provides the real one)."""

    def kill_all(self, timeout: float) -> None: ...

    def signal_all(self, sig: int, but: int | None = None) -> None:
        """Send ``sig`` to every process in the slot except ``but``."""
        ...

    def oom_kill_count(self) -> int: ...

    def pids(self) -> list[int]: ...


class WorkerHandle(Protocol):
    @property
    def pid(self) -> int: ...

    def poll(self, now: float | None = None) -> ExitRecord | None: ...

    def send_signal(self, sig: int) -> None: ...

    def close(self) -> None: ...


class Launcher(Protocol):
    def launch(self, req: LaunchRequest) -> WorkerHandle: ...


ProbeCheck = Callable[[Probe, str], "bool | ProbeResult"]
#: Runs an exec probe where the worker behind the handle runs (its slot, namespaces and uid).
ExecProbe = Callable[[Probe, WorkerHandle], "bool | ProbeResult"]

#: The longest a start-up probe waits between checks of a server whose answer is a definite no
#: (:attr:`ProbeResult.definite`: no such path, authentication asked, not HTTP): each such answer
#: in a row doubles the wait from startup_period_seconds (never past period_seconds), so a
#: misconfigured server's log gets about one request a second instead of twenty. "Not yet"
#: answers (connection refused, 503, not serving) keep the start-up period: a server is still
#: seen ready within startup_period_seconds of being so.
DEFINITE_BACKOFF_MAX_SECONDS = 1.0
#: Definite answers in a row before the back-off starts: a server may answer 404 for a moment
#: while it registers its model (TorchServe's management API does), and readiness right after
#: must still be seen within startup_period_seconds.
DEFINITE_GRACE_ANSWERS = 20


def as_result(outcome: bool | ProbeResult, probe: Probe) -> ProbeResult:
    """A check's outcome as a :class:`ProbeResult` (exec probes through the keeper say only yes or no)."""
    if isinstance(outcome, ProbeResult):
        return outcome
    detail = f"{probe.kind.value} probe " + ("passed" if outcome else "failed")
    return ProbeResult(outcome, False, detail, time.time())


class Phase(enum.StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    UNREADY = "unready"
    STOPPING = "stopping"
    BACKOFF = "backoff"
    CRASHLOOP = "crashloop"
    EXITED = "exited"
    FAILED = "failed"
    STOPPED = "stopped"


ALIVE_PHASES = frozenset({Phase.STARTING, Phase.RUNNING, Phase.UNREADY, Phase.STOPPING})
_WAITING = frozenset({Phase.BACKOFF, Phase.CRASHLOOP})


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential restart delay, as Kubernetes does it (its defaults are 10 s doubling to 300 s)."""

    initial_seconds: float = 1.0
    factor: float = 2.0
    max_seconds: float = 300.0
    #: A worker that stayed up this long has its failure count reset.
    reset_after_seconds: float = 600.0
    #: This many failures in a row is a crash loop (restarts continue, with the same backoff).
    crashloop_after: int = 3

    def delay(self, consecutive_failures: int) -> float:
        steps = max(0, consecutive_failures - 1)
        return float(min(self.max_seconds, self.initial_seconds * self.factor**steps))


#: Shared by every supervisor not given one of its own (it is frozen).
DEFAULT_BACKOFF = Backoff()


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    phase: Phase
    pid: int | None
    restarts: int
    consecutive_failures: int
    last_exit: ExitRecord | None
    next_restart_in: float | None
    message: str
    #: The readiness probe's last result (None: no probe, or none ran yet).
    last_probe: ProbeResult | None = None
    #: "probe": running means its readiness probe passed; "started": it has none, running means
    #: only that its process runs.
    ready_when: str = "started"

    def same_as(self, other: WorkerStatus) -> bool:
        """Equal but for the restart countdown, which changes every instant and is computed when read."""
        return dataclasses.replace(self, next_restart_in=None) == dataclasses.replace(
            other, next_restart_in=None
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "phase": str(self.phase),
            "pid": self.pid,
            "restarts": self.restarts,
            "consecutive_failures": self.consecutive_failures,
            "last_exit": None if self.last_exit is None else self.last_exit.to_json(),
            "next_restart_in": self.next_restart_in,
            "message": self.message,
            "last_probe": None if self.last_probe is None else self.last_probe.to_json(),
            "ready_when": self.ready_when,
        }

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> WorkerStatus:
        last_exit = body.get("last_exit")
        return cls(
            phase=Phase(body["phase"]),
            pid=body.get("pid"),
            restarts=int(body.get("restarts", 0)),
            consecutive_failures=int(body.get("consecutive_failures", 0)),
            last_exit=None if last_exit is None else ExitRecord.from_json(last_exit),
            next_restart_in=body.get("next_restart_in"),
            message=str(body.get("message", "")),
            last_probe=ProbeResult.from_json(body["last_probe"]) if body.get("last_probe") else None,
            ready_when=str(body.get("ready_when", "started")),
        )


class ProbeTracker:
    """Consecutive successes and failures of one probe, when it is next due, and the check under way
    when probes run off the supervision thread."""

    def __init__(self, probe: Probe, now: float, *, passing: bool, delay: bool = True) -> None:
        """``delay``: wait the probe's initial delay first (not for a worker found running after a
        restart of the agent: it is past its start, and its phase should be known at once)."""
        self.probe = probe
        self.next_due = now + (probe.initial_delay_seconds if delay else 0.0)
        self.passing = passing
        self.ever_passed = passing
        self._successes = 0
        self._failures = 0
        #: Definite "no" answers in a row before the probe ever passed (the back-off).
        self._definite_in_row = 0
        self.last: ProbeResult | None = None
        #: The check running in the probe pool, when there is one, and when it was submitted.
        self.pending: Future[ProbeResult] | None = None
        self.submitted = 0.0

    def due(self, now: float) -> bool:
        return self.pending is None and now >= self.next_due

    def record(self, result: ProbeResult, now: float, started: float | None = None) -> None:
        """Count one result; the next check is due a period after this one ``started`` (when it ran
        in the pool: the time it waited for a thread and for the loop does not stretch the period)."""
        ok = result.passed
        self.last = result
        period = self.probe.period_seconds
        self._definite_in_row = self._definite_in_row + 1 if result.definite else 0
        if not self.ever_passed and not ok:
            # Until it first passes, a probe runs often: the worker is running within about
            # startup_period_seconds of being ready rather than a full period later; less often
            # while the server's answer is a definite no (DEFINITE_BACKOFF_MAX_SECONDS).
            period = min(period, startup_interval(self.probe, self._definite_in_row))
        self.next_due = max(now, (now if started is None else started) + period)
        if ok:
            self._successes += 1
            self._failures = 0
            if self._successes >= self.probe.success_threshold:
                self.passing = self.ever_passed = True
        else:
            self._failures += 1
            self._successes = 0
            if self._failures >= self.probe.failure_threshold:
                self.passing = False


def startup_interval(probe: Probe, definite_in_row: int) -> float:
    """Seconds to the next start-up check after ``definite_in_row`` definite "no" answers in a row."""
    base = probe.startup_period_seconds
    beyond = definite_in_row - DEFINITE_GRACE_ANSWERS
    if beyond <= 0:
        return base
    doubled = base * (1 << min(beyond, 30))
    return max(base, min(DEFINITE_BACKOFF_MAX_SECONDS, doubled))


class Supervisor:
    """Keeps one slot's worker alive according to its spec."""

    # One per slot, with more attributes than CPython shares the keys of between instances (30):
    # without slots each carried a dict of its own, ~1.5 KB of the daemon's memory per slot.
    __slots__ = (
        "_backoff",
        "_cgroup",
        "_check",
        "_clock",
        "_exec_probe",
        "_executor",
        "_handle",
        "_killed_for",
        "_launch_numbers",
        "_launched_at",
        "_launcher",
        "_liveness",
        "_next_restart_at",
        "_oom_at_launch",
        "_pre_stop",
        "_pre_stop_until",
        "_probe_host",
        "_readiness",
        "_signal_at",
        "_signaled",
        "_stop_deadline",
        "_stop_requested",
        "_template",
        "_wake",
        "consecutive_failures",
        "last_exit",
        "message",
        "phase",
        "restarts",
        "spec",
    )

    def __init__(
        self,
        spec: WorkerSpec,
        template: LaunchRequest,
        launcher: Launcher,
        cgroup: SlotCgroup,
        *,
        clock: Callable[[], float] = time.monotonic,
        check: ProbeCheck = run_probe,
        probe_host: str = "127.0.0.1",
        backoff: Backoff | None = None,
        exec_probe: ExecProbe | None = None,
    ) -> None:
        """``exec_probe``: how exec probes run (the keeper runtime launches them into the worker's
        slot and sandbox); without it they go through ``check``."""
        self.spec = spec
        self._template = template
        self._launcher = launcher
        self._cgroup = cgroup
        self._clock = clock
        self._check = check
        self._probe_host = probe_host
        self._backoff = backoff or DEFAULT_BACKOFF
        self._exec_probe = exec_probe
        self._executor: Executor | None = None
        self._wake: Callable[[], None] | None = None
        self._launch_numbers = itertools.count(1)
        self.phase = Phase.STOPPED
        self._handle: WorkerHandle | None = None
        self._readiness: ProbeTracker | None = None
        self._liveness: ProbeTracker | None = None
        self._launched_at = 0.0
        self._oom_at_launch = 0
        self._stop_deadline: float | None = None
        #: A stop under way: when the stop signal is due (after draining), whether it went out, and
        #: the pre_stop hook's run and deadline.
        self._signal_at = 0.0
        self._signaled = False
        self._pre_stop: Future[bool] | None = None
        self._pre_stop_until = 0.0
        self._stop_requested = False
        self._killed_for = ""
        self._next_restart_at: float | None = None
        self.restarts = 0
        self.consecutive_failures = 0
        self.last_exit: ExitRecord | None = None
        self.message = "not started"

    # --- commands ---------------------------------------------------------------------------

    def start(self) -> None:
        if self.phase in ALIVE_PHASES:
            return
        self._stop_requested = False
        self._launch(self._clock())

    def stop(self) -> None:
        """Begin a graceful stop; ``tick()`` finishes it. A waiting restart is cancelled."""
        self._stop_requested = True
        if self.phase in _WAITING or self.phase in (Phase.EXITED, Phase.FAILED):
            self._set(Phase.STOPPED, "stopped on request")
            self._next_restart_at = None
        elif self.phase in ALIVE_PHASES and self.phase is not Phase.STOPPING:
            self._begin_stop(self._clock(), "stop requested")

    def resume(self, handle: WorkerHandle, launched_at: float | None = None) -> None:
        """Take over a worker found again after an agent restart (see adopt.py): without a readiness
        probe it is running; with one, the probe runs at the first tick, with no initial delay."""
        self._handle = handle
        self._stop_requested = False
        now = self._clock()
        self._launched_at = now if launched_at is None else launched_at
        self._oom_at_launch = self._cgroup.oom_kill_count()
        self._arm_probes(now, delay=False)
        if self._readiness is None:
            self._set(Phase.RUNNING, f"re-adopted pid {handle.pid} (no readiness probe)")
        else:
            self._set(Phase.STARTING, f"re-adopted pid {handle.pid}; checking readiness")

    def resume_exited(self, record: ExitRecord) -> None:
        """An adopted worker that ended while the agent was away: apply the restart policy now."""
        self._handle = None
        self._after_exit(record, self._clock())

    # --- the loop ---------------------------------------------------------------------------

    def tick(self) -> WorkerStatus:
        now = self._clock()
        if self.phase in ALIVE_PHASES and self._handle is not None:
            record = self._handle.poll()
            if record is not None:
                self._after_exit(record, now)
            elif self.phase is Phase.STOPPING:
                self._escalate_stop(now)
            else:
                self._run_probes(now)
        elif self.phase in _WAITING and self._next_restart_at is not None and now >= self._next_restart_at:
            self._launch(now)
        return self.status()

    def due_in(self) -> float | None:
        """Seconds until ``tick()`` has timed work (a probe, a stop deadline, a restart); None: none.

        A worker's exit is not timed work: a loop that waits on :meth:`exit_fd` learns of it
        without asking, so an idle worker with no probes needs no ticks at all.
        """
        now = self._clock()
        if self.phase in _WAITING:
            return None if self._next_restart_at is None else max(0.0, self._next_restart_at - now)
        if self.phase not in ALIVE_PHASES or self._handle is None:
            return None
        if self.phase is Phase.STOPPING:
            if not self._signaled:
                # The hook's end wakes the loop (attach()); its timeout is timed work.
                when = self._signal_at
                if self._pre_stop_busy(now):
                    when = max(when, self._pre_stop_until)
                return max(0.0, when - now)
            return None if self._stop_deadline is None else max(0.0, self._stop_deadline - now)
        # A check under way is not timed work: its result wakes the loop (attach()).
        dues = [t.next_due for t in (self._liveness, self._readiness) if t is not None and t.pending is None]
        return max(0.0, min(dues) - now) if dues else None

    def exit_fd(self) -> int | None:
        """A file descriptor that polls readable once the live worker's exit can be read (the
        keeper's notice pipe: its exit record is final, or the keeper went away).

        None when no worker is alive, or when its handle offers no such descriptor: then only
        polling through ``tick()`` finds the exit.
        """
        if self.phase not in ALIVE_PHASES or self._handle is None:
            return None
        fd = getattr(self._handle, "exit_fd", None)
        return fd if isinstance(fd, int) and fd >= 0 else None

    def status(self) -> WorkerStatus:
        wait = None
        if self._next_restart_at is not None and self.phase in _WAITING:
            wait = max(0.0, self._next_restart_at - self._clock())
        return WorkerStatus(
            phase=self.phase,
            pid=self._handle.pid if self._handle is not None and self.phase in ALIVE_PHASES else None,
            restarts=self.restarts,
            consecutive_failures=self.consecutive_failures,
            last_exit=self.last_exit,
            next_restart_in=wait,
            message=self.message,
            last_probe=None if self._readiness is None else self._readiness.last,
            ready_when="probe" if self.spec.readiness is not None else "started",
        )

    # --- steps ------------------------------------------------------------------------------

    def _set(self, phase: Phase, message: str) -> None:
        self.phase = phase
        self.message = message

    def _launch(self, now: float) -> None:
        req = dataclasses.replace(
            self._template, launch_id=f"{self._template.launch_id}-{next(self._launch_numbers)}"
        )
        # A worker starts in an empty slot. Whatever runs there now belongs to no worker the agent
        # knows: one that exec'd just as its keeper died (before the keeper took custody, so no
        # state file names it), or leftovers nobody saw end.
        if self._cgroup.pids():
            self._cgroup.kill_all(KILL_TIMEOUT_SECONDS)
        self._oom_at_launch = self._cgroup.oom_kill_count()
        self._killed_for = ""
        self._stop_deadline = None
        self._next_restart_at = None
        try:
            self._handle = self._launcher.launch(req)
        except WorkerError as err:
            # A worker that cannot even be started (no such program, a bad user, a refused
            # namespace) fails the same way every time: say so at once instead of retrying.
            self._handle = None
            self.consecutive_failures += 1
            self._set(Phase.FAILED, f"launch failed: {err}; fix the worker spec and start it again")
            return
        self._launched_at = now
        self._arm_probes(now)
        if self._readiness is None:
            self._set(Phase.RUNNING, f"pid {self._handle.pid} running (no readiness probe)")
        else:
            self._set(Phase.STARTING, f"pid {self._handle.pid} started; waiting for readiness")

    def _arm_probes(self, now: float, *, delay: bool = True) -> None:
        spec = self.spec
        self._readiness = (
            ProbeTracker(spec.readiness, now, passing=False, delay=delay) if spec.readiness else None
        )
        self._liveness = (
            ProbeTracker(spec.liveness, now, passing=True, delay=delay) if spec.liveness else None
        )

    def attach(self, executor: Executor, wake: Callable[[], None]) -> None:
        """Run probes in ``executor`` from now on, off the thread that ticks (and off the agent's lock
        it holds): a due probe is submitted, and ``wake`` (thread-safe) asks for a tick once its
        result is in. Without it probes run inside ``tick()``."""
        self._executor = executor
        self._wake = wake

    def _checked(self, tracker: ProbeTracker | None, now: float) -> bool:
        """Advance one probe: True when a result was recorded at this tick."""
        if tracker is None:
            return False
        if tracker.pending is not None:
            if not tracker.pending.done():
                return False
            future, tracker.pending = tracker.pending, None
            try:
                result = future.result()
            except Exception as err:  # a probe's own bug counts as a failure, not as the loop's
                log.exception("probe raised", extra={"probe": tracker.probe.kind.value})
                result = ProbeResult(False, False, f"the probe itself failed: {err!r}", time.time())
            tracker.record(result, now, started=tracker.submitted)
            return True
        if not tracker.due(now):
            return False
        if self._executor is None:
            tracker.record(self._probe(tracker.probe), now)
            return True
        tracker.submitted = now
        tracker.pending = self._executor.submit(self._probe, tracker.probe)
        wake = self._wake
        if wake is not None:
            tracker.pending.add_done_callback(lambda _: wake())
        return False

    def _run_probes(self, now: float) -> None:
        readiness = self._readiness
        timeout = self.spec.startup_timeout_seconds
        if readiness is not None and not readiness.ever_passed and now - self._launched_at >= timeout:
            self._killed_for = f"not ready within its startup timeout of {timeout:g}s"
            self._begin_stop(now, self._killed_for)
            return
        liveness = self._liveness
        if self._checked(liveness, now) and liveness is not None and not liveness.passing:
            self._killed_for = "liveness probe failed"
            self._begin_stop(now, f"liveness probe failed {liveness.probe.failure_threshold} times")
            return
        if self._checked(self._readiness, now) and self._readiness is not None:
            pid = self._handle.pid if self._handle else None
            if self._readiness.passing and self.phase is not Phase.RUNNING:
                self._set(Phase.RUNNING, f"pid {pid} ready")
            elif not self._readiness.passing and self.phase is Phase.RUNNING:
                self._set(Phase.UNREADY, f"pid {pid} failed its readiness probe")

    def _probe(self, probe: Probe) -> ProbeResult:
        if probe.kind is ProbeKind.EXEC and self._exec_probe is not None and self._handle is not None:
            return as_result(self._exec_probe(probe, self._handle), probe)
        return as_result(self._check(probe, self._probe_host), probe)

    def _begin_stop(self, now: float, why: str) -> None:
        """A stop in up to three steps: drain (the worker is shown not ready at once; requests under
        way finish) and the pre_stop hook, side by side; then the stop signal; then, after the grace
        period, SIGKILL to everything in the slot."""
        served = self.phase in (Phase.RUNNING, Phase.UNREADY)  # a worker never ready has no requests
        self._set(Phase.STOPPING, why)
        spec = self.spec
        self._signal_at = now + (spec.drain_seconds if served else 0.0)
        self._stop_deadline = None
        self._signaled = False
        self._pre_stop = None
        if spec.pre_stop is not None and self._handle is not None:
            self._pre_stop_until = now + spec.pre_stop.timeout_seconds
            if self._executor is None:
                self._pre_stop = Future()
                self._pre_stop.set_result(self._run_pre_stop(spec.pre_stop, self._handle))
            else:
                self._pre_stop = self._executor.submit(self._run_pre_stop, spec.pre_stop, self._handle)
                wake = self._wake
                if wake is not None:
                    self._pre_stop.add_done_callback(lambda _: wake())
        if spec.drain_seconds and served:
            self.message = f"{why}; draining for {spec.drain_seconds:g}s before {spec.stop_signal}"
        self._escalate_stop(now)

    def _run_pre_stop(self, hook: PreStop, handle: WorkerHandle) -> bool:
        """The pre_stop hook, in a probe thread: True when it succeeded (the stop goes on either way)."""
        if hook.exec is not None:
            probe = Probe(exec=hook.exec, timeout_seconds=hook.timeout_seconds)
            if self._exec_probe is not None:
                return as_result(self._exec_probe(probe, handle), probe).passed
            return as_result(self._check(probe, self._probe_host), probe).passed
        assert hook.http is not None
        return call_http(hook.http, self._probe_host, hook.timeout_seconds)

    def _pre_stop_busy(self, now: float) -> bool:
        return self._pre_stop is not None and not self._pre_stop.done() and now < self._pre_stop_until

    def _send_stop_signal(self) -> None:
        sig = signal.Signals[self.spec.stop_signal]
        if self._handle is None:
            return
        self._handle.send_signal(sig)
        if self.spec.stop_scope == "slot" and kind_of(self.spec).signals_whole_slot:
            # Every process in the slot, each once: helpers a server forked (and orphaned) stop too
            # (not for a container: runtime/worker_kind.py).
            self._cgroup.signal_all(sig, but=self._handle.pid)

    def _escalate_stop(self, now: float) -> None:
        if not self._signaled:
            if now < self._signal_at or self._pre_stop_busy(now):
                return
            self._signaled = True
            self._stop_deadline = now + self.spec.stop_grace_seconds
            hook = ""
            if self._pre_stop is not None:
                ok = self._pre_stop.done() and not self._pre_stop.exception() and self._pre_stop.result()
                hook = "pre_stop done; " if ok else "pre_stop failed or timed out; "
            self._send_stop_signal()
            grace = self.spec.stop_grace_seconds
            self.message = f"{self.message}; {hook}{self.spec.stop_signal} sent, waiting up to {grace:g}s"
            return
        if self._stop_deadline is not None and now >= self._stop_deadline:
            self._stop_deadline = None
            self.message = (
                f"grace period of {self.spec.stop_grace_seconds:g}s over; killing the slot's processes"
            )
            self._cgroup.kill_all(KILL_TIMEOUT_SECONDS)

    def _after_exit(self, record: ExitRecord, now: float) -> None:
        if self._handle is not None:
            self._handle.close()
        self._handle = None
        if (
            not record.oom_killed
            and record.signal == signal.SIGKILL
            and self._cgroup.oom_kill_count() > self._oom_at_launch
        ):
            record = dataclasses.replace(record, oom_killed=True, reason="oom-killed")
        if self._killed_for:
            record = dataclasses.replace(record, stopped_by=self._killed_for)
        self.last_exit = record
        # Helpers the worker forked must not outlive it: the next start needs an empty slot.
        if self._cgroup.pids():
            self._cgroup.kill_all(KILL_TIMEOUT_SECONDS)
        if self._stop_requested:
            self._set(Phase.STOPPED, f"stopped; worker {record.describe()}")
            return
        # Exiting before it was ever ready is a failure whatever the status: a server that exits 0
        # at start-up (a stale lock, a missing model) did not do its job.
        never_ready = self._readiness is not None and not self._readiness.ever_passed
        failed = not record.succeeded or bool(self._killed_for) or never_ready
        if now - self._launched_at >= self._backoff.reset_after_seconds:
            self.consecutive_failures = 0
        policy = self.spec.restart
        restart = policy is RestartPolicy.ALWAYS or (policy is RestartPolicy.ON_FAILURE and failed)
        cause = self._killed_for or record.describe() + (" before it was ever ready" if never_ready else "")
        if not restart:
            self._set(Phase.FAILED if failed else Phase.EXITED, f"worker {cause}")
            return
        self._after_failure(now, f"worker {cause}")

    def _after_failure(self, now: float, cause: str) -> None:
        if self.spec.restart is RestartPolicy.NEVER:
            self._set(Phase.FAILED, cause)
            return
        self.consecutive_failures += 1
        self.restarts += 1
        delay = self._backoff.delay(self.consecutive_failures)
        self._next_restart_at = now + delay
        looping = self.consecutive_failures >= self._backoff.crashloop_after
        phase = Phase.CRASHLOOP if looping else Phase.BACKOFF
        self._set(phase, f"{cause}; restart {self.restarts} in {delay:g}s")
