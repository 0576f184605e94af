"""Elastic slots: allocate -> first inference answered, from a warm pool against a cold start, side
by side in one run (docs/pools.md).

Servers: the repository's example Open Inference Protocol worker (examples/oip_worker.py), MLServer
and KServe's model server (from PyPI, CPU only, the tests' tiny "doubler" model; bench/model_servers.py
installs them). Each slot is guaranteed, 1 exclusive CPU, --memory, the server's preset, sandboxed
as by default. For each server, ``--runs`` rounds, alternating:

  pool   POST /v1/slots {"name", "pool"} (the pool holds one frozen standby, refilled between rounds),
         then POST of an inference to the slot's endpoint every 5 ms until one is answered
  cold   POST /v1/slots with the pool's own request (the same worker started in a new slot), then
         the same inference loop

Then, with the first server: a burst of --burst claims at once from a pool of --burst standbys
(each in its own thread, each followed by its first inference): the time until the last answered
(burstable slots of 0.25 CPU: eight exclusive CPUs do not fit a small host);
and a guaranteed neighbour (the example OIP worker on an exclusive CPU) under a steady load of
--rate requests/s for --seconds, first with the pool full and idle, then while the pool refills
--burst standbys from empty, --neighbour-rounds times: its p50/p99 side by side, medians over rounds
(the load generator runs on the host under SCHED_FIFO, standing for a client on another machine;
the agent partitions the host as a real one does, --host-partitioning off leaves it alone).

Targets: pool <= 50 ms median (and cold >= 10x that), the burst answered within 1 s, the
neighbour's p99 during the refill <= 1.1x without.

Run as root on a host with writable cgroups; everything lives under a test cgroup parent
("natest<pid>m.slice"), a tmp state directory and /var/tmp/natest<pid>-* venvs, removed afterwards.

    python bench/elasticity.py [--servers oip,mlserver] [--runs 7] [--burst 8] [--rate 100]
        [--seconds 10] [--neighbour-rounds 5] [--memory 512Mi] [--host-partitioning auto|off]
        [--keep-venvs DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `tests` is a package of the repo
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/model_servers.py, a script beside

from model_servers import MODEL, Server, config_text, installed, remove_bench_objects, servers

from tests.daemon import DaemonProcess

KINDS = ("oip", "mlserver", "kserve")
#: An inference each server answers: the tests' "doubler" (MLServer, KServe), and one row of the
#: example worker's MLP (64 inputs).
BODIES: dict[str, dict[str, Any]] = {
    "oip": {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [0.5] * 64}]},
    "doubler": {"inputs": [{"name": "x", "shape": [3], "datatype": "FP32", "data": [1.0, 2.5, -4.0]}]},
}


def body_of(server: Server) -> dict[str, Any]:
    return BODIES["oip" if server.name == "oip" else "doubler"]


STARTUP = 240.0
TARGET_MS = 50.0
#: One client for every first inference, made before any clock starts (making a client costs
#: milliseconds of its own: an SSL context). No kept-alive connections: each slot is new.
POLLER = httpx.Client(timeout=2.0, limits=httpx.Limits(max_keepalive_connections=0))


def infer_url(slot: dict[str, Any]) -> str:
    (endpoint,) = [e for e in slot["endpoints"] if e["name"] == "http"]
    return f"http://{endpoint['address']}:{endpoint['port']}/v2/models/{MODEL}/infer"


def first_answer(url: str, body: dict[str, Any], began: float, timeout: float = STARTUP) -> float:
    """Seconds from ``began`` until an inference to ``url`` is answered (polled every 5 ms)."""
    while True:
        try:
            if POLLER.post(url, json=body).status_code == 200:
                return time.perf_counter() - began
        except httpx.HTTPError:
            pass
        if time.perf_counter() - began > timeout:
            raise SystemExit(f"no inference answered at {url} within {timeout:g}s")
        time.sleep(0.005)


#: The burst's shape: eight slots of one exclusive CPU each do not fit a small host, eight
#: burstable slots do.
BURST_SHAPE = ("burstable", 0.25)


def request_of(
    server: Server, name: str, memory: str, shape: tuple[str, float] = ("guaranteed", 1)
) -> dict[str, Any]:
    return {
        "name": name,
        "qos": shape[0],
        "resources": {"cpus": shape[1], "memory": memory},
        "worker": {**server.worker, "startup_timeout_seconds": STARTUP, "stop_grace_seconds": 5},
    }


def make_pool(
    client: httpx.Client, server: Server, size: int, memory: str, shape: tuple[str, float] = ("guaranteed", 1)
) -> None:
    slot = request_of(server, "unused", memory, shape)
    del slot["name"]
    created = client.post("/v1/pools", json={"name": server.name, "size": size, "slot": slot})
    if created.status_code not in (200, 201):
        raise SystemExit(f"pool {server.name}: {created.text}")


def wait_pool(client: httpx.Client, name: str, ready: int, timeout: float = STARTUP) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pool = client.get(f"/v1/pools/{name}").json()
        if pool["ready"] >= ready:
            return
        if pool.get("problem"):
            raise SystemExit(f"pool {name}: {pool['problem']}")
        time.sleep(0.1)
    raise SystemExit(f"pool {name} not at {ready} ready standbys within {timeout:g}s")


def claim_once(client: httpx.Client, server: Server, name: str) -> tuple[float, float]:
    """(allocate answered, first inference answered), in seconds from the POST."""
    began = time.perf_counter()
    answer = client.post("/v1/slots", json={"name": name, "pool": server.name})
    if answer.status_code != 201:
        raise SystemExit(f"claim {name} from {server.name}: {answer.text}")
    allocated = time.perf_counter() - began
    return allocated, first_answer(infer_url(answer.json()), body_of(server), began)


def cold_once(client: httpx.Client, server: Server, name: str, memory: str) -> tuple[float, float]:
    began = time.perf_counter()
    answer = client.post("/v1/slots", json=request_of(server, name, memory))
    if answer.status_code != 201:
        raise SystemExit(f"cold {name}: {answer.text}")
    allocated = time.perf_counter() - began
    return allocated, first_answer(infer_url(answer.json()), body_of(server), began)


def ms(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values) * 1000:.1f} [{min(values) * 1000:.1f}-{max(values) * 1000:.1f}]"


def claim_steps(log_path: Path) -> dict[str, list[float]]:
    """Each step of every claim so far, in ms, from the daemon's "standby taken" log records."""
    steps: dict[str, list[float]] = {}
    for line in log_path.read_text().splitlines() if log_path.exists() else []:
        if '"standby taken"' not in line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        for step, value in (record.get("ms") or {}).items():
            steps.setdefault(step, []).append(float(value))
    return steps


