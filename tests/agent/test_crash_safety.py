"""Crash safety: SIGKILL ``nodeagent serve``, its host keeper, or both, at random points of
allocate/launch/resize/release; restart what died (the agent restarts a dead keeper itself), and
check the invariants of tests/chaos.py after every round.

Iterations: 50 when CI is set, else NODEAGENT_CRASH_ITERATIONS (default 5); bench/chaos.py runs 500.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent.agent.config import apply_overrides, parse_config
from nodeagent.agent.daemon import build_isolation
from nodeagent.cgroups import detect
from nodeagent.devices.discovery import discover
from nodeagent.isolation.backend import KernelIsolation
from tests.chaos import Names, run
from tests.daemon import DaemonProcess

pytestmark = [pytest.mark.root, pytest.mark.slow]

ITERATIONS = 50 if os.environ.get("CI") else int(os.environ.get("NODEAGENT_CRASH_ITERATIONS", "5"))
NAMES = Names(
    parent=f"natest{os.getpid()}c.slice",
    netns_prefix=f"nt{os.getpid()}-",
    firewall_table=f"natest{os.getpid()}c",
)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path, NAMES.config_toml())
    yield d
    d.stop()
    d.stop_keeper()
    cfg = apply_overrides(parse_config(NAMES.config()), state_dir=d.state)
    kernel = build_isolation(cfg, discover(gpus=False, fpgas=False), detect())
    if isinstance(kernel, KernelIsolation):
        kernel.isolator.remove_all()


def test_sigkill_of_agent_keeper_or_both_at_random_points_never_double_books(daemon: DaemonProcess) -> None:
    tally = run(daemon, NAMES, ITERATIONS, os.environ.get("NODEAGENT_CRASH_SEED", "7"))
    print(
        f"{tally.rounds} rounds, {tally.operations} operations in {tally.seconds:.1f} s: SIGKILLed the "
        f"agent {tally.killed['agent']}, the keeper {tally.killed['keeper']} times"
    )
