"""Host partitioning's kernel backends on fake /proc, /sys and cgroup trees (and a fake irqbalance
socket): what each reads, what it writes, and the whole partitioner over them."""

from __future__ import annotations

import errno
import os
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent.isolation.foreign import CpuTicks, ForeignCpuMeter, foreign_seconds, parse_proc_stat
from nodeagent.isolation.host import PF_KTHREAD, PF_NO_SETAFFINITY, HostPartitioner, Knob, RecordFile
from nodeagent.isolation.host_kernel import (
    CgroupSiblings,
    Interrupts,
    IrqBalance,
    ProcTasks,
    Workqueue,
    format_mask,
    interrupt_counts,
    parse_mask,
    parse_stat,
    systemd_owns_cgroups,
)
from tests.trees import write_tree

F = frozenset


def stat_line(pid: int, comm: str, ppid: int, flags: int, start: int, *, cpu: int = 0) -> str:
    fields = ["S", str(ppid)] + ["0"] * 4 + [str(flags)] + ["0"] * 12 + [str(start)] + ["0"] * 16 + [str(cpu)]
    return f"{pid} ({comm}) " + " ".join(fields) + "\n"


def proc_task(pid: int, tid: int, comm: str, cpus: str, *, ppid: int = 1, flags: int = 0) -> dict[str, str]:
    base = f"{pid}/task/{tid}/"
    return {
        base + "stat": stat_line(tid, comm, ppid, flags, 100 + tid),
        base + "status": f"Name:\t{comm}\nCpus_allowed_list:\t{cpus}\n",
    }


def fake_proc(tmp_path: Path) -> Path:
    tree: dict[str, str] = {}
    tree.update(proc_task(1, 1, "init", "0-3", ppid=0))
    tree["1/cgroup"] = "0::/init.scope\n"
    tree.update(proc_task(2, 2, "kthreadd", "0-3", ppid=0, flags=PF_KTHREAD))
    tree["2/cgroup"] = "0::/\n"
    tree.update(proc_task(20, 20, "ksoftirqd/3", "3", ppid=2, flags=PF_KTHREAD | PF_NO_SETAFFINITY))
    tree["20/cgroup"] = "0::/\n"
    # a process with two threads, one with a name holding ") (" to check the stat parser
    tree.update(proc_task(30, 30, "web (x) 1", "0-3"))
    tree.update(proc_task(30, 31, "web (x) 1", "1-3"))
    tree["30/cgroup"] = "0::/system.slice/web.service\n"
    # a worker in one of the agent's slots (hybrid: the v1 cpuset line names it)
    tree.update(proc_task(40, 40, "worker", "3"))
    tree["40/cgroup"] = "3:cpuset:/nodeagent.slice/s1\n0::/\n"
    tree["self"] = "not a pid\n"
    return write_tree(tmp_path / "proc", tree)


def test_stat_parser_takes_the_command_name_up_to_its_last_parenthesis() -> None:
    comm, fields = parse_stat("31 (web (x) 1) S 1 0 0 0 0 64 0 0 0 0 0 0 0 0 0 0 0 0 131 0\n")
    assert comm == "web (x) 1"
    assert fields[1] == "1"
    assert fields[6] == "64"
    assert fields[19] == "131"


def test_proc_tasks_reads_every_thread_and_marks_slot_members_and_covered_cgroups(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path)
    covered = ProcTasks(
        proc, slot_parent="nodeagent.slice", covered=lambda path: path.startswith("/system.slice")
    )
    tasks = {t.tid: t for t in covered.read()}
    assert sorted(tasks) == [1, 2, 20, 30, 31, 40]
    assert tasks[31].pid == 30
    assert tasks[31].comm == "web (x) 1"
    assert tasks[31].cpus == F({1, 2, 3})
    assert tasks[2].kthreadd
    assert not tasks[2].pinned
    assert tasks[20].pinned
    assert tasks[20].kthread
    assert tasks[40].in_slot
    assert not tasks[30].in_slot
    assert tasks[30].cgroup_confined
    assert tasks[31].cgroup_confined
    assert not tasks[1].cgroup_confined
    only = ProcTasks(proc, only=lambda pid: pid == 30)
    assert sorted(t.tid for t in only.read()) == [30, 31]


