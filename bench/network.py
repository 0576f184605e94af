"""Per-slot network setup and teardown time: the pyroute2 (thread + netlink) path vs ``ip -batch``.

Run as root: ``python bench/network.py [--runs 200] [--shaping 40]``. Prints median and p99 in ms
for each backend, side by side in one run (absolute figures drift between machines).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from nodeagent.isolation.network import IpBatchBackend, NetworkBackend, Pyroute2Backend, SlotNetworkConfig


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure(backend: NetworkBackend, runs: int, shaping: float | None) -> tuple[list[float], list[float]]:
    setup_ms: list[float] = []
    teardown_ms: list[float] = []
    for i in range(runs + 5):
        slot_id = f"b{i}"
        started = time.perf_counter()
        backend.setup(slot_id, i % 64, bandwidth_mbit=shaping)
        built = time.perf_counter()
        backend.teardown(slot_id)
        done = time.perf_counter()
        if i >= 5:  # the first few warm caches and pyroute2's message compilation
            setup_ms.append((built - started) * 1000)
            teardown_ms.append((done - built) * 1000)
    return setup_ms, teardown_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--shaping", type=float, default=None, help="egress limit in Mbit/s")
    args = parser.parse_args()
    tag = f"nabench{os.getpid() % 10000}"
    config = SlotNetworkConfig(cidr="100.127.0.0/16", netns_prefix=f"{tag}-", veth_prefix=tag)
    backends: list[NetworkBackend] = [Pyroute2Backend(config), IpBatchBackend(config)]
    print(f"{args.runs} runs, shaping={args.shaping} Mbit/s; median / p99 in ms")
    print(f"{'backend':<18}{'setup':>18}{'teardown':>18}")
    try:
        for backend in backends:
            setup_ms, teardown_ms = measure(backend, args.runs, args.shaping)
            print(
                f"{type(backend).__name__:<18}"
                f"{statistics.median(setup_ms):>9.2f} / {_percentile(setup_ms, 0.99):<6.2f}"
                f"{statistics.median(teardown_ms):>9.2f} / {_percentile(teardown_ms, 0.99):<6.2f}"
            )
    finally:
        backends[0].remove_owned(backends[0].list_owned())


if __name__ == "__main__":
    main()
