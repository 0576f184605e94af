"""A slot's device allow-list: the safe set every process needs, plus the slot's own devices.

Everything not on the list is refused (v1: the devices controller; v2: the eBPF program the
cgroup manager attaches). Access is read/write, and mknod for exactly the nodes the worker sandbox
makes in its private /dev: the six standard ones (null, zero, full, random, urandom, tty) and the
slot's own devices. Mknod is what lets the sandbox give the slot's uid its own node (owner and
mode of the sandbox's choosing, in a /dev only that worker sees) without touching the host's node,
which may be root's 0600 (an FPGA, a VFIO group, a loop device); the bind mount of the host's node
it falls back to without 'm' keeps the host's owner and mode, and costs three times a mknod
(~0.3-0.6 ms per launch measured in a slot here). 'm' grants nothing the slot cannot do already: a
node made of its own numbers opens only what its 'rw' opens, and a sandboxed worker never holds
CAP_MKNOD (``runtime.sandbox.caps.NEVER_FOR_ROOT``: no request or configuration can give it).

Building the rules is pure (:func:`device_rules`); finding the type and numbers of the slot's
device paths is the one piece of I/O (:func:`resolve_device_nodes`), done before any kernel
object exists so a wrong path fails the request cleanly.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from nodeagent.cgroups import DeviceRule
from nodeagent.devices.pci import DeviceNumber, device_node_info
from nodeagent.devices.topology import Topology
from nodeagent.errors import InvalidRequest, NotFound

if TYPE_CHECKING:
    from nodeagent.isolation.slot_spec import IsolatorConfig, SlotIsolationSpec

SLOT_ACCESS = "rw"
#: The nodes the sandbox makes with mknod: the standard ones and the slot's own (module docstring).
MADE_ACCESS = "rwm"

#: What any process expects to open: null, zero, full, random, urandom, tty, ptmx and the
#: pseudo-terminals (Unix98 pty slaves, major 136).
SAFE_DEVICES: tuple[DeviceRule, ...] = (
    DeviceRule("c", 1, 3, MADE_ACCESS),
    DeviceRule("c", 1, 5, MADE_ACCESS),
    DeviceRule("c", 1, 7, MADE_ACCESS),
    DeviceRule("c", 1, 8, MADE_ACCESS),
    DeviceRule("c", 1, 9, MADE_ACCESS),
    DeviceRule("c", 5, 0, MADE_ACCESS),
    DeviceRule("c", 5, 2, SLOT_ACCESS),
    DeviceRule("c", 136, None, SLOT_ACCESS),
)

#: What runc (1.1) writes into every container's v1 device cgroup whatever the container spec says:
#: mknod of any node (opening still needs its own rule), the console and /dev/net/tun, and mknod
#: on the pty nodes. A v1 child cgroup can only hold rules its parent has, so a slot whose worker is
#: a container (its cgroup is the container's parent) must have these, or the container cannot
#: start ("write devices.allow: operation not permitted"). None lets a process open any node the
#: slot's list does not name; a sandboxed or container worker holds no CAP_MKNOD by default anyway.
CONTAINER_RUNTIME_DEVICES: tuple[DeviceRule, ...] = (
    DeviceRule("c", None, None, "m"),
    DeviceRule("b", None, None, "m"),
    DeviceRule("c", 5, 1, MADE_ACCESS),
    DeviceRule("c", 10, 200, MADE_ACCESS),
    DeviceRule("c", 5, 2, MADE_ACCESS),
    DeviceRule("c", 136, None, MADE_ACCESS),
)

#: What CUDA opens besides the GPU's own node; added for GPU slots where the host has them.
GPU_CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


def device_rules(
    nodes: Iterable[DeviceNumber], safe: Iterable[DeviceRule] = SAFE_DEVICES
) -> tuple[DeviceRule, ...]:
    """The allow-list: ``safe`` plus read, write and mknod on each of the slot's ``nodes`` (the
    sandbox makes them in the worker's private /dev), sorted and without duplicates."""
    # One rule per device class: two for the same class (rw and rwm) become one with both accesses.
    access: dict[tuple[str, int | None, int | None], str] = {}
    for rule in safe:
        access[rule.key] = access.get(rule.key, "") + rule.access
    for node in nodes:
        key = (node.type, node.major, node.minor)
        access[key] = access.get(key, "") + MADE_ACCESS
    return tuple(sorted((DeviceRule(*key, "".join(set(a))) for key, a in access.items()), key=_order))


def _order(rule: DeviceRule) -> tuple[str, int, int]:
    """Sorted by type and numbers, '*' (None) first."""
    return (rule.type, -1 if rule.major is None else rule.major, -1 if rule.minor is None else rule.minor)


def resolve_device_nodes(
    slot_id: str, required: Iterable[str], optional: Iterable[str] = ()
) -> tuple[DeviceNumber, ...]:
    """Type and numbers of every ``required`` path (each must be a device node) and of each
    ``optional`` one that exists. Raises NotFound / InvalidRequest naming the path."""
    found: list[DeviceNumber] = []
    for path in required:
        try:
            found.append(device_node_info(path))
        except NotFound as err:
            raise NotFound(
                f"slot {slot_id} asks for device {path}, which does not exist on this host; check the "
                "path and that its driver is loaded, or drop it from the request"
            ) from err
        except InvalidRequest as err:
            raise InvalidRequest(
                f"slot {slot_id} asks for device {path}, which is not a character or block device "
                "node; give its node under /dev"
            ) from err
    found += [device_node_info(path) for path in optional if Path(path).exists()]
    return tuple(found)


def slot_device_rules(spec: SlotIsolationSpec, config: IsolatorConfig) -> tuple[DeviceRule, ...]:
    """The allow-list of ``spec``'s slot, resolving its device paths on this host."""
    optional = config.gpu_control_nodes if spec.gpu else ()
    safe = (*config.safe_devices, *(CONTAINER_RUNTIME_DEVICES if spec.containers else ()))
    return device_rules(resolve_device_nodes(spec.slot_id, spec.device_paths, optional), safe)


def assigned_device_nodes(
    topology: Topology,
    *,
    gpus: Iterable[int] = (),
    mig: Iterable[tuple[int, int, int | None]] = (),
    fpgas: Iterable[str] = (),
    named: Iterable[str] = (),
) -> tuple[str, ...]:
    """The device nodes behind what placement assigned: ``named`` paths as they are, each held GPU's
    ``/dev/nvidiaN`` (by its minor number), the capability nodes of each MIG instance
    ``(gpu index, GPU instance id, compute instance id)`` and each FPGA's nodes; in that order,
    without duplicates. A GPU or FPGA the topology no longer lists contributes nothing."""
    paths = list(named)
    by_index = {gpu.index: gpu for gpu in topology.gpus}
    mig = tuple(mig)
    for index in sorted(set(gpus) | {m[0] for m in mig}):
        gpu = by_index.get(index)
        if gpu is not None and gpu.minor is not None:
            paths.append(f"/dev/nvidia{gpu.minor}")
    for gpu_index, gpu_instance, compute_instance in mig:
        gpu = by_index.get(gpu_index)
        instances = gpu.mig.instances if gpu is not None and gpu.mig is not None else ()
        for inst in instances:
            if inst.gpu_instance_id == gpu_instance and inst.compute_instance_id == compute_instance:
                paths += inst.device_nodes
    by_id = {fpga.id: fpga for fpga in topology.fpgas}
    for fpga_id in fpgas:
        if fpga_id in by_id:
            paths += by_id[fpga_id].device_nodes
    return tuple(dict.fromkeys(paths))
