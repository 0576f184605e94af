"""Finding a slot's worker again after the agent restarts.

Workers outlive the agent (the host keeper is their parent, not the agent). On start, the agent
reads each worker's state file and asks the keeper to watch the worker it names (:meth:`watch`):
the keeper already has it in custody, or re-adopts it (it checks the process with a pidfd opened
on the pid and then verified against the recorded start time, so a pid the kernel has since handed
to another process is never mistaken for ours, and never signalled), or has recorded how it ended.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from nodeagent.runtime.process import (
    ExitRecord,
    Watcher,
    WorkerProcess,
    WorkerState,
    open_verified_pidfd,
    read_state,
)
from nodeagent.runtime.supervisor import Supervisor


@dataclass(frozen=True)
class Adoption:
    """What was found in a worker's run directory.

    ``process`` is set when a keeper holds the worker: alive, or its tree still being ended and
    its record not yet final; ``exit`` when it ended while the agent was away. Neither: nothing
    was ever launched from this directory.
    """

    state: WorkerState | None
    process: WorkerProcess | None
    exit: ExitRecord | None


def adopt(run_dir: Path, keeper: Watcher) -> Adoption:
    """Raises WorkerError when no keeper can be reached (the worker is left as it is)."""
    state = read_state(run_dir)
    if state is None:
        return Adoption(None, None, None)
    if state.exit is not None:
        return Adoption(state, None, state.exit)
    notice = keeper.watch(run_dir, state.launch_id)
    if notice is None:
        # No keeper holds it any more: the keeper wrote how it ended just now, or (a state file
        # written by nobody we know) nobody knows.
        final = read_state(run_dir)
        if final is not None and final.launch_id == state.launch_id and final.exit is not None:
            return Adoption(final, None, final.exit)
        return Adoption(state, None, ExitRecord.lost(time.time()))
    pidfd = open_verified_pidfd(state.worker)
    return Adoption(
        state, WorkerProcess(state, run_dir, -1 if pidfd is None else pidfd, notice, keeper), None
    )


def resume_supervision(supervisor: Supervisor, run_dir: Path, keeper: Watcher) -> Adoption:
    """Adopt the worker of ``run_dir`` into ``supervisor``: resume it, or apply its restart policy."""
    found = adopt(run_dir, keeper)
    if found.process is not None:
        supervisor.resume(found.process)
    elif found.exit is not None:
        supervisor.resume_exited(found.exit)
    return found
