"""A fake of nvidia-ml-py's ``pynvml`` module, driven by a host profile.

It exposes the functions nodeagent calls under their real names and signatures, the real
constants, and the real exception classes (taken from the installed ``pynvml``, so
``except pynvml.NVMLError_NotSupported`` catches what the fake raises). The semantics follow NVML:

- every call but ``nvmlInit`` needs an initialised library (refcounted ``nvmlInit``/``nvmlShutdown``),
  otherwise ``NVMLError_Uninitialized``;
- a host without driver fails ``nvmlInit`` with ``NVMLError_LibraryNotFound`` (no libnvidia-ml.so.1)
  or ``NVMLError_DriverNotLoaded`` (library present, kernel module not loaded);
- an index past the device count is ``NVMLError_InvalidArgument``;
- MIG calls on a GPU that cannot do MIG are ``NVMLError_NotSupported``; MIG device handles exist
  only while MIG mode is enabled; empty MIG slots are ``NVMLError_NotFound``;
- a GPU that fell off the bus still has a handle, but every query on it is ``NVMLError_GpuIsLost``;
- event sets deliver injected events for the devices and event types registered on them; waiting
  blocks up to the timeout and then raises ``NVMLError_Timeout``.

Test helpers (``inject_xid``, ``inject_ecc``, ``lose_gpu``) drive the events; ``calls`` records the
name of every NVML function called.
"""

from __future__ import annotations

import collections
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pynvml

MiB = 1024 * 1024
NO_INSTANCE = 0xFFFFFFFF  # NVML's "not scoped to a GPU/compute instance"


# --------------------------------------------------------------------------- GPU models


@dataclass(frozen=True)
class GiProfile:
    """One GPU instance profile of a GPU model, as NVML describes it."""

    id: int  #: NVML profile id (what nvmlGpuInstanceGetInfo().profileId says)
    name: str  #: e.g. "1g.10gb"
    slices: int  #: compute slices (the "Ng" of the name)
    instance_count: int
    memory_mb: int
    placement_size: int  #: memory slices taken
    placement_starts: tuple[int, ...]


@dataclass(frozen=True)
class GpuModel:
    name: str
    pci_device_id: int
    memory_mb: int
    max_mig_devices: int
    #: NVML_GPU_INSTANCE_PROFILE_* index -> profile; empty for GPUs that cannot do MIG
    gi_profiles: dict[int, GiProfile]
    supported_events: int


_ECC_AND_XID = (
    pynvml.nvmlEventTypeXidCriticalError
    | pynvml.nvmlEventTypeSingleBitEccError
    | pynvml.nvmlEventTypeDoubleBitEccError
    | pynvml.nvmlEventTypePState
    | pynvml.nvmlEventTypeClock
)

# Profiles as `nvidia-smi mig -lgip` and `-lgipp` list them on an H100 SXM5 80GB.
H100_80GB = GpuModel(
    name="NVIDIA H100 80GB HBM3",
    pci_device_id=0x233010DE,
    memory_mb=81559,
    max_mig_devices=7,
    gi_profiles={
        pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE: GiProfile(
            19, "1g.10gb", 1, 7, 9984, 1, (0, 1, 2, 3, 4, 5, 6)
        ),
        pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1: GiProfile(
            20, "1g.10gb+me", 1, 1, 9984, 1, (0, 1, 2, 3, 4, 5, 6)
        ),
        pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2: GiProfile(15, "1g.20gb", 1, 4, 20096, 2, (0, 2, 4, 6)),
        pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE: GiProfile(14, "2g.20gb", 2, 3, 20096, 2, (0, 2, 4)),
        pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE: GiProfile(9, "3g.40gb", 3, 2, 40448, 4, (0, 4)),
        pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE: GiProfile(5, "4g.40gb", 4, 1, 40448, 4, (0,)),
        pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE: GiProfile(0, "7g.80gb", 7, 1, 81152, 8, (0,)),
    },
    supported_events=_ECC_AND_XID,
)

