"""``nodeagent capacity``: what the agent has, has given out and has left, per resource and NUMA node."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from nodeagent.bytesize import format_quantity_short
from nodeagent.cli.cmd_slots import api_options, client_from

_KINDS = ("total", "reserved", "allocatable", "allocated", "free")


@click.command("capacity")
@api_options
@click.option("--json", "as_json", is_flag=True, help="Print the API's JSON instead of tables.")
@click.pass_context
def command(ctx: click.Context, api: str | None, token_file: Path | None, as_json: bool) -> None:
    """Total, reserved, allocatable, allocated and free per resource, host-wide and per NUMA node."""
    ctx.find_root().meta["nodeagent.api"] = (api, token_file)
    capacity = client_from(ctx).capacity()
    click.echo(json.dumps(capacity, indent=2, sort_keys=True) if as_json else format_capacity(capacity))


def format_capacity(capacity: Mapping[str, Any]) -> str:
    lines = ["host", *_table(capacity.get("resources") or {})]
    for node, resources in sorted((capacity.get("by_numa") or {}).items(), key=lambda kv: int(kv[0])):
        lines += ["", f"NUMA node {node}", *_table(resources)]
    pool = capacity.get("shared_pool") or {}
    if pool:
        lines += ["", "shared pool", *(f"  {k:<22} {_number(v)}" for k, v in pool.items())]
    return "\n".join(lines)


def _table(resources: Mapping[str, Mapping[str, Any]]) -> list[str]:
    rows = [("RESOURCE", *(k.upper() for k in _KINDS))]
    for name, figures in resources.items():
        shown = "memory" if name == "memory_bytes" else name
        rows.append((shown, *(_amount(name, figures.get(k)) for k in _KINDS)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  "
        + "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in rows
    ]


def _amount(resource: str, value: Any) -> str:
    if value is None:
        return "-"
    if resource == "memory_bytes":
        return format_quantity_short(int(value))
    return _number(value)


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)
