"""Time from a launch request to the worker's exec inside an isolated cgroup v1 slot.

Side by side in one run (run as root on a cgroup v1 or hybrid host):
  spawner          nodeagent's path: agent -> spawner -> pre-forked keeper -> pre-forked child,
                   which joins the slot (cpuset, memory, pids) and execs; timed until the agent
                   has the reply, i.e. after exec succeeded
  popen-preexec    subprocess.Popen(preexec_fn=join the slot): the by-hand baseline (forces fork)
  popen-plain      subprocess.Popen with no cgroup at all: the floor

Each is measured back to back ("warm") and with a pause before each launch ("spaced"), because a
cgroup migration after some tens of ms without one waits for an RCU grace period (the cold-join
penalty); cgroup_favordynmods removes it host-wide. The worker is /bin/true; the slot exists
before the clock starts, as it does when a worker is launched into an allocated slot.

crun is not driven from here; to compare, install it (``apt-get install -y crun``) and time
``crun run`` of the same command with a cpuset/memory/pids config (on a hybrid host it needs a
private mount namespace with /sys/fs/cgroup/unified unmounted).

    python bench/launch.py [--runs 200] [--gap-ms 50]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from nodeagent.runtime.request import LaunchRequest
from nodeagent.runtime.spawner import Spawner

ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("cpuset", "memory", "pids")


def make_slot(name: str) -> list[Path]:
    dirs = [ROOT / ctrl / name for ctrl in CONTROLLERS]
    for path in dirs:
        path.mkdir()
    (dirs[0] / "cpuset.cpus").write_text((ROOT / "cpuset" / "cpuset.cpus").read_text())
    (dirs[0] / "cpuset.mems").write_text((ROOT / "cpuset" / "cpuset.mems").read_text())
    (dirs[1] / "memory.limit_in_bytes").write_text(str(256 << 20))
    (dirs[2] / "pids.max").write_text("64")
    return dirs


def remove_slot(dirs: list[Path]) -> None:
    for path in dirs:
        for _ in range(200):
            try:
                path.rmdir()
                break
            except OSError:
                time.sleep(0.01)


def measure(
    launch: Callable[[list[str]], subprocess.Popen[bytes] | None], runs: int, gap: float, tag: str
) -> list[float]:
    times = []
    for index in range(runs):
        name = f"natest{os.getpid()}-{tag}-{index}"
        dirs = make_slot(name)
        procs = [str(path / "cgroup.procs") for path in dirs]
        if gap:
            time.sleep(gap)
        started = time.perf_counter()
        child = launch(procs)
        times.append((time.perf_counter() - started) * 1000)
        if child is not None:
            child.wait()  # Popen returns once exec succeeded; reaping is not part of the launch
        time.sleep(0.005)  # let /bin/true finish so the slot can be removed
        remove_slot(dirs)
    return times


def summary(times: list[float]) -> str:
    ordered = sorted(times)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return f"median {statistics.median(ordered):6.2f} ms   p99 {p99:6.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--gap-ms", type=float, default=50.0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="natest-bench-"))
    spawner = Spawner()
    spawner.start()

    def ours(procs: list[str]) -> None:
        spawner.launch(
            LaunchRequest(
                launch_id="bench",
                argv=("/bin/true",),
                env={"PATH": "/usr/bin:/bin"},
                run_dir=str(work / "run"),
                log_dir=str(work / "logs"),
                cgroup_procs=tuple(procs),
            )
        )

    def preexec(procs: list[str]) -> subprocess.Popen[bytes]:
        def join() -> None:
            for path in procs:
                with open(path, "w") as handle:
                    handle.write("0")

        return subprocess.Popen(["/bin/true"], preexec_fn=join)  # noqa: PLW1509 - the baseline on purpose

    def plain(procs: list[str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(["/bin/true"])

    rss = Path("/proc/self/status").read_text().split("VmRSS:")[1].split("\n")[0].strip()
    print(
        f"launch -> exec of /bin/true, {args.runs} runs each, agent RSS {rss}, load {os.getloadavg()[0]:.2f}"
    )
    try:
        for label, gap in (("warm", 0.0), (f"spaced {args.gap_ms:g} ms", args.gap_ms / 1000)):
            for name, launch in (("spawner", ours), ("popen-preexec", preexec), ("popen-plain", plain)):
                print(
                    f"  {label:>14}  {name:<14} {summary(measure(launch, args.runs, gap, name))}", flush=True
                )
    finally:
        spawner.close()


if __name__ == "__main__":
    main()
