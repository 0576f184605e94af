"""Allocate -> model ready: a real model server through the agent, against the same server started
by hand, side by side in one run.

Servers: MLServer and KServe's model server (from PyPI, CPU only, the tests' tiny "doubler" model,
tests/servers), the repository's example Open Inference Protocol worker (examples/oip_worker.py,
a fast starter that shows the agent's own part best), and TorchServe and Triton (the installs and
models of bench/validate_servers.py, tests/servers/heavy.py). For each, ``--runs`` rounds,
alternating:

  by hand   Popen of the same command with the same ports (as root, no slot, no sandbox), then
            GET of the model's ready URL every 10 ms until it says ready (/v2/models/<model>/ready
            answers 200; TorchServe: its management API's /models/<model> says the worker is
            READY, what the preset's probe asks). TorchServe and Triton run the command, files and
            environment the agent's own preset resolves to (runtime/presets.py), in a fresh working
            directory, with {threads} the slot's
  agent     POST /v1/slots (a burstable slot with the server's preset and the host's CPUs as its
            quota, sandboxed as by default), then GET of the model's ready URL on the slot's
            endpoint every 10 ms (the model answers), then the time the slot turned `running`
            (its `updated_at`, written when the readiness probe passed)

The bench asks from 127.0.0.2, the agent's probe from 127.0.0.1: a server that logs its requests
(TorchServe's ACCESS_LOG) tells them apart. For TorchServe it also reads the server's own log
(by hand: its stdout; through the agent: the slot's logs) for the steps of its start, as seconds
from the start: the process forked (/proc), the JVM's first line, its APIs bound, the Python worker
up (torch imported), the model loaded; and through the agent the probe's requests (count, the
longest gap between two, their status codes).

Each round ends the server (SIGTERM to its process group by hand; DELETE /v1/slots through the
agent) before the next. The table gives medians (and the spread) per server; "agent, running" minus
"by hand" is what the agent costs a deployment, target <= 50 ms at the median.

Run as root on a host with writable cgroups; everything lives under a test cgroup parent
("natest<pid>m.slice"), a tmp state directory, /var/tmp/natest<pid>-* venvs and a free loopback
port, and is removed afterwards. The first run installs the servers (about a minute each).

    python bench/model_servers.py [--runs 7] [--servers oip,mlserver,kserve,torchserve,triton]
        [--keep-venvs DIR] [--memory 1Gi] [--cpus N] [--sandbox default|no-seccomp|off]
        [--hand-probe] [--startup-period S]

--keep-venvs DIR: the servers' installs in DIR/<server> (as bench/validate_servers.py --keep-venvs
leaves them; made there when missing, kept afterwards). TorchServe's install is about 5 GB (torch).
To tell the agent's parts apart: --sandbox (no seccomp filter; no sandbox), --memory (the JVM sizes
its heap and picks its collector by it), --hand-probe (the agent's start-up probe beside the by-hand
server too), --startup-period (the agent's start-up probe at another period).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `tests` is a package of the repo

from nodeagent.agent.config import apply_overrides, parse_config
from nodeagent.agent.daemon import build_isolation
from nodeagent.cgroups import detect
from nodeagent.devices.discovery import discover
from nodeagent.isolation.backend import KernelIsolation
from nodeagent.runtime.env import DEFAULT_PATH, THREAD_COUNT_VARIABLES
from nodeagent.runtime.keeper_client import stop_keeper
from nodeagent.runtime.presets import PRESETS, find_program, resolve, wanted_ports
from nodeagent.runtime.probes import body_matches, run_probe
from nodeagent.schema.worker import BodyMatch, HttpCheck, Probe, WorkerSpec
from tests.daemon import DaemonProcess
from tests.servers.fixtures import build_kserve, build_mlserver, new_base
from tests.servers.heavy import build_torchserve, build_triton
from tests.workerpy import make_venv

REPO = Path(__file__).resolve().parent.parent
PARENT = f"natest{os.getpid()}m.slice"
POLL_SECONDS = 0.010
STARTUP_TIMEOUT = 240.0
TARGET_MS = 50.0
MODEL = "doubler"
#: The bench polls from here, the agent's probe from 127.0.0.1: a server's access log tells them apart.
BENCH_ADDRESS = "127.0.0.2"
KINDS = ("oip", "mlserver", "kserve", "torchserve", "triton")


#: --sandbox: the default sandbox; the same without its seccomp filter; none (to tell its parts'
#: cost apart: the agent's configuration allows each).
SANDBOXES = ("default", "no-seccomp", "off")


def config_text(first_port: int, sandbox: str = "default") -> str:
    text = (
        f'[isolation]\ncgroup_parent = "{PARENT}"\nhost_partitioning = "off"\n\n'
        f'[workers]\ntick_seconds = 0.5\nport_range = "{first_port}-{first_port + 99}"\n\n'
        '[log]\nlevel = "warning"\n'
    )
    if sandbox == "no-seccomp":
        text += "\n[sandbox]\nallow_unconfined_seccomp = true\n"
    elif sandbox == "off":
        text += "\n[sandbox]\nenabled = false\n"
    return text


def remove_bench_objects(state_dir: Path) -> None:
    """The keeper of ``state_dir`` and everything under the bench's cgroup parent."""
    stop_keeper(state_dir / "keeper")
    isolation = {"cgroup_parent": PARENT, "host_partitioning": "off"}
    config = apply_overrides(parse_config({"isolation": isolation}), state_dir=state_dir)
    kernel = build_isolation(config, discover(gpus=False, fpgas=False), detect())
    if isinstance(kernel, KernelIsolation):
        kernel.isolator.remove_all()


