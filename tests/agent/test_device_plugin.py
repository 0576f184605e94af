"""The kubelet device plugin (agent/deviceplugin.py) against a fake kubelet in grpcio.

The fake kubelet serves the v1beta1 Registration service on ``kubelet.sock`` in a short temporary
directory (unix socket paths are limited to 108 bytes); the plugins are polled by hand
(``start(watch=False)``, ``poll()``) so nothing waits on a clock.
"""

from __future__ import annotations

import dataclasses
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from nodeagent.agent.deviceplugin import DevicePlugins, preferred, resource_devices
from nodeagent.agent.deviceplugin_api import api_pb2 as pb
from nodeagent.agent.deviceplugin_api import api_pb2_grpc as rpc
from nodeagent.devices.synthetic import synthetic_topology
from nodeagent.devices.topology import Topology

# Two NUMA nodes, two GPUs on each; GPU 3 is split into MIG instances; one FPGA per node.
TOPOLOGY = synthetic_topology(
    sockets=2, gpus_per_numa=2, mig={3: ["1g.10gb", "1g.10gb", "3g.40gb"]}, fpgas_per_numa=1
)
GPU = [f"GPU-{i:08x}-0000-0000-0000-000000000000" for i in range(4)]


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


class FakeKubelet:
    """The kubelet's Registration service: records every request; ``refuse`` answers an error;
    with a ``gate``, each Register waits until the gate is set (a kubelet that hangs)."""

    def __init__(self, directory: Path, *, refuse: bool = False, gate: threading.Event | None = None) -> None:
        self.requests: queue.Queue[pb.RegisterRequest] = queue.Queue()
        self.refuse = refuse
        self.gate = gate
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        rpc.add_RegistrationServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix://{directory / 'kubelet.sock'}")
        self.server.start()

    def Register(self, request: pb.RegisterRequest, context: Any) -> pb.Empty:  # gRPC names the method
        if self.gate is not None:
            self.gate.wait(30)
        if self.refuse:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "resource name already taken")
        self.requests.put(request)
        return pb.Empty()

    def registered(self) -> dict[str, pb.RegisterRequest]:
        out = {}
        while not self.requests.empty():
            r = self.requests.get_nowait()
            out[r.resource_name] = r
        return out

    def stop(self) -> None:
        self.server.stop(None).wait()


class Source:
    """A DeviceSource over a topology the test changes."""

    def __init__(self, topology: Topology, free: Mapping[int, float]) -> None:
        self.current = topology
        self.free = dict(free)

    def topology(self) -> Topology:
        return self.current

    def free_cpus_by_numa(self) -> Mapping[int, float]:
        return self.free


@pytest.fixture
def plugin_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def kubelet(plugin_dir: Path) -> Iterator[FakeKubelet]:
    k = FakeKubelet(plugin_dir)
    yield k
    k.stop()


@pytest.fixture
def fuse(plugin_dir: Path) -> str:
    # An allowed device that exists (a plain file stands in for /dev/fuse).
    path = plugin_dir / "fuse"
    path.write_text("")
    return str(path)


def make(plugin_dir: Path, source: Source, *, fuse: str | None = None, cdi: bool = True) -> DevicePlugins:
    return DevicePlugins(source, plugin_dir, allowed_devices=(fuse,) if fuse else (), cdi=cdi)


@pytest.fixture
def source() -> Source:
    return Source(TOPOLOGY, {0: 2.0, 1: 6.0})


@pytest.fixture
def plugins(plugin_dir: Path, kubelet: FakeKubelet, source: Source, fuse: str) -> Iterator[DevicePlugins]:
    p = make(plugin_dir, source, fuse=fuse)
    p.start(watch=False)
    yield p
    p.close()


def stub(plugin_dir: Path, suffix: str) -> tuple[grpc.Channel, rpc.DevicePluginStub]:
    channel = grpc.insecure_channel(f"unix://{plugin_dir / f'nodeagent-{suffix}.sock'}")
    return channel, rpc.DevicePluginStub(channel)


def test_registers_every_resource_class(
    plugins: DevicePlugins, kubelet: FakeKubelet, plugin_dir: Path
) -> None:
    got = kubelet.registered()
    assert sorted(got) == [
        "nodeagent.io/device-fuse",
        "nodeagent.io/fpga",
        "nodeagent.io/gpu",
        "nodeagent.io/mig-1g.10gb",
        "nodeagent.io/mig-3g.40gb",
    ]
    gpu = got["nodeagent.io/gpu"]
    assert gpu.version == "v1beta1"
    assert gpu.endpoint == "nodeagent-gpu.sock"
    assert gpu.options.get_preferred_allocation_available
    assert (plugin_dir / "nodeagent-mig-1g.10gb.sock").is_socket()
    assert plugins.problems() == ()
    # A MIG-mode GPU is offered as its instances only.
    assert [d.id for d in plugins.resources["nodeagent.io/gpu"]] == GPU[:3]
    assert len(plugins.resources["nodeagent.io/mig-1g.10gb"]) == 2


