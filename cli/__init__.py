"""The ``nodeagent`` command line: a thin shell over the agent's REST API and the project's modules.

Each subcommand lives in its own module ``nodeagent.cli.cmd_<name>`` exposing ``command`` (a click
command or group). This module holds only the table of them and imports one when it runs, never all
of them: `nodeagent --version` and `nodeagent slots list` are what operators type and scripts call
in loops, and importing every command (placement, discovery, the daemon's configuration) was most
of their run time (docs/benchmarks.md, CLI). ``nodeagent --help`` lists the commands from the table,
whose short help texts tests/cli checks against the commands themselves.

The project's errors become one line on stderr with exit status 1.
"""

from __future__ import annotations

import gc
import importlib
import sys
from typing import Any, NamedTuple

import click

from nodeagent import __version__
from nodeagent.errors import NodeAgentError


class LazyCommand(NamedTuple):
    module: str  #: the module whose ``command`` attribute is the click command
    help: str  #: the first sentence of the command's help, which is what ``--help`` lists


#: Every subcommand, by name. ``help`` must stay the first sentence of the command's docstring.
COMMANDS: dict[str, LazyCommand] = {
    "capacity": LazyCommand(
        "nodeagent.cli.cmd_capacity",
        "Total, reserved, allocatable, allocated and free per resource, host-wide and per NUMA node.",
    ),
    "doctor": LazyCommand(
        "nodeagent.cli.cmd_doctor",
        "Check host readiness: cgroups, cpusets, device filtering, namespaces, GPUs, FPGAs, resctrl, "
        "PSI, isolcpus, NUMA balancing, swap.",
    ),
    "plan": LazyCommand(
        "nodeagent.cli.cmd_plan",
        "Show the assignment placement would make for a slot request, without touching the host.",
    ),
    "pools": LazyCommand(
        "nodeagent.cli.cmd_pools",
        "Warm standby pools: workers kept started, ready and frozen for allocations in milliseconds.",
    ),
    "serve": LazyCommand(
        "nodeagent.cli.cmd_serve",
        "Run the agent: reconcile, supervise workers, serve the REST API, report to the controller.",
    ),
    "slots": LazyCommand(
        "nodeagent.cli.cmd_slots",
        "Slots on this host: isolated CPUs, memory and devices with an optional worker.",
    ),
    "topology": LazyCommand(
        "nodeagent.cli.cmd_topology",
        "Show the CPUs (by socket, NUMA node and core), NUMA memory, GPUs and FPGAs of this host.",
    ),
    "uninstall": LazyCommand(
        "nodeagent.cli.cmd_uninstall",
        "Remove what a stopped agent left on this host (cgroup parents, firewall table, CDI specs, "
        "keeper) and put the host back.",
    ),
}


class LazyGroup(click.Group):
    """A click group that imports a subcommand's module when the subcommand is looked up.

    The project's errors raised by a subcommand are printed as ``nodeagent: <message>`` (exit 1).
    """

    def __init__(self, *args: Any, lazy_commands: dict[str, LazyCommand], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy_commands = lazy_commands

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *self.lazy_commands})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in self.lazy_commands:
            module = importlib.import_module(self.lazy_commands[cmd_name].module)
            self.add_command(module.command, cmd_name)
        return self.commands.get(cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # click lays the listing out from each command's help; stand-ins carrying the table's help
        # give the same listing without importing a single command.
        stand_ins = click.Group(
            commands=[
                self.commands.get(name) or click.Command(name, help=self.lazy_commands[name].help)
                for name in self.list_commands(ctx)
            ]
        )
        stand_ins.format_commands(ctx, formatter)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except NodeAgentError as err:
            click.echo(f"nodeagent: {err}", err=True)
            sys.exit(1)


@click.group(cls=LazyGroup, lazy_commands=COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="nodeagent")
def cli() -> None:
    """Partition this host's CPUs, NUMA nodes and accelerators into isolated slots for inference
    workers, and report capacity to a controller."""


def main() -> None:
    try:
        cli(prog_name="nodeagent")
    finally:
        # The interpreter's last garbage collection walks every object the imports created (click's
        # alone are tens of thousands): ~10 ms of a short command's life, spent on a process that is
        # about to end. Frozen objects are left out of it; the rest of exit (flushing the output,
        # atexit handlers, closing files) happens as usual.
        gc.freeze()


__all__ = ["COMMANDS", "LazyCommand", "LazyGroup", "cli", "main"]
