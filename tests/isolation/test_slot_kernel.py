"""SlotIsolator: pure mapping of specs onto cgroup settings, then slots on the real kernel (root).

The kernel tests use a parent of their own (``natest<pid>-<n>.slice``), so a real nodeagent.slice is
never touched, and check after every test that nothing they created remains.
"""

from __future__ import annotations

import errno
import itertools
import os
import subprocess
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from nodeagent.cgroups import UNLIMITED, CgroupHost, CgroupLimits, detect, open_manager
from nodeagent.cgroups.resources import CPU_WEIGHT_MIN, weight_to_shares
from nodeagent.errors import CgroupError, Conflict, InvalidRequest, NetworkError, NotFound, Unsupported
from nodeagent.isolation.backend import KernelIsolation
from nodeagent.isolation.firewall import NftFirewall, SlotElements
from nodeagent.isolation.isolator import AppliedSlot, SlotIsolator, slot_resources
from nodeagent.isolation.network import (
    AllowedHostPort,
    SlotAccess,
    SlotNetwork,
    SlotNetworkConfig,
    host_veth_name,
)
from nodeagent.isolation.network_ipbatch import IpBatchBackend
from nodeagent.isolation.qos import qos_parameters
from nodeagent.isolation.resctrl import Resctrl
from nodeagent.isolation.slot_spec import IsolatorConfig, SlotIsolationSpec, SlotNetworkSpec
from tests.isolation.specs import (
    PINNED_WITH_A_THREAD,
    F,
    MiB,
    burstable,
    guaranteed,
    status_field,
    threads_cpus,
)

from ..cgroups.conftest import Child, wait_for

# --------------------------------------------------------------------------- pure


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        pytest.param({"slot_id": "a/b", "qos": "burstable"}, InvalidRequest, "cannot name", id="slash-in-id"),
        pytest.param(
            {"slot_id": "burstable", "qos": "burstable"}, InvalidRequest, "reserved", id="class-name"
        ),
        pytest.param({"slot_id": "x", "qos": "gold"}, InvalidRequest, "unknown QoS", id="unknown-qos"),
        pytest.param(
            {"slot_id": "x", "qos": "guaranteed", "cpus": F({1})},
            InvalidRequest,
            "exclusive=False",
            id="guaranteed-not-exclusive",
        ),
        pytest.param(
            {"slot_id": "x", "qos": "burstable", "exclusive": True},
            InvalidRequest,
            "only guaranteed",
            id="burstable-exclusive",
        ),
        pytest.param(
            {"slot_id": "x", "qos": "guaranteed", "exclusive": True},
            InvalidRequest,
            "has no CPUs",
            id="guaranteed-without-cpus",
        ),
        pytest.param(
            {"slot_id": "x", "qos": "burstable", "mems": F()},
            InvalidRequest,
            "at least one NUMA",
            id="empty-mems",
        ),
        pytest.param(
            {"slot_id": "x", "qos": "burstable", "cpu_quota": 0}, InvalidRequest, "cpu_quota", id="zero-quota"
        ),
        pytest.param(
            {"slot_id": "x", "qos": "burstable", "pids_max": 0}, InvalidRequest, "pids_max", id="zero-pids"
        ),
    ],
)
def test_invalid_specs_are_refused(kwargs: dict, error: type[Exception], fragment: str) -> None:
    with pytest.raises(error, match=fragment):
        SlotIsolationSpec(**kwargs)


