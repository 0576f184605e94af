"""Host partitioning's pure decision (plan_host) and the partitioner's record and passes, on plain data
and in-memory backends: what moves, what is put back, what a crash leaves and how the next start
repairs it."""

from __future__ import annotations

import errno
import json
import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from nodeagent.errors import ConfigError
from nodeagent.isolation.host import (
    PF_KTHREAD,
    PF_NO_SETAFFINITY,
    PF_WQ_WORKER,
    Entry,
    HostPartitioner,
    HostRecord,
    HostView,
    Knob,
    RecordFile,
    Task,
    confine,
    plan_host,
    validate_parts,
)

F = frozenset
ALL = F({0, 1, 2, 3})


def task(tid: int, cpus: frozenset[int] = ALL, *, pid: int | None = None, ppid: int = 1, **kw: Any) -> Task:
    return Task(
        tid=tid, pid=pid or tid, ppid=ppid, start=1000 + tid, comm=kw.pop("comm", f"t{tid}"), cpus=cpus, **kw
    )


INIT = task(1, ppid=0, comm="init")
KTHREADD = task(2, ppid=0, comm="kthreadd", flags=PF_KTHREAD)


def targets(
    view: HostView, exclusive: frozenset[int], record: HostRecord | None = None, **kw: Any
) -> dict[str, frozenset[int]]:
    plan = plan_host(view, exclusive, record or HostRecord(), **kw)
    return {m.ident: m.to for m in plan.moves}


# =========================================================================== confine


@pytest.mark.parametrize(
    ("wish", "exclusive", "expected"),
    [
        pytest.param(ALL, F({3}), F({0, 1, 2}), id="all-cpus-lose-the-exclusive-one"),
        pytest.param(F({2}), F({3}), F({2}), id="a-pin-elsewhere-is-kept"),
        pytest.param(F({1, 3}), F({3}), F({1}), id="a-pin-is-narrowed"),
        pytest.param(F({3}), F({3}), F({0, 1, 2}), id="pinned-to-exclusive-gets-the-host"),
        pytest.param(F(), F({3}), F({0, 1, 2}), id="empty-means-all"),
        pytest.param(F({7}), F({3}), F({0, 1, 2}), id="offline-cpus-are-dropped"),
    ],
)
def test_confine_narrows_and_keeps_a_pin(
    wish: frozenset[int], exclusive: frozenset[int], expected: frozenset[int]
) -> None:
    assert confine(wish, ALL, exclusive) == expected


# =========================================================================== plan_host


def test_every_task_outside_slots_leaves_the_exclusive_cpus_and_is_recorded() -> None:
    view = HostView(ALL, (INIT, KTHREADD, task(10), task(11, F({2, 3})), task(12, in_slot=True, cpus=F({3}))))
    plan = plan_host(view, F({3}), HostRecord())
    assert {m.ident: m.to for m in plan.moves} == {
        INIT.key: F({0, 1, 2}),
        KTHREADD.key: F({0, 1, 2}),
        task(10).key: F({0, 1, 2}),
        task(11).key: F({2}),
    }
    assert plan.record.tasks[task(11).key] == Entry(F({2, 3}), F({2}), "t11", 11)
    assert task(12).key not in plan.record.tasks  # a slot's worker: its cpuset decides
    assert plan.record.exclusive == F({3})
    assert plan.host_cpus == F({0, 1, 2})


def test_nothing_exclusive_puts_back_what_the_record_names_and_nothing_else() -> None:
    record = HostRecord(F({3}), {INIT.key: Entry(ALL, F({0, 1, 2})), task(10).key: Entry(F({1, 3}), F({1}))})
    view = HostView(ALL, (replace(INIT, cpus=F({0, 1, 2})), task(10, F({1})), task(11, F({0}))))
    plan = plan_host(view, F(), record)
    assert {m.ident: m.to for m in plan.moves} == {INIT.key: ALL, task(10).key: F({1, 3})}
    # Entries stay until the put-back has succeeded (the partitioner drops them after the writes).
    assert set(plan.record.tasks) == {INIT.key, task(10).key}
    assert plan.record.exclusive == F()


def test_a_task_that_changed_its_own_affinity_since_keeps_its_owners_choice() -> None:
    record = HostRecord(F({3}), {task(10).key: Entry(ALL, F({0, 1, 2}))})
    widened = HostView(ALL, (task(10, ALL),))
    # While confined: widened again -> confined again, and what it asked for is what it gets back later.
    plan = plan_host(widened, F({3}), record)
    assert [(m.ident, m.to) for m in plan.moves] == [(task(10).key, F({0, 1, 2}))]
    narrowed = HostView(ALL, (task(10, F({0})),))
    # Narrowed by its owner: nothing to do now, and at release it keeps {0}, not the old "before".
    assert plan_host(narrowed, F({3}), record).moves == ()
    assert plan_host(narrowed, F(), record).moves == ()


