"""Finding a slot's worker again after the agent restarts.

Workers outlive the agent (their keeper is their parent, not the agent). On start, the agent reads
each worker's state file and asks: is the process it names still the one we launched? The answer
comes from a pidfd opened on the pid and checked against the recorded start time, so a pid the
kernel has since handed to another process is never mistaken for ours, and never signalled.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from nodeagent.runtime.process import ExitRecord, WorkerProcess, WorkerState, open_verified_pidfd, read_state
from nodeagent.runtime.supervisor import Supervisor


@dataclass(frozen=True)
class Adoption:
    """What was found in a worker's run directory.

    ``process`` is set when the worker is still ours and alive (or its exit is still being
    written by its keeper); ``exit`` when it ended while the agent was away. Neither: nothing was
    ever launched from this directory.
    """

    state: WorkerState | None
    process: WorkerProcess | None
    exit: ExitRecord | None


def adopt(run_dir: Path, proc: Path = Path("/proc")) -> Adoption:
    state = read_state(run_dir)
    if state is None:
        return Adoption(None, None, None)
    if state.exit is not None:
        return Adoption(state, None, state.exit)
    pidfd = open_verified_pidfd(state.worker, proc)
    keeper_pidfd = open_verified_pidfd(state.keeper, proc)
    # A worker that is gone, or whose pid now names a stranger, is held as "exited" (-1): its
    # keeper's record, or "lost" when there is none, says how it ended.
    process = WorkerProcess(state, run_dir, -1 if pidfd is None else pidfd, keeper_pidfd)
    record = process.poll() if pidfd is None else None
    if record is not None:
        process.close()
        return Adoption(state, None, record)
    return Adoption(state, process, None)


def resume_supervision(supervisor: Supervisor, run_dir: Path, proc: Path = Path("/proc")) -> Adoption:
    """Adopt the worker of ``run_dir`` into ``supervisor``: resume it, or apply its restart policy."""
    found = adopt(run_dir, proc)
    if found.process is not None:
        supervisor.resume(found.process)
    elif found.exit is not None:
        supervisor.resume_exited(found.exit)
    return found