@pytest.mark.parametrize(
    ("spec", "idle", "expected"),
    [
        pytest.param(
            guaranteed(cpus=F({2, 3})),
            True,
            CgroupLimits(
                cpuset_cpus=F({2, 3}),
                cpuset_mems=F({0}),
                cpu_weight=200,
                cpu_quota_us=UNLIMITED,
                cpu_period_us=100_000,
                memory_max=128 * MiB,
                memory_swap_max=0,
                pids_max=4096,
            ),
            id="guaranteed-no-quota-no-swap",
        ),
        pytest.param(
            burstable(pids_max=64),
            True,
            CgroupLimits(
                cpuset_cpus=F({2, 3}),
                cpu_weight=50,
                cpu_quota_us=50_000,
                cpu_period_us=100_000,
                memory_max=128 * MiB,
                memory_swap_max=0,
                pids_max=64,
            ),
            id="burstable-quota-and-weight",
        ),
        pytest.param(
            SlotIsolationSpec("e", "best-effort", memory_bytes=64 * MiB),
            True,
            CgroupLimits(
                cpuset_cpus=F({2, 3}),
                cpu_quota_us=UNLIMITED,
                cpu_period_us=100_000,
                cpu_idle=True,
                memory_max=128 * MiB,
                memory_high=64 * MiB,
                pids_max=4096,
            ),
            id="best-effort-idle-no-weight",
        ),
        pytest.param(
            SlotIsolationSpec("e", "best-effort"),
            False,
            CgroupLimits(
                cpuset_cpus=F({2, 3}),
                cpu_weight=1,
                cpu_quota_us=UNLIMITED,
                cpu_period_us=100_000,
                memory_max=UNLIMITED,
                pids_max=4096,
            ),
            id="best-effort-without-cpu-idle",
        ),
    ],
)
def test_qos_parameters_map_onto_cgroup_resources(
    spec: SlotIsolationSpec, idle: bool, expected: CgroupLimits
) -> None:
    cpus = spec.cpus if spec.exclusive else F({2, 3})
    request = float(len(spec.cpus)) if spec.exclusive else spec.cpu_quota
    params = qos_parameters(spec.qos, cpus=request, memory_bytes=spec.memory_bytes, cpu_idle_available=idle)
    assert slot_resources(spec, params, cpus, swap_limit=True) == expected


def test_no_swap_limit_where_swap_accounting_is_off() -> None:
    spec = guaranteed()
    params = qos_parameters("guaranteed", cpus=1, memory_bytes=spec.memory_bytes, cpu_idle_available=True)
    assert slot_resources(spec, params, spec.cpus, swap_limit=False).memory_swap_max is None


def test_applied_slot_json_round_trip() -> None:
    applied = AppliedSlot(
        slot_id="g", qos="guaranteed", cgroup="na.slice/g", cgroup_version="v1",
        procs_files=("/sys/fs/cgroup/cpuset/na.slice/g/cgroup.procs",), oom_events=None, cpus=F({1}),
        mems=F({0}), memory_max=MiB, sched_idle=False, oom_score_adj=-997, device_rules=("c 1:3 rw",),
        resctrl_group="na-g", resctrl_tasks="/sys/fs/resctrl/na-g/tasks",
    )  # fmt: skip
    assert AppliedSlot.from_json(applied.to_json()) == applied


# --------------------------------------------------------------------------- real kernel

_numbers = itertools.count()