def test_a_task_born_confined_inherits_its_ancestors_wish() -> None:
    record = HostRecord(F({3}), {INIT.key: Entry(ALL, F({0, 1, 2}))})
    shell = task(50, F({0, 1, 2}), ppid=1)
    child = task(51, F({0, 1, 2}), ppid=50)
    thread = task(52, F({0, 1, 2}), pid=51, ppid=50)
    pinned_by_owner = task(53, F({0}), ppid=50)
    view = HostView(ALL, (replace(INIT, cpus=F({0, 1, 2})), shell, child, thread, pinned_by_owner))
    assert plan_host(view, F({3}), record).moves == ()  # born confined: nothing to move, nothing to record
    assert targets(view, F(), record) == {INIT.key: ALL, shell.key: ALL, child.key: ALL, thread.key: ALL}


def test_a_change_of_the_exclusive_set_moves_from_the_wish_not_from_what_is_held() -> None:
    record = HostRecord(F({3}), {task(10).key: Entry(ALL, F({0, 1, 2}))})
    view = HostView(ALL, (task(10, F({0, 1, 2})),))
    # CPU 3 freed, CPU 1 taken: the task gets 0,2,3, not 0,2 (what it holds minus 1).
    assert targets(view, F({1}), record) == {task(10).key: F({0, 2, 3})}


def test_per_cpu_kernel_threads_are_reported_and_never_moved() -> None:
    ksoftirqd = task(20, F({3}), ppid=2, comm="ksoftirqd/3", flags=PF_KTHREAD | PF_NO_SETAFFINITY)
    worker = task(21, ALL, ppid=2, comm="kworker/u8:1", flags=PF_KTHREAD | PF_NO_SETAFFINITY | PF_WQ_WORKER)
    unbound = task(22, ALL, ppid=2, comm="khugepaged", flags=PF_KTHREAD)
    plan = plan_host(HostView(ALL, (ksoftirqd, worker, unbound)), F({3}), HostRecord())
    assert [m.ident for m in plan.moves] == [unbound.key]
    # The unbound kworker follows the workqueue cpumask; only the per-CPU thread is reported.
    assert plan.immovable == ("kernel thread ksoftirqd/3 (pid 20) is bound to CPU(s) 3",)


@pytest.mark.parametrize(
    ("parts", "moved"),
    [
        pytest.param({"processes"}, {"init", "t10", "cgroup:system.slice"}, id="processes"),
        pytest.param({"kernel-threads"}, {"kthreadd"}, id="kernel-threads"),
        pytest.param({"irqs"}, {"irq:24", "irq-default:default"}, id="irqs"),
        pytest.param({"workqueue"}, {"workqueue:unbound"}, id="workqueue"),
    ],
)
def test_parts_choose_what_moves(parts: set[str], moved: set[str]) -> None:
    view = HostView(
        ALL,
        (INIT, KTHREADD, task(10)),
        (
            Knob("irq", "24", ALL, "virtio0"),
            Knob("irq-default", "default", ALL),
            Knob("workqueue", "unbound", ALL),
            Knob("cgroup", "system.slice", F()),
        ),
    )
    plan = plan_host(view, F({3}), HostRecord(), validate_parts(parts))
    names = {m.item.comm if isinstance(m.item, Task) else m.ident for m in plan.moves}
    assert names == moved


def test_cgroup_confined_tasks_keep_their_affinity_and_an_empty_cpuset_means_all() -> None:
    view = HostView(ALL, (task(10, cgroup_confined=True),), (Knob("cgroup", "system.slice", F()),))
    plan = plan_host(view, F({3}), HostRecord())
    assert [(m.ident, m.to) for m in plan.moves] == [("cgroup:system.slice", F({0, 1, 2}))]
    restored = plan_host(
        replace(view, knobs=(Knob("cgroup", "system.slice", F({0, 1, 2})),)), F(), plan.record
    )
    assert [(m.ident, m.to) for m in restored.moves] == [("cgroup:system.slice", F())]


def test_when_every_cpu_is_exclusive_the_host_is_left_alone_and_told_why() -> None:
    plan = plan_host(HostView(F({0, 1}), (INIT,)), F({0, 1}), HostRecord())
    assert plan.moves == ()
    assert "reserve a CPU" in plan.problems[0]


