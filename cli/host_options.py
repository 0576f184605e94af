"""The options of the commands that act on this host's agent itself (``serve``, ``uninstall``):
which configuration file, and which state directory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import click

F = TypeVar("F", bound=Callable[..., object])

_OPTIONS = (
    click.option(
        "--config",
        "config_file",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="TOML configuration file [default: /etc/nodeagent/config.toml if present, else defaults].",
    ),
    click.option(
        "--state-dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="Database, API token and worker directories [default: /var/lib/nodeagent as root].",
    ),
)


def host_options(func: F) -> F:
    """``--config`` and ``--state-dir``, as every host-side command spells them."""
    for option in reversed(_OPTIONS):
        func = option(func)
    return func
