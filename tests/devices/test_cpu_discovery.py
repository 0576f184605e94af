"""CPU/NUMA discovery on fake sysfs trees (tests/devices/sysfs_trees.py) and on this host."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from nodeagent.cpulist import parse_cpulist
from nodeagent.devices.cpu import CPU_DIR, NODE_DIR, CpuTopology, cpu_model, discover_cpu_topology
from nodeagent.devices.discovery import discover
from nodeagent.devices.topology import (
    Fpga,
    Gpu,
    MigInstance,
    MigState,
    Sriov,
    Topology,
    topology_from_dict,
    topology_to_dict,
)
from nodeagent.errors import DiscoveryError
from nodeagent.kernelfs import Sysfs
from tests.devices import sysfs_trees as trees
from tests.trees import write_tree

GIB = 1024**3


def cpus(text: str) -> frozenset[int]:
    return parse_cpulist(text)


def discover_tree(tmp_path: Path, tree: dict[str, str], meminfo: str | None = None) -> CpuTopology:
    write_tree(tmp_path / "sys", tree)
    proc = tmp_path / "proc"
    proc.mkdir(exist_ok=True)
    if meminfo is not None:
        (proc / "meminfo").write_text(meminfo)
    return discover_cpu_topology(Sysfs(tmp_path / "sys"), proc_root=proc)


def groups(topo: CpuTopology, key: str) -> set[frozenset[int]]:
    """CPUs partitioned by one attribute (core, socket, numa, l3), ignoring CPUs where it is None."""
    out: dict[Any, set[int]] = {}
    for c in topo.cpus:
        value = getattr(c, key)
        if value is not None:
            out.setdefault(value, set()).add(c.id)
    return {frozenset(v) for v in out.values()}


# --------------------------------------------------------------------------- named trees


@dataclass(frozen=True)
class Expected:
    cpu_count: int
    online: str
    sockets: dict[int, str]
    numa: dict[int, str]
    distances: dict[int, tuple[int, ...]]
    node_memory: int
    cores: list[str] = field(default_factory=list)  #: every core's CPUs; empty: only count them
    core_count: int = 0
    l3: dict[int, str] = field(default_factory=dict)  #: L3 id -> its CPUs
    l3_count: int = 0
    isolated: str = ""


EXPECTED = {
    "single_socket_ht": Expected(
        cpu_count=8,
        online="0-7",
        sockets={0: "0-7"},
        numa={0: "0-7"},
        distances={0: (10,)},
        node_memory=16 * GIB,
        cores=["0,4", "1,5", "2,6", "3,7"],
        l3={0: "0-7"},
    ),
    # core_id 0,2,4,6 on both packages: only (package, core_id) tells cores apart. No L3 ids.
    "dual_socket_ht": Expected(
        cpu_count=16,
        online="0-15",
        sockets={0: "0-3,8-11", 1: "4-7,12-15"},
        numa={0: "0-3,8-11", 1: "4-7,12-15"},
        distances={0: (10, 21), 1: (21, 10)},
        node_memory=16 * GIB,
        cores=["0,8", "1,9", "2,10", "3,11", "4,12", "5,13", "6,14", "7,15"],
        l3={0: "0-3,8-11", 1: "4-7,12-15"},
    ),
    "four_numa_nps2": Expected(
        cpu_count=32,
        online="0-31",
        sockets={0: "0-7,16-23", 1: "8-15,24-31"},
        numa={0: "0-3,16-19", 1: "4-7,20-23", 2: "8-11,24-27", 3: "12-15,28-31"},
        distances={0: (10, 12, 32, 32), 1: (12, 10, 32, 32), 2: (32, 32, 10, 12), 3: (32, 32, 12, 10)},
        node_memory=16 * GIB,
        core_count=16,
        l3={
            0: "0-1,16-17",
            1: "2-3,18-19",
            2: "4-5,20-21",
            3: "6-7,22-23",
            4: "8-9,24-25",
            5: "10-11,26-27",
            6: "12-13,28-29",
            7: "14-15,30-31",
        },
    ),
    # 3 and 7 (one whole core) and 5 (sibling of 1) are offline: each gets a core of its own.
    "offline_cpus": Expected(
        cpu_count=8,
        online="0-2,4,6",
        sockets={0: "0-7"},
        numa={0: "0-7"},
        distances={0: (10,)},
        node_memory=16 * GIB,
        cores=["0,4", "1", "2,6", "3", "5", "7"],
        l3={0: "0-2,4,6"},
    ),
    "isolcpus": Expected(
        cpu_count=16,
        online="0-15",
        sockets={0: "0-3,8-11", 1: "4-7,12-15"},
        numa={0: "0-3,8-11", 1: "4-7,12-15"},
        distances={0: (10, 21), 1: (21, 10)},
        node_memory=16 * GIB,
        core_count=8,
        l3={0: "0-3,8-11", 1: "4-7,12-15"},
        isolated="2-3,10-11",
    ),
    "large_384": Expected(
        cpu_count=384,
        online="0-383",
        sockets={0: "0-95,192-287", 1: "96-191,288-383"},
        numa={n: f"{n * 24}-{n * 24 + 23},{192 + n * 24}-{192 + n * 24 + 23}" for n in range(8)},
        distances={0: (10, 12, 12, 12, 32, 32, 32, 32), 5: (32, 32, 32, 32, 12, 10, 12, 12)},
        node_memory=96 * GIB,
        core_count=192,
        l3_count=24,
    ),
}


@pytest.fixture(scope="module")
def written_trees(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Writes each named tree once for this module (the big one takes seconds on a busy disk)."""
    roots: dict[str, Path] = {}

    def root_of(name: str) -> Path:
        if name not in roots:
            roots[name] = write_tree(tmp_path_factory.mktemp(name), trees.NAMED_TREES[name]())
        return roots[name]

    return root_of


