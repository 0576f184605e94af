"""Memory traffic counters: the bookkeeping on fake counters and a fake /proc, then the real
perf_event_open(2) with the task-clock software event (this host's CPU exposes no PMU)."""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent.isolation import memory_traffic
from nodeagent.isolation.memory_traffic import (
    LLC_MISSES,
    TASK_CLOCK,
    MemoryTraffic,
    PerfEvent,
    open_counter,
    probe,
    scaled,
)

OLD = 0  # a start time (clock ticks since boot) before any counter was opened
NEW = 10**15  # one after every counter was opened


class FakePerf:
    """Counters that are real fds on /dev/null (so closing them is real), valued per thread."""

    def __init__(self) -> None:
        self.values: dict[int, int | tuple[int, int, int]] = {}  # tid -> value or (value, enabled, running)
        self.fail: dict[int, int] = {}  # tid -> errno its open fails with
        self.opens: list[int] = []  # tids, one per open tried
        self.tid_of: dict[int, int] = {}

    def open(self, event: PerfEvent, tid: int) -> int:
        assert event == LLC_MISSES
        self.opens.append(tid)
        if tid in self.fail:
            raise OSError(self.fail[tid], os.strerror(self.fail[tid]))
        fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        self.tid_of[fd] = tid
        return fd

    def read(self, fd: int) -> tuple[int, int, int]:
        os.fstat(fd)  # EBADF if the code under test reads a counter it closed
        value = self.values.get(self.tid_of[fd], 0)
        return (value, 1, 1) if isinstance(value, int) else value


def add_process(
    proc: Path, pid: int, *, ppid: int = 1, start: int = OLD, threads: tuple[int, ...] = ()
) -> None:
    """``<proc>/<pid>/stat`` (comm with a space and a parenthesis, as the kernel allows) and one
    ``task/<tid>/`` directory per thread (the pid itself first)."""
    fields = ["S", str(ppid), *["0"] * 17, str(start), "0", "0"]
    (proc / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "stat").write_text(f"{pid} (w) {pid}) {' '.join(fields)}\n")
    for tid in (pid, *threads):
        (proc / str(pid) / "task" / str(tid)).mkdir(parents=True)


@pytest.fixture
def perf() -> FakePerf:
    return FakePerf()


@pytest.fixture
def traffic(tmp_path: Path, perf: FakePerf) -> Iterator[MemoryTraffic]:
    counters = MemoryTraffic(proc_root=tmp_path, open_counter=perf.open, read_counter=perf.read)
    yield counters
    counters.close()


def test_a_new_process_gets_one_counter_per_thread(
    tmp_path: Path, perf: FakePerf, traffic: MemoryTraffic
) -> None:
    add_process(tmp_path, 100, threads=(101, 102))
    perf.values = {100: 1, 101: 2, 102: 3}
    assert traffic.read("s", [100]) == 6 * 64
    assert sorted(perf.opens) == [100, 101, 102]
    assert traffic.open_counters() == 3
    perf.values[101] = 12
    assert traffic.read("s", [100]) == 16 * 64
    assert len(perf.opens) == 3  # nothing opened again


def test_a_child_created_after_the_open_is_counted_by_inheritance(
    tmp_path: Path, perf: FakePerf, traffic: MemoryTraffic
) -> None:
    add_process(tmp_path, 100)
    traffic.read("s", [100])
    add_process(tmp_path, 200, ppid=100, start=NEW, threads=(201,))
    add_process(tmp_path, 300, ppid=250, start=NEW)  # its parent 250 (not in the slot) is 200's child
    add_process(tmp_path, 250, ppid=200, start=NEW)
    traffic.read("s", [100, 200, 300])
    assert perf.opens == [100]
    assert traffic.open_counters() == 1


def test_a_child_forked_before_its_parents_counter_opened_gets_its_own(
    tmp_path: Path, perf: FakePerf, traffic: MemoryTraffic
) -> None:
    # Listed together (or forked between the listing and the open): the child was not inherited.
    add_process(tmp_path, 100)
    add_process(tmp_path, 200, ppid=100, start=OLD)
    traffic.read("s", [200, 100])
    assert sorted(perf.opens) == [100, 200]


