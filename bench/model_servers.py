"""Allocate -> model ready: a real model server through the agent, against the same server started
by hand, side by side in one run.

Servers: MLServer and KServe's model server (from PyPI, CPU only, the tests' tiny "doubler" model,
tests/servers) and the repository's example Open Inference Protocol worker (examples/oip_worker.py,
a fast starter that shows the agent's own part best). For each, ``--runs`` rounds, alternating:

  by hand   Popen of the same command with the same ports (as root, no slot, no sandbox), then
            GET /v2/models/<model>/ready every 10 ms until it answers 200
  agent     POST /v1/slots (a burstable slot with the server's preset and the host's CPUs as its
            quota, sandboxed as by default), then GET of the model's ready URL on the slot's
            endpoint every 10 ms (the model answers), then the time the slot turned `running`
            (its `updated_at`, written when the readiness probe passed)

Each round ends the server (SIGTERM to its process group by hand; DELETE /v1/slots through the
agent) before the next. The table gives medians (and the spread) per server; "agent, running" minus
"by hand" is what the agent costs a deployment, target <= 50 ms at the median.

Run as root on a host with writable cgroups; everything lives under a test cgroup parent
("natest<pid>m.slice"), a tmp state directory, /var/tmp/natest<pid>-* venvs and a free loopback
port, and is removed afterwards. The first run installs the servers (about a minute each).

    python bench/model_servers.py [--runs 7] [--servers oip,mlserver,kserve]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `tests` is a package of the repo

from nodeagent.agent.config import apply_overrides, parse_config
from nodeagent.agent.daemon import build_isolation
from nodeagent.cgroups import detect
from nodeagent.devices.discovery import discover
from nodeagent.isolation.backend import KernelIsolation
from nodeagent.runtime.keeper_client import stop_keeper
from tests.daemon import DaemonProcess
from tests.servers.fixtures import build_kserve, build_mlserver, new_base
from tests.workerpy import make_venv

REPO = Path(__file__).resolve().parent.parent
PARENT = f"natest{os.getpid()}m.slice"
POLL_SECONDS = 0.010
STARTUP_TIMEOUT = 240.0
TARGET_MS = 50.0
MODEL = "doubler"


def config_text(first_port: int) -> str:
    return (
        f'[isolation]\ncgroup_parent = "{PARENT}"\nhost_partitioning = "off"\n\n'
        f'[workers]\ntick_seconds = 0.5\nport_range = "{first_port}-{first_port + 99}"\n\n'
        '[log]\nlevel = "warning"\n'
    )


def remove_bench_objects(state_dir: Path) -> None:
    """The keeper of ``state_dir`` and everything under the bench's cgroup parent."""
    stop_keeper(state_dir / "keeper")
    isolation = {"cgroup_parent": PARENT, "host_partitioning": "off"}
    config = apply_overrides(parse_config({"isolation": isolation}), state_dir=state_dir)
    kernel = build_isolation(config, discover(gpus=False, fpgas=False), detect())
    if isinstance(kernel, KernelIsolation):
        kernel.isolator.remove_all()


@dataclass
class Server:
    """How to run one server: by hand (argv and env for the given ports) and through the agent (a
    worker spec with its preset), and the model's ready path."""

    name: str
    by_hand: Callable[[dict[str, int]], tuple[list[str], dict[str, str]]]
    worker: dict[str, Any]
    ports: tuple[str, ...]
    model: str = MODEL

    @property
    def ready_path(self) -> str:
        return f"/v2/models/{self.model}/ready"