@pytest.fixture(scope="module", params=sorted(EXPECTED), ids=str)
def named(
    request: pytest.FixtureRequest, written_trees: Callable[[str], Path]
) -> tuple[str, CpuTopology, Expected]:
    """Each named tree written and discovered once: the result is immutable, the tests only read it."""
    name = request.param
    root = written_trees(name)
    return name, discover_cpu_topology(Sysfs(root), proc_root=root), EXPECTED[name]


def test_lists_every_present_cpu_with_its_online_state(named: tuple[str, CpuTopology, Expected]) -> None:
    _, topo, exp = named
    assert [c.id for c in topo.cpus] == list(range(exp.cpu_count))
    assert {c.id for c in topo.cpus if c.online} == cpus(exp.online)


def test_core_index_is_unique_host_wide_and_shared_by_siblings(
    named: tuple[str, CpuTopology, Expected],
) -> None:
    _, topo, exp = named
    cores = groups(topo, "core")
    if exp.cores:
        assert cores == {cpus(c) for c in exp.cores}
    else:
        assert len(cores) == exp.core_count
    assert sorted({c.core for c in topo.cpus}) == list(range(len(cores))), "core indices must be dense"
    by_id = {c.id: c for c in topo.cpus}
    for core in cores:  # a physical core never straddles a socket or a NUMA node
        assert len({(by_id[i].socket, by_id[i].numa) for i in core}) == 1


def test_core_indices_follow_lowest_cpu_id(named: tuple[str, CpuTopology, Expected]) -> None:
    _, topo, _ = named
    first_cpu = {}
    for c in topo.cpus:
        first_cpu.setdefault(c.core, c.id)
    assert sorted(first_cpu, key=first_cpu.__getitem__) == sorted(first_cpu)


