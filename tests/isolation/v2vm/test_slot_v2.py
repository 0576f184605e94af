"""SlotIsolator's promises on a real unified-only (cgroup v2) kernel: the hierarchy, exclusive CPUs and
the shared pool, QoS limits, the eBPF device allow-list, OOM reporting, release and orphan clean-up."""

from __future__ import annotations

import dataclasses
import errno
import os
from pathlib import Path

import pytest

from nodeagent.cgroups import CgroupHost, bpf, open_manager
from nodeagent.cgroups.detect import V2_CONTROLLERS
from nodeagent.errors import CgroupError, Conflict, InvalidRequest
from nodeagent.isolation.isolator import SlotIsolator
from nodeagent.isolation.slot_spec import SlotIsolationSpec
from tests.isolation.specs import (
    PINNED_WITH_A_THREAD,
    F,
    MiB,
    best_effort,
    burstable,
    guaranteed,
    status_field,
    threads_cpus,
)

from ...cgroups.conftest import wait_for


def cgroup_dir(host: CgroupHost, relpath: str) -> Path:
    assert host.v2_mount is not None
    return host.v2_mount / relpath


def read(host: CgroupHost, relpath: str, name: str) -> str:
    return (cgroup_dir(host, relpath) / name).read_text().strip()


def program_alive(prog_id: int) -> bool:
    try:
        fd = bpf._prog_fd(prog_id)
    except CgroupError as err:
        if err.errno == errno.ENOENT:
            return False
        raise
    os.close(fd)
    return True


def open_results(paths: list[str]) -> str:
    return (
        "import os\n"
        f"for path in {paths!r}:\n"
        "    try:\n"
        "        os.close(os.open(path, os.O_RDONLY))\n"
        "        print('ok', flush=True)\n"
        "    except OSError as err:\n"
        "        print(err.errno, flush=True)\n"
    )


# --------------------------------------------------------------------------- the hierarchy


@pytest.mark.root
def test_hierarchy_enables_the_controllers_down_the_tree_and_parents_hold_no_processes(
    isolator: SlotIsolator, host: CgroupHost, start_in
) -> None:
    isolator.ensure_hierarchy()
    slots = [isolator.apply(guaranteed()), isolator.apply(burstable()), isolator.apply(best_effort())]
    workers = [start_in(slot) for slot in slots]

    available = set(read(host, "", "cgroup.controllers").split())
    assert set(V2_CONTROLLERS) <= available, "the VM's root should offer every controller the agent uses"
    parent = isolator.hierarchy.parent
    for relpath in ("", *isolator.hierarchy.parents()):
        assert set(V2_CONTROLLERS) <= set(read(host, relpath, "cgroup.subtree_control").split()), relpath
    for relpath in isolator.hierarchy.parents():
        assert read(host, relpath, "cgroup.procs") == "", f"{relpath} holds processes"
        assert read(host, relpath, "cgroup.type") == "domain"
    for slot, worker in zip(slots, workers, strict=True):
        assert slot.cgroup_version == "v2"
        assert slot.cgroup.startswith(parent + "/")
        assert slot.procs_files == (str(cgroup_dir(host, slot.cgroup) / "cgroup.procs"),)
        # A leaf: its own controllers are on, but none in its subtree_control, so it may hold processes.
        assert set(V2_CONTROLLERS) <= set(read(host, slot.cgroup, "cgroup.controllers").split())
        assert read(host, slot.cgroup, "cgroup.subtree_control") == ""
        assert read(host, slot.cgroup, "cgroup.type") == "domain"
        assert read(host, slot.cgroup, "cgroup.procs").split() == [str(worker.pid)]
        assert worker.proc.poll() is None


@pytest.mark.root
def test_ensure_hierarchy_twice_changes_nothing(isolator: SlotIsolator, host: CgroupHost) -> None:
    isolator.ensure_hierarchy()
    parents = isolator.hierarchy.parents()

    def state() -> dict[str, tuple[str, str]]:
        return {p: (read(host, p, "cgroup.subtree_control"), read(host, p, "cpuset.cpus")) for p in parents}

    before = state()
    isolator.ensure_hierarchy()
    assert state() == before


# --------------------------------------------------------------------------- CPUs and memory nodes