def servers(installs: dict[str, Path]) -> dict[str, Server]:
    found: dict[str, Server] = {}
    if "oip" in installs:
        python = str(installs["oip"] / "venv" / "bin" / "python")
        script = str(REPO / "examples" / "oip_worker.py")
        found["oip"] = Server(
            "oip",
            lambda p, python=python, script=script: (
                [python, script, "--port", str(p["http"]), "--model", MODEL],
                {},
            ),
            {
                "preset": "generic",
                "command": [python, script, "--port", "{port:http}", "--model", MODEL],
                "ports": {"http": {}},
                "model_name": MODEL,
            },
            ("http",),
        )
    if "mlserver" in installs:
        base = installs["mlserver"]
        found["mlserver"] = Server(
            "mlserver",
            lambda p, base=base: (
                [str(base / "venv" / "bin" / "mlserver"), "start", str(base / "models")],
                {
                    "MLSERVER_HTTP_PORT": str(p["http"]),
                    "MLSERVER_GRPC_PORT": str(p["grpc"]),
                    "MLSERVER_METRICS_PORT": str(p["metrics"]),
                    "MLSERVER_PARALLEL_WORKERS": "0",
                },
            ),
            {
                "preset": "mlserver",
                "model_repository": str(base / "models"),
                "model_name": MODEL,
                "path": [str(base / "venv" / "bin")],
            },
            ("http", "grpc", "metrics"),
        )
    if "kserve" in installs:
        base = installs["kserve"]
        python, model = str(base / "venv" / "bin" / "python"), str(base / "model.py")
        found["kserve"] = Server(
            "kserve",
            lambda p, python=python, model=model: (
                [python, model, f"--http_port={p['http']}", f"--grpc_port={p['grpc']}", "--workers=1"],
                {},
            ),
            {"preset": "kserve", "command": [python, model], "model_name": MODEL},
            ("http", "grpc"),
        )
    return found