def test_sockets_and_numa_nodes(named: tuple[str, CpuTopology, Expected]) -> None:
    _, topo, exp = named
    for socket, members in exp.sockets.items():
        assert {c.id for c in topo.cpus if c.socket == socket} == cpus(members)
    assert [n.id for n in topo.numa_nodes] == sorted(exp.numa)
    for node in topo.numa_nodes:
        assert frozenset(node.cpus) == cpus(exp.numa[node.id])
        assert {c.id for c in topo.cpus if c.numa == node.id} == cpus(exp.numa[node.id])
        assert node.memory_bytes == exp.node_memory
    for node_id, row in exp.distances.items():
        assert next(n for n in topo.numa_nodes if n.id == node_id).distances == row


def test_l3_caches(named: tuple[str, CpuTopology, Expected]) -> None:
    _, topo, exp = named
    if exp.l3:
        assert {l3: {c.id for c in topo.cpus if c.l3 == l3} for l3 in exp.l3} == {
            l3: set(cpus(m)) for l3, m in exp.l3.items()
        }
    else:
        assert len(groups(topo, "l3")) == exp.l3_count
    offline_l3 = {c.l3 for c in topo.cpus if not c.online}
    assert offline_l3 <= {None}, "an offline CPU has no cache directory, so its L3 is unknown"


def test_isolated_cpus_and_total_memory(named: tuple[str, CpuTopology, Expected]) -> None:
    _, topo, exp = named
    assert topo.isolated_cpus == cpus(exp.isolated)
    assert topo.memory_bytes == exp.node_memory * len(exp.numa)


# --------------------------------------------------------------------------- rules and fallbacks


def l3_ids(topo: CpuTopology) -> dict[int, int | None]:
    return {c.id: c.l3 for c in topo.cpus}


def test_kernel_l3_ids_are_kept_when_unique(tmp_path: Path) -> None:
    topo = discover_tree(tmp_path, trees.generate_tree(sockets=2, l3_id_step=8))
    assert {c.l3 for c in topo.cpus if c.socket == 0} == {0}
    assert {c.l3 for c in topo.cpus if c.socket == 1} == {8}


def test_colliding_kernel_l3_ids_fall_back_to_dense_indices(tmp_path: Path) -> None:
    tree = trees.generate_tree(sockets=2, nodes_per_socket=2, l3_id_step=1)
    for rel in tree:
        if rel.endswith("cache/index3/id"):
            tree[rel] = "0"  # per-package numbering, as some firmware reports it
    topo = discover_tree(tmp_path, tree)
    assert sorted({c.l3 for c in topo.cpus}) == [0, 1, 2, 3]
    assert groups(topo, "l3") == groups(topo, "numa")


def test_no_cache_directories_mean_unknown_l3(tmp_path: Path) -> None:
    tree = {k: v for k, v in trees.single_socket_ht().items() if "/cache/" not in k}
    assert {c.l3 for c in discover_tree(tmp_path, tree).cpus} == {None}


def test_l3_found_at_another_index(tmp_path: Path) -> None:
    """Some CPUs (no separate L1i) describe the L3 as index2: found by reading each level."""
    tree = {}
    for rel, value in trees.single_socket_ht().items():
        if "/cache/index1/" in rel:
            continue
        tree[rel.replace("/cache/index2/", "/cache/index1/").replace("/cache/index3/", "/cache/index2/")] = (
            value
        )
    topo = discover_tree(tmp_path, tree)
    assert {c.l3 for c in topo.cpus} == {0}


def test_without_numa_support_node_0_holds_everything(tmp_path: Path) -> None:
    tree = {k: v for k, v in trees.dual_socket_ht().items() if not k.startswith(NODE_DIR)}
    topo = discover_tree(tmp_path, tree, meminfo="MemTotal:       8000000 kB\nMemFree:  1 kB\n")
    assert len(topo.numa_nodes) == 1
    node = topo.numa_nodes[0]
    assert (node.id, node.cpus, node.memory_bytes, node.distances) == (
        0,
        tuple(range(16)),
        8000000 * 1024,
        None,
    )
    assert {c.numa for c in topo.cpus} == {0}
    assert topo.memory_bytes == 8000000 * 1024
    assert groups(topo, "socket") == {cpus("0-3,8-11"), cpus("4-7,12-15")}


