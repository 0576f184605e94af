"""The sandbox on a pure cgroup v2 host: the same guarantees as on v1 (read-only cgroupfs, a
cgroup namespace that shows the slot as the whole tree, private mounts, no capabilities, the
seccomp filter), with a v2 slot made here."""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent.runtime.sandbox import SandboxSpec, enter_sandbox, probe_live
from tests.runtime.sandbox.child import NOBODY, check_private_places, in_child, os_error_of, python, run

ROOT = Path("/sys/fs/cgroup")


@pytest.fixture
def v2_slot() -> Iterator[Path]:
    made = ROOT / f"natest{os.getpid()}-{time.monotonic_ns()}"
    made.mkdir()
    (made / "memory.max").write_text(str(96 << 20))
    yield made
    for pid in (made / "cgroup.procs").read_text().split():
        os.kill(int(pid), 9)
    for _ in range(200):
        try:
            made.rmdir()
            break
        except OSError:
            time.sleep(0.01)


VIEW = """
import errno, json, os
try:
    os.mkdir("/sys/fs/cgroup/escape")
    mkdir = "made"
except OSError as err:
    mkdir = errno.errorcode[err.errno]
print(json.dumps({
    "cgroup": open("/proc/self/cgroup").read().strip(),
    "dirs": [n for n in os.listdir("/sys/fs/cgroup") if os.path.isdir("/sys/fs/cgroup/" + n)],
    "memory_max": open("/sys/fs/cgroup/memory.max").read().strip(),
    "mkdir": mkdir,
    "tmp": os.listdir("/tmp"),
    "caps": [line.split()[1] for line in open("/proc/self/status") if line.startswith("CapEff")],
}))
"""


def test_cgroup_namespace_shows_the_slot_as_the_root(v2_slot: Path):
    spec = SandboxSpec(
        uid=NOBODY, gid=NOBODY, namespaces=("mount", "ipc", "uts", "cgroup"), cgroup_view="namespace"
    )
    finished = run(spec, python(VIEW), cgroup_procs=[str(v2_slot / "cgroup.procs")])
    assert finished.returncode == 0, finished.output
    view = json.loads(finished.output)
    assert view["cgroup"] == "0::/"
    assert view["dirs"] == []
    assert view["memory_max"] == str(96 << 20)
    assert view["mkdir"] == "EROFS"
    assert view["tmp"] == []
    assert view["caps"] == ["0000000000000000"]


def test_control_host_view_shows_the_slot_path_and_its_siblings(v2_slot: Path):
    spec = SandboxSpec(uid=NOBODY, gid=NOBODY, cgroup_view="host")
    finished = run(spec, [*python(VIEW.replace("/sys/fs/cgroup/memory.max", f"{v2_slot}/memory.max"))],
                   cgroup_procs=[str(v2_slot / "cgroup.procs")])  # fmt: skip
    view = json.loads(finished.output)
    assert view["cgroup"] == f"0::/{v2_slot.name}"
    assert v2_slot.name in view["dirs"]


def _mkdir_at_root(spec: SandboxSpec | None) -> int:
    if spec is not None:
        enter_sandbox(spec)
    target = ROOT / f"natest{os.getpid()}-probe"
    result = os_error_of(lambda: target.mkdir())
    if result == 0:
        target.rmdir()
    return result


def test_cgroupfs_is_read_only_for_root_and_writable_without_the_sandbox():
    assert in_child(lambda: _mkdir_at_root(SandboxSpec(uid=NOBODY, gid=NOBODY))) == errno.EROFS
    assert in_child(lambda: _mkdir_at_root(None)) == 0


def test_live_probe_finds_every_piece():
    assert {key: value for key, value in probe_live().items() if value != "ok"} == {}


def test_home_and_var_tmp_are_private_limited_and_charged_to_the_slot(v2_slot: Path, host_dir: Path):
    check_private_places(
        lambda spec, argv: run(spec, argv, cgroup_procs=[str(v2_slot / "cgroup.procs")]),
        str(v2_slot / "memory.current"),
        host_dir / "home",
    )
