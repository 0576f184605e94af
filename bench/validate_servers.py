"""Validate every preset's model server through the agent, each installed from PyPI into a fresh
venv and started the way docs/model-servers.md shows: MLServer (a parallel worker, from the
repository's settings.json), KServe (a model.py of the usual shape), PyTriton (a script binding a
Python function with pytriton.triton.Triton, through the generic preset), Triton (the tritonserver
that nvidia-pytriton's wheel bundles), TorchServe, TF Serving (when installable) and the SageMaker
serving contract (a bring-your-own-container `serve`), put through the checks of the CI end-to-end
tests (tests/servers/lifecycle.py):

  ready         a 1-CPU burstable slot turns `running` through the preset's model-level probe
  inference     an inference is answered right (median latency of 20)
  side by side  a second slot of the same server: all its ports agent-assigned, none shared
  re-adopted    after the agent is SIGKILLed: the same worker pid, still answering
  restarted     after its main process is SIGKILLed: nothing of the old tree left, answering
  drained       a graceful stop: `stopping`, answering during the drain, exits on its stop signal
  released      no process, no listening port, no file of the slots' uids left

and reports the threads each server runs in its 1-CPU slot (by program). Prints a table of server x
check (pass / FAIL / not installable / -: not reached) with the ready time and inference latency.

Run by hand as root on a host with writable cgroups (not in CI: the installs are large, TorchServe
needs a JRE):

    python bench/validate_servers.py [--servers mlserver,kserve,...] [--keep-venvs DIR] [--state-dir tmp]

Each server gets its own agent (a test cgroup parent "natest<pid>e.slice" in every hierarchy, a
port range of this pid's) with the agent's default state directory (/var/lib/nodeagent as root,
what `nodeagent serve` uses without a config: the socket paths of workers below it must fit), and is
installed into /var/tmp/natest<pid>-* (world-readable: workers run as the slot's own uid), all
removed at the end, on failure or Ctrl-C too. The default state directory must not exist when the
run starts (it refuses otherwise: an agent's, or one left by one, would be changed) and is removed
after each server. --state-dir tmp gives each agent a tmp state directory instead. --keep-venvs DIR
installs into DIR/<server> instead, keeps it, and reuses it the next time.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `tests` is a package of the repo

from nodeagent.defaults import default_state_dir
from tests.servers.fixtures import new_base
from tests.servers.heavy import BUILDERS, NotInstallable, versions
from tests.servers.lifecycle import STEPS, Lifecycle, remove_daemon, server_daemon

SERVERS = ("mlserver", "kserve", "pytriton", "triton", "torchserve", "tfserving", "sagemaker")
#: The packages whose versions the report names.
SHOWN_VERSIONS = (
    "mlserver", "kserve", "nvidia-pytriton", "torchserve", "torch-model-archiver", "torch", "numpy",
)  # fmt: skip


class StateDirInUse(Exception):
    """The default state directory is there already: another agent's, or left by one."""


def claim_default_state() -> Path:
    """The agent's default state directory, checked to be absent (so that removing it after the run
    leaves the host as found)."""
    state = default_state_dir()
    if state.exists() or state.is_symlink():
        raise StateDirInUse(
            f"{state}, the agent's default state directory, exists: an agent uses it or left it, and "
            "this run would change it. Stop that agent (and `nodeagent uninstall`) and move the "
            "directory away, or run with --state-dir tmp"
        )
    return state


def release_default_state(state: Path) -> None:
    """Remove what the run's agent made of the default state directory (its workers' directories,
    the journal, the token, the keeper's socket)."""
    shutil.rmtree(state, ignore_errors=True)
    if state.exists():
        raise SystemExit(f"could not remove {state}: remove it by hand")


@dataclass
class Result:
    server: str
    checks: dict[str, str] = field(default_factory=dict)  # step -> "pass" / "FAIL" / ...
    seconds: dict[str, float] = field(default_factory=dict)
    measured: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    install_s: float | None = None
    note: str = ""


def record_into(result: Result) -> Any:
    def record(step: str, seconds: float, error: BaseException | None) -> None:
        result.checks[step] = "pass" if error is None else "FAIL"
        result.seconds[step] = seconds
        if error is not None:
            result.note = f"{step}: {type(error).__name__}: {str(error)[:600]}"
        print(f"  {step:<13} {result.checks[step]:<5} {seconds:7.1f} s", flush=True)

    return record