def test_parts_must_be_known() -> None:
    with pytest.raises(
        ConfigError, match="'irq' unknown; use any of processes, kernel-threads, workqueue, irqs"
    ):
        validate_parts(["irq"])


# =========================================================================== the record file


def test_record_round_trips_and_refuses_garbage_with_advice(tmp_path: Path) -> None:
    record = HostRecord(
        F({3}),
        {"10:1010": Entry(ALL, F({0, 1, 2}), "sshd", 10)},
        {"irq:24": Entry(ALL, F({0}), "virtio0")},
        {"pid": 7},
    )
    file = RecordFile(tmp_path / "host-partition.json")
    file.save(record)
    assert file.load() == record
    file.save(HostRecord())
    assert not file.path.exists()  # nothing recorded: no file
    file.path.write_text("{")
    with pytest.raises(ConfigError, match="not JSON"):
        file.load()
    file.path.write_text(
        json.dumps({"schema": "nodeagent.host-partition/v1", "tasks": {"1:1": {"before": "x"}}})
    )
    with pytest.raises(ConfigError, match=r"malformed .* move it aside"):
        file.load()


# =========================================================================== the partitioner, in memory


class MemoryTasks:
    """A host's tasks in memory; ``refuse`` maps a tid to the errno its write gets."""

    def __init__(self, tasks: Sequence[Task], refuse: dict[int, int] | None = None) -> None:
        self.tasks = {t.tid: t for t in tasks}
        self.refuse = refuse or {}
        self.writes: list[tuple[int, frozenset[int]]] = []

    def read(self) -> list[Task]:
        return list(self.tasks.values())

    def write(self, item: Any, cpus: frozenset[int]) -> None:
        if item.tid in self.refuse:
            raise OSError(self.refuse[item.tid], "refused")
        self.writes.append((item.tid, cpus))
        self.tasks[item.tid] = replace(self.tasks[item.tid], cpus=cpus)


class MemoryIrqs:
    kinds = ("irq",)

    def __init__(self, irqs: dict[str, frozenset[int]], managed: set[str]) -> None:
        self.irqs = irqs
        self.managed = managed

    def read(self) -> list[Knob]:
        return [Knob("irq", k, v, f"dev{k}") for k, v in self.irqs.items()]

    def write(self, item: Any, cpus: frozenset[int]) -> None:
        if item.key in self.managed:
            raise OSError(errno.EIO, "Input/output error")
        self.irqs[item.key] = cpus


class Recording:
    """A notifier that remembers what it was told."""

    def __init__(self) -> None:
        self.told: list[frozenset[int]] = []

    def notify(self, exclusive: frozenset[int], record: Any) -> tuple[Any, tuple[str, ...]]:
        self.told.append(exclusive)
        return ({"banned": sorted(exclusive)} if exclusive else None), ()


def partitioner(
    tmp_path: Path, tasks: MemoryTasks, irqs: MemoryIrqs | None = None, **kw: Any
) -> HostPartitioner:
    return HostPartitioner(
        lambda: ALL, tasks, [irqs] if irqs else [], RecordFile(tmp_path / "host-partition.json"), **kw
    )


def test_confine_then_release_leaves_the_host_as_it_was_and_no_record(tmp_path: Path) -> None:
    tasks = MemoryTasks([INIT, KTHREADD, task(10, F({1, 3})), task(11, F({0}))])
    irqs = MemoryIrqs({"24": ALL, "25": F({3}), "26": F({3})}, managed={"26"})
    told = Recording()
    p = partitioner(tmp_path, tasks, irqs, notifiers=[told])
    before = {t: v.cpus for t, v in tasks.tasks.items()}
    report = p.apply(F({3}))
    assert {t: v.cpus for t, v in tasks.tasks.items()} == {
        1: F({0, 1, 2}),
        2: F({0, 1, 2}),
        10: F({1}),
        11: F({0}),
    }
    assert irqs.irqs == {"24": F({0, 1, 2}), "25": F({0, 1, 2}), "26": F({3})}
    assert report.moved == {"task": 3, "irq": 2}
    assert report.immovable == [
        "interrupt 26 (dev26) stays on CPU(s) 3: "
        "the kernel keeps its affinity (a managed or per-CPU interrupt)"
    ]
    on_disk = json.loads((tmp_path / "host-partition.json").read_text())
    assert on_disk["exclusive"] == "3"
    assert set(on_disk["knobs"]) == {"irq:24", "irq:25"}
    assert on_disk["irqbalance"] == {"banned": [3]}
    p.apply(F())
    assert {t: v.cpus for t, v in tasks.tasks.items()} == before
    assert irqs.irqs == {"24": ALL, "25": F({3}), "26": F({3})}
    assert not (tmp_path / "host-partition.json").exists()
    assert told.told == [F({3}), F()]


