"""WorkerSpec validation and presets, environment wiring, the launch request: plain data and tmp files."""

from __future__ import annotations

import json

import pytest

from nodeagent.errors import InvalidRequest
from nodeagent.runtime.env import SlotDescription, worker_environment, write_slot_file
from nodeagent.runtime.launch_request import LaunchRequest
from nodeagent.runtime.presets import EVERY_ADDRESS, LOOPBACK, resolve
from nodeagent.schema.worker import ProbeKind, RestartPolicy, parse_worker_spec


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        pytest.param({}, "command", id="no-command"),
        pytest.param({"command": "python serve.py"}, "command", id="shell-line"),
        pytest.param({"command": []}, "command", id="empty-argv"),
        pytest.param({"command": ["w"], "restart": "sometimes"}, "restart", id="bad-restart"),
        pytest.param({"command": ["w"], "env": {"A=B": "x"}}, "env key", id="bad-env-key"),
        pytest.param({"command": ["w"], "workdir": "relative"}, "workdir", id="relative-workdir"),
        pytest.param(
            {"command": ["w"], "rlimits": {"nofile": [10, 5]}}, "rlimits.nofile", id="soft-over-hard"
        ),
        pytest.param({"command": ["w"], "rlimits": {"bogus": 1}}, "bogus", id="unknown-rlimit"),
        pytest.param(
            {"command": ["w"], "readiness": {"http": {"port": 0}}}, "readiness.http.port", id="bad-port"
        ),
        pytest.param(
            {"command": ["w"], "readiness": {"http": {"port": 1}, "tcp": {"port": 1}}},
            "exactly one",
            id="two-kinds",
        ),
        pytest.param({"command": ["w"], "stop_grace_seconds": -1}, "stop_grace_seconds", id="negative-grace"),
        pytest.param({"command": ["w"], "colour": "blue"}, "unknown", id="unknown-key"),
        pytest.param({"preset": "triton"}, "model_repository", id="triton-without-repo"),
        pytest.param({"preset": "kubeflow"}, "preset", id="unknown-preset"),
        pytest.param(
            {"command": ["w"], "supplementary_groups": [None]}, "supplementary_groups", id="null-group"
        ),
    ],
)
def test_invalid_specs_name_the_field(raw, field):
    with pytest.raises(InvalidRequest, match=field):
        resolve(parse_worker_spec(raw))


def test_full_spec_parses():
    spec = parse_worker_spec(
        {
            "command": ["python", "serve.py"],
            "env": {"A": "1"},
            "user": "nobody",
            "restart": "always",
            "readiness": {"tcp": {"port": 9000}, "period_seconds": 2},
            "liveness": {"exec": {"argv": ["true"]}, "failure_threshold": 5},
            "rlimits": {"nofile": 4096},
            "stop_grace_seconds": 10,
        }
    )
    assert spec.command == ("python", "serve.py")
    assert spec.restart is RestartPolicy.ALWAYS
    assert spec.readiness is not None
    assert (spec.readiness.kind, spec.readiness.port) == (ProbeKind.TCP, 9000)
    assert spec.liveness is not None
    assert spec.liveness.failure_threshold == 5
    assert spec.rlimits == {"nofile": (4096, 4096)}


@pytest.mark.parametrize(
    ("raw", "argv0", "ready_path", "port"),
    [
        pytest.param(
            {"preset": "triton", "model_repository": "/models", "model_name": "resnet"},
            "tritonserver",
            "/v2/models/resnet/ready",
            8000,
            id="triton-model",
        ),
        pytest.param(
            {"preset": "triton", "model_repository": "/models"},
            "tritonserver",
            "/v2/health/ready",
            8000,
            id="triton-server",
        ),
        pytest.param(
            {"preset": "torchserve", "model_repository": "/m", "model_name": "bert"},
            "torchserve",
            "/models/bert",  # the model's own status on the management API, not /ping
            8081,
            id="torchserve",
        ),
        pytest.param(
            {"preset": "tfserving", "model_repository": "/m", "model_name": "wd"},
            "tensorflow_model_server",
            "/v1/models/wd",
            8501,
            id="tfserving",
        ),
        pytest.param(
            {"preset": "generic", "command": ["srv"], "port": 9000},
            "srv",
            "/v2/health/ready",
            9000,
            id="generic-oip",
        ),
    ],
)
def test_presets_fill_command_and_probes(raw, argv0, ready_path, port):
    spec = resolve(parse_worker_spec(raw))
    assert spec.command[0] == argv0
    assert spec.readiness is not None
    assert spec.liveness is not None
    assert (spec.readiness.path, spec.readiness.port) == (ready_path, port)