@dataclass(frozen=True)
class ReadyCheck:
    """What says the model is ready: a GET of ``path`` on the named port answers 200 (and its body
    matches ``body``), as the preset's readiness probe asks."""

    port: str = "http"
    path: str = f"/v2/models/{MODEL}/ready"
    body: BodyMatch | None = None


#: A server's steps of start-up from its own output (lines with the time each was read): step ->
#: Unix time or seconds, and a note (see torchserve_steps).
LogSteps = Callable[[list[tuple[float, str]]], tuple[dict[str, float], str]]


@dataclass
class Server:
    """How to run one server: by hand (argv and env for the given ports, in the given working
    directory) and through the agent (a worker spec with its preset), and what says it is ready."""

    name: str
    by_hand: Callable[[dict[str, int], Path], tuple[list[str], dict[str, str]]]
    worker: dict[str, Any]
    ports: tuple[str, ...]
    check: ReadyCheck = ReadyCheck()
    steps: LogSteps | None = None


def preset_server(name: str, worker: dict[str, Any], cpus: float, steps: LogSteps | None = None) -> Server:
    """A server whose by-hand command, files and environment are what the agent's preset resolves
    ``worker`` to (runtime/presets.py), {threads} being the slot's (its quota rounded up) and
    {files} a directory in the by-hand working directory."""
    spec = WorkerSpec.model_validate(worker)
    preset = PRESETS[spec.preset or ""]
    threads = str(max(1, math.ceil(cpus)))

    def by_hand(ports: dict[str, int], workdir: Path) -> tuple[list[str], dict[str, str]]:
        resolved = resolve(spec, ports, find=find_program)
        files = workdir / "files"
        files.mkdir()

        def filled(text: str) -> str:
            return text.replace("{threads}", threads).replace("{files}", str(files))

        for file_name, text in resolved.files.items():
            (files / file_name).write_text(filled(text))
        env = {
            "PATH": ":".join((*spec.path, DEFAULT_PATH)),
            **dict.fromkeys(THREAD_COUNT_VARIABLES, threads),  # as the agent sizes them to the slot
            **{key: filled(value) for key, value in resolved.env.items()},
        }
        return [filled(arg) for arg in resolved.command], env

    probe = resolve(spec).readiness
    if probe is None or probe.http is None:
        raise SystemExit(f"{name}: the preset has no HTTP readiness probe")
    check = ReadyCheck(preset.probe_port, probe.http.path, probe.http.body)
    return Server(name, by_hand, worker, tuple(wanted_ports(spec)), check, steps)