def test_memory_is_unknown_when_nothing_says(tmp_path: Path) -> None:
    tree = {k: v for k, v in trees.single_socket_ht().items() if not k.endswith("meminfo")}
    topo = discover_tree(tmp_path, tree)
    assert topo.numa_nodes[0].memory_bytes is None
    assert topo.memory_bytes is None


def test_total_memory_from_proc_when_a_node_does_not_say(tmp_path: Path) -> None:
    tree = trees.dual_socket_ht()
    tree[f"{NODE_DIR}/node1/meminfo"] = "Node 1 HugePages_Total: 0\n"
    topo = discover_tree(tmp_path, tree, meminfo="MemTotal: 100 kB\n")
    assert [n.memory_bytes for n in topo.numa_nodes] == [16 * GIB, None]
    assert topo.memory_bytes == 100 * 1024


def test_distance_row_of_the_wrong_length_is_unknown(tmp_path: Path) -> None:
    tree = trees.dual_socket_ht()
    tree[f"{NODE_DIR}/node1/distance"] = "21 10 10"
    topo = discover_tree(tmp_path, tree)
    assert [n.distances for n in topo.numa_nodes] == [(10, 21), None]


def test_offline_cpu_takes_numa_node_from_its_link_and_socket_from_that_node(tmp_path: Path) -> None:
    # CPU 5 is a socket-1 CPU (node 1) of dual_socket_ht; offline, it has no topology directory.
    topo = discover_tree(tmp_path, trees.generate_tree(sockets=2, offline=(5,)))
    cpu5 = topo.cpus[5]
    assert (cpu5.online, cpu5.numa, cpu5.socket, cpu5.l3) == (False, 1, 1, None)
    assert cpu5.core == max(c.core for c in topo.cpus), "offline CPUs come after every online core"
    assert 5 in topo.numa_nodes[1].cpus


def test_offline_cpu_without_any_node_hint_goes_to_the_lowest_node(tmp_path: Path) -> None:
    tree = trees.generate_tree(sockets=2, offline=(5,))
    del tree[f"{CPU_DIR}/cpu5/node1"]
    topo = discover_tree(tmp_path, tree)
    assert (topo.cpus[5].numa, topo.cpus[5].socket) == (0, 0)


def test_per_cpu_online_files_when_the_global_list_is_missing(tmp_path: Path) -> None:
    tree = trees.offline_cpus()
    del tree[f"{CPU_DIR}/online"]
    topo = discover_tree(tmp_path, tree)
    assert {c.id for c in topo.cpus if c.online} == cpus("0-2,4,6")


@pytest.mark.parametrize(
    ("removed", "expected_ids"),
    [
        pytest.param(("present",), "0-7", id="possible-when-no-present"),
        pytest.param(("present", "possible"), "0-7", id="cpu-dirs-when-no-lists"),
    ],
)
def test_which_cpus_exist(tmp_path: Path, removed: tuple[str, ...], expected_ids: str) -> None:
    tree = trees.single_socket_ht()
    for name in removed:
        del tree[f"{CPU_DIR}/{name}"]
    assert {c.id for c in discover_tree(tmp_path, tree).cpus} == cpus(expected_ids)


def test_present_wins_over_possible(tmp_path: Path) -> None:
    tree = trees.single_socket_ht()
    tree[f"{CPU_DIR}/possible"] = "0-63"  # firmware's hot-plug slots without a CPU in them
    assert len(discover_tree(tmp_path, tree).cpus) == 8


def test_old_kernel_without_die_and_package_lists(tmp_path: Path) -> None:
    """Before Linux 5.2/5.7 there is no die_id/die_cpus_list/package_cpus_list: same answer."""
    old_names = ("/die_id", "/die_cpus_list", "/package_cpus_list", "/core_cpus_list")
    full = discover_tree(tmp_path / "new", trees.four_numa_nps2())
    tree = {k: v for k, v in trees.four_numa_nps2().items() if not k.endswith(old_names)}
    assert discover_tree(tmp_path / "old", tree) == full


