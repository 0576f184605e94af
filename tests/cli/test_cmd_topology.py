"""``nodeagent topology`` on fake sysfs trees, through the real CLI group (error handling included)."""

from __future__ import annotations

import json
import socket
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
from click.testing import CliRunner, Result

from nodeagent.cli import cli
from nodeagent.cli.cmd_topology import format_topology
from nodeagent.devices import discovery
from nodeagent.devices.topology import Fpga, Gpu, MigInstance, MigState, Topology, topology_from_dict
from tests.devices import sysfs_trees as trees
from tests.trees import write_tree

GIB = 1024**3
SCHEMA = json.loads(resources.files("nodeagent.schema").joinpath("topology-v1.json").read_text())


def run_topology(tmp_path: Path, tree_name: str, *args: str) -> Result:
    root = write_tree(tmp_path / "sys", trees.NAMED_TREES[tree_name]())
    argv = ["topology", "--sysfs-root", str(root), "--proc-root", str(tmp_path), "--no-gpus", "--no-fpgas"]
    return CliRunner().invoke(cli, [*argv, *args])


@pytest.mark.parametrize(
    ("tree_name", "expected_lines"),
    [
        pytest.param(
            "single_socket_ht",
            [
                "8 CPUs (8 online, 0 isolated), 4 cores, 1 socket, 1 NUMA node, memory 16.0 GiB, 0 GPUs,",
                "socket 0",
                "  NUMA node 0: memory 16.0 GiB, CPUs 0-7, distances 10",
                "       3  0     3 7",
            ],
            id="single-socket",
        ),
        pytest.param(
            "four_numa_nps2",
            [
                "32 CPUs (32 online, 0 isolated), 16 cores, 2 sockets, 4 NUMA nodes, memory 64.0 GiB",
                "socket 1",
                "  NUMA node 2: memory 16.0 GiB, CPUs 8-11,24-27, distances 32 32 10 12",
                "       9  4     9 25",
                "      15  7     15 31",
            ],
            id="four-numa",
        ),
        pytest.param(
            "offline_cpus",
            [
                "8 CPUs (5 online, 0 isolated), 6 cores",
                "       1  0     1",
                "       4  -     5(offline)",
                "       5  -     7(offline)",
            ],
            id="offline",
        ),
        pytest.param(
            "isolcpus",
            [
                "16 CPUs (16 online, 4 isolated)",
                "       2  0     2(isolated) 10(isolated)",
                "       4  1     4 12",
            ],
            id="isolated",
        ),
    ],
)
def test_table(tmp_path: Path, tree_name: str, expected_lines: list[str]) -> None:
    result = run_topology(tmp_path, tree_name)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"host {socket.gethostname()}: ")
    for expected in expected_lines:
        assert any(expected in line for line in lines), f"{expected!r} not in:\n{result.stdout}"


def test_table_orders_sockets_then_nodes_then_cores(tmp_path: Path) -> None:
    lines = run_topology(tmp_path, "four_numa_nps2").stdout.splitlines()
    headings = [line.strip().split(":")[0] for line in lines if line.startswith(("socket", "  NUMA"))]
    assert headings == ["socket 0", "NUMA node 0", "NUMA node 1", "socket 1", "NUMA node 2", "NUMA node 3"]
    core_rows = [
        int(line.split()[0]) for line in lines if line.startswith("    ") and line.split()[0].isdigit()
    ]
    assert core_rows == list(range(16))


@pytest.mark.parametrize("tree_name", sorted(trees.NAMED_TREES))
def test_json_validates_against_the_schema(tmp_path: Path, tree_name: str) -> None:
    result = run_topology(tmp_path, tree_name, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    jsonschema.validate(doc, SCHEMA, cls=jsonschema.Draft202012Validator)
    topo = topology_from_dict(doc)
    assert topo.hostname == socket.gethostname()
    assert [c.id for c in topo.cpus] == sorted(trees_cpu_ids(tree_name))
    assert result.stdout.startswith('{\n  "schema": "nodeagent.topology/v1"'), "indent 2"


def trees_cpu_ids(tree_name: str) -> set[int]:
    tree = trees.NAMED_TREES[tree_name]()
    return {int(rel.split("/")[3][3:]) for rel in tree if rel.startswith("devices/system/cpu/cpu")}


def test_missing_sysfs_root_is_a_one_line_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["topology", "--sysfs-root", str(tmp_path / "nowhere"), "--no-gpus"])
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("nodeagent: no CPUs found under ")


