"""A slot's worker output as the API and ``nodeagent slots logs`` show it: its last lines with stream
and time, the agent's word on a worker that is not running, and the logs a released slot left
for ``[workers] log_retention_seconds``. A part of :class:`SlotManager` kept in a module of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nodeagent.errors import InvalidRequest, NotFound
from nodeagent.runtime.logs import LogLine
from nodeagent.runtime.supervisor import ALIVE_PHASES

if TYPE_CHECKING:
    from nodeagent.agent.manager import SlotManager


def worker_log_entries(
    manager: SlotManager, slot_id: str, lines: int, since: str | None = None
) -> tuple[str, list[LogLine]]:
    """The slot's id and the last ``lines`` lines of its worker's output with their stream and
    time; ``since`` (a time as the lines carry it): only complete lines after it, as a follower
    asks. A released slot's logs while [workers] log_retention_seconds keeps them."""
    if lines < 0:
        raise InvalidRequest(f"logs: lines is {lines}; ask for 0 or more")
    try:
        slot = manager._view(manager._slot(slot_id))
    except NotFound as err:
        manager._prune_logs()
        kept = manager._runtime.released_logs(slot_id)
        if kept is None:
            raise NotFound(
                f"{err}; a released slot's logs are kept for [workers] log_retention_seconds "
                f"({manager._log_retention:g}s here)"
            ) from None
        try:
            output = manager._runtime.log_lines(kept, lines, complete_only=since is not None)
        except NotFound:
            output = []  # its worker never wrote anything (it never launched)
        last_word = manager._runtime.released_word(kept)
        if since is None and last_word and lines:
            output = [*output, LogLine("agent", last_word)][-lines:]
        return kept, _since(output, since)
    worker = slot.worker
    said = lines and worker is not None and worker.phase not in ALIVE_PHASES and worker.message
    try:
        output = manager._runtime.log_lines(slot.id, lines, complete_only=since is not None)
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
