"""Start-up that never destroys what it cannot explain.

The database names every slot the agent holds (a slot's row is committed before any of its kernel
objects exist), so after any crash of the agent, kernel objects no row names are leftovers of an
allocation that never finished, and empty. A slot cgroup **with processes in it** that no row names
means the database lost rows: it was deleted, restored from an old backup, or the disk was wiped.
Removing such a cgroup would kill workers somebody relies on, so the agent does not start; the
operator chooses (docs/recovery.md):

- ``nodeagent serve --recover``: rebuild the missing slots from the evidence. Each slot's record is
  also kept as a manifest file (``<state dir>/slots/<id>.json``, rewritten at each change), so a
  slot whose manifest survived comes back whole: its request, assignment, kernel objects and
  worker (re-adopted as after any restart). A slot with no manifest comes back from what its
  cgroup says (QoS class, exclusive CPUs), named ``recovered-<id>``, without a worker spec: its
  processes keep running, unsupervised, until the operator releases the slot.
- ``nodeagent serve --discard-orphans``: remove them, killing their processes.

:func:`decide` is the pure decision; :class:`Manifests` the files.
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodeagent.agent.slot import Slot
from nodeagent.atomicfile import write_atomic
from nodeagent.errors import NO_SPACE, InsufficientStorage, NodeAgentError, translate_os_error

log = logging.getLogger(__name__)


class RecoveryMode(enum.StrEnum):
    REFUSE = "refuse"  #: the default: do not start while there are unexplained busy slots
    RECOVER = "recover"  #: rebuild them (``--recover``)
    DISCARD = "discard"  #: remove them and kill what runs there (``--discard-orphans``)


class UnexplainedSlots(NodeAgentError):
    """The kernel holds busy slots the database does not name; the agent will not start blindly."""

    code = "unexplained_slots"


@dataclass(frozen=True)
class Evidence:
    """What the host shows of slots: each owned slot cgroup and whether processes run in it."""

    #: slot id -> processes in its cgroup (pids)
    busy: Mapping[str, tuple[int, ...]]
    #: slot ids with a cgroup (busy or not)
    cgroups: Collection[str]


@dataclass(frozen=True)
class RecoveryDecision:
    #: busy slots no row names: rebuild these (RECOVER) ...
    rebuild: tuple[str, ...] = ()
    #: ... or let orphan removal take them (DISCARD; killing what runs there)
    discard: tuple[str, ...] = ()


def decide(
    evidence: Evidence, known: Collection[str], mode: RecoveryMode, database: Path
) -> RecoveryDecision:
    """What to do with busy slot cgroups the database does not name (``known``: every slot id it has)."""
    unexplained = tuple(sorted(slot for slot in evidence.busy if slot not in known))
    if not unexplained:
        return RecoveryDecision()
    if mode is RecoveryMode.RECOVER:
        return RecoveryDecision(rebuild=unexplained)
    if mode is RecoveryMode.DISCARD:
        return RecoveryDecision(discard=unexplained)
    shown = ", ".join(f"{slot} ({len(evidence.busy[slot])} processes)" for slot in unexplained[:5])
    more = f" and {len(unexplained) - 5} more" if len(unexplained) > 5 else ""
    state = "is missing or empty" if not known else "does not name them"
    raise UnexplainedSlots(
        f"the state database {database} {state}, but this host runs slots of a previous agent: "
        f"{shown}{more}. Nothing was changed. To rebuild them from what survives, start with "
        "`nodeagent serve --recover`; to remove them and kill their processes, start with "
        "`nodeagent serve --discard-orphans`; or restore the database from a backup "
        "(see docs/recovery.md)"
    )


class Manifests:
    """One JSON file per slot under ``directory``: the slot's record as the database holds it.

    Written at every change of the slot (atomically, not flushed: like a pending row, it has to
    survive the agent, and the kernel objects it explains do not survive the machine).
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def write(self, record: Mapping[str, Any]) -> None:
        path = self.directory / f"{record['id']}.json"
        try:
            self.directory.mkdir(mode=0o700, exist_ok=True)
            # 0600: it names the worker's env, the agent's alone whatever the umask.
            write_atomic(path, json.dumps(record, sort_keys=True), mode=0o600)
        except OSError as err:
            if err.errno in NO_SPACE:
                raise InsufficientStorage(
                    f"the state directory {self.directory.parent} is full: cannot write the slot manifest "
                    f"{path} ({err.strerror}); free space there, then retry"
                ) from err
            raise translate_os_error(f"write the slot manifest {path}", err) from err

    def remove(self, slot_id: str) -> None:
        try:
            (self.directory / f"{slot_id}.json").unlink(missing_ok=True)
        except OSError as err:
            raise translate_os_error(f"remove the slot manifest of {slot_id}", err) from err

    def read(self, slot_id: str) -> Mapping[str, Any] | None:
        """The manifest of ``slot_id``, or None when there is none or it cannot be read as JSON."""
        try:
            body = json.loads((self.directory / f"{slot_id}.json").read_text())
        except (OSError, ValueError):
            return None
        return body if isinstance(body, dict) else None

    def slot_ids(self) -> list[str]:
        try:
            return sorted(p.stem for p in self.directory.glob("*.json"))
        except OSError:
            return []

    # A released slot's uid rests for [sandbox] uid_quarantine_seconds; the database says when
    # each was released. This file says it again for a start after the database was lost, so the
    # next slot is not handed a uid whose files the last owner may have left where it could.
    # Its name is not a manifest's (``*.json``).
    RELEASED_UIDS = ".released-uids"
    #: Entries older than the longest quarantine allowed are dropped when the file is written.
    RELEASED_KEPT_SECONDS = 31_536_000.0

    def note_released(self, uid: int, at: float) -> None:
        """Add ``uid`` released at ``at`` (wall-clock seconds). Best effort: the database holds
        the same; without room to write this the release goes on and says so in the log."""
        entries = {u: t for u, t in self.released_uids().items() if t > at - self.RELEASED_KEPT_SECONDS}
        entries[uid] = at
        path = self.directory / self.RELEASED_UIDS
        try:
            self.directory.mkdir(mode=0o700, exist_ok=True)
            write_atomic(path, json.dumps({str(u): t for u, t in sorted(entries.items())}), mode=0o600)
        except OSError as err:
            log.warning("released uid not noted beside the manifests", extra={"uid": uid, "reason": str(err)})

    def released_uids(self) -> dict[int, float]:
        """Each uid a released slot held and when (empty when none is noted or it is unreadable)."""
        try:
            body = json.loads((self.directory / self.RELEASED_UIDS).read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(body, dict):
            return {}
        return {
            int(u): float(t)
            for u, t in body.items()
            if u.isdigit() and isinstance(t, (int, float)) and not isinstance(t, bool)
        }


def recovered_name(slot_id: str) -> str:
    return f"recovered-{slot_id}"


__all__ = [
    "Evidence",
    "Manifests",
    "RecoveryDecision",
    "RecoveryMode",
    "Slot",
    "UnexplainedSlots",
    "decide",
    "recovered_name",
]
