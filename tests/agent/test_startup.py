"""Start-up checks everything it can before it touches the kernel, and never destroys what it cannot
explain: one agent per state directory, bad configuration and a busy port stop the start before any
cgroup exists, and slots the database lost are kept until the operator says what to do with them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent.agent.config import apply_overrides, parse_config
from nodeagent.agent.daemon import build_isolation
from nodeagent.cgroups import detect
from nodeagent.devices.discovery import discover
from nodeagent.isolation.backend import KernelIsolation
from tests.daemon import HOST_OFF, DaemonProcess, free_port, nodeagent_argv, wait_until

pytestmark = [pytest.mark.root]

PARENT = f"natest{os.getpid()}s.slice"
WORKER = {"command": ["/bin/sleep", "600"], "restart": "always", "stop_grace_seconds": 1}


def cgroup_parent_exists() -> bool:
    return any(Path(root, PARENT).exists() for root in Path("/sys/fs/cgroup").iterdir() if root.is_dir())


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path, f'[isolation]\ncgroup_parent = "{PARENT}"\n')
    yield d
    d.stop()
    d.stop_keeper()  # the agent keeps its keeper (and workers) across its own stop
    isolation = {"cgroup_parent": PARENT, **HOST_OFF}
    cfg = apply_overrides(parse_config({"isolation": isolation}), state_dir=d.state)
    isolation = build_isolation(cfg, discover(gpus=False, fpgas=False), detect())
    if isinstance(isolation, KernelIsolation):
        isolation.isolator.remove_all()  # kills what the test left in its slots


def allocate_and_wait(
    argv: list[str], request: dict[str, object], *, timeout: int
) -> subprocess.CompletedProcess[str]:
    """``nodeagent slots allocate --request ... --wait`` (argv: the CLI against the daemon)."""
    return subprocess.run(
        [*argv, "allocate", "--request", json.dumps(request), "--wait", "--timeout", str(timeout)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_a_second_agent_on_the_same_state_directory_stops_at_once_naming_the_first(
    daemon: DaemonProcess,
) -> None:
    client = daemon.start()
    body = {"name": "a", "qos": "burstable", "resources": {"cpus": 0.1, "memory": "32Mi"}}
    created = client.post("/v1/slots", json=body)
    assert created.status_code == 201, created.text
    events_before = client.get("/v1/slots/a").json()["updated_at"]
    code, output = daemon.start_and_fail(url=f"http://127.0.0.1:{free_port()}")
    assert code != 0
    assert f"another nodeagent (pid {daemon.pid}) is using the state directory" in output
    assert client.get("/v1/slots/a").json()["updated_at"] == events_before  # nothing reconciled twice
    client.close()


def test_a_bad_controller_token_file_stops_the_start_before_any_cgroup_exists(tmp_path: Path) -> None:
    config = f'[isolation]\ncgroup_parent = "{PARENT}"\n[controller]\nurl = "http://127.0.0.1:9/v1"\n'
    config += f'token_file = "{tmp_path}/missing-token"\n'
    daemon = DaemonProcess(tmp_path / "d", config)
    code, output = daemon.start_and_fail()
    assert code != 0
    assert "token_file" in output
    assert "Traceback" not in output
    assert not cgroup_parent_exists()


def test_a_busy_port_stops_the_start_before_any_cgroup_exists(tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path / "d", f'[isolation]\ncgroup_parent = "{PARENT}"\n')
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code, output = daemon.start_and_fail(url=f"http://127.0.0.1:{taken.getsockname()[1]}")
    assert code != 0
    assert "listen on" in output
    assert "Traceback" not in output
    assert not cgroup_parent_exists()


def test_an_empty_token_file_is_replaced_whole(daemon: DaemonProcess) -> None:
    daemon.state.mkdir(parents=True, exist_ok=True)
    daemon.token_file.write_text("")
    client = daemon.start()
    assert len(daemon.token_file.read_text().strip()) >= 32
    assert client.get("/v1/node").status_code == 200
    client.close()


def test_a_lost_database_keeps_the_running_worker_until_the_operator_chooses(daemon: DaemonProcess) -> None:
    client = daemon.start()
    # A slot before it takes the range's first uid, and is gone: "web" runs as the second.
    early = {
        "name": "early",
        "qos": "burstable",
        "resources": {"cpus": 0.1, "memory": "32Mi"},
        "worker": WORKER,
    }
    assert client.post("/v1/slots", json=early).status_code == 201
    early_uid = wait_until("the early worker", lambda: client.get("/v1/slots/early").json().get("sandbox"))[
        "uid"
    ]
    body = {"name": "web", "qos": "guaranteed", "resources": {"cpus": 1, "memory": "64Mi"}, "worker": WORKER}
    assert client.post("/v1/slots", json=body).status_code == 201
    assert client.delete("/v1/slots/early").status_code == 204
    pid = wait_until("web's worker", lambda: (client.get("/v1/slots/web").json()["worker"] or {}).get("pid"))
    client.close()
    daemon.stop()
    for suffix in ("", "-wal", "-shm"):
        (daemon.state / f"state.db{suffix}").unlink(missing_ok=True)

    code, output = daemon.start_and_fail()
    assert code != 0
    assert "--recover" in output
    assert "--discard-orphans" in output
    assert alive(pid)

    client = daemon.start("--recover")
    slot = client.get("/v1/slots/web").json()
    assert slot["worker"]["pid"] == pid
    assert alive(pid)
    # It keeps the uid its worker runs as: the next slot gets another (one uid per slot).
    running_uid = int(
        next(
            ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("Uid:")
        ).split()[1]
    )
    assert slot["sandbox"]["uid"] == running_uid
    other = {
        "name": "other",
        "qos": "burstable",
        "resources": {"cpus": 0.1, "memory": "32Mi"},
        "worker": WORKER,
    }
    assert client.post("/v1/slots", json=other).status_code == 201
    second = wait_until(
        "the other worker", lambda: client.get("/v1/slots/other").json().get("sandbox") or None
    )
    assert second["uid"] != running_uid
    # Nor the uid "early" left: it rests for its quarantine although the database that said so is gone.
    assert second["uid"] != early_uid
    for name in ("web", "other"):
        assert client.delete(f"/v1/slots/{name}").status_code == 204
    client.close()


def test_a_worker_that_cannot_launch_fails_at_once_and_allocate_wait_says_so(daemon: DaemonProcess) -> None:
    client = daemon.start()
    argv = [*nodeagent_argv(), "slots", "--api", daemon.url, "--token-file", str(daemon.token_file)]
    # A program that is not there is refused when the request comes, before anything is placed.
    missing = {
        "name": "missing",
        "qos": "burstable",
        "resources": {"cpus": 0.1, "memory": "32Mi"},
        "worker": {"command": ["/nonexistent/server"], "restart": "always"},
    }
    done = allocate_and_wait(argv, missing, timeout=20)
    assert done.returncode != 0, done.stdout + done.stderr
    assert "program '/nonexistent/server' not found" in done.stderr
    assert client.get("/v1/slots/missing").status_code == 404
    # One that is there but cannot start (its working directory is missing) fails at its launch.
    request = {
        "name": "broken",
        "qos": "burstable",
        "resources": {"cpus": 0.1, "memory": "32Mi"},
        "worker": {"command": ["/bin/true"], "workdir": "/nonexistent-natest", "restart": "always"},
    }
    done = allocate_and_wait(argv, request, timeout=20)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "did not start" in done.stderr
    assert "launch failed" in done.stderr
    worker = client.get("/v1/slots/broken").json()["worker"]
    assert worker["phase"] == "failed"
    assert "No such file" in worker["message"]
    assert worker["next_restart_in"] is None  # not retried, whatever its policy
    answer = client.get("/v1/slots/broken/logs")
    assert answer.status_code == 200, answer.text
    logs = answer.json()["lines"]
    assert logs[-1].startswith("[agent] worker failed: launch failed")
    client.close()


def test_allocate_wait_fails_for_a_probeless_worker_that_exits_at_once(daemon: DaemonProcess) -> None:
    """Without a readiness probe a worker is "running" once its process runs: --wait still fails
    when it exits within its first second (README: exit 1 if it cannot start)."""
    daemon.start().close()
    argv = [*nodeagent_argv(), "slots", "--api", daemon.url, "--token-file", str(daemon.token_file)]
    request = {
        "name": "quitter",
        "qos": "burstable",
        "resources": {"cpus": 0.1, "memory": "32Mi"},
        "worker": {"command": ["/bin/sh", "-c", "exit 3"], "restart": "always"},
    }
    done = allocate_and_wait(argv, request, timeout=20)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "did not start" in done.stderr


def test_a_worker_that_is_not_ready_says_why_in_show_and_in_wait(
    daemon: DaemonProcess, worker_python: str
) -> None:
    """A server that answers 404 at its readiness path: the last probe result and its likely cause
    reach the slot's view, `slots show` and the --wait failure, which does not advise waiting longer."""
    client = daemon.start()
    argv = [*nodeagent_argv(), "slots", "--api", daemon.url, "--token-file", str(daemon.token_file)]
    port = free_port()
    request = {
        "name": "lost-model",
        "qos": "burstable",
        "resources": {"cpus": 0.2, "memory": "64Mi"},
        "worker": {
            "command": [worker_python, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
            "workdir": "/",
            "readiness": {"http": {"port": port, "path": "/v2/models/typo/ready"}},
        },
    }
    done = allocate_and_wait(argv, request, timeout=4)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "last readiness probe: GET /v2/models/typo/ready: HTTP 404" in done.stderr
    assert "likely: the server answers, but has nothing at /v2/models/typo/ready" in done.stderr
    assert "wait longer" not in done.stderr
    worker = client.get("/v1/slots/lost-model").json()["worker"]
    assert (worker["phase"], worker["ready_when"]) == ("starting", "probe")
    assert worker["last_probe"]["definite"] is True
    shown = subprocess.run(
        [*argv, "show", "lost-model"], capture_output=True, text=True, timeout=30, check=True
    )
    assert "  probe     failed: GET /v2/models/typo/ready: HTTP 404" in shown.stdout
    assert "  likely    the server answers, but has nothing at" in shown.stdout
    assert client.delete("/v1/slots/lost-model").status_code == 204
    client.close()