def test_list_and_watch_streams_health_and_changes(
    plugins: DevicePlugins, source: Source, plugin_dir: Path
) -> None:
    channel, dp = stub(plugin_dir, "gpu")
    with channel:
        stream = dp.ListAndWatch(pb.Empty(), timeout=30)
        first = next(stream)
        assert [(d.ID, d.health, [n.ID for n in d.topology.nodes]) for d in first.devices] == [
            (GPU[0], "Healthy", [0]),
            (GPU[1], "Healthy", [0]),
            (GPU[2], "Healthy", [1]),
        ]
        gpus = tuple(
            dataclasses.replace(g, healthy=False, health_events=("xid 79",)) if g.index == 1 else g
            for g in TOPOLOGY.gpus
        )
        source.current = dataclasses.replace(TOPOLOGY, gpus=gpus)
        plugins.poll()
        second = next(stream)
        assert {d.ID: d.health for d in second.devices} == {
            GPU[0]: "Healthy",
            GPU[1]: "Unhealthy",
            GPU[2]: "Healthy",
        }
        stream.cancel()


def test_preferred_allocation_follows_free_cpus(plugins: DevicePlugins, plugin_dir: Path) -> None:
    channel, dp = stub(plugin_dir, "fpga")
    with channel:
        # Node 1 has more free CPUs: the FPGA there is preferred.
        answer = dp.GetPreferredAllocation(
            pb.PreferredAllocationRequest(
                container_requests=[
                    pb.ContainerPreferredAllocationRequest(
                        available_deviceIDs=["fpga0", "fpga1"], allocation_size=1
                    )
                ]
            ),
            timeout=30,
        )
        assert list(answer.container_responses[0].deviceIDs) == ["fpga1"]


def test_preferred_keeps_one_node_and_honours_must_include() -> None:
    devices = {d.id: d for d in resource_devices(synthetic_topology(sockets=2, gpus_per_numa=2))["gpu"]}
    ids = sorted(devices)  # 0, 1 on node 0; 2, 3 on node 1
    assert preferred(devices, ids, [], 2, {0: 2, 1: 6}) == ids[2:]
    assert preferred(devices, ids, [], 2, {0: 8, 1: 6}) == ids[:2]
    # A must-include device pins its node even where the other has more free CPUs.
    assert preferred(devices, ids, [ids[1]], 2, {0: 2, 1: 6}) == [ids[1], ids[0]]
    # More than one node holds: fill the best node first, then the next.
    assert preferred(devices, ids, [], 3, {0: 2, 1: 6}) == [ids[2], ids[3], ids[0]]
    with pytest.raises(ValueError, match="unknown device"):
        preferred(devices, ["nope"], [], 1, {})
    with pytest.raises(ValueError, match="does not fit"):
        preferred(devices, ids, [], 5, {})


def allocate(plugin_dir: Path, resource: str, ids: list[str]) -> Any:
    """One container's Allocate answer from the plugin of ``nodeagent.io/<resource>``."""
    channel, dp = stub(plugin_dir, resource)
    with channel:
        answer = dp.Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)]), timeout=30
        )
    return answer.container_responses[0]


def test_allocate_answers_cdi_names_and_visible_devices(plugins: DevicePlugins, plugin_dir: Path) -> None:
    c = allocate(plugin_dir, "gpu", [GPU[0], GPU[2]])
    assert [d.name for d in c.cdi_devices] == [f"nodeagent.io/gpu={GPU[0]}", f"nodeagent.io/gpu={GPU[2]}"]
    assert list(c.devices) == []
    assert dict(c.envs) == {"NVIDIA_VISIBLE_DEVICES": f"{GPU[0]},{GPU[2]}"}


def test_allocate_answers_nodes_for_mig_and_cdi_for_allowed_devices(
    plugins: DevicePlugins, plugin_dir: Path, fuse: str
) -> None:
    mig = plugins.resources["nodeagent.io/mig-3g.40gb"][0]
    c = allocate(plugin_dir, "mig-3g.40gb", [mig.id])
    # No CDI spec names MIG instances: the GPU's node and the instance's capability node.
    assert [(d.host_path, d.container_path, d.permissions) for d in c.devices] == [
        ("/dev/nvidia3", "/dev/nvidia3", "rw"),
        ("/dev/nvidia-caps/nvidia-cap303", "/dev/nvidia-caps/nvidia-cap303", "rw"),
    ]
    assert dict(c.envs) == {"NVIDIA_VISIBLE_DEVICES": mig.id}
    c = allocate(plugin_dir, "device-fuse", ["fuse"])
    # The agent's nodeagent.io/device spec names it (SlotCdiSpecs.write_device_specs).
    assert [d.name for d in c.cdi_devices] == ["nodeagent.io/device=fuse"]
    assert list(c.devices) == []
    assert dict(c.envs) == {}


