"""Chaos: N rounds (default 500) of random allocate/launch/resize/release load on a real
``nodeagent serve``, each ended by a SIGKILL of the agent, of its host keeper, or of both, at a
random moment; after every restart the invariants of tests/chaos.py are checked (no CPU or device
held twice, database and kernel objects agree both ways, every live worker re-adopted, no process
of ours outside a slot, capacity equal to the sum of the slots). A failed invariant stops the run
with the round, the seed and the complaint.

Run as root: ``python bench/chaos.py [--rounds 500] [--seed 7]``. Everything lives under a test
cgroup parent, netns prefix and firewall table of its own, and a tmp state directory; all of it is
removed afterwards. CI runs 50 rounds of the same code (tests/agent/test_crash_safety.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `tests` is a package of the repo

from nodeagent.agent.config import apply_overrides, parse_config
from nodeagent.agent.daemon import build_isolation
from nodeagent.cgroups import detect
from nodeagent.devices.discovery import discover
from nodeagent.isolation.backend import KernelIsolation
from tests.chaos import Names, Tally, run
from tests.daemon import DaemonProcess


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=500)
    parser.add_argument("--seed", default="7")
    args = parser.parse_args()
    names = Names(f"natest{os.getpid()}x.slice", f"nx{os.getpid()}-", f"natest{os.getpid()}x")
    with tempfile.TemporaryDirectory(prefix="nodeagent-chaos-") as work:
        daemon = DaemonProcess(Path(work), names.config_toml())

        def progress(tally: Tally) -> None:
            if tally.rounds % 25 == 0:
                print(
                    f"  round {tally.rounds}: {tally.operations} operations, {tally.checks} checks passed, "
                    f"{tally.seconds:.0f} s",
                    flush=True,
                )

        try:
            tally = run(daemon, names, args.rounds, args.seed, progress)
        finally:
            daemon.stop()
            daemon.stop_keeper()
            config = apply_overrides(parse_config(names.config()), state_dir=daemon.state)
            isolation = build_isolation(config, discover(gpus=False, fpgas=False), detect())
            if isinstance(isolation, KernelIsolation):
                isolation.isolator.remove_all()
    print(
        f"{tally.rounds} rounds (seed {args.seed}), {tally.operations} operations, every invariant held "
        f"after each of {tally.checks} restarts; SIGKILLed the agent {tally.killed['agent']} and the keeper "
        f"{tally.killed['keeper']} times; {tally.seconds:.0f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
