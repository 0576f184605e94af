"""What placing containers through the agent costs containerd (issue 22 item 6), side by side in one
run: a container created and started in a pod sandbox by crictl, as the kubelet does it, with the
NRI shim registered (every CreateContainer asks the agent, which allocates the container's slot;
every StopContainer/RemoveContainer releases it) and without it (containerd alone), alternating.

Run as root (it starts containerd and a test agent, and creates cgroups), from the repository with
its .venv: ``kube/build`` and ``kube/build-nri-shim`` give the binaries (cached; a cold build takes
about ten minutes), ``kube/cluster containerd`` starts containerd alone (its own root, state and
sockets under ``--work``), and everything is stopped and removed at the end (``kube/cluster stop``,
the agent's ``uninstall --release-slots``).

Each round, per mode: ``crictl create`` (the NRI CreateContainer hook runs inside it), ``crictl
start``, then ``crictl stop`` + ``rm``. The container asks for one whole CPU and 64 MiB (a
Guaranteed container: the agent gives it an exclusive core); a burstable one (0.25 CPU) is timed
too. The figure is the median added by the agent per container (create with the shim minus create
without), and the create + start total. Target: the agent adds at most 20 ms at the median.

    python bench/kube.py [--rounds 15] [--work /tmp/nodeagent-kube-bench]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.kube.nri_e2e import (
    Crictl,
    clean_up,
    container_config,
    nri_agent,
    nri_slots,
    pod_config,
    start_shim,
)

REPO = Path(__file__).resolve().parent.parent
PARENT = f"natestkb{os.getpid()}.slice"
#: (label, CFS quota per 100 ms period, memory): what each container asks for.
SHAPES = (("guaranteed 1 CPU", 100_000, 64 << 20), ("burstable 0.25 CPU", 25_000, 64 << 20))


def tool(name: str, env: dict[str, str]) -> Path:
    done = subprocess.run([str(REPO / "kube" / name)], capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"kube/{name} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def one(cri: Crictl, pod: tuple[str, str], name: str, shape: tuple[int, int]) -> tuple[float, float]:
    """Create, start, stop and remove one container in ``pod`` (its id and config file) asking for
    ``shape`` (CFS quota, memory): (create seconds, create + start seconds)."""
    pod_id, pod_json = pod
    body = cri.write(name, container_config(name, *shape))
    began = time.perf_counter()
    ctr = cri.run("create", pod_id, body, pod_json).stdout.strip()
    created = time.perf_counter()
    cri.run("start", ctr)
    started = time.perf_counter()
    cri.run("stop", "--timeout", "0", ctr)
    cri.run("rm", ctr)
    return created - began, started - began


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:7.1f} [{min(values) * 1000:.1f}-{max(values) * 1000:.1f}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--work", type=Path, default=Path("/tmp/nodeagent-kube-bench"))
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the bench starts containerd and creates cgroups")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped bench still cleans up
    env = {**os.environ, "NODEAGENT_KUBE_WORK": str(args.work)}
    binaries = tool("build", env)
    shim_binary = tool("build-nri-shim", env)
    agent_dir = Path(tempfile.mkdtemp(prefix="kube-bench-agent-"))
    daemon = nri_agent(agent_dir, "kb", PARENT)
    shim_args = argparse.Namespace(shim=shim_binary, work=args.work, procs=[])
    cri = Crictl(binaries / "crictl", args.work)
    pods: list[str] = []
    subprocess.run([str(REPO / "kube" / "cluster"), "containerd"], env=env, check=True, capture_output=True)
    times: dict[tuple[str, str], list[float]] = {}
    try:
        client = daemon.start(timeout=180)
        pod_json = cri.write("pod", pod_config(args.work, f"kubebench{os.getpid()}"))
        pod = cri.run("runp", pod_json).stdout.strip()
        pods.append(pod)
        shim = None
        for n in range(args.rounds + 1):  # round 0 warms both paths (image unpacked, caches)
            for mode in ("without", "with") if n % 2 else ("with", "without"):
                if mode == "with" and shim is None:
                    shim = start_shim(shim_args, daemon, agent_dir / "shim.log")
                elif mode == "without" and shim is not None:
                    shim.terminate()
                    shim.wait(timeout=10)
                    shim = None
                for label, quota, memory in SHAPES:
                    created, total = one(cri, (pod, pod_json), f"b{n}{mode[0]}{quota}", (quota, memory))
                    if n > 0:
                        times.setdefault((label, mode), []).append(created)
                        times.setdefault((label, mode + " total"), []).append(total)
            if nri_slots(client):
                raise SystemExit(f"slots left after round {n}: {nri_slots(client)}")
        if shim is not None:
            shim.terminate()
            shim.wait(timeout=10)
    finally:
        # The e2e suite's clean-up: pods, the shim, the agent and its keeper, uninstall --release-slots.
        clean_up(argparse.Namespace(pods=pods, procs=shim_args.procs), daemon, cri, tell=lambda _: None)
        subprocess.run([str(REPO / "kube" / "cluster"), "stop"], env=env, capture_output=True, check=False)
        shutil.rmtree(agent_dir, ignore_errors=True)
    print(f"\ncontainers created (crictl create; NRI's CreateContainer inside) in {args.rounds} rounds, ms:")
    print(f"{'container':20} {'without the shim':>24} {'with the shim':>24} {'added (median)':>15}")
    for label, _, _ in SHAPES:
        without, with_ = times[(label, "without")], times[(label, "with")]
        added = (statistics.median(with_) - statistics.median(without)) * 1000
        print(f"{label:20} {ms(without):>24} {ms(with_):>24} {added:>13.1f} ms")
    print("\ncreate + start, ms:")
    for label, _, _ in SHAPES:
        print(f"{label:20} {ms(times[(label, 'without total')]):>24} {ms(times[(label, 'with total')]):>24}")
    print("(target, issue 22: the agent adds <= 20 ms per container at the median)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