def test_proc_tasks_treat_a_left_alone_subtree_as_the_slots(tmp_path: Path) -> None:
    """The kubelet's pods while NRI places their containers: their tasks keep their cpusets (v1: a
    container on an exclusive CPU would refuse the host's mask with EINVAL), not "kubepods-x"."""
    proc = fake_proc(tmp_path)
    extra = {
        **proc_task(50, 50, "pod", "3"),
        "50/cgroup": "3:cpuset:/kube/kubepods/pod1/c1\n0::/\n",
        **proc_task(51, 51, "near", "0-3"),
        "51/cgroup": "3:cpuset:/kube/kubepods-x\n0::/\n",
    }
    write_tree(proc, extra)
    tasks = {
        t.tid: t
        for t in ProcTasks(proc, slot_parent="nodeagent.slice", left_alone=["/kube/kubepods/"]).read()
    }
    assert tasks[50].in_slot
    assert tasks[40].in_slot
    assert not tasks[51].in_slot
    assert not {t.tid: t for t in ProcTasks(proc, slot_parent="nodeagent.slice").read()}[50].in_slot


def test_proc_tasks_writes_by_tid_and_refuses_a_reused_tid(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path)
    backend = ProcTasks(proc)
    web = next(t for t in backend.read() if t.tid == 31)
    backend.write(web, F({1}))
    assert next(t for t in backend.read() if t.tid == 31).cpus == F({1})
    (proc / "30/task/31/stat").write_text(stat_line(31, "other", 1, 0, 999))  # the tid was reused
    with pytest.raises(ProcessLookupError):
        backend.write(web, F({2}))


def test_interrupts_read_names_and_masks_and_write_each_format(tmp_path: Path) -> None:
    proc = write_tree(
        tmp_path / "proc",
        {
            "interrupts": "           CPU0       CPU1\n"
            " 24:          1          0  IO-APIC   5-edge      ACPI:Ged\n"
            " 36:          0    1672484 PCI-MSIX-0000:00:02.0   1-edge      virtio1-req.0\n"
            "LOC:    1220196    1253166   Local timer interrupts\n",
            "irq/24/smp_affinity_list": "0-1\n",
            "irq/36/smp_affinity_list": "1\n",
            "irq/2/": "",  # no smp_affinity_list: not listed
            "irq/default_smp_affinity": "3\n",
        },
    )
    backend = Interrupts(proc)
    knobs = backend.read()
    assert knobs == [
        Knob("irq", "24", F({0, 1}), "ACPI:Ged"),
        Knob("irq", "36", F({1}), "virtio1-req.0"),
        Knob("irq-default", "default", F({0, 1})),
    ]
    backend.write(knobs[1], F({0}))
    backend.write(knobs[2], F({0}))
    assert (proc / "irq/36/smp_affinity_list").read_text() == "0"
    assert (proc / "irq/default_smp_affinity").read_text() == "00000001"
    assert interrupt_counts((proc / "interrupts").read_text()) == {0: 1, 1: 1672484}


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("3", F({0, 1})), ("00000001,00000000\n", F({32})), ("ff,ffffffff", F(range(40))), ("0", F())],
)
def test_masks_round_trip_in_the_kernels_format(text: str, cpus: frozenset[int]) -> None:
    assert parse_mask(text) == cpus
    assert parse_mask(format_mask(cpus)) == cpus


def test_workqueue_mask(tmp_path: Path) -> None:
    sys_root = write_tree(tmp_path / "sys", {"devices/virtual/workqueue/cpumask": "f\n"})
    backend = Workqueue(sys_root)
    [knob] = backend.read()
    assert knob.cpus == F({0, 1, 2, 3})
    backend.write(knob, F({0, 1}))
    assert (sys_root / "devices/virtual/workqueue/cpumask").read_text() == "00000003"
    assert Workqueue(tmp_path / "nothing").read() == []


def cgroup_tree(tmp_path: Path) -> Path:
    return write_tree(
        tmp_path / "cgroup",
        {
            "cgroup.procs": "",
            "cpuset.cpus.effective": "0-3\n",
            "init.scope/cpuset.cpus": "",
            "user.slice/cpuset.cpus": "0-3\n",
            "nocpuset/cgroup.procs": "",  # no cpuset controller there: its tasks need their affinity moved
            "system.slice/cpuset.cpus": "",
            "system.slice/sshd.service/cpuset.cpus": "",
            "system.slice/nodeagent.service/cpuset.cpus": "",
            "system.slice/nodeagent.service/agent/cpuset.cpus": "",
            "system.slice/nodeagent.service/slots/cpuset.cpus": "0-3\n",
            "system.slice/nodeagent.service/slots/s1/cpuset.cpus": "3\n",
        },
    )


