"""The CLI starts light: a command imports its own module and nothing of the daemon.

Operators and scripts run ``nodeagent --version`` and ``nodeagent slots list`` in loops; each one
pays for every module it imports (the target is under 80 ms, bench/cli.py measures it). Timing is
the bench's business; these tests prove the structure that keeps it fast, by listing the modules a
real ``nodeagent`` process has loaded when it exits.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import click
import pytest

import nodeagent.cli
from nodeagent.cli import COMMANDS, LazyGroup, cli
from nodeagent.schema.request import parse_slot_request
from tests.cli import test_cli_client as served

agent = served.agent  # the fixture: a real uvicorn server over FakeSlotService
Agent = served.Agent

#: What only the daemon, placement or discovery need. A prefix covers its submodules.
DAEMON_SIDE = (
    "fastapi",
    "starlette",
    "uvicorn",
    "pydantic",
    "httpx",
    "httpcore",
    "anyio",
    "numpy",
    "pyroute2",
    "psutil",
    "nodeagent.agent",
    "nodeagent.placement",
    "nodeagent.cgroups",
    "nodeagent.isolation",
    "nodeagent.devices",
    "nodeagent.runtime",
)

# Runs the console script's entry point; when the process exits, writes the names of the loaded
# modules and how many objects the interpreter's last garbage collection will skip.
SCRIPT = """
import atexit, gc, json, sys
out, args = sys.argv[1], json.loads(sys.argv[2])
atexit.register(lambda: open(out, "w").write(json.dumps([sorted(sys.modules), gc.get_freeze_count()])))
sys.argv = ["nodeagent", *args]
from nodeagent.cli import main
main()
"""


def run_main(tmp_path: Path, *args: str) -> tuple[set[str], int, subprocess.CompletedProcess[str]]:
    listing = tmp_path / "modules.json"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(listing), json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    modules, frozen = json.loads(listing.read_text())
    return set(modules), frozen, done


def loaded_by(tmp_path: Path, *args: str) -> tuple[set[str], subprocess.CompletedProcess[str]]:
    modules, _, done = run_main(tmp_path, *args)
    return modules, done


def daemon_side(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in DAEMON_SIDE))


def subcommand_modules(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m.startswith("nodeagent.cli.cmd_"))


@pytest.mark.parametrize(
    ("args", "status"),
    [(["--version"], 0), (["--help"], 0), ([], 2)],  # click answers no arguments with the help and 2
    ids=["version", "help", "no-arguments"],
)
def test_the_group_alone_imports_no_subcommand(tmp_path: Path, args: list[str], status: int) -> None:
    modules, done = loaded_by(tmp_path, *args)
    assert done.returncode == status, done.stderr
    assert "nodeagent" in done.stdout + done.stderr  # without arguments, the help goes to stderr
    assert subcommand_modules(modules) == []
    assert daemon_side(modules) == []


@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_slots_list_imports_nothing_of_the_daemon(tmp_path: Path, agent: Agent, as_json: bool) -> None:
    request = {"name": "llm-a", "qos": "guaranteed", "resources": {"cpus": 2}}
    agent.service.allocate(parse_slot_request(request))
    args = ["slots", "--api", agent.url, "--token-file", str(agent.token_file), "list"]
    modules, done = loaded_by(tmp_path, *args, *(["--json"] if as_json else []))
    assert done.returncode == 0, done.stderr
    assert "llm-a" in done.stdout
    assert subcommand_modules(modules) == ["nodeagent.cli.cmd_slots"]
    assert "nodeagent.cli.client" in modules
    assert daemon_side(modules) == []
    assert "nodeagent.schema.request" not in modules  # the request parser: nothing here parses one


def test_the_last_garbage_collection_skips_what_the_command_loaded(tmp_path: Path) -> None:
    _, frozen, done = run_main(tmp_path, "--version")
    assert done.returncode == 0, done.stderr
    assert frozen > 1000  # without the freeze: 0


def test_every_command_module_is_in_the_table() -> None:
    on_disk = {f"nodeagent.cli.{p.stem}" for p in Path(nodeagent.cli.__file__).parent.glob("cmd_*.py")}
    assert {entry.module for entry in COMMANDS.values()} == on_disk


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_the_table_names_each_command_as_it_names_itself(name: str) -> None:
    command = importlib.import_module(COMMANDS[name].module).command
    assert command.name == name


@pytest.mark.parametrize("width", [40, 80, 120])
def test_help_lists_the_commands_as_if_they_were_all_imported(width: int) -> None:
    # A fresh lazy group (the module's `cli` may have loaded commands in other tests) against a plain
    # click group holding the real commands: the listing must not tell them apart.
    lazy = LazyGroup("nodeagent", lazy_commands=COMMANDS, help=cli.help)
    eager = click.Group(
        "nodeagent",
        commands=[importlib.import_module(entry.module).command for entry in COMMANDS.values()],
        help=cli.help,
    )
    shown = [
        group.get_help(click.Context(group, info_name="nodeagent", terminal_width=width))
        for group in (lazy, eager)
    ]
    assert shown[0] == shown[1]
    assert not lazy.commands, "listing the commands imported one"
    assert all(name in shown[0] for name in COMMANDS)
