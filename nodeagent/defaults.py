"""Where the agent listens and keeps its state unless told otherwise.

Both sides need these: the daemon's configuration (``nodeagent.agent.config``) and the operator's
CLI (``nodeagent.cli.client``), which must find the agent without importing the configuration and,
through it, placement, cgroups and the network code. So this module uses the standard library only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

DEFAULT_LISTEN = "127.0.0.1:7070"
#: The URL the CLI calls when neither --api nor NODEAGENT_API says otherwise.
DEFAULT_API = f"http://{DEFAULT_LISTEN}"
ROOT_STATE_DIR = Path("/var/lib/nodeagent")
#: The API token's file name in the state directory (``nodeagent serve`` writes it on first start).
TOKEN_FILE_NAME = "token"  # noqa: S105 - a file name, not a secret


def default_state_dir(env: Mapping[str, str] | None = None, euid: int | None = None) -> Path:
    """/var/lib/nodeagent for root; the user's XDG state directory otherwise."""
    environ = os.environ if env is None else env
    uid = os.geteuid() if euid is None else euid
    if uid == 0:
        return ROOT_STATE_DIR
    xdg = environ.get("XDG_STATE_HOME", "")
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / "nodeagent"
    home = environ.get("HOME") or str(Path.home())
    return Path(home) / ".local" / "state" / "nodeagent"


def default_token_file(env: Mapping[str, str] | None = None, euid: int | None = None) -> Path:
    """The token file of an agent that runs with the default state directory."""
    return default_state_dir(env, euid) / TOKEN_FILE_NAME


__all__ = [
    "DEFAULT_API",
    "DEFAULT_LISTEN",
    "ROOT_STATE_DIR",
    "TOKEN_FILE_NAME",
    "default_state_dir",
    "default_token_file",
]