def test_cgroup_siblings_along_a_delegated_path_and_what_they_cover(tmp_path: Path) -> None:
    mount = cgroup_tree(tmp_path)
    deep = CgroupSiblings(mount, "system.slice/nodeagent.service/slots")
    assert deep.siblings() == [
        "init.scope",
        "user.slice",
        "system.slice/sshd.service",
        "system.slice/nodeagent.service/agent",
    ]
    assert deep.covers("/user.slice/user-0.slice/session-1.scope")
    assert deep.covers("/system.slice/sshd.service")
    assert not deep.covers("/")  # the root cgroup: only affinity moves its tasks
    assert not deep.covers("/nocpuset")
    assert not deep.covers("/system.slice/nodeagent.service/slots/s1")
    top = CgroupSiblings(mount, "nodeagent.slice")
    assert top.siblings() == ["init.scope", "system.slice", "user.slice"]
    with pytest.raises(Exception, match="must not be the root"):
        CgroupSiblings(mount, "/")


def test_cgroup_siblings_leave_a_kept_subtree_and_its_ancestors_whole(tmp_path: Path) -> None:
    """The kubelet's pods (``--cgroup-root=kube``) while NRI places them: neither ``kube`` nor
    ``kube/kubepods`` is confined (an ancestor's cpuset bounds every container below it), the
    cgroups beside them are, and a task below them is not covered."""
    mount = cgroup_tree(tmp_path)
    write_tree(
        mount,
        {
            "kube/cpuset.cpus": "",
            "kube/kubelet.service/cpuset.cpus": "",
            "kube/kubepods/cpuset.cpus": "",
            "kube/kubepods/besteffort/cpuset.cpus": "",
        },
    )
    kept = CgroupSiblings(mount, "nodeagent.slice", left_alone=["/kube/kubepods", ""])
    assert kept.siblings() == ["init.scope", "system.slice", "user.slice", "kube/kubelet.service"]
    assert kept.covers("/kube/kubelet.service")
    assert not kept.covers("/kube/kubepods/besteffort/pod1/c1")
    assert not kept.covers("/kube/kubepods")
    assert not kept.covers("/kube")  # an ancestor of a kept subtree: only affinity moves its tasks
    assert kept.covers("/system.slice/sshd.service")
    assert "kube" in CgroupSiblings(mount, "nodeagent.slice").siblings()
    # One inside the agent's own subtree changes nothing there: the agent's subtree stays whole.
    inside = CgroupSiblings(
        mount, "system.slice/nodeagent.service", left_alone=["system.slice/nodeagent.service/x"]
    )
    assert inside.siblings() == ["init.scope", "kube", "user.slice", "system.slice/sshd.service"]


def test_cgroup_siblings_write_directly_or_through_systemd(tmp_path: Path) -> None:
    mount = cgroup_tree(tmp_path)
    calls: list[list[str]] = []
    systemd = CgroupSiblings(
        mount, "nodeagent.slice", systemd=True, systemctl=lambda args: calls.append(list(args))
    )
    knobs = {k.key: k for k in systemd.read()}
    assert knobs["system.slice"].label == "system.slice"
    systemd.write(knobs["system.slice"], F({0, 1, 2}))
    systemd.write(knobs["system.slice"], F())
    assert calls == [
        ["set-property", "--runtime", "system.slice", "AllowedCPUs=0-2"],
        ["set-property", "--runtime", "system.slice", "AllowedCPUs=0-3"],  # the root's CPUs, named, first
        ["set-property", "--runtime", "system.slice", "AllowedCPUs="],
    ]
    plain = CgroupSiblings(mount, "nodeagent.slice")
    plain.write(next(k for k in plain.read() if k.key == "user.slice"), F({0, 1, 2}))
    assert (mount / "user.slice/cpuset.cpus").read_text() == "0-2"


