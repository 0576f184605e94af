"""Tail latency of a CPU-bound inference loop next to noisy neighbours: alone, unprotected, isolated.

Run as root: ``python bench/isolation.py [--requests 1000] [--rounds 3] [--neighbours 3]``.

The loop is one single-threaded process serving requests of ~3 ms of pure-Python compute with
~2 ms gaps (a small model's forward pass between arrivals). Three scenarios, interleaved in rounds
because a shared VM drifts:

- ``alone``: the loop with nothing else of ours running;
- ``no isolation``: the loop and ``--neighbours`` CPU-bound busy loops, all free to run anywhere;
- ``isolated``: the loop in a guaranteed slot (one exclusive CPU) and the neighbours in a
  burstable slot, which the shared pool keeps off that CPU (SlotIsolator, cgroup cpusets);
- ``host noise``: the loop in the guaranteed slot and the neighbours started outside every slot, as
  system daemons, sessions and cron jobs are: a cpuset keeps only the agent's own slots away;
- ``host partitioned``: the same, with host partitioning (nodeagent.isolation.host) confining every
  task outside the slots, kernel threads, the workqueue mask and interrupts to the other CPUs for
  the length of the scenario, then putting them back;
- ``alone partitioned``: the loop in its slot, no neighbours, the host partitioned: on a machine
  whose other users load it, ``alone`` has their noise too, and this is the baseline without it.

``--host-scope all`` (the default) partitions the whole host, as the agent does: on a shared machine
every other process runs on the remaining CPUs for the few seconds of that scenario, and everything
is put back afterwards (also on Ctrl-C or SIGTERM; the record in a temporary state directory names
what was changed). ``--host-scope bench`` confines only the bench's own neighbours.

For the host scenarios the foreign CPU time on the slot's CPU (time spent there by anything but the
loop, interrupts included) is measured from /proc/stat and the slot's cgroup, as a share of the run.

The slot's CPU defaults to the one that has served the fewest device interrupts (``/proc/interrupts``):
an interrupt handler preempts whatever runs on its CPU, and exclusivity cannot keep it away.
Prints p50/p99/p99.9 in ms per scenario (median over rounds) and p99 as a multiple of ``alone``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from nodeagent.cgroups import detect, open_manager
from nodeagent.isolation.foreign import ForeignCpuMeter
from nodeagent.isolation.host import PARTS, HostPartitioner
from nodeagent.isolation.isolator import AppliedSlot, SlotIsolator
from nodeagent.isolation.network import SlotNetworkConfig
from nodeagent.isolation.partitioning import host_partitioner
from nodeagent.isolation.slot_spec import IsolatorConfig, SlotIsolationSpec

MiB = 1 << 20
SCENARIOS = ("alone", "no isolation", "isolated", "host noise", "host partitioned", "alone partitioned")
HOST_SCENARIOS = ("host noise", "host partitioned", "alone partitioned")
PARTITIONED = ("host partitioned", "alone partitioned")

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


@contextlib.contextmanager
def partitioned(partitioner: HostPartitioner | None, cpu: int) -> Iterator[None]:
    """The host confined off ``cpu`` for the block, put back afterwards whatever happens."""
    if partitioner is None:
        yield
        return
    report = partitioner.apply(frozenset({cpu}))
    try:
        yield
    finally:
        partitioner.restore()
        moved = report.moved
        print(f"  host partitioned: moved {moved}, {len(report.immovable)} cannot move", file=sys.stderr)


def run_scenario(
    scenario: str,
    work: int,
    args: argparse.Namespace,
    *,
    loop_slot: AppliedSlot | None,
    busy_slot: AppliedSlot | None,
    host: HostPartitioner | None,
) -> tuple[list[float], float | None]:
    """The loop's latencies in ms, and for the host scenarios the foreign share of its CPU."""
    neighbours: list[subprocess.Popen[str]] = []
    try:
        if scenario not in ("alone", "alone partitioned"):
            for _ in range(args.neighbours):
                busy, release = start_paused("import os, sys\nos.read(int(sys.argv[-1]), 1)\n" + BUSY, [])
                neighbours.append(busy)
                join(busy_slot if scenario == "isolated" else None, busy.pid)
                os.write(release, b"x")
                os.close(release)
            time.sleep(0.3)  # let the scheduler settle with the neighbours running
        in_slot = scenario in ("isolated", *HOST_SCENARIOS)
        with partitioned(host if scenario in PARTITIONED else None, args.slot_cpu):
            loop, release = start_paused(LOOP, [str(work), str(args.requests), str(args.gap_ms / 1000)])
            join(loop_slot if in_slot else None, loop.pid)
            meter = ForeignCpuMeter(cache_seconds=0)
            if scenario in HOST_SCENARIOS and loop_slot is not None:
                meter.measure("loop", frozenset({args.slot_cpu}), slot_usage(loop_slot))
            os.write(release, b"x")
            os.close(release)
            out, _ = loop.communicate(timeout=args.requests * 0.2 + 60)
            foreign = None
            if scenario in HOST_SCENARIOS and loop_slot is not None:
                foreign = meter.measure("loop", frozenset({args.slot_cpu}), slot_usage(loop_slot)).fraction
        return [s * 1000 for s in json.loads(out)], foreign
    finally:
        for busy in neighbours:
            busy.kill()  # our own children, by pid
            busy.wait()


