"""CPU and NUMA discovery from sysfs.

What is read (paths under the sysfs root):

- ``devices/system/cpu/present`` (else ``possible``, else the ``cpuN`` directories): which CPUs
  exist. Present, not possible: firmware often declares hot-plug slots that hold no CPU.
- ``devices/system/cpu/online`` (else each ``cpuN/online``; cpu0 often has none and is online).
- ``devices/system/cpu/isolated``: the kernel's ``isolcpus=`` set.
- ``cpuN/topology/{thread_siblings_list,core_id,physical_package_id,package_cpus_list,die_id,
  die_cpus_list}``. Each file is read once per core, package or die, not once per CPU: every CPU in
  a sibling/package/die list shares what its first member reported. This keeps discovery on a
  384-CPU host to a few hundred reads.
- ``cpuN/cache/index*/{level,id,shared_cpu_list}`` for the L3, once per L3 instance.
- ``devices/system/node/nodeN/{cpulist,meminfo,distance}``; without a node directory (a kernel
  built without NUMA) node 0 holds every CPU and memory comes from ``<proc>/meminfo``.

Rules where the kernel is silent (the v1 model has no null for a CPU's core, socket or NUMA node):

- ``core`` is a host-wide dense index over (physical_package_id, die_id, core_id) in the order of
  each core's lowest CPU id, because core_id alone repeats on every package.
- An offline CPU has no ``topology`` or ``cache`` directory on x86 (the kernel removes them at
  offline time). Such a CPU gets a core index of its own after all cores that have topology, in CPU
  id order; its NUMA node is the node whose cpulist holds it, else its ``cpuN/nodeM`` link, else the
  lowest node id; its socket is the lowest socket among the other CPUs of that node, else 0; its
  ``l3`` is null. Placement never uses offline CPUs, so these numbers only keep the listing whole.
- A negative ``physical_package_id`` (-1: "unknown" on some older ARM kernels) counts as socket 0.
- ``l3`` is the kernel's cache ``id`` when every L3 instance has one and no two instances share it;
  otherwise a dense index over the L3 instances in the order of their lowest CPU id.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from nodeagent.devices.topology import Cpu, NumaNode
from nodeagent.errors import DiscoveryError
from nodeagent.kernelfs import KernelFs, Procfs, Sysfs
from nodeagent.procfmt import meminfo_bytes, parse_meminfo

CPU_DIR = "devices/system/cpu"
NODE_DIR = "devices/system/node"

_NODE_NAME = re.compile(r"node(\d+)")
_CPU_NAME = re.compile(r"cpu(\d+)")


@dataclass(frozen=True, slots=True)
class CpuTopology:
    cpus: tuple[Cpu, ...]
    numa_nodes: tuple[NumaNode, ...]
    isolated_cpus: frozenset[int]
    memory_bytes: int | None


@dataclass(frozen=True, slots=True)
class CpuModel:
    name: str | None  #: e.g. "AMD EPYC 9654 96-Core Processor"
    vendor: str | None  #: e.g. "AuthenticAMD"
    flags: frozenset[str]  #: e.g. {"avx512f", "amx_tile", ...}


def discover_cpu_topology(sysfs: Sysfs, *, proc_root: Path = Path("/proc")) -> CpuTopology:
    """Read the host's CPUs and NUMA nodes from ``sysfs``; see the module docstring for the rules."""
    cpu_ids = _cpu_ids(sysfs)
    online = _online_cpus(sysfs, cpu_ids)
    node_cpus = _node_cpulists(sysfs, cpu_ids)
    placed = _read_cores(sysfs, cpu_ids)
    l3_of = _read_l3(sysfs, cpu_ids)
    numa_of = _numa_of(sysfs, cpu_ids, node_cpus)
    core_of, socket_of = _core_and_socket(cpu_ids, placed, numa_of)

    cpus = tuple(
        Cpu(id=c, core=core_of[c], socket=socket_of[c], numa=numa_of[c], l3=l3_of.get(c), online=c in online)
        for c in cpu_ids
    )
    nodes = _numa_nodes(sysfs, node_cpus, cpus, proc_root)
    isolated = (sysfs.read_cpulist(f"{CPU_DIR}/isolated") or frozenset()) & frozenset(cpu_ids)
    return CpuTopology(
        cpus=cpus,
        numa_nodes=nodes,
        isolated_cpus=isolated,
        memory_bytes=_total_memory(nodes, proc_root),
    )


