"""``nodeagent serve``: run the daemon (see agent/daemon.py)."""

from __future__ import annotations

from pathlib import Path

import click

from nodeagent.agent.config import apply_overrides, load_config
from nodeagent.cli.host_options import host_options


@click.command("serve")
@host_options
@click.option(
    "--listen", metavar="HOST:PORT", default=None, help="Serve the REST API here [default: 127.0.0.1:7070]."
)
@click.option(
    "--recover",
    is_flag=True,
    help="Rebuild slots that run on this host but that the state database lost (docs/recovery.md).",
)
@click.option(
    "--discard-orphans",
    is_flag=True,
    help="Remove slots that run on this host but that the state database lost, killing their processes.",
)
@click.option(
    "--restore-host",
    is_flag=True,
    help="Put back every CPU affinity, interrupt and cgroup host partitioning changed, then exit "
    "(refused while an agent runs; docs/host-partitioning.md).",
)
@click.option(
    "--on-agent-stop",
    type=click.Choice(["keep", "stop"]),
    default=None,
    help="What stopping the agent (systemctl stop, not a restart) does to running workers "
    "[default: [workers] on_agent_stop, keep].",
)
@click.option(
    "--systemd-delegation",
    type=click.Choice(["auto", "off"]),
    default=None,
    help="auto: under systemd, create cgroups only where a unit delegates them (docs/systemd.md); "
    "off: use [isolation] cgroup_parent [default: [systemd] delegation, auto].",
)
def command(
    *,
    config_file: Path | None,
    listen: str | None,
    state_dir: Path | None,
    recover: bool,
    discard_orphans: bool,
    restore_host: bool,
    on_agent_stop: str | None,
    systemd_delegation: str | None,
) -> None:
    """Run the agent: reconcile, supervise workers, serve the REST API, report to the controller."""
    from nodeagent.agent.daemon import serve  # noqa: PLC0415 - keep other commands' start-up light
    from nodeagent.agent.recovery import RecoveryMode  # noqa: PLC0415

    if restore_host:
        from nodeagent.agent.daemon import restore_host as restore  # noqa: PLC0415
        from nodeagent.isolation.partitioning import describe  # noqa: PLC0415

        report = restore(
            apply_overrides(
                load_config(config_file), state_dir=state_dir, systemd_delegation=systemd_delegation
            )
        )
        click.echo(f"host restored: {describe(report)}")
        return
    if recover and discard_orphans:
        raise click.UsageError("--recover and --discard-orphans exclude each other; choose one")
    mode = RecoveryMode.REFUSE
    if recover:
        mode = RecoveryMode.RECOVER
    elif discard_orphans:
        mode = RecoveryMode.DISCARD
    config = apply_overrides(
        load_config(config_file),
        listen=listen,
        state_dir=state_dir,
        on_agent_stop=on_agent_stop,
        systemd_delegation=systemd_delegation,
    )
    serve(config, recovery=mode)