@dataclass
class Times:
    by_hand: list[float] = field(default_factory=list)
    allocated: list[float] = field(default_factory=list)  # the POST answered: slot made, worker launched
    answers: list[float] = field(default_factory=list)  # through the agent: the model answers
    running: list[float] = field(default_factory=list)  # through the agent: the agent says running


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def by_hand_once(server: Server) -> float:
    ports = dict(zip(server.ports, free_ports(len(server.ports)), strict=True))
    argv, extra = server.by_hand(ports)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": "/root", **extra}
    url = f"http://127.0.0.1:{ports['http']}{server.ready_path}"
    began = time.perf_counter()
    process = subprocess.Popen(
        argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        while not ready(url):
            if process.poll() is not None:
                raise SystemExit(f"{server.name} by hand exited ({process.returncode}): {argv}")
            if time.perf_counter() - began > STARTUP_TIMEOUT:
                raise SystemExit(f"{server.name} by hand not ready in {STARTUP_TIMEOUT:g}s")
            time.sleep(POLL_SECONDS)
        return time.perf_counter() - began
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        time.sleep(0.2)  # the helpers it forked


def agent_once(
    client: httpx.Client, server: Server, number: int, cpus: float
) -> tuple[float, float, float]:
    name = f"bench-{server.name}-{number}"
    body = {
        "name": name,
        "qos": "burstable",
        # By hand the server has every CPU of the host; the slot's quota is the same by default.
        "resources": {"cpus": cpus, "memory": "1Gi"},
        "worker": {**server.worker, "startup_timeout_seconds": STARTUP_TIMEOUT, "stop_grace_seconds": 10},
    }
    began, wall = time.perf_counter(), time.time()
    created = client.post("/v1/slots", json=body)
    created.raise_for_status()
    allocated = time.perf_counter() - began
    slot = created.json()
    (http,) = [e for e in slot["endpoints"] if e["name"] == "http"]
    url = f"http://{http['address']}:{http['port']}{server.ready_path}"
    try:
        # The model's URL polled every 10 ms, as by hand; the agent is not asked meanwhile (asking
        # it every 10 ms would load a small host more than the agent itself does).
        while not ready(url):
            if time.perf_counter() - began > STARTUP_TIMEOUT:
                raise SystemExit(f"{server.name} through the agent not ready in {STARTUP_TIMEOUT:g}s")
            time.sleep(POLL_SECONDS)
        answered = time.perf_counter() - began
        while True:
            # The slot turns `running` when its readiness probe passes; its updated_at says when.
            seen = client.get(f"/v1/slots/{slot['id']}").json()
            worker = seen.get("worker") or {}
            if worker.get("phase") in ("failed", "crashloop"):
                raise SystemExit(f"{server.name} through the agent failed: {worker}")
            if seen["state"] == "running":
                return allocated, answered, float(seen["updated_at"]) - wall
            time.sleep(0.05)
    finally:
        client.delete(f"/v1/slots/{slot['id']}")


@contextlib.contextmanager
def installed(kinds: list[str]) -> Iterator[dict[str, Path]]:
    bases: dict[str, Path] = {}
    try:
        for kind in kinds:
            print(f"installing {kind} ...", flush=True)
            base = new_base(kind)
            bases[kind] = base
            if kind == "mlserver":
                build_mlserver(base)
            elif kind == "kserve":
                build_kserve(base)
            else:
                from importlib.metadata import version

                make_venv(base / "venv", [f"numpy=={version('numpy')}"])
        yield bases
    finally:
        for base in bases.values():
            shutil.rmtree(base, ignore_errors=True)


def ms(values: list[float]) -> str:
    if not values:
        return "-"
    median = statistics.median(values) * 1000
    return f"{median:7.0f} ({min(values) * 1000:.0f}-{max(values) * 1000:.0f})"


def table(results: dict[str, Times]) -> str:
    rows = [
        "| server | by hand, polled every 10 ms | agent: POST answered | agent: the model answers "
        "| agent: slot `running` | `running` after the model answers | agent `running` - by hand (medians) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, t in results.items():
        delta = (statistics.median(t.running) - statistics.median(t.by_hand)) * 1000
        verdict = "ok" if delta <= TARGET_MS else f"over the {TARGET_MS:g} ms target"
        lag = [max(0.0, r - a) for r, a in zip(t.running, t.answers, strict=True)]
        rows.append(
            f"| {name} | {ms(t.by_hand)} | {ms(t.allocated)} | {ms(t.answers)} | {ms(t.running)} | {ms(lag)} "
            f"| {delta:+.0f} ms ({verdict}) |"
        )
    return "\n".join(rows) + "\n\nmilliseconds from the start: median (min-max)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="rounds per server (each: by hand, then agent)")
    parser.add_argument(
        "--servers", default="oip,mlserver,kserve", help="comma-separated: oip, mlserver, kserve"
    )
    parser.add_argument(
        "--cpus", type=float, default=float(os.cpu_count() or 1), help="the slot's CPU quota (default: all)"
    )
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the bench creates cgroups")
    kinds = [k for k in args.servers.split(",") if k]
    work = Path(tempfile.mkdtemp(prefix=f"natest{os.getpid()}-bench-"))
    first_port = 30000 + (os.getpid() % 20) * 100
    with installed(kinds) as installs:
        daemon = DaemonProcess(work, config_text(first_port))
        client = daemon.start()
        results: dict[str, Times] = {}
        try:
            for name, server in servers(installs).items():
                times = results.setdefault(name, Times())
                by_hand_once(server)  # warm the page cache: both paths then read the same files
                for number in range(args.runs):
                    times.by_hand.append(by_hand_once(server))
                    allocated, answered, running = agent_once(client, server, number, args.cpus)
                    times.allocated.append(allocated)
                    times.answers.append(answered)
                    times.running.append(running)
                    print(
                        f"{name} {number + 1}/{args.runs}: by hand {times.by_hand[-1] * 1000:.0f} ms, "
                        f"agent: allocated {allocated * 1000:.0f} ms, answers {answered * 1000:.0f} ms, "
                        f"running {running * 1000:.0f} ms",
                        flush=True,
                    )
        finally:
            client.close()
            daemon.stop()
            remove_bench_objects(daemon.state)
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(table(results))


if __name__ == "__main__":
    main()