def ms_values(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"


def burst(client: httpx.Client, server: Server, count: int, memory: str) -> tuple[float, list[float]]:
    """``count`` claims at once from a full pool of ``count``: until the last answered, and each."""
    make_pool(client, server, count, memory, BURST_SHAPE)
    wait_pool(client, server.name, count)
    times: list[float] = [0.0] * count
    failed: list[BaseException] = []
    start = threading.Barrier(count + 1)

    def one(i: int) -> None:
        with httpx.Client(base_url=str(client.base_url), headers=client.headers, timeout=60) as own:
            start.wait()
            try:
                times[i] = claim_once(own, server, f"burst-{i}")[1]
            except BaseException as err:  # noqa: BLE001 - reported below, with the figures
                failed.append(err)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    began = time.perf_counter()
    start.wait()
    for t in threads:
        t.join()
    total = time.perf_counter() - began
    for i in range(count):
        client.delete(f"/v1/slots/burst-{i}")
    if failed:
        raise SystemExit(f"{len(failed)} of {count} claims of the burst failed: {failed[0]}")
    return total, times


def load(url: str, body: dict[str, Any], rate: float, seconds: float) -> list[float]:
    """Latencies of inferences sent at ``rate`` per second for ``seconds`` (open loop, one client)."""
    latencies: list[float] = []
    interval = 1.0 / rate
    with realtime():
        _send(url, body, interval, seconds, latencies)
    return latencies


@contextlib.contextmanager
def realtime() -> Iterator[None]:
    """The calling thread under SCHED_FIFO for the block: the load generator stands for a client on
    another machine, so the refill's work on the shared CPU (where this bench has to run on a small
    host) must not delay the client itself; what is left is what the refill does to the neighbour."""
    before = os.sched_getscheduler(0), os.sched_getparam(0)
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    try:
        yield
    finally:
        os.sched_setscheduler(0, before[0], before[1])


def _send(url: str, body: dict[str, Any], interval: float, seconds: float, latencies: list[float]) -> None:
    # A connection per request: the example worker writes its headers and body apart, which on a
    # kept-alive connection meets the client's delayed ACK (40 ms stalls that would hide the rest).
    with httpx.Client(timeout=5.0, limits=httpx.Limits(max_keepalive_connections=0)) as sender:
        start = time.perf_counter()
        n = 0
        while (now := time.perf_counter()) - start < seconds:
            due = start + n * interval
            if now < due:
                time.sleep(due - now)
            t = time.perf_counter()
            sender.post(url, json=body)
            latencies.append(time.perf_counter() - t)
            n += 1


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def neighbour(
    client: httpx.Client,
    server: Server,
    neighbour_server: Server,
    *,
    count: int,
    memory: str,
    rate: float,
    seconds: float,
    rounds: int,
) -> list[dict[str, list[float]]]:
    """``rounds`` rounds, each a load phase with the pool full and idle, then one while it refills
    ``count`` standbys from empty: the neighbour's latencies of each phase of each round."""
    answer = client.post("/v1/slots", json=request_of(neighbour_server, "neighbour", "256Mi"))
    answer.raise_for_status()
    url = infer_url(answer.json())
    body = body_of(neighbour_server)
    first_answer(url, body, time.perf_counter())
    found: list[dict[str, list[float]]] = []
    try:
        make_pool(client, server, count, memory, BURST_SHAPE)
        for n in range(rounds):
            wait_pool(client, server.name, count)
            quiet = load(url, body, rate, seconds)
            client.patch(f"/v1/pools/{server.name}", json={"size": 0})
            deadline = time.monotonic() + 30
            while client.get(f"/v1/pools/{server.name}").json()["standbys"] and time.monotonic() < deadline:
                time.sleep(0.1)
            client.patch(f"/v1/pools/{server.name}", json={"size": count})  # the refill starts now
            refilling = load(url, body, rate, seconds)
            ready = client.get(f"/v1/pools/{server.name}").json()["ready"]
            found.append({"pool full, idle": quiet, "pool refilling": refilling})
            print(
                f"neighbour {n + 1}/{rounds}: p99 {pct(quiet, 0.99):.2f} ms idle, "
                f"{pct(refilling, 0.99):.2f} ms refilling ({ready} of {count} ready after {seconds:g}s)",
                flush=True,
            )
        return found
    finally:
        client.delete("/v1/slots/neighbour")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default="oip,mlserver", help=f"comma-separated: {', '.join(KINDS)}")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--burst", type=int, default=8)
    parser.add_argument("--rate", type=float, default=100.0, help="the neighbour's load, requests/s")
    parser.add_argument("--seconds", type=float, default=10.0, help="each load phase")
    parser.add_argument("--neighbour-rounds", type=int, default=5, help="rounds of idle then refilling")
    parser.add_argument("--memory", default="512Mi", help="each slot's memory (the pool's shape)")
    parser.add_argument(
        "--host-partitioning",
        choices=("off", "auto"),
        default="auto",
        help="auto (a real agent's default): the rest of the host (this load generator, the agent, the "
        "refill's work before a standby enters its cgroup) is kept off the neighbour's exclusive CPU; it "
        "changes the whole host for the bench's length and puts it back at the end",
    )
    parser.add_argument(
        "--keep-venvs", type=Path, default=None, help="the installs in (and kept in) DIR/<server>"
    )
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the bench creates cgroups")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped bench still cleans up
    kinds = [k for k in args.servers.split(",") if k]
    if set(kinds) - set(KINDS):
        raise SystemExit(f"unknown servers {sorted(set(kinds) - set(KINDS))}; known: {', '.join(KINDS)}")
    keep = args.keep_venvs.resolve() if args.keep_venvs else None
    work = Path(tempfile.mkdtemp(prefix=f"natest{os.getpid()}-elastic-"))
    first_port = 30000 + (os.getpid() % 20) * 100
    needed = sorted({*kinds, "oip"}, key=KINDS.index)
    with installed(needed, keep) as (installs, workers):
        config = config_text(first_port)
        # Info: each claim's "standby taken" record has its steps' times (printed at the end).
        config = config.replace('level = "warning"', 'level = "info"')
        if args.host_partitioning == "auto":
            config = config.replace('host_partitioning = "off"', 'host_partitioning = "auto"')
        daemon = DaemonProcess(work, config)
        client = daemon.start()
        found = servers(installs, workers, 1.0)
        rows: dict[str, dict[str, list[float]]] = {}
        try:
            for kind in kinds:
                server = found[kind]
                make_pool(client, server, 1, args.memory)
                row = rows[kind] = {"pool alloc": [], "pool": [], "cold alloc": [], "cold": []}
                for n in range(args.runs):
                    wait_pool(client, kind, 1)
                    allocated, answered = claim_once(client, server, f"{kind}-p{n}")
                    row["pool alloc"].append(allocated)
                    row["pool"].append(answered)
                    client.delete(f"/v1/slots/{kind}-p{n}")
                    allocated, answered = cold_once(client, server, f"{kind}-c{n}", args.memory)
                    row["cold alloc"].append(allocated)
                    row["cold"].append(answered)
                    client.delete(f"/v1/slots/{kind}-c{n}")
                    print(
                        f"{kind} {n + 1}/{args.runs}: pool {row['pool'][-1] * 1000:.1f} ms, "
                        f"cold {row['cold'][-1] * 1000:.1f} ms",
                        flush=True,
                    )
                client.delete(f"/v1/pools/{kind}")
            steps = claim_steps(daemon.log_path)
            first = found[kinds[0]]
            total, each = 0.0, []
            if args.burst > 0:
                total, each = burst(client, first, args.burst, args.memory)
                client.delete(f"/v1/pools/{first.name}")
            phases = []
            if args.burst > 0 and args.neighbour_rounds > 0:
                phases = neighbour(
                    client,
                    first,
                    found["oip"],
                    count=args.burst,
                    memory=args.memory,
                    rate=args.rate,
                    seconds=args.seconds,
                    rounds=args.neighbour_rounds,
                )
                client.delete(f"/v1/pools/{first.name}")
        finally:
            client.close()
            daemon.stop()
            remove_bench_objects(daemon.state)
            shutil.rmtree(work, ignore_errors=True)
    print()
    print("allocate -> first inference answered, ms: median [min-max]")
    heads = ("pool: allocate", "pool: answered", "cold: allocate", "cold: answered")
    print(f"{'server':10} " + " ".join(f"{h:>22}" for h in heads) + f" {'cold/pool':>9}")
    for kind, row in rows.items():
        ratio = statistics.median(row["cold"]) / statistics.median(row["pool"])
        print(
            f"{kind:10} {ms(row['pool alloc']):>22} {ms(row['pool']):>22} {ms(row['cold alloc']):>22} "
            f"{ms(row['cold']):>22} {ratio:>8.1f}x"
        )
    if steps:
        print("\nwhere a claim's time goes in the agent ('standby taken' records), ms: median [min-max]")
        for step, values in steps.items():
            print(f"  {step:10} {ms_values(values)}")
    if not each:
        return
    print(
        f"\nburst of {args.burst} claims from a pool of {args.burst} ({kinds[0]}): all answered in "
        f"{total * 1000:.0f} ms (each: median {statistics.median(each) * 1000:.0f} ms, "
        f"max {max(each) * 1000:.0f} ms)"
    )
    print(
        f"\nguaranteed neighbour at {args.rate:g} req/s, {args.seconds:g}s a phase, {len(phases)} rounds: "
        "median over rounds [min-max]"
    )
    if not phases:
        return
    for phase in ("pool full, idle", "pool refilling"):
        p50s = [pct(r[phase], 0.5) for r in phases]
        p99s = [pct(r[phase], 0.99) for r in phases]
        print(
            f"  {phase:18} p50 {statistics.median(p50s):6.2f} ms  p99 {statistics.median(p99s):6.2f} ms "
            f"[{min(p99s):.2f}-{max(p99s):.2f}]"
        )
    ratios = [pct(r["pool refilling"], 0.99) / pct(r["pool full, idle"], 0.99) for r in phases]
    print(
        f"  p99 refilling / idle, each round: median {statistics.median(ratios):.2f}x "
        f"[{min(ratios):.2f}-{max(ratios):.2f}]"
    )


if __name__ == "__main__":
    main()
