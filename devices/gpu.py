"""NVIDIA GPUs through NVML (nvidia-ml-py's ``pynvml``), behind a small backend interface.

``discover_gpus()`` is what topology discovery calls; ``discover_gpus_with(backend, ...)`` does the
same with any ``GpuBackend`` and returns a ``GpuInventory`` that also says why there is no GPU
(``nodeagent doctor`` shows it). A host without driver or without GPU is a normal state, never an
exception.

What NVML does not know comes from the kernel: a GPU's NUMA node from
``/sys/bus/pci/devices/<bus id>/numa_node`` when NVML has no answer, and the device nodes that grant
access to a MIG instance from ``/proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<G>[/ci<C>]/access``
("DeviceFileMinor: N" -> ``/dev/nvidia-caps/nvidia-capN``), as the NVIDIA container toolkit reads them.
"""

from __future__ import annotations

import ctypes
import math
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

from nodeagent.devices.topology import Gpu, MigInstance, MigState
from nodeagent.errors import DiscoveryError
from nodeagent.kernelfs import Procfs, Sysfs

GpuStatus = Literal["ok", "no_driver", "no_gpus", "error"]
EventKind = Literal["watching", "unwatched", "xid", "ecc_dbe", "ecc_sbe", "lost", "other"]

NVIDIA_VENDOR = "0x10de"
_GPU_CLASSES = ("0x0300", "0x0302")  # VGA controller, 3D controller
_NO_INSTANCE = 0xFFFFFFFF  # NVML's "event not scoped to a GPU/compute instance"
_MIB = 1024 * 1024
_GIB = 1024 * _MIB
LOST = "gpu lost"

T = TypeVar("T")


class GpuUnavailable(DiscoveryError):
    """NVML cannot run here: the NVIDIA library or kernel driver is missing. A normal state."""


#: The library pynvml loads (on Linux).
NVML_LIBRARY = "libnvidia-ml.so.1"
NO_DRIVER = (
    f"no NVIDIA driver: {NVML_LIBRARY} is not installed; install the NVIDIA driver if this host has GPUs"
)


def nvml_library_loadable(name: str = NVML_LIBRARY) -> bool:
    """Whether the NVIDIA management library can be loaded here. Asked before pynvml is imported:
    on a host without the driver the module (with what it imports) is ~1-3 MB of the daemon's
    memory for nothing but the answer "no library"."""
    try:
        ctypes.CDLL(name)
    except OSError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class GpuReading:
    """What the backend read about one GPU; discovery completes it from sysfs and /proc."""

    index: int
    uuid: str | None
    name: str | None
    pci_bus_id: str | None  #: normalised "0000:1b:00.0"; None when the GPU could not be queried
    numa: int | None  #: from NVML; None when NVML does not say
    memory_bytes: int | None
    minor: int | None
    mig: MigState | None  #: instances come without device_nodes
    lost: bool = False
    problems: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class GpuEvent:
    """A health-relevant happening on one GPU (or on a MIG instance of it)."""

    index: int
    uuid: str | None
    kind: EventKind
    xid: int | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    detail: str = ""


@dataclass(frozen=True, slots=True)
class GpuInventory:
    status: GpuStatus
    message: str
    gpus: tuple[Gpu, ...] = ()
    driver_version: str | None = None
    problems: tuple[str, ...] = ()  #: what could not be read, one line each


class GpuBackend(Protocol):
    """The few questions discovery asks of a GPU library."""

    def open(self) -> None:
        """Start a session; raises GpuUnavailable (no driver) or DiscoveryError."""

    def close(self) -> None: ...

    def driver_version(self) -> str | None: ...

    def device_count(self) -> int: ...

    def read_gpu(self, index: int) -> GpuReading:
        """Raises DiscoveryError when the GPU cannot be identified at all."""
        ...


# --------------------------------------------------------------------------- discovery


def discover_gpus(sysfs_root: Path = Path("/sys"), proc_root: Path = Path("/proc")) -> tuple[Gpu, ...]:
    """Every NVIDIA GPU NVML reports; () when there is no GPU or no driver."""
    return discover_gpus_with(NvmlBackend(), sysfs_root, proc_root).gpus


