"""Container workers: from an allocate request to a container that answers its readiness probe,
next to ``podman run`` of the same image with the same flags by hand, interleaved run by run.

  agent      POST /v1/slots (a guaranteed slot, 1 CPU, 256 MiB, with worker.container running
             busybox httpd and an HTTP readiness probe every 20 ms) until GET /v1/slots/NAME says
             the worker is running: placement, the slot's cgroups, its CDI spec, the keeper's
             launch of ``podman run`` into the slot, podman and runc, the first passing probe, and
             the API's view of it. The slot is released after each run (not timed).
  by-hand    ``podman run`` with the same flags as the agent's (runtime/container.py: cgroupfs,
             runc, --cgroup-parent, the CDI device of a slot the agent holds, --init, the same
             user, capabilities and limits), started from this process, until the server answers
             the same HTTP request polled every 20 ms; then stopped (not timed). On every CPU.
  by-hand-1cpu  the same, podman (and so conmon, runc and the container) on one CPU, as in the
             agent's guaranteed slot of 1 CPU, where podman runs inside the slot.

The image is the tests' (tests/containers.py: a static busybox, imported offline). Run as root
on a host with podman, runc and catatonit:

    python bench/containers.py [--runs 15]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `tests` is a package of the repo

from nodeagent.agent.config import apply_overrides, parse_config
from nodeagent.agent.daemon import build_isolation
from nodeagent.cgroups import detect
from nodeagent.devices.discovery import discover
from nodeagent.isolation.backend import KernelIsolation
from nodeagent.runtime.container import PodmanConfig, container_name, init_path, run_argv
from nodeagent.runtime.sandbox.spec import SandboxSpec
from nodeagent.schema.worker import parse_worker_spec
from tests.containers import build_image, remove_image
from tests.daemon import DaemonProcess, free_port

PID = os.getpid()
ISOLATION = {
    "cgroup_parent": f"natest{PID}bc.slice",
    "netns_prefix": f"nb{PID}-",
    "firewall_table": f"natest{PID}bc",
    "host_partitioning": "off",
}
CDI = {"dir": "/var/run/cdi", "prefix": f"natest{PID}bc-"}
PROBE_PERIOD = 0.02


def worker(image: str, port: int) -> dict[str, object]:
    return {
        "container": {"image": image, "command": ["/bin/httpd", "-f", "-p", str(port), "-h", "/www"]},
        "readiness": {"http": {"port": port, "path": "/ready"}, "period_seconds": PROBE_PERIOD},
    }


def agent_run(client: httpx.Client, image: str, name: str) -> float:
    request = {
        "name": name,
        "qos": "guaranteed",
        "resources": {"cpus": 1, "memory": "256Mi"},
        "worker": worker(image, free_port()),
    }
    began = time.perf_counter()
    created = client.post("/v1/slots", json=request)
    assert created.status_code == 201, created.text
    while (client.get(f"/v1/slots/{name}").json().get("worker") or {}).get("phase") != "running":
        time.sleep(0.005)
    took = time.perf_counter() - began
    assert client.delete(f"/v1/slots/{name}").status_code == 204
    return took


def by_hand(argv: list[str], port: int, cpus: set[int] | None = None) -> float:
    began = time.perf_counter()
    process = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=None if cpus is None else (lambda: os.sched_setaffinity(0, cpus)),  # noqa: PLW1509
    )
    try:
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if process.poll() is not None:
                raise RuntimeError(
                    f"podman run exited: {process.stderr.read().decode() if process.stderr else ''}"
                )
            time.sleep(PROBE_PERIOD)
        return time.perf_counter() - began
    finally:
        process.terminate()
        process.wait(timeout=60)


def summary(name: str, values: list[float]) -> str:
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    median = statistics.median(values) * 1000
    return f"{name:13s} median {median:7.1f} ms   p90 {p90 * 1000:7.1f} ms   n={len(values)}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    image = build_image(f"localhost/natest-busybox:bench{PID}")
    work = Path(f"/tmp/nodeagent-bench-containers-{PID}")
    toml = (
        "[isolation]\n"
        + "".join(f'{k} = "{v}"\n' for k, v in ISOLATION.items())
        + f'[cdi]\ndir = "{CDI["dir"]}"\nprefix = "{CDI["prefix"]}"\n[sandbox]\n'
    )
    daemon = DaemonProcess(work, toml)
    client = daemon.start()
    try:
        # A slot the agent holds, whose CDI device the by-hand runs use (no worker of its own).
        holder = client.post(
            "/v1/slots",
            json={"name": "holder", "qos": "burstable", "resources": {"cpus": 0.1, "memory": "64Mi"}},
        )
        assert holder.status_code == 201, holder.text
        holder_id = holder.json()["id"]
        config = PodmanConfig(runtime="runc")
        times: dict[str, list[float]] = {"agent": [], "by-hand": [], "by-hand-1cpu": []}
        one_cpu = {max(os.sched_getaffinity(0))}
        for i in range(args.runs + 1):  # the first pair warms caches and is not counted
            port = free_port()
            spec = parse_worker_spec(worker(image, port))
            assert spec.container is not None
            argv = list(
                run_argv(
                    "podman",
                    config,
                    spec,
                    spec.container,
                    slot_id=holder_id,
                    cgroup=f"natest{PID}bh",
                    sandbox=SandboxSpec(uid=600999, gid=600999),
                    init=init_path(),
                )
            )
            argv[argv.index(f"--name={container_name(holder_id)}")] = f"--name=natest{PID}-hand"
            order = list(times)
            order = order[i % 3 :] + order[: i % 3]  # rotate who goes first
            for who in order:
                if who == "agent":
                    took = agent_run(client, image, f"bench{i}")
                else:
                    took = by_hand(argv, port, one_cpu if who == "by-hand-1cpu" else None)
                if i:
                    times[who].append(took)
        for who, values in times.items():
            print(summary(who, values))
        agent = statistics.median(times["agent"])
        for who in ("by-hand", "by-hand-1cpu"):
            print(f"ratio agent / {who} (medians): {agent / statistics.median(times[who]):.2f}")
    finally:
        client.close()
        daemon.stop()
        daemon.stop_keeper()
        cfg = apply_overrides(parse_config({"isolation": ISOLATION, "cdi": CDI}), state_dir=daemon.state)
        kernel = build_isolation(cfg, discover(gpus=False, fpgas=False), detect())
        if isinstance(kernel, KernelIsolation):
            kernel.isolator.remove_all()
        for spec_file in Path(CDI["dir"]).glob(f"{CDI['prefix']}*.json"):
            spec_file.unlink()
        subprocess.run(
            ["podman", "rm", "-f", "--ignore", f"natest{PID}-hand"], capture_output=True, check=False
        )
        for controller in Path("/sys/fs/cgroup").iterdir():
            hand = controller / f"natest{PID}bh"
            if hand.is_dir():
                for sub in sorted(hand.rglob("*"), reverse=True):
                    if sub.is_dir():
                        sub.rmdir()
                hand.rmdir()
        remove_image(image)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
