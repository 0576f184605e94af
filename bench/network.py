"""Per-slot network setup and teardown time: the pyroute2 (thread + netlink) path vs ``ip -batch``,
each without the slot firewall, with it (default-deny only), and with opt-ins (two host ports and
egress through NAT).

Run as root: ``python bench/network.py [--runs 200] [--shaping 40] [--others 0]``. Prints median and
p99 in ms for each variant, side by side in one run (absolute figures drift between machines), and
the firewall's added cost per slot (difference of medians). ``--others N`` first fills the table
with the opt-ins of N other slots, as on a busy host (setup and teardown read the table).

Egress toggles the host's ip_forward (on at a slot's setup, back off at its teardown) when it was
off: the value is restored at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

from nodeagent.isolation.firewall import NftFirewall
from nodeagent.isolation.network import (
    AllowedHostPort,
    NetworkBackend,
    Pyroute2Backend,
    SlotAccess,
    SlotNetworkConfig,
    plan_slot_network,
)
from nodeagent.isolation.network_ipbatch import IpBatchBackend

VARIANTS: dict[str, SlotAccess | None] = {
    "no firewall": None,
    "firewall, deny": SlotAccess(),
    "firewall, 2 ports + nat": SlotAccess("nat", (AllowedHostPort(9000), AllowedHostPort(53, "udp"))),
}


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


Samples = dict[str, tuple[list[float], list[float]]]


def measure(
    backends: dict[str, tuple[NetworkBackend, SlotAccess | None]], runs: int, shaping: float | None
) -> Samples:
    """Set-up and teardown times (ms) per variant. The variants take turns slot by slot, so a
    change of load on the machine reaches each of them alike."""
    samples: Samples = {name: ([], []) for name in backends}
    for i in range(runs + 5):
        for name, (backend, access) in backends.items():
            slot_id = f"b{i}"
            started = time.perf_counter()
            backend.setup(slot_id, i % 64, bandwidth_mbit=shaping, access=access)
            built = time.perf_counter()
            backend.teardown(slot_id)
            done = time.perf_counter()
            if i >= 5:  # the first few warm caches and pyroute2's message compilation
                samples[name][0].append((built - started) * 1000)
                samples[name][1].append((done - built) * 1000)
    return samples


def measure_firewall(firewall: NftFirewall, config: SlotNetworkConfig, runs: int) -> Samples:
    """The firewall's own calls for a slot (no netns, no veth): the part it adds to each."""
    samples: Samples = {}
    for variant, access in VARIANTS.items():
        if access is None:
            continue
        apply_ms: list[float] = []
        remove_ms: list[float] = []
        for i in range(runs + 5):
            plan = plan_slot_network(config, f"f{i}", i % 64, access=access, filtered=True)
            started = time.perf_counter()
            firewall.apply(plan)
            applied = time.perf_counter()
            firewall.remove(plan.host_ifname)
            done = time.perf_counter()
            if i >= 5:
                apply_ms.append((applied - started) * 1000)
                remove_ms.append((done - applied) * 1000)
        samples[variant] = (apply_ms, remove_ms)
    return samples


def _row(label: str, variant: str, setup_ms: list[float], teardown_ms: list[float]) -> str:
    return (
        f"{label:<18}{variant:<26}"
        f"{statistics.median(setup_ms):>9.2f} / {_percentile(setup_ms, 0.99):<6.2f}"
        f"{statistics.median(teardown_ms):>9.2f} / {_percentile(teardown_ms, 0.99):<6.2f}"
    )


def fill(firewall: NftFirewall, config: SlotNetworkConfig, others: int) -> None:
    """Opt-ins of ``others`` slots that have no veth (the table's size is what matters here)."""
    access = SlotAccess(host_ports=(AllowedHostPort(9000), AllowedHostPort(53, "udp")))
    for index in range(others):
        plan = plan_slot_network(config, f"other{index}", 64 + index, access=access, filtered=True)
        firewall.apply(plan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--shaping", type=float, default=None, help="egress limit in Mbit/s")
    parser.add_argument("--others", type=int, default=0, help="other slots' opt-ins in the table")
    args = parser.parse_args()
    tag = f"nabench{os.getpid() % 10000}"
    config = SlotNetworkConfig(
        cidr="100.127.0.0/16", netns_prefix=f"{tag}-", veth_prefix=tag, nft_table=f"{tag}-fw"
    )
    firewall = NftFirewall(config)
    problem = firewall.problem()
    kinds: list[Callable[[SlotNetworkConfig, NftFirewall | None], NetworkBackend]] = [
        Pyroute2Backend,
        IpBatchBackend,
    ]
    print(f"{args.runs} runs, shaping={args.shaping} Mbit/s, {args.others} other slots; median / p99 in ms")
    if problem:
        print(f"firewall variants skipped: {problem}")
    print(f"{'backend':<18}{'variant':<26}{'setup':>18}{'teardown':>18}")
    try:
        if not problem:
            fill(firewall, config, args.others)
        for kind in kinds:
            backends = {
                variant: (kind(config, None if access is None else firewall), access)
                for variant, access in VARIANTS.items()
                if access is None or not problem
            }
            samples = measure(backends, args.runs, args.shaping)
            for variant, (setup_ms, teardown_ms) in samples.items():
                print(_row(kind.__name__, variant, setup_ms, teardown_ms))
            base_setup, base_teardown = (statistics.median(x) for x in samples["no firewall"])
            for variant, (setup_ms, teardown_ms) in samples.items():
                if variant != "no firewall":
                    print(
                        f"{'':<18}{'  added: ' + variant.removeprefix('firewall, '):<26}"
                        f"{statistics.median(setup_ms) - base_setup:>+9.2f}{'':<9}"
                        f"{statistics.median(teardown_ms) - base_teardown:>+9.2f}"
                    )
        if not problem:
            for variant, (apply_ms, remove_ms) in measure_firewall(firewall, config, args.runs).items():
                print(_row("NftFirewall alone", variant, apply_ms, remove_ms))
    finally:
        backend = Pyroute2Backend(config, None if problem else firewall)
        backend.remove_owned(backend.list_owned())
        if not problem:
            firewall.remove_all()


if __name__ == "__main__":
    main()