def test_systemd_is_detected_by_pid_1_and_its_runtime_directory(tmp_path: Path) -> None:
    proc = write_tree(tmp_path / "proc", {"1/comm": "systemd\n"})
    run = write_tree(tmp_path / "run", {"systemd/system/": ""})
    assert systemd_owns_cgroups(proc, run)
    assert not systemd_owns_cgroups(proc, tmp_path / "elsewhere")
    (proc / "1/comm").write_text("bash\n")
    assert not systemd_owns_cgroups(proc, run)


# =========================================================================== irqbalance


@pytest.fixture
def irqbalance(tmp_path: Path) -> Iterator[tuple[Path, Path, list[tuple[str, int]]]]:
    """A fake irqbalance: its comm in a fake /proc and its UI socket; records (command, sender uid)."""
    proc = write_tree(tmp_path / "proc", {"4242/comm": "irqbalance\n", "1/comm": "init\n"})
    run = tmp_path / "run"
    (run / "irqbalance").mkdir(parents=True)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(run / "irqbalance" / "irqbalance4242.sock"))
    server.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    server.listen(4)
    received: list[tuple[str, int]] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                data, ancillary, _, _ = conn.recvmsg(1024, socket.CMSG_SPACE(struct.calcsize("3i")))
                uid = next(
                    struct.unpack("3i", d)[1] for lvl, typ, d in ancillary if typ == socket.SCM_CREDENTIALS
                )
                received.append((data.decode(), uid))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield proc, run, received
    server.shutdown(socket.SHUT_RDWR)
    server.close()
    thread.join(timeout=5)


def test_irqbalance_is_told_to_ban_the_exclusive_cpus_and_then_to_use_its_own_settings(
    irqbalance: tuple[Path, Path, list[tuple[str, int]]],
) -> None:
    proc, run, received = irqbalance
    notifier = IrqBalance(proc, run)
    state, warnings = notifier.notify(F({2, 3}), None)
    assert state == {"pid": 4242, "banned": "2-3"}
    assert warnings == ()
    state, warnings = notifier.notify(F(), state)
    assert state is None
    for _ in range(100):
        if len(received) == 2:
            break
        threading.Event().wait(0.02)
    assert received == [("settings cpus 2-3", os.getuid()), ("settings cpus NULL", os.getuid())]


def test_an_unreachable_irqbalance_is_a_warning_that_says_what_to_do(tmp_path: Path) -> None:
    proc = write_tree(tmp_path / "proc", {"77/comm": "irqbalance\n"})
    state, warnings = IrqBalance(proc, tmp_path / "run").notify(F({3}), None)
    assert state is None
    assert "irqbalance (pid 77) runs and will move interrupts back onto CPU(s) 3" in warnings[0]
    assert "IRQBALANCE_BANNED_CPULIST=3" in warnings[0]
    assert IrqBalance(write_tree(tmp_path / "p2", {"1/comm": "init\n"}), tmp_path).notify(F({3}), None) == (
        None,
        (),
    )


# =========================================================================== the partitioner over fake trees