def discover_gpus_with(
    backend: GpuBackend, sysfs_root: Path = Path("/sys"), proc_root: Path = Path("/proc")
) -> GpuInventory:
    try:
        backend.open()
    except GpuUnavailable as err:
        return GpuInventory(status="no_driver", message=str(err))
    except DiscoveryError as err:
        return GpuInventory(status="error", message=str(err))
    try:
        return _inventory(backend, sysfs_root, proc_root)
    except DiscoveryError as err:
        return GpuInventory(status="error", message=str(err))
    finally:
        backend.close()


def _inventory(backend: GpuBackend, sysfs_root: Path, proc_root: Path) -> GpuInventory:
    version = backend.driver_version()
    count = backend.device_count()
    if count == 0:
        return GpuInventory(
            status="no_gpus",
            message=f"the NVIDIA driver {version or '(unknown version)'} is loaded but reports no GPU",
            driver_version=version,
        )
    gpus: list[Gpu] = []
    problems: list[str] = []
    for index in range(count):
        try:
            reading = backend.read_gpu(index)
        except DiscoveryError as err:
            problems.append(f"GPU {index}: {err}")
            continue
        problems += [f"GPU {index}: {p}" for p in reading.problems]
        gpu = _complete(reading, sysfs_root, proc_root, problems)
        if gpu is not None:
            gpus.append(gpu)
    message = f"{len(gpus)} of {count} NVIDIA GPUs read, driver {version or '(unknown version)'}"
    return GpuInventory("ok", message, tuple(gpus), version, tuple(problems))


def _complete(r: GpuReading, sysfs_root: Path, proc_root: Path, problems: list[str]) -> Gpu | None:
    # What NVML does not say comes from sysfs and /proc; a kernel file there that cannot be read
    # costs this GPU that detail (a line in problems), not the whole inventory.
    bus_id = r.pci_bus_id
    if bus_id is None:
        # NVML numbers GPUs in PCI bus order, so the index still names the card in sysfs.
        try:
            nvidia = nvidia_gpus_in_sysfs(sysfs_root)
        except DiscoveryError as err:
            problems.append(f"GPU {r.index}: NVML cannot query it and sysfs cannot be listed: {err}")
            return None
        if r.index >= len(nvidia):
            problems.append(
                f"GPU {r.index}: NVML cannot query it and sysfs lists only {len(nvidia)} NVIDIA GPUs, "
                "so its PCI address is unknown; check `nvidia-smi` and the kernel log"
            )
            return None
        bus_id = nvidia[r.index]
    numa = r.numa
    if numa is None:
        try:
            numa = sysfs_numa_node(sysfs_root, bus_id)
        except DiscoveryError as err:
            problems.append(f"GPU {r.index}: its NUMA node is unknown: {err}")
    mig = r.mig
    if mig is not None and r.minor is not None:
        mig = _with_device_nodes(mig, proc_root, r.minor, problems, r.index)
    return Gpu(
        index=r.index,
        uuid=r.uuid,
        name=r.name,
        pci_bus_id=bus_id,
        numa=numa,
        memory_bytes=r.memory_bytes,
        mig=mig,
        minor=r.minor,
        healthy=False if r.lost else None,
        health_events=(LOST,) if r.lost else (),
    )


def _with_device_nodes(
    mig: MigState, proc_root: Path, minor: int, problems: list[str], index: int
) -> MigState:
    instances = []
    for m in mig.instances:
        try:
            nodes = mig_device_nodes(proc_root, minor, m.gpu_instance_id, m.compute_instance_id)
        except DiscoveryError as err:
            problems.append(f"GPU {index}: MIG instance {m.gpu_instance_id}: {err}")
            nodes = ()
        if nodes is None:
            problems.append(
                f"GPU {index}: no MIG capability files for GPU instance {m.gpu_instance_id} under "
                f"{proc_root}/driver/nvidia/capabilities/gpu{minor}; the instance cannot be handed "
                "to a slot until the driver exposes them"
            )
            nodes = ()
        instances.append(replace(m, device_nodes=nodes))
    return replace(mig, instances=tuple(instances))


