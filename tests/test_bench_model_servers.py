"""bench/model_servers.py's reading of TorchServe's log: the steps of its start and the agent's probe
requests (told apart from the bench's by their source address)."""

from __future__ import annotations

import sys
from datetime import datetime
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import model_servers  # the bench is a script beside the package

DAY = "2026-12-04T16:36:"


def access(time: str, source: str, code: int) -> str:
    return f'{DAY}{time} [INFO ] loop ACCESS_LOG - /{source}:55562 "GET /models/m HTTP/1.1" {code} 1'


LOG = [
    "WARNING: sun.reflect.Reflection.getCallerClass is not supported. This will impact performance.",
    f"{DAY}51,390 [DEBUG] main org.pytorch.serve.util.ConfigManager - xpu-smi not available",
    "Torchserve version: 0.12.0",
    f"{DAY}51,831 [INFO ] main org.pytorch.serve.ModelServer - Management API bind to: http://127.0.0.1:1",
    access("51,989", "127.0.0.2", 200),
    access("52,000", "127.0.0.1", 404),
    access("52,050", "127.0.0.1", 200),
    access("52,250", "127.0.0.1", 200),
    f"{DAY}53,981 [INFO ] W-9000-doubler_1.0-stdout MODEL_LOG - Listening on port: /tmp/.ts.sock.9000",
    f"{DAY}54,085 [DEBUG] W-9000 WorkerThread - State change WORKER_STARTED -> WORKER_MODEL_LOADED",
    access("54,100", "127.0.0.1", 200),
]


def at(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%f").timestamp()


def test_the_steps_of_torchserves_start_and_the_agents_probes_are_read_from_its_log():
    lines = [(at("2026-12-04T16:36:55.000"), line) for line in LOG]
    steps, codes = model_servers.torchserve_steps(lines)
    assert steps["jvm"] == pytest.approx(at("2026-12-04T16:36:51.390"))
    assert steps["bound"] == pytest.approx(at("2026-12-04T16:36:51.831"))
    assert steps["worker up"] == pytest.approx(at("2026-12-04T16:36:53.981"))
    assert steps["loaded"] == pytest.approx(at("2026-12-04T16:36:54.085"))
    # Only 127.0.0.1's requests before the model loaded: the bench's (127.0.0.2) and later ones not.
    assert steps["probes"] == 3
    assert steps["probe gap"] == pytest.approx(0.2)
    assert codes == "404 200"
    assert steps["stdout lag"] == pytest.approx(55.0 - 51.390)


def test_a_line_without_a_log4j_time_has_none():
    assert model_servers.log4j_time("Torchserve version: 0.12.0") is None
    assert model_servers.relative({"jvm": 12.5, "probes": 3.0}, 10.0) == {"jvm": 2.5, "probes": 3.0}
