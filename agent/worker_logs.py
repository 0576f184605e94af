"""A slot's worker output as the API and ``nodeagent slots logs`` show it: its last lines with stream
and time, the agent's word on a worker that is not running, and the logs a released slot left
for ``[workers] log_retention_seconds``. A part of the slot (agent/parts.py's kind): it owns the
released slots' kept logs and their retention; the manager hands it the slot's view.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from nodeagent.agent.slot import Slot
from nodeagent.errors import InvalidRequest, NotFound
from nodeagent.runtime.logs import LogLine
from nodeagent.runtime.supervisor import ALIVE_PHASES
from nodeagent.runtime.workers import WorkerRuntime


class WorkerLogs:
    """``find``: the slot's view by id or name (NotFound when it does not exist);
    ``retention_seconds``: how long a released slot's logs are kept (0: removed with it)."""

    def __init__(
        self,
        runtime: WorkerRuntime,
        find: Callable[[str], Slot],
        *,
        retention_seconds: float,
        clock: Callable[[], float],
    ) -> None:
        self._runtime = runtime
        self._find = find
        self.retention_seconds = retention_seconds
        self._clock = clock

    def prune(self) -> None:
        """Remove the kept logs of slots released longer ago than the retention."""
        with contextlib.suppress(OSError):
            self._runtime.prune_released(self._clock() - self.retention_seconds)

    def entries(self, slot_id: str, lines: int, since: str | None = None) -> tuple[str, list[LogLine]]:
        """The slot's id and the last ``lines`` lines of its worker's output with their stream and
        time; ``since`` (a time as the lines carry it): only complete lines after it, as a
        follower asks. A released slot's logs while [workers] log_retention_seconds keeps them."""
        if lines < 0:
            raise InvalidRequest(f"logs: lines is {lines}; ask for 0 or more")
        try:
            slot = self._find(slot_id)
        except NotFound as err:
            return self._released(slot_id, lines, since, err)
        return _live(self._runtime, slot, lines, since)

    def _released(self, key: str, lines: int, since: str | None, err: NotFound) -> tuple[str, list[LogLine]]:
        self.prune()
        kept = self._runtime.released_logs(key)
        if kept is None:
            raise NotFound(
                f"{err}; a released slot's logs are kept for [workers] log_retention_seconds "
                f"({self.retention_seconds:g}s here)"
            ) from None
        try:
            output = self._runtime.log_lines(kept, lines, complete_only=since is not None)
        except NotFound:
            output = []  # its worker never wrote anything (it never launched)
        last_word = self._runtime.released_word(kept)
        if since is None and last_word and lines:
            output = [*output, LogLine("agent", last_word)][-lines:]
        return kept, _since(output, since)


def _live(runtime: WorkerRuntime, slot: Slot, lines: int, since: str | None) -> tuple[str, list[LogLine]]:
    worker = slot.worker
    said = lines and worker is not None and worker.phase not in ALIVE_PHASES and worker.message
    try:
        output = runtime.log_lines(slot.id, lines, complete_only=since is not None)
    except NotFound:
        if not said:
            raise
        output = []  # it never wrote anything (a launch that failed): the agent's word is all
    if since is not None:
        return slot.id, _since(output, since)
    if said and worker is not None:
        # Why the worker is not running (a launch that failed writes nothing of its own): the
        # agent's word last, marked as such.
        word = LogLine("agent", f"worker {worker.phase}: {worker.message}")
        output = [*output, word][-lines:]
    return slot.id, output


def _since(lines: list[LogLine], since: str | None) -> list[LogLine]:
    # RFC 3339 in UTC with nanoseconds: the text orders as the time does.
    return lines if since is None else [line for line in lines if line.time > since]