A100_40GB = GpuModel(
    name="NVIDIA A100-SXM4-40GB",
    pci_device_id=0x20B010DE,
    memory_mb=40960,
    max_mig_devices=7,
    gi_profiles={
        pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE: GiProfile(
            19, "1g.5gb", 1, 7, 4864, 1, (0, 1, 2, 3, 4, 5, 6)
        ),
        pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE: GiProfile(14, "2g.10gb", 2, 3, 9856, 2, (0, 2, 4)),
        pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE: GiProfile(9, "3g.20gb", 3, 2, 19968, 4, (0, 4)),
        pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE: GiProfile(5, "4g.20gb", 4, 1, 19968, 4, (0,)),
        pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE: GiProfile(0, "7g.40gb", 7, 1, 40192, 8, (0,)),
    },
    supported_events=_ECC_AND_XID,
)

# A GPU without MIG (and without ECC events), to exercise the NotSupported paths.
L4 = GpuModel(
    name="NVIDIA L4",
    pci_device_id=0x27B810DE,
    memory_mb=23034,
    max_mig_devices=0,
    gi_profiles={},
    supported_events=pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypePState,
)


# --------------------------------------------------------------------------- host profile


@dataclass(frozen=True)
class FakeMigDevice:
    """One compute instance inside a GPU instance: what CUDA sees as a MIG device."""

    gi_profile: str  #: name of the GPU instance profile, e.g. "3g.40gb"
    gpu_instance_id: int
    placement_start: int
    compute_instance_id: int = 0
    ci_slices: int | None = None  #: None: the compute instance takes the whole GPU instance
    uuid: str = ""


@dataclass
class FakeGpu:
    index: int
    model: GpuModel
    uuid: str
    pci_bus_id: str  #: as NVML writes it: "00000000:1B:00.0"
    numa: int
    minor: int
    mig_enabled: bool = False
    mig_devices: tuple[FakeMigDevice, ...] = ()
    lost: bool = False
    volatile_uncorrected_ecc: int = 0

    def profile(self, name: str) -> tuple[int, GiProfile]:
        for index, p in self.model.gi_profiles.items():
            if p.name == name:
                return index, p
        raise ValueError(f"{self.model.name} has no MIG profile {name!r}")


@dataclass
class FakeHost:
    gpus: list[FakeGpu] = field(default_factory=list)
    #: "ok", "library_not_found" (no libnvidia-ml.so.1) or "driver_not_loaded"
    driver: str = "ok"
    driver_version: str = "550.90.07"
    #: how nvmlDeviceGetNumaNodeId behaves: "ok", "missing" (older pynvml without the function),
    #: "function_not_found" (older driver), "not_supported"
    numa_call: str = "ok"
    #: False: the driver predates nvmlDeviceGetGpuInstanceProfileInfoV, so profile infos carry no name
    profile_info_v2: bool = True


def _mig_uuid(gpu_uuid: str, gi: int, ci: int) -> str:
    # Drivers since R470 name MIG devices "MIG-<uuid>" with a UUID of their own.
    return "MIG-" + str(uuid.uuid5(uuid.NAMESPACE_URL, f"{gpu_uuid}/gi{gi}/ci{ci}"))


def _gpu_uuid(seed: str) -> str:
    return "GPU-" + str(uuid.uuid5(uuid.NAMESPACE_URL, seed))


def _check_layout(gpu: FakeGpu) -> None:
    """Refuse MIG layouts the hardware could not have, so profiles stay realistic."""
    used: dict[int, int] = {}
    seen_gi: dict[int, tuple[str, int]] = {}
    for dev in gpu.mig_devices:
        _, prof = gpu.profile(dev.gi_profile)
        if dev.placement_start not in prof.placement_starts:
            raise ValueError(f"{prof.name} cannot start at memory slice {dev.placement_start}")
        key = (dev.gi_profile, dev.placement_start)
        if dev.gpu_instance_id in seen_gi:
            if seen_gi[dev.gpu_instance_id] != key:
                raise ValueError(f"GPU instance {dev.gpu_instance_id} given two placements")
            continue
        seen_gi[dev.gpu_instance_id] = key
        for s in range(dev.placement_start, dev.placement_start + prof.placement_size):
            if s in used:
                raise ValueError(
                    f"GPU {gpu.index}: memory slice {s} used by GI {used[s]} and {dev.gpu_instance_id}"
                )
            used[s] = dev.gpu_instance_id


def _with_uuids(gpu: FakeGpu) -> FakeGpu:
    devs = tuple(
        FakeMigDevice(
            d.gi_profile,
            d.gpu_instance_id,
            d.placement_start,
            d.compute_instance_id,
            d.ci_slices,
            d.uuid or _mig_uuid(gpu.uuid, d.gpu_instance_id, d.compute_instance_id),
        )
        for d in gpu.mig_devices
    )
    gpu.mig_devices = devs
    _check_layout(gpu)
    return gpu


