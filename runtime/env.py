"""The environment a worker starts with, and the slot description file it can read.

The worker does not inherit the agent's environment (it may hold tokens); it gets a small base, the
slot's wiring (slot id and file, thread counts sized to the slot, visible GPUs, FPGA device paths,
a private temporary directory) and finally the spec's own env, which wins wherever it sets a key.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from nodeagent.atomicfile import write_atomic
from nodeagent.errors import KernelError, translate_os_error

SLOT_DESCRIPTION_SCHEMA = "nodeagent.slot/v1"

#: Thread-pool sizes read by the common numeric libraries and ML frameworks.
THREAD_COUNT_VARIABLES = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "TF_NUM_INTRAOP_THREADS",
)

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class SlotDescription:
    """What a worker may know about its slot; written as JSON to ``NODEAGENT_SLOT_FILE``."""

    slot_id: str
    cpus: tuple[int, ...]
    numa_nodes: tuple[int, ...]
    memory_bytes: int | None
    #: GPU or MIG UUIDs (or indexes where a UUID is unknown).
    gpus: tuple[str, ...] = ()
    #: Device nodes of the slot's FPGAs, e.g. "/dev/xclmgmt256".
    fpga_devices: tuple[str, ...] = ()
    #: Other device nodes the slot may open.
    devices: tuple[str, ...] = ()
    #: The slot's own network addresses (in its netns), e.g. "10.77.0.2/30".
    addresses: tuple[str, ...] = ()
    #: CPU quota in CPUs for burstable slots on the shared pool; None when CPUs are exclusive.
    cpu_quota: float | None = None

    def to_json(self) -> dict[str, object]:
        body: dict[str, object] = {"schema": SLOT_DESCRIPTION_SCHEMA}
        body.update({k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()})
        return body


def thread_count(slot: SlotDescription) -> int:
    """Threads a worker should use: its quota rounded up when it has one, else its CPUs."""
    if slot.cpu_quota is not None:
        return max(1, math.ceil(slot.cpu_quota))
    return max(1, len(slot.cpus))


def write_slot_file(slot: SlotDescription, path: Path) -> Path:
    """Write the description atomically (a reader never sees half a file); world-readable."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(slot.to_json(), indent=2, sort_keys=True) + "\n", mode=0o644)
    except OSError as err:
        raise translate_os_error(f"write slot description {path}", err, KernelError) from err
    return path


def slot_environment(slot: SlotDescription, slot_file: str) -> dict[str, str]:
    """The slot's wiring alone: its id and file, thread counts sized to it, visible GPUs, FPGA
    device paths (what a worker gets besides its base environment; also a slot's CDI device)."""
    env = {"NODEAGENT_SLOT_ID": slot.slot_id, "NODEAGENT_SLOT_FILE": slot_file}
    threads = str(thread_count(slot))
    for name in THREAD_COUNT_VARIABLES:
        env[name] = threads
    if slot.gpus:
        visible = ",".join(slot.gpus)
        env["CUDA_VISIBLE_DEVICES"] = visible
        env["NVIDIA_VISIBLE_DEVICES"] = visible
    else:
        # Hide every GPU from CUDA and from the NVIDIA container hook, not just the denied ones.
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["NVIDIA_VISIBLE_DEVICES"] = "void"
    if slot.fpga_devices:
        env["NODEAGENT_FPGA_DEVICES"] = ",".join(slot.fpga_devices)
    return env


def worker_environment(
    slot: SlotDescription,
    slot_file: Path,
    spec_env: Mapping[str, str],
    *,
    home: str = "/",
    tmpdir: str | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The full environment for a worker; ``spec_env`` wins over everything else."""
    env: dict[str, str] = {"PATH": DEFAULT_PATH, "LANG": "C.UTF-8", "HOME": home}
    env.update(base or {})
    env.update(slot_environment(slot, str(slot_file)))
    if tmpdir is not None:
        env["TMPDIR"] = tmpdir
    env.update(spec_env)
    return env
