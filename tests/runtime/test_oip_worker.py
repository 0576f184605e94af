"""The example OIP inference server, run as a real process and spoken to over HTTP."""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

np = pytest.importorskip("numpy")

WORKER = Path(__file__).resolve().parents[2] / "examples" / "oip_worker.py"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def request(port: int, method: str, path: str, body: object | None = None) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request(method, path, body=json.dumps(body) if body is not None else None)
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null"), dict(response.getheaders())
    finally:
        conn.close()


@pytest.fixture
def server() -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            str(WORKER),
            "--port",
            str(port),
            "--inputs",
            "4",
            "--hidden",
            "8",
            "--outputs",
            "3",
        ],
        env=env,
        stdout=subprocess.PIPE,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if request(port, "GET", "/v2/health/ready")[0] == 200:
                break
        except OSError:
            time.sleep(0.05)
    yield port, proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    assert proc.stdout is not None
    proc.stdout.close()


def load_model_class():
    spec = importlib.util.spec_from_file_location("oip_worker", WORKER)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MLP


def test_health_and_metadata(server):
    port, _ = server
    assert request(port, "GET", "/v2/health/live")[:2] == (200, {"live": True})
    assert request(port, "GET", "/v2/models/mlp/ready")[0] == 200
    status, meta, _ = request(port, "GET", "/v2/models/mlp")
    assert status == 200
    assert meta["inputs"][0]["shape"] == [-1, 4]
    assert request(port, "GET", "/v2/models/other/ready")[0] == 404


def test_inference_matches_the_seeded_model_and_reports_latency(server):
    port, _ = server
    data = [0.5, -1.0, 2.0, 0.25, 1.0, 1.0, 1.0, 1.0]
    body = {"id": "r1", "inputs": [{"name": "input", "shape": [2, 4], "datatype": "FP32", "data": data}]}
    status, reply, headers = request(port, "POST", "/v2/models/mlp/infer", body)
    assert status == 200
    assert reply["id"] == "r1"
    output = reply["outputs"][0]
    assert output["shape"] == [2, 3]
    expected = load_model_class()([4, 8, 8, 3], seed=0)(np.array(data, dtype=np.float32).reshape(2, 4))
    np.testing.assert_allclose(output["data"], expected.ravel(), rtol=1e-5)
    assert float(headers["X-Inference-Latency-Us"]) > 0
    stats = request(port, "GET", "/v2/models/mlp/stats")[1]["latency"]
    assert stats["count"] == 1
    assert stats["p50_us"] is not None


@pytest.mark.parametrize(
    "tensor",
    [
        pytest.param(
            {"name": "input", "shape": [1, 5], "datatype": "FP32", "data": [0] * 5}, id="wrong-width"
        ),
        pytest.param(
            {"name": "input", "shape": [1, 4], "datatype": "INT8", "data": [0] * 4}, id="wrong-type"
        ),
        pytest.param(
            {"name": "input", "shape": [1, 4], "datatype": "FP32", "data": [0] * 3}, id="short-data"
        ),
    ],
)
def test_bad_inputs_are_400(server, tensor):
    port, _ = server
    assert request(port, "POST", "/v2/models/mlp/infer", {"inputs": [tensor]})[0] == 400


def test_sigterm_stops_it_cleanly(server):
    _, proc = server
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0
