"""nodeagent doctor on fake hosts (trees under tmp_path) and once on this host."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from nodeagent.agent.doctor import (
    Check,
    HostRoots,
    exit_code,
    overall,
    run_checks,
    to_json,
    to_table,
)
from nodeagent.cli.cmd_doctor import command
from nodeagent.devices.topology import Fpga, Gpu, MigInstance, MigState
from nodeagent.runtime.podman_facts import PodmanFacts
from tests.trees import write_tree

ALL_CAPS = "000001ffffffffff"
STATUS = "Name:\tnodeagent\nUid:\t0\t0\t0\t0\nCapEff:\t{caps}\n"
PROC_COMMON = {
    "self/ns/net": "",
    "self/status": STATUS.format(caps=ALL_CAPS),
    "pressure/cpu": "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
    "sys/kernel/numa_balancing": "0\n",
    "sys/kernel/unprivileged_bpf_disabled": "2\n",
    "swaps": "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n",
    "cpuinfo": "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse2 avx2\n\n",
    # What the worker sandbox needs: namespaces, seccomp filter mode, a kernel with hidepid.
    "sys/kernel/osrelease": "6.1.0\n",
    "sys/kernel/seccomp/actions_avail": "kill_process kill_thread errno trace log allow\n",
    **{f"self/ns/{ns}": "" for ns in ("mnt", "pid", "ipc", "uts", "cgroup", "user")},
}
SYS_COMMON = {"sys/devices/system/cpu/isolated": "\n"}

HEALTHY_V2 = {
    **{f"proc/{k}": v for k, v in PROC_COMMON.items()},
    **SYS_COMMON,
    "proc/self/mountinfo": "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n",
    "proc/cgroups": "#subsys_name\thierarchy\tnum_cgroups\tenabled\ncpuset\t0\t1\t1\ncpu\t0\t1\t1\n"
    "memory\t0\t1\t1\npids\t0\t1\t1\nio\t0\t1\t1\n",
    "proc/self/cgroup": "0::/system.slice/nodeagent.service\n",
    "sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory hugetlb pids rdma misc\n",
    "sys/fs/cgroup/cgroup.subtree_control": "cpuset cpu io memory pids\n",
    "sys/fs/cgroup/cpuset.cpus.effective": "0-15\n",
    "sys/fs/cgroup/cpuset.mems.effective": "0-1\n",
    # resctrl mounted on an RDT host
    "sys/fs/resctrl/info/L3/cbm_mask": "7ff\n",
    "sys/fs/resctrl/info/L3/min_cbm_bits": "1\n",
    "sys/fs/resctrl/info/L3/num_closids": "16\n",
    "sys/fs/resctrl/info/L3/shareable_bits": "0\n",
    "sys/fs/resctrl/info/MB/min_bandwidth": "10\n",
    "sys/fs/resctrl/info/MB/bandwidth_gran": "10\n",
    "sys/fs/resctrl/info/MB/num_closids": "8\n",
    "sys/fs/resctrl/schemata": "L3:0=7ff;1=7ff\nMB:0=100;1=100\n",
}

_V1 = ("cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "blkio", "pids")
# The shape of this host: v1 controllers, an empty cgroup2 at /sys/fs/cgroup/unified.
HYBRID = {
    **{f"proc/{k}": v for k, v in PROC_COMMON.items()},
    **SYS_COMMON,
    "proc/self/mountinfo": "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
    + "".join(
        f"{32 + i} 31 0:{29 + i} / /sys/fs/cgroup/{c} rw,relatime - cgroup cgroup rw,{c}\n"
        for i, c in enumerate(_V1)
    )
    + "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n",
    "proc/cgroups": "#subsys_name\thierarchy\tnum_cgroups\tenabled\n"
    + "".join(f"{c}\t{i + 1}\t1\t1\n" for i, c in enumerate(_V1))
    + "hugetlb\t0\t1\t1\n",
    "proc/self/cgroup": "8:pids:/\n3:cpuset:/\n0::/\n",
    "sys/fs/cgroup/cpuset/cpuset.cpus": "0-1\n",
    "sys/fs/cgroup/cpuset/cpuset.mems": "0\n",
    "sys/fs/cgroup/unified/cgroup.controllers": "hugetlb\n",
    **{f"sys/fs/cgroup/{c}/tasks": "1\n" for c in _V1},
}

# A host with nothing: no cgroups, no PSI, not root, swap on, NUMA balancing on.
NOTHING = {
    "proc/self/mountinfo": "22 1 0:21 / /proc rw - proc proc rw\n",
    "proc/self/status": STATUS.format(caps="0000000000000000"),
    "proc/sys/kernel/numa_balancing": "1\n",
    "proc/swaps": "Filename\tType\tSize\tUsed\tPriority\n/swapfile file\t4194300\t0\t-2\n",
    "proc/cpuinfo": "processor\t: 0\nflags\t\t: fpu\n\n",
}


def fake_host(tmp_path: Path, files: dict[str, str], **kwargs: object) -> HostRoots:
    base = write_tree(tmp_path / "host", files)
    defaults: dict[str, object] = {
        "euid": 0,
        "bpf_probe": lambda: None,
        "cache_miss_probe": lambda: None,
        "firewall_probe": lambda: None,
        "sandbox_probe": lambda: {"namespace mount": "ok", "seccomp filter": "ok"},
        "podman_probe": lambda podman: PodmanFacts("4.3.1", "crun", "crun version 1.8.1", "cgroupfs"),
        "which": lambda name: f"/usr/sbin/{name}",
        "gpus": lambda sys_root: (),
        "fpgas": lambda sys_root, dev_root: (),
    }
    return HostRoots.under(base, **{**defaults, **kwargs})


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def statuses(checks: list[Check]) -> dict[str, str]:
    return {c.name: c.status for c in checks}


def test_healthy_v2_host(tmp_path: Path) -> None:
    checks = run_checks(fake_host(tmp_path, HEALTHY_V2))
    assert statuses(checks) == dict.fromkeys(
        [
            "privileges",
            "cgroup mode",
            "cgroup controllers",
            "cpuset",
            "device access control",
            "network namespaces",
            "network firewall",
            "worker sandbox",
            "container workers",
            "GPUs",
            "MIG",
            "FPGAs",
            "cache/memory-bandwidth isolation",
            "best-effort memory bandwidth",
            "PSI",
            "isolcpus",
            "exclusive CPU noise",
            "NUMA balancing",
            "NUMA memory",
            "swap",
        ],
        "OK",
    )
    found = by_name(checks)
    assert found["cgroup mode"].detail.startswith("v2")
    assert found["device access control"].detail == "eBPF device programs"
    assert "L3 CAT 11 ways on domains [0, 1]" in found["cache/memory-bandwidth isolation"].detail
    assert "8 CLOSIDs" in found["cache/memory-bandwidth isolation"].detail
    assert (overall(checks), exit_code(checks)) == ("OK", 0)


def test_hybrid_host_like_this_one(tmp_path: Path) -> None:
    checks = run_checks(fake_host(tmp_path, HYBRID))
    found = by_name(checks)
    assert found["cgroup mode"].status == "WARN"
    assert found["cgroup mode"].detail.startswith("hybrid")
    assert "hugetlb" in found["cgroup mode"].detail
    assert found["cgroup controllers"].status == "OK"
    assert found["cpuset"].status == "OK"
    assert "CPUs 0-1" in found["cpuset"].detail
    assert found["device access control"].detail.startswith("v1 devices controller")
    assert "the CPU has no RDT" in found["cache/memory-bandwidth isolation"].detail
    assert (overall(checks), exit_code(checks)) == ("WARN", 0)


def test_host_with_nothing_fails(tmp_path: Path) -> None:
    checks = run_checks(fake_host(tmp_path, NOTHING, euid=1000, which=lambda name: None))
    found = by_name(checks)
    assert found["cgroup mode"].status == "FAIL"
    assert found["privileges"].status == "FAIL"
    assert found["cgroup controllers"].status == "FAIL"
    assert "missing required cpuset, memory, pids" in found["cgroup controllers"].detail
    assert found["network namespaces"].status == "WARN"
    assert found["PSI"].status == "WARN"
    assert found["swap"].status == "WARN"
    assert "1 device(s), 4.0 GiB" in found["swap"].detail
    assert found["NUMA balancing"].status == "WARN"
    assert "migrate memory of pinned workers" in found["NUMA balancing"].detail
    assert found["isolcpus"].status == "WARN"
    assert (overall(checks), exit_code(checks)) == ("FAIL", 1)


@pytest.mark.parametrize(
    ("change", "check", "status", "detail"),
    [
        pytest.param(
            {"sys/fs/cgroup/cgroup.controllers": "cpu io memory\n"},
            "cgroup controllers", "FAIL", "missing required cpuset, pids", id="v2-without-cpuset-pids",
        ),
        pytest.param(
            {"sys/fs/cgroup/cgroup.controllers": "cpuset memory pids\n"},
            "cgroup controllers", "WARN", "missing cpu, io", id="v2-without-cpu-io",
        ),
        pytest.param(
            {"sys/fs/cgroup/cpuset.cpus.effective": "\n"},
            "cpuset", "FAIL", "missing or empty", id="empty-cpuset",
        ),
        pytest.param(
            {"sys/devices/system/cpu/isolated": "2-7\n"},
            "isolcpus", "OK", "isolated CPUs 2-7", id="isolcpus-set",
        ),
        pytest.param(
            {"proc/self/status": STATUS.format(caps="0000000000001000")},
            "network namespaces", "WARN", "missing CAP_SYS_ADMIN", id="netns-without-sys-admin",
        ),
        pytest.param(
            {"proc/self/status": STATUS.format(caps="000001fffeffffff")},
            "privileges", "WARN", "without CAP_SYS_RESOURCE", id="root-without-sys-resource",
        ),
        pytest.param(
            {
                "proc/meminfo": "MemTotal:       16777216 kB\n",
                "sys/devices/system/node/node0/meminfo": "Node 0 MemTotal:        8388608 kB\n",
                "sys/devices/system/node/node1/meminfo": "Node 1 MemTotal:        8388608 kB\n",
            },
            "NUMA memory", "OK", "2 node(s) hold 16.0 GiB of 16.0 GiB", id="numa-memory-adds-up",
        ),
        pytest.param(
            {
                "proc/meminfo": "MemTotal:       25165824 kB\n",
                "sys/devices/system/node/node0/meminfo": "Node 0 MemTotal:        6291456 kB\n",
            },
            "NUMA memory", "WARN", "1 node(s) hold 6.0 GiB of 24.0 GiB", id="numa-memory-missing",
        ),
        pytest.param(
            {"sys/fs/resctrl/info/L3/cbm_mask": None, "sys/fs/resctrl/info/MB/min_bandwidth": None},
            "cache/memory-bandwidth isolation", "WARN", "cannot read resctrl", id="resctrl-broken-info",
        ),
    ],
)  # fmt: skip
def test_single_findings(tmp_path: Path, change: dict, check: str, status: str, detail: str) -> None:
    files = {k: v for k, v in {**HEALTHY_V2, **change}.items() if v is not None}
    if None in change.values():
        # A directory that lost its files: keep the directory so the resource still looks present.
        for rel in (k for k, v in change.items() if v is None):
            (tmp_path / "host" / rel).parent.mkdir(parents=True, exist_ok=True)
    found = by_name(run_checks(fake_host(tmp_path, files)))[check]
    assert (found.status, detail in found.detail) == (status, True), found


def test_resctrl_not_mounted_on_rdt_cpu(tmp_path: Path) -> None:
    files = {k: v for k, v in HEALTHY_V2.items() if not k.startswith("sys/fs/resctrl/")}
    files["proc/cpuinfo"] = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu rdt_a cat_l3 mba\n\n"
    files["proc/filesystems"] = "nodev\tresctrl\n"
    found = by_name(run_checks(fake_host(tmp_path, files)))["cache/memory-bandwidth isolation"]
    assert found.status == "WARN"
    assert "not mounted" in found.detail
    assert found.hint == "mount -t resctrl resctrl /sys/fs/resctrl"


def test_without_mba_the_bandwidth_proxy_needs_cache_miss_counters(tmp_path: Path) -> None:
    with_mba = by_name(run_checks(fake_host(tmp_path / "mba", HEALTHY_V2)))["best-effort memory bandwidth"]
    assert with_mba.status == "OK"
    assert "MBA" in with_mba.detail
    files = {k: v for k, v in HEALTHY_V2.items() if not k.startswith("sys/fs/resctrl/")}
    counted = by_name(run_checks(fake_host(tmp_path / "a", files)))["best-effort memory bandwidth"]
    assert counted.status == "OK"
    assert "cache misses" in counted.detail
    no_pmu = "perf_event_open(cache-misses): No such file or directory (no hardware PMU)"
    roots = fake_host(tmp_path / "b", files, cache_miss_probe=lambda: no_pmu)
    blind = by_name(run_checks(roots))["best-effort memory bandwidth"]
    assert blind.status == "WARN"
    assert no_pmu in blind.detail
    assert "bounded only by its CPU allowance" in blind.detail
    assert "PMU" in blind.hint


def test_ebpf_refused_on_pure_v2_is_a_warning(tmp_path: Path) -> None:
    roots = fake_host(tmp_path, HEALTHY_V2, bpf_probe=lambda: "loading a program: Operation not permitted")
    found = by_name(run_checks(roots))["device access control"]
    assert found.status == "WARN"
    assert "Operation not permitted" in found.detail


def test_unprivileged_bpf_disabled_is_reported_without_probing(tmp_path: Path) -> None:
    def probe() -> str | None:
        raise AssertionError("must not load a program as non-root when the sysctl forbids it")

    roots = fake_host(tmp_path, HEALTHY_V2, euid=1000, bpf_probe=probe)
    found = by_name(run_checks(roots))["device access control"]
    assert (found.status, "unprivileged_bpf_disabled" in found.detail) == ("WARN", True)


def test_missing_firewall_is_a_warning_that_says_what_to_do(tmp_path: Path) -> None:
    reason = "libnftables.so.1 cannot be loaded (No such file)"
    roots = fake_host(tmp_path, HEALTHY_V2, firewall_probe=lambda: reason)
    checks = run_checks(roots)
    found = by_name(checks)["network firewall"]
    assert (found.status, found.detail) == ("WARN", reason)
    assert "apt-get install nftables" in found.hint
    assert "allow_unfiltered_network" in found.hint
    assert (overall(checks), exit_code(checks)) == ("WARN", 0)


def test_firewall_is_not_probed_without_root(tmp_path: Path) -> None:
    def probe() -> str | None:
        raise AssertionError("loading nftables rules needs CAP_NET_ADMIN: no probe as non-root")

    checks = run_checks(fake_host(tmp_path, HEALTHY_V2, euid=1000, firewall_probe=probe))
    found = by_name(checks)["network firewall"]
    assert (found.status, "not root" in found.detail) == ("WARN", True)


def _gpu(index: int, mig: MigState | None = None, healthy: bool | None = True) -> Gpu:
    return Gpu(
        index, f"GPU-{index}", "NVIDIA A100", f"0000:{index + 1:02x}:00.0", 0, 40 << 30, mig, healthy=healthy
    )


@pytest.mark.parametrize(
    ("gpus", "gpu_status", "mig_status", "mig_detail"),
    [
        pytest.param((_gpu(0),), "OK", "OK", "no MIG-capable", id="one-gpu-no-mig"),
        pytest.param((_gpu(0, MigState(False)),), "OK", "OK", "supported but off", id="mig-off"),
        pytest.param(
            (_gpu(0, MigState(True, (MigInstance(1, 0, "1g.10gb", 0, 1, "MIG-x", 10 << 30),))),),
            "OK", "OK", "GPU 0: 1 instance(s)", id="mig-on",
        ),
        pytest.param((_gpu(0, healthy=False),), "WARN", "OK", "no MIG-capable", id="unhealthy"),
    ],
)  # fmt: skip
def test_gpu_and_mig(tmp_path: Path, gpus: tuple, gpu_status: str, mig_status: str, mig_detail: str) -> None:
    found = by_name(run_checks(fake_host(tmp_path, HEALTHY_V2, gpus=lambda sys_root: gpus)))
    assert found["GPUs"].status == gpu_status
    assert (found["MIG"].status, mig_detail in found["MIG"].detail) == (mig_status, True)


def test_nvidia_on_bus_without_driver(tmp_path: Path) -> None:
    device = "sys/bus/pci/devices/0000:3b:00.0"
    files = {
        **HEALTHY_V2,
        f"{device}/vendor": "0x10de\n",
        f"{device}/device": "0x20b0\n",
        f"{device}/class": "0x030200\n",
        f"{device}/numa_node": "0\n",
    }
    found = by_name(run_checks(fake_host(tmp_path, files)))
    assert found["GPUs"].status == "WARN"
    assert "on the PCI bus but NVML reports none" in found["GPUs"].detail
    assert found["MIG"].status == "WARN"


def test_fpga_without_device_nodes(tmp_path: Path) -> None:
    fpgas = (Fpga("fpga0", "0x10ee", "0x5005", "0000:af:00.0", 1, ()),)
    found = by_name(run_checks(fake_host(tmp_path, HEALTHY_V2, fpgas=lambda s, d: fpgas)))["FPGAs"]
    assert (found.status, "0000:af:00.0" in found.detail) == ("WARN", True)


def test_a_crashing_check_is_reported_not_raised(tmp_path: Path) -> None:
    def broken(sys_root: Path, dev_root: Path) -> tuple:
        raise RuntimeError("boom")

    found = by_name(run_checks(fake_host(tmp_path, HEALTHY_V2, fpgas=broken)))["FPGAs"]
    assert (found.status, "boom" in found.detail) == ("WARN", True)


def test_reports() -> None:
    checks = [Check("a", "OK", "fine"), Check("b", "WARN", "meh", "do x"), Check("c", "OK", "ok", "optional")]
    table = to_table(checks)
    assert table.splitlines() == [
        "OK    a  fine",
        "WARN  b  meh",
        "         -> do x",
        "OK    c  ok",
        "overall: WARN",
    ]
    data = json.loads(to_json(checks))
    assert data["status"] == "WARN"
    assert data["checks"][1] == {"name": "b", "status": "WARN", "detail": "meh", "hint": "do x"}


@pytest.mark.kernel
def test_this_host_reports_hybrid() -> None:
    if not Path("/sys/fs/cgroup/unified").is_dir() or not Path("/sys/fs/cgroup/cpuset").is_dir():
        pytest.skip("this test describes the hybrid development host")
    result = CliRunner().invoke(command, ["--json"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    data = json.loads(result.output)
    found = {c["name"]: c for c in data["checks"]}
    assert found["cgroup mode"]["detail"].startswith("hybrid")
    assert data["status"] in ("OK", "WARN", "FAIL")
    assert result.exit_code == (1 if data["status"] == "FAIL" else 0)
    table = CliRunner().invoke(command, [])
    assert "cgroup mode" in table.output
    assert table.output.rstrip().endswith(f"overall: {data['status']}")


# --------------------------------------------------------------------------- host partitioning


def test_exclusive_cpu_noise_lists_what_cannot_move(tmp_path: Path) -> None:
    from nodeagent.agent.doctor import check_unmovable
    from nodeagent.isolation.host import PF_KTHREAD, PF_NO_SETAFFINITY

    flags = PF_KTHREAD | PF_NO_SETAFFINITY
    tree = {
        "proc/20/stat": f"20 (ksoftirqd/3) S 2 0 0 0 0 {flags} 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n",
        "proc/21/stat": "21 (sshd) S 1 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n",
        "proc/interrupts": "           CPU0\n 33:   3   PCI-MSI 81921-edge   nvme0q1\n",
        "sys/kernel/debug/irq/irqs/33": "handler: handle_edge_irq\nstate: IRQD_AFFINITY_MANAGED\n",
        "sys/kernel/debug/irq/irqs/34": "state: \n",
        "sys/devices/system/cpu/nohz_full": "(null)\n",
    }
    check = check_unmovable(HostRoots.under(write_tree(tmp_path, tree)))
    assert check.status == "OK"
    assert "per-CPU kernel threads cannot move (ksoftirqd)" in check.detail
    assert "managed interrupts stay where the kernel put them: 33 (nvme0q1)" in check.detail
    assert "nohz_full=CPUS" in check.hint


def test_an_irqbalance_without_its_socket_is_a_warning(tmp_path: Path) -> None:
    from nodeagent.agent.doctor import check_unmovable

    root = write_tree(tmp_path, {"proc/77/comm": "irqbalance\n", "proc/77/stat": "77 (irqbalance) S 1 0\n"})
    check = check_unmovable(HostRoots.under(root))
    assert check.status == "WARN"
    assert "irqbalance (pid 77) runs without its control socket" in check.detail
    write_tree(root, {"run/irqbalance/irqbalance77.sock": ""})
    assert check_unmovable(HostRoots.under(root)).status == "OK"


@pytest.mark.parametrize(
    ("status", "expected", "detail"),
    [
        pytest.param(None, "WARN", "does not partition", id="no-isolation"),
        pytest.param({"mode": "off"}, "WARN", "off: every process", id="off"),
        pytest.param(
            {"mode": "auto", "active": False, "last": None}, "OK", "no exclusive CPU is held", id="idle"
        ),
        pytest.param(
            {
                "mode": "auto",
                "active": True,
                "last": {
                    "exclusive_cpus": "3",
                    "host_cpus": "0-2",
                    "confined": {"tasks": 120, "irq": 9, "cgroup": 0},
                    "immovable": ["interrupt 33 (nvme0q1) stays on CPU(s) 3: a managed interrupt"],
                    "warnings": [],
                    "problems": [],
                },
            },
            "OK",
            "exclusive CPUs 3, the rest of the host on 0-2; confined: 9 irq, 120 tasks; "
            "cannot move (1): interrupt 33",
            id="active",
        ),
        pytest.param(
            {"mode": "auto", "active": True, "error": "partition: disk full", "last": {"confined": {}}},
            "WARN",
            "last pass failed: partition: disk full",
            id="failed",
        ),
    ],
)
def test_host_partitioning_from_the_agents_node(status: object, expected: str, detail: str) -> None:
    from nodeagent.agent.doctor import check_host_partitioning

    check = check_host_partitioning({"host_partitioning": status})
    assert check.status == expected
    assert detail in check.detail


def test_foreign_cpu_time_warns_above_one_percent() -> None:
    from nodeagent.agent.doctor import agent_checks

    quiet = {
        "name": "a",
        "assignment": {"cpuset": "3"},
        "foreign_cpu": {"seconds": 0.1, "fraction": 0.001, "irq_seconds": 0.1},
    }
    noisy = {
        "name": "b",
        "assignment": {"cpuset": "2"},
        "foreign_cpu": {"seconds": 9.0, "fraction": 0.3, "irq_seconds": 0.0},
    }
    shared = {"name": "c", "foreign_cpu": None}
    host, foreign = agent_checks({"host_partitioning": {"mode": "auto", "active": False}}, [quiet, shared])
    assert host.name == "host partitioning"
    assert foreign.status == "OK"
    assert foreign.detail == "a (CPUs 3): 0.10% of its CPU time (0.10 s, of which interrupts 0.10 s)"
    _, foreign = agent_checks({}, [quiet, noisy])
    assert foreign.status == "WARN"
    assert foreign.detail.startswith("b (CPUs 2): 30.00%")
    assert agent_checks({}, [shared])[1].detail == "no guaranteed slot to measure"


def test_sandbox_that_works_is_ok_and_says_what_was_tried(tmp_path: Path) -> None:
    found = by_name(run_checks(fake_host(tmp_path, HEALTHY_V2)))["worker sandbox"]
    assert found.status == "OK"
    assert "tried live" in found.detail
    assert "cgroup, ipc, mount, pid, user, uts" in found.detail


@pytest.mark.parametrize(
    ("change", "probe", "expected"),
    [
        pytest.param({"proc/sys/kernel/osrelease": "5.4.0\n"}, {}, "hidepid", id="kernel-before-5.8"),
        pytest.param(
            {"proc/sys/kernel/seccomp/actions_avail": "allow\n"}, {}, "seccomp", id="no-filter-mode"
        ),
        pytest.param(
            {}, {"namespace mount": "EPERM: Operation not permitted"}, "namespace mount: EPERM", id="live"
        ),
    ],
)
def test_sandbox_missing_a_piece_is_a_warning_that_says_what_to_do(
    tmp_path: Path, change: dict[str, str], probe: dict[str, str], expected: str
) -> None:
    roots = fake_host(tmp_path, {**HEALTHY_V2, **change}, sandbox_probe=lambda: probe)
    checks = run_checks(roots)
    found = by_name(checks)["worker sandbox"]
    assert found.status == "WARN"
    assert expected in found.detail
    assert "enabled = false" in found.hint
    assert exit_code(checks) == 0


def test_sandbox_is_not_tried_without_root(tmp_path: Path) -> None:
    def probe() -> dict[str, str]:
        raise AssertionError("namespaces and mounts need root: no live probe as non-root")

    found = by_name(run_checks(fake_host(tmp_path, HEALTHY_V2, euid=1000, sandbox_probe=probe)))[
        "worker sandbox"
    ]
    assert (found.status, "not root" in found.detail) == ("WARN", True)


def test_container_workers(tmp_path: Path) -> None:
    found = by_name(run_checks(fake_host(tmp_path, HEALTHY_V2)))["container workers"]
    assert (found.status, found.detail) == (
        "OK",
        "podman 4.3.1, runtime crun (podman's default crun crun version 1.8.1)",
    )
    hybrid = by_name(run_checks(fake_host(tmp_path / "h", HYBRID)))["container workers"]
    assert hybrid.detail.startswith("podman 4.3.1, runtime runc")  # crun refuses hybrid hosts
    no_podman = fake_host(
        tmp_path / "n", HYBRID, which=lambda name: None if name == "podman" else f"/usr/bin/{name}"
    )
    missing = by_name(run_checks(no_podman))["container workers"]
    assert (missing.status, missing.hint) == (
        "WARN",
        "apt-get install podman runc catatonit (command workers are not affected)",
    )
    no_runc = fake_host(
        tmp_path / "r", HYBRID, which=lambda name: None if name == "runc" else f"/usr/bin/{name}"
    )
    found = by_name(run_checks(no_runc))["container workers"]
    assert (found.status, found.hint) == ("WARN", "apt-get install runc")

    def broken(podman: str) -> PodmanFacts:
        raise ValueError("database is locked")

    found = by_name(run_checks(fake_host(tmp_path / "b", HYBRID, podman_probe=broken)))["container workers"]
    assert found.status == "WARN"
    assert "database is locked" in found.detail


def test_the_kubernetes_integrations_the_agent_runs() -> None:
    from nodeagent.agent.doctor import agent_checks, check_kubernetes

    assert check_kubernetes({}) is None
    assert check_kubernetes({"integrations": {}}) is None
    assert len(agent_checks({"integrations": {}}, [])) == 2  # none on: no line for them
    working = check_kubernetes({"integrations": {"device_plugin": [], "node_resource_topology": []}})
    assert working is not None
    assert (working.status, working.detail) == ("OK", "device_plugin, node_resource_topology: working")
    failing = check_kubernetes(
        {"integrations": {"device_plugin": [], "node_resource_topology": ["API server did not answer"]}}
    )
    assert failing is not None
    assert failing.status == "WARN"
    assert failing.detail == "node_resource_topology: API server did not answer"
    assert agent_checks({"integrations": {"node_resource_topology": ["x"]}}, [])[-1] == failing.__class__(
        "kubernetes", "WARN", "node_resource_topology: x", failing.hint
    )