def slot_usage(slot: AppliedSlot) -> int:
    usage = open_manager(detect(), slot.cgroup).stats().cpu_usage_ns
    return usage or 0


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
    parser.add_argument(
        "--host-scope",
        choices=("all", "bench"),
        default="all",
        help="host partitioned: confine the whole host (as the agent does) or the bench's neighbours only",
    )
    args = parser.parse_args()

    online = sorted(os.sched_getaffinity(0))
    if len(online) < 2:
        sys.exit("needs at least two CPUs: one for the guaranteed slot, one for the shared pool")
    slot_cpu, irqs = quietest_cpu(online)
    args.slot_cpu = args.slot_cpu if args.slot_cpu is not None else slot_cpu
    work = calibrate(args.work_ms)
    print(f"CPUs {online}; device interrupts per CPU since boot {irqs}; slot on CPU {args.slot_cpu}")
    print(
        f"{args.requests} requests of ~{args.work_ms} ms ({work} iterations) with {args.gap_ms} ms gaps; "
        f"{args.neighbours} busy neighbours; {args.rounds} interleaved rounds; host scope {args.host_scope}"
    )

    # Names of its own for everything remove_all() takes down: a running agent's slots, veths,
    # netns and firewall table are never the benchmark's to remove.
    tag = f"nabench{os.getpid() % 10000}"
    network = SlotNetworkConfig(netns_prefix=f"{tag}-", veth_prefix=tag, nft_table=f"{tag}-fw")
    parent = f"natestbench{os.getpid()}.slice"
    isolator = SlotIsolator(detect(), IsolatorConfig(cgroup_parent=parent, network=network))
    results: dict[str, list[list[float]]] = {s: [] for s in SCENARIOS}
    foreign: dict[str, list[float]] = {s: [] for s in HOST_SCENARIOS}
    state = Path(tempfile.mkdtemp(prefix="nodeagent-bench-"))
    bench_pid = os.getpid()
    whole = args.host_scope == "all"
    host = host_partitioner(
        detect(),
        state_dir=state,
        cgroup_parent=parent,
        # The bench's own scope moves only its neighbours: no kernel thread, interrupt or workqueue.
        parts=PARTS if whole else ("processes",),
        only=None if whole else (lambda pid: _child_of(pid, bench_pid)),
    )
    # SIGTERM ends the bench through its finally blocks, which put the host back.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated"))
    try:
        loop_slot = isolator.apply(
            SlotIsolationSpec(
                "loop", "guaranteed", cpus=frozenset({args.slot_cpu}), exclusive=True, memory_bytes=512 * MiB
            )
        )
        busy_slot = isolator.apply(SlotIsolationSpec("noisy", "burstable", memory_bytes=512 * MiB))
        print(f"shared pool: CPUs {sorted(busy_slot.cpus)}")
        for round_no in range(args.rounds):
            for scenario in SCENARIOS:
                latencies, share = run_scenario(
                    scenario, work, args, loop_slot=loop_slot, busy_slot=busy_slot, host=host
                )
                results[scenario].append(latencies)
                if share is not None:
                    foreign[scenario].append(share)
            print(f"round {round_no + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        host.restore()
        isolator.remove_all()
        with contextlib.suppress(OSError):
            state.rmdir()
    report(results, foreign)


def _child_of(pid: int, ancestor: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return int(text.rpartition(")")[2].split()[1]) == ancestor


def report(results: dict[str, list[list[float]]], foreign: dict[str, list[float]]) -> None:
    alone_p99 = [percentile(r, 0.99) for r in results["alone"]]
    print(
        f"\n{'scenario':<18}{'p50':>8}{'p99':>8}{'p99.9':>8}   p99 / alone: median [min-max over rounds]"
        "   foreign CPU on the slot's CPU: median [min-max]"
    )
    for scenario, rounds in results.items():
        p50, p99, p999 = (statistics.median(percentile(r, q) for r in rounds) for q in (0.5, 0.99, 0.999))
        ratios = [percentile(r, 0.99) / a for r, a in zip(rounds, alone_p99, strict=True)]
        shares = foreign.get(scenario) or []
        share = (
            f"   {statistics.median(shares):.2%} [{min(shares):.2%}-{max(shares):.2%}]" if shares else ""
        )
        print(
            f"{scenario:<18}{p50:>8.2f}{p99:>8.2f}{p999:>8.2f}   "
            f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]{share}"
        )
    base = [percentile(r, 0.99) for r in results["alone partitioned"]]
    noisy = [percentile(r, 0.99) / b for r, b in zip(results["host partitioned"], base, strict=True)]
    print(
        f"\nhost partitioned / alone partitioned (p99, same round): {statistics.median(noisy):.2f}x "
        f"[{min(noisy):.2f}-{max(noisy):.2f}]"
    )


if __name__ == "__main__":
    main()
