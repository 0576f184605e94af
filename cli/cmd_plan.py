"""``nodeagent plan``: what would placement give this request on that topology?

Prints the Assignment as JSON (exit 0), or the refusal as one line on stderr (exit 1). Works on a
captured topology file, so it answers "what if" questions about a production host from anywhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from nodeagent.devices.topology import Topology, topology_from_dict
from nodeagent.errors import InvalidRequest, NotFound
from nodeagent.placement import Allocated, PlacementOptions, plan
from nodeagent.schema.request import parse_slot_request


def _read_json(path: Path, what: str) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise NotFound(f"{what} file {path} does not exist; give the path of a JSON file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise InvalidRequest(f"cannot read {what} file {path}: {err}") from err
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise InvalidRequest(
            f"{what} file {path} is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}"
        ) from None


def _load_topology(path: Path) -> Topology:
    obj = _read_json(path, "topology")
    try:
        return topology_from_dict(obj)
    except InvalidRequest as err:
        raise InvalidRequest(f"{path}: {err}") from None


def _load_request(text: str) -> Any:
    if text.startswith("@"):
        return _read_json(Path(text[1:]), "request")
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise InvalidRequest(
            f"--request is not valid JSON: {err.msg} at column {err.colno}; "
            'e.g. {"name": "a", "qos": "guaranteed", "resources": {"cpus": 4}} or @FILE'
        ) from None


@click.command("plan")
@click.option(
    "--topology",
    "topology_path",
    required=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="A nodeagent.topology/v1 JSON file (from `nodeagent topology --json`).",
)
@click.option(
    "--request",
    "request_text",
    required=True,
    help="A SlotRequest as JSON, or @FILE to read it from a file.",
)
@click.option(
    "--allocated",
    "allocated_path",
    type=click.Path(path_type=Path, dir_okay=False),
    help='JSON of what is taken already: {"cpus": [...], "gpus": [...], "memory_bytes": {"0": bytes}}.',
)
@click.option(
    "--option",
    "option_items",
    multiple=True,
    metavar="KEY=VALUE",
    help="A placement option, e.g. whole_cores=false, distribute_across_numa=true, reserved_cpus=0-1.",
)
def command(
    topology_path: Path, request_text: str, allocated_path: Path | None, option_items: tuple[str, ...]
) -> None:
    """Show the assignment placement would make for a slot request, without touching the host."""
    options = PlacementOptions.from_strings(option_items)
    topology = _load_topology(topology_path)
    request = parse_slot_request(_load_request(request_text))
    allocated = Allocated()
    if allocated_path is not None:
        allocated = Allocated.from_dict(_read_json(allocated_path, "allocated"), topology)
    assignment = plan(topology, allocated, request, options)
    click.echo(json.dumps(assignment.to_dict(), indent=2))