LOG4J_TIME = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d),(\d{3}) ")
ACCESS = re.compile(r'ACCESS_LOG - /(\d+\.\d+\.\d+\.\d+):\d+ "GET \S+ HTTP/1\.1" (\d+)')
#: TorchServe's steps: the first line of the JVM, its APIs bound, the Python worker up (it has
#: imported torch and listens), the model loaded.
TORCHSERVE_STEPS = (
    ("jvm", ""),
    ("bound", "Management API bind to"),
    ("worker up", "MODEL_LOG - Listening on port"),
    ("loaded", "-> WORKER_MODEL_LOADED"),
)


def log4j_time(line: str) -> float | None:
    """The Unix time of a log4j line (``2026-12-04T16:36:51,390 [INFO ] ...``, local time)."""
    found = LOG4J_TIME.match(line)
    if found is None:
        return None
    return datetime.strptime(found.group(1), "%Y-%m-%dT%H:%M:%S").timestamp() + int(found.group(2)) / 1000


def torchserve_steps(lines: list[tuple[float, str]]) -> tuple[dict[str, float], str]:
    """Steps of TorchServe's start (Unix times, as its log says them), and what its access log says
    of the agent's probe (requests from 127.0.0.1 before the model was loaded): "probes" (count),
    "probe gap" (seconds, the longest between two) and the note: their status codes in order
    (repeats folded); "stdout lag": the longest a line took from its log4j time to being read (the
    receipt time: through the agent the keeper's; by hand unknown, 0)."""
    found: dict[str, float] = {}
    probes: list[float] = []
    codes: list[str] = []
    lag = 0.0
    for received, line in lines:
        at = log4j_time(line)
        if at is None:
            continue
        lag = max(lag, received - at)
        for step, marker in TORCHSERVE_STEPS:
            if step not in found and marker in line:
                found[step] = at
        access = ACCESS.search(line)
        if access and access.group(1) == "127.0.0.1" and "loaded" not in found:
            probes.append(at)
            if not codes or codes[-1] != access.group(2):
                codes.append(access.group(2))
    if probes:
        found["probes"] = float(len(probes))
        found["probe gap"] = max((b - a for a, b in itertools.pairwise(probes)), default=0.0)
    found["stdout lag"] = lag
    return found, " ".join(codes)


