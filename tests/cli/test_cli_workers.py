"""``nodeagent slots start|stop`` and the worker status ``slots show`` prints.

The commands run through CliRunner against the API served over the fake service (the ``agent``
fixture of test_cli_client); the formatting is tested on plain slot dicts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nodeagent.cli.cmd_slots import format_slot
from tests.cli import test_cli_client as served

agent = served.agent  # the fixture: a real uvicorn server over FakeSlotService
Agent = served.Agent
run = served.run

WORKER = {"command": ["/bin/sleep", "600"], "restart": "never"}
REQUEST_WITH_WORKER = {**served.REQUEST, "worker": WORKER}


def allocate(agent: Agent, request: dict[str, Any]) -> str:
    code, out, err = run(agent, "allocate", "--request", json.dumps(request), "--json")
    assert (code, err) == (0, "")
    return str(json.loads(out)["id"])


def test_start_with_a_spec_then_stop(agent: Agent) -> None:
    slot_id = allocate(agent, served.REQUEST)

    code, out, err = run(agent, "start", slot_id, "--spec", json.dumps(WORKER))
    assert (code, err) == (0, "")
    assert out == "worker of slot s1 (llm-a): running (pid 4242, 2 restarts)\n"
    assert agent.service.calls[-1] == ("start_worker", ("s1", WORKER))

    code, out, err = run(agent, "stop", "llm-a")
    assert (code, err) == (0, "")
    assert out == "worker of slot s1 (llm-a): stopped (2 restarts)\n"
    assert agent.service.calls[-1] == ("stop_worker", "llm-a")


def test_start_without_a_spec_uses_the_requests_worker(agent: Agent) -> None:
    slot_id = allocate(agent, REQUEST_WITH_WORKER)
    code, _, err = run(agent, "start", slot_id)
    assert (code, err) == (0, "")
    assert agent.service.calls[-1] == ("start_worker", ("s1", None))


def test_start_reads_the_spec_from_a_file(agent: Agent, tmp_path: Path) -> None:
    slot_id = allocate(agent, served.REQUEST)
    spec_file = tmp_path / "worker.json"
    spec_file.write_text(json.dumps(WORKER))
    code, out, _ = run(agent, "start", slot_id, "--spec", f"@{spec_file}", "--json")
    assert code == 0
    assert json.loads(out)["worker"]["phase"] == "running"
    assert agent.service.calls[-1] == ("start_worker", ("s1", WORKER))


def test_wait_returns_once_the_phase_is_reached(agent: Agent) -> None:
    slot_id = allocate(agent, served.REQUEST)
    code, out, _ = run(agent, "start", slot_id, "--spec", json.dumps(WORKER), "--wait", "--timeout", "5")
    assert (code, out.split(":")[-1].split()[0]) == (0, "running")
    code, out, _ = run(agent, "stop", slot_id, "--wait", "--timeout", "5")
    assert (code, out.split(":")[-1].split()[0]) == (0, "stopped")


def test_show_prints_the_worker_status(agent: Agent) -> None:
    slot_id = allocate(agent, served.REQUEST)
    assert "  worker    -" in run(agent, "show", slot_id)[1].splitlines()
    run(agent, "start", slot_id, "--spec", json.dumps(WORKER))
    lines = run(agent, "show", slot_id)[1].splitlines()
    assert "  worker    running (pid 4242, 2 restarts)" in lines
    assert "  message   started" in lines


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["start", "s1"], "has no worker in its request", id="no-spec-and-none-in-request"),
        pytest.param(["start", "s1", "--spec", "[1]"], "--spec must be a JSON object", id="spec-not-object"),
        pytest.param(["start", "s1", "--spec", "{oops"], "--spec is not valid JSON", id="spec-bad-json"),
        pytest.param(
            ["start", "s1", "--spec", "@/natest-missing.json"],
            "cannot read the spec file /natest-missing.json",
            id="spec-file-missing",
        ),
        pytest.param(
            ["start", "s1", "--spec", '{"command": "sleep 1"}'], "command: must be a list", id="bad-spec"
        ),
        pytest.param(["stop", "natest-none"], "no slot with id or name 'natest-none'", id="stop-unknown"),
        pytest.param(["start", "../x"], "'../x' is not a slot id or name", id="dotdot-id"),
    ],
)
def test_worker_command_errors_are_one_line(agent: Agent, args: list[str], message: str) -> None:
    allocate(agent, served.REQUEST)
    code, out, err = run(agent, *args)
    assert (code, out) == (1, "")
    assert err.count("\n") == 1
    assert message in err


def test_a_refused_start_is_one_line(agent: Agent) -> None:
    slot_id = allocate(agent, served.REQUEST)
    agent.service.fail_worker_start = "cannot launch /bin/sleep: natest refusal"
    code, _, err = run(agent, "start", slot_id, "--spec", json.dumps(WORKER))
    assert code == 1
    assert err == "nodeagent: cannot launch /bin/sleep: natest refusal\n"


# --------------------------------------------------------------------------- format_slot on plain data

SLOT = {
    "id": "s1",
    "name": "web",
    "qos": "burstable",
    "state": "ready",
    "assignment": {"exclusive": False, "cpu_quota": 0.5, "memory_bytes": 1 << 30, "numa_nodes": [0]},
    "cgroup": "nodeagent.slice/burstable/s1",
}
NOW = 1_700_000_100.0


@pytest.mark.parametrize(
    ("worker", "expected"),
    [
        pytest.param(None, ["  worker    -"], id="no-worker"),
        pytest.param(
            {"phase": "running", "pid": 77, "restarts": 0, "last_exit": None, "message": "pid 77 ready"},
            ["  worker    running (pid 77, 0 restarts)", "  message   pid 77 ready"],
            id="running",
        ),
        pytest.param(
            {
                "phase": "backoff",
                "pid": None,
                "restarts": 1,
                "next_restart_in": 3.6,
                "last_exit": {
                    "code": 3,
                    "signal": None,
                    "finished_at": NOW - 90,
                    "description": "exited with status 3",
                },
                "message": "worker exited with status 3; restart 1 in 4s",
            },
            [
                "  worker    backoff (1 restart, next in 4s)",
                "  last exit exited with status 3, 1m ago",
                "  message   worker exited with status 3; restart 1 in 4s",
            ],
            id="backoff-after-an-exit",
        ),
        pytest.param(
            {"phase": "failed", "restarts": 5, "last_exit": {"code": None, "signal": 9}},
            ["  worker    failed (5 restarts)", "  last exit killed by signal 9"],
            id="exit-without-description",
        ),
    ],
)
def test_format_slot_worker_lines(worker: dict[str, Any] | None, expected: list[str]) -> None:
    lines = format_slot({**SLOT, "worker": worker}, now=NOW).splitlines()
    assert lines[0] == "slot s1 (web): burstable, ready"
    assert lines[6 : 6 + len(expected)] == expected
    assert len(lines) == 6 + len(expected)
