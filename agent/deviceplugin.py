"""A kubelet device plugin (API v1beta1) for the accelerators the agent manages ([kubernetes] device_plugin).

One gRPC server per resource class, each on its own unix socket in the kubelet's device plugin
directory: ``nodeagent.io/gpu`` (whole GPUs not in MIG mode), ``nodeagent.io/mig-<profile>`` (MIG
instances), ``nodeagent.io/fpga`` and ``nodeagent.io/device-<name>`` (``[placement]
allowed_devices``). Each registers with ``kubelet.sock``; ListAndWatch streams the devices with the
health the agent tracks and pushes the list again when it changes; GetPreferredAllocation keeps a
pod's devices on one NUMA node, the one with the most free CPUs; Allocate answers the agent's CDI
device names (when it writes device specs) or the device nodes, plus NVIDIA_VISIBLE_DEVICES.

The kubelet deletes every plugin socket when it restarts and recreates ``kubelet.sock``: ``poll``
(run by a thread every few seconds) sees either and serves and registers again. Nothing here blocks
the daemon: the servers run on grpcio's threads, and a failure is logged and kept in ``problems``.

The protocol is spoken through grpcio's generic handlers over the protoc messages (api_pb2, typed
by its .pyi) rather than through protoc's untyped service stubs, so this module is the typed seam.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc

from nodeagent.agent.deviceplugin_api import api_pb2 as pb
from nodeagent.devices.topology import Topology
from nodeagent.isolation.cdi import (
    DEVICE_KIND,
    FPGA_KIND,
    GPU_KIND,
    allowed_device_name,
    qualified_name,
    valid_device_name,
)

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
RESOURCE_DOMAIN = "nodeagent.io"
DEFAULT_DIRECTORY = "/var/lib/kubelet/device-plugins/"
#: CUDA's control nodes, handed with every GPU and MIG instance when no CDI spec carries them.
GPU_CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
_SERVICE = f"{API_VERSION}.DevicePlugin"
_REGISTRATION = f"{API_VERSION}.Registration"


@dataclass(frozen=True)
class PluginDevice:
    """One device as a resource class offers it: what the kubelet sees and what Allocate hands out."""

    id: str
    numa: int | None
    healthy: bool
    #: the agent's CDI names (e.g. "nodeagent.io/gpu=GPU-..."); empty: hand the nodes instead
    cdi: tuple[str, ...] = ()
    nodes: tuple[str, ...] = ()
    #: what NVIDIA_VISIBLE_DEVICES lists for it (a GPU or MIG UUID); None: not a CUDA device
    visible: str | None = None


class DeviceSource(Protocol):
    """What the plugins read: the topology with current health, and free CPUs per NUMA node."""

    def topology(self) -> Topology: ...

    def free_cpus_by_numa(self) -> Mapping[int, float]: ...


def resource_name(suffix: str) -> str:
    return f"{RESOURCE_DOMAIN}/{suffix}"


def resource_label(text: str) -> str:
    """A resource name's part after the domain: letters, digits, '-', '_' and '.' only."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-._") or "x"


