"""``nodeagent slots`` and ``nodeagent capacity`` against a real uvicorn server running the API over
the fake service on a free loopback port."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import uvicorn
from click.testing import CliRunner

from nodeagent.agent.api import create_app
from nodeagent.cli import cli
from nodeagent.cli.client import AgentClient, AgentUnreachable, read_token
from nodeagent.errors import ConfigError, Conflict, NotFound, PlacementError
from tests.agent.fake_service import FakeSlotService

TOKEN = "natest-cli-token"
REQUEST = {"name": "llm-a", "qos": "guaranteed", "resources": {"cpus": 2, "memory": "1Gi"}}


@dataclass
class Agent:
    url: str
    token_file: Path
    service: FakeSlotService


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    service = FakeSlotService()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    # IPPROTO_TCP explicitly: asyncio only sets TCP_NODELAY on sockets that say so, and without it
    # every JSON answer waits ~40 ms for a delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        create_app(service, token=TOKEN), log_level="warning", lifespan="off", ws="none", access_log=False
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert thread.is_alive(), "the test server thread died while starting"
            assert time.monotonic() < deadline, "the test server did not start within 10 s"
            time.sleep(0.01)
        host, port = sock.getsockname()
        yield Agent(f"http://{host}:{port}", token_file, service)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def run(agent: Agent, *args: str, group: str = "slots") -> tuple[int, str, str]:
    argv = [group, "--api", agent.url, "--token-file", str(agent.token_file), *args]
    result = CliRunner().invoke(cli, argv)
    return result.exit_code, result.stdout, result.stderr


def test_allocate_list_show_logs_release(agent: Agent) -> None:
    code, out, err = run(agent, "allocate", "--request", json.dumps(REQUEST))
    assert (code, err) == (0, "")
    assert out.startswith("allocated slot s1 (llm-a)")
    assert "cpus      1,9" in out

    code, out, _ = run(agent, "allocate", "--request", json.dumps(REQUEST))
    assert (code, out.splitlines()[0]) == (0, "already allocated with this request: slot s1 (llm-a)")

    code, out, _ = run(agent, "list")
    header, row = out.splitlines()
    assert header.split() == [
        "ID",
        "NAME",
        "QOS",
        "STATE",
        "CPUS",
        "MEMORY",
        "NUMA",
        "DEVICES",
        "WORKER",
        "AGE",
    ]
    assert row.split()[:7] == ["s1", "llm-a", "guaranteed", "ready", "1,9", "1Gi", "0"]

    code, out, _ = run(agent, "show", "llm-a")
    assert (code, out.splitlines()[0]) == (0, "slot s1 (llm-a): guaranteed, ready")

    code, out, _ = run(agent, "logs", "s1", "--lines", "2")
    assert (code, out) == (0, "llm-a line 3\nllm-a line 4\n")

    code, out, _ = run(agent, "cdi", "llm-a")
    assert code == 0
    assert json.loads(out)["devices"][0]["name"] == "llm-a"  # the API's spec, as JSON

    code, out, _ = run(agent, "release", "s1")
    assert (code, out) == (0, "released s1\n")
    assert agent.service.list_slots() == []
    assert run(agent, "list")[1] == "no slots\n"


def test_json_outputs_are_the_apis_json(agent: Agent) -> None:
    code, out, _ = run(agent, "allocate", "--request", json.dumps(REQUEST), "--json")
    slot = json.loads(out)
    assert (code, slot["id"], slot["assignment"]["cpus"]) == (0, "s1", [1, 9])
    assert json.loads(run(agent, "list", "--json")[1]) == [slot]
    assert json.loads(run(agent, "show", "s1", "--json")[1]) == slot
    capacity = json.loads(run(agent, "--json", group="capacity")[1])
    assert capacity["resources"]["cpus"]["allocated"] == 2


def test_allocate_from_a_file_and_from_flags(agent: Agent, tmp_path: Path) -> None:
    request_file = tmp_path / "request.json"
    request_file.write_text(json.dumps(REQUEST))
    assert run(agent, "allocate", "--request", f"@{request_file}")[0] == 0
    code, out, err = run(
        agent, "allocate", "--name", "web", "--qos", "burstable", "--cpus", "500m", "--memory", "256Mi",
        "--worker-cmd", "python -m http.server 8080", "--json",
    )  # fmt: skip
    assert (code, err) == (0, "")
    request = json.loads(out)["request"]
    assert request["resources"]["cpus"] == 0.5
    assert request["resources"]["memory"] == 256 << 20
    assert request["worker"] == {"command": ["python", "-m", "http.server", "8080"]}


def test_resize(agent: Agent) -> None:
    run(agent, "allocate", "--request", json.dumps(REQUEST))
    code, out, _ = run(agent, "resize", "s1", "--cpus", "4", "--json")
    assert (code, len(json.loads(out)["assignment"]["cpus"])) == (0, 4)
    code, out, _ = run(agent, "resize", "s1", "--resources", '{"memory": "2Gi"}', "--json")
    assert (code, json.loads(out)["assignment"]["memory_bytes"]) == (0, 2 << 30)


def test_capacity_table(agent: Agent) -> None:
    code, out, _ = run(agent, group="capacity")
    lines = out.splitlines()
    assert (code, lines[0]) == (0, "host")
    assert lines[1].split() == ["RESOURCE", "TOTAL", "RESERVED", "ALLOCATABLE", "ALLOCATED", "FREE"]
    assert lines[2].split() == ["cpus", "16", "2", "14", "0", "14"]
    assert "NUMA node 1" in lines
    assert "shared pool" in lines


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["show", "natest-none"], "no slot with id or name 'natest-none'", id="unknown-slot"),
        pytest.param(
            ["allocate", "--request", '{"name": "x", "qos": "guaranteed", "resources": {"cpus": 64}}'],
            "need 64",
            id="does-not-fit",
        ),
        pytest.param(["allocate", "--request", "{nope"], "--request is not valid JSON", id="local-bad-json"),
        pytest.param(["allocate", "--name", "x"], "at least --name and --qos", id="flags-incomplete"),
        pytest.param(["resize", "x"], "nothing to change", id="resize-nothing"),
        pytest.param(["show", "../node"], "'../node' is not a slot id or name", id="dotdot-id"),
    ],
)
def test_errors_are_one_line_with_a_nonzero_exit(agent: Agent, args: list[str], message: str) -> None:
    code, out, err = run(agent, *args)
    assert (code, out) == (1, "")
    assert err.count("\n") == 1
    assert err.startswith("nodeagent: ")
    assert message in err


def test_wrong_token_is_a_one_line_error(agent: Agent) -> None:
    agent.token_file.write_text("natest-wrong")
    code, _, err = run(agent, "list")
    assert code == 1
    assert "does not match" in err
    assert "--token-file" in err


def test_unreachable_agent_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens on it once closed
    token = tmp_path / "token"
    token.write_text(TOKEN)
    url = f"http://127.0.0.1:{port}"
    result = CliRunner().invoke(cli, ["slots", "--api", url, "--token-file", str(token), "list"])
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1
    assert f"cannot reach the agent at {url}" in result.stderr
    assert "is `nodeagent serve` running?" in result.stderr


def test_environment_variables_select_the_agent(agent: Agent) -> None:
    env = {"NODEAGENT_API": agent.url, "NODEAGENT_TOKEN_FILE": str(agent.token_file)}
    result = CliRunner().invoke(cli, ["slots", "list"], env=env)
    assert (result.exit_code, result.stdout) == (0, "no slots\n")


def test_api_options_also_work_after_the_subcommand(agent: Agent) -> None:
    argv = ["slots", "--api", "http://127.0.0.1:9", "list", "--api", agent.url]
    result = CliRunner().invoke(cli, [*argv, "--token-file", str(agent.token_file)])
    assert (result.exit_code, result.stdout) == (0, "no slots\n"), result.stderr


def test_missing_token_file_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="NODEAGENT_TOKEN_FILE"):
        read_token(tmp_path / "natest-missing")


def test_client_maps_error_codes_to_the_projects_errors(agent: Agent) -> None:
    with AgentClient(agent.url, TOKEN) as client:
        slot, created = client.allocate(REQUEST)
        assert (slot["id"], created) == ("s1", True)
        assert client.allocate(REQUEST) == (slot, False)
        with pytest.raises(Conflict, match="different request"):
            client.allocate({**REQUEST, "resources": {"cpus": 4}})
        with pytest.raises(PlacementError):
            client.allocate({"name": "big", "qos": "guaranteed", "resources": {"cpus": 64}})
        with pytest.raises(NotFound):
            client.get_slot("natest-none")
        assert client.start_worker("s1", {"command": ["x"]})["state"] == "running"
        assert client.stop_worker("s1")["state"] == "ready"
        assert client.node()["node_id"] == "node-fake"
        assert client.topology()["schema"] == "nodeagent.topology/v1"
        client.release("s1")
        assert client.list_slots() == []


def test_client_against_nothing_raises_unreachable() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with AgentClient(f"http://127.0.0.1:{port}", TOKEN) as client, pytest.raises(AgentUnreachable):
        client.list_slots()
