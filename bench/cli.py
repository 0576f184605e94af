"""How long an operator waits for the ``nodeagent`` command, next to a bare interpreter.

Run as root on a host with writable cgroups:
``python bench/cli.py [--runs 30] [--slots 50] [--other PATH]``.

Starts a real ``nodeagent serve`` (tests/daemon.py's runner: a tmp state directory, a free loopback
port, a test cgroup parent "natest<pid>cli.slice"), allocates ``--slots`` real burstable slots (0.01 CPU,
8Mi, no worker) so that ``slots list`` has a table to print, then times, as processes:

  python -c pass               the interpreter alone (the same one the console script runs on)
  nodeagent --version          the command's own start-up: click, the command table
  nodeagent slots list         start-up + the REST client + one GET /v1/slots + the table
  nodeagent slots list --json  the same, printed as JSON

Every command runs with bytecode caching on, in a cache directory of the bench's own
(``PYTHONPYCACHEPREFIX``, filled by the warm-up runs): an installed nodeagent runs from compiled
.pyc files, while ``PYTHONDONTWRITEBYTECODE`` in a caller's environment would make each run compile
the project's modules from source again. The commands take turns run by run, so drift on a shared
machine spreads over all of them. Prints median and p90 wall time per command, the median as a
multiple of the bare interpreter's, and, from one more run with ``PYTHONPROFILEIMPORTTIME``, how many
modules the command imported and what their imports cost. The slots are released, the daemon
stopped, and its cgroups and the bytecode cache removed at the end.

``--other PATH`` times a second install's ``nodeagent`` script (e.g. one built from an older commit
into its own virtual environment) in the same rounds, against the same agent: before and after,
side by side, under the same load.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `tests` is a package of the repo

from nodeagent.cgroups import detect
from nodeagent.isolation.isolator import SlotIsolator
from nodeagent.isolation.network import SlotNetworkConfig
from nodeagent.isolation.slot_spec import IsolatorConfig
from tests.daemon import DaemonProcess, nodeagent_argv

PARENT = f"natest{os.getpid()}cli.slice"
NETNS_PREFIX = f"nl{os.getpid()}-"
VETH_PREFIX = "ntl"
SLOT_REQUEST = {"qos": "burstable", "resources": {"cpus": 0.01, "memory": "8Mi"}}
TARGET_MS = 80.0


def config_text() -> str:
    return (
        f'[isolation]\ncgroup_parent = "{PARENT}"\nnetns_prefix = "{NETNS_PREFIX}"\n'
        f'veth_prefix = "{VETH_PREFIX}"\n\n[log]\nlevel = "warning"\n'
    )


def remove_bench_cgroups() -> None:
    """The bench's cgroup parent and anything left under it (kills what runs there)."""
    network = SlotNetworkConfig(netns_prefix=NETNS_PREFIX, veth_prefix=VETH_PREFIX)
    SlotIsolator(detect(), IsolatorConfig(cgroup_parent=PARENT, network=network)).remove_all()


@contextlib.contextmanager
def workspace() -> Iterator[Path]:
    work = Path(tempfile.mkdtemp(prefix="natest-bench-cli-"))
    try:
        yield work
    finally:
        remove_bench_cgroups()
        shutil.rmtree(work, ignore_errors=True)


def allocate_slots(client: httpx.Client, count: int) -> list[str]:
    ids = []
    for i in range(count):
        response = client.post("/v1/slots", json={"name": f"cli-bench-{i}", **SLOT_REQUEST})
        response.raise_for_status()
        ids.append(str(response.json()["id"]))
    return ids


def cached_bytecode_env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "PYTHONPYCACHEPREFIX": str(cache)}


def time_run(argv: Sequence[str], env: Mapping[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, check=True)
    return time.perf_counter() - t0


def import_profile(argv: Sequence[str], env: Mapping[str, str]) -> tuple[int, float]:
    """(modules imported, their import time in ms) for one run, from ``PYTHONPROFILEIMPORTTIME``:
    the sum of the cumulative times of the top-level imports, which include every nested one."""
    env = {**env, "PYTHONPROFILEIMPORTTIME": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, check=True)
    modules, total_us = 0, 0
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cumulative, name = line.removeprefix("import time:").split("|")
        modules += 1
        if not name.startswith("  "):  # one space separates the column; nested imports indent more
            total_us += int(cumulative)
    return modules, total_us / 1000


def timed(nodeagent: list[str], api: list[str], label: str = "") -> dict[str, list[str]]:
    """The commands timed for one install of nodeagent, by name."""
    return {
        f"{label}nodeagent --version": [*nodeagent, "--version"],
        f"{label}nodeagent slots list": [*nodeagent, "slots", *api, "list"],
        f"{label}nodeagent slots list --json": [*nodeagent, "slots", *api, "list", "--json"],
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in rows
    )


def measure(
    commands: dict[str, list[str]], env: Mapping[str, str], runs: int, warmup: int = 3
) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in commands}
    for n in range(warmup + runs):
        for name, argv in commands.items():
            took = time_run(argv, env)
            if n >= warmup:
                times[name].append(took)
    return times


def report(commands: dict[str, list[str]], env: Mapping[str, str], times: dict[str, list[float]]) -> str:
    baseline = statistics.median(times["python -c pass"])
    rows = [("command", "median ms", "p90 ms", "x python", "modules", "imports ms", f"< {TARGET_MS:g} ms")]
    for name, argv in commands.items():
        median = statistics.median(times[name])
        modules, imports_ms = import_profile(argv, env)
        verdict = "-" if name == "python -c pass" else ("yes" if median * 1000 < TARGET_MS else "NO")
        rows.append(
            (
                name,
                f"{median * 1000:.1f}",
                f"{percentile(times[name], 0.9) * 1000:.1f}",
                f"{median / baseline:.2f}",
                str(modules),
                f"{imports_ms:.1f}",
                verdict,
            )
        )
    return table(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30, help="timed runs per command")
    parser.add_argument("--slots", type=int, default=50, help="slots the agent holds while timed")
    parser.add_argument("--other", type=Path, help="another install's nodeagent script, timed alongside")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the bench allocates real slots (cgroups)")

    with workspace() as work:
        daemon = DaemonProcess(work, config_text())
        client = daemon.start()
        try:
            ids = allocate_slots(client, args.slots)
            nodeagent = nodeagent_argv()
            api = ["--api", daemon.url, "--token-file", str(daemon.token_file)]
            commands = {"python -c pass": [sys.executable, "-c", "pass"], **timed(nodeagent, api)}
            if args.other:
                commands |= timed([str(args.other)], api, label="other: ")
            listed = subprocess.run(
                commands["nodeagent slots list"], capture_output=True, text=True, check=True
            )
            rows = len(listed.stdout.splitlines()) - 1
            print(
                f"{args.runs} runs per command, interleaved; the agent holds {len(ids)} burstable slots "
                f"(`slots list` prints {rows} rows); load average {os.getloadavg()[0]:.2f}",
                flush=True,
            )
            env = cached_bytecode_env(work / "pycache")
            times = measure(commands, env, args.runs)
            print(report(commands, env, times))
            print("(x python: median relative to `python -c pass`; modules and imports ms: one run under "
                  "PYTHONPROFILEIMPORTTIME, interpreter start-up modules included)")  # fmt: skip
            for slot_id in ids:
                client.delete(f"/v1/slots/{slot_id}").raise_for_status()
        finally:
            client.close()
            daemon.stop()


if __name__ == "__main__":
    main()
