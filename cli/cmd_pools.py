"""``nodeagent pools ...``: create, list, show, resize and delete warm standby pools through the
agent's API (docs/pools.md). A slot is taken from a pool with ``nodeagent slots allocate --name N
--pool POOL``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from nodeagent.bytesize import format_quantity
from nodeagent.cli.cmd_slots import (
    api_options,
    client_from,
    json_object,
    json_option,
    read_argument,
    subcommand_api_options,
)


@click.group("pools")
@api_options
@click.pass_context
def command(ctx: click.Context, api: str | None, token_file: Path | None) -> None:
    """Warm standby pools: workers kept started, ready and frozen for allocations in milliseconds."""
    ctx.find_root().meta["nodeagent.api"] = (api, token_file)


@command.command("create")
@subcommand_api_options
@click.option(
    "--spec",
    "spec_text",
    required=True,
    metavar="JSON|@FILE|-",
    help='The pool as JSON ({"name", "size", "slot": {"qos", "resources", "worker"}}), @FILE or - for stdin.',
)
@json_option
@click.pass_context
def create_command(ctx: click.Context, spec_text: str, as_json: bool) -> None:
    """Create a pool (idempotent: the same spec again shows the existing pool)."""
    spec = json_object(read_argument(spec_text, "spec"), "--spec")
    pool, created = client_from(ctx).create_pool(spec)
    if as_json:
        click.echo(json.dumps(pool, indent=2))
        return
    click.echo(f"{'created' if created else 'already exists with this spec:'} pool {pool['name']}")
    click.echo(format_pool(pool))


@command.command("list")
@subcommand_api_options
@json_option
@click.pass_context
def list_command(ctx: click.Context, as_json: bool) -> None:
    """One line per pool."""
    pools = client_from(ctx).list_pools()
    if as_json:
        click.echo(json.dumps(pools, indent=2))
        return
    rows = [("NAME", "SIZE", "READY", "STARTING", "SHAPE", "MEMORY HELD", "PROBLEM")]
    rows += [
        (
            p["name"],
            str(p["size"]),
            str(p["ready"]),
            str(p["starting"]),
            _shape(p),
            format_quantity(p["memory_bytes"]),
            p.get("problem") or "",
        )
        for p in pools
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    click.echo(
        "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)
    )


@command.command("show")
@subcommand_api_options
@click.argument("name")
@json_option
@click.pass_context
def show_command(ctx: click.Context, name: str, as_json: bool) -> None:
    """A pool with its standbys."""
    pool = client_from(ctx).get_pool(name)
    click.echo(json.dumps(pool, indent=2) if as_json else format_pool(pool))


@command.command("resize")
@subcommand_api_options
@click.argument("name")
@click.argument("size", type=click.IntRange(0, 64))
@json_option
@click.pass_context
def resize_command(ctx: click.Context, name: str, size: int, as_json: bool) -> None:
    """Keep SIZE standbys from now on (a smaller pool drops its extra standbys at once)."""
    pool = client_from(ctx).resize_pool(name, size)
    click.echo(json.dumps(pool, indent=2) if as_json else format_pool(pool))


@command.command("delete")
@subcommand_api_options
@click.argument("name")
@click.pass_context
def delete_command(ctx: click.Context, name: str) -> None:
    """Delete a pool and its standbys (slots already taken from it stay)."""
    client_from(ctx).delete_pool(name)
    click.echo(f"deleted pool {name}")


def _shape(pool: dict[str, Any]) -> str:
    slot = pool["slot"]
    res = slot.get("resources", {})
    parts = [slot["qos"]]
    if res.get("cpus"):
        parts.append(f"{res['cpus']:g} CPU")
    if res.get("memory"):
        parts.append(format_quantity(int(res["memory"])))
    return " ".join(parts)


def format_pool(pool: dict[str, Any]) -> str:
    lines = [
        f"pool {pool['name']}: {_shape(pool)}, size {pool['size']}, priority {pool['priority']}",
        f"  standbys: {pool['ready']} ready (frozen), {pool['starting']} starting; "
        f"{format_quantity(pool['memory_bytes'])} held",
        f"  claims: {pool['claims']} from standbys, {pool['cold_claims']} cold",
    ]
    if pool.get("problem"):
        lines.append(f"  problem: {pool['problem']}")
    for s in pool["standbys"]:
        phase = (s.get("worker") or {}).get("phase", "-")
        lines.append(f"  {s['name']}  {s['id']}  {s['state']}  worker {phase}  NUMA {s['numa_nodes']}")
    return "\n".join(lines)
