"""Tail latency of a CPU-bound inference loop next to noisy neighbours: alone, unprotected, isolated.

Run as root: ``python bench/isolation.py [--requests 1000] [--rounds 3] [--neighbours 3]``.

The loop is one single-threaded process serving requests of ~3 ms of pure-Python compute with
~2 ms gaps (a small model's forward pass between arrivals). Three scenarios, interleaved in rounds
because a shared VM drifts:

- ``alone``: the loop with nothing else of ours running;
- ``no isolation``: the loop and ``--neighbours`` CPU-bound busy loops, all free to run anywhere;
- ``isolated``: the loop in a guaranteed slot (one exclusive CPU) and the neighbours in a
  burstable slot, which the shared pool keeps off that CPU (SlotIsolator, cgroup cpusets).

The slot's CPU defaults to the one that has served the fewest device interrupts (``/proc/interrupts``):
an interrupt handler preempts whatever runs on its CPU, and exclusivity cannot keep it away.
Prints p50/p99/p99.9 in ms per scenario (median over rounds) and p99 as a multiple of ``alone``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from nodeagent.cgroups import detect
from nodeagent.isolation.network import SlotNetworkConfig
from nodeagent.isolation.slot import AppliedSlot, SlotIsolator
from nodeagent.isolation.spec import IsolationConfig, SlotIsolationSpec

MiB = 1 << 20
SCENARIOS = ("alone", "no isolation", "isolated")

# The loop waits for a byte on the fd in its last argument (so it can join a cgroup first), then serves.
LOOP = """
import json, os, sys, time
work, requests, gap = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
os.read(int(sys.argv[-1]), 1)
def infer():
    acc = 0
    for i in range(work):
        acc += i * i
    return acc
samples = []
for n in range(requests + 20):
    start = time.perf_counter()
    infer()
    samples.append(time.perf_counter() - start)
    time.sleep(gap)
print(json.dumps(samples[20:]))
"""
BUSY = "while True:\n    pass\n"


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def calibrate(target_ms: float) -> int:
    """Iterations of the loop's inner sum that take about ``target_ms`` on this machine."""
    code = (
        "import time\n"
        "def infer(work):\n    acc = 0\n    for i in range(work):\n        acc += i * i\n    return acc\n"
        "best = 1e9\n"
        "for _ in range(15):\n"
        "    t = time.perf_counter()\n    infer(200_000)\n    best = min(best, time.perf_counter() - t)\n"
        "print(best / 200_000)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    per_iteration = float(done.stdout)
    return max(1000, round(target_ms / 1000 / per_iteration))


def quietest_cpu(cpus: list[int]) -> tuple[int, dict[int, int]]:
    """The CPU that has handled the fewest device interrupts (numbered IRQ lines) since boot."""
    lines = Path("/proc/interrupts").read_text().splitlines()
    columns = [int(name.removeprefix("CPU")) for name in lines[0].split()]
    totals = dict.fromkeys(columns, 0)
    for line in lines[1:]:
        label, _, rest = line.partition(":")
        if not label.strip().isdigit():
            continue  # timer, IPIs and other per-CPU counters, not device interrupts
        for cpu, count in zip(columns, rest.split()[: len(columns)], strict=False):
            totals[cpu] += int(count) if count.isdigit() else 0
    return min(cpus, key=lambda c: totals.get(c, 0)), totals


def start_paused(code: str, args: list[str]) -> tuple[subprocess.Popen[str], int]:
    """Start ``code`` blocked on a pipe whose fd is its last argument; return it and the release fd."""
    read_fd, write_fd = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args, str(read_fd)],
        pass_fds=(read_fd,),
        stdout=subprocess.PIPE,
        text=True,
    )
    os.close(read_fd)
    return proc, write_fd


def join(slot: AppliedSlot | None, pid: int) -> None:
    if slot is not None:
        for procs in slot.procs_files:
            Path(procs).write_text(str(pid))


