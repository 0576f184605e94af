"""Placement speed and quality under allocate/release churn, on hosts of growing size.

Run: .venv/bin/python bench/placement.py [--decisions N] [--seed S] [--option KEY=VALUE ...]

For each host it replays the same seeded churn (random slot shapes, half the steps release a random
slot) through ``plan`` and through a naive first-fit baseline written here (lowest free whole cores,
no NUMA awareness, as a CPU manager without a topology policy would do). It prints the median and
p99 time per decision, decisions per second, the median as a multiple of the smallest host's (the
cost of a decision should not grow with the host), the median time of the ledger update that
follows each decision (``Allocated.add``/``remove``), how long ``count_fits`` takes to count the
4-CPU slots an empty host takes, and how often a slot that could have fitted on one NUMA node was
spread over several (what costs tail latency). ``--option`` passes placement options to ``plan`` and
``count_fits`` (``--option whole_cores=false`` times the thread-level choice); the naive baseline
ignores them.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nodeagent.devices.synthetic import synthetic_topology
from nodeagent.devices.topology import Topology
from nodeagent.errors import ConfigError, PlacementError
from nodeagent.placement import Allocated, Assignment, PlacementOptions, count_fits, placement_index, plan
from nodeagent.schema.request import SlotRequest, parse_slot_request

HOSTS = {
    "16 CPUs, 1 node": lambda: synthetic_topology(1, 1, 8, 2),
    "96 CPUs, 4 nodes, 4 GPUs": lambda: synthetic_topology(2, 2, 12, 2, gpus_per_numa=1),
    "384 CPUs, 24 nodes, 8 GPUs": lambda: synthetic_topology(
        4, 6, 8, 2, gpu_numa=[0, 3, 6, 9, 12, 15, 18, 21]
    ),
    "1024 CPUs, 32 nodes, 8 GPUs": lambda: synthetic_topology(
        4, 8, 16, 2, gpu_numa=[0, 4, 8, 12, 16, 20, 24, 28]
    ),
}


@dataclass
class Result:
    times: list[float]
    placed: int
    refused: int
    spans: int  #: slots spread over several nodes although one node had room when they were placed
    ledger_times: list[float] = field(default_factory=list)  #: Allocated.add / remove


def shapes(rng: random.Random, gpus: bool, count: int) -> list[tuple[bool, SlotRequest]]:
    out = []
    for i in range(count):
        release = rng.random() < 0.5
        resources = {"cpus": rng.choice([1, 2, 2, 4, 4, 8, 16]), "numa": rng.choice(["single", "prefer"])}
        if gpus and rng.random() < 0.25:
            resources["gpus"] = 1
        out.append(
            (release, parse_slot_request({"name": f"s{i}", "qos": "guaranteed", "resources": resources}))
        )
    return out


class OneNodeOracle:
    """Whether some NUMA node still has ``n`` CPUs of free whole cores (not timed)."""

    def __init__(self, topo: Topology) -> None:
        reserved = placement_index(topo).default_reserved()
        self.cores_by_node: dict[int, list[frozenset[int]]] = {n.id: [] for n in topo.numa_nodes}
        for cpus in topo.cores.values():
            if not set(cpus) & reserved:
                self.cores_by_node[topo.cpu_by_id[cpus[0]].numa].append(frozenset(cpus))

    def fits(self, held: frozenset[int], n: int) -> bool:
        return any(
            sum(len(core) for core in cores if core.isdisjoint(held)) >= n
            for cores in self.cores_by_node.values()
        )


def naive_first_fit(topo: Topology, allocated: Allocated, request: SlotRequest) -> Assignment:
    """Lowest-numbered free whole cores, whatever their node: the baseline."""
    blocked = allocated.cpus | placement_index(topo).default_reserved()
    want = request.resources.whole_cpus
    cpus: list[int] = []
    for siblings in topo.cores.values():
        if len(cpus) >= want:
            break
        if blocked.isdisjoint(siblings):
            cpus.extend(siblings)
    if len(cpus) < want:
        raise PlacementError("does not fit")
    nodes = tuple(sorted({topo.cpu_by_id[c].numa for c in cpus}))
    return Assignment(request.name, request.qos, tuple(sorted(cpus)), True, len(cpus) * 1000, nodes, 0, {})


def churn(topo: Topology, steps: list[tuple[bool, SlotRequest]], decide: Callable[..., Assignment]) -> Result:
    ledger, held = Allocated(), []
    result = Result([], 0, 0, 0)
    rng = random.Random(7)
    oracle = OneNodeOracle(topo)
    for release, request in steps:
        if release and held:
            start = time.perf_counter()
            ledger = ledger.remove(held.pop(rng.randrange(len(held))))
            result.ledger_times.append(time.perf_counter() - start)
            continue
        could_fit_one = oracle.fits(ledger.cpus, request.resources.whole_cpus)
        start = time.perf_counter()
        try:
            a = decide(topo, ledger, request)
        except PlacementError:
            result.times.append(time.perf_counter() - start)
            result.refused += 1
            continue
        result.times.append(time.perf_counter() - start)
        result.placed += 1
        result.spans += len(a.numa_nodes) > 1 and could_fit_one
        start = time.perf_counter()
        ledger = ledger.add(a)
        result.ledger_times.append(time.perf_counter() - start)
        held.append(a)
    return result


def time_count_fits(topo: Topology, options: PlacementOptions | None = None) -> tuple[int, float]:
    """How many 4-CPU slots an empty host takes, and how long count_fits took to say so (best of 3)."""
    shape = parse_slot_request({"name": "fit", "qos": "guaranteed", "resources": {"cpus": 4}})
    best, fits = float("inf"), 0
    for _ in range(3):
        start = time.perf_counter()
        fits = count_fits(topo, Allocated(), shape, options)
        best = min(best, time.perf_counter() - start)
    return fits, best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decisions", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--option", action="append", default=[], help="a placement option, KEY=VALUE")
    args = parser.parse_args()
    try:
        options = PlacementOptions.from_strings(args.option)
    except ConfigError as err:
        parser.error(str(err))
    print(
        f"{args.decisions} churn steps per host (about half are releases), seed {args.seed}"
        + (f", options {' '.join(args.option)}" if args.option else "")
    )
    print("x1st: the median over the first (16-CPU) host's; ratio: plan's median over naive's\n")
    header = (
        f"{'host':<28} {'median us':>9} {'p99 us':>7} {'decisions/s':>11} {'x1st':>5} "
        f"{'naive us':>8} {'x1st':>5} {'ratio':>5} {'ledger us':>9} {'count_fits':>15} "
        f"{'spans (plan)':>12} {'spans (naive)':>13}"
    )
    print(header)
    print("-" * len(header))
    first: tuple[float, float] | None = None
    for label, make in HOSTS.items():
        topo = make()
        steps = shapes(random.Random(args.seed), bool(topo.gpus), args.decisions)
        warm = parse_slot_request({"name": "warm", "qos": "guaranteed", "resources": {"cpus": 1}})
        plan(topo, Allocated(), warm, options)  # build the index outside the measurement
        ours = churn(topo, steps, lambda t, ledger, request: plan(t, ledger, request, options))
        naive = churn(topo, steps, naive_first_fit)  # ignores GPUs: it only times and places CPUs
        med = statistics.median(ours.times) * 1e6
        p99 = sorted(ours.times)[int(len(ours.times) * 0.99)] * 1e6
        base = statistics.median(naive.times) * 1e6
        first = first or (med, base)
        ledger_us = statistics.median(ours.ledger_times) * 1e6
        fits, fits_s = time_count_fits(topo, options)
        print(
            f"{label:<28} {med:>9.0f} {p99:>7.0f} {1e6 / med:>11.0f} {med / first[0]:>5.1f} "
            f"{base:>8.0f} {base / first[1]:>5.1f} {med / base:>5.1f} {ledger_us:>9.0f} "
            f"{fits:>4} in {fits_s * 1e3:>5.1f} ms "
            f"{ours.spans:>5}/{ours.placed:<6} {naive.spans:>6}/{naive.placed:<6}"
        )


if __name__ == "__main__":
    main()
