"""The daemon's start-up loads only what it uses: a module it imports for nothing costs every host
its memory for the daemon's whole life (the RSS target is 80 MB with 500 slots)."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from nodeagent.devices.gpu import nvml_library_loadable

#: Heavy modules that a host whose slots have no network, GPUs' hotplug, or model never needs.
NOT_AT_START = ("pyroute2", "pyudev", "numpy", "cpuinfo", "hypothesis", "jsonschema")

SCRIPT = """
import json, sys
from nodeagent.agent.config import apply_overrides, parse_config
from nodeagent.agent.daemon import build_manager, ensure_state_dir
from pathlib import Path
state = Path(sys.argv[1])
isolation = {"cgroup_parent": sys.argv[2], "host_partitioning": "off"}
config = apply_overrides(parse_config({"isolation": isolation}), state_dir=state)
ensure_state_dir(config.state_dir)
manager = build_manager(config)
manager.start()
loaded = sorted({m.split(".")[0] for m in sys.modules})
manager.close()
manager.isolation.isolator.remove_all()  # type: ignore[attr-defined]
print(json.dumps(loaded))
"""


@pytest.mark.root
def test_start_up_does_not_load_what_it_does_not_use(tmp_path: Path) -> None:
    parent = f"natest{os.getpid()}f.slice"
    try:
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(tmp_path / "state"), parent],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        # remove_all leaves the empty QoS class cgroups (best-effort, burstable) and the parent.
        for hierarchy in list(Path("/sys/fs/cgroup").glob(f"*/{parent}")):
            for directory in [*sorted(hierarchy.rglob("*/"), key=lambda d: -len(d.parts)), hierarchy]:
                with contextlib.suppress(FileNotFoundError):  # cpu and cpuacct: one hierarchy
                    directory.rmdir()
    assert done.returncode == 0, done.stderr
    loaded = set(json.loads(done.stdout.splitlines()[-1]))
    assert not loaded & set(NOT_AT_START), f"start-up loaded {sorted(loaded & set(NOT_AT_START))}"
    if not nvml_library_loadable():  # a host without the NVIDIA driver: pynvml is not needed
        assert "pynvml" not in loaded


def _run_clean(code: str) -> None:
    """Run ``code`` in a fresh interpreter (nothing imported yet), which asserts what it loaded."""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr


def test_an_agent_without_a_controller_does_not_load_httpx() -> None:
    # The reporter's HTTP client (httpx, with httpcore, h11 and, where installed, rich and pygments
    # for its command line) is 3-5 MB of the daemon's RSS: only a configured controller loads it.
    _run_clean(
        "import sys\n"
        "from nodeagent.agent.config import parse_config\n"
        "from nodeagent.agent import api, daemon\n"
        "assert daemon._reporter(parse_config({}), None, None, None) is None\n"
        "loaded = sorted(m for m in ('httpx', 'httpcore', 'nodeagent.agent.reporter') if m in sys.modules)\n"
        "assert not loaded, loaded\n"
    )


def test_an_agent_without_the_plugins_does_not_load_grpc() -> None:
    # grpc and protobuf are ~19 MB of the daemon's RSS: only [kubernetes] device_plugin loads them.
    _run_clean(
        "import sys\n"
        "import nodeagent.agent.daemon, nodeagent.agent.api, nodeagent.cli\n"
        "loaded = sorted(m for m in ('grpc', 'google.protobuf') if m in sys.modules)\n"
        "assert not loaded, loaded\n"
    )


def test_the_api_parses_http_with_httptools() -> None:
    # uvicorn falls back to h11 without a word when httptools is missing; the REST path's cost per
    # request (issue 23: REST within 1.3x of the in-process allocate) counts on the C parser.
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    assert AutoHTTPProtocol.__name__ == "HttpToolsProtocol"


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's M_ARENA_MAX is glibc's")
def test_the_daemons_threads_share_two_malloc_arenas() -> None:
    # In a process of its own: the setting is the whole process's, for its life.
    code = "from nodeagent.agent.daemon import limit_malloc_arenas\nassert limit_malloc_arenas()\n"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr


def test_the_daemon_builds_its_routes_without_pydantic_v1() -> None:
    # FastAPI imports pydantic.v1 (~1.1 MB of the daemon's RSS) to ask of each route's types whether
    # they are v1 models; the daemon has none, and its answers are the same without it.
    _run_clean(
        "import sys\n"
        "from fastapi.testclient import TestClient\n"
        "from nodeagent.agent.daemon import without_pydantic_v1\n"
        "assert without_pydantic_v1()\n"
        "from nodeagent.agent.api import create_app\n"
        "from tests.agent.fake_service import FakeSlotService\n"
        "client = TestClient(create_app(FakeSlotService(), token='t'))\n"
        "body = {'name': 'a', 'qos': 'burstable', 'resources': {'cpus': 0.5}}\n"
        "answer = client.post('/v1/slots', json=body, headers={'Authorization': 'Bearer t'})\n"
        "assert answer.status_code == 201, answer.text\n"
        "assert client.get('/openapi.json').status_code == 200\n"
        "assert sys.modules['pydantic.v1'] is None, 'pydantic.v1 loaded'\n"
    )
    # Where something loaded it before (a test process), it stays.
    _run_clean(
        "import sys, pydantic.v1\n"
        "from nodeagent.agent.daemon import without_pydantic_v1\n"
        "assert not without_pydantic_v1()\n"
        "assert sys.modules['pydantic.v1'] is not None\n"
    )