def test_a_process_that_left_is_retired_and_the_total_never_drops(
    tmp_path: Path, perf: FakePerf, traffic: MemoryTraffic
) -> None:
    add_process(tmp_path, 100)
    add_process(tmp_path, 200)
    perf.values = {100: 10, 200: 5}
    assert traffic.read("s", [100, 200]) == 15 * 64
    perf.values = {100: 11, 200: 7}
    fds = list(perf.tid_of)
    assert traffic.read("s", [100]) == 18 * 64  # 200's last value (7) stays in the total
    assert traffic.open_counters() == 1
    assert traffic.read("s", []) == 18 * 64
    assert traffic.open_counters() == 0
    for fd in fds:
        with pytest.raises(OSError, match="Bad file descriptor"):
            os.fstat(fd)


def test_descendants_of_a_process_that_left_get_counters_of_their_own(
    tmp_path: Path, perf: FakePerf, traffic: MemoryTraffic
) -> None:
    # Closing a counter ends its inherited copies too: those still in the slot are counted anew.
    add_process(tmp_path, 100)
    traffic.read("s", [100])
    add_process(tmp_path, 200, ppid=100, start=NEW)
    perf.values = {100: 30}
    assert traffic.read("s", [100, 200]) == 30 * 64
    assert traffic.read("s", [200]) == 30 * 64
    assert perf.opens == [100, 200]
    perf.values[200] = 4
    assert traffic.read("s", [200]) == 34 * 64


def test_forget_closes_the_counters_of_other_slots(
    tmp_path: Path, perf: FakePerf, traffic: MemoryTraffic
) -> None:
    add_process(tmp_path, 100)
    add_process(tmp_path, 200)
    traffic.read("a", [100])
    traffic.read("b", [200])
    (fd_a, fd_b) = perf.tid_of
    traffic.forget(["b"])
    assert traffic.open_counters() == 1
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(fd_a)
    os.fstat(fd_b)
    assert traffic.read("a", []) is None  # forgotten: it starts over


def test_no_pmu_is_not_retried_and_reads_none(
    tmp_path: Path, perf: FakePerf, traffic: MemoryTraffic, caplog: pytest.LogCaptureFixture
) -> None:
    add_process(tmp_path, 100, threads=(101,))
    add_process(tmp_path, 200)
    perf.fail = {100: errno.ENOENT, 101: errno.ENOENT, 200: errno.ENOENT}
    with caplog.at_level(logging.WARNING, logger=memory_traffic.__name__):
        for _ in range(3):
            assert traffic.read("s", [100]) is None
        assert traffic.read("s", [100, 200]) is None
    assert perf.opens == [100]  # the host has no PMU: not one more try
    assert traffic.unavailable is not None
    assert "no hardware PMU" in traffic.unavailable
    assert traffic.open_counters() == 0
    assert len(caplog.records) == 1
    assert "no hardware PMU" in caplog.records[0].getMessage()


def test_a_denied_process_is_not_retried_but_others_are_counted(
    tmp_path: Path, perf: FakePerf, traffic: MemoryTraffic, caplog: pytest.LogCaptureFixture
) -> None:
    add_process(tmp_path, 100, threads=(101,))
    add_process(tmp_path, 200)
    add_process(tmp_path, 300)
    perf.fail = {101: errno.EACCES, 300: errno.EPERM}
    perf.values = {200: 3}
    with caplog.at_level(logging.WARNING, logger=memory_traffic.__name__):
        assert traffic.read("s", [100]) is None
        assert traffic.read("s", [100, 200, 300]) == 3 * 64
        assert traffic.read("s", [100, 200, 300]) == 3 * 64
    assert perf.opens == [100, 101, 200, 300]
    assert traffic.open_counters() == 1  # 100's first thread's counter was closed with its failure
    assert traffic.unavailable is None
    assert len(caplog.records) == 1
    assert "not allowed" in caplog.records[0].getMessage()


