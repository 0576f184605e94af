"""GPU discovery through NVML, driven by the fake pynvml and fake sysfs/proc trees."""

from __future__ import annotations

from pathlib import Path

import pynvml
import pytest

from nodeagent.devices.gpu import (
    GpuInventory,
    NvmlBackend,
    discover_gpus,
    discover_gpus_with,
    mig_profile_name,
    normalise_pci_bus_id,
)
from nodeagent.devices.topology import Gpu, MigInstance
from nodeagent.errors import DiscoveryError
from tests.devices.gpu_trees import (
    cap_minor,
    gpu_host_sysfs,
    h100_host_sysfs,
    mig_capabilities_proc,
)
from tests.fakes import fake_nvml
from tests.fakes.fake_nvml import FakeHost, FakeNvml
from tests.trees import write_tree

GiB = 1024**3
H100_MEMORY = 81559 * 1024 * 1024


def discover(
    tmp_path: Path, host: FakeHost, *, sysfs: dict[str, str] | None = None, proc: dict[str, str] | None = None
) -> tuple[GpuInventory, FakeNvml]:
    nvml = FakeNvml(host)
    sysfs_root = write_tree(tmp_path / "sys", gpu_host_sysfs(host) if sysfs is None else sysfs)
    proc_root = write_tree(tmp_path / "proc", mig_capabilities_proc(host) if proc is None else proc)
    inventory = discover_gpus_with(NvmlBackend(nvml), sysfs_root, proc_root)
    assert not nvml.initialised, "discovery must balance nvmlInit with nvmlShutdown"
    return inventory, nvml


def by_index(inventory: GpuInventory) -> dict[int, Gpu]:
    return {g.index: g for g in inventory.gpus}


# --------------------------------------------------------------------------- 8 x H100


