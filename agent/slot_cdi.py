"""The slots' CDI specs as the agent keeps them: built from a slot's record, written when the slot
is ready, again when it is resized or its worker changes, removed when it goes, and reconciled at
start-up (a spec of a slot the agent does not hold is removed: no stale device survives a crash).

The pure spec builder and the directory are ``nodeagent.isolation.cdi``; what goes in is decided
here, where the slot's assignment, its worker spec and the runtime's environment rules meet:

- device nodes: exactly what the slot's device cgroup allows besides the safe set (its GPUs, MIG
  capability nodes, FPGAs and named devices) plus CUDA's control nodes for a GPU slot;
- environment: the slot's wiring (``runtime.env.slot_environment``) with ``NODEAGENT_SLOT_FILE``
  naming the file's path inside the container; where the slot's worker spec sets one of those
  variables itself, its value is the one written. Runtimes apply a CDI device's environment after
  their own ``--env`` (podman 4.3 does), so this is how the spec's env keeps winning for a
  container worker, as it does for a command worker;
- mounts: the slot description, a file of the agent's (``<state>/cdi/<slot id>.json``), read-only
  at ``/run/nodeagent/slot.json``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from nodeagent.agent.sandbox import slot_device_paths
from nodeagent.agent.slot import Slot
from nodeagent.agent.translate import isolation_spec, slot_description
from nodeagent.devices.topology import Topology
from nodeagent.errors import KernelError, NotFound, Unsupported
from nodeagent.isolation.cdi import (
    CONTAINER_SLOT_FILE,
    DEVICE_KIND,
    FPGA_KIND,
    GPU_KIND,
    CdiSpecDir,
    allowed_device_name,
    device_spec,
    slot_spec,
    valid_device_name,
)
from nodeagent.isolation.devices import GPU_CONTROL_NODES
from nodeagent.runtime.env import slot_environment, write_slot_file
from nodeagent.runtime.worker_kind import kind_of
from nodeagent.schema.worker import WorkerSpec

log = logging.getLogger("nodeagent.cdi")

#: Keys of the per-device spec files (``<prefix>gpu.json``, ``<prefix>fpga.json``,
#: ``<prefix>device.json``): never a slot id (ids start with "s" and are 13 characters long).
DEVICE_KEYS = ("gpu", "fpga", "device")


class SlotCdiSpecs:
    """Writes and removes the slots' CDI specs in ``specs`` and their slot files in ``slot_files``."""

    def __init__(
        self,
        specs: CdiSpecDir,
        slot_files: Path,
        *,
        device_specs: bool = False,
        allowed_devices: Sequence[str] = (),
    ) -> None:
        self.specs = specs
        self.slot_files = slot_files
        self.device_specs = device_specs
        self.allowed_devices = tuple(allowed_devices)

    def build(
        self, slot: Slot, topology: Topology, shared_pool: frozenset[int], worker_env: Mapping[str, str]
    ) -> dict[str, Any]:
        """The spec of ``slot`` as it is now (pure but for the device control nodes' existence)."""
        isolated = isolation_spec(slot, topology)
        description = slot_description(slot, shared_pool)
        env = slot_environment(description, CONTAINER_SLOT_FILE)
        env.update({k: v for k, v in worker_env.items() if k in env})
        return slot_spec(
            slot.id,
            slot.name,
            slot_device_paths(isolated.device_paths, isolated.gpu),
            env,
            str(self.slot_file(slot.id)),
        )

    def slot_file(self, slot_id: str) -> Path:
        return self.slot_files / f"{slot_id}.json"

    def write(
        self, slot: Slot, topology: Topology, shared_pool: frozenset[int], worker_env: Mapping[str, str]
    ) -> Path:
        """The slot file first, then the spec that mounts it (a runtime never finds a spec whose
        file is missing)."""
        write_slot_file(slot_description(slot, shared_pool), self.slot_file(slot.id))
        return self.specs.write(slot.id, self.build(slot, topology, shared_pool, worker_env))

    def remove(self, slot_id: str) -> None:
        self.specs.remove(slot_id)
        self.slot_file(slot_id).unlink(missing_ok=True)

    def read(self, slot_id: str) -> dict[str, Any] | None:
        return self.specs.read(slot_id)

    def written(self, slot: Slot) -> dict[str, Any]:
        """The slot's spec as written; NotFound when it has none."""
        spec = self.read(slot.id)
        if spec is None:
            raise NotFound(
                f"slot {slot.name!r} has no CDI spec in {self.specs.directory} (it is {slot.state}; "
                "specs exist for ready and running slots)"
            )
        return spec

    def remove_stale(self, held: Iterable[str]) -> list[str]:
        """Remove the specs and slot files of slots not in ``held``; the slot ids removed."""
        held = set(held)
        keep = held | set(DEVICE_KEYS)
        removed = self.specs.remove_except(keep, owned=self._owned)
        try:
            names = os.listdir(self.slot_files)
        except FileNotFoundError:
            names = []
        for name in names:
            if name.endswith(".json") and name[: -len(".json")] not in held:
                (self.slot_files / name).unlink(missing_ok=True)
        return removed

    def _owned(self, spec: Mapping[str, Any]) -> bool:
        """A spec this agent wrote: it mounts a slot file from this agent's directory (another
        agent's, sharing the CDI directory and prefix, mounts its own)."""
        mine = str(self.slot_files) + os.sep
        for device in spec.get("devices", ()):
            for mount in device.get("containerEdits", {}).get("mounts", ()):
                if str(mount.get("hostPath", "")).startswith(mine):
                    return True
        return False

    def write_device_specs(self, topology: Topology) -> list[Path]:
        """``nodeagent.io/gpu``, ``nodeagent.io/fpga`` and ``nodeagent.io/device`` specs for the
        devices discovered and allowed (when configured); a kind with no device has no file."""
        if not self.device_specs:
            return []
        written = []
        control = [p for p in GPU_CONTROL_NODES if os.path.exists(p)]
        gpus: dict[str, list[str]] = {}
        for gpu in topology.gpus:
            if gpu.minor is None:
                continue
            nodes = [f"/dev/nvidia{gpu.minor}", *control]
            gpus[str(gpu.index)] = nodes
            if gpu.uuid:
                gpus[gpu.uuid] = nodes
        fpgas = {f.id: list(f.device_nodes) for f in topology.fpgas if f.device_nodes}
        # An allowed device that is not there now has no entry (the runtime would refuse the spec).
        allowed = {allowed_device_name(p): [p] for p in self.allowed_devices if os.path.exists(p)}
        kinds = (("gpu", GPU_KIND, gpus), ("fpga", FPGA_KIND, fpgas), ("device", DEVICE_KIND, allowed))
        for key, kind, found in kinds:
            devices = {name: nodes for name, nodes in found.items() if valid_device_name(name)}
            if devices:
                written.append(self.specs.write(key, device_spec(kind, devices)))
            else:
                self.specs.remove(key)
        return written


def check_container(cdi: SlotCdiSpecs | None, spec: WorkerSpec | None) -> None:
    """A container worker gets its slot through the slot's CDI spec: without specs it cannot start."""
    if kind_of(spec).needs_container_runtime and cdi is None:
        raise Unsupported(
            "container workers need the slot's CDI spec, and this agent writes none ([cdi] enabled = "
            "false, or slots are not isolated here); enable [cdi] or give a command"
        )


def try_cdi(action: str, slot_id: str, step: Any, *args: Any) -> bool:
    """Run a CDI step; a failure is logged, not raised: a slot's kernel isolation stands without
    its CDI spec (only container workers need it, and their launch then says what is missing)."""
    try:
        step(*args)
    except (KernelError, OSError) as err:
        log.warning("CDI spec not %s", action, extra={"slot": slot_id, "reason": str(err)})
        return False
    return True


__all__ = ["DEVICE_KEYS", "SlotCdiSpecs", "try_cdi"]
