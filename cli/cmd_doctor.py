"""``nodeagent doctor [--json]``: is this host ready to run slots?"""

from __future__ import annotations

import sys

import click

from nodeagent.agent.doctor import exit_code, run_checks, to_json, to_table


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print the checks and the overall status as JSON.")
def command(as_json: bool) -> None:
    """Check host readiness: cgroups, cpusets, device filtering, namespaces, GPUs, FPGAs, resctrl,
    PSI, isolcpus, NUMA balancing, swap. Exits 1 when a required capability is missing."""
    checks = run_checks()
    click.echo(to_json(checks) if as_json else to_table(checks))
    sys.exit(exit_code(checks))