def test_a_thread_or_process_that_ended_is_skipped(
    tmp_path: Path, perf: FakePerf, traffic: MemoryTraffic
) -> None:
    add_process(tmp_path, 100, threads=(101,))
    perf.fail = {101: errno.ESRCH}  # ended between the listing and the open
    perf.values = {100: 2}
    assert traffic.read("s", [100, 999]) == 2 * 64  # 999: no /proc entry
    assert traffic.open_counters() == 1


def test_multiplexed_counts_are_scaled_and_never_go_back(
    tmp_path: Path, perf: FakePerf, traffic: MemoryTraffic
) -> None:
    assert scaled(100, 400, 100) == 400
    assert scaled(100, 400, 400) == 100
    assert scaled(100, 400, 0) == 0
    add_process(tmp_path, 100)
    perf.values = {100: (100, 300, 100)}
    assert traffic.read("s", [100]) == 300 * 64
    perf.values = {100: (120, 400, 200)}  # the estimate dips to 240
    assert traffic.read("s", [100]) == 300 * 64


def test_an_unknown_machine_has_no_syscall(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory_traffic, "SYSCALL_NUMBERS", {})
    with pytest.raises(OSError, match="no perf_event_open syscall number") as caught:
        open_counter(TASK_CLOCK, 0)
    assert caught.value.errno == errno.ENOSYS
    reason = probe(TASK_CLOCK)
    assert reason is not None
    assert "syscall number" in reason
    assert "kernel built" not in reason


# ---------------------------------------------------------------- the real system call

# Waits for a line, then burns 0.3 s of CPU time in a new thread and 0.3 s in a forked child
# (whose pid it prints first), both created after the parent's counter was opened.
BURNER = """
import os, sys, threading, time
sys.stdin.readline()
time.sleep(0.05)  # a later clock tick than the counter's opening
def burn(clock):
    end = clock() + 0.3
    while clock() < end:
        pass
thread = threading.Thread(target=burn, args=(time.thread_time,))
thread.start()
child = os.fork()
if child == 0:
    burn(time.process_time)
    os._exit(0)
print(child, flush=True)
thread.join()
os.waitpid(child, 0)
"""


@pytest.mark.root
def test_probe() -> None:
    assert probe(TASK_CLOCK) is None
    reason = probe(LLC_MISSES)
    assert reason is None or reason.startswith("perf_event_open(cache-misses): ")


@pytest.mark.root
def test_threads_and_children_are_counted_by_inheritance() -> None:
    traffic = MemoryTraffic(event=TASK_CLOCK, bytes_per_event=1)
    proc = subprocess.Popen(
        [sys.executable, "-c", BURNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdin is not None
    assert proc.stdout is not None
    grandchild = None
    try:
        first = traffic.read("s", [proc.pid])
        assert first is not None
        counters = traffic.open_counters()
        assert counters >= 1
        proc.stdin.write("go\n")
        proc.stdin.flush()
        grandchild = int(proc.stdout.readline())
        # The forked child in the slot too: it descends from a counted process, so nothing opens.
        during = traffic.read("s", [proc.pid, grandchild])
        assert during is not None
        assert traffic.open_counters() == counters
        assert proc.wait(timeout=30) == 0
        done = traffic.read("s", [proc.pid])
        assert done is not None
        assert first <= during < done
        # The thread's and the child's 0.3 s each (task-clock counts nanoseconds on CPU).
        assert done >= 0.6e9
        assert traffic.read("s", []) == done
        assert traffic.open_counters() == 0
    finally:
        traffic.close()
        if proc.poll() is None:
            if grandchild is not None:  # still our child's child, so the pid is still its
                os.kill(grandchild, signal.SIGKILL)
            proc.kill()
            proc.wait(timeout=10)
        proc.stdin.close()
        proc.stdout.close()
