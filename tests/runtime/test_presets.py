"""Presets as plain data: each server's command, ports, environment, files and probes; the program
looked up on the worker's PATH (which the spec may extend) and refused at once when missing; what
a spec adds (args, env, files) on top of its preset; {threads} and {files} filled in at launch."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from nodeagent.errors import InvalidRequest
from nodeagent.runtime.env import DEFAULT_PATH, SlotDescription
from nodeagent.runtime.launch import SlotBinding, build_launch_request
from nodeagent.runtime.presets import find_program, only_argv_resolved, resolve
from nodeagent.schema.worker import WorkerSpec, parse_worker_spec

PORTS = {"http": 21000, "grpc": 21001, "metrics": 21002, "management": 21003, "grpc_management": 21004}


def spec_of(**raw: Any) -> WorkerSpec:
    return parse_worker_spec(raw)


def ports_for(spec: WorkerSpec) -> dict[str, int]:
    from nodeagent.runtime.presets import wanted_ports

    return {name: PORTS[name] for name in wanted_ports(spec)}


def bound(**raw: Any) -> WorkerSpec:
    spec = spec_of(**raw)
    return resolve(spec, ports_for(spec))


def never_found(name: str, path: str) -> str | None:
    return None


def test_a_spec_whose_argv_alone_is_resolved_can_stand_for_the_resolved_one() -> None:
    def at_bin(name: str, path: str) -> str:
        return f"/usr/bin/{name}"

    plain = spec_of(command=["sleep", "infinity"], args=["x"], restart="never")
    run = resolve(plain, {}, find=at_bin)
    assert run.command == ("/usr/bin/sleep", "infinity", "x")
    assert only_argv_resolved(plain, run)
    # Anything else resolve fills in (a port's number, PATH, a preset's probes) is the resolved
    # spec's own: a supervisor needs that one.
    with_port = spec_of(command=["srv", "--port={port:http}"], ports={"http": {}})
    assert not only_argv_resolved(with_port, resolve(with_port, {"http": 21000}, find=at_bin))
    with_path = spec_of(command=["srv"], path=["/opt/srv/bin"])
    assert not only_argv_resolved(with_path, resolve(with_path, {}, find=at_bin))
    preset = spec_of(preset="triton", model_repository="/models")
    assert not only_argv_resolved(preset, resolve(preset, ports_for(preset)))


def test_triton_runs_on_its_ports_sized_to_the_slot_with_its_backends(tmp_path: Path) -> None:
    prefix = tmp_path / "tritonserver"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "backends").mkdir()
    program = prefix / "bin" / "tritonserver"
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    bin_dir = str(prefix / "bin")
    (tmp_path / "models").mkdir()
    spec = spec_of(
        preset="triton", model_repository=str(tmp_path / "models"), model_name="resnet", path=[bin_dir]
    )
    run = resolve(spec, ports_for(spec), find=find_program)
    assert run.command is not None
    assert run.command[0] == str(program)
    assert f"--backend-directory={prefix / 'backends'}" in run.command
    flags = ("--http-port=21000", "--grpc-port=21001", "--metrics-port=21002")
    assert "--http-thread-count={threads}" in run.command
    assert "--backend-config=python,thread-pool-size={threads}" in run.command
    for flag in flags:
        assert flag in run.command
    assert run.env["PATH"] == f"{prefix / 'bin'}:{DEFAULT_PATH}"
    assert run.readiness is not None
    assert (run.readiness.port, run.readiness.path) == (21000, "/v2/models/resnet/ready")


def test_a_missing_program_is_refused_at_once_naming_the_path() -> None:
    spec = spec_of(preset="triton", model_repository="/models", path=["/opt/triton/bin"])
    with pytest.raises(InvalidRequest) as err:
        resolve(spec, ports_for(spec), find=never_found)
    text = str(err.value)
    assert "program 'tritonserver' not found on the worker's PATH (/opt/triton/bin:" in text
    assert 'put its directory in "path"' in text
    with pytest.raises(InvalidRequest, match="program '/no/such/server' not found;"):
        resolve(spec_of(command=["/no/such/server"]), {}, find=find_program)


def test_an_env_path_replaces_the_default_path() -> None:
    seen: list[str] = []

    def find(name: str, path: str) -> str | None:
        seen.append(path)
        return "/x/" + name

    resolve(spec_of(command=["srv"], env={"PATH": "/only/here"}), {}, find=find)
    assert seen == ["/only/here"]


def test_torchserve_gets_a_config_file_with_its_ports_and_probes_the_models_status() -> None:
    run = bound(preset="torchserve", model_repository="/store", model_name="bert")
    assert run.command is not None
    assert "--ncs" in run.command
    assert "--ts-config={files}/config.properties" in run.command
    assert "--models=bert=bert.mar" in run.command
    properties = run.files["config.properties"]
    assert "inference_address=http://127.0.0.1:21000" in properties
    assert "management_address=http://127.0.0.1:21003" in properties
    assert "metrics_address=http://127.0.0.1:21002" in properties
    # Its gRPC servers on the slot's ports too (not 7070/7071, which a second TorchServe also takes).
    assert "grpc_inference_port=21001" in properties
    assert "grpc_management_port=21004" in properties
    assert "number_of_netty_threads={threads}" in properties  # filled in at launch
    ready = run.readiness
    assert ready is not None
    assert ready.http is not None
    assert (ready.http.port, ready.http.path) == (21003, "/models/bert")
    assert ready.http.body is not None
    assert (ready.http.body.json_field, ready.http.body.equals) == ("0.workers.0.status", "READY")
    # /ping is on the inference port: the management port answers it 404.
    live = run.liveness
    assert live is not None
    assert live.http is not None
    assert (live.http.port, live.http.path) == (21000, "/ping")


def test_tfserving_sizes_its_thread_pools_and_waits_for_an_available_version() -> None:
    run = bound(preset="tfserving", model_repository="/m", model_name="wd")
    assert run.command is not None
    assert "--tensorflow_intra_op_parallelism={threads}" in run.command
    assert "--tensorflow_inter_op_parallelism={threads}" in run.command
    assert "--port=21001" in run.command
    assert "--rest_api_port=21000" in run.command
    assert run.readiness is not None
    assert run.readiness.http is not None
    assert run.readiness.http.body is not None
    assert run.readiness.http.body.equals == "AVAILABLE"


def test_mlserver_takes_its_ports_from_the_environment_and_the_spec_adds_to_it() -> None:
    run = bound(
        preset="mlserver",
        model_repository="/models",
        model_name="doubler",
        env={"MLSERVER_PARALLEL_WORKERS": "2", "EXTRA": "1"},
        args=["--debug"],
    )
    assert run.command == ("mlserver", "start", "/models", "--debug")
    assert run.env["MLSERVER_HTTP_PORT"] == "21000"
    assert run.env["MLSERVER_GRPC_PORT"] == "21001"
    assert run.env["MLSERVER_METRICS_PORT"] == "21002"
    assert run.env["MLSERVER_PARALLEL_WORKERS"] == "2"  # the spec's own value wins
    assert run.env["EXTRA"] == "1"
    assert run.readiness is not None
    assert run.readiness.path == "/v2/models/doubler/ready"


def test_kserve_runs_the_users_model_file_with_the_servers_arguments() -> None:
    run = bound(preset="kserve", command=["/venv/bin/python", "/srv/model.py"], model_name="m", args=["--x"])
    assert run.command == (
        "/venv/bin/python",
        "/srv/model.py",
        "--http_port=21000",
        "--grpc_port=21001",
        "--workers=1",
        "--max_threads={threads}",
        "--model_name=m",
        "--x",
    )
    assert run.readiness is not None
    assert (run.readiness.port, run.readiness.path) == (21000, "/v2/models/m/ready")
    with pytest.raises(InvalidRequest, match="command is missing"):
        bound(preset="kserve", model_name="m")


def test_sagemaker_binds_where_the_contract_says_and_answers_ping() -> None:
    run = bound(preset="sagemaker")
    assert run.command == ("serve",)
    assert run.env["SAGEMAKER_BIND_TO_PORT"] == "21000"
    assert run.readiness is not None
    assert run.liveness is not None
    assert (run.readiness.path, run.liveness.path) == ("/ping", "/ping")


def test_a_spec_file_and_env_win_over_the_presets_by_name() -> None:
    mine = {"config.properties": "x=1"}
    run = bound(preset="torchserve", model_repository="/s", model_name="b", files=mine)
    assert run.files == {"config.properties": "x=1"}


def test_the_launch_fills_in_threads_and_files_and_writes_the_files(tmp_path: Path) -> None:
    spec = spec_of(
        command=["srv", "--threads={threads}", "--conf={files}/a.conf"],
        env={"T": "{threads}"},
        files={"a.conf": "threads={threads}\n"},
    )
    slot = SlotDescription(slot_id="s1", cpus=(2, 3, 6), numa_nodes=(0,), memory_bytes=None)
    req = build_launch_request(spec, slot, SlotBinding(cgroup_procs=()), tmp_path / "w")
    files = Path(os.path.realpath(tmp_path)) / "w" / "view" / "files"
    assert req.argv == ("srv", "--threads=3", f"--conf={files}/a.conf")
    assert req.env["T"] == "3"
    assert req.env["NODEAGENT_FILES_DIR"] == str(files)
    assert (files / "a.conf").read_text() == "threads=3\n"
    assert (files / "a.conf").stat().st_mode & 0o777 == 0o644
    # A new spec for the slot: files it no longer names go.
    build_launch_request(spec_of(command=["srv"]), slot, SlotBinding(cgroup_procs=()), tmp_path / "w")
    assert not (files / "a.conf").exists()


@pytest.mark.parametrize(
    ("raw", "missing"),
    [
        ({"preset": "triton", "model_repository": "{tmp}/nope"}, "the directory {tmp}/nope"),
        ({"preset": "mlserver", "model_repository": "{tmp}/nope"}, "the directory {tmp}/nope"),
        (
            {"preset": "torchserve", "model_repository": "{tmp}", "model_name": "bret"},
            "the file {tmp}/bret.mar",
        ),
        ({"preset": "tfserving", "model_repository": "{tmp}", "model_name": "wd"}, "the directory {tmp}/wd"),
    ],
)
def test_what_a_server_needs_to_find_its_model_is_checked_at_submit(
    tmp_path: Path, raw: dict[str, Any], missing: str
) -> None:
    filled = {k: v.replace("{tmp}", str(tmp_path)) for k, v in raw.items()}
    spec = spec_of(**filled)
    expected = missing.replace("{tmp}", str(tmp_path))
    with pytest.raises(InvalidRequest, match=f"needs {expected}, and there is none"):
        resolve(spec, ports_for(spec), find=lambda name, path: f"/x/{name}")


def test_a_model_store_that_holds_the_archive_passes(tmp_path: Path) -> None:
    (tmp_path / "bert.mar").write_bytes(b"")
    spec = spec_of(preset="torchserve", model_repository=str(tmp_path), model_name="bert")
    assert resolve(spec, ports_for(spec), find=lambda name, path: f"/x/{name}").command is not None