@pytest.mark.root
def test_guaranteed_slot_owns_its_cpu_and_the_pool_gives_it_back(
    isolator: SlotIsolator, host: CgroupHost, start_in
) -> None:
    shared = isolator.apply(burstable())
    neighbour = start_in(shared)
    assert status_field(neighbour.pid, "Cpus_allowed_list") == "0-1"

    slot = isolator.apply(guaranteed())
    worker = start_in(slot)
    assert slot.cpus == F({1})
    assert status_field(worker.pid, "Cpus_allowed_list") == "1"
    assert status_field(worker.pid, "Mems_allowed_list") == "0"
    assert read(host, slot.cgroup, "cpuset.cpus.effective") == "1"
    assert read(host, slot.cgroup, "cpuset.mems.effective") == "0"
    assert status_field(neighbour.pid, "Cpus_allowed_list") == "0"
    assert read(host, shared.cgroup, "cpuset.cpus.effective") == "0"
    for qos in ("burstable", "best-effort"):
        assert read(host, isolator.hierarchy.class_parent(qos), "cpuset.cpus.effective") == "0"
    late = start_in(isolator.apply(burstable("late")))
    assert status_field(late.pid, "Cpus_allowed_list") == "0"

    isolator.release("g")
    assert worker.proc.wait(timeout=30) == -9
    assert status_field(neighbour.pid, "Cpus_allowed_list") == "0-1"
    assert status_field(late.pid, "Cpus_allowed_list") == "0-1"
    assert read(host, shared.cgroup, "cpuset.cpus.effective") == "0-1"
    assert not cgroup_dir(host, slot.cgroup).exists()


@pytest.mark.root
def test_pinned_workers_and_their_threads_follow_every_cpuset_change(
    isolator: SlotIsolator, start_in
) -> None:
    """Launched as the agent launches them (pinned to their cpuset), with a second thread: the pool's
    growth reaches burstable and best-effort workers."""
    isolator.apply(guaranteed())
    shared = [start_in(isolator.apply(s), PINNED_WITH_A_THREAD) for s in (burstable(), best_effort())]
    for worker in shared:
        assert wait_for(lambda w=worker: len(threads_cpus(w.pid)) == 2)
        assert set(threads_cpus(worker.pid).values()) == {"0"}
    isolator.release("g")
    for worker in shared:
        assert set(threads_cpus(worker.pid).values()) == {"0-1"}


@pytest.mark.root
def test_a_pinned_guaranteed_worker_follows_its_resizes(isolator: SlotIsolator, start_in) -> None:
    worker = start_in(isolator.apply(guaranteed()), PINNED_WITH_A_THREAD)
    assert wait_for(lambda: len(threads_cpus(worker.pid)) == 2)
    isolator.resize(guaranteed(cpus=F({0})))
    assert set(threads_cpus(worker.pid).values()) == {"0"}
    isolator.resize(guaranteed(cpus=F({0, 1})))
    assert set(threads_cpus(worker.pid).values()) == {"0-1"}


@pytest.mark.root
def test_resize_moves_the_exclusive_cpu_and_the_pool_follows(
    isolator: SlotIsolator, host: CgroupHost, start_in
) -> None:
    worker = start_in(isolator.apply(guaranteed()))
    assert isolator.resize(guaranteed(cpus=F({0}))).cpus == F({0})
    assert status_field(worker.pid, "Cpus_allowed_list") == "0"
    assert read(host, isolator.hierarchy.class_parent("burstable"), "cpuset.cpus.effective") == "1"
    neighbour = start_in(isolator.apply(burstable()))
    assert status_field(neighbour.pid, "Cpus_allowed_list") == "1"


@pytest.mark.root
def test_an_empty_pool_is_written_as_empty_and_refuses_shared_slots(
    isolator: SlotIsolator, host: CgroupHost, start_in
) -> None:
    isolator.apply(guaranteed("g0", cpus=F({0})))
    isolator.apply(guaranteed("g1", cpus=F({1})))
    for qos in ("burstable", "best-effort"):
        assert read(host, isolator.hierarchy.class_parent(qos), "cpuset.cpus") == ""
    with pytest.raises(Conflict, match="would have no CPU"):
        isolator.apply(burstable())
    isolator.release("g0")
    neighbour = start_in(isolator.apply(burstable()))
    assert status_field(neighbour.pid, "Cpus_allowed_list") == "0"


@pytest.mark.root
def test_a_kernel_refusal_rolls_back_the_slot_and_the_pool(isolator: SlotIsolator, host: CgroupHost) -> None:
    shared = isolator.apply(burstable())
    bogus_node = max(isolator.pool.layout.nodes) + 7
    with pytest.raises(CgroupError) as caught:
        isolator.apply(SlotIsolationSpec("g", "guaranteed", cpus=F({1}), exclusive=True, mems=F({bogus_node}),
                                         memory_bytes=128 * MiB))  # fmt: skip
    assert caught.value.errno == errno.EINVAL
    assert list(isolator.list_owned().cgroups) == ["b"]
    assert read(host, shared.cgroup, "cpuset.cpus.effective") == "0-1"