def test_partitioner_over_fake_trees_confines_and_puts_back_byte_for_byte(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path)
    write_tree(proc, {"irq/36/smp_affinity_list": "0-3\n", "irq/37/smp_affinity_list": "3\n"})
    sys_root = write_tree(tmp_path / "sys", {"devices/virtual/workqueue/cpumask": "f\n"})
    mount = cgroup_tree(tmp_path)
    siblings = CgroupSiblings(mount, "nodeagent.slice")
    tasks = ProcTasks(proc, slot_parent="nodeagent.slice", covered=siblings.covers)
    refuse_37 = Interrupts(proc)
    original = refuse_37.write

    def managed(item: object, cpus: frozenset[int]) -> None:
        if getattr(item, "key", "") == "37":
            raise OSError(errno.EIO, "Input/output error")
        original(item, cpus)

    refuse_37.write = managed  # type: ignore[method-assign]
    p = HostPartitioner(
        lambda: F({0, 1, 2, 3}),
        tasks,
        [refuse_37, Workqueue(sys_root), siblings],
        RecordFile(tmp_path / "state" / "host-partition.json"),
    )
    (tmp_path / "state").mkdir()
    snapshot = {
        path: path.read_bytes()
        for root in (proc, sys_root, mount)
        for path in root.rglob("*")
        if path.is_file()
    }
    report = p.apply(F({3}))
    status = {t.tid: t.cpus for t in tasks.read()}
    # PID 1 sits in init.scope, whose cpuset confines it: its affinity stays; kthreadd is in the root.
    assert status[1] == F({0, 1, 2, 3})
    assert status[2] == F({0, 1, 2})
    assert (mount / "init.scope/cpuset.cpus").read_text() == "0-2"
    assert status[40] == F({3})  # in a slot
    assert status[20] == F({3})  # per-CPU kthread, reported
    assert (mount / "system.slice/cpuset.cpus").read_text() == "0-2"
    assert (sys_root / "devices/virtual/workqueue/cpumask").read_text() == "00000007"
    assert any("interrupt 37" in line and "managed or per-CPU" in line for line in report.immovable)
    assert any("ksoftirqd/3" in line for line in report.immovable)
    p.restore()
    after = {path: path.read_bytes() for path in snapshot}
    changed = {str(path.relative_to(tmp_path)) for path in snapshot if after[path] != snapshot[path]}
    # Values come back equal, in the kernel's own spelling where it would print them differently
    # (a mask, a cpulist, an empty cpuset written as a bare newline).
    respelled = {
        "sys/devices/virtual/workqueue/cpumask",
        "proc/irq/36/smp_affinity_list",
        "cgroup/user.slice/cpuset.cpus",
        "cgroup/init.scope/cpuset.cpus",
        "cgroup/system.slice/cpuset.cpus",
    }
    statuses = {f"proc/{p}/task/{t}/status" for p, t in ((1, 1), (2, 2), (30, 30), (30, 31))}
    assert changed <= respelled | statuses
    assert {(mount / c / "cpuset.cpus").read_text().strip() for c in ("init.scope", "system.slice")} == {""}
    assert parse_mask((sys_root / "devices/virtual/workqueue/cpumask").read_text()) == F({0, 1, 2, 3})
    assert {t.tid: t.cpus for t in tasks.read()} == {
        1: F({0, 1, 2, 3}),
        2: F({0, 1, 2, 3}),
        20: F({3}),
        30: F({0, 1, 2, 3}),
        31: F({1, 2, 3}),
        40: F({3}),
    }
    assert not (tmp_path / "state" / "host-partition.json").exists()


# =========================================================================== foreign CPU time


def test_proc_stat_per_cpu_busy_and_interrupt_ticks() -> None:
    text = "cpu  9 9 9 9 9 9 9 9 0 0\ncpu0 100 5 50 1000 7 3 2 9 0 0\ncpu1 1 0 1 10 0 0 0 0 0 0\nintr 1 2\n"
    assert parse_proc_stat(text) == {0: CpuTicks(160, 5), 1: CpuTicks(2, 0)}


def test_foreign_seconds_subtracts_the_slots_own_time_and_never_goes_negative() -> None:
    before = {2: CpuTicks(0, 0), 3: CpuTicks(0, 0)}
    after = {2: CpuTicks(150, 10), 3: CpuTicks(50, 0)}
    assert foreign_seconds(before, after, F({2, 3}), 1_500_000_000, hz=100) == (0.5, 0.1)
    assert foreign_seconds(before, after, F({2, 3}), 9_000_000_000, hz=100) == (0.0, 0.1)


def test_meter_measures_from_a_baseline_per_slot(tmp_path: Path) -> None:
    proc = write_tree(tmp_path / "proc", {"stat": "cpu0 0 0 0 0 0 0 0\ncpu1 0 0 0 0 0 0 0\n"})
    now = [1000.0]
    meter = ForeignCpuMeter(proc, clock=lambda: 5.0, monotonic=lambda: now[0], cache_seconds=0)
    first = meter.measure("s1", F({1}), 0)
    assert (first.seconds, first.since) == (0.0, 5.0)
    (proc / "stat").write_text(
        "cpu0 0 0 0 0 0 0 0\ncpu1 150 0 50 0 0 20 5\n"
    )  # 2.25 s busy, 0.25 s in interrupts
    now[0] += 10
    later = meter.measure("s1", F({1}), 2_000_000_000)  # the slot used 2 s of it
    assert later.seconds == pytest.approx(0.25)
    assert later.irq_seconds == pytest.approx(0.25)
    assert later.fraction == pytest.approx(0.025)
    assert later.to_json() == {"seconds": 0.25, "fraction": 0.025, "since": 5.0, "irq_seconds": 0.25}
    meter.forget("s1")
    assert meter.measure("s1", F({1}), 2_000_000_000).seconds == 0.0  # a new baseline
