"""The ``nodeagent`` command line: a thin shell over the project's modules.

Each subcommand lives in its own module ``nodeagent.agent.cmd_<name>`` exposing ``command`` (a
click command or group); this module only assembles them and turns the project's errors into one
line on stderr with a non-zero exit.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click

from nodeagent import __version__
from nodeagent.errors import NodeAgentError

#: Subcommand modules, in the order `nodeagent --help` lists them.
COMMAND_MODULES = ("serve", "topology", "plan", "doctor", "slots", "capacity")


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except NodeAgentError as err:
            click.echo(f"nodeagent: {err}", err=True)
            sys.exit(1)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="nodeagent")
def cli() -> None:
    """Partition this host's CPUs, NUMA nodes and accelerators into isolated slots for inference
    workers, and report capacity to a controller."""


for _name in COMMAND_MODULES:
    try:
        _module = importlib.import_module(f"nodeagent.agent.cmd_{_name}")
    except ModuleNotFoundError as _err:
        if _err.name != f"nodeagent.agent.cmd_{_name}":
            raise
        continue
    cli.add_command(_module.command)


def main() -> None:
    cli(prog_name="nodeagent")