@pytest.mark.root
def test_reserved_cpus_are_never_given_to_a_slot(isolator: SlotIsolator, host: CgroupHost, start_in) -> None:
    reserving = SlotIsolator(
        host, dataclasses.replace(isolator.config, reserved_cpus=F({0})), resctrl=isolator.resctrl
    )
    worker = start_in(reserving.apply(burstable()))
    assert status_field(worker.pid, "Cpus_allowed_list") == "1"
    assert read(host, reserving.hierarchy.parent, "cpuset.cpus.effective") == "1"
    with pytest.raises(InvalidRequest, match="offline or reserved"):
        reserving.apply(guaranteed(cpus=F({0})))


@pytest.mark.root
def test_a_restarted_isolator_reads_the_exclusive_cpus_back_from_the_kernel(
    isolator: SlotIsolator, host: CgroupHost, start_in
) -> None:
    isolator.apply(guaranteed())
    restarted = SlotIsolator(host, isolator.config, resctrl=isolator.resctrl)
    assert restarted.list_owned().cgroups == isolator.list_owned().cgroups
    assert restarted.pool.exclusive_by_slot() == {"g": F({1})}
    late = start_in(restarted.apply(burstable()))
    assert status_field(late.pid, "Cpus_allowed_list") == "0"
    with pytest.raises(Conflict, match="belong to slot g"):
        restarted.apply(guaranteed("other"))


# --------------------------------------------------------------------------- QoS limits


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        pytest.param(
            guaranteed(),
            {"memory.max": str(128 * MiB), "memory.high": "max", "memory.swap.max": "0", "pids.max": "4096",
             "cpu.max": "max 100000", "cpu.weight": "100", "io.weight": "default 200"},
            id="guaranteed",
        ),
        pytest.param(
            burstable(pids_max=64),
            {"memory.max": str(128 * MiB), "memory.high": "max", "memory.swap.max": "0", "pids.max": "64",
             "cpu.max": "50000 100000", "cpu.weight": "50", "io.weight": "default 100"},
            id="burstable",
        ),
        pytest.param(
            best_effort(),
            {"memory.max": str(128 * MiB), "memory.high": str(64 * MiB), "pids.max": "4096",
             "cpu.max": "max 100000", "io.weight": "default 1"},
            id="best-effort",
        ),
    ],
)  # fmt: skip
@pytest.mark.root
def test_qos_limits_are_written_as_the_class_says(
    isolator: SlotIsolator, host: CgroupHost, spec: SlotIsolationSpec, expected: dict[str, str]
) -> None:
    slot = isolator.apply(spec)
    found = {name: read(host, slot.cgroup, name) for name in expected if name != "io.weight"}
    assert found == {name: value for name, value in expected.items() if name != "io.weight"}
    if (cgroup_dir(host, slot.cgroup) / "io.weight").exists():
        assert read(host, slot.cgroup, "io.weight").splitlines()[0] == expected["io.weight"]
    assert slot.memory_max == int(expected["memory.max"])
    assert slot.oom_events == str(cgroup_dir(host, slot.cgroup) / "memory.events")


@pytest.mark.root
def test_best_effort_runs_in_an_idle_group_where_the_kernel_has_cpu_idle(
    isolator: SlotIsolator, host: CgroupHost
) -> None:
    slot = isolator.apply(best_effort())
    class_parent = isolator.hierarchy.class_parent("best-effort")
    if (cgroup_dir(host, class_parent) / "cpu.idle").exists():
        assert read(host, class_parent, "cpu.idle") == "1"
        assert read(host, slot.cgroup, "cpu.idle") == "1"
        assert not slot.sched_idle
    else:
        assert read(host, class_parent, "cpu.weight") == "1"
        assert slot.sched_idle
    burstable_parent = isolator.hierarchy.class_parent("burstable")
    if (cgroup_dir(host, burstable_parent) / "cpu.idle").exists():
        assert read(host, burstable_parent, "cpu.idle") == "0"


# --------------------------------------------------------------------------- devices (eBPF)


@pytest.mark.root
def test_devices_outside_the_allow_list_are_refused(
    isolator: SlotIsolator, host: CgroupHost, start_in, loop_devices: tuple[str, str]
) -> None:
    allowed, refused = loop_devices
    slot = isolator.apply(burstable(device_paths=(allowed,)))
    _, programs = bpf.query(cgroup_dir(host, slot.cgroup))
    assert len(programs) == 1
    child = start_in(slot, open_results(["/dev/null", "/dev/urandom", allowed, refused]))
    rc, out, err = child.finish()
    assert rc == 0, err
    assert out.split() == ["ok", "ok", "ok", str(errno.EPERM)]
    # The refusal is the slot's filter, not the device: outside the slot it opens.
    outside = start_in(None, open_results([refused]))
    assert outside.finish()[1].split() == ["ok"]