# --------------------------------------------------------------------------- kernel side


def normalise_pci_bus_id(raw: str | bytes) -> str:
    """NVML's "00000000:1B:00.0" (bytes or str) -> sysfs's "0000:1b:00.0"."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    text = text.strip("\x00 \n").lower()
    match = re.fullmatch(r"([0-9a-f]{4,8}):([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])", text)
    if match is None:
        raise DiscoveryError(f"NVML gave PCI bus id {text!r}; expected DOMAIN:BUS:DEVICE.FUNCTION in hex")
    domain, bus, device, function = match.groups()
    return f"{int(domain, 16):04x}:{bus}:{device}.{function}"


def sysfs_numa_node(sysfs_root: Path, bus_id: str) -> int | None:
    """The PCI device's NUMA node; None when unknown (-1 means the platform did not say)."""
    node = Sysfs(sysfs_root).read_int(f"bus/pci/devices/{bus_id}/numa_node")
    return node if node is not None and node >= 0 else None


def nvidia_gpus_in_sysfs(sysfs_root: Path) -> list[str]:
    """PCI addresses of the NVIDIA display and 3D controllers, in bus order."""
    sysfs = Sysfs(sysfs_root)
    return [
        name
        for name in sysfs.listdir("bus/pci/devices") or []
        if sysfs.read_text(f"bus/pci/devices/{name}/vendor") == NVIDIA_VENDOR
        and (sysfs.read_text(f"bus/pci/devices/{name}/class") or "").startswith(_GPU_CLASSES)
    ]


def _cap_minor(procfs: Procfs, rel: str) -> int | None:
    text = procfs.read_text(rel)
    if text is None:
        return None
    match = re.search(r"^DeviceFileMinor:\s*(\d+)", text, re.MULTILINE)
    return int(match.group(1)) if match else None


def mig_device_nodes(proc_root: Path, gpu_minor: int, gi: int, ci: int | None) -> tuple[str, ...] | None:
    """The /dev/nvidia-caps nodes a process needs to use one MIG instance; None when not exposed."""
    procfs = Procfs(proc_root)
    gi_dir = f"driver/nvidia/capabilities/gpu{gpu_minor}/mig/gi{gi}"
    rels = [f"{gi_dir}/access"] + ([f"{gi_dir}/ci{ci}/access"] if ci is not None else [])
    minors = [_cap_minor(procfs, rel) for rel in rels]
    if any(m is None for m in minors):
        return None
    return tuple(f"/dev/nvidia-caps/nvidia-cap{m}" for m in minors)


def mig_profile_name(gi_slices: int, ci_slices: int, memory_mb: int, gpu_memory_bytes: int | None) -> str:
    """A MIG profile's name ("3g.40gb", "1c.3g.40gb") from its slices and memory.

    For drivers whose profile infos carry no name. The memory part is the instance's share of the
    GPU rounded up to eighths, times the GPU's memory in whole GB, as NVIDIA's device plugin does:
    a "7g.80gb" instance has 79.25 GiB.
    """
    if gpu_memory_bytes:
        share = math.ceil(memory_mb * _MIB / gpu_memory_bytes * 8) / 8
        gb = round(share * math.ceil(gpu_memory_bytes / _GIB))
    else:
        gb = round(memory_mb / 1024)
    name = f"{gi_slices}g.{gb}gb"
    return f"{ci_slices}c.{name}" if ci_slices < gi_slices else name


# --------------------------------------------------------------------------- NVML backend


def _text(value: str | bytes) -> str:
    # nvidia-ml-py decodes most strings, but struct fields (busId, profile name) stay bytes.
    return (value.decode(errors="replace") if isinstance(value, bytes) else value).rstrip("\x00")