def _base36(number: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        number, rest = divmod(number, 36)
        out = digits[rest] + out
        if not number:
            return out


@pytest.fixture
def host() -> CgroupHost:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    found = detect()
    missing = {"cpuset", "cpu", "memory", "pids", "devices", "freezer"} - set(found.v1_mounts)
    if found.mode not in ("v1", "hybrid") or missing:
        pytest.skip(f"these tests describe a cgroup v1/hybrid host; here: {found.mode}, missing {missing}")
    if not {0, 1} <= os.sched_getaffinity(0):
        pytest.skip("needs CPUs 0 and 1")
    return found


@pytest.fixture
def isolator(host: CgroupHost, tmp_path: Path) -> Iterator[SlotIsolator]:
    pid = os.getpid()
    tag = f"nai{_base36(pid)}{next(_numbers)}"
    network = SlotNetworkConfig(
        cidr=f"100.{128 + pid % 64}.0.0/16",
        netns_prefix=f"natest-{tag}-",
        veth_prefix=tag,
        rule_priority=3233,
        nft_table=f"natest-{tag}",
    )
    config = IsolatorConfig(
        cgroup_parent=f"natest{pid}-{next(_numbers)}.slice",
        network=network,
        resctrl_prefix=f"natest-{tag}-",
        resctrl_root=tmp_path / "no-resctrl",
    )
    iso = SlotIsolator(host, config, resctrl=Resctrl(root=tmp_path / "no-resctrl"))
    try:
        yield iso
    finally:
        iso.remove_all()
        assert not _has_table(network.nft_table), "firewall table left behind"
        leftovers = [m / config.cgroup_parent for m in (*host.v1_mounts.values(), host.v2_mount) if m]
        assert not [p for p in leftovers if p.exists()], "cgroups left behind"
        assert (
            not [n for n in os.listdir("/run/netns") if n.startswith(network.netns_prefix)]
            if Path("/run/netns").is_dir()
            else True
        )


@pytest.fixture
def start_in() -> Iterator[Callable[[AppliedSlot, str], Child]]:
    """Start a paused Python child, move it into a slot, then let it run ``code``; killed at the end."""
    children: list[Child] = []

    def start(applied: AppliedSlot, code: str = "import time\ntime.sleep(60)") -> Child:
        child = Child(code)
        children.append(child)
        for procs in applied.procs_files:
            Path(procs).write_text(str(child.pid))
        child.release()
        return child

    yield start
    for child in children:
        child.stop()


def cpuset_of(host: CgroupHost, relpath: str) -> str:
    return (host.v1_mounts["cpuset"] / relpath / "cpuset.cpus").read_text().strip()


@pytest.mark.root
def test_guaranteed_slot_owns_its_cpu_and_the_pool_gives_it_back(
    isolator: SlotIsolator, host: CgroupHost, start_in
) -> None:
    shared = isolator.apply(burstable())
    neighbour = start_in(shared)
    assert status_field(neighbour.pid, "Cpus_allowed_list") == "0-1"

    slot = isolator.apply(guaranteed())
    worker = start_in(slot)
    assert status_field(worker.pid, "Cpus_allowed_list") == "1"
    assert status_field(worker.pid, "Mems_allowed_list") == "0"
    assert status_field(neighbour.pid, "Cpus_allowed_list") == "0"
    parent = isolator.hierarchy.parent
    assert cpuset_of(host, f"{parent}/burstable") == "0"
    assert cpuset_of(host, f"{parent}/best-effort") == "0"
    memory = host.v1_mounts["memory"] / slot.cgroup
    assert int((memory / "memory.limit_in_bytes").read_text()) == 128 * MiB
    assert int((memory / "memory.memsw.limit_in_bytes").read_text()) == 128 * MiB
    assert slot.oom_score_adj < 0

    isolator.release("g")
    assert worker.proc.wait(timeout=10) == -9
    assert status_field(neighbour.pid, "Cpus_allowed_list") == "0-1"
    assert cpuset_of(host, f"{parent}/best-effort") == "0-1"
    assert "g" not in isolator.list_owned().cgroups
    isolator.release("g")  # already gone is fine


@pytest.mark.root
def test_a_pinned_worker_and_its_threads_grow_with_the_pool(isolator: SlotIsolator, start_in) -> None:
    """The kernel keeps a task's own sched_setaffinity mask across cpuset changes (6.2 and later):
    without the agent taking the tasks along, a worker launched on a one-CPU pool stays on it."""
    isolator.apply(guaranteed())
    worker = start_in(isolator.apply(burstable()), PINNED_WITH_A_THREAD)
    assert wait_for(lambda: len(threads_cpus(worker.pid)) == 2)
    assert set(threads_cpus(worker.pid).values()) == {"0"}

    isolator.release("g")
    assert set(threads_cpus(worker.pid).values()) == {"0-1"}


@pytest.mark.root
def test_a_pinned_worker_follows_its_exclusive_cpus_through_resizes(isolator: SlotIsolator, start_in) -> None:
    worker = start_in(isolator.apply(guaranteed()), PINNED_WITH_A_THREAD)
    assert wait_for(lambda: len(threads_cpus(worker.pid)) == 2)
    isolator.resize(guaranteed(cpus=F({0})))
    assert set(threads_cpus(worker.pid).values()) == {"0"}
    isolator.resize(guaranteed(cpus=F({0, 1})))
    assert set(threads_cpus(worker.pid).values()) == {"0-1"}


@pytest.mark.root
def test_new_shared_slots_start_on_the_pool_only(isolator: SlotIsolator, start_in) -> None:
    isolator.apply(guaranteed())
    later = start_in(isolator.apply(burstable("late")))
    assert status_field(later.pid, "Cpus_allowed_list") == "0"


@pytest.mark.root
def test_shared_slots_keep_one_cpuset_between_them(isolator: SlotIsolator) -> None:
    first = isolator.apply(burstable("one"))
    second = isolator.apply(burstable("two"))
    # The pool's CPUs, one set for every shared slot's record rather than a copy each.
    assert first.cpus == second.cpus
    assert first.cpus is second.cpus


@pytest.mark.root
def test_resize_moves_the_exclusive_cpu_and_the_pool_follows(
    isolator: SlotIsolator, host: CgroupHost, start_in
) -> None:
    worker = start_in(isolator.apply(guaranteed()))
    resized = isolator.resize(guaranteed(cpus=F({0})))
    assert resized.cpus == F({0})
    assert status_field(worker.pid, "Cpus_allowed_list") == "0"
    assert cpuset_of(host, isolator.hierarchy.class_parent("burstable")) == "1"
    neighbour = start_in(isolator.apply(burstable()))
    assert status_field(neighbour.pid, "Cpus_allowed_list") == "1"


@pytest.mark.root
def test_resize_changes_limits_in_place(isolator: SlotIsolator, host: CgroupHost, start_in) -> None:
    slot = isolator.apply(guaranteed())
    worker = start_in(slot)
    isolator.resize(
        SlotIsolationSpec("g", "guaranteed", cpus=F({1}), exclusive=True, mems=F({0}), memory_bytes=256 * MiB)
    )
    assert int((host.v1_mounts["memory"] / slot.cgroup / "memory.limit_in_bytes").read_text()) == 256 * MiB
    assert worker.proc.poll() is None


@pytest.mark.root
def test_a_move_that_would_leave_shared_slots_without_a_cpu_is_a_conflict(
    isolator: SlotIsolator, host: CgroupHost
) -> None:
    # Two CPUs, one exclusive and one shared: the pool cannot be cut before the slot lets go.
    isolator.apply(burstable())
    isolator.apply(guaranteed())
    with pytest.raises(Conflict, match="would be left with no CPU"):
        isolator.resize(guaranteed(cpus=F({0})))
    assert cpuset_of(host, f"{isolator.hierarchy.parent}/g") == "1"
    assert cpuset_of(host, f"{isolator.hierarchy.parent}/burstable/b") == "0"


@pytest.mark.root
def test_resizing_a_slot_that_does_not_exist_is_not_found(isolator: SlotIsolator) -> None:
    with pytest.raises(NotFound, match="apply it first"):
        isolator.resize(guaranteed())


@pytest.mark.root
def test_a_cpu_held_by_another_guaranteed_slot_is_a_conflict(isolator: SlotIsolator) -> None:
    isolator.apply(guaranteed("first"))
    with pytest.raises(Conflict, match="belong to slot first"):
        isolator.apply(guaranteed("second"))
    assert "second" not in isolator.list_owned().cgroups


@pytest.mark.root
def test_devices_outside_the_allow_list_are_refused(isolator: SlotIsolator, start_in) -> None:
    allowed, refused = "/dev/loop0", "/dev/loop1"
    if not (Path(allowed).exists() and Path(refused).exists()):
        pytest.skip("needs /dev/loop0 and /dev/loop1")
    slot = isolator.apply(burstable(device_paths=(allowed,)))
    code = (
        "import errno, os\n"
        f"for path in ('/dev/null', '/dev/urandom', {allowed!r}, {refused!r}):\n"
        "    try:\n"
        "        os.close(os.open(path, os.O_RDONLY))\n"
        "        print(path, 'ok')\n"
        "    except OSError as err:\n"
        "        print(path, errno.errorcode[err.errno])\n"
    )
    child = start_in(slot, code)
    rc, out, err = child.finish()
    assert rc == 0, err
    assert out.split("\n")[:4] == ["/dev/null ok", "/dev/urandom ok", f"{allowed} ok", f"{refused} EPERM"]


@pytest.mark.root
def test_apply_is_idempotent(isolator: SlotIsolator, host: CgroupHost) -> None:
    first = isolator.apply(guaranteed(device_paths=("/dev/loop0",)))
    devices = (host.v1_mounts["devices"] / first.cgroup / "devices.list").read_text()
    assert isolator.apply(guaranteed(device_paths=("/dev/loop0",))) == first
    assert (host.v1_mounts["devices"] / first.cgroup / "devices.list").read_text() == devices
    assert list(isolator.list_owned().cgroups) == ["g"]


@pytest.mark.root
def test_best_effort_class_is_an_idle_group(isolator: SlotIsolator, host: CgroupHost) -> None:
    slot = isolator.apply(SlotIsolationSpec("e", "best-effort", memory_bytes=64 * MiB))
    class_parent = host.v1_mounts["cpu"] / isolator.hierarchy.class_parent("best-effort")
    if not (class_parent / "cpu.idle").exists():
        pytest.skip("kernel without cpu.idle")
    assert (class_parent / "cpu.idle").read_text().strip() == "1"
    assert not slot.sched_idle
    memory = host.v1_mounts["memory"] / slot.cgroup
    assert int((memory / "memory.soft_limit_in_bytes").read_text()) == 64 * MiB


@pytest.mark.root
def test_a_best_effort_quota_change_alone_syncs_no_cpuset(
    isolator: SlotIsolator, host: CgroupHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    slot = isolator.apply(SlotIsolationSpec("e", "best-effort", memory_bytes=64 * MiB))
    syncs: list[int] = []
    real_sync = isolator.pool.sync
    monkeypatch.setattr(isolator.pool, "sync", lambda *a, **k: syncs.append(1) or real_sync(*a, **k))
    assert isolator.limit_best_effort(frozenset({1}), 0.5) == frozenset({1})
    assert cpuset_of(host, slot.cgroup) == "1"
    assert len(syncs) == 1
    isolator.limit_best_effort(frozenset({1}), 0.3)  # the quota alone: the class parent only
    assert len(syncs) == 1
    quota = host.v1_mounts["cpu"] / isolator.hierarchy.class_parent("best-effort") / "cpu.cfs_quota_us"
    assert int(quota.read_text()) == 30000
    assert isolator.limit_best_effort(None, None) == frozenset({0, 1})  # the CPUs: every slot again
    assert len(syncs) == 2
    assert cpuset_of(host, slot.cgroup) == "0-1"


@pytest.mark.root
def test_what_the_colocation_loop_holds_a_slot_to_survives_its_resize(
    isolator: SlotIsolator, host: CgroupHost
) -> None:
    """The isolator is the one writer of a slot's cgroup: the loop's memory throttle and CPU quota
    go through it, and a resize of the slot keeps them (its own soft limit would otherwise be
    written over the throttle) until the loop lifts them."""
    slot = isolator.apply(SlotIsolationSpec("e", "best-effort", memory_bytes=64 * MiB))
    memory = host.v1_mounts["memory"] / slot.cgroup / "memory.soft_limit_in_bytes"
    quota = host.v1_mounts["cpu"] / slot.cgroup / "cpu.cfs_quota_us"
    isolator.hold_best_effort_slot("e", memory_high=16 * MiB, cpu_quota_us=20000)
    assert int(memory.read_text()) == 16 * MiB
    assert int(quota.read_text()) == 20000
    isolator.resize(SlotIsolationSpec("e", "best-effort", memory_bytes=128 * MiB))
    assert int(memory.read_text()) == 16 * MiB, "a resize kept the loop's throttle"
    assert int(quota.read_text()) == 20000
    isolator.hold_best_effort_slot("e", memory_high=None, own_memory_high=128 * MiB, cpu_quota_us=None)
    assert int(memory.read_text()) == 128 * MiB
    assert int(quota.read_text()) == -1
    isolator.resize(SlotIsolationSpec("e", "best-effort", memory_bytes=96 * MiB))
    assert int(memory.read_text()) == 96 * MiB, "lifted: the slot's own limit again"
    isolator.release("e")
    isolator.hold_best_effort_slot("e", memory_high=8 * MiB)  # gone meanwhile: not an error
    assert not isolator._held_by_qos, "nothing is held for a slot that is gone"


@pytest.mark.root
def test_a_missing_device_fails_before_anything_is_created(isolator: SlotIsolator, tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="does not exist"):
        isolator.apply(guaranteed(device_paths=(str(tmp_path / "nvidia7"),)))
    assert isolator.list_owned().empty


@pytest.mark.root
def test_l3_without_resctrl_is_unsupported_before_anything_is_created(isolator: SlotIsolator) -> None:
    with pytest.raises(Unsupported):
        isolator.apply(burstable(l3=0.5))
    assert isolator.list_owned().empty


@pytest.mark.root
def test_a_kernel_refusal_rolls_back_the_slot_and_the_pool(isolator: SlotIsolator, host: CgroupHost) -> None:
    isolator.apply(burstable())
    bogus_node = max(isolator.pool.layout.nodes) + 7
    with pytest.raises(CgroupError) as caught:
        isolator.apply(SlotIsolationSpec("g", "guaranteed", cpus=F({1}), exclusive=True, mems=F({bogus_node}),
                                         memory_bytes=128 * MiB))  # fmt: skip
    assert caught.value.errno == errno.EINVAL
    assert list(isolator.list_owned().cgroups) == ["b"]
    assert cpuset_of(host, f"{isolator.hierarchy.parent}/burstable/b") == "0-1"


@pytest.mark.root
def test_qos_class_cannot_change_under_the_same_id(isolator: SlotIsolator) -> None:
    isolator.apply(burstable("same"))
    with pytest.raises(Conflict, match="cannot change its QoS class"):
        isolator.apply(guaranteed("same"))


@pytest.mark.root
def test_network_namespace_is_created_and_removed_with_the_slot(isolator: SlotIsolator) -> None:
    slot = isolator.apply(burstable(network=SlotNetworkSpec(bandwidth_mbit=100)))
    assert slot.network is not None
    assert slot.netns_path is not None
    assert Path(slot.netns_path).exists()
    assert slot.network.subnet.subnet_of(isolator.config.network.pool)
    assert isolator.apply(burstable(network=SlotNetworkSpec(bandwidth_mbit=100))).network == slot.network
    assert isolator.list_owned().network.netns == (slot.network.netns,)
    isolator.release("b")
    assert not Path(slot.netns_path).exists()
    assert isolator.list_owned().network.empty


def _has_table(name: str) -> bool:
    done = subprocess.run(["nft", "list", "table", "inet", name], capture_output=True, check=False)
    return done.returncode == 0


def _opt_ins(isolator: SlotIsolator) -> SlotElements:
    firewall = isolator.network.firewall
    assert isinstance(firewall, NftFirewall)
    return firewall.read_table().elements


@pytest.mark.root
def test_network_access_follows_the_spec_through_apply_resize_and_release(isolator: SlotIsolator) -> None:
    ports = (AllowedHostPort(9000), AllowedHostPort(53, "udp"))
    slot = isolator.apply(burstable(network=SlotNetworkSpec(host_ports=ports)))
    assert slot.network is not None
    assert (slot.network.filtered, slot.network.access) == (True, SlotAccess(host_ports=ports))
    veth = slot.network.host_ifname
    assert _opt_ins(isolator).host_ports == {(veth, "tcp", 9000), (veth, "udp", 53)}
    resized = isolator.resize(
        burstable(network=SlotNetworkSpec(egress="nat", host_ports=(AllowedHostPort(9001),)))
    )
    assert resized.network is not None
    assert resized.network.subnet == slot.network.subnet  # same netns: only the opt-ins changed
    elements = _opt_ins(isolator)
    assert elements.host_ports == {(veth, "tcp", 9001)}
    assert elements.egress == {(veth, str(slot.network.slot_address))}
    isolator.release("b")
    assert not _opt_ins(isolator)


@pytest.mark.root
def test_firewall_opt_ins_of_a_crashed_agent_are_orphans(isolator: SlotIsolator) -> None:
    isolator.apply(burstable("gone", network=SlotNetworkSpec(host_ports=(AllowedHostPort(9000),))))
    isolator.apply(burstable("kept", network=SlotNetworkSpec(host_ports=(AllowedHostPort(9000),))))
    # A new isolator (a restarted agent) knows only what the kernel tells it.
    restarted = SlotIsolator(isolator.host, isolator.config, resctrl=isolator.resctrl)
    removed = restarted.remove_orphans({"kept"})
    gone = host_veth_name(isolator.config.network, "gone")
    assert removed.network.firewall_ifnames == (gone,)
    assert _opt_ins(isolator).ifnames() == {host_veth_name(isolator.config.network, "kept")}


@pytest.mark.root
def test_a_restart_puts_a_flushed_table_back_only_where_slot_veths_exist(isolator: SlotIsolator) -> None:
    table = isolator.config.network.nft_table
    isolator.ensure_firewall()
    assert not _has_table(table)  # no slot network here: no table, no library work
    isolator.apply(burstable(network=SlotNetworkSpec()))
    subprocess.run(["nft", "delete", "table", "inet", table], check=True)  # the test's own table
    restarted = KernelIsolation(SlotIsolator(isolator.host, isolator.config, resctrl=isolator.resctrl))
    restarted.prepare()
    assert _has_table(table)
    assert restarted.degraded() == ()


@dataclass
class BrokenFirewall:
    def ensure(self) -> None:
        raise NetworkError("nftables refused to set up the slot firewall: Operation not supported")

    def apply(self, plan: SlotNetwork) -> None: ...

    def remove(self, host_ifname: str) -> None: ...

    def list_owned(self) -> tuple[str, ...]:
        return ()

    def remove_owned(self, host_ifnames: Iterable[str]) -> None: ...

    def remove_all(self) -> None: ...


@pytest.mark.root
def test_a_firewall_that_cannot_be_set_up_at_start_is_reported_not_fatal(isolator: SlotIsolator) -> None:
    isolator.apply(burstable(network=SlotNetworkSpec()))  # a slot veth exists
    backend = IpBatchBackend(isolator.config.network, BrokenFirewall())
    kernel = KernelIsolation(SlotIsolator(isolator.host, isolator.config, backend, isolator.resctrl))
    kernel.prepare()
    (reason,) = kernel.degraded()
    assert "firewall table could not be set up" in reason
    assert "Operation not supported" in reason
    assert kernel.isolates


@pytest.mark.root
@pytest.mark.parametrize("allowed", [False, True], ids=["refused", "allowed-unfiltered"])
def test_without_a_firewall_network_slots_need_the_operators_consent(
    host: CgroupHost, isolator: SlotIsolator, allowed: bool
) -> None:
    config = replace(isolator.config, allow_unfiltered_network=allowed)
    unfiltered = IpBatchBackend(config.network)  # no firewall, as where libnftables is missing
    iso = SlotIsolator(host, config, network_backend=unfiltered, resctrl=isolator.resctrl)
    spec = burstable("net", network=SlotNetworkSpec())
    (reason,) = iso.degraded()
    assert reason.startswith("network filtering: the network backend has no firewall")
    if not allowed:
        refusal = r"slot net asks for a network namespace, but .* allow_unfiltered_network = true"
        with pytest.raises(Unsupported, match=refusal):
            iso.apply(spec)
        assert not open_manager(host, iso.hierarchy.slot_path("net", "burstable")).exists()
        return
    slot = iso.apply(spec)
    assert slot.network is not None
    assert slot.network.filtered is False
    assert "run unfiltered" in iso.degraded()[0]
    iso.release("net")


@pytest.mark.root
def test_remove_orphans_keeps_known_slots(isolator: SlotIsolator, start_in) -> None:
    isolator.apply(guaranteed("known"))
    orphan = start_in(isolator.apply(burstable("orphan")))
    removed = isolator.remove_orphans({"known"})
    assert dict(removed.cgroups) == {"orphan": f"{isolator.hierarchy.parent}/burstable/orphan"}
    assert orphan.proc.wait(timeout=10) == -9
    assert list(isolator.list_owned().cgroups) == ["known"]
    assert wait_for(lambda: not open_manager(isolator.host, removed.cgroups["orphan"]).exists())


def test_a_slot_left_half_made_across_v1_hierarchies_is_still_listed(
    isolator: SlotIsolator, host: CgroupHost
) -> None:
    """An agent killed while it made or removed a slot's cgroups leaves the slot in some v1
    hierarchies and not in cpuset: start-up must still see it (to remove or rebuild it), not stop
    on its missing cpuset files."""
    isolator.ensure_hierarchy()
    relpath = f"{isolator.config.cgroup_parent}/burstable/shalfmade0001"
    (host.v1_mounts["pids"] / relpath).mkdir()
    owned = {o.slot_id: o for o in isolator.owned_slots()}
    assert owned["shalfmade0001"].applied.cpus == frozenset()
    assert owned["shalfmade0001"].applied.mems is None
    assert "shalfmade0001" in isolator.remove_orphans(set()).cgroups
    assert not (host.v1_mounts["pids"] / relpath).exists()


@pytest.mark.root
def test_a_slot_cut_short_before_its_cpuset_directory_is_still_listed(
    isolator: SlotIsolator, host: CgroupHost
) -> None:
    """v1 makes a slot hierarchy by hierarchy; a crash between two leaves it without a cpuset
    directory, and the next start must list it (to finish or remove it), not fail reading it."""
    isolator.ensure_hierarchy()
    relpath = f"{isolator.hierarchy.parent}/burstable/cut"
    for controller, mount in host.v1_mounts.items():
        if controller != "cpuset":
            (mount / relpath).mkdir(exist_ok=True)
    owned = {o.slot_id: o for o in isolator.owned_slots()}
    assert owned["cut"].applied.cpus == frozenset()
    assert owned["cut"].applied.mems is None
    assert isolator.remove_orphans(()).cgroups == {"cut": relpath}


@pytest.mark.root
def test_a_standby_waits_at_the_lowest_weight_frozen_then_changes_class_thawed(
    isolator: SlotIsolator, host: CgroupHost, start_in
) -> None:
    """A warm pool's standby (docs/pools.md): burstable in the background, frozen once ready, then
    taken as a guaranteed slot: every process moves into the new class's cgroup and runs again
    there, with that class's weight, and the standby's cgroup goes."""
    standby = isolator.apply(SlotIsolationSpec("s", "burstable", memory_bytes=128 * MiB, background=True))
    cpu = host.v1_mounts["cpu"]
    assert int((cpu / standby.cgroup / "cpu.shares").read_text()) == weight_to_shares(CPU_WEIGHT_MIN)
    worker = start_in(standby)
    isolator.freeze("s", "burstable")
    assert isolator.frozen("s", "burstable") == "frozen"
    assert status_field(worker.pid, "State").startswith(("D", "S"))

    taken = isolator.change_class(guaranteed("s"), "burstable")
    assert taken.cgroup != standby.cgroup
    assert not (cpu / standby.cgroup).exists(), "the standby's cgroup went"
    assert isolator.frozen("s", "guaranteed") == "thawed"
    weight = qos_parameters("guaranteed", cpus=1, memory_bytes=128 * MiB, cpu_idle_available=False).cpu_weight
    shares = int((cpu / taken.cgroup / "cpu.shares").read_text())
    assert shares == weight_to_shares(weight) > 2 * weight_to_shares(CPU_WEIGHT_MIN)
    assert str(worker.pid) in (host.v1_mounts["cpuset"] / taken.cgroup / "cgroup.procs").read_text().split()
    assert status_field(worker.pid, "Cpus_allowed_list") == "1"
    assert worker.proc.poll() is None