@contextlib.contextmanager
def install_dir(server: str, keep: Path | None) -> Iterator[Path]:
    if keep is not None:
        base = keep / server
        base.mkdir(parents=True, exist_ok=True)
        for path in (keep, base):
            path.chmod(0o755)
        yield base
        return
    base = new_base(server)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def validate(server: str, keep: Path | None, default_state: bool) -> Result:
    result = Result(server)
    print(f"\n{server}: installing ...", flush=True)
    with install_dir(server, keep) as base:
        began = time.monotonic()
        try:
            case = BUILDERS[server](base)
        except NotInstallable as err:
            result.checks = dict.fromkeys(STEPS, "not installable")
            result.note = str(err)
            return result
        except (OSError, subprocess.SubprocessError, pytest.fail.Exception) as err:  # make_venv: pytest.fail
            result.checks = dict.fromkeys(STEPS, "not installable")
            result.note = f"install failed: {type(err).__name__}: {str(err)[-1500:]}"
            return result
        result.install_s = time.monotonic() - began
        result.versions = versions(base)
        state = claim_default_state() if default_state else None
        work = Path(tempfile.mkdtemp(prefix=f"natest-{server}-"))
        daemon = server_daemon(work, state)
        lifecycle = None
        try:
            lifecycle = Lifecycle(daemon, case)
            lifecycle.run(record_into(result))
        except Exception as err:  # noqa: BLE001 - reported, and the next server still runs
            if not result.note:  # not a check's failure (those are recorded): the agent's start, say
                result.note = f"{type(err).__name__}: {err}"
                traceback.print_exc()
        finally:
            if lifecycle is not None:
                result.measured = lifecycle.measured
                result.note += f"\n{lifecycle.failure_logs}" if lifecycle.failure_logs else ""
            if result.note:
                result.note += f"\n    agent log: ...{daemon.log_tail(1500)}"
            try:
                remove_daemon(daemon)
            finally:
                shutil.rmtree(work, ignore_errors=True)
                if state is not None:
                    release_default_state(state)
    return result


def threads(measured: dict[str, Any]) -> str:
    counts: dict[str, int] = measured.get("threads") or {}
    if not counts:
        return "-"
    parts = " + ".join(f"{name} {n}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    return f"{sum(counts.values())} ({parts})" if len(counts) > 1 else str(sum(counts.values()))


def table(results: list[Result]) -> str:
    rows = [
        "| server | " + " | ".join(STEPS) + " | ready | inference (median) | restart | threads, 1-CPU slot |",
        "|---" * (len(STEPS) + 5) + "|",
    ]
    for r in results:
        checks = [r.checks.get(step, "-") for step in STEPS]
        ready, latency, restart = (r.measured.get(k) for k in ("ready_s", "latency_s", "restart_s"))
        rows.append(
            f"| {r.server} | "
            + " | ".join(checks)
            + f" | {f'{ready:.1f} s' if ready else '-'} | {f'{latency * 1000:.1f} ms' if latency else '-'}"
            + f" | {f'{restart:.1f} s' if restart else '-'} | {threads(r.measured)} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated: {', '.join(SERVERS)}")
    parser.add_argument("--keep-venvs", type=Path, default=None, help="install into (and reuse) DIR/<server>")
    parser.add_argument(
        "--state-dir",
        choices=("default", "tmp"),
        default="default",
        help="the agent's default state directory (it must not exist; removed after) or a tmp one",
    )
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the script creates cgroups")
    chosen = [s for s in args.servers.split(",") if s]
    unknown = set(chosen) - set(SERVERS)
    if unknown:
        raise SystemExit(f"unknown servers {sorted(unknown)}; known: {', '.join(SERVERS)}")
    # Ctrl-C and SIGTERM clean up (the finally blocks remove what was made), also when started
    # with SIGINT ignored (a background job of a script).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    keep = args.keep_venvs.resolve() if args.keep_venvs else None
    default_state = args.state_dir == "default"
    if default_state:
        try:
            claim_default_state()
        except StateDirInUse as err:
            raise SystemExit(str(err)) from None
        print(f"state directory: {default_state_dir()} (the agent's default)", flush=True)
    results = []
    for server in chosen:
        results.append(validate(server, keep, default_state))
    print()
    print(table(results))
    for r in results:
        if r.versions:
            shown = {k: v for k, v in r.versions.items() if k.lower() in SHOWN_VERSIONS}
            print(f"\n{r.server}: installed in {r.install_s:.0f} s; {shown}")
        if r.note:
            print(f"\n{r.server}: {r.note}")
        if "last_exit" in r.measured:
            print(f"{r.server}: graceful stop exit {r.measured['last_exit']}")
    if any(c == "FAIL" for r in results for c in r.checks.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
