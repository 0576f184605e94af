"""The daemon's figures: allocation round trips through the REST API, and its footprint at rest.

Run as root on a host with writable cgroups; everything lives under a test cgroup parent
("natest<pid>b.slice"), a tmp state directory and a free loopback port, and is removed afterwards.

Latency and throughput, side by side in one run:
  in-process     SlotManager.allocate + release called directly (the same placement, SQLite writes
                 and cgroups): the floor the API adds to
  rest           POST /v1/slots + DELETE /v1/slots/{id} to ``nodeagent serve`` over loopback with a
                 keep-alive httpx client
  rest-agentclient  the same calls through the CLI's own client (cli/client.py: one keep-alive
                 socket, no HTTP library): the server's share of ``rest`` without httpx's
  cli            ``nodeagent slots allocate`` + ``release`` as processes (what an operator pays)
Each allocates a burstable slot (0.1 CPU, 32Mi, no worker) and releases it; the table gives median
and p99 per call and allocate+release pairs per second. The first three are timed in turns of 10
pairs (the in-process manager, with names of its own, runs beside the daemon), so that a shared
host's changing load weighs on each alike.

Footprint of ``nodeagent serve`` and of its host keeper (the one process, besides the workers, that
it starts): the daemon's RSS (VmRSS), the keeper's PSS (its pages shared with its pre-forked idle
children counted once, between them) and idle CPU as % of one core (utime+stime from /proc/PID/stat
over --idle-seconds with no API calls; memory after it: past 30 s without a launch the keeper keeps
one idle child, of the last launch's kind), fresh, with 0 slots after the round trips, and with --slots
best-effort slots (0.01 CPU, 8Mi) each running a minimal worker (``sleep infinity``, restart
never). Targets: daemon RSS < 80 MB and idle CPU < 1% of a core; daemon RSS + keeper PSS (with its
idle children) < 100 MB and daemon + keeper idle CPU < 0.5% of a core at 500 slots.
``--profile`` then runs the same slots under an in-process SlotManager: memory per slot, the
supervision loop's idle CPU (it waits on all pidfds at once and ticks only what is due), what a
full sweep over every supervisor costs (``SlotManager.tick()``), and one /metrics render.

    python bench/api.py [--runs 200] [--slots 500] [--idle-seconds 30] [--cli-runs 10] [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import io
import json
import os
import pstats
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `tests` is a package of the repo

from nodeagent.agent.config import AgentConfig, apply_overrides, parse_config
from nodeagent.agent.daemon import build_isolation, build_manager, ensure_state_dir
from nodeagent.agent.manager import SlotManager
from nodeagent.cgroups import detect
from nodeagent.cli.client import AgentClient
from nodeagent.devices.discovery import discover
from nodeagent.isolation.api_guard import ApiGuard, table_name
from nodeagent.isolation.backend import KernelIsolation
from nodeagent.isolation.firewall import LibNftables
from nodeagent.runtime.keeper_client import keeper_identity, stop_keeper
from nodeagent.schema.request import parse_slot_request
from tests.daemon import DaemonProcess, nodeagent_argv

PARENT = f"natest{os.getpid()}b.slice"
NETNS_PREFIX = f"nb{os.getpid()}-"
VETH_PREFIX = "ntb"
FIREWALL_TABLE = f"natest{os.getpid()}b"
TICKS = os.sysconf("SC_CLK_TCK")
PAIR_REQUEST: dict[str, Any] = {"qos": "burstable", "resources": {"cpus": 0.1, "memory": "32Mi"}}
IDLE_WORKER = {"command": ["sleep", "infinity"], "restart": "never", "stop_grace_seconds": 1}
RSS_TARGET_MB = 80.0
CPU_TARGET_PERCENT = 1.0
TOTAL_TARGET_MB = 100.0
TOTAL_CPU_TARGET_PERCENT = 0.5


# =========================================================================== configuration and daemon


def config_text() -> str:
    return (
        f'[isolation]\ncgroup_parent = "{PARENT}"\nnetns_prefix = "{NETNS_PREFIX}"\n'
        f'veth_prefix = "{VETH_PREFIX}"\nfirewall_table = "{FIREWALL_TABLE}"\nhost_partitioning = "off"\n\n'
        '[log]\nlevel = "warning"\n'
    )


def own_names(state_dir: Path) -> tuple[str, str, str, str]:
    """Cgroup parent, netns and veth prefixes and firewall table of the manager of ``state_dir``:
    the in-process manager runs beside the daemon (``interleaved``), so it has names of its own
    (one would take the other's slots for orphans, or remove its firewall rules)."""
    if state_dir.name == "inproc":
        return f"natest{os.getpid()}i.slice", f"ni{os.getpid()}-", "nti", f"natest{os.getpid()}i"
    return PARENT, NETNS_PREFIX, VETH_PREFIX, FIREWALL_TABLE


def agent_config(state_dir: Path) -> AgentConfig:
    parent, netns_prefix, veth_prefix, firewall_table = own_names(state_dir)
    data = {
        # The benchmark measures the agent's own work: partitioning this (shared) host is not part of it.
        "isolation": {
            "cgroup_parent": parent,
            "netns_prefix": netns_prefix,
            "veth_prefix": veth_prefix,
            "host_partitioning": "off",
            "firewall_table": firewall_table,
        },
        "log": {"level": "warning"},
        "cdi": {"dir": str(state_dir / "cdi-specs")},  # not the host's CDI directory
    }
    return apply_overrides(parse_config(data), state_dir=state_dir)


def remove_bench_objects(state_dir: Path) -> None:
    """Everything under the bench's cgroup parent, netns and veth prefixes (kills what runs there),
    the keeper of ``state_dir`` and the daemon's firewall rules for its slots (a daemon that did not
    stop cleanly leaves them, and they would refuse other agents' slots of the same uids)."""
    stop_keeper(state_dir / "keeper")
    kernel = build_isolation(agent_config(state_dir), discover(gpus=False, fpgas=False), detect())
    if isinstance(kernel, KernelIsolation):
        kernel.isolator.remove_all()  # the uninstall path; no public wrapper yet
    ApiGuard(LibNftables(), table_name(own_names(state_dir)[3])).remove()


# =========================================================================== latency


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@dataclass
class PairTimes:
    allocate: list[float]
    release: list[float]
    elapsed: float

    @property
    def pairs_per_second(self) -> float:
        return len(self.allocate) / self.elapsed


def time_pairs(runs: int, allocate: Callable[[str], str], release: Callable[[str], None]) -> PairTimes:
    times = PairTimes([], [], 0.0)
    began = time.perf_counter()
    for i in range(runs):
        t0 = time.perf_counter()
        slot_id = allocate(f"bench-{i}")
        t1 = time.perf_counter()
        release(slot_id)
        t2 = time.perf_counter()
        times.allocate.append(t1 - t0)
        times.release.append(t2 - t1)
    times.elapsed = time.perf_counter() - began
    return times


def in_process_pairs(manager: SlotManager, runs: int) -> PairTimes:
    def allocate(name: str) -> str:
        return manager.allocate(parse_slot_request({"name": name, **PAIR_REQUEST})).slot.id

    return time_pairs(runs, allocate, manager.release)


def rest_pairs(client: httpx.Client, runs: int) -> PairTimes:
    def allocate(name: str) -> str:
        response = client.post("/v1/slots", json={"name": name, **PAIR_REQUEST})
        response.raise_for_status()
        return str(response.json()["id"])

    def release(slot_id: str) -> None:
        client.delete(f"/v1/slots/{slot_id}").raise_for_status()

    return time_pairs(runs, allocate, release)


def agentclient_pairs(client: AgentClient, runs: int) -> PairTimes:
    def allocate(name: str) -> str:
        slot, _created = client.allocate({"name": f"ac-{name}", **PAIR_REQUEST})
        return str(slot["id"])

    return time_pairs(runs, allocate, client.release)


def interleaved(
    paths: dict[str, Callable[[int], PairTimes]], runs: int, block: int = 10
) -> dict[str, PairTimes]:
    """``runs`` pairs through each path, taken in turns of ``block`` pairs: on a shared host the
    load drifts within seconds, and paths timed one after the other (the in-process calls first,
    REST a minute later) compared the load of different minutes as much as the paths."""
    rows = {name: PairTimes([], [], 0.0) for name in paths}
    done = 0
    while done < runs:
        count = min(block, runs - done)
        for name, run in paths.items():
            times = run(count)
            rows[name].allocate += times.allocate
            rows[name].release += times.release
            rows[name].elapsed += times.elapsed
        done += count
    return rows


def cli_pairs(daemon: DaemonProcess, runs: int) -> PairTimes:
    base = [*nodeagent_argv(), "slots", "--api", daemon.url, "--token-file", str(daemon.token_file)]

    def run(*args: str) -> str:
        done = subprocess.run([*base, *args], capture_output=True, text=True, check=True)
        return done.stdout

    def allocate(name: str) -> str:
        out = run(
            "allocate", "--name", f"cli-{name}", "--qos", "burstable", "--cpus", "0.1", "--memory", "32Mi"
        )
        return out.split()[2]  # "allocated slot <id> (<name>)"

    def release(slot_id: str) -> None:
        run("release", slot_id)

    return time_pairs(runs, allocate, release)


def http_parser() -> str:
    """The HTTP/1.1 parser uvicorn serves the daemon's API with (the daemon runs this interpreter):
    httptools where installed, else h11; it is a good part of the REST path's cost."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    name = AutoHTTPProtocol.__name__
    return {"HttpToolsProtocol": "httptools", "H11Protocol": "h11"}.get(name, name)


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}"


def latency_table(rows: dict[str, PairTimes]) -> str:
    base = rows.get("in-process")
    header = ("path", "runs", "alloc p50", "alloc p99", "release p50", "release p99", "pairs/s", "x in-proc")
    lines = [header]
    for name, t in rows.items():
        ratio = statistics.median(t.allocate) / statistics.median(base.allocate) if base else float("nan")
        lines.append(
            (
                name,
                str(len(t.allocate)),
                ms(statistics.median(t.allocate)),
                ms(percentile(t.allocate, 0.99)),
                ms(statistics.median(t.release)),
                ms(percentile(t.release, 0.99)),
                f"{t.pairs_per_second:.1f}",
                f"{ratio:.2f}",
            )
        )
    return table(lines) + "\n(latencies in ms; x in-proc: median allocate relative to the in-process call)"


def table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in rows
    )


# =========================================================================== footprint


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime (fields 14, 15)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class Footprint:
    label: str
    rss_mb: float
    cpu_percent: float | None
    #: The keeper and the idle children it forked ahead of time (None: no keeper runs yet).
    keeper_pss_mb: float | None
    keeper_cpu_percent: float | None
    idle_children: int
    #: Parents of the workers other than the keeper (there should be none).
    other_parents: int

    @property
    def total_mb(self) -> float:
        return self.rss_mb + (self.keeper_pss_mb or 0.0)

    @property
    def total_cpu_percent(self) -> float | None:
        if self.cpu_percent is None:
            return None
        return self.cpu_percent + (self.keeper_cpu_percent or 0.0)


def keeper_processes(state_dir: Path) -> list[int]:
    """The host keeper of ``state_dir`` and the idle children it forked ahead of time (its children
    that have not exec'd: they still run the keeper's interpreter)."""
    identity = keeper_identity(state_dir / "keeper")
    if identity is None:
        return []
    try:
        keeper = psutil.Process(identity.pid)
        exe = keeper.exe()
        children = [c.pid for c in keeper.children() if c.exe() == exe]
    except psutil.Error:
        return []
    return [identity.pid, *children]


def total_cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += cpu_seconds(pid)
    return total


def total_pss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            total += psutil.Process(pid).memory_full_info().pss
    return total / (1 << 20)


def footprint(
    label: str, daemon_pid: int, state_dir: Path, idle_seconds: float, worker_pids: list[int]
) -> Footprint:
    keeper = keeper_processes(state_dir)
    parents: set[int] = set()
    for pid in worker_pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            parents.add(psutil.Process(pid).ppid())
    cpu = keeper_cpu = None
    if idle_seconds > 0:
        own0, keeper0, t0 = cpu_seconds(daemon_pid), total_cpu(keeper), time.monotonic()
        time.sleep(idle_seconds)
        own1, keeper1, t1 = cpu_seconds(daemon_pid), total_cpu(keeper), time.monotonic()
        cpu = 100 * (own1 - own0) / (t1 - t0)
        keeper_cpu = 100 * (keeper1 - keeper0) / (t1 - t0) if keeper else None
        # The keeper's children as they are after the idle window: 30 s after the last launch it
        # keeps one idle child, of the last launch's kind (runtime/keeper_client.py).
        keeper = keeper_processes(state_dir)
    return Footprint(
        label,
        rss_mb(daemon_pid),
        cpu,
        total_pss_mb(keeper) if keeper else None,
        keeper_cpu,
        max(0, len(keeper) - 1),
        len(parents - set(keeper[:1])),
    )


def footprint_table(rows: list[Footprint]) -> str:
    def pct(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    def mb(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    lines = [
        (
            "daemon state",
            "daemon RSS MB",
            "idle CPU %",
            "keeper PSS MB",
            "keeper CPU %",
            "idle children",
            "RSS+PSS MB",
            "CPU % both",
        )
    ]
    for f in rows:
        lines.append(
            (
                f.label,
                f"{f.rss_mb:.1f}",
                pct(f.cpu_percent),
                mb(f.keeper_pss_mb),
                pct(f.keeper_cpu_percent),
                str(f.idle_children),
                f"{f.total_mb:.1f}",
                pct(f.total_cpu_percent),
            )
        )
    verdicts = []
    for f in rows:
        verdict = f"{f.label}: RSS {'OK' if f.rss_mb < RSS_TARGET_MB else 'OVER'}"
        verdict += f", with the keeper {'OK' if f.total_mb < TOTAL_TARGET_MB else 'OVER'}"
        if f.total_cpu_percent is not None:
            verdict += f", idle CPU {'OK' if f.total_cpu_percent < TOTAL_CPU_TARGET_PERCENT else 'OVER'}"
        if f.other_parents:
            verdict += f", {f.other_parents} worker parent(s) besides the keeper"
        verdicts.append(verdict)
    return (
        table(lines)
        + f"\n(targets: daemon RSS < {RSS_TARGET_MB:g} MB, idle CPU < {CPU_TARGET_PERCENT:g}% of one core; "
        + f"daemon RSS + keeper PSS < {TOTAL_TARGET_MB:g} MB, daemon + keeper idle CPU < "
        + f"{TOTAL_CPU_TARGET_PERCENT:g}%; keeper PSS includes its idle children)\n"
        + "; ".join(verdicts)
    )


def allocate_idle_slots(client: httpx.Client, count: int) -> tuple[list[str], float]:
    began = time.perf_counter()
    ids = []
    for i in range(count):
        body = {
            "name": f"idle-{i}",
            "qos": "best-effort",
            "resources": {"cpus": 0.01, "memory": "8Mi"},
            "worker": IDLE_WORKER,
        }
        response = client.post("/v1/slots", json=body)
        response.raise_for_status()
        ids.append(str(response.json()["id"]))
    return ids, time.perf_counter() - began


def running_worker_pids(client: httpx.Client, expected: int, timeout: float = 120) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        slots = client.get("/v1/slots").json()["slots"]
        pids = [s["worker"]["pid"] for s in slots if (s.get("worker") or {}).get("phase") == "running"]
        if len(pids) >= expected or time.monotonic() > deadline:
            return [int(p) for p in pids if p]
        time.sleep(0.5)


def timed_gets(
    gets: dict[tuple[str, str], Callable[[], Any]], runs: int = 11
) -> dict[tuple[str, str], float]:
    """The median seconds of each GET over ``runs`` rounds, the GETs taking turns within a round so
    that the machine's noise hits each alike (an error answer raises)."""
    times: dict[tuple[str, str], list[float]] = {key: [] for key in gets}
    for _ in range(runs):
        for key, get in gets.items():
            t0 = time.perf_counter()
            answer = get()
            if isinstance(answer, httpx.Response):
                answer.raise_for_status()
            times[key].append(time.perf_counter() - t0)
    return {key: statistics.median(seconds) for key, seconds in times.items()}


# =========================================================================== profile of a tick


def profile_ticks(state_dir: Path, slots: int, ticks: int = 20) -> str:
    """Where an in-process manager holding ``slots`` idle workers spends: memory per slot
    (tracemalloc over the allocations), the supervision tick, and one /metrics scrape."""
    from nodeagent.agent.daemon import _slot_stats
    from nodeagent.agent.metrics import Metrics

    manager = build_manager(agent_config(state_dir), discover(gpus=False, fpgas=False))
    manager.start()  # with the supervision loop, as the daemon runs it
    report: list[str] = []
    # The keeper it starts lives in state_dir/keeper; the workspace's clean-up stops it.
    try:
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        for i in range(slots):
            body = {"name": f"prof-{i}", "qos": "best-effort", "resources": {"cpus": 0.01, "memory": "8Mi"}}
            manager.allocate(parse_slot_request({**body, "worker": IDLE_WORKER}))
        manager.tick()
        growth = tracemalloc.take_snapshot().compare_to(before, "filename")
        tracemalloc.stop()
        held = sum(d.size_diff for d in growth)
        report.append(
            f"python heap held after {slots} allocations: {held / 1024:.0f} KiB "
            f"({held / max(slots, 1):.0f} B per slot)"
        )
        report += [f"  {d.size_diff / 1024:9.0f} KiB  {d.traceback[0].filename}" for d in growth[:8]]
        wall0, cpu0 = time.monotonic(), time.process_time()
        time.sleep(5)  # only the supervision thread runs meanwhile
        loop = (time.process_time() - cpu0) / (time.monotonic() - wall0)
        report.append(
            f"\nsupervision loop idle with {slots} workers: {100 * loop:.3f}% of a core "
            "(process CPU over 5 s)"
        )
        t0 = time.perf_counter()
        for _ in range(ticks):
            manager.tick()
        per_tick = (time.perf_counter() - t0) / ticks
        report.append(
            f"full sweep (SlotManager.tick(), every supervisor; the loop does not run it) with {slots} "
            f"idle workers: {per_tick * 1000:.2f} ms ({per_tick / max(slots, 1) * 1e6:.1f} us per slot)"
        )
        report.append(profiled(lambda: [manager.tick() for _ in range(ticks)], 14))
        metrics = Metrics(manager, stats_provider=_slot_stats(manager))
        t0 = time.perf_counter()
        metrics.render()
        report.append(f"one /metrics render with {slots} slots: {(time.perf_counter() - t0) * 1000:.0f} ms")
        report.append(profiled(metrics.render, 14))

        def slots_body() -> bytes:  # what GET /v1/slots does before the HTTP layer
            return json.dumps({"slots": [s.to_json() for s in manager.list_slots()]}).encode()

        t0 = time.perf_counter()
        slots_body()
        report.append(
            f"one GET /v1/slots body with {slots} slots: {(time.perf_counter() - t0) * 1000:.0f} ms"
        )
        report.append(profiled(slots_body, 14))
    finally:
        for slot in manager.list_slots():
            with contextlib.suppress(Exception):
                manager.release(slot.id)
        manager.close()
    return "\n".join(report)


def profiled(call: Callable[[], object], lines: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    call()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(lines)
    return out.getvalue()


# =========================================================================== main


@contextlib.contextmanager
def workspace() -> Iterator[Path]:
    work = Path(tempfile.mkdtemp(prefix="natest-bench-api-"))
    try:
        yield work
    finally:
        for state in ("state", "inproc", "profile"):  # the daemon's, and the in-process managers'
            remove_bench_objects(work / state)
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="allocate+release pairs per path")
    parser.add_argument("--cli-runs", type=int, default=10, help="pairs through the CLI (0: skip)")
    parser.add_argument("--slots", type=int, default=500, help="idle slots with a worker for the footprint")
    parser.add_argument("--idle-seconds", type=float, default=30.0, help="idle CPU window (0: skip)")
    parser.add_argument("--profile", action="store_true", help="profile the supervision tick in-process")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the bench creates cgroups")
    # A SIGTERM (a timeout) ends the run through the workspace's clean-up, not around it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    with workspace() as work:
        rows: dict[str, PairTimes] = {}
        state = ensure_state_dir(work / "inproc")
        manager = build_manager(agent_config(state), discover(gpus=False, fpgas=False))
        manager.start()
        daemon = DaemonProcess(work, config_text())
        try:
            client = daemon.start()
        except BaseException:
            manager.close()
            raise
        prints: list[Footprint] = []
        agent = AgentClient(daemon.url, daemon.token_file.read_text().strip())
        try:
            prints.append(footprint("fresh, 0 slots", daemon.pid, daemon.state, 0, []))
            try:
                paths: dict[str, Callable[[int], PairTimes]] = {
                    "in-process": lambda n: in_process_pairs(manager, n),
                    "rest": lambda n: rest_pairs(client, n),
                    "rest-agentclient": lambda n: agentclient_pairs(agent, n),
                }
                for run in paths.values():
                    run(min(20, args.runs))  # warm-up
                rows.update(interleaved(paths, args.runs))
            finally:
                manager.close()
                remove_bench_objects(state)  # its own names: the daemon's slots stay
            if args.cli_runs:
                rows["cli"] = cli_pairs(daemon, args.cli_runs)
            print(latency_table(rows), flush=True)
            print(f"(the daemon parses HTTP with {http_parser()})", flush=True)
            prints.append(
                footprint("0 slots, after round trips", daemon.pid, daemon.state, args.idle_seconds, [])
            )
            ids, took = allocate_idle_slots(client, args.slots)
            workers = running_worker_pids(client, args.slots)
            print(
                f"\nallocated {len(ids)} best-effort slots with workers in {took:.1f} s "
                f"({len(ids) / took:.1f}/s); {len(workers)} workers running",
                flush=True,
            )
            # The first scrape reads every slot's five cgroup files; later ones read two of a slot
            # that used no CPU since the one before (CgroupStats.ran_since): both are shown.
            time.sleep(2)  # the QoS loop's tending and relisting after the allocations is done
            t0 = time.perf_counter()
            agent.get("/metrics")
            first_scrape = time.perf_counter() - t0
            # Each GET through httpx and through the agent's own client (one keep-alive socket, the
            # body read whole and not parsed), alternating: httpx's own cost of reading a 0.3-0.5 MB
            # answer is part of the first figure only.
            gets = timed_gets(
                {
                    (path, via): functools.partial(call, path)
                    for path in ("/v1/slots", "/metrics")
                    for via, call in (("httpx", client.get), ("agent client", agent.get))
                }
            )
            time.sleep(2)  # let the scrapes' garbage settle before the idle window
            prints.append(
                footprint(
                    f"{len(ids)} slots, idle workers", daemon.pid, daemon.state, args.idle_seconds, workers
                )
            )
            print(
                f"at {len(ids)} slots: the first GET /metrics (every file read) {first_scrape * 1e3:.1f} ms "
                "through the agent's client"
            )
            print(
                f"at {len(ids)} slots (median of 11; httpx / the agent's client): "
                + ", ".join(
                    f"GET {path} {gets[path, 'httpx'] * 1e3:.1f} / {gets[path, 'agent client'] * 1e3:.1f} ms"
                    for path in ("/v1/slots", "/metrics")
                )
            )
            t0 = time.perf_counter()
            for slot_id in ids:
                client.delete(f"/v1/slots/{slot_id}").raise_for_status()
            print(f"released {len(ids)} slots in {time.perf_counter() - t0:.1f} s\n")
        finally:
            client.close()
            agent.close()
            daemon.stop()
        print(footprint_table(prints), flush=True)
        remove_bench_objects(daemon.state)

        if args.profile:
            print()
            print(profile_ticks(ensure_state_dir(work / "profile"), args.slots))


if __name__ == "__main__":
    main()