def test_garbage_in_the_tree_is_a_one_line_error(tmp_path: Path) -> None:
    tree = trees.single_socket_ht()
    tree["devices/system/cpu/online"] = "0-zz"
    root = write_tree(tmp_path / "sys", tree)
    result = CliRunner().invoke(cli, ["topology", "--sysfs-root", str(root), "--no-gpus", "--no-fpgas"])
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1
    assert f"{root}/devices/system/cpu/online" in result.stderr


def sample_gpu(index: int, **changes: object) -> Gpu:
    fields: dict[str, object] = {
        "index": index,
        "uuid": f"GPU-{index}",
        "name": "NVIDIA A100",
        "pci_bus_id": f"00000000:{0x17 + index:02x}:00.0",
        "numa": 1,
        "memory_bytes": 80 * GIB,
        "mig": None,
    }
    fields.update(changes)
    return Gpu(**fields)  # type: ignore[arg-type]


def test_gpus_and_fpgas_come_from_their_discovery_modules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(discovery, "discover_gpus", lambda root: (sample_gpu(0),))
    fpga = Fpga("0000:3b:00.0", "0x10ee", "0x5000", "0000:3b:00.0", 0, ("/dev/xclmgmt1",), "xclmgmt", True)
    monkeypatch.setattr(discovery, "discover_fpgas", lambda root, dev: (fpga,))
    root = write_tree(tmp_path / "sys", trees.dual_socket_ht())
    result = CliRunner().invoke(cli, ["topology", "--sysfs-root", str(root), "--proc-root", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "1 GPU, 1 FPGA" in result.stdout
    assert (
        "  GPU 0: NVIDIA A100, pci 00000000:17:00.0, NUMA 1, memory 80.0 GiB, health unknown" in result.stdout
    )
    assert "  0000:3b:00.0: 0x10ee:0x5000, pci 0000:3b:00.0, NUMA 0, driver xclmgmt, healthy" in result.stdout


def test_no_gpus_and_no_fpgas_skip_their_discovery(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def must_not_run(*_: object) -> tuple[()]:
        raise AssertionError("discovery ran although it was switched off")

    monkeypatch.setattr(discovery, "discover_gpus", must_not_run)
    monkeypatch.setattr(discovery, "discover_fpgas", must_not_run)
    assert run_topology(tmp_path, "single_socket_ht").exit_code == 0


def test_format_shows_mig_instances_and_health(tmp_path: Path) -> None:
    root = write_tree(tmp_path / "sys", trees.single_socket_ht())
    base = discovery.discover(root, proc_root=tmp_path, gpus=False, fpgas=False)
    mig = MigState(True, (MigInstance(3, 0, "2g.20gb", 4, 2, "MIG-abc", 20 * GIB),))
    gpus = (
        sample_gpu(0, mig=mig, healthy=True),
        sample_gpu(1, healthy=False, health_events=("xid 79", "xid 48"), numa=None, name=None),
    )
    text = format_topology(Topology(base.hostname, base.cpus, base.numa_nodes, gpus, (), base.memory_bytes))
    lines = text.splitlines()
    assert "GPUs" in lines
    assert "    MIG enabled" in lines
    assert "      GI 3 CI 0: 2g.20gb, memory 20.0 GiB, uuid MIG-abc" in lines
    assert any(line.startswith("  GPU 0: NVIDIA A100") and "healthy" in line for line in lines)
    assert any(
        line.startswith("  GPU 1: unknown model")
        and "NUMA -," in line
        and "UNHEALTHY (xid 79, xid 48)" in line
        for line in lines
    )
    assert "FPGAs" not in lines
