"""What kind of worker a slot runs, chosen once from its spec: a **process** that the host keeper
starts in the slot's sandbox, or a **container** that podman starts in the slot
(runtime/container.py). Everything that differs between the two is answered here, so that no
other module asks whether a spec has a ``container``:

- whether a preset resolves its program and arguments (a container's image knows its own);
- what the sandbox checks of its arguments and host paths (a process's program and arguments, a
  container's mount sources);
- whether ``stop_scope = "slot"`` signals every process of the slot (a process worker's helpers
  stop too; not a container's: conmon and the OCI runtime, also in the slot, must outlive the
  container to record its exit);
- whether its slot's device cgroup must admit an OCI runtime below it and its slot needs a CDI
  spec (a container gets its devices, wiring and slot file through the slot's CDI spec);
- whether a slot allocated for one kind can run a worker of the other (a container needs a slot
  made for containers; a process runs in either).

The supervisor each kind gets, and what releasing its slot removes, are runtime/workers.py's, one
builder per kind.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nodeagent.schema.request import SlotRequest
from nodeagent.schema.worker import ContainerMount, WorkerSpec


@dataclass(frozen=True)
class WorkerKind:
    name: str
    #: a preset fills in its program, arguments, environment and probes
    uses_presets: bool
    #: it runs in the host keeper's sandbox: its program and arguments must be reachable there
    runs_in_sandbox: bool
    #: ``stop_scope = "slot"`` signals every process of the slot, not only the worker's main one
    signals_whole_slot: bool
    #: its slot's device cgroup admits an OCI runtime below it, and the slot needs a CDI spec
    needs_container_runtime: bool

    def mounts(self, spec: WorkerSpec) -> Sequence[ContainerMount]:
        """The host paths it mounts (a container's ``mounts``; none for a process)."""
        return () if spec.container is None else spec.container.mounts

    def runs_in(self, slot_kind: WorkerKind) -> bool:
        """Whether a worker of this kind can start in a slot allocated for ``slot_kind``."""
        return slot_kind.needs_container_runtime or not self.needs_container_runtime

    def __str__(self) -> str:
        return self.name


PROCESS = WorkerKind(
    "process", uses_presets=True, runs_in_sandbox=True, signals_whole_slot=True, needs_container_runtime=False
)
CONTAINER = WorkerKind(
    "container",
    uses_presets=False,
    runs_in_sandbox=False,
    signals_whole_slot=False,
    needs_container_runtime=True,
)


def kind_of(spec: WorkerSpec | None) -> WorkerKind:
    """The kind of worker ``spec`` describes (a process when there is none)."""
    return CONTAINER if spec is not None and spec.container is not None else PROCESS


def slot_kind(request: SlotRequest) -> WorkerKind:
    """The kind a slot is allocated for: its request's worker's, fixed for the slot's life (its device
    cgroup is built for it at allocate, and every later apply must give the same answer)."""
    return kind_of(request.worker)


__all__ = ["CONTAINER", "PROCESS", "WorkerKind", "kind_of", "slot_kind"]