# --------------------------------------------------------------------------- which CPUs


def _cpu_ids(sysfs: Sysfs) -> list[int]:
    for name in ("present", "possible"):
        ids = sysfs.read_cpulist(f"{CPU_DIR}/{name}")
        if ids:
            return sorted(ids)
    names = sysfs.listdir(CPU_DIR) or []
    ids_from_dirs = sorted(int(m.group(1)) for n in names if (m := _CPU_NAME.fullmatch(n)))
    if not ids_from_dirs:
        raise DiscoveryError(
            f"no CPUs found under {sysfs.path(CPU_DIR)} (no 'present' or 'possible' file, no cpuN "
            f"directories); is {sysfs.root} a sysfs tree? Point the sysfs root at a mounted sysfs "
            "or a captured copy of one"
        )
    return ids_from_dirs


def _online_cpus(sysfs: Sysfs, cpu_ids: Iterable[int]) -> frozenset[int]:
    online = sysfs.read_cpulist(f"{CPU_DIR}/online")
    if online is not None:
        return online
    # No global list (very old kernels, some captured trees): a CPU without its own `online`
    # file cannot be taken offline, so it is online.
    return frozenset(c for c in cpu_ids if sysfs.read_int(f"{CPU_DIR}/cpu{c}/online") in (None, 1))


# --------------------------------------------------------------------------- cores and sockets


@dataclass(frozen=True, slots=True)
class _Placed:
    """What a CPU's topology directory says about it."""

    package: int
    core_key: tuple[int, ...]  #: identifies the physical core host-wide


def _read_cores(sysfs: Sysfs, cpu_ids: list[int]) -> dict[int, _Placed]:
    """Package and core identity of every CPU that has a topology directory."""
    known = frozenset(cpu_ids)
    package_of: dict[int, int] = {}
    die_of: dict[int, int] = {}
    placed: dict[int, _Placed] = {}
    for cpu in cpu_ids:
        if cpu in placed:
            continue
        topo = f"{CPU_DIR}/cpu{cpu}/topology"
        siblings = sysfs.read_cpulist(f"{topo}/thread_siblings_list")
        if siblings is None:
            continue  # offline on x86, or no topology support: handled by _core_and_socket
        if cpu not in package_of:
            _spread(
                sysfs,
                topo,
                cpu,
                known=known,
                into=package_of,
                id_file="physical_package_id",
                list_file="package_cpus_list",
            )
        if cpu not in die_of:
            _spread(sysfs, topo, cpu, known=known, into=die_of, id_file="die_id", list_file="die_cpus_list")
        package = max(package_of[cpu], 0)
        core_id = sysfs.read_int(f"{topo}/core_id")
        # Without a usable core_id the sibling list is still one core: key it by its first CPU.
        key = (package, die_of[cpu], core_id) if core_id is not None and core_id >= 0 else (-1, cpu)
        for sibling in (siblings & known) | {cpu}:
            placed.setdefault(sibling, _Placed(package=package, core_key=key))
    return placed


def _spread(
    sysfs: Sysfs,
    topo: str,
    cpu: int,
    *,
    known: frozenset[int],
    into: dict[int, int],
    id_file: str,
    list_file: str,
) -> None:
    """Read one id (package, die) once and give it to every CPU its list names."""
    value = sysfs.read_int(f"{topo}/{id_file}")
    value = 0 if value is None else value  # die_id appeared in Linux 5.2; before it, one die
    members = sysfs.read_cpulist(f"{topo}/{list_file}")
    if members is None and list_file == "package_cpus_list":
        members = sysfs.read_cpulist(f"{topo}/core_siblings_list")  # its name before Linux 5.7
    for member in ((members or frozenset()) & known) | {cpu}:
        into.setdefault(member, value)