def test_preset_keeps_what_the_spec_sets():
    spec = resolve(
        parse_worker_spec(
            {
                "preset": "triton",
                "model_repository": "/m",
                "command": ["my-triton"],
                "readiness": {"tcp": {"port": 1}},
            }
        )
    )
    assert spec.command == ("my-triton",)
    assert spec.readiness is not None
    assert spec.readiness.kind is ProbeKind.TCP


@pytest.mark.parametrize("listen_on", [LOOPBACK, EVERY_ADDRESS])
def test_presets_listen_where_the_endpoints_say(listen_on: str) -> None:
    """Loopback for a slot in the host's network namespace (its endpoints say 127.0.0.1), every
    address of the slot's own namespace otherwise."""
    triton = resolve(parse_worker_spec({"preset": "triton", "model_repository": "/m"}), listen_on=listen_on)
    for flag in ("--http-address", "--grpc-address", "--metrics-address"):
        assert f"{flag}={listen_on}" in triton.command
    torchserve = resolve(
        parse_worker_spec({"preset": "torchserve", "model_repository": "/m", "model_name": "bert"}),
        listen_on=listen_on,
    )
    properties = torchserve.files["config.properties"]
    for key in ("inference_address", "management_address", "metrics_address"):
        assert f"{key}=http://{listen_on}:" in properties
    for key in ("grpc_inference_address", "grpc_management_address"):
        assert f"{key}={listen_on}\n" in properties
    mlserver = resolve(
        parse_worker_spec({"preset": "mlserver", "model_repository": "/m"}), listen_on=listen_on
    )
    assert mlserver.env["MLSERVER_HOST"] == listen_on


def test_the_kserve_preset_names_the_model_to_kserves_parser() -> None:
    named = resolve(
        parse_worker_spec({"preset": "kserve", "command": ["python", "model.py"], "model_name": "iris"})
    )
    assert named.command[-1] == "--model_name=iris"
    assert named.readiness is not None
    assert named.readiness.path == "/v2/models/iris/ready"
    unnamed = resolve(parse_worker_spec({"preset": "kserve", "command": ["python", "model.py"]}))
    assert not any(arg.startswith("--model_name") for arg in unnamed.command)


SLOT = SlotDescription(
    slot_id="s1",
    cpus=(2, 3, 6, 7),
    numa_nodes=(0,),
    memory_bytes=1 << 30,
    gpus=("GPU-abc", "MIG-def"),
    fpga_devices=("/dev/xclmgmt1",),
)


def test_environment_is_wired_and_the_spec_wins(tmp_path):
    env = worker_environment(SLOT, tmp_path / "slot.json", {"OMP_NUM_THREADS": "1", "X": "y"})
    assert env["NODEAGENT_SLOT_ID"] == "s1"
    assert env["NODEAGENT_SLOT_FILE"] == str(tmp_path / "slot.json")
    assert env["OMP_NUM_THREADS"] == "1"
    assert env["MKL_NUM_THREADS"] == env["OPENBLAS_NUM_THREADS"] == "4"
    assert env["CUDA_VISIBLE_DEVICES"] == env["NVIDIA_VISIBLE_DEVICES"] == "GPU-abc,MIG-def"
    assert env["NODEAGENT_FPGA_DEVICES"] == "/dev/xclmgmt1"
    assert env["X"] == "y"


@pytest.mark.parametrize(
    ("slot", "threads", "cuda"),
    [
        pytest.param(
            SlotDescription("b", cpus=(0, 1, 2, 3), numa_nodes=(), memory_bytes=None, cpu_quota=1.5),
            "2",
            "",
            id="quota",
        ),
        pytest.param(SlotDescription("c", cpus=(), numa_nodes=(), memory_bytes=None), "1", "", id="no-cpus"),
    ],
)
def test_thread_counts_follow_quota_and_gpus_are_hidden(tmp_path, slot, threads, cuda):
    env = worker_environment(slot, tmp_path / "s.json", {})
    assert (env["OMP_NUM_THREADS"], env["CUDA_VISIBLE_DEVICES"], env["NVIDIA_VISIBLE_DEVICES"]) == (
        threads,
        cuda,
        "void",
    )


def test_slot_file_is_json(tmp_path):
    body = json.loads(write_slot_file(SLOT, tmp_path / "slot.json").read_text())
    assert body["schema"] == "nodeagent.slot/v1"
    assert (body["cpus"], body["gpus"], body["memory_bytes"]) == (
        [2, 3, 6, 7],
        ["GPU-abc", "MIG-def"],
        1 << 30,
    )


def test_launch_request_round_trips_json():
    req = LaunchRequest(
        launch_id="a",
        argv=("w", "x"),
        env={"A": "1"},
        run_dir="/r",
        log_dir="/l",
        cpus=(1,),
        rlimits={"nofile": (1, 2)},
        stop_grace_seconds=2.5,
    )
    assert LaunchRequest.from_json(json.loads(json.dumps(req.to_json()))) == req