# DGX H100 / HGX H100 bus numbers: four GPUs behind each CPU socket.
H100_BUS_IDS = ("1B", "43", "52", "61", "9D", "C3", "D1", "DF")


def _h100_layouts() -> dict[int, tuple[FakeMigDevice, ...]]:
    one_g = "1g.10gb"
    return {
        # GPU 2: seven 1g.10gb, the densest layout
        2: tuple(FakeMigDevice(one_g, gpu_instance_id=7 + s, placement_start=s) for s in range(7)),
        # GPU 3: 2g.20gb + 1g.10gb + 3g.40gb, one 1g slot left free
        3: (
            FakeMigDevice("2g.20gb", gpu_instance_id=5, placement_start=0),
            FakeMigDevice(one_g, gpu_instance_id=9, placement_start=2),
            FakeMigDevice("3g.40gb", gpu_instance_id=2, placement_start=4),
        ),
        # GPU 5: 4g.40gb + 3g.40gb
        5: (
            FakeMigDevice("4g.40gb", gpu_instance_id=1, placement_start=0),
            FakeMigDevice("3g.40gb", gpu_instance_id=2, placement_start=4),
        ),
        # GPU 6: a 3g.40gb split into a 1-slice and a 2-slice compute instance, plus a 3g.40gb
        6: (
            FakeMigDevice(
                "3g.40gb", gpu_instance_id=1, placement_start=0, compute_instance_id=0, ci_slices=1
            ),
            FakeMigDevice(
                "3g.40gb", gpu_instance_id=1, placement_start=0, compute_instance_id=1, ci_slices=2
            ),
            FakeMigDevice("3g.40gb", gpu_instance_id=2, placement_start=4),
        ),
        # GPU 7: the whole GPU as one 7g.80gb
        7: (FakeMigDevice("7g.80gb", gpu_instance_id=0, placement_start=0),),
    }


def h100_8x_mixed_mig(**host_options: Any) -> FakeHost:
    """8 x H100 80GB: GPUs 0-3 on NUMA node 0, 4-7 on node 1.

    MIG disabled on GPUs 0 and 1, enabled but empty on GPU 4, mixed layouts on 2, 3, 5, 6 and 7.
    """
    layouts = _h100_layouts()
    gpus = [
        _with_uuids(
            FakeGpu(
                index=i,
                model=H100_80GB,
                uuid=_gpu_uuid(f"h100-{i}"),
                pci_bus_id=f"00000000:{bus}:00.0",
                numa=0 if i < 4 else 1,
                minor=i,
                mig_enabled=i >= 2,
                mig_devices=layouts.get(i, ()),
            )
        )
        for i, bus in enumerate(H100_BUS_IDS)
    ]
    return FakeHost(gpus=gpus, **host_options)


def a100_2x(**host_options: Any) -> FakeHost:
    """2 x A100 40GB, MIG disabled, on NUMA nodes 0 and 1."""
    gpus = [
        FakeGpu(i, A100_40GB, _gpu_uuid(f"a100-{i}"), f"00000000:{bus}:00.0", numa=i, minor=i)
        for i, bus in enumerate(("07", "87"))
    ]
    return FakeHost(gpus=gpus, **host_options)


def l4_1x(**host_options: Any) -> FakeHost:
    """One L4: no MIG, no ECC events."""
    return FakeHost(
        gpus=[FakeGpu(0, L4, _gpu_uuid("l4-0"), "00000000:41:00.0", numa=0, minor=0)], **host_options
    )


def no_driver(kind: str = "library_not_found") -> FakeHost:
    """A host whose NVIDIA driver is missing (or whose kernel module is not loaded)."""
    return FakeHost(driver=kind)


def no_gpus() -> FakeHost:
    """The driver is installed and loaded, but there is no GPU."""
    return FakeHost()


# --------------------------------------------------------------------------- NVML objects


@dataclass(frozen=True)
class _Device:
    """Opaque device handle: a full GPU, or a MIG device when ``mig`` is set."""

    gpu: int
    mig: int | None = None


@dataclass(frozen=True)
class _GpuInstance:
    gpu: int
    gi: int