# --------------------------------------------------------------------------- OOM


@pytest.mark.root
def test_an_oom_in_a_slot_is_reported_and_a_bystander_survives(
    isolator: SlotIsolator, host: CgroupHost, start_in
) -> None:
    slot = isolator.apply(guaranteed())
    bystander = start_in(None)
    neighbour = start_in(isolator.apply(burstable()))
    hog = start_in(slot, "chunks = []\nwhile True: chunks.append(bytearray(8 << 20))")
    assert hog.proc.wait(timeout=120) == -9
    assert slot.oom_events is not None
    events = dict(line.split() for line in Path(slot.oom_events).read_text().splitlines())
    assert int(events["oom_kill"]) >= 1
    # The kernel may overshoot memory.max by one charge batch (64 pages) before it reclaims or kills.
    assert int(read(host, slot.cgroup, "memory.peak")) <= 128 * MiB + 64 * os.sysconf("SC_PAGE_SIZE")
    assert bystander.proc.poll() is None
    assert neighbour.proc.poll() is None


# --------------------------------------------------------------------------- release, orphans, idempotence


@pytest.mark.root
def test_release_removes_the_cgroups_and_the_device_programs(
    isolator: SlotIsolator, host: CgroupHost, start_in
) -> None:
    slots = [isolator.apply(guaranteed()), isolator.apply(burstable()), isolator.apply(best_effort())]
    workers = [start_in(slot) for slot in slots]
    programs = [bpf.query(cgroup_dir(host, slot.cgroup))[1] for slot in slots]
    assert all(len(ids) == 1 for ids in programs)
    assert all(program_alive(ids[0]) for ids in programs)

    for slot in slots:
        isolator.release(slot.slot_id)
    assert [worker.proc.wait(timeout=30) for worker in workers] == [-9, -9, -9]
    assert not [slot.cgroup for slot in slots if cgroup_dir(host, slot.cgroup).exists()]
    assert isolator.list_owned().cgroups == {}
    assert wait_for(lambda: not any(program_alive(ids[0]) for ids in programs), timeout=30)
    assert read(host, isolator.hierarchy.class_parent("burstable"), "cpuset.cpus.effective") == "0-1"
    for slot in slots:
        isolator.release(slot.slot_id)  # already gone is fine


@pytest.mark.root
def test_remove_orphans_removes_slots_unknown_to_the_caller(
    isolator: SlotIsolator, host: CgroupHost, start_in
) -> None:
    known = isolator.apply(guaranteed("known"))
    orphan = start_in(isolator.apply(burstable("orphan")))
    stray = f"{isolator.hierarchy.class_parent('best-effort')}/stray"
    open_manager(host, stray).create()  # left by a crash between mkdir and the record

    removed = isolator.remove_orphans({"known"})
    orphan_path = f"{isolator.hierarchy.parent}/burstable/orphan"
    assert dict(removed.cgroups) == {"orphan": orphan_path, "stray": stray}
    assert orphan.proc.wait(timeout=30) == -9
    assert list(isolator.list_owned().cgroups) == ["known"]
    assert cgroup_dir(host, known.cgroup).exists()
    assert not cgroup_dir(host, removed.cgroups["orphan"]).exists()
    assert not cgroup_dir(host, stray).exists()


@pytest.mark.root
def test_apply_is_idempotent(
    isolator: SlotIsolator, host: CgroupHost, start_in, loop_devices: tuple[str, str]
) -> None:
    allowed, refused = loop_devices
    first = isolator.apply(guaranteed(device_paths=(allowed,)))
    worker = start_in(first)
    names = ("cpuset.cpus", "cpuset.mems", "memory.max", "memory.swap.max", "pids.max", "cpu.max")
    settings = {name: read(host, first.cgroup, name) for name in names}

    assert isolator.apply(guaranteed(device_paths=(allowed,))) == first
    assert {name: read(host, first.cgroup, name) for name in names} == settings
    _, programs = bpf.query(cgroup_dir(host, first.cgroup))
    assert len(programs) == 1, "a re-apply must replace the device program, not stack another"
    assert list(isolator.list_owned().cgroups) == ["g"]
    assert worker.proc.poll() is None
    probe = start_in(first, open_results([allowed, refused]))
    assert probe.finish()[1].split() == ["ok", str(errno.EPERM)]