def resource_devices(
    topology: Topology,
    allowed_devices: Sequence[str] = (),
    *,
    cdi: bool = False,
    exists: Callable[[str], bool] = os.path.exists,
) -> dict[str, tuple[PluginDevice, ...]]:
    """The resource classes (suffix after ``nodeagent.io/``) and their devices. ``cdi``: the agent
    writes its CDI device specs (``[cdi] device_specs``), so Allocate may name them."""
    control = tuple(p for p in GPU_CONTROL_NODES if exists(p))
    out: dict[str, list[PluginDevice]] = {}
    for gpu in sorted(topology.gpus, key=lambda g: g.index):
        healthy = gpu.healthy is not False
        base = () if gpu.minor is None else (f"/dev/nvidia{gpu.minor}", *control)
        if gpu.mig is not None and gpu.mig.enabled:
            # The instances are the unit; the whole GPU is not offered beside them.
            for inst in gpu.mig.instances:
                ci = "" if inst.compute_instance_id is None else f"-{inst.compute_instance_id}"
                out.setdefault(f"mig-{resource_label(inst.profile)}", []).append(
                    PluginDevice(
                        id=inst.uuid or f"{gpu.index}-{inst.gpu_instance_id}{ci}",
                        numa=gpu.numa,
                        healthy=healthy,
                        nodes=(*base, *inst.device_nodes),
                        visible=inst.uuid,
                    )
                )
            continue
        name = gpu.uuid or str(gpu.index)
        names = (
            (qualified_name(GPU_KIND, name),)
            if cdi and gpu.minor is not None and valid_device_name(name)
            else ()
        )
        out.setdefault("gpu", []).append(
            PluginDevice(
                id=name,
                numa=gpu.numa,
                healthy=healthy,
                cdi=names,
                nodes=base,
                visible=gpu.uuid or str(gpu.index),
            )
        )
    for fpga in topology.fpgas:
        names = (
            (qualified_name(FPGA_KIND, fpga.id),)
            if cdi and fpga.device_nodes and valid_device_name(fpga.id)
            else ()
        )
        out.setdefault("fpga", []).append(
            PluginDevice(
                id=fpga.id,
                numa=fpga.numa,
                healthy=fpga.healthy is not False,
                cdi=names,
                nodes=fpga.device_nodes,
            )
        )
    for path in allowed_devices:
        name = allowed_device_name(path)
        names = (qualified_name(DEVICE_KIND, name),) if cdi and valid_device_name(name) else ()
        out.setdefault(f"device-{name}", []).append(
            PluginDevice(id=name, numa=None, healthy=exists(path), cdi=names, nodes=(path,))
        )
    return {k: tuple(v) for k, v in out.items()}


def preferred(
    devices: Mapping[str, PluginDevice],
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    free_cpus: Mapping[int, float],
) -> list[str]:
    """``size`` of ``available``, ``must_include`` first, on as few NUMA nodes as possible: the
    must-include devices' node first, then the nodes with the most free CPUs (a pod's CPUs come from
    where CPUs are free, so its devices should sit there too). ValueError on bad input."""
    unknown = [d for d in (*available, *must_include) if d not in devices]
    if unknown:
        raise ValueError(f"unknown device ids {sorted(set(unknown))}")
    if size < len(set(must_include)) or size > len(set(available) | set(must_include)):
        raise ValueError(
            f"allocation size {size} does not fit {len(set(must_include))} must-include and "
            f"{len(set(available))} available devices"
        )
    chosen = list(dict.fromkeys(must_include))
    rest = [d for d in dict.fromkeys(available) if d not in chosen]
    need = size - len(chosen)
    pinned = [devices[d].numa for d in chosen if devices[d].numa is not None]
    numas = {n for d in rest if (n := devices[d].numa) is not None}
    nodes = sorted(numas, key=lambda n: (-free_cpus.get(n, 0), n))
    order = list(dict.fromkeys([*pinned, *nodes]))
    by_node = {n: [d for d in rest if devices[d].numa == n] for n in order}
    # One node that holds all that is missing wins; else fill node by node in the same order.
    whole = next((n for n in order if len(by_node[n]) >= need), None)
    if whole is not None:
        return chosen + by_node[whole][:need]
    ranked = [d for n in order for d in by_node[n]] + [d for d in rest if devices[d].numa is None]
    return chosen + ranked[:need]


@dataclass
class _Resource:
    """One resource class: its devices, its gRPC server and the streams waiting for a change."""

    suffix: str
    devices: tuple[PluginDevice, ...]
    socket: Path
    server: Any = None
    generation: int = 0
    changed: threading.Condition = field(default_factory=threading.Condition)
    closed: bool = False

    @property
    def name(self) -> str:
        return resource_name(self.suffix)

    def by_id(self) -> dict[str, PluginDevice]:
        return {d.id: d for d in self.devices}


