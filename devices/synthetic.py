"""Made-up but realistic topologies, for tests, benchmarks and "what if" plans.

CPU ids follow Linux's usual enumeration: the first thread of every core, socket by socket, then the
second threads in the same order (so on a 2-socket, 2-thread host CPU 0 and CPU N/2 are siblings).
The distance matrix follows a typical SLIT: 10 local, 12 between nodes of one socket, 32 across.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from nodeagent.devices.topology import Cpu, Fpga, Gpu, MigInstance, MigState, NumaNode, Topology

GIB = 2**30
LOCAL_DISTANCE = 10
SAME_SOCKET_DISTANCE = 12
REMOTE_DISTANCE = 32


def synthetic_topology(
    sockets: int = 1,
    numa_per_socket: int = 1,
    cores_per_numa: int = 4,
    threads_per_core: int = 2,
    *,
    gpus_per_numa: int = 0,
    gpu_numa: Sequence[int | None] | None = None,
    mig: Mapping[int, Sequence[str]] | None = None,
    unhealthy_gpus: Collection[int] = (),
    fpgas_per_numa: int = 0,
    memory_per_numa: int = 64 * GIB,
    offline: Collection[int] = (),
    isolated: Collection[int] = (),
    l3_per_numa: int = 1,
    hostname: str = "synthetic",
) -> Topology:
    """A host of ``sockets x numa_per_socket`` NUMA nodes, each with ``cores_per_numa`` cores.

    GPUs: ``gpus_per_numa`` on every node, or ``gpu_numa`` giving each GPU's node (None: unknown).
    ``mig`` maps a GPU index to the profiles of the MIG instances that exist on it.
    """
    if min(sockets, numa_per_socket, cores_per_numa, threads_per_core, l3_per_numa) < 1:
        raise ValueError("sockets, numa_per_socket, cores_per_numa, threads_per_core, l3_per_numa >= 1")
    nodes = sockets * numa_per_socket
    total_cores = nodes * cores_per_numa
    cpus: list[Cpu] = []
    for thread in range(threads_per_core):
        for core in range(total_cores):
            node = core // cores_per_numa
            l3 = node * l3_per_numa + (core % cores_per_numa) * l3_per_numa // cores_per_numa
            cpu_id = thread * total_cores + core
            cpus.append(Cpu(cpu_id, core, node // numa_per_socket, node, l3, cpu_id not in offline))
    numa_nodes = tuple(
        NumaNode(
            id=node,
            cpus=tuple(c.id for c in cpus if c.numa == node),
            memory_bytes=memory_per_numa,
            distances=tuple(_distance(node, other, numa_per_socket) for other in range(nodes)),
        )
        for node in range(nodes)
    )
    layout = (
        list(gpu_numa) if gpu_numa is not None else [n for n in range(nodes) for _ in range(gpus_per_numa)]
    )
    gpus = tuple(
        _gpu(index, node, (mig or {}).get(index), index not in unhealthy_gpus)
        for index, node in enumerate(layout)
    )
    fpgas = tuple(
        _fpga(node * fpgas_per_numa + i, node) for node in range(nodes) for i in range(fpgas_per_numa)
    )
    return Topology(
        hostname=hostname,
        cpus=tuple(sorted(cpus, key=lambda c: c.id)),
        numa_nodes=numa_nodes,
        gpus=gpus,
        fpgas=fpgas,
        memory_bytes=memory_per_numa * nodes,
        isolated_cpus=frozenset(isolated),
    )


def _distance(a: int, b: int, numa_per_socket: int) -> int:
    if a == b:
        return LOCAL_DISTANCE
    return SAME_SOCKET_DISTANCE if a // numa_per_socket == b // numa_per_socket else REMOTE_DISTANCE


def _gpu(index: int, node: int | None, profiles: Sequence[str] | None, healthy: bool) -> Gpu:
    mig = None
    if profiles is not None:
        mig = MigState(
            enabled=True,
            instances=tuple(
                MigInstance(
                    gpu_instance_id=gi,
                    compute_instance_id=0,
                    profile=profile,
                    placement_start=None,
                    placement_size=None,
                    uuid=f"MIG-{index:08x}-0000-0000-0000-{gi:012x}",
                    memory_bytes=None,
                    device_nodes=(f"/dev/nvidia-caps/nvidia-cap{index * 100 + gi}",),
                )
                for gi, profile in enumerate(profiles, start=1)
            ),
        )
    return Gpu(
        index=index,
        uuid=f"GPU-{index:08x}-0000-0000-0000-000000000000",
        name="Synthetic GPU 80GB",
        pci_bus_id=f"0000:{0x10 + index:02x}:00.0",
        numa=node,
        memory_bytes=80 * GIB,
        mig=mig,
        minor=index,
        healthy=healthy,
        health_events=() if healthy else ("xid 79",),
    )


def _fpga(number: int, node: int) -> Fpga:
    return Fpga(
        id=f"fpga{number}",
        vendor="0x10ee",
        device="0x5000",
        pci_bus_id=f"0000:{0x80 + number:02x}:00.0",
        numa=node,
        device_nodes=(f"/dev/xclmgmt{number}",),
        healthy=True,
    )