def test_without_cdi_specs_allocate_hands_device_nodes(
    plugin_dir: Path, kubelet: FakeKubelet, source: Source, fuse: str
) -> None:
    p = make(plugin_dir, source, cdi=False)
    p.start(watch=False)
    try:
        c = allocate(plugin_dir, "gpu", [GPU[1]])
        assert list(c.cdi_devices) == []
        assert c.devices[0].host_path == "/dev/nvidia1"
    finally:
        p.close()
    with_fuse = make(plugin_dir, source, fuse=fuse, cdi=False)
    with_fuse.start(watch=False)
    try:
        c = allocate(plugin_dir, "device-fuse", ["fuse"])
        assert list(c.cdi_devices) == []
        assert [d.host_path for d in c.devices] == [fuse]
    finally:
        with_fuse.close()


def test_bad_requests_are_invalid_argument(plugins: DevicePlugins, plugin_dir: Path) -> None:
    channel, dp = stub(plugin_dir, "gpu")
    with channel:
        with pytest.raises(grpc.RpcError) as err:
            dp.Allocate(
                pb.AllocateRequest(
                    container_requests=[pb.ContainerAllocateRequest(devices_ids=["GPU-nope"])]
                ),
                timeout=30,
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "GPU-nope" in (err.value.details() or "")
        with pytest.raises(grpc.RpcError) as err:
            dp.GetPreferredAllocation(
                pb.PreferredAllocationRequest(
                    container_requests=[
                        pb.ContainerPreferredAllocationRequest(
                            available_deviceIDs=[GPU[0]], allocation_size=2
                        )
                    ]
                ),
                timeout=30,
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_registers_again_after_the_kubelet_restarts(
    plugins: DevicePlugins, kubelet: FakeKubelet, plugin_dir: Path
) -> None:
    kubelet.registered()
    kubelet.stop()
    # What a restarting kubelet does: remove every socket in the directory, then serve anew.
    for sock in plugin_dir.glob("*.sock"):
        sock.unlink()
    again = FakeKubelet(plugin_dir)
    try:
        plugins.poll()
        assert len(again.registered()) == 5
        assert (plugin_dir / "nodeagent-gpu.sock").is_socket()
        channel, dp = stub(plugin_dir, "gpu")
        with channel:
            options = dp.GetDevicePluginOptions(pb.Empty(), timeout=30)
        assert options.get_preferred_allocation_available
        # Nothing changed since: the next poll registers nothing.
        plugins.poll()
        assert again.registered() == {}
    finally:
        again.stop()


def test_no_kubelet_is_a_problem_until_it_comes(plugin_dir: Path, source: Source) -> None:
    p = make(plugin_dir, source)
    try:
        p.start(watch=False)
        assert len(p.problems()) == 4
        assert "no kubelet socket" in p.problems()[0]
        k = FakeKubelet(plugin_dir)
        try:
            p.poll()
            assert len(k.registered()) == 4
            assert p.problems() == ()
        finally:
            k.stop()
    finally:
        p.close()


def test_a_refusing_kubelet_is_a_problem(plugin_dir: Path, source: Source) -> None:
    k = FakeKubelet(plugin_dir, refuse=True)
    p = make(plugin_dir, source)
    try:
        p.start(watch=False)
        assert any("already taken" in text for text in p.problems())
    finally:
        p.close()
        k.stop()


def test_close_removes_the_sockets(plugin_dir: Path, kubelet: FakeKubelet, source: Source) -> None:
    p = make(plugin_dir, source)
    p.start()
    wait_for(lambda: len(list(plugin_dir.glob("nodeagent-*.sock"))) == 4, "the plugins' sockets")
    assert sorted(s.name for s in plugin_dir.glob("nodeagent-*.sock")) == [
        "nodeagent-fpga.sock",
        "nodeagent-gpu.sock",
        "nodeagent-mig-1g.10gb.sock",
        "nodeagent-mig-3g.40gb.sock",
    ]
    p.close()
    assert list(plugin_dir.glob("nodeagent-*.sock")) == []
    assert (plugin_dir / "kubelet.sock").exists()


def test_start_does_not_wait_on_a_kubelet_that_hangs(plugin_dir: Path, source: Source) -> None:
    # The agent starts its API after the plugins: a kubelet that takes a registration and does
    # not answer must cost the agent nothing (the registrations wait on the plugins' thread).
    gate = threading.Event()
    k = FakeKubelet(plugin_dir, gate=gate)
    p = make(plugin_dir, source)
    try:
        p.start()
        # Returned while the first registration still hangs: nothing registered, nothing failed.
        assert k.requests.empty()
        assert p.problems() == ()
        gate.set()
        wait_for(lambda: k.requests.qsize() == 4, "the four registrations once the kubelet answers")
        assert p.problems() == ()
    finally:
        gate.set()
        p.close()
        k.stop()
