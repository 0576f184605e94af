"""SlotIsolator on a pure cgroup v2 kernel (collected only inside the VM, NODEAGENT_IN_CGROUP2_VM=1).

Every test gets an isolator of its own under ``natest<pid>-<n>.slice``, so a real nodeagent.slice is
never touched, and the fixture checks afterwards that nothing it created remains.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nodeagent.cgroups import CgroupHost, detect
from nodeagent.isolation.isolator import AppliedSlot, SlotIsolator
from nodeagent.isolation.network import SlotNetworkConfig
from nodeagent.isolation.resctrl import Resctrl
from nodeagent.isolation.slot_spec import IsolatorConfig

from ...cgroups.conftest import Child

_HERE = Path(__file__).parent
_numbers = itertools.count()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in item.path.parents:
            item.add_marker(pytest.mark.cgroup2vm)
            item.add_marker(pytest.mark.root)


@pytest.fixture
def host() -> CgroupHost:
    found = detect()
    if found.mode != "v2" or found.v2_mount is None:
        pytest.skip(f"needs a pure cgroup v2 host; this one is {found.mode}")
    if not {0, 1} <= os.sched_getaffinity(0):
        pytest.skip("needs CPUs 0 and 1")
    return found


@pytest.fixture
def isolator(host: CgroupHost, tmp_path: Path) -> Iterator[SlotIsolator]:
    pid = os.getpid()
    number = next(_numbers)
    tag = f"nav{pid % 100000}x{number}"
    config = IsolatorConfig(
        cgroup_parent=f"natest{pid}-{number}.slice",
        network=SlotNetworkConfig(
            cidr=f"100.{128 + pid % 64}.0.0/16",
            netns_prefix=f"natest-{tag}-",
            veth_prefix=tag,
            nft_table=f"natest-{tag}",
        ),
        resctrl_prefix=f"natest-{tag}-",
        resctrl_root=tmp_path / "no-resctrl",
    )
    iso = SlotIsolator(host, config, resctrl=Resctrl(root=tmp_path / "no-resctrl"))
    try:
        yield iso
    finally:
        iso.remove_all()
        assert host.v2_mount is not None
        assert not (host.v2_mount / config.cgroup_parent).exists(), "cgroups left behind"


@pytest.fixture
def start_in() -> Iterator[Callable[..., Child]]:
    """Start a paused Python child, move it into a slot (or leave it where it is with ``None``), then
    let it run ``code``; every child is killed by pid and reaped at the end."""
    children: list[Child] = []

    def start(applied: AppliedSlot | None, code: str = "import time\ntime.sleep(120)") -> Child:
        child = Child(code)
        children.append(child)
        for procs in applied.procs_files if applied else ():
            Path(procs).write_text(str(child.pid))
        child.release()
        return child

    yield start
    for child in children:
        child.stop()


@pytest.fixture
def loop_devices(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """Two loop devices backed by files in tmp_path (tmpfs in the guest), detached afterwards."""
    if shutil.which("losetup") is None:
        pytest.skip("needs losetup (util-linux)")
    attached: list[str] = []
    try:
        for name in ("allowed.img", "refused.img"):
            backing = tmp_path / name
            backing.write_bytes(b"\0" * (1 << 20))
            result = subprocess.run(
                ["losetup", "--find", "--show", str(backing)], capture_output=True, text=True, check=True
            )
            attached.append(result.stdout.strip())
        yield attached[0], attached[1]
    finally:
        for device in attached:
            subprocess.run(["losetup", "--detach", device], check=False)