class DevicePlugins:
    """Serves and registers one device plugin per resource class; ``start``, ``poll``, ``close``."""

    def __init__(
        self,
        source: DeviceSource,
        directory: Path,
        *,
        allowed_devices: Sequence[str] = (),
        cdi: bool = False,
        # A kubelet restart (a new kubelet.sock) or a device's health change reaches the kubelet
        # within a poll: 1 s (issue 22: capacity visible to the kubelet within 1 s). A poll is a
        # stat of the socket and a walk of the agent's in-memory topology.
        interval_s: float = 1.0,
        register_timeout_s: float = 5.0,
    ) -> None:
        self._source = source
        self._dir = directory
        self._allowed = tuple(allowed_devices)
        self._cdi = cdi
        self._interval = interval_s
        self._register_timeout = register_timeout_s
        self._resources: dict[str, _Resource] = {}
        self._kubelet: tuple[int, int] | None = None
        self._problems: dict[str, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def resources(self) -> dict[str, tuple[PluginDevice, ...]]:
        with self._lock:
            return {r.name: r.devices for r in self._resources.values()}

    def socket(self, resource: str) -> Path:
        return self._dir / f"nodeagent-{resource_label(resource.removeprefix(RESOURCE_DOMAIN + '/'))}.sock"

    def problems(self) -> tuple[str, ...]:
        """What keeps a resource from the kubelet now (empty when every one is registered)."""
        with self._lock:
            return tuple(self._problems[k] for k in sorted(self._problems))

    def start(self, *, watch: bool = True) -> None:
        """``watch``: serve, register and poll in a daemon thread, the first poll at once; the
        caller never waits on the kubelet (a hung kubelet socket costs a registration timeout
        per resource, which must not hold up the agent's start). Without ``watch``: one poll
        now, in the caller's thread (tests drive ``poll`` themselves)."""
        if not watch:
            self.poll()
            return
        self._thread = threading.Thread(target=self._run, name="device-plugins", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self.poll()
            except Exception:  # a poll that fails tries again next interval; the daemon goes on
                log.exception("device plugin poll failed")
            if self._stop.wait(self._interval):
                return

    def poll(self) -> None:
        """Take the devices' current state, push changes to ListAndWatch, and serve and register
        again where the kubelet restarted (``kubelet.sock`` replaced) or removed a socket."""
        found = resource_devices(self._source.topology(), self._allowed, cdi=self._cdi)
        kubelet = _identity(self._dir / KUBELET_SOCKET)
        restarted = kubelet is not None and kubelet != self._kubelet
        for suffix in sorted(set(found) | set(self._resources)):
            devices = found.get(suffix, ())
            res = self._resources.get(suffix)
            if res is None:
                res = _Resource(suffix, devices, self.socket(resource_name(suffix)))
                with self._lock:
                    self._resources[suffix] = res
            elif res.devices != devices:
                with res.changed:
                    res.devices = devices
                    res.generation += 1
                    res.changed.notify_all()
            if res.server is None or not res.socket.exists():
                self._serve(res)
                self._register(res)
            elif restarted or res.name in self._problems:
                self._register(res)
        if kubelet is not None:
            self._kubelet = kubelet

    def _serve(self, res: _Resource) -> None:
        if res.server is not None:
            res.server.stop(None)
        self._dir.mkdir(parents=True, exist_ok=True)
        res.socket.unlink(missing_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"dp-{res.suffix}"))
        server.add_generic_rpc_handlers((_handlers(res, self._source),))
        server.add_insecure_port(f"unix://{res.socket}")
        server.start()
        res.server = server

    def _register(self, res: _Resource) -> None:
        kubelet = self._dir / KUBELET_SOCKET
        if not kubelet.exists():
            self._problem(res, f"{res.name}: no kubelet socket at {kubelet} (waiting for the kubelet)")
            return
        request = pb.RegisterRequest(
            version=API_VERSION,
            endpoint=res.socket.name,
            resource_name=res.name,
            options=pb.DevicePluginOptions(get_preferred_allocation_available=True),
        )
        try:
            with grpc.insecure_channel(f"unix://{kubelet}") as channel:
                register = channel.unary_unary(
                    f"/{_REGISTRATION}/Register",
                    request_serializer=pb.RegisterRequest.SerializeToString,
                    response_deserializer=pb.Empty.FromString,
                )
                register(request, timeout=self._register_timeout)
        except grpc.RpcError as err:
            self._problem(
                res,
                f"{res.name}: the kubelet refused or missed the registration: {err.code()} {err.details()}",
            )
            return
        with self._lock:
            self._problems.pop(res.name, None)
        log.info("device plugin registered", extra={"resource": res.name, "devices": len(res.devices)})

    def _problem(self, res: _Resource, text: str) -> None:
        with self._lock:
            fresh = self._problems.get(res.name) != text
            self._problems[res.name] = text
        if fresh:
            log.warning("device plugin: %s", text)

    def close(self) -> None:
        """Stop polling, end the streams, stop the servers and remove their sockets."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            resources = list(self._resources.values())
            self._resources.clear()
        for res in resources:
            with res.changed:
                res.closed = True
                res.changed.notify_all()
            if res.server is not None:
                res.server.stop(None).wait()
            res.socket.unlink(missing_ok=True)


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _device_message(d: PluginDevice) -> pb.Device:
    return pb.Device(
        ID=d.id,
        health="Healthy" if d.healthy else "Unhealthy",
        topology=None if d.numa is None else pb.TopologyInfo(nodes=[pb.NUMANode(ID=d.numa)]),
    )


def _handlers(res: _Resource, source: DeviceSource) -> Any:
    """grpcio's handlers for one resource's DevicePlugin service."""

    def options(_request: pb.Empty, _context: Any) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(get_preferred_allocation_available=True)

    def list_and_watch(_request: pb.Empty, context: Any) -> Iterator[pb.ListAndWatchResponse]:
        seen = [-1]  # a cell, so the wait's predicate reads the current value
        while True:
            with res.changed:
                # Wakes on a change, on close, or now and then to notice a kubelet that hung up.
                res.changed.wait_for(lambda: res.closed or res.generation != seen[0], timeout=1.0)
                if res.closed or not context.is_active():
                    return
                if res.generation == seen[0]:
                    continue
                seen[0] = res.generation
                devices = res.devices
            yield pb.ListAndWatchResponse(devices=[_device_message(d) for d in devices])

    def preferred_allocation(
        request: pb.PreferredAllocationRequest, context: Any
    ) -> pb.PreferredAllocationResponse:
        known = res.by_id()
        answers = []
        for req in request.container_requests:
            try:
                ids = preferred(
                    known,
                    list(req.available_deviceIDs),
                    list(req.must_include_deviceIDs),
                    req.allocation_size,
                    source.free_cpus_by_numa(),
                )
            except ValueError as err:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{res.name}: {err}")
            answers.append(pb.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return pb.PreferredAllocationResponse(container_responses=answers)

    def allocate(request: pb.AllocateRequest, context: Any) -> pb.AllocateResponse:
        known = res.by_id()
        answers = []
        for req in request.container_requests:
            ids = list(req.devices_ids)
            unknown = sorted({i for i in ids if i not in known})
            if unknown or not ids:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"{res.name}: unknown or no device ids {unknown}"
                )
            answers.append(_allocation([known[i] for i in ids]))
        return pb.AllocateResponse(container_responses=answers)

    def pre_start(_request: pb.PreStartContainerRequest, _context: Any) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()  # not asked for (pre_start_required is false)

    unary = grpc.unary_unary_rpc_method_handler
    return grpc.method_handlers_generic_handler(
        _SERVICE,
        {
            "GetDevicePluginOptions": unary(
                options, pb.Empty.FromString, pb.DevicePluginOptions.SerializeToString
            ),
            "ListAndWatch": grpc.unary_stream_rpc_method_handler(
                list_and_watch, pb.Empty.FromString, pb.ListAndWatchResponse.SerializeToString
            ),
            "GetPreferredAllocation": unary(
                preferred_allocation,
                pb.PreferredAllocationRequest.FromString,
                pb.PreferredAllocationResponse.SerializeToString,
            ),
            "Allocate": unary(allocate, pb.AllocateRequest.FromString, pb.AllocateResponse.SerializeToString),
            "PreStartContainer": unary(
                pre_start,
                pb.PreStartContainerRequest.FromString,
                pb.PreStartContainerResponse.SerializeToString,
            ),
        },
    )


def _allocation(devices: Sequence[PluginDevice]) -> pb.ContainerAllocateResponse:
    """CDI names where the agent has a spec for every device, else the device nodes themselves."""
    answer = pb.ContainerAllocateResponse()
    if all(d.cdi for d in devices):
        answer.cdi_devices.extend(pb.CDIDevice(name=n) for d in devices for n in d.cdi)
    else:
        nodes = dict.fromkeys(n for d in devices for n in d.nodes)
        answer.devices.extend(pb.DeviceSpec(container_path=n, host_path=n, permissions="rw") for n in nodes)
    visible = [d.visible for d in devices if d.visible is not None]
    if visible:
        answer.envs["NVIDIA_VISIBLE_DEVICES"] = ",".join(visible)
    return answer


__all__ = [
    "API_VERSION",
    "DEFAULT_DIRECTORY",
    "DevicePlugins",
    "DeviceSource",
    "PluginDevice",
    "preferred",
    "resource_devices",
    "resource_label",
    "resource_name",
]