def test_missing_core_id_still_groups_siblings(tmp_path: Path) -> None:
    tree = {k: v for k, v in trees.dual_socket_ht().items() if not k.endswith("/core_id")}
    assert groups(discover_tree(tmp_path, tree), "core") == {cpus(f"{i},{i + 8}") for i in range(8)}


def test_unknown_package_id_counts_as_socket_0(tmp_path: Path) -> None:
    tree = trees.single_socket_ht()
    for rel in tree:
        if rel.endswith("/physical_package_id"):
            tree[rel] = "-1"
    assert {c.socket for c in discover_tree(tmp_path, tree).cpus} == {0}


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("rel", "content"),
    [
        pytest.param(f"{CPU_DIR}/present", "zzz", id="present-not-a-cpulist"),
        pytest.param(f"{CPU_DIR}/online", "0-", id="online-half-range"),
        pytest.param(f"{CPU_DIR}/isolated", "1,a", id="isolated-garbage"),
        pytest.param(f"{CPU_DIR}/cpu1/topology/core_id", "abc", id="core-id-not-int"),
        pytest.param(f"{CPU_DIR}/cpu0/topology/thread_siblings_list", "0-x", id="siblings-garbage"),
        pytest.param(f"{CPU_DIR}/cpu0/topology/physical_package_id", "\xff", id="package-not-int"),
        pytest.param(f"{CPU_DIR}/cpu0/cache/index3/id", "three", id="l3-id-not-int"),
        pytest.param(f"{NODE_DIR}/node0/distance", "10 x", id="distance-garbage"),
        pytest.param(f"{NODE_DIR}/node0/meminfo", "Node 0 MemTotal: lots kB\n", id="meminfo-garbage"),
        pytest.param(f"{NODE_DIR}/node0/cpulist", "-1", id="node-cpulist-negative"),
    ],
)
def test_garbage_file_names_its_path(tmp_path: Path, rel: str, content: str) -> None:
    tree = trees.single_socket_ht()
    tree[rel] = content
    with pytest.raises(DiscoveryError) as info:
        discover_tree(tmp_path, tree)
    assert str(tmp_path / "sys" / rel) in str(info.value)


def test_invalid_utf8_names_its_path(tmp_path: Path) -> None:
    root = write_tree(tmp_path / "sys", trees.single_socket_ht())
    (root / NODE_DIR / "node0" / "distance").write_bytes(b"\xff\xfe")
    with pytest.raises(DiscoveryError, match="node0/distance"):
        discover_cpu_topology(Sysfs(root), proc_root=tmp_path)


def test_unreadable_file_names_its_path_and_the_reason(tmp_path: Path) -> None:
    tree = trees.single_socket_ht()
    del tree[f"{CPU_DIR}/online"]
    root = write_tree(tmp_path / "sys", tree)
    (root / CPU_DIR / "online").mkdir()  # reading a directory fails with EISDIR, even as root
    with pytest.raises(DiscoveryError, match=r"reading .*/devices/system/cpu/online: .*EISDIR"):
        discover_cpu_topology(Sysfs(root), proc_root=tmp_path)


def test_missing_sysfs_root_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(DiscoveryError, match=r"no CPUs found under .*nowhere/devices/system/cpu.*sysfs"):
        discover_cpu_topology(Sysfs(tmp_path / "nowhere"), proc_root=tmp_path)


# --------------------------------------------------------------------------- JSON


SCHEMA = json.loads(resources.files("nodeagent.schema").joinpath("topology-v1.json").read_text())


def full_topology(tmp_path: Path, name: str) -> Topology:
    root = write_tree(tmp_path / "sys", trees.NAMED_TREES[name]())
    return discover(root, proc_root=tmp_path, gpus=False, fpgas=False)


