"""Fake sysfs trees for CPU/NUMA discovery, as ``{relpath: content}`` maps under a sysfs root.

``generate_tree`` builds a tree the way an x86 Linux kernel lays it out:

- CPU ids enumerate the first hyperthread of every core (socket by socket, node by node), then the
  second hyperthread of every core, and so on; ``core_id`` restarts at 0 on every package.
- An offline CPU keeps ``cpuN/online`` ("0") and its ``cpuN/nodeM`` link but loses its
  ``topology/`` and ``cache/`` directories, and disappears from every sibling list, shared cache
  list and its node's cpulist.
- A symlink such as ``cpuN/nodeM`` is written as an empty file: discovery only lists its name.

The named trees below are what the tests and the benchmark use; tests may copy a map and edit it
to damage or vary one file. ``capture_tree`` copies the same subset from a real sysfs.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path

from nodeagent.cpulist import format_cpulist

Tree = dict[str, str]

CPU = "devices/system/cpu"
NODE = "devices/system/node"


def distance_matrix(
    sockets: int, nodes_per_socket: int, *, same_socket: int = 12, remote: int = 21
) -> list[list[int]]:
    """A SLIT as firmware reports it: 10 on the diagonal, then same-socket, then cross-socket."""
    count = sockets * nodes_per_socket
    return [
        [
            10 if a == b else same_socket if a // nodes_per_socket == b // nodes_per_socket else remote
            for b in range(count)
        ]
        for a in range(count)
    ]


def generate_tree(
    *,
    sockets: int = 1,
    nodes_per_socket: int = 1,
    cores_per_node: int = 4,
    threads_per_core: int = 2,
    l3_per_node: int = 1,
    offline: Iterable[int] = (),
    isolated: Iterable[int] = (),
    node_memory_kib: int = 16 * 1024 * 1024,
    distances: list[list[int]] | None = None,
    l3_id_step: int | None = 1,
    core_id_step: int = 1,
    l1_l2_caches: bool = True,
) -> Tree:
    """A whole CPU/NUMA sysfs subset.

    ``l3_id_step`` None leaves out the L3 ``id`` files (older kernels); otherwise the n-th L3 of
    the host has id ``n * l3_id_step``. ``core_id_step`` > 1 leaves gaps in core_id as Intel parts
    do. ``distances`` defaults to :func:`distance_matrix`. ``l1_l2_caches`` False writes only the
    L3's ``cache/index3`` (discovery reads nothing else), for trees so big that writing costs.
    """
    offline_set, isolated_set = frozenset(offline), frozenset(isolated)
    nodes = sockets * nodes_per_socket
    total_cores = nodes * cores_per_node
    cpu_count = total_cores * threads_per_core
    all_cpus = range(cpu_count)
    online = [c for c in all_cpus if c not in offline_set]

    def cpus_of_core(core: int) -> list[int]:
        return [t * total_cores + core for t in range(threads_per_core)]

    def live(cpus: Iterable[int]) -> str:
        return format_cpulist(c for c in cpus if c not in offline_set)

    tree: Tree = {
        f"{CPU}/possible": format_cpulist(all_cpus),
        f"{CPU}/present": format_cpulist(all_cpus),
        f"{CPU}/online": format_cpulist(online),
        f"{CPU}/offline": format_cpulist(offline_set),
        f"{CPU}/isolated": format_cpulist(isolated_set),
        f"{CPU}/kernel_max": "8191",
        f"{NODE}/possible": format_cpulist(range(nodes)),
        f"{NODE}/online": format_cpulist(range(nodes)),
    }
    slit = distances or distance_matrix(sockets, nodes_per_socket)
    cores_per_l3 = max(cores_per_node // l3_per_node, 1)

    def l3_of(position_in_node: int) -> int:
        return min(position_in_node // cores_per_l3, l3_per_node - 1)

    for node in range(nodes):
        socket = node // nodes_per_socket
        node_cores = range(node * cores_per_node, (node + 1) * cores_per_node)
        node_cpus = [c for core in node_cores for c in cpus_of_core(core)]
        package_cpus = [
            c
            for core in range(
                socket * nodes_per_socket * cores_per_node, (socket + 1) * nodes_per_socket * cores_per_node
            )
            for c in cpus_of_core(core)
        ]
        tree[f"{NODE}/node{node}/cpulist"] = live(node_cpus)
        tree[f"{NODE}/node{node}/distance"] = " ".join(map(str, slit[node]))
        tree[f"{NODE}/node{node}/meminfo"] = _node_meminfo(node, node_memory_kib)
        for core in node_cores:
            local_core = core - socket * nodes_per_socket * cores_per_node
            l3_global = node * l3_per_node + l3_of(core - node_cores[0])
            l3_cores = [k for k in node_cores if l3_of(k - node_cores[0]) == l3_global - node * l3_per_node]
            l3_cpus = [c for k in l3_cores for c in cpus_of_core(k)]
            for cpu in cpus_of_core(core):
                base = f"{CPU}/cpu{cpu}"
                if cpu != 0:  # cpu0 usually cannot be unplugged and has no `online` file
                    tree[f"{base}/online"] = "0" if cpu in offline_set else "1"
                tree[f"{base}/node{node}"] = ""
                if cpu in offline_set:
                    continue
                siblings = live(cpus_of_core(core))
                topology = {
                    "core_id": str(local_core * core_id_step),
                    "physical_package_id": str(socket),
                    "die_id": "0",
                    "thread_siblings_list": siblings,
                    "core_cpus_list": siblings,
                    "package_cpus_list": live(package_cpus),
                    "core_siblings_list": live(package_cpus),
                    "die_cpus_list": live(package_cpus),
                }
                for name, value in topology.items():
                    tree[f"{base}/topology/{name}"] = value
                caches = [
                    ("index0", 1, "Data", core, siblings),
                    ("index1", 1, "Instruction", core, siblings),
                    ("index2", 2, "Unified", core, siblings),
                    ("index3", 3, "Unified", l3_global, live(l3_cpus)),
                ]
                for index, level, kind, cache_id, shared in caches[0 if l1_l2_caches else 3 :]:
                    tree[f"{base}/cache/{index}/level"] = str(level)
                    tree[f"{base}/cache/{index}/type"] = kind
                    tree[f"{base}/cache/{index}/shared_cpu_list"] = shared
                    if level < 3:
                        tree[f"{base}/cache/{index}/id"] = str(cache_id)
                    elif l3_id_step is not None:
                        tree[f"{base}/cache/{index}/id"] = str(cache_id * l3_id_step)
    return tree


def _node_meminfo(node: int, total_kib: int) -> str:
    free = total_kib * 3 // 4
    return (
        f"Node {node} MemTotal:       {total_kib} kB\n"
        f"Node {node} MemFree:        {free} kB\n"
        f"Node {node} MemUsed:        {total_kib - free} kB\n"
        f"Node {node} HugePages_Total:     0\n"
    )


# --------------------------------------------------------------------------- named trees


def single_socket_ht() -> Tree:
    """One socket, one node, 4 cores x 2 threads: CPUs 0-3 first threads, 4-7 their siblings."""
    return generate_tree(sockets=1, nodes_per_socket=1, cores_per_node=4, threads_per_core=2)


def dual_socket_ht() -> Tree:
    """Two sockets of one node each, 4 cores x 2 threads per socket (16 CPUs), Intel-like."""
    return generate_tree(
        sockets=2, nodes_per_socket=1, cores_per_node=4, threads_per_core=2, l3_id_step=None, core_id_step=2
    )


def four_numa_nps2() -> Tree:
    """Two sockets x 2 NUMA nodes (AMD NPS2), 4 cores x 2 threads per node, 2 L3 (CCX) per node."""
    return generate_tree(
        sockets=2,
        nodes_per_socket=2,
        cores_per_node=4,
        threads_per_core=2,
        l3_per_node=2,
        distances=distance_matrix(2, 2, same_socket=12, remote=32),
    )


def offline_cpus() -> Tree:
    """single_socket_ht with CPU 5 (sibling of 1) and the whole core of CPUs 3 and 7 offline."""
    return generate_tree(sockets=1, cores_per_node=4, threads_per_core=2, offline=(3, 5, 7))


def isolcpus() -> Tree:
    """dual_socket_ht booted with isolcpus=2,3,10,11 (cores 2 and 3 of socket 0 with siblings)."""
    return generate_tree(sockets=2, cores_per_node=4, threads_per_core=2, isolated=(2, 3, 10, 11))


def large_384() -> Tree:
    """Two AMD Genoa-like sockets in NPS4: 8 nodes x 24 cores x 2 threads, 3 L3 per node (384 CPUs)."""
    return generate_tree(
        sockets=2,
        nodes_per_socket=4,
        cores_per_node=24,
        threads_per_core=2,
        l3_per_node=3,
        node_memory_kib=96 * 1024 * 1024,
        distances=distance_matrix(2, 4, same_socket=12, remote=32),
        l1_l2_caches=False,
    )


NAMED_TREES: dict[str, Callable[[], Tree]] = {
    "single_socket_ht": single_socket_ht,
    "dual_socket_ht": dual_socket_ht,
    "four_numa_nps2": four_numa_nps2,
    "offline_cpus": offline_cpus,
    "isolcpus": isolcpus,
    "large_384": large_384,
}


# --------------------------------------------------------------------------- capture


_CPU_FILES = ("online", "possible", "present", "offline", "isolated", "kernel_max")
_TOPOLOGY_FILES = (
    "core_id",
    "physical_package_id",
    "die_id",
    "thread_siblings_list",
    "core_cpus_list",
    "package_cpus_list",
    "core_siblings_list",
    "die_cpus_list",
)
_CACHE_FILES = ("level", "type", "id", "shared_cpu_list")
_NODE_FILES = ("cpulist", "meminfo", "distance")


def capture_tree(sysfs_root: Path = Path("/sys")) -> Tree:
    """Copy the CPU/NUMA subset of a real sysfs into a map (e.g. to keep a host as a fixture)."""
    tree: Tree = {}

    def take(rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            tree[rel] = (sysfs_root / rel).read_text()

    for name in _CPU_FILES:
        take(f"{CPU}/{name}")
    for name in ("possible", "online"):
        take(f"{NODE}/{name}")
    for entry in _names(sysfs_root / CPU, r"cpu\d+"):
        base = f"{CPU}/{entry}"
        take(f"{base}/online")
        for link in _names(sysfs_root / base, r"node\d+"):
            tree[f"{base}/{link}"] = ""
        for name in _TOPOLOGY_FILES:
            take(f"{base}/topology/{name}")
        for index in _names(sysfs_root / base / "cache", r"index\d+"):
            for name in _CACHE_FILES:
                take(f"{base}/cache/{index}/{name}")
    for entry in _names(sysfs_root / NODE, r"node\d+"):
        for name in _NODE_FILES:
            take(f"{NODE}/{entry}/{name}")
    return tree


def _names(directory: Path, pattern: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(directory) if re.fullmatch(pattern, n))
    except FileNotFoundError:
        return []
