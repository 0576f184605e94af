"""``nodeagent serve``: run the daemon (see agent/daemon.py)."""

from __future__ import annotations

from pathlib import Path

import click

from nodeagent.agent.config import apply_overrides, load_config


@click.command("serve")
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="TOML configuration file [default: /etc/nodeagent/config.toml if present, else defaults].",
)
@click.option(
    "--listen", metavar="HOST:PORT", default=None, help="Serve the REST API here [default: 127.0.0.1:7070]."
)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Database, API token and worker directories [default: /var/lib/nodeagent as root].",
)
def command(config_file: Path | None, listen: str | None, state_dir: Path | None) -> None:
    """Run the agent: reconcile, supervise workers, serve the REST API, report to the controller."""
    from nodeagent.agent.daemon import serve  # noqa: PLC0415 - `serve --help` need not load the daemon

    config = apply_overrides(load_config(config_file), listen=listen, state_dir=state_dir)
    serve(config)