def servers(installs: dict[str, Path], workers: dict[str, dict[str, Any]], cpus: float) -> dict[str, Server]:
    found: dict[str, Server] = {}
    if "oip" in installs:
        python = str(installs["oip"] / "venv" / "bin" / "python")
        script = str(REPO / "examples" / "oip_worker.py")
        found["oip"] = Server(
            "oip",
            lambda p, _, python=python, script=script: (
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
            lambda p, _, base=base: (
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
            lambda p, _, python=python, model=model: (
                [
                    python,
                    model,
                    f"--http_port={p['http']}",
                    f"--grpc_port={p['grpc']}",
                    "--workers=1",
                    f"--model_name={MODEL}",  # what the preset passes; the script's default is another
                ],
                {},
            ),
            {"preset": "kserve", "command": [python, model], "model_name": MODEL},
            ("http", "grpc"),
        )
    if "torchserve" in workers:
        found["torchserve"] = preset_server("torchserve", workers["torchserve"], cpus, torchserve_steps)
    if "triton" in workers:
        found["triton"] = preset_server("triton", workers["triton"], cpus)
    return found


@dataclass
class Times:
    by_hand: list[float] = field(default_factory=list)
    allocated: list[float] = field(default_factory=list)  # the POST answered: slot made, worker launched
    answers: list[float] = field(default_factory=list)  # through the agent: the model answers
    running: list[float] = field(default_factory=list)  # through the agent: the agent says running
    #: Steps of the start (seconds from it) by hand and through the agent, one dict per round.
    hand_steps: list[dict[str, float]] = field(default_factory=list)
    agent_steps: list[dict[str, float]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def new_poller() -> httpx.Client:
    """The bench's client for one round: one kept-alive connection from BENCH_ADDRESS (a new
    connection every 10 ms would load the server more than the agent's probe does), closed at the
    round's end (a server may wait for open connections before it exits: Triton did, 30 s)."""
    return httpx.Client(timeout=1.0, transport=httpx.HTTPTransport(local_address=BENCH_ADDRESS))


def ready(poller: httpx.Client, url: str, check: ReadyCheck) -> bool:
    try:
        answer = poller.get(url)
    except httpx.HTTPError:
        return False
    return answer.status_code == 200 and (check.body is None or body_matches(check.body, answer.content))


#: Steps that are amounts (counts, seconds), not times.
AMOUNTS = ("cpu", "probes", "probe gap", "stdout lag")


def stat_of(pid: int) -> tuple[str, list[str]] | None:
    """(comm, the fields after it) of /proc/<pid>/stat; None when gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    head, _, rest = text.rpartition(")")
    return head.partition("(")[2], rest.split()


def session_steps(leader: int) -> dict[str, float]:
    """Of the server's session (``leader``'s: the worker's main process starts one, by hand and in
    a slot alike): the CPU seconds its processes used so far ("cpu", reaped children included) and
    when its JVM was forked ("java forked": a real fork by TorchServe's launcher, Unix time to the
    kernel's 10 ms ticks; the main process itself is a pre-forked child in a slot, its start time
    says nothing)."""
    leader_stat = stat_of(leader)
    if leader_stat is None:
        return {}
    sid = leader_stat[1][3]
    tick = os.sysconf("SC_CLK_TCK")
    boot_offset = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    cpu = 0.0
    java: list[float] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        found = stat_of(int(entry.name))
        if found is None or found[1][3] != sid:
            continue
        comm, fields = found
        cpu += sum(int(x) for x in fields[11:15]) / tick
        if comm == "java":
            java.append(boot_offset + int(fields[19]) / tick)
    steps = {"cpu": cpu}
    if java:
        steps["java forked"] = min(java)
    return steps


def relative(steps: dict[str, float], wall: float) -> dict[str, float]:
    """Unix times made seconds from ``wall``; amounts (AMOUNTS) as they are."""
    return {k: v if k in AMOUNTS else v - wall for k, v in steps.items()}


def probing(url_port: int, check: ReadyCheck, stop: threading.Event) -> threading.Thread:
    """--hand-probe: the agent's start-up readiness probe beside a by-hand server (its own check,
    runtime/probes.py: a new connection from 127.0.0.1 each time, every startup_period_seconds)
    until it passes or ``stop``."""
    probe = HttpCheck(port=url_port, path=check.path, body=check.body)
    period = Probe(http=probe).startup_period_seconds  # timeout_seconds: the default, 1 s

    def run() -> None:
        while not stop.is_set():
            started = time.monotonic()
            if run_probe(Probe(http=probe), "127.0.0.1").passed:
                return
            stop.wait(max(0.0, started + period - time.monotonic()))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def by_hand_once(server: Server, *, hand_probe: bool = False) -> tuple[float, dict[str, float], str]:
    ports = dict(zip(server.ports, free_ports(len(server.ports)), strict=True))
    workdir = Path(tempfile.mkdtemp(prefix=f"natest{os.getpid()}-hand-"))
    argv, extra = server.by_hand(ports, workdir)
    # A private TMPDIR, as the agent gives a worker (TorchServe keeps its pid file and the Python
    # worker's socket there: a shared /tmp would see the previous round's).
    (workdir / "tmp").mkdir()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        "HOME": "/root",
        "TMPDIR": str(workdir / "tmp"),
        **extra,
    }
    url = f"http://127.0.0.1:{ports[server.check.port]}{server.check.path}"
    output = workdir / "output.log"
    began, wall = time.perf_counter(), time.time()
    with output.open("wb") as out:
        process = subprocess.Popen(
            argv, env=env, cwd=workdir, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    steps: dict[str, float] = {}
    stop = threading.Event()
    if hand_probe:
        probing(ports[server.check.port], server.check, stop)
    poller = new_poller()
    try:
        while not ready(poller, url, server.check):
            if process.poll() is not None:
                raise SystemExit(f"{server.name} by hand exited ({process.returncode}): {argv}")
            if time.perf_counter() - began > STARTUP_TIMEOUT:
                raise SystemExit(f"{server.name} by hand not ready in {STARTUP_TIMEOUT:g}s")
            time.sleep(POLL_SECONDS)
        took = time.perf_counter() - began
        steps.update(session_steps(process.pid))
        note = ""
        if server.steps is not None:
            lines = output.read_text(errors="replace").splitlines()
            logged, note = server.steps([(log4j_time(line) or 0.0, line) for line in lines])
            steps.update(logged)
        return took, relative(steps, wall), note
    finally:
        stop.set()
        poller.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        # The helpers it forked (TorchServe's JVM and Python worker) end too before the next round.
        deadline = time.monotonic() + 30
        with contextlib.suppress(ProcessLookupError):
            while time.monotonic() < deadline:
                os.killpg(process.pid, 0)
                time.sleep(0.05)
            os.killpg(process.pid, signal.SIGKILL)
        time.sleep(0.2)
        shutil.rmtree(workdir, ignore_errors=True)


def iso_time(text: str) -> float:
    """A log entry's time (``2026-12-04T16:36:51.123456789Z``) as a Unix time."""
    day, _, fraction = text.rstrip("Z").partition(".")
    return datetime.strptime(day + "+0000", "%Y-%m-%dT%H:%M:%S%z").timestamp() + float(f"0.{fraction or 0}")


@dataclass
class AgentRound:
    allocated: float
    answered: float
    running: float
    steps: dict[str, float]
    note: str


def agent_once(client: httpx.Client, server: Server, number: int, *, cpus: float, memory: str) -> AgentRound:
    name = f"bench-{server.name}-{number}"
    body = {
        "name": name,
        "qos": "burstable",
        # By hand the server has every CPU of the host; the slot's quota is the same by default.
        "resources": {"cpus": cpus, "memory": memory},
        "worker": {**server.worker, "startup_timeout_seconds": STARTUP_TIMEOUT, "stop_grace_seconds": 10},
    }
    began, wall = time.perf_counter(), time.time()
    created = client.post("/v1/slots", json=body)
    created.raise_for_status()
    allocated = time.perf_counter() - began
    slot = created.json()
    steps: dict[str, float] = {}
    pid = (slot.get("worker") or {}).get("pid")
    (endpoint,) = [e for e in slot["endpoints"] if e["name"] == server.check.port]
    url = f"http://{endpoint['address']}:{endpoint['port']}{server.check.path}"
    poller = new_poller()
    try:
        # The model's URL polled every 10 ms, as by hand; the agent is not asked meanwhile (asking
        # it every 10 ms would load a small host more than the agent itself does).
        while not ready(poller, url, server.check):
            if time.perf_counter() - began > STARTUP_TIMEOUT:
                raise SystemExit(f"{server.name} through the agent not ready in {STARTUP_TIMEOUT:g}s")
            time.sleep(POLL_SECONDS)
        answered = time.perf_counter() - began
        if pid:
            steps.update(session_steps(int(pid)))
        while True:
            # The slot turns `running` when its readiness probe passes; its updated_at says when.
            seen = client.get(f"/v1/slots/{slot['id']}").json()
            worker = seen.get("worker") or {}
            if worker.get("phase") in ("failed", "crashloop"):
                raise SystemExit(f"{server.name} through the agent failed: {worker}")
            if seen["state"] == "running":
                running = float(seen["updated_at"]) - wall
                break
            time.sleep(0.05)
        note = ""
        if server.steps is not None:
            logs = client.get(f"/v1/slots/{slot['id']}/logs", params={"lines": 10000}).json()
            lines = [(iso_time(e["time"]), e["text"]) for e in logs["entries"] if e["time"]]
            logged, note = server.steps(lines)
            steps.update(logged)
        return AgentRound(allocated, answered, running, relative(steps, wall), note)
    finally:
        poller.close()
        client.delete(f"/v1/slots/{slot['id']}")


@contextlib.contextmanager
def installed(
    kinds: list[str], keep: Path | None
) -> Iterator[tuple[dict[str, Path], dict[str, dict[str, Any]]]]:
    """The servers' installs (kind -> base directory) and, for the preset-resolved ones (TorchServe,
    Triton), their worker specs as bench/validate_servers.py runs them. ``keep``: in keep/<kind>,
    reused and kept; otherwise fresh ones, removed afterwards."""
    bases: dict[str, Path] = {}
    workers: dict[str, dict[str, Any]] = {}
    made: list[Path] = []
    try:
        for kind in kinds:
            print(f"installing {kind} (or finding it installed) ...", flush=True)
            if keep is not None:
                base = keep / kind
                base.mkdir(parents=True, exist_ok=True)
                for path in (keep, base):
                    path.chmod(0o755)
            else:
                base = new_base(kind)
                made.append(base)
            bases[kind] = base
            if kind == "mlserver":
                build_mlserver(base)
            elif kind == "kserve":
                build_kserve(base)
            elif kind == "torchserve":
                workers[kind] = build_torchserve(base).worker
            elif kind == "triton":
                workers[kind] = build_triton(base).worker
            else:
                from importlib.metadata import version

                if not (base / "venv" / "bin" / "python").exists():
                    make_venv(base / "venv", [f"numpy=={version('numpy')}"])
        yield bases, workers
    finally:
        for base in made:
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


def steps_table(name: str, t: Times) -> str:
    """The server's steps of start, by hand and through the agent, side by side."""
    names = [
        k
        for k in ("java forked", *(step for step, _ in TORCHSERVE_STEPS))
        if any(k in s for s in t.hand_steps)
    ]
    rows = [
        f"| {name}: step (ms from the start) | by hand | agent | agent - by hand (medians) |",
        "|---|---|---|---|",
    ]

    def row(label: str, hand: list[float], agent: list[float]) -> str:
        delta = (
            (statistics.median(agent) - statistics.median(hand)) * 1000 if hand and agent else float("nan")
        )
        return f"| {label} | {ms(hand)} | {ms(agent)} | {delta:+.0f} |"

    for step in names:
        rows.append(
            row(
                step,
                [s[step] for s in t.hand_steps if step in s],
                [s[step] for s in t.agent_steps if step in s],
            )
        )
    rows.append(row("model ready (the bench's poll)", t.by_hand, t.answers))
    rows.append(row("CPU time of the server's processes at ready", *cpu_of(t)))
    probes = [s["probes"] for s in t.agent_steps if "probes" in s]
    if probes:
        rows.append(
            f"| agent's probes before ready | | {statistics.median(probes):.0f} "
            f"({min(probes):.0f}-{max(probes):.0f}) | |"
        )
    for key in ("probe gap", "stdout lag"):
        if not any(key in s for s in t.agent_steps):
            continue
        rows.append(f"| agent's {key} (longest) | | {ms([s[key] for s in t.agent_steps if key in s])} | |")
    codes = sorted(set(t.notes))
    if not any(codes):
        return "\n".join(rows)
    return (
        "\n".join(rows) + f"\n\nthe agent's probe answers during the start (status codes in order): {codes}"
    )


def readiness(check: ReadyCheck, startup_period: float) -> dict[str, Any]:
    """--startup-period: the preset's readiness check as a spec's own probe, with that period."""
    http: dict[str, Any] = {"port": check.port, "path": check.path}
    if check.body is not None:
        http["body"] = check.body.model_dump(exclude_none=True)
    return {"http": http, "period_seconds": 2.0, "startup_period_seconds": startup_period}


def cpu_of(t: Times) -> tuple[list[float], list[float]]:
    return [s["cpu"] for s in t.hand_steps if "cpu" in s], [s["cpu"] for s in t.agent_steps if "cpu" in s]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="rounds per server (each: by hand, then agent)")
    parser.add_argument(
        "--servers", default="oip,mlserver,kserve", help=f"comma-separated: {', '.join(KINDS)}"
    )
    parser.add_argument(
        "--cpus", type=float, default=float(os.cpu_count() or 1), help="the slot's CPU quota (default: all)"
    )
    parser.add_argument("--memory", default="1Gi", help="the slot's memory limit (default 1Gi)")
    parser.add_argument(
        "--sandbox", choices=SANDBOXES, default="default", help="the slots' sandbox (default: the default)"
    )
    parser.add_argument(
        "--hand-probe",
        action="store_true",
        help="run the agent's start-up readiness probe beside each by-hand server too (its cost)",
    )
    parser.add_argument(
        "--startup-period",
        type=float,
        default=None,
        help="the agent's start-up probe period in seconds (the preset's readiness check with "
        "startup_period_seconds set; default: the preset's own, 0.05)",
    )
    parser.add_argument(
        "--keep-venvs", type=Path, default=None, help="the installs in (and kept in) DIR/<server>"
    )
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the bench creates cgroups")
    kinds = [k for k in args.servers.split(",") if k]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise SystemExit(f"unknown servers {sorted(unknown)}; known: {', '.join(KINDS)}")
    keep = args.keep_venvs.resolve() if args.keep_venvs else None
    work = Path(tempfile.mkdtemp(prefix=f"natest{os.getpid()}-bench-"))
    first_port = 30000 + (os.getpid() % 20) * 100
    with installed(kinds, keep) as (installs, workers):
        daemon = DaemonProcess(work, config_text(first_port, args.sandbox))
        client = daemon.start()
        results: dict[str, Times] = {}
        try:
            for name, server in servers(installs, workers, args.cpus).items():
                if args.sandbox == "no-seccomp":
                    server.worker = {**server.worker, "sandbox": {"seccomp": "unconfined"}}
                if args.startup_period is not None:
                    server.worker = {
                        **server.worker,
                        "readiness": readiness(server.check, args.startup_period),
                    }
                times = results.setdefault(name, Times())
                by_hand_once(
                    server, hand_probe=args.hand_probe
                )  # warm the page cache: both paths then read the same files
                for number in range(args.runs):
                    took, hand_steps, _ = by_hand_once(server, hand_probe=args.hand_probe)
                    times.by_hand.append(took)
                    times.hand_steps.append(hand_steps)
                    done = agent_once(client, server, number, cpus=args.cpus, memory=args.memory)
                    times.allocated.append(done.allocated)
                    times.answers.append(done.answered)
                    times.running.append(done.running)
                    times.agent_steps.append(done.steps)
                    times.notes.append(done.note)
                    print(
                        f"{name} {number + 1}/{args.runs}: by hand {took * 1000:.0f} ms, "
                        f"agent: allocated {done.allocated * 1000:.0f} ms, "
                        f"answers {done.answered * 1000:.0f} ms, "
                        f"running {done.running * 1000:.0f} ms",
                        flush=True,
                    )
                    if server.steps is not None:
                        print(
                            f"  by hand: {rounded(hand_steps)}\n  agent:   {rounded(done.steps)} {done.note}",
                            flush=True,
                        )
        finally:
            client.close()
            daemon.stop()
            remove_bench_objects(daemon.state)
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(table(results))
    for name, t in results.items():
        if t.hand_steps and any(t.hand_steps):
            print()
            print(steps_table(name, t))


def rounded(steps: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}" if k != "probes" else f"{k} {v:.0f}" for k, v in steps.items())


if __name__ == "__main__":
    main()