def test_h100_host_lists_every_gpu_with_identity(tmp_path: Path) -> None:
    host = fake_nvml.h100_8x_mixed_mig()
    inventory, _ = discover(tmp_path, host, sysfs=h100_host_sysfs())

    assert inventory.status == "ok"
    assert inventory.problems == ()
    assert inventory.driver_version == "550.90.07"
    assert [g.uuid for g in inventory.gpus] == [g.uuid for g in host.gpus]
    assert {g.name for g in inventory.gpus} == {"NVIDIA H100 80GB HBM3"}
    assert [g.pci_bus_id for g in inventory.gpus] == [
        "0000:1b:00.0",
        "0000:43:00.0",
        "0000:52:00.0",
        "0000:61:00.0",
        "0000:9d:00.0",
        "0000:c3:00.0",
        "0000:d1:00.0",
        "0000:df:00.0",
    ]
    assert [g.numa for g in inventory.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [g.minor for g in inventory.gpus] == list(range(8))
    assert {g.memory_bytes for g in inventory.gpus} == {H100_MEMORY}
    assert {g.healthy for g in inventory.gpus} == {None}, "discovery alone does not judge health"


@pytest.mark.parametrize(
    ("numa_call", "sysfs_numa", "expected"),
    [
        pytest.param("ok", {0: 1, 5: 0}, 0, id="nvml-answer-wins-over-sysfs"),
        pytest.param("missing", {}, 0, id="old-pynvml-without-call-uses-sysfs"),
        pytest.param("function_not_found", {}, 0, id="old-driver-uses-sysfs"),
        pytest.param("not_supported", {}, 0, id="not-supported-uses-sysfs"),
        pytest.param("not_supported", {0: -1}, None, id="sysfs-minus-one-is-unknown"),
    ],
)
def test_numa_node_comes_from_nvml_else_sysfs(
    tmp_path: Path, numa_call: str, sysfs_numa: dict[int, int], expected: int | None
) -> None:
    host = fake_nvml.h100_8x_mixed_mig(numa_call=numa_call)
    sysfs = gpu_host_sysfs(host, numa_override=sysfs_numa)
    inventory, _ = discover(tmp_path, host, sysfs=sysfs)
    assert by_index(inventory)[0].numa == expected
    assert by_index(inventory)[7].numa == 1


def test_numa_is_none_when_neither_nvml_nor_sysfs_knows(tmp_path: Path) -> None:
    inventory, _ = discover(tmp_path, fake_nvml.a100_2x(numa_call="not_supported"), sysfs={})
    assert [g.numa for g in inventory.gpus] == [None, None]


# --------------------------------------------------------------------------- MIG


def instance_summary(gpu: Gpu) -> list[tuple[str, int, int | None, int | None, int | None]]:
    assert gpu.mig is not None
    return [
        (m.profile, m.gpu_instance_id, m.compute_instance_id, m.placement_start, m.placement_size)
        for m in gpu.mig.instances
    ]


@pytest.mark.parametrize(
    ("index", "enabled", "instances"),
    [
        pytest.param(0, False, [], id="gpu0-mig-disabled"),
        pytest.param(2, True, [("1g.10gb", 7 + s, 0, s, 1) for s in range(7)], id="gpu2-7x1g.10gb"),
        pytest.param(
            3,
            True,
            [("3g.40gb", 2, 0, 4, 4), ("2g.20gb", 5, 0, 0, 2), ("1g.10gb", 9, 0, 2, 1)],
            id="gpu3-3g+2g+1g",
        ),
        pytest.param(4, True, [], id="gpu4-enabled-no-instances"),
        pytest.param(5, True, [("4g.40gb", 1, 0, 0, 4), ("3g.40gb", 2, 0, 4, 4)], id="gpu5-4g+3g"),
        pytest.param(
            6,
            True,
            [("1c.3g.40gb", 1, 0, 0, 4), ("2c.3g.40gb", 1, 1, 0, 4), ("3g.40gb", 2, 0, 4, 4)],
            id="gpu6-compute-instances",
        ),
        pytest.param(7, True, [("7g.80gb", 0, 0, 0, 8)], id="gpu7-7g.80gb"),
    ],
)
@pytest.mark.parametrize("profile_info_v2", [True, False], ids=["named-profiles", "old-driver-names-derived"])
def test_mig_layouts(
    tmp_path: Path, index: int, enabled: bool, instances: list[tuple[object, ...]], profile_info_v2: bool
) -> None:
    inventory, _ = discover(tmp_path, fake_nvml.h100_8x_mixed_mig(profile_info_v2=profile_info_v2))
    gpu = by_index(inventory)[index]
    assert gpu.mig is not None
    assert gpu.mig.enabled is enabled
    assert instance_summary(gpu) == instances


def test_mig_instances_carry_uuid_memory_and_device_nodes(tmp_path: Path) -> None:
    host = fake_nvml.h100_8x_mixed_mig()
    inventory, _ = discover(tmp_path, host)
    gpu6 = by_index(inventory)[6]
    assert gpu6.mig is not None
    one_c, two_c, whole = gpu6.mig.instances

    assert one_c == MigInstance(
        gpu_instance_id=1,
        compute_instance_id=0,
        profile="1c.3g.40gb",
        placement_start=0,
        placement_size=4,
        uuid=host.gpus[6].mig_devices[0].uuid,
        memory_bytes=40448 * 1024 * 1024,
        device_nodes=("/dev/nvidia-caps/nvidia-cap822", "/dev/nvidia-caps/nvidia-cap823"),
    )
    # Two compute instances of one GPU instance share its GI node, each has its own CI node.
    assert two_c.device_nodes == ("/dev/nvidia-caps/nvidia-cap822", "/dev/nvidia-caps/nvidia-cap824")
    assert whole.device_nodes == (
        f"/dev/nvidia-caps/nvidia-cap{cap_minor(6, 2)}",
        f"/dev/nvidia-caps/nvidia-cap{cap_minor(6, 2, 0)}",
    )
    all_uuids = [m.uuid for g in inventory.gpus if g.mig for m in g.mig.instances]
    assert len(all_uuids) == 7 + 3 + 2 + 3 + 1
    assert all(u is not None and u.startswith("MIG-") for u in all_uuids)
    assert len(set(all_uuids)) == len(all_uuids)


def test_gpu_without_mig_support_has_no_mig_state(tmp_path: Path) -> None:
    inventory, nvml = discover(tmp_path, fake_nvml.l4_1x())
    assert inventory.gpus[0].mig is None
    assert "nvmlDeviceGetMaxMigDeviceCount" not in nvml.calls


def test_missing_mig_capability_files_are_reported_not_fatal(tmp_path: Path) -> None:
    inventory, _ = discover(tmp_path, fake_nvml.h100_8x_mixed_mig(), proc={})
    gpu7 = by_index(inventory)[7]
    assert gpu7.mig is not None
    assert gpu7.mig.instances[0].device_nodes == ()
    assert inventory.status == "ok"
    assert any("GPU 7: no MIG capability files for GPU instance 0" in p for p in inventory.problems)


def test_damaged_kernel_files_cost_one_gpu_a_detail_not_the_inventory(tmp_path: Path) -> None:
    host = fake_nvml.h100_8x_mixed_mig(numa_call="not_supported")
    sysfs = gpu_host_sysfs(host)
    sysfs["bus/pci/devices/0000:1b:00.0/numa_node"] = "zero\n"  # GPU 0's NUMA node, garbled
    proc = mig_capabilities_proc(host)
    access = "driver/nvidia/capabilities/gpu7/mig/gi0/access"
    del proc[access]
    proc[access + "/"] = ""  # a directory where GPU 7's MIG access file should be: EISDIR
    inventory, _ = discover(tmp_path, host, sysfs=sysfs, proc=proc)
    assert inventory.status == "ok"
    assert len(inventory.gpus) == 8
    assert (by_index(inventory)[0].numa, by_index(inventory)[1].numa) == (None, 0)
    gpu7 = by_index(inventory)[7]
    assert gpu7.mig is not None
    assert gpu7.mig.instances[0].device_nodes == ()
    assert sorted(p.split(":")[0] for p in inventory.problems) == ["GPU 0", "GPU 7"]
    gpu0, gpu7_problem = sorted(inventory.problems)
    assert "its NUMA node is unknown" in gpu0
    assert "0000:1b:00.0/numa_node: expected an integer, found 'zero" in gpu0
    assert "MIG instance 0" in gpu7_problem
    assert f"{access}: Is a directory (EISDIR)" in gpu7_problem


# --------------------------------------------------------------------------- no driver, no GPU


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        pytest.param("library_not_found", "libnvidia-ml.so.1 is not installed", id="library-missing"),
        pytest.param("driver_not_loaded", "kernel driver is not loaded", id="module-not-loaded"),
    ],
)
def test_no_driver_is_a_normal_state(tmp_path: Path, kind: str, says: str) -> None:
    inventory, nvml = discover(tmp_path, fake_nvml.no_driver(kind), sysfs=h100_host_sysfs())
    assert inventory.status == "no_driver"
    assert inventory.gpus == ()
    assert says in inventory.message
    assert nvml.calls == ["nvmlInit"]