@dataclass
class _EventSet:
    registered: dict[int, int] = field(default_factory=dict)  # gpu index -> event mask
    queue: collections.deque[Any] = field(default_factory=collections.deque)
    freed: bool = False


@dataclass
class _Placement:
    start: int
    size: int


@dataclass
class _GpuInstanceInfo:
    device: _Device
    id: int
    profileId: int
    placement: _Placement


@dataclass
class _ProfileInfoV1:
    id: int
    isP2pSupported: int
    sliceCount: int
    instanceCount: int
    memorySizeMB: int


@dataclass
class _ProfileInfoV2(_ProfileInfoV1):
    name: bytes = b""
    version: int = pynvml.nvmlGpuInstanceProfileInfo_v2


@dataclass
class _DeviceAttributes:
    gpuInstanceSliceCount: int
    computeInstanceSliceCount: int
    memorySizeMB: int
    multiprocessorCount: int = 0


@dataclass
class _Memory:
    total: int
    free: int
    used: int


@dataclass
class _PciInfo:
    busId: bytes
    busIdLegacy: bytes
    domain: int
    bus: int
    device: int
    pciDeviceId: int


@dataclass
class _EventData:
    device: _Device
    eventType: int
    eventData: int
    gpuInstanceId: int
    computeInstanceId: int


def _raise(code: int) -> Any:
    raise pynvml.NVMLError(code)


