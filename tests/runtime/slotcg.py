"""A throwaway cgroup v1 slot on the real kernel, implementing runtime's SlotCgroup protocol.

Stands in for the cgroups package's manager in runtime's tests: cpuset, memory, pids and freezer
directories named ``natest<pid>-<n>``; kill_all freezes the slot, SIGKILLs every task, thaws it and
waits for the tasks to go.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("cpuset", "memory", "pids", "freezer")
_numbers = itertools.count()


def _root_value(name: str) -> str:
    return (ROOT / "cpuset" / name).read_text().strip()


class V1Slot:
    def __init__(self, cpus: str | None = None, memory_bytes: int | None = None) -> None:
        self.name = f"natest{os.getpid()}-{next(_numbers)}"
        self.dirs = {ctrl: ROOT / ctrl / self.name for ctrl in CONTROLLERS}
        for path in self.dirs.values():
            path.mkdir()
        (self.dirs["cpuset"] / "cpuset.cpus").write_text(cpus or _root_value("cpuset.cpus"))
        (self.dirs["cpuset"] / "cpuset.mems").write_text(_root_value("cpuset.mems"))
        if memory_bytes is not None:
            (self.dirs["memory"] / "memory.limit_in_bytes").write_text(str(memory_bytes))
            # No swap to escape into: the limit must end in an OOM kill.
            swap = self.dirs["memory"] / "memory.memsw.limit_in_bytes"
            if swap.exists():
                swap.write_text(str(memory_bytes))
            (self.dirs["memory"] / "memory.swappiness").write_text("0")

    @property
    def procs_files(self) -> tuple[str, ...]:
        return tuple(str(path / "cgroup.procs") for path in self.dirs.values())

    @property
    def oom_events(self) -> str:
        return str(self.dirs["memory"] / "memory.oom_control")

    def pids(self) -> list[int]:
        text = (self.dirs["pids"] / "cgroup.procs").read_text()
        return [int(line) for line in text.split()]

    def oom_kill_count(self) -> int:
        for line in Path(self.oom_events).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def signal_all(self, sig: int, but: int | None = None) -> None:
        for pid in self.pids():
            if pid != but:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)

    def kill_all(self, timeout: float) -> None:
        state = self.dirs["freezer"] / "freezer.state"
        state.write_text("FROZEN")
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        state.write_text("THAWED")
        deadline = time.monotonic() + timeout
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.01)

    def remove(self) -> None:
        if self.pids():
            self.kill_all(5.0)
        for path in self.dirs.values():
            for _ in range(100):
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)