def run_scenario(
    scenario: str,
    work: int,
    args: argparse.Namespace,
    loop_slot: AppliedSlot | None,
    busy_slot: AppliedSlot | None,
) -> list[float]:
    neighbours: list[subprocess.Popen[str]] = []
    try:
        if scenario != "alone":
            for _ in range(args.neighbours):
                busy, release = start_paused("import os, sys\nos.read(int(sys.argv[-1]), 1)\n" + BUSY, [])
                neighbours.append(busy)
                join(busy_slot if scenario == "isolated" else None, busy.pid)
                os.write(release, b"x")
                os.close(release)
            time.sleep(0.3)  # let the scheduler settle with the neighbours running
        loop, release = start_paused(LOOP, [str(work), str(args.requests), str(args.gap_ms / 1000)])
        join(loop_slot if scenario == "isolated" else None, loop.pid)
        os.write(release, b"x")
        os.close(release)
        out, _ = loop.communicate(timeout=args.requests * 0.2 + 60)
        return [s * 1000 for s in json.loads(out)]
    finally:
        for busy in neighbours:
            busy.kill()  # our own children, by pid
            busy.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000, help="measured requests per scenario and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--neighbours", type=int, default=3, help="CPU-bound busy loops")
    parser.add_argument("--work-ms", type=float, default=3.0, help="compute per request")
    parser.add_argument("--gap-ms", type=float, default=2.0, help="sleep between requests")
    parser.add_argument(
        "--slot-cpu", type=int, default=None, help="the guaranteed slot's CPU (default: quietest)"
    )
    args = parser.parse_args()

    online = sorted(os.sched_getaffinity(0))
    if len(online) < 2:
        sys.exit("needs at least two CPUs: one for the guaranteed slot, one for the shared pool")
    slot_cpu, irqs = quietest_cpu(online)
    slot_cpu = args.slot_cpu if args.slot_cpu is not None else slot_cpu
    work = calibrate(args.work_ms)
    print(f"CPUs {online}; device interrupts per CPU since boot {irqs}; guaranteed slot on CPU {slot_cpu}")
    print(f"{args.requests} requests of ~{args.work_ms} ms ({work} iterations) with {args.gap_ms} ms gaps; "
          f"{args.neighbours} busy neighbours; {args.rounds} interleaved rounds")  # fmt: skip

    # Names of its own for everything remove_all() takes down: a running agent's slots, veths,
    # netns and firewall table are never the benchmark's to remove.
    tag = f"nabench{os.getpid() % 10000}"
    network = SlotNetworkConfig(netns_prefix=f"{tag}-", veth_prefix=tag, nft_table=f"{tag}-fw")
    isolator = SlotIsolator(
        detect(), IsolationConfig(cgroup_parent=f"natestbench{os.getpid()}.slice", network=network)
    )
    results: dict[str, list[list[float]]] = {s: [] for s in SCENARIOS}
    try:
        loop_slot = isolator.apply(
            SlotIsolationSpec(
                "loop", "guaranteed", cpus=frozenset({slot_cpu}), exclusive=True, memory_bytes=512 * MiB
            )
        )
        busy_slot = isolator.apply(SlotIsolationSpec("noisy", "burstable", memory_bytes=512 * MiB))
        print(f"shared pool: CPUs {sorted(busy_slot.cpus)}")
        for round_no in range(args.rounds):
            for scenario in SCENARIOS:
                results[scenario].append(run_scenario(scenario, work, args, loop_slot, busy_slot))
            print(f"round {round_no + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        isolator.remove_all()
    report(results)


def report(results: dict[str, list[list[float]]]) -> None:
    alone_p99 = [percentile(r, 0.99) for r in results["alone"]]
    print(f"\n{'scenario':<14}{'p50':>8}{'p99':>8}{'p99.9':>8}   p99 / alone: median [min-max over rounds]")
    for scenario, rounds in results.items():
        p50, p99, p999 = (statistics.median(percentile(r, q) for r in rounds) for q in (0.5, 0.99, 0.999))
        ratios = [percentile(r, 0.99) / a for r, a in zip(rounds, alone_p99, strict=True)]
        print(
            f"{scenario:<14}{p50:>8.2f}{p99:>8.2f}{p999:>8.2f}   "
            f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"
        )


if __name__ == "__main__":
    main()