@pytest.mark.parametrize("name", sorted(trees.NAMED_TREES))
def test_json_round_trip_and_schema(written_trees: Callable[[str], Path], name: str) -> None:
    root = written_trees(name)
    topo = discover(root, proc_root=root, gpus=False, fpgas=False)
    doc = json.loads(json.dumps(topology_to_dict(topo)))
    jsonschema.validate(doc, SCHEMA, cls=jsonschema.Draft202012Validator)
    assert topology_from_dict(doc) == topo


def with_devices(topo: Topology) -> Topology:
    mig = MigState(
        enabled=True,
        instances=(
            MigInstance(1, 0, "1g.10gb", 0, 1, "MIG-1111", 10 * GIB, ("/dev/nvidia-caps/nvidia-cap21",)),
            MigInstance(2, None, "3g.40gb", None, None, None, None),
        ),
    )
    gpus = (
        Gpu(0, "GPU-aaaa", "NVIDIA A100", "00000000:17:00.0", 0, 80 * GIB, mig, minor=0, healthy=True),
        Gpu(1, None, None, "00000000:65:00.0", None, None, None, healthy=False, health_events=("xid 79",)),
    )
    fpgas = (
        Fpga("0000:3b:00.0", "0x10ee", "0x5000", "0000:3b:00.0", 1, ("/dev/xclmgmt15104",), "xclmgmt", True),
        Fpga("0000:af:00.0", "0x1172", "0x5052", "0000:af:00.0", None, (), sriov=Sriov(8, 2)),
    )
    return Topology(
        topo.hostname, topo.cpus, topo.numa_nodes, gpus, fpgas, topo.memory_bytes, topo.isolated_cpus
    )


def test_json_with_gpus_mig_and_fpgas_round_trips_and_validates(tmp_path: Path) -> None:
    topo = with_devices(full_topology(tmp_path, "dual_socket_ht"))
    doc = json.loads(json.dumps(topology_to_dict(topo)))
    jsonschema.validate(doc, SCHEMA, cls=jsonschema.Draft202012Validator)
    assert topology_from_dict(doc) == topo


def _schema_props(definition: str | None = None) -> set[str]:
    node = SCHEMA if definition is None else SCHEMA["$defs"][definition]
    return set(node["properties"])


def test_schema_describes_exactly_the_fields_the_agent_writes(tmp_path: Path) -> None:
    doc = topology_to_dict(with_devices(full_topology(tmp_path, "single_socket_ht")))
    gpu, fpga = doc["gpus"][0], doc["fpgas"][0]
    assert set(doc) == _schema_props()
    assert set(doc["cpus"][0]) == _schema_props("cpu")
    assert set(doc["numa_nodes"][0]) == _schema_props("numa_node")
    assert set(gpu) == _schema_props("gpu")
    assert set(gpu["mig"]) == _schema_props("mig")
    assert set(gpu["mig"]["instances"][0]) == _schema_props("mig_instance")
    assert set(fpga) == _schema_props("fpga")


@pytest.mark.parametrize(
    ("path", "value"),
    [
        pytest.param(("schema",), "nodeagent.topology/v2", id="wrong-schema-name"),
        pytest.param(("cpus", 0, "core"), -1, id="negative-core"),
        pytest.param(("cpus", 0, "online"), "yes", id="online-not-bool"),
        pytest.param(("cpus", 0, "numa"), None, id="numa-null"),
        pytest.param(("cpus", 0, "speed"), 3, id="unknown-cpu-field"),
        pytest.param(("numa_nodes", 0, "distances"), ["10"], id="distance-string"),
        pytest.param(("gpus", 0, "mig", "instances", 0, "placement"), {"start": 0}, id="placement-no-size"),
        pytest.param(("fpgas", 0, "device_nodes"), None, id="fpga-device-nodes-null"),
    ],
)
def test_schema_rejects_bad_documents(tmp_path: Path, path: tuple[Any, ...], value: Any) -> None:
    doc = topology_to_dict(with_devices(full_topology(tmp_path, "single_socket_ht")))
    target: Any = doc
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, SCHEMA, cls=jsonschema.Draft202012Validator)


