"""``nodeagent topology``: what this host has, as a table for people or ``--json`` for programs."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import click

from nodeagent.cpulist import format_cpulist
from nodeagent.devices.discovery import discover
from nodeagent.devices.topology import Cpu, Fpga, Gpu, NumaNode, Topology, topology_to_dict

_GIB = 1024**3


@click.command("topology")
@click.option("--json", "as_json", is_flag=True, help="Print nodeagent.topology/v1 JSON instead of a table.")
@click.option(
    "--sysfs-root",
    type=click.Path(path_type=Path),
    default=Path("/sys"),
    show_default=True,
    help="Read this sysfs tree (e.g. one captured from another host).",
)
@click.option(
    "--proc-root",
    type=click.Path(path_type=Path),
    default=Path("/proc"),
    show_default=True,
    help="Where meminfo is read when sysfs has no NUMA nodes.",
)
@click.option("--dev-root", type=click.Path(path_type=Path), default=Path("/dev"), show_default=True)
@click.option("--gpus/--no-gpus", default=True, show_default=True, help="Discover NVIDIA GPUs through NVML.")
@click.option("--fpgas/--no-fpgas", default=True, show_default=True, help="Discover FPGAs on the PCI bus.")
def command(
    *, as_json: bool, sysfs_root: Path, proc_root: Path, dev_root: Path, gpus: bool, fpgas: bool
) -> None:
    """Show the CPUs (by socket, NUMA node and core), NUMA memory, GPUs and FPGAs of this host."""
    topo = discover(sysfs_root, proc_root=proc_root, dev_root=dev_root, gpus=gpus, fpgas=fpgas)
    if as_json:
        click.echo(json.dumps(topology_to_dict(topo), indent=2))
    else:
        click.echo(format_topology(topo))


# --------------------------------------------------------------------------- the table


def format_topology(topo: Topology) -> str:
    """The human-readable listing: a summary line, CPUs by socket -> NUMA node -> core, devices."""
    lines = [_summary(topo), ""]
    for socket in topo.sockets:
        lines.append(f"socket {socket}")
        for node in topo.numa_nodes:
            cores = _cores_on(topo, socket, node.id)
            if cores:
                lines.extend(_node_block(topo, node, cores))
    cpuless = [n for n in topo.numa_nodes if not n.cpus]
    if cpuless:
        lines.append("NUMA nodes without CPUs")
        lines.extend(f"  {_node_heading(n)}" for n in cpuless)
    lines.extend(_gpu_lines(topo.gpus))
    lines.extend(_fpga_lines(topo.fpgas))
    return "\n".join(lines).rstrip()


def _summary(topo: Topology) -> str:
    online = len(topo.online_cpus)
    return (
        f"host {topo.hostname}: {_plural(len(topo.cpus), 'CPU')} ({online} online, "
        f"{len(topo.isolated_cpus)} isolated), {_plural(len(topo.cores), 'core')}, "
        f"{_plural(len(topo.sockets), 'socket')}, {_plural(len(topo.numa_nodes), 'NUMA node')}, "
        f"memory {_size(topo.memory_bytes)}, {_plural(len(topo.gpus), 'GPU')}, "
        f"{_plural(len(topo.fpgas), 'FPGA')}"
    )


def _cores_on(topo: Topology, socket: int, node: int) -> list[tuple[int, list[Cpu]]]:
    """The cores whose first CPU is on ``socket`` and ``node``, each with its CPUs."""
    found = []
    for core, cpu_ids in topo.cores.items():
        cpus = [topo.cpu_by_id[i] for i in cpu_ids]
        if cpus[0].socket == socket and cpus[0].numa == node:
            found.append((core, cpus))
    return found


def _node_block(topo: Topology, node: NumaNode, cores: list[tuple[int, list[Cpu]]]) -> list[str]:
    lines = [f"  {_node_heading(node)}", "    core  L3    CPUs"]
    for core, cpus in cores:
        l3s = sorted({c.l3 for c in cpus if c.l3 is not None})
        l3 = ",".join(map(str, l3s)) or "-"
        shown = " ".join(_cpu_cell(c, topo.isolated_cpus) for c in cpus)
        lines.append(f"    {core:>4}  {l3:<4}  {shown}")
    return lines


def _node_heading(node: NumaNode) -> str:
    heading = (
        f"NUMA node {node.id}: memory {_size(node.memory_bytes)}, CPUs {format_cpulist(node.cpus) or '-'}"
    )
    if node.distances is not None:
        heading += f", distances {' '.join(map(str, node.distances))}"
    return heading


def _cpu_cell(cpu: Cpu, isolated: frozenset[int]) -> str:
    marks = [m for m, on in (("offline", not cpu.online), ("isolated", cpu.id in isolated)) if on]
    return f"{cpu.id}({','.join(marks)})" if marks else str(cpu.id)


def _gpu_lines(gpus: Iterable[Gpu]) -> list[str]:
    lines: list[str] = []
    for g in gpus:
        if not lines:
            lines.append("GPUs")
        lines.append(
            f"  GPU {g.index}: {g.name or 'unknown model'}, pci {g.pci_bus_id}, NUMA {_or_dash(g.numa)}, "
            f"memory {_size(g.memory_bytes)}, {_health(g.healthy, g.health_events)}, uuid {g.uuid or '-'}"
        )
        if g.mig is not None:
            lines.append(f"    MIG {'enabled' if g.mig.enabled else 'disabled'}")
            lines.extend(
                f"      GI {m.gpu_instance_id} CI {_or_dash(m.compute_instance_id)}: {m.profile}, "
                f"memory {_size(m.memory_bytes)}, uuid {m.uuid or '-'}"
                for m in g.mig.instances
            )
    return lines


def _fpga_lines(fpgas: Iterable[Fpga]) -> list[str]:
    lines: list[str] = []
    for f in fpgas:
        if not lines:
            lines.append("FPGAs")
        nodes = " ".join(f.device_nodes) or "-"
        sriov = f", SR-IOV {f.sriov.num_vfs}/{f.sriov.total_vfs} VFs" if f.sriov else ""
        lines.append(
            f"  {f.id}: {f.vendor}:{f.device}, pci {f.pci_bus_id}, NUMA {_or_dash(f.numa)}, "
            f"driver {f.driver or '-'}, {_health(f.healthy, ())}{sriov}, devices {nodes}"
        )
    return lines


def _health(healthy: bool | None, events: Iterable[str]) -> str:
    if healthy is None:
        return "health unknown"
    if healthy:
        return "healthy"
    reasons = ", ".join(events)
    return f"UNHEALTHY ({reasons})" if reasons else "UNHEALTHY"


def _size(n: int | None) -> str:
    return "unknown" if n is None else f"{n / _GIB:.1f} GiB"


def _or_dash(n: int | None) -> str:
    return "-" if n is None else str(n)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
