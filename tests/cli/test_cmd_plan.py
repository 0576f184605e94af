"""``nodeagent plan`` through click's CliRunner: JSON out on success, one line and exit 1 otherwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from nodeagent.cli import cli
from nodeagent.devices.synthetic import synthetic_topology
from nodeagent.devices.topology import topology_to_dict

REQUEST = {
    "name": "a",
    "qos": "guaranteed",
    "resources": {"cpus": 4, "memory": "2Gi", "numa": "prefer", "gpus": 1},
}


@pytest.fixture
def topology_file(tmp_path: Path) -> Path:
    path = tmp_path / "topology.json"
    path.write_text(json.dumps(topology_to_dict(synthetic_topology(2, 1, 4, 2, gpus_per_numa=1))))
    return path


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, ["plan", *args])
    return result.exit_code, result.stdout, result.stderr


def test_prints_the_assignment_as_json(topology_file: Path) -> None:
    code, out, err = run("--topology", str(topology_file), "--request", json.dumps(REQUEST))
    assert (code, err) == (0, "")
    got = json.loads(out)
    assert got["cpus"] == [1, 2, 9, 10]
    assert (got["exclusive"], got["numa_nodes"], got["gpus"]) == (True, [0], [0])
    assert got["memory_bytes"] == 2 * 2**30
    assert got["memory_bytes_by_node"] == {"0": 2 * 2**30}


def test_allocated_file_and_options_are_honoured(topology_file: Path, tmp_path: Path) -> None:
    allocated = tmp_path / "allocated.json"
    allocated.write_text(json.dumps({"cpus": [1, 9], "gpus": [0], "memory_bytes": {"0": 1024}}))
    code, out, _ = run(
        "--topology", str(topology_file), "--request", json.dumps(REQUEST),
        "--allocated", str(allocated), "--option", "reserved_cpus=", "--option", "whole_cores=true",
    )  # fmt: skip
    assert code == 0
    got = json.loads(out)
    assert (got["gpus"], got["numa_nodes"], got["cpus"]) == ([1], [1], [4, 5, 12, 13])


def test_request_from_a_file(topology_file: Path, tmp_path: Path) -> None:
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"name": "b", "qos": "burstable", "resources": {"cpus": 0.5}}))
    code, out, _ = run("--topology", str(topology_file), "--request", f"@{request}")
    assert code == 0
    assert json.loads(out)["exclusive"] is False


def test_refusal_is_one_line_on_stderr(topology_file: Path) -> None:
    request = {"name": "a", "qos": "guaranteed", "resources": {"cpus": 10, "numa": "single"}}
    code, out, err = run("--topology", str(topology_file), "--request", json.dumps(request))
    assert (code, out) == (1, "")
    assert err == (
        "nodeagent: slot 'a': need 10 exclusive CPUs on one NUMA node; the largest free set is 8, on node 1 "
        "(node 0: 6 CPUs; node 1: 8 CPUs); ask for fewer CPUs, use numa prefer, or release a slot\n"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(
            ("--option", "colour=red"),
            "unknown placement option 'colour'; known options:",
            id="unknown-option",
        ),
        pytest.param(
            ("--option", "whole_cores=perhaps"),
            "whole_cores='perhaps': expected true or false",
            id="bad-bool",
        ),
        pytest.param(("--request", "{not json"), "--request is not valid JSON", id="bad-request-json"),
        pytest.param(
            ("--request", '{"name": "a"}'), "request: qos is missing; use one of", id="invalid-request"
        ),
        pytest.param(
            ("--allocated", "/nonexistent/alloc.json"),
            "allocated file /nonexistent/alloc.json does not exist",
            id="missing-allocated",
        ),
    ],
)
def test_bad_input_is_one_line_exit_1(topology_file: Path, args: tuple[str, ...], message: str) -> None:
    base = {"--topology": str(topology_file), "--request": json.dumps(REQUEST)}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    code, _, err = run(*[x for pair in base.items() for x in pair])
    assert code == 1
    assert message in err
    assert err.count("\n") == 1


def test_missing_topology_file(tmp_path: Path) -> None:
    code, _, err = run("--topology", str(tmp_path / "nope.json"), "--request", json.dumps(REQUEST))
    assert code == 1
    assert f"topology file {tmp_path / 'nope.json'} does not exist" in err


def test_topology_file_that_is_not_json(tmp_path: Path) -> None:
    path = tmp_path / "topology.json"
    path.write_text("schema: v1\n")
    code, _, err = run("--topology", str(path), "--request", json.dumps(REQUEST))
    assert code == 1
    assert f"topology file {path} is not valid JSON: Expecting value at line 1 column 1" in err


def test_topology_file_with_a_bad_field(tmp_path: Path) -> None:
    path = tmp_path / "topology.json"
    path.write_text(json.dumps({"schema": "nodeagent.topology/v0"}))
    code, _, err = run("--topology", str(path), "--request", json.dumps(REQUEST))
    assert code == 1
    assert f"{path}: topology: schema is 'nodeagent.topology/v0'" in err
