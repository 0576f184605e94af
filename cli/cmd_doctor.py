"""``nodeagent doctor [--json]``: is this host ready to run slots?"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from nodeagent.agent.doctor import Check, agent_checks, exit_code, run_checks, to_json, to_table
from nodeagent.cli.cmd_slots import api_options
from nodeagent.errors import NodeAgentError


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print the checks and the overall status as JSON.")
@api_options
def command(as_json: bool, api: str | None, token_file: Path | None) -> None:
    """Check host readiness: cgroups, cpusets, device filtering, namespaces, GPUs, FPGAs, resctrl,
    PSI, isolcpus, NUMA balancing, swap; and, when an agent answers, what it reports (confinement,
    host partitioning, foreign CPU time). Exits 1 when a required capability is missing."""
    checks = run_checks()
    checks += _from_the_agent(api, token_file)
    click.echo(to_json(checks) if as_json else to_table(checks))
    sys.exit(exit_code(checks))


def _from_the_agent(api: str | None, token_file: Path | None) -> list[Check]:
    """The agent's own account, when one answers (a host without a running agent is no failure)."""
    from nodeagent.cli.client import AgentClient  # noqa: PLC0415 - only when asked of an agent

    try:
        with AgentClient.from_options(api, token_file) as client:
            return agent_checks(client.node(), client.list_slots())
    except NodeAgentError:
        return []