def _core_and_socket(
    cpu_ids: list[int], placed: Mapping[int, _Placed], numa_of: Mapping[int, int]
) -> tuple[dict[int, int], dict[int, int]]:
    core_index: dict[tuple[int, ...], int] = {}
    for cpu in cpu_ids:  # ascending, so cores are numbered by their lowest CPU id
        if cpu in placed:
            core_index.setdefault(placed[cpu].core_key, len(core_index))
    core_of = {cpu: core_index[p.core_key] for cpu, p in placed.items()}
    socket_of = {cpu: p.package for cpu, p in placed.items()}

    node_sockets: dict[int, int] = {}
    for cpu, p in placed.items():
        node = numa_of[cpu]
        node_sockets[node] = min(node_sockets.get(node, p.package), p.package)
    next_core = len(core_index)
    for cpu in cpu_ids:
        if cpu not in placed:
            core_of[cpu] = next_core
            next_core += 1
            socket_of[cpu] = node_sockets.get(numa_of[cpu], 0)
    return core_of, socket_of


# --------------------------------------------------------------------------- L3 caches


def _read_l3(sysfs: Sysfs, cpu_ids: list[int]) -> dict[int, int]:
    """Host-wide L3 id of every CPU whose cache directory describes an L3."""
    known = frozenset(cpu_ids)
    instances: list[tuple[frozenset[int], int | None]] = []
    covered: set[int] = set()
    index_name: str | None = None
    for cpu in cpu_ids:
        if cpu in covered:
            continue
        found = _l3_index(sysfs, cpu, index_name)
        if found is None:
            continue
        index_name = found
        base = f"{CPU_DIR}/cpu{cpu}/cache/{found}"
        sharing = ((sysfs.read_cpulist(f"{base}/shared_cpu_list") or frozenset()) & known) | {cpu}
        sharing = frozenset(sharing - covered)
        instances.append((sharing, sysfs.read_int(f"{base}/id")))
        covered.update(sharing)

    ids = [kernel_id for _, kernel_id in instances]
    use_kernel_ids = None not in ids and len(set(ids)) == len(ids)
    l3_of: dict[int, int] = {}
    for dense, (sharing, kernel_id) in enumerate(instances):  # already in lowest-CPU order
        value = kernel_id if use_kernel_ids and kernel_id is not None else dense
        for cpu in sharing:
            l3_of[cpu] = value
    return l3_of


def _l3_index(sysfs: Sysfs, cpu: int, guess: str | None) -> str | None:
    """The ``cache/indexN`` directory of ``cpu`` that describes its L3; tries last CPU's first."""
    cache = f"{CPU_DIR}/cpu{cpu}/cache"
    if guess is not None and sysfs.read_int(f"{cache}/{guess}/level") == 3:
        return guess
    for name in sysfs.listdir(cache) or []:
        if name.startswith("index") and sysfs.read_int(f"{cache}/{name}/level") == 3:
            return name
    return None


# --------------------------------------------------------------------------- NUMA


def _node_cpulists(sysfs: Sysfs, cpu_ids: list[int]) -> dict[int, frozenset[int]]:
    """NUMA node id -> its CPUs per the kernel; {} when the kernel has no NUMA support."""
    names = sysfs.listdir(NODE_DIR)
    if names is None:
        return {}
    known = frozenset(cpu_ids)
    node_ids = sorted(int(m.group(1)) for n in names if (m := _NODE_NAME.fullmatch(n)))
    return {n: (sysfs.read_cpulist(f"{NODE_DIR}/node{n}/cpulist") or frozenset()) & known for n in node_ids}