def test_the_record_is_on_disk_before_the_first_change(tmp_path: Path) -> None:
    seen: list[bool] = []
    tasks = MemoryTasks([INIT, task(10)])
    original_write = tasks.write

    def write(item: Any, cpus: frozenset[int]) -> None:
        seen.append((tmp_path / "host-partition.json").exists())
        original_write(item, cpus)

    tasks.write = write  # type: ignore[method-assign]
    partitioner(tmp_path, tasks).apply(F({3}))
    assert seen == [True, True]


def test_a_crash_mid_pass_is_repaired_by_the_next_start(tmp_path: Path) -> None:
    tasks = MemoryTasks([INIT, task(10), task(11)])

    class Crash(Exception):
        pass

    original_write = tasks.write
    calls = 0

    def dying_write(item: Any, cpus: frozenset[int]) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise Crash  # the agent dies between two writes
        original_write(item, cpus)

    tasks.write = dying_write  # type: ignore[method-assign]
    with pytest.raises(Crash):
        partitioner(tmp_path, tasks).apply(F({3}))
    tasks.write = original_write  # type: ignore[method-assign]
    # A new agent on the same state directory; no exclusive slot survived: everything goes back.
    partitioner(tmp_path, tasks).apply(F())
    assert all(t.cpus == ALL for t in tasks.tasks.values())
    assert not (tmp_path / "host-partition.json").exists()


def test_a_restart_with_slots_left_keeps_the_confinement_and_its_record(tmp_path: Path) -> None:
    tasks = MemoryTasks([INIT, task(10)])
    partitioner(tmp_path, tasks).apply(F({3}))
    again = partitioner(tmp_path, tasks)
    report = again.apply(F({3}))
    assert report.moved == {}
    assert again.recorded().tasks[task(10).key] == Entry(ALL, F({0, 1, 2}), "t10", 10)
    again.restore()
    assert all(t.cpus == ALL for t in tasks.tasks.values())


def test_sweep_confines_what_widened_and_refusals_are_reported_not_recorded(tmp_path: Path) -> None:
    tasks = MemoryTasks([INIT, task(10), task(11, F({3}))], refuse={11: errno.EINVAL})
    p = partitioner(tmp_path, tasks)
    assert p.sweep() is None  # nothing applied yet
    report = p.apply(F({3}))
    assert report.immovable == ["task t11 (pid 11) stays on CPU(s) 3: its cpuset or the kernel pins it there"]
    assert task(11).key not in p.recorded().tasks
    tasks.tasks[10] = replace(tasks.tasks[10], cpus=ALL)  # it widened its own affinity
    swept = p.sweep()
    assert swept is not None
    assert swept.moved == {"task": 1}
    assert tasks.tasks[10].cpus == F({0, 1, 2})
    p.restore()
    assert tasks.tasks[10].cpus == ALL


def test_a_task_that_exits_before_its_write_is_not_an_error(tmp_path: Path) -> None:
    tasks = MemoryTasks([INIT, task(10)], refuse={10: errno.ESRCH})
    report = partitioner(tmp_path, tasks).apply(F({3}))
    assert report.immovable == []
    assert report.moved == {"task": 1}
    assert set(partitioner(tmp_path, tasks).recorded().tasks) == {INIT.key}


def test_a_sweep_that_races_an_allocation_never_puts_back_what_it_confined(tmp_path: Path) -> None:
    """The sweep reads the exclusive set under the partitioner's lock: one that was waiting while an
    allocation confined the host sweeps for the new set, not the one it saw before waiting."""
    tasks = MemoryTasks([INIT, task(10)])
    p = partitioner(tmp_path, tasks)
    p.apply(F())  # start-up: nothing exclusive
    entered = threading.Event()
    release = threading.Event()
    original_read = tasks.read

    def slow_read() -> list[Task]:
        entered.set()
        release.wait(5)
        return original_read()

    tasks.read = slow_read  # type: ignore[method-assign]
    allocation = threading.Thread(target=p.apply, args=(F({3}),))
    allocation.start()
    assert entered.wait(5)
    tasks.read = original_read  # type: ignore[method-assign]
    sweeper = threading.Thread(target=p.sweep)
    sweeper.start()  # blocks on the lock the allocation holds
    release.set()
    allocation.join(5)
    sweeper.join(5)
    assert tasks.tasks[10].cpus == F({0, 1, 2})
    assert tasks.tasks[1].cpus == F({0, 1, 2})