def test_no_gpus_is_a_normal_state(tmp_path: Path) -> None:
    inventory, _ = discover(tmp_path, fake_nvml.no_gpus())
    assert inventory.status == "no_gpus"
    assert inventory.gpus == ()
    assert "550.90.07" in inventory.message


# --------------------------------------------------------------------------- failures while reading


def test_lost_gpu_is_reported_unhealthy_and_others_are_fine(tmp_path: Path) -> None:
    host = fake_nvml.h100_8x_mixed_mig()
    host.gpus[5].lost = True
    inventory, _ = discover(tmp_path, host)

    lost = by_index(inventory)[5]
    assert lost.healthy is False
    assert lost.health_events == ("gpu lost",)
    # NVML cannot say where it is; its place in PCI bus order does.
    assert (lost.pci_bus_id, lost.numa, lost.uuid) == ("0000:c3:00.0", 1, None)
    assert inventory.status == "ok"
    others = [g for g in inventory.gpus if g.index != 5]
    assert len(others) == 7
    assert all(g.healthy is None and g.uuid is not None for g in others)


def test_lost_gpu_without_sysfs_entry_is_left_out_with_a_problem(tmp_path: Path) -> None:
    host = fake_nvml.h100_8x_mixed_mig()
    host.gpus[7].lost = True
    inventory, _ = discover(tmp_path, host, sysfs={})
    assert [g.index for g in inventory.gpus] == list(range(7))
    assert len(inventory.problems) == 1
    assert inventory.problems[0].startswith("GPU 7: NVML cannot query it")


def test_unexpected_error_on_one_gpu_keeps_the_others(tmp_path: Path) -> None:
    class FlakyNvml(FakeNvml):
        def nvmlDeviceGetPciInfo(self, handle):
            if handle.gpu == 1:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
            return super().nvmlDeviceGetPciInfo(handle)

    nvml = FlakyNvml(fake_nvml.a100_2x())
    inventory = discover_gpus_with(NvmlBackend(nvml), tmp_path, tmp_path)
    assert [g.index for g in inventory.gpus] == [0]
    assert inventory.problems == ("GPU 1: reading GPU 1: NVML says Unknown Error",)
    assert not nvml.initialised


def test_failing_device_count_is_an_error_status(tmp_path: Path) -> None:
    class BrokenNvml(FakeNvml):
        def nvmlDeviceGetCount(self):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)

    nvml = BrokenNvml(fake_nvml.a100_2x())
    inventory = discover_gpus_with(NvmlBackend(nvml), tmp_path, tmp_path)
    assert inventory.status == "error"
    assert "counting GPUs: NVML says Insufficient Permissions" in inventory.message
    assert not nvml.initialised


# --------------------------------------------------------------------------- pure helpers


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        pytest.param(b"00000000:1B:00.0", "0000:1b:00.0", id="nvml-bytes"),
        pytest.param("00000000:c3:00.0", "0000:c3:00.0", id="nvml-str"),
        pytest.param("0000:1b:00.0", "0000:1b:00.0", id="already-sysfs-form"),
        pytest.param(b"00000001:DF:00.1\x00", "0001:df:00.1", id="other-domain-nul-padded"),
    ],
)
def test_normalise_pci_bus_id(raw: str | bytes, expected: str) -> None:
    assert normalise_pci_bus_id(raw) == expected


