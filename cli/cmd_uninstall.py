"""``nodeagent uninstall``: remove what a stopped agent left on this host (agent/uninstall.py)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from nodeagent.agent.config import apply_overrides, load_config
from nodeagent.cli.host_options import host_options


@click.command("uninstall")
@host_options
@click.option(
    "--release-slots",
    is_flag=True,
    help="Kill the workers of slots that still exist and remove them (without it, slots are refused).",
)
@click.option("--purge", is_flag=True, help="Also remove the state directory (database, token, logs).")
@click.option("--json", "as_json", is_flag=True, help="What was removed, as JSON.")
def command(
    *, config_file: Path | None, state_dir: Path | None, release_slots: bool, purge: bool, as_json: bool
) -> None:
    """Remove what a stopped agent left on this host (cgroup parents, firewall table, CDI specs,
    keeper) and put the host back.

    Refused while an agent runs on the state directory (stop it first) and while slots exist,
    unless --release-slots. The package itself is removed the way it was installed.
    """
    from nodeagent.agent.uninstall import uninstall  # noqa: PLC0415 - keep other commands' start-up light

    config = apply_overrides(load_config(config_file), state_dir=state_dir)
    report = uninstall(config, release_slots=release_slots, purge=purge)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
        return
    for line in report.lines():
        click.echo(line)