class NvmlBackend:
    """GpuBackend (and health event source) over a pynvml-compatible module.

    ``nvml_module`` is the real ``pynvml`` by default, imported on first use so that hosts
    without GPUs never need it; tests pass a fake with the same functions and exceptions.
    """

    def __init__(self, nvml_module: Any = None) -> None:
        self._nvml = nvml_module
        self._sessions = 0  # NVML counts nvmlInit calls; every open is matched by one close
        self._event_set: Any = None
        self._watched: dict[int, Any] = {}  # index -> handle
        self._uuid_index: dict[str, int] = {}

    @property
    def nvml(self) -> Any:
        if self._nvml is None:
            if not nvml_library_loadable():
                raise GpuUnavailable(NO_DRIVER)
            try:
                import pynvml  # noqa: PLC0415 - optional at import time, needed only here
            except ImportError as err:
                raise DiscoveryError(
                    "cannot read NVIDIA GPUs: the pynvml module is missing; install nvidia-ml-py"
                ) from err
            self._nvml = pynvml
        return self._nvml

    @contextmanager
    def _translated(self, action: str) -> Iterator[None]:
        try:
            yield
        except self.nvml.NVMLError as err:
            raise DiscoveryError(f"{action}: NVML says {err}") from err

    # ----------------------------------------------------------------- session

    def open(self) -> None:
        nvml = self.nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError_LibraryNotFound as err:
            raise GpuUnavailable(NO_DRIVER) from err
        except nvml.NVMLError_DriverNotLoaded as err:
            raise GpuUnavailable(
                "the NVIDIA kernel driver is not loaded; run `modprobe nvidia` or check `dmesg` "
                "if this host has NVIDIA GPUs"
            ) from err
        except nvml.NVMLError_LibRmVersionMismatch as err:
            raise DiscoveryError(
                "NVML and the loaded NVIDIA kernel driver have different versions "
                "(driver upgraded without reload); reboot or reload the nvidia modules"
            ) from err
        except nvml.NVMLError as err:
            raise DiscoveryError(f"initialising NVML failed: {err}") from err
        self._sessions += 1

    def close(self) -> None:
        if self._sessions == 0:
            return
        self._sessions -= 1
        # A failed shutdown leaves nothing to release and nothing the caller could do.
        with suppress(self.nvml.NVMLError):
            self.nvml.nvmlShutdown()

    def driver_version(self) -> str | None:
        return self._optional(lambda: _text(self.nvml.nvmlSystemGetDriverVersion()))

    def device_count(self) -> int:
        with self._translated("counting GPUs"):
            return int(self.nvml.nvmlDeviceGetCount())

    # ----------------------------------------------------------------- one GPU

    def _optional(self, query: Callable[[], T]) -> T | None:
        """A query whose absence is normal; a lost GPU still propagates."""
        nvml = self.nvml
        try:
            return query()
        except nvml.NVMLError_GpuIsLost:
            raise
        except nvml.NVMLError:
            return None

    def read_gpu(self, index: int) -> GpuReading:
        nvml = self.nvml
        try:
            with self._translated(f"reading GPU {index}"):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(nvml.nvmlDeviceGetUUID(handle))
                bus_id = normalise_pci_bus_id(nvml.nvmlDeviceGetPciInfo(handle).busId)
                return self._read_details(index, handle, uuid, bus_id)
        except DiscoveryError as err:
            if isinstance(err.__cause__, nvml.NVMLError_GpuIsLost):
                return GpuReading(index, None, None, None, None, None, None, None, lost=True)
            raise

    def _read_details(self, index: int, handle: Any, uuid: str, bus_id: str) -> GpuReading:
        nvml = self.nvml
        memory = self._optional(lambda: int(nvml.nvmlDeviceGetMemoryInfo(handle).total))
        minor = self._optional(lambda: int(nvml.nvmlDeviceGetMinorNumber(handle)))
        problems: list[str] = []
        try:
            mig = self._read_mig(handle, memory)
        except nvml.NVMLError_GpuIsLost:
            raise
        except nvml.NVMLError as err:
            problems.append(f"reading its MIG instances failed: NVML says {err}")
            mig = None
        return GpuReading(
            index=index,
            uuid=uuid,
            name=self._optional(lambda: _text(nvml.nvmlDeviceGetName(handle))),
            pci_bus_id=bus_id,
            numa=self._numa(handle),
            memory_bytes=memory,
            minor=minor,
            mig=mig,
            problems=tuple(problems),
        )

    def _numa(self, handle: Any) -> int | None:
        # nvidia-ml-py added nvmlDeviceGetNumaNodeId in 12.x; older drivers lack the symbol.
        query = getattr(self.nvml, "nvmlDeviceGetNumaNodeId", None)
        if query is None:
            return None
        node = self._optional(lambda: int(query(handle)))
        return node if node is not None and node >= 0 else None

    # ----------------------------------------------------------------- MIG

    def _read_mig(self, handle: Any, gpu_memory: int | None) -> MigState | None:
        nvml = self.nvml
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
        except nvml.NVMLError_NotSupported:
            return None  # the GPU cannot do MIG
        if current != nvml.NVML_DEVICE_MIG_ENABLE:
            return MigState(enabled=False)
        names = self._gi_profile_names(handle)
        instances = []
        for slot in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except nvml.NVMLError_NotFound:
                continue  # an empty slot
            instances.append(self._read_mig_device(handle, mig, names, gpu_memory))
        ordered = sorted(instances, key=lambda m: (m.gpu_instance_id, m.compute_instance_id or 0))
        return MigState(enabled=True, instances=tuple(ordered))

    def _gi_profile_names(self, handle: Any) -> dict[int, str]:
        """NVML profile id -> name ("1g.10gb") for the profiles this GPU offers."""
        nvml = self.nvml
        names: dict[int, str] = {}
        for profile in range(getattr(nvml, "NVML_GPU_INSTANCE_PROFILE_COUNT", 8)):
            try:
                info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, profile)
            except nvml.NVMLError_FunctionNotFound:
                return {}  # driver older than the named (v2) profile info
            except (nvml.NVMLError_NotSupported, nvml.NVMLError_InvalidArgument):
                continue
            name = _text(getattr(info, "name", b"")).removeprefix("MIG ").strip()
            if name:
                names[int(info.id)] = name
        return names

    def _read_mig_device(
        self, parent: Any, mig: Any, names: dict[int, str], gpu_memory: int | None
    ) -> MigInstance:
        nvml = self.nvml
        gi_id = int(nvml.nvmlDeviceGetGpuInstanceId(mig))
        ci_id = int(nvml.nvmlDeviceGetComputeInstanceId(mig))
        info = nvml.nvmlGpuInstanceGetInfo(nvml.nvmlDeviceGetGpuInstanceById(parent, gi_id))
        attrs = self._optional(lambda: nvml.nvmlDeviceGetAttributes(mig))
        profile = names.get(int(info.profileId))
        if attrs is not None:
            gi_slices, ci_slices = int(attrs.gpuInstanceSliceCount), int(attrs.computeInstanceSliceCount)
            if profile is None:
                profile = mig_profile_name(gi_slices, gi_slices, int(attrs.memorySizeMB), gpu_memory)
            if ci_slices < gi_slices:
                profile = f"{ci_slices}c.{profile}"
        return MigInstance(
            gpu_instance_id=gi_id,
            compute_instance_id=ci_id,
            profile=profile or f"profile-{int(info.profileId)}",
            placement_start=int(info.placement.start),
            placement_size=int(info.placement.size),
            uuid=_text(nvml.nvmlDeviceGetUUID(mig)),
            memory_bytes=self._optional(lambda: int(nvml.nvmlDeviceGetMemoryInfo(mig).total)),
        )

    # ----------------------------------------------------------------- health events

    def start_events(self) -> tuple[GpuEvent, ...]:
        """Open a session and watch every GPU for XID and ECC events; one event per GPU says how."""
        nvml = self.nvml
        self.open()
        try:
            with self._translated("creating an NVML event set"):
                self._event_set = nvml.nvmlEventSetCreate()
                count = int(nvml.nvmlDeviceGetCount())
        except DiscoveryError:
            self.stop_events()
            raise
        return tuple(e for index in range(count) for e in self._watch(index))

    def _watch(self, index: int) -> list[GpuEvent]:
        nvml = self.nvml
        wanted = (
            nvml.nvmlEventTypeXidCriticalError
            | nvml.nvmlEventTypeDoubleBitEccError
            | nvml.nvmlEventTypeSingleBitEccError
        )
        uuid = None
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            supported = int(nvml.nvmlDeviceGetSupportedEventTypes(handle))
            nvml.nvmlDeviceRegisterEvents(handle, wanted & supported, self._event_set)
        except nvml.NVMLError_GpuIsLost:
            return [GpuEvent(index, uuid, "lost", detail="NVML says the GPU is lost")]
        except nvml.NVMLError as err:
            return [GpuEvent(index, uuid, "unwatched", detail=f"cannot watch its events: NVML says {err}")]
        self._watched[index] = handle
        self._uuid_index[uuid] = index
        out = [GpuEvent(index, uuid, "watching")]
        uncorrected = self._optional(
            lambda: int(
                nvml.nvmlDeviceGetTotalEccErrors(
                    handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
                )
            )
        )
        if uncorrected:
            detail = f"{uncorrected} uncorrected ECC errors since the driver loaded"
            out.append(GpuEvent(index, uuid, "ecc_dbe", detail=detail))
        return out

    def wait_events(self, timeout_ms: int) -> tuple[GpuEvent, ...]:
        """Events that arrive within ``timeout_ms``; () when none did."""
        nvml = self.nvml
        if self._event_set is None:
            raise DiscoveryError("waiting for GPU events before start_events(); call start_events() first")
        wait = getattr(nvml, "nvmlEventSetWait_v2", None) or nvml.nvmlEventSetWait
        try:
            data = wait(self._event_set, timeout_ms)
        except nvml.NVMLError_Timeout:
            return ()
        except nvml.NVMLError_GpuIsLost:
            return self._probe_lost()
        except nvml.NVMLError as err:
            raise DiscoveryError(f"waiting for GPU events failed: NVML says {err}") from err
        return self._event_from(data)

    def _probe_lost(self) -> tuple[GpuEvent, ...]:
        """NVML says some GPU is lost without saying which: ask each watched one."""
        nvml = self.nvml
        lost = []
        for index, handle in self._watched.items():
            try:
                nvml.nvmlDeviceGetUUID(handle)
            except nvml.NVMLError_GpuIsLost:
                lost.append(GpuEvent(index, None, "lost", detail="NVML says the GPU is lost"))
            except nvml.NVMLError:
                continue
        return tuple(lost)

    def _event_from(self, data: Any) -> tuple[GpuEvent, ...]:
        nvml = self.nvml
        try:
            uuid = _text(nvml.nvmlDeviceGetUUID(data.device))
        except nvml.NVMLError_GpuIsLost:
            return self._probe_lost()
        except nvml.NVMLError:
            return ()
        index = self._uuid_index.get(uuid)
        if index is None:
            return ()  # a device we do not watch
        kinds: dict[int, EventKind] = {
            nvml.nvmlEventTypeXidCriticalError: "xid",
            nvml.nvmlEventTypeDoubleBitEccError: "ecc_dbe",
            nvml.nvmlEventTypeSingleBitEccError: "ecc_sbe",
        }
        kind = kinds.get(int(data.eventType), "other")
        gi, ci = int(data.gpuInstanceId), int(data.computeInstanceId)
        return (
            GpuEvent(
                index,
                uuid,
                kind,
                xid=int(data.eventData) if kind == "xid" else None,
                gpu_instance_id=None if gi == _NO_INSTANCE else gi,
                compute_instance_id=None if ci == _NO_INSTANCE else ci,
            ),
        )

    def stop_events(self) -> None:
        if self._event_set is not None:
            # The session is going away; NVML frees the set on shutdown anyway.
            with suppress(self.nvml.NVMLError):
                self.nvml.nvmlEventSetFree(self._event_set)
            self._event_set = None
        self._watched.clear()
        self._uuid_index.clear()
        self.close()