def test_normalise_pci_bus_id_rejects_garbage() -> None:
    with pytest.raises(DiscoveryError, match=r"expected DOMAIN:BUS:DEVICE\.FUNCTION"):
        normalise_pci_bus_id("GPU-0")


@pytest.mark.parametrize(
    ("gi", "ci", "memory_mb", "gpu_memory", "expected"),
    [
        pytest.param(1, 1, 9984, H100_MEMORY, "1g.10gb", id="h100-1g"),
        pytest.param(1, 1, 20096, H100_MEMORY, "1g.20gb", id="h100-1g.20gb"),
        pytest.param(3, 3, 40448, H100_MEMORY, "3g.40gb", id="h100-3g"),
        pytest.param(7, 7, 81152, H100_MEMORY, "7g.80gb", id="h100-7g-rounds-79.25GiB-up"),
        pytest.param(3, 1, 40448, H100_MEMORY, "1c.3g.40gb", id="h100-compute-instance"),
        pytest.param(1, 1, 4864, 40960 * 1024 * 1024, "1g.5gb", id="a100-40gb-1g"),
        pytest.param(2, 2, 9856, None, "2g.10gb", id="gpu-memory-unknown"),
    ],
)
def test_mig_profile_name(gi: int, ci: int, memory_mb: int, gpu_memory: int | None, expected: str) -> None:
    assert mig_profile_name(gi, ci, memory_mb, gpu_memory) == expected


# --------------------------------------------------------------------------- the fake stays faithful


def test_backend_uses_only_functions_the_real_pynvml_has(tmp_path: Path) -> None:
    _, nvml = discover(tmp_path, fake_nvml.h100_8x_mixed_mig())
    assert set(nvml.calls) - set(dir(pynvml)) == set()
    assert "nvmlGpuInstanceGetInfo" in nvml.calls


@pytest.mark.parametrize(
    ("call", "error"),
    [
        pytest.param(lambda n: n.nvmlDeviceGetCount(), pynvml.NVMLError_Uninitialized, id="before-init"),
    ],
)
def test_fake_requires_init(call, error) -> None:
    with pytest.raises(error):
        call(FakeNvml(fake_nvml.a100_2x()))


@pytest.mark.parametrize(
    ("call", "error"),
    [
        pytest.param(
            lambda n: n.nvmlDeviceGetHandleByIndex(8), pynvml.NVMLError_InvalidArgument, id="bad-index"
        ),
        pytest.param(
            lambda n: n.nvmlDeviceGetMigDeviceHandleByIndex(n.nvmlDeviceGetHandleByIndex(0), 0),
            pynvml.NVMLError_InvalidArgument,
            id="mig-handle-while-mig-disabled",
        ),
        pytest.param(
            lambda n: n.nvmlDeviceGetMigDeviceHandleByIndex(n.nvmlDeviceGetHandleByIndex(3), 5),
            pynvml.NVMLError_NotFound,
            id="empty-mig-slot",
        ),
        pytest.param(
            lambda n: n.nvmlDeviceGetGpuInstanceId(n.nvmlDeviceGetHandleByIndex(3)),
            pynvml.NVMLError_NotSupported,
            id="instance-id-of-full-gpu",
        ),
        pytest.param(
            lambda n: n.nvmlEventSetWait_v2(n.nvmlEventSetCreate(), 0),
            pynvml.NVMLError_Timeout,
            id="no-event",
        ),
    ],
)
def test_fake_raises_the_real_nvml_errors(call, error) -> None:
    nvml = FakeNvml(fake_nvml.h100_8x_mixed_mig())
    nvml.nvmlInit()
    with pytest.raises(error) as info:
        call(nvml)
    assert isinstance(info.value, pynvml.NVMLError)


def test_fake_rejects_impossible_mig_layouts() -> None:
    host = fake_nvml.h100_8x_mixed_mig()
    overlapping = (
        fake_nvml.FakeMigDevice("4g.40gb", gpu_instance_id=1, placement_start=0),
        fake_nvml.FakeMigDevice("2g.20gb", gpu_instance_id=3, placement_start=2),
    )
    gpu = host.gpus[0]
    gpu.mig_devices = overlapping
    with pytest.raises(ValueError, match="memory slice 2"):
        fake_nvml._with_uuids(gpu)


# --------------------------------------------------------------------------- the real library


def test_real_pynvml_never_crashes_discovery() -> None:
    """On a host without NVIDIA driver this is no_driver and (); on a GPU host it lists the GPUs."""
    inventory = discover_gpus_with(NvmlBackend())
    assert inventory.status in ("ok", "no_driver", "no_gpus"), inventory.message
    gpus = discover_gpus()
    if inventory.status == "ok":
        assert [g.uuid for g in gpus] == [g.uuid for g in inventory.gpus]
    else:
        assert gpus == ()
        assert inventory.gpus == ()
