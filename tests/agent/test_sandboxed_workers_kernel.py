"""Real workers in default (sandboxed) slots, through the real SlotManager, kernel isolation and
host keeper: an exec probe that can only pass inside its worker's sandbox, and a third-party model
server installed from PyPI (MLServer, CPU only) serving a tiny model built here.

MLServer is installed into a venv of its own for this session (tests.workerpy): in CI a failed
install fails the test rather than skipping it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from nodeagent.agent.config import AgentConfig
from nodeagent.agent.daemon import build_manager
from nodeagent.agent.manager import SlotManager
from nodeagent.devices.discovery import discover
from nodeagent.schema.request import parse_slot_request
from tests.escape.harness import config_for, free_port, tear_down
from tests.workerpy import make_venv, world_python

pytestmark = [pytest.mark.root, pytest.mark.slow]

MLSERVER = "mlserver==1.7.1"
#: A model MLServer loads from Python code: doubles its FP32 input (no weights, no model hub).
MODEL = """
import numpy as np
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class Doubler(MLModel):
    async def load(self) -> bool:
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        data = NumpyCodec.decode_input(payload.inputs[0])
        return InferenceResponse(
            model_name=self.name, outputs=[NumpyCodec.encode_output("doubled", data * 2)]
        )
"""


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[tuple[SlotManager, AgentConfig]]:
    cfg = config_for(tmp_path, "w")
    made = build_manager(cfg, discover(gpus=False, fpgas=False))
    made.start(supervise=False)
    try:
        yield made, cfg
    finally:
        made.close()
        tear_down(cfg)


def wait_for_phase(manager: SlotManager, name: str, phase: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        manager.tick()
        worker = manager.get_slot(name).worker
        assert worker is not None
        if worker.phase == phase:
            return worker.to_json()
        assert worker.phase not in ("failed", "crashloop"), f"{worker}\n{manager.logs(name, 40)}"
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{name} is {worker.phase}, not {phase}: {worker.message}\n{manager.logs(name, 40)}"
            )
        time.sleep(0.1)


def test_an_exec_probe_runs_inside_its_workers_sandbox(manager: tuple[SlotManager, AgentConfig]) -> None:
    """The probe passes only where the worker's private /tmp holds its file and only as the slot's
    uid; run from the agent (the host's /tmp, root) the same command fails."""
    slots, _ = manager
    marker = f"natest{os.getpid()}-ready"
    probe = f"test -f /tmp/{marker} && test $(id -u) -ge 600000 && test $(id -u) -le 665535"
    slot = slots.allocate(
        parse_slot_request(
            {
                "name": "probed",
                "qos": "burstable",
                "resources": {"cpus": 0.2, "memory": "64Mi"},
                "worker": {
                    "command": ["/bin/sh", "-c", f"touch /tmp/{marker}; exec sleep 300"],
                    "readiness": {"exec": {"argv": ["/bin/sh", "-c", probe]}, "period_seconds": 0.2},
                    "stop_grace_seconds": 1,
                },
            }
        )
    ).slot
    assert not Path("/tmp", marker).exists()  # the worker's /tmp is its own
    assert os.system(probe) != 0  # the control: the same check from the agent fails
    worker = wait_for_phase(slots, slot.id, "running", timeout=30)
    assert worker["pid"]
    slots.release(slot.id)


@pytest.fixture(scope="session")
def mlserver() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix=f"natest{os.getpid()}-mlserver-", dir="/var/tmp"))
    base.chmod(0o755)
    try:
        make_venv(base / "venv", [MLSERVER])
        models = base / "models" / "doubler"
        models.mkdir(parents=True)
        (models / "doubler_model.py").write_text(MODEL)
        (models / "model-settings.json").write_text(
            json.dumps({"name": "doubler", "implementation": "doubler_model.Doubler"})
        )
        for path in (base / "models", models, *models.iterdir()):
            path.chmod(0o755 if path.is_dir() else 0o644)
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_mlserver_serves_sandboxed(manager: tuple[SlotManager, AgentConfig], mlserver: Path) -> None:
    slots, _ = manager
    assert world_python()  # the venv's interpreter is one the slot's uid can run
    http, grpc, metrics = free_port(), free_port(), free_port()
    models = mlserver / "models"
    (models / "settings.json").write_text(
        json.dumps({"http_port": http, "grpc_port": grpc, "metrics_port": metrics, "parallel_workers": 0})
    )
    (models / "settings.json").chmod(0o644)
    slot = slots.allocate(
        parse_slot_request(
            {
                "name": "mlserver",
                "qos": "guaranteed",
                "resources": {"cpus": 1, "memory": "1Gi"},
                "worker": {
                    "command": [str(mlserver / "venv" / "bin" / "mlserver"), "start", str(models)],
                    "readiness": {
                        "http": {"port": http, "path": "/v2/models/doubler/ready"},
                        "period_seconds": 0.5,
                    },
                    "startup_timeout_seconds": 240,
                    "stop_grace_seconds": 5,
                },
            }
        )
    ).slot
    worker = wait_for_phase(slots, slot.id, "running", timeout=240)
    status = Path(f"/proc/{worker['pid']}/status").read_text()
    uid = int(status.split("Uid:")[1].split()[0])
    assert 600000 <= uid <= 665535, f"mlserver runs as uid {uid}"
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1.0, 2.5, -4.0]}]}
    answer = httpx.post(f"http://127.0.0.1:{http}/v2/models/doubler/infer", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"][0]["data"] == [2.0, 5.0, -8.0]
    slots.release(slot.id)
