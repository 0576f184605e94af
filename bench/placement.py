"""Placement speed and quality under allocate/release churn, on hosts of growing size.

Run: .venv/bin/python bench/placement.py [--decisions N] [--seed S]

For each host it replays the same seeded churn (random slot shapes, half the steps release a random
slot) through ``plan`` and through a naive first-fit baseline written here (lowest free whole cores,
no NUMA awareness, as a CPU manager without a topology policy would do). It prints the median and
p99 time per decision, decisions per second, and how often a slot that could have fitted on one NUMA
node was spread over several (what costs tail latency).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from nodeagent.agent.placement import Allocated, Assignment, placement_index, plan
from nodeagent.agent.request import SlotRequest, parse_slot_request
from nodeagent.devices.synthetic import synthetic_topology
from nodeagent.devices.topology import Topology
from nodeagent.errors import PlacementError

HOSTS = {
    "16 CPUs, 1 node": lambda: synthetic_topology(1, 1, 8, 2),
    "96 CPUs, 4 nodes, 4 GPUs": lambda: synthetic_topology(2, 2, 12, 2, gpus_per_numa=1),
    "384 CPUs, 24 nodes, 8 GPUs": lambda: synthetic_topology(
        4, 6, 8, 2, gpu_numa=[0, 3, 6, 9, 12, 15, 18, 21]
    ),
}


@dataclass
class Result:
    times: list[float]
    placed: int
    refused: int
    spans: int  #: slots spread over several nodes although one node had room when they were placed


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


def fits_one_node(topo: Topology, held: frozenset[int], n: int) -> bool:
    reserved = placement_index(topo).default_reserved()
    for node in topo.numa_nodes:
        free = sum(
            1
            for cpus in topo.cores.values()
            if topo.cpu_by_id[cpus[0]].numa == node.id and not (set(cpus) & (held | reserved))
        )
        if free * 2 >= n:
            return True
    return False


def naive_first_fit(topo: Topology, allocated: Allocated, request: SlotRequest) -> Assignment:
    """Lowest-numbered free whole cores, whatever their node: the baseline."""
    reserved = placement_index(topo).default_reserved()
    want = request.resources.whole_cpus
    cpus: list[int] = []
    for siblings in topo.cores.values():
        if len(cpus) >= want:
            break
        if not (set(siblings) & (allocated.cpus | reserved)):
            cpus.extend(siblings)
    if len(cpus) < want:
        raise PlacementError("does not fit")
    nodes = tuple(sorted({topo.cpu_by_id[c].numa for c in cpus}))
    return Assignment(request.name, request.qos, tuple(sorted(cpus)), True, len(cpus) * 1000, nodes, 0, {})


def churn(topo: Topology, steps: list[tuple[bool, SlotRequest]], decide: Callable[..., Assignment]) -> Result:
    ledger, held = Allocated(), []
    result = Result([], 0, 0, 0)
    rng = random.Random(7)
    for release, request in steps:
        if release and held:
            ledger = ledger.remove(held.pop(rng.randrange(len(held))))
            continue
        could_fit_one = fits_one_node(topo, ledger.cpus, request.resources.whole_cpus)
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
        ledger = ledger.add(a)
        held.append(a)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decisions", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(f"{args.decisions} churn steps per host (about half are releases), seed {args.seed}\n")
    header = (
        f"{'host':<28} {'median us':>10} {'p99 us':>8} {'decisions/s':>12} "
        f"{'naive median us':>16} {'ratio':>6} {'spans (plan)':>13} {'spans (naive)':>14}"
    )
    print(header)
    print("-" * len(header))
    for label, make in HOSTS.items():
        topo = make()
        steps = shapes(random.Random(args.seed), bool(topo.gpus), args.decisions)
        warm = parse_slot_request({"name": "warm", "qos": "guaranteed", "resources": {"cpus": 1}})
        plan(topo, Allocated(), warm)  # build the index outside the measurement
        ours = churn(topo, steps, plan)
        naive = churn(topo, steps, naive_first_fit)  # ignores GPUs: it only times and places CPUs
        med = statistics.median(ours.times) * 1e6
        p99 = sorted(ours.times)[int(len(ours.times) * 0.99)] * 1e6
        base = statistics.median(naive.times) * 1e6
        print(
            f"{label:<28} {med:>10.0f} {p99:>8.0f} {1e6 / med:>12.0f} {base:>16.0f} {med / base:>6.1f} "
            f"{ours.spans:>5}/{ours.placed:<7} {naive.spans:>6}/{naive.placed:<7}"
        )


if __name__ == "__main__":
    main()