class FakeNvml:
    """Module-like stand-in for ``pynvml``; pass it where the real module would go."""

    def __init__(self, host: FakeHost) -> None:
        self.host = host
        self.calls: list[str] = []
        self._refcount = 0
        self._cond = threading.Condition()
        self._event_sets: list[_EventSet] = []
        self._pending_wait_errors: collections.deque[int] = collections.deque()
        if host.numa_call != "missing":
            # Older nvidia-ml-py releases lack this function; the backend must cope.
            self.nvmlDeviceGetNumaNodeId = self._get_numa_node_id

    # ----------------------------------------------------------------- helpers for tests

    @property
    def initialised(self) -> bool:
        return self._refcount > 0

    @property
    def open_event_sets(self) -> int:
        return sum(1 for s in self._event_sets if not s.freed)

    def inject_xid(self, gpu: int, xid: int, *, gi: int = NO_INSTANCE, ci: int = NO_INSTANCE) -> None:
        self._deliver(gpu, pynvml.nvmlEventTypeXidCriticalError, xid, gi, ci)

    def inject_ecc(self, gpu: int, *, double_bit: bool = True) -> None:
        kind = pynvml.nvmlEventTypeDoubleBitEccError if double_bit else pynvml.nvmlEventTypeSingleBitEccError
        self._deliver(gpu, kind, 0, NO_INSTANCE, NO_INSTANCE)

    def lose_gpu(self, gpu: int) -> None:
        """The GPU falls off the bus: queries fail, and a pending event wait reports it once."""
        with self._cond:
            self.host.gpus[gpu].lost = True
            self._pending_wait_errors.append(pynvml.NVML_ERROR_GPU_IS_LOST)
            self._cond.notify_all()

    def _deliver(self, gpu: int, event_type: int, data: int, gi: int, ci: int) -> None:
        with self._cond:
            for s in self._event_sets:
                if not s.freed and s.registered.get(gpu, 0) & event_type:
                    s.queue.append(_EventData(_Device(gpu), event_type, data, gi, ci))
            self._cond.notify_all()

    # ----------------------------------------------------------------- internals

    def _enter(self, name: str) -> None:
        self.calls.append(name)
        if self._refcount == 0:
            _raise(pynvml.NVML_ERROR_UNINITIALIZED)

    def _gpu(self, handle: Any, *, allow_mig: bool = False) -> FakeGpu:
        if not isinstance(handle, _Device) or not 0 <= handle.gpu < len(self.host.gpus):
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.host.gpus[handle.gpu]
        if gpu.lost:
            _raise(pynvml.NVML_ERROR_GPU_IS_LOST)
        if handle.mig is not None and not allow_mig:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def _mig(self, handle: Any) -> tuple[FakeGpu, FakeMigDevice]:
        gpu = self._gpu(handle, allow_mig=True)
        if handle.mig is None:
            # Instance ids exist only on MIG device handles.
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not gpu.mig_enabled or handle.mig >= len(gpu.mig_devices):
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu, gpu.mig_devices[handle.mig]

    def _mig_capable(self, handle: Any) -> FakeGpu:
        gpu = self._gpu(handle)
        if not gpu.model.gi_profiles:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    # ----------------------------------------------------------------- library

    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        if self.host.driver == "library_not_found":
            _raise(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        if self.host.driver == "driver_not_loaded":
            _raise(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        self._refcount += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self._refcount -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.host.driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.host.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Device:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.host.gpus):
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return _Device(index)

    # ----------------------------------------------------------------- device queries

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        self._enter("nvmlDeviceGetIndex")
        return self._gpu(handle).index

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        self._enter("nvmlDeviceGetUUID")
        gpu = self._gpu(handle, allow_mig=True)
        if handle.mig is not None:
            return self._mig(handle)[1].uuid
        return gpu.uuid

    def nvmlDeviceGetName(self, handle: Any) -> str:
        self._enter("nvmlDeviceGetName")
        gpu = self._gpu(handle, allow_mig=True)
        if handle.mig is not None:
            _, dev = self._mig(handle)
            return f"{gpu.model.name} MIG {dev.gi_profile}"
        return gpu.model.name

    def nvmlDeviceGetPciInfo(self, handle: Any) -> _PciInfo:
        self._enter("nvmlDeviceGetPciInfo")
        gpu = self._gpu(handle)
        domain, bus, dev_fn = gpu.pci_bus_id.split(":")
        return _PciInfo(
            busId=gpu.pci_bus_id.encode(),
            busIdLegacy=gpu.pci_bus_id[4:].encode(),
            domain=int(domain, 16),
            bus=int(bus, 16),
            device=int(dev_fn.split(".")[0], 16),
            pciDeviceId=gpu.model.pci_device_id,
        )

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> _Memory:
        self._enter("nvmlDeviceGetMemoryInfo")
        gpu = self._gpu(handle, allow_mig=True)
        mb = gpu.model.memory_mb
        if handle.mig is not None:
            _, dev = self._mig(handle)
            mb = gpu.profile(dev.gi_profile)[1].memory_mb
        return _Memory(total=mb * MiB, free=mb * MiB, used=0)

    def nvmlDeviceGetMinorNumber(self, handle: Any) -> int:
        self._enter("nvmlDeviceGetMinorNumber")
        return self._gpu(handle).minor

    def _get_numa_node_id(self, handle: Any) -> int:
        self._enter("nvmlDeviceGetNumaNodeId")
        gpu = self._gpu(handle)
        if self.host.numa_call == "function_not_found":
            _raise(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        if self.host.numa_call == "not_supported":
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu.numa

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: int, counter_type: int) -> int:
        self._enter("nvmlDeviceGetTotalEccErrors")
        gpu = self._gpu(handle)
        if not gpu.model.supported_events & pynvml.nvmlEventTypeDoubleBitEccError:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        uncorrected = error_type == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        volatile = counter_type == pynvml.NVML_VOLATILE_ECC
        return gpu.volatile_uncorrected_ecc if uncorrected and volatile else 0

    # ----------------------------------------------------------------- MIG

    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:
        self._enter("nvmlDeviceGetMigMode")
        gpu = self._mig_capable(handle)
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if gpu.mig_enabled else pynvml.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any) -> int:
        self._enter("nvmlDeviceGetMaxMigDeviceCount")
        return self._mig_capable(handle).model.max_mig_devices

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: int) -> _Device:
        self._enter("nvmlDeviceGetMigDeviceHandleByIndex")
        gpu = self._mig_capable(handle)
        if not gpu.mig_enabled or not 0 <= index < gpu.model.max_mig_devices:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if index >= len(gpu.mig_devices):
            _raise(pynvml.NVML_ERROR_NOT_FOUND)
        return _Device(gpu.index, index)

    def nvmlDeviceIsMigDeviceHandle(self, handle: Any) -> bool:
        self._enter("nvmlDeviceIsMigDeviceHandle")
        self._gpu(handle, allow_mig=True)
        return handle.mig is not None

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: Any) -> _Device:
        self._enter("nvmlDeviceGetDeviceHandleFromMigDeviceHandle")
        gpu, _ = self._mig(handle)
        return _Device(gpu.index)

    def nvmlDeviceGetGpuInstanceId(self, handle: Any) -> int:
        self._enter("nvmlDeviceGetGpuInstanceId")
        return self._mig(handle)[1].gpu_instance_id

    def nvmlDeviceGetComputeInstanceId(self, handle: Any) -> int:
        self._enter("nvmlDeviceGetComputeInstanceId")
        return self._mig(handle)[1].compute_instance_id

    def nvmlDeviceGetAttributes(self, handle: Any) -> _DeviceAttributes:
        self._enter("nvmlDeviceGetAttributes")
        gpu, dev = self._mig(handle)
        prof = gpu.profile(dev.gi_profile)[1]
        return _DeviceAttributes(prof.slices, dev.ci_slices or prof.slices, prof.memory_mb)

    def nvmlDeviceGetGpuInstanceProfileInfo(self, handle: Any, profile: int, version: int = 2) -> Any:
        self._enter("nvmlDeviceGetGpuInstanceProfileInfo")
        if version == 2 and not self.host.profile_info_v2:
            _raise(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        gpu = self._mig_capable(handle)
        if not 0 <= profile < pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        p = gpu.model.gi_profiles.get(profile)
        if p is None:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if version == 1:
            return _ProfileInfoV1(p.id, 0, p.slices, p.instance_count, p.memory_mb)
        return _ProfileInfoV2(p.id, 0, p.slices, p.instance_count, p.memory_mb, name=f"MIG {p.name}".encode())

    def nvmlDeviceGetGpuInstanceById(self, handle: Any, gi: int) -> _GpuInstance:
        self._enter("nvmlDeviceGetGpuInstanceById")
        gpu = self._mig_capable(handle)
        if not gpu.mig_enabled:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if all(d.gpu_instance_id != gi for d in gpu.mig_devices):
            _raise(pynvml.NVML_ERROR_NOT_FOUND)
        return _GpuInstance(gpu.index, gi)

    def nvmlGpuInstanceGetInfo(self, instance: Any) -> _GpuInstanceInfo:
        self._enter("nvmlGpuInstanceGetInfo")
        if not isinstance(instance, _GpuInstance):
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self._gpu(_Device(instance.gpu))
        dev = next((d for d in gpu.mig_devices if d.gpu_instance_id == instance.gi), None)
        if dev is None:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        prof = gpu.profile(dev.gi_profile)[1]
        return _GpuInstanceInfo(
            _Device(gpu.index), instance.gi, prof.id, _Placement(dev.placement_start, prof.placement_size)
        )

    # ----------------------------------------------------------------- events

    def nvmlEventSetCreate(self) -> _EventSet:
        self._enter("nvmlEventSetCreate")
        s = _EventSet()
        with self._cond:
            self._event_sets.append(s)
        return s

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        self._enter("nvmlDeviceGetSupportedEventTypes")
        return self._gpu(handle).model.supported_events

    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: _EventSet) -> None:
        self._enter("nvmlDeviceRegisterEvents")
        gpu = self._gpu(handle)
        if event_set.freed:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if event_types & ~gpu.model.supported_events:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        with self._cond:
            event_set.registered[gpu.index] = event_set.registered.get(gpu.index, 0) | event_types

    def nvmlEventSetWait_v2(self, event_set: _EventSet, timeoutms: int) -> _EventData:
        self._enter("nvmlEventSetWait_v2")
        ready: Callable[[], bool] = lambda: bool(event_set.queue or self._pending_wait_errors)  # noqa: E731
        with self._cond:
            if event_set.freed:
                _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            if not self._cond.wait_for(ready, timeout=timeoutms / 1000):
                _raise(pynvml.NVML_ERROR_TIMEOUT)
            if self._pending_wait_errors:
                _raise(self._pending_wait_errors.popleft())
            return event_set.queue.popleft()

    def nvmlEventSetWait(self, event_set: _EventSet, timeoutms: int) -> _EventData:
        return self.nvmlEventSetWait_v2(event_set, timeoutms)

    def nvmlEventSetFree(self, event_set: _EventSet) -> None:
        self._enter("nvmlEventSetFree")
        with self._cond:
            event_set.freed = True
            self._cond.notify_all()


def _copy_module_names() -> None:
    """Give FakeNvml the real constants and exception classes, so callers can use either."""
    for name in dir(pynvml):
        if name.startswith(("NVML_", "NVMLError", "nvmlEventType", "nvmlGpuInstanceProfileInfo_v")):
            setattr(FakeNvml, name, getattr(pynvml, name))


_copy_module_names()