def _numa_of(sysfs: Sysfs, cpu_ids: list[int], node_cpus: Mapping[int, frozenset[int]]) -> dict[int, int]:
    if not node_cpus:
        return dict.fromkeys(cpu_ids, 0)
    numa_of = {cpu: node for node, cpus in node_cpus.items() for cpu in cpus}
    lowest = min(node_cpus)
    for cpu in cpu_ids:
        if cpu not in numa_of:
            # x86 drops an offline CPU from its node's cpulist but keeps the cpuN/nodeM link.
            links = sysfs.listdir(f"{CPU_DIR}/cpu{cpu}") or []
            linked = [int(m.group(1)) for n in links if (m := _NODE_NAME.fullmatch(n))]
            numa_of[cpu] = linked[0] if linked and linked[0] in node_cpus else lowest
    return numa_of


def _numa_nodes(
    sysfs: Sysfs, node_cpus: Mapping[int, frozenset[int]], cpus: tuple[Cpu, ...], proc_root: Path
) -> tuple[NumaNode, ...]:
    members: dict[int, list[int]] = {}
    for c in cpus:
        members.setdefault(c.numa, []).append(c.id)
    if not node_cpus:
        memory = _meminfo_total(Procfs(proc_root), "meminfo")
        return (NumaNode(id=0, cpus=tuple(members.get(0, ())), memory_bytes=memory, distances=None),)
    count = len(node_cpus)
    nodes = []
    for n in sorted(node_cpus):
        distances = _distances(sysfs, n)
        nodes.append(
            NumaNode(
                id=n,
                cpus=tuple(members.get(n, ())),
                memory_bytes=_meminfo_total(sysfs, f"{NODE_DIR}/node{n}/meminfo"),
                # The kernel prints one distance per online node; a row of another length would
                # not line up with numa_nodes, so it is unknown rather than misread.
                distances=distances if distances is not None and len(distances) == count else None,
            )
        )
    return tuple(nodes)


def _distances(sysfs: Sysfs, node: int) -> tuple[int, ...] | None:
    rel = f"{NODE_DIR}/node{node}/distance"
    text = sysfs.read_text(rel)
    if text is None:
        return None
    try:
        return tuple(int(d) for d in text.split())
    except ValueError:
        raise DiscoveryError(
            f"reading {sysfs.path(rel)}: expected distances such as '10 21', found {text[:60]!r}"
        ) from None


def _meminfo_total(reader: KernelFs, rel: str) -> int | None:
    """MemTotal in bytes from a node's meminfo ("Node 0 MemTotal: 123 kB") or /proc/meminfo."""
    text = reader.read_text(rel)
    value = None if text is None else parse_meminfo(text).get("MemTotal")
    if value is None:
        return None
    size = meminfo_bytes(value)
    if size is None:
        raise DiscoveryError(
            f"reading {reader.path(rel)}: expected 'MemTotal: <number> kB', found {'MemTotal: ' + value!r}"
        )
    return size


def _total_memory(nodes: tuple[NumaNode, ...], proc_root: Path) -> int | None:
    sizes = [n.memory_bytes for n in nodes]
    if sizes and all(s is not None for s in sizes):
        return sum(s for s in sizes if s is not None)
    return _meminfo_total(Procfs(proc_root), "meminfo")


# --------------------------------------------------------------------------- CPU model


@functools.cache
def cpu_model() -> CpuModel:
    """The CPU's model name, vendor and feature flags (py-cpuinfo).

    Slow (py-cpuinfo may start a subprocess), so it is never part of discovery: call it when a
    feature decision needs it (AMX, AVX-512, resctrl support). Cached for the process's lifetime.
    """
    import cpuinfo  # noqa: PLC0415  (heavy, and only needed on this path)

    info = cpuinfo.get_cpu_info()
    return CpuModel(
        name=info.get("brand_raw") or None,
        vendor=info.get("vendor_id_raw") or None,
        flags=frozenset(info.get("flags") or ()),
    )
