"""CPU/NUMA discovery time on this host's /sys and on a generated 384-CPU tree.

    .venv/bin/python bench/discovery.py [--runs N]

Prints median and p90 in ms over N runs of ``discover_cpu_topology`` (the part of discovery that
walks sysfs; GPUs and FPGAs have their own costs) and the ratio to the 50 ms target. The fake tree
sits on tmpfs-like storage, so it measures Python's share; the kernel's sysfs reads add to it on a
real host.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `tests` is a package of the repo

from nodeagent.devices.cpu import discover_cpu_topology
from nodeagent.kernelfs import Sysfs
from tests.devices.sysfs_trees import large_384
from tests.trees import write_tree

TARGET_MS = 50.0


def measure(fn: Callable[[], object], runs: int) -> tuple[float, float]:
    fn()  # warm the page cache and the imports
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(len(times) * 0.9))]


def report(label: str, cpus: int, median: float, p90: float) -> None:
    print(
        f"{label:<28} {cpus:>4} CPUs  median {median:7.2f} ms  p90 {p90:7.2f} ms  "
        f"median/target {median / TARGET_MS:5.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()

    host = Sysfs(Path("/sys"))
    cpus = len(discover_cpu_topology(host).cpus)
    report("this host /sys", cpus, *measure(lambda: discover_cpu_topology(host), args.runs))

    with tempfile.TemporaryDirectory(prefix="natest-bench-") as tmp:
        root = write_tree(Path(tmp) / "sys", large_384())
        fake = Sysfs(root)
        proc = Path(tmp)
        cpus = len(discover_cpu_topology(fake, proc_root=proc).cpus)
        report(
            "large_384 fixture tree",
            cpus,
            *measure(lambda: discover_cpu_topology(fake, proc_root=proc), args.runs),
        )
    print(f"target: under {TARGET_MS:.0f} ms each (ratio < 1)")


if __name__ == "__main__":
    main()
