"""Host partitioning on the real kernel (this host: cgroup v1 or hybrid, so processes move by their
affinity), scoped to processes the test starts: this machine is shared, so nothing else on it (PID 1,
other sessions, interrupts, the workqueue mask) is touched here. The cgroup v2 VM tests
(tests/isolation/v2vm/test_host_v2.py) partition a whole throwaway host, interrupts included.

A busy process started outside any slot must never run on the exclusive CPU while the slot lives
(sampled from /proc/PID/stat field 39 and its affinity), must get its CPUs back after release, and
an agent killed with SIGKILL must leave a record from which the next start makes the host
consistent with the slots that exist.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nodeagent.cgroups import detect
from nodeagent.isolation.host import HostPartitioner
from nodeagent.isolation.isolator import SlotIsolator
from nodeagent.isolation.partitioning import RECORD_NAME, host_partitioner
from nodeagent.isolation.slot_spec import IsolatorConfig
from tests.isolation.specs import guaranteed

pytestmark = pytest.mark.root

PARENT = f"natest{os.getpid()}host.slice"
BUSY = "import os\nif os.fork() == 0:\n    pass\nwhile True:\n    pass\n"  # a busy parent and a busy child


def ppid(pid: int) -> int | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(text.rpartition(")")[2].split()[1])


def last_cpu(pid: int) -> int | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(text.rpartition(")")[2].split()[36])  # field 39: the CPU it last ran on


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


@pytest.fixture
def cpus() -> tuple[int, int]:
    online = sorted(os.sched_getaffinity(0))
    if len(online) < 2:
        pytest.skip("needs two CPUs: one exclusive, one for the rest")
    return online[0], online[-1]


@pytest.fixture
def busy() -> Iterator[subprocess.Popen[bytes]]:
    """A CPU-bound process (and its CPU-bound child), started outside every slot, free on all CPUs."""
    proc = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        deadline = time.monotonic() + 10
        while not children(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        yield proc
    finally:
        for child in children(proc.pid):
            os.kill(child, signal.SIGKILL)  # our own grandchild, by pid
        proc.kill()
        proc.wait()


@pytest.fixture
def isolator() -> Iterator[SlotIsolator]:
    iso = SlotIsolator(detect(), IsolatorConfig(cgroup_parent=PARENT))
    try:
        yield iso
    finally:
        iso.remove_all()


def scoped(started: subprocess.Popen[bytes]) -> Callable[[int], bool]:
    """Only the test's process tree: the busy process and its descendants."""

    def ours(pid: int) -> bool:
        seen = pid
        for _ in range(8):
            if seen == started.pid:
                return True
            parent = ppid(seen)
            if parent is None or parent <= 1:
                return False
            seen = parent
        return False

    return ours


def partitioner(state: Path, busy: subprocess.Popen[bytes]) -> HostPartitioner:
    return host_partitioner(
        detect(), state_dir=state, cgroup_parent=PARENT, parts=["processes"], only=scoped(busy)
    )


def sample(pids: list[int], seconds: float) -> set[int]:
    """The CPUs the processes were seen on, sampled every millisecond or so."""
    seen: set[int] = set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for pid in pids:
            cpu = last_cpu(pid)
            if cpu is not None:
                seen.add(cpu)
        time.sleep(0.001)
    return seen


def test_a_busy_process_outside_slots_never_runs_on_the_exclusive_cpu_and_gets_it_back(
    tmp_path: Path, cpus: tuple[int, int], busy: subprocess.Popen[bytes], isolator: SlotIsolator
) -> None:
    shared, exclusive = cpus
    tree = [busy.pid, *children(busy.pid)]
    everywhere = frozenset(os.sched_getaffinity(busy.pid))
    assert exclusive in sample(tree, 1.0) or exclusive in everywhere  # free to run there before
    isolator.apply(guaranteed("g", frozenset({exclusive})))
    p = partitioner(tmp_path, busy)
    report = p.apply(frozenset({exclusive}))
    assert report.moved == {"task": len(tree)}
    assert all(exclusive not in os.sched_getaffinity(pid) for pid in tree)
    assert exclusive not in sample(tree, 1.5)
    assert (tmp_path / RECORD_NAME).exists()
    # The owner widens its own affinity; the sweep confines it again (there is no event for this).
    os.sched_setaffinity(busy.pid, everywhere)
    swept = p.sweep()
    assert swept is not None
    assert swept.moved == {"task": 1}
    assert exclusive not in os.sched_getaffinity(busy.pid)
    isolator.release("g")
    p.restore()
    # Put back to what its owner last asked for (everything), and the child to what it had.
    assert all(frozenset(os.sched_getaffinity(pid)) == everywhere for pid in tree)
    assert not (tmp_path / RECORD_NAME).exists()
    assert shared in everywhere


AGENT = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from nodeagent.cgroups import detect
    from nodeagent.isolation.partitioning import host_partitioner
    state, parent, root, cpu = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    def ours(pid):
        for _ in range(8):
            if pid == root:
                return True
            try:
                pid = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
            except OSError:
                return False
            if pid <= 1:
                return False
        return False
    p = host_partitioner(detect(), state_dir=state, cgroup_parent=parent, parts=["processes"], only=ours)
    p.apply(frozenset({cpu}))
    print("confined", flush=True)
    time.sleep(600)
    """
)


def test_after_the_agent_is_killed_the_next_start_matches_the_slots_that_exist(
    tmp_path: Path, cpus: tuple[int, int], busy: subprocess.Popen[bytes], isolator: SlotIsolator
) -> None:
    _, exclusive = cpus
    tree = [busy.pid, *children(busy.pid)]
    everywhere = frozenset(os.sched_getaffinity(busy.pid))
    isolator.apply(guaranteed("g", frozenset({exclusive})))
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, str(tmp_path), PARENT, str(busy.pid), str(exclusive)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert agent.stdout is not None
        assert agent.stdout.readline().strip() == "confined"
    finally:
        agent.kill()  # SIGKILL: nothing of the agent runs afterwards
        agent.wait()
        if agent.stdout is not None:
            agent.stdout.close()
    assert all(exclusive not in os.sched_getaffinity(pid) for pid in tree)
    # The slot survived the crash: the next start keeps the host confined (and moves nothing).
    restarted = partitioner(tmp_path, busy)
    assert restarted.apply(frozenset({exclusive})).moved == {}
    assert exclusive not in sample(tree, 0.5)
    # Its slot is released while no agent runs; the start after that finds none and puts the host back.
    isolator.release("g")
    assert partitioner(tmp_path, busy).apply(frozenset()).moved == {"task": len(tree)}
    assert all(frozenset(os.sched_getaffinity(pid)) == everywhere for pid in tree)
    assert not (tmp_path / RECORD_NAME).exists()