def test_schema_document_is_valid_draft_2020_12() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


# --------------------------------------------------------------------------- this host


def host_sysfs_or_skip() -> Path:
    root = Path("/sys")
    if not (root / CPU_DIR).is_dir():
        pytest.skip("no sysfs CPU directory on this host")
    return root


@pytest.mark.kernel
def test_host_matches_lscpu() -> None:
    root = host_sysfs_or_skip()
    lscpu = shutil.which("lscpu")
    if lscpu is None:
        pytest.skip("lscpu (util-linux) is not installed")
    out = subprocess.run(
        [lscpu, "-p=CPU,CORE,SOCKET,NODE"], capture_output=True, text=True, check=True
    ).stdout
    rows = [line.split(",") for line in out.splitlines() if line and not line.startswith("#")]
    topo = discover_cpu_topology(Sysfs(root))
    online = {c.id: c for c in topo.cpus if c.online}
    assert sorted(int(r[0]) for r in rows) == sorted(online)

    def partition(column: int) -> set[frozenset[int]]:
        out: dict[str, set[int]] = {}
        for r in rows:
            out.setdefault(r[column], set()).add(int(r[0]))
        return {frozenset(v) for v in out.values()}

    # lscpu numbers cores and sockets its own way: compare how CPUs are grouped, not the numbers.
    online_groups = {
        key: {g & set(online) for g in groups(topo, key)} - {frozenset()} for key in ("core", "socket")
    }
    assert partition(1) == online_groups["core"]
    assert partition(2) == online_groups["socket"]
    if all(r[3] for r in rows):
        assert {int(r[0]): int(r[3]) for r in rows} == {i: c.numa for i, c in online.items()}


@pytest.mark.kernel
def test_host_matches_proc_cpuinfo() -> None:
    root = host_sysfs_or_skip()
    text = Path("/proc/cpuinfo").read_text()
    blocks = [b for b in text.split("\n\n") if b.strip().startswith("processor")]
    fields = [dict(line.split(":", 1) for line in b.splitlines() if ":" in line) for b in blocks]
    fields = [{k.strip(): v.strip() for k, v in f.items()} for f in fields]
    topo = discover_cpu_topology(Sysfs(root))
    assert len(fields) == sum(c.online for c in topo.cpus)
    socket_of = {c.id: c.socket for c in topo.cpus}
    for f in fields:
        if "physical id" in f:  # x86 only
            assert socket_of[int(f["processor"])] == int(f["physical id"])


@pytest.mark.kernel
def test_host_capture_discovers_the_same(tmp_path: Path) -> None:
    root = host_sysfs_or_skip()
    captured = trees.capture_tree(root)
    live = discover_cpu_topology(Sysfs(root))
    copy = discover_tree(tmp_path, captured)
    # Memory is left out: a balloon driver may change it between the two reads.
    assert copy.cpus == live.cpus
    assert [(n.id, n.cpus, n.distances) for n in copy.numa_nodes] == [
        (n.id, n.cpus, n.distances) for n in live.numa_nodes
    ]
    assert copy.isolated_cpus == live.isolated_cpus


@pytest.mark.kernel
def test_cpu_model_names_the_cpu_and_is_cached() -> None:
    if os.uname().machine not in ("x86_64", "aarch64"):
        pytest.skip("py-cpuinfo reports flags reliably on x86_64 and aarch64 only")
    model = cpu_model()
    assert model.name
    assert model.flags
    assert cpu_model() is model


def test_discovery_never_imports_py_cpuinfo(tmp_path: Path) -> None:
    root = write_tree(tmp_path / "sys", trees.single_socket_ht())
    code = (
        "import sys; from pathlib import Path; from nodeagent.devices.discovery import discover; "
        f"discover(Path({str(root)!r}), proc_root=Path({str(tmp_path)!r}), gpus=False, fpgas=False); "
        "print('cpuinfo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
