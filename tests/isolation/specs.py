"""Slot specs and /proc readers shared by the isolation tests on v1 (this host) and v2 (the VM)."""

from __future__ import annotations

from pathlib import Path

from nodeagent.isolation.slot_spec import SlotIsolationSpec

MiB = 1 << 20
F = frozenset


def guaranteed(slot_id: str = "g", cpus: frozenset[int] = F({1}), **kwargs: object) -> SlotIsolationSpec:
    return SlotIsolationSpec(
        slot_id, "guaranteed", cpus=cpus, exclusive=True, mems=F({0}), memory_bytes=128 * MiB, **kwargs
    )  # type: ignore[arg-type]


def burstable(slot_id: str = "b", **kwargs: object) -> SlotIsolationSpec:
    return SlotIsolationSpec(slot_id, "burstable", cpu_quota=0.5, memory_bytes=128 * MiB, **kwargs)  # type: ignore[arg-type]


def best_effort(slot_id: str = "e") -> SlotIsolationSpec:
    return SlotIsolationSpec(slot_id, "best-effort", memory_bytes=64 * MiB)


def status_field(pid: int, name: str) -> str:
    """One field of /proc/PID/status, e.g. Cpus_allowed_list."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"{name} not in /proc/{pid}/status")


#: A worker as the launch leaves it: pinned to its cpuset by sched_setaffinity, with a second thread.
PINNED_WITH_A_THREAD = """
import threading, time
os.sched_setaffinity(0, os.sched_getaffinity(0))
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
time.sleep(60)
"""


def threads_cpus(pid: int) -> dict[int, str]:
    """Each thread of ``pid`` -> its Cpus_allowed_list."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                found[int(task.name)] = line.split(":", 1)[1].strip()
    return found
