"""CDI specs: the pure builder against the specification's rules, and the spec directory."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from nodeagent.isolation.cdi import (
    CONTAINER_SLOT_FILE,
    SLOT_KIND,
    CdiSpecDir,
    device_spec,
    qualified_name,
    required_version,
    slot_spec,
    valid_device_name,
    valid_kind,
)
from tests.isolation.cdi_schema import cdi_schema


def validate(spec: dict[str, Any]) -> None:
    jsonschema.validate(spec, cdi_schema(spec["cdiVersion"]))


def names(spec: dict[str, Any]) -> list[str]:
    return [d["name"] for d in spec["devices"]]


GPU_SLOT = slot_spec(
    "s0123456789ab",
    "mlp",
    ["/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap21", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia0"],
    {"OMP_NUM_THREADS": "4", "CUDA_VISIBLE_DEVICES": "MIG-1234", "NODEAGENT_SLOT_FILE": CONTAINER_SLOT_FILE},
    "/var/lib/nodeagent/cdi/s0123456789ab.json",
)


def test_a_slot_spec_is_valid_cdi_and_names_the_slot_twice() -> None:
    validate(GPU_SLOT)
    assert GPU_SLOT["kind"] == SLOT_KIND == "nodeagent.io/slot"
    assert names(GPU_SLOT) == ["mlp", "s0123456789ab"]
    first, second = (d["containerEdits"] for d in GPU_SLOT["devices"])
    assert first == second
    # Each node once, in order; type and numbers left to the runtime, which reads the host's node.
    assert first["deviceNodes"] == [
        {"path": "/dev/nvidia0"},
        {"path": "/dev/nvidia-caps/nvidia-cap21"},
        {"path": "/dev/nvidiactl"},
        {"path": "/dev/nvidia-uvm"},
    ]
    assert first["env"] == sorted(first["env"])
    assert "OMP_NUM_THREADS=4" in first["env"]
    assert first["mounts"] == [
        {
            "hostPath": "/var/lib/nodeagent/cdi/s0123456789ab.json",
            "containerPath": CONTAINER_SLOT_FILE,
            "options": ["ro", "nosuid", "nodev", "bind"],
            "type": "bind",
        }
    ]


def test_the_declared_version_is_the_oldest_that_has_what_the_spec_uses() -> None:
    # A mount's "type" arrived in 0.4.0: the slot spec declares 0.4.0, readable by podman 4.3's
    # CDI library (0.3.0-0.5.0) and by every later one.
    assert GPU_SLOT["cdiVersion"] == "0.4.0"
    bare = slot_spec("s0123456789ab", "cpu-only", [], {"OMP_NUM_THREADS": "1"}, None)
    validate(bare)
    assert bare["cdiVersion"] == "0.3.0"
    assert "deviceNodes" not in bare["devices"][0]["containerEdits"]
    with_host_path = {
        "devices": [{"containerEdits": {"deviceNodes": [{"path": "/dev/x", "hostPath": "/dev/y"}]}}]
    }
    assert required_version(with_host_path) == "0.5.0"
    # What the schema of a declared version refuses: a field of a later version.
    too_new = json.loads(json.dumps(GPU_SLOT))
    too_new["cdiVersion"] = "0.3.0"
    with pytest.raises(jsonschema.ValidationError):
        validate(too_new)


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("mlp", True),
        ("a.b_c-d:0", True),
        ("s0123456789ab", True),
        ("web-", False),
        ("-web", False),
        ("a/b", False),
        ("", False),
    ],
)
def test_device_names_follow_the_specification(name: str, ok: bool) -> None:
    assert valid_device_name(name) is ok


def test_a_slot_name_cdi_cannot_take_is_named_by_its_id_alone() -> None:
    spec = slot_spec("s0123456789ab", "web-", [], {}, None)
    validate(spec)
    assert names(spec) == ["s0123456789ab"]


def test_kinds() -> None:
    assert valid_kind("nodeagent.io/slot")
    assert valid_kind("foo.bar.baz/foo-bar123")
    for bad in ("foo", "vendor.com/foo/", "vendor.com/foo/bar", "/slot", "vendor.com/a.b"):
        assert not valid_kind(bad), bad
    assert qualified_name(SLOT_KIND, "mlp") == "nodeagent.io/slot=mlp"


def test_device_specs_for_gpus_and_fpgas() -> None:
    spec = device_spec(
        "nodeagent.io/gpu", {"0": ["/dev/nvidia0", "/dev/nvidiactl"], "GPU-abc": ["/dev/nvidia0"]}
    )
    validate(spec)
    assert names(spec) == ["0", "GPU-abc"]
    with pytest.raises(ValueError, match="at least one device"):
        device_spec("nodeagent.io/fpga", {})
    with pytest.raises(ValueError, match="not valid"):
        device_spec("nodeagent.io/fpga", {"bad/name": ["/dev/x"]})


def test_the_spec_directory_writes_atomically_lists_and_removes_only_its_own(tmp_path: Path) -> None:
    directory = CdiSpecDir(tmp_path / "cdi")
    assert directory.keys() == set()
    path = directory.write("s0123456789ab", GPU_SLOT)
    assert path.name == "nodeagent-slot-s0123456789ab.json"
    assert os.stat(path).st_mode & 0o777 == 0o644  # runtimes may read it as any user
    assert directory.read("s0123456789ab") == GPU_SLOT
    assert [p.name for p in (tmp_path / "cdi").iterdir()] == [path.name]  # no temporary file left
    directory.write("s111111111111", GPU_SLOT)
    foreign = tmp_path / "cdi" / "vendor.json"
    foreign.write_text("{}")
    stray = tmp_path / "cdi" / ".nodeagent-slot-s222222222222.json.tmp"  # a write the agent died in
    stray.write_text("{")
    os.utime(stray, (1, 1))
    under_way = tmp_path / "cdi" / ".nodeagent-slot-s333333333333.json.tmp"  # another's, being written
    under_way.write_text("{")
    assert directory.keys() == {"s0123456789ab", "s111111111111"}
    assert directory.remove_except({"s0123456789ab"}) == ["s111111111111"]
    assert sorted(p.name for p in (tmp_path / "cdi").iterdir()) == [under_way.name, path.name, "vendor.json"]
    under_way.unlink()
    # With an owner test, a file of another agent (same directory, same prefix) stays.
    directory.write(
        "s444444444444", {"devices": [{"containerEdits": {"mounts": [{"hostPath": "/other/x"}]}}]}
    )
    assert directory.remove_except({"s0123456789ab"}, owned=lambda spec: False) == []
    assert directory.remove_except({"s0123456789ab"}, owned=lambda spec: True) == ["s444444444444"]
    assert directory.remove("s0123456789ab") is True
    assert directory.remove("s0123456789ab") is False
    assert directory.read("s0123456789ab") is None
    assert CdiSpecDir(tmp_path / "absent").keys() == set()
    with pytest.raises(ValueError, match="prefix"):
        CdiSpecDir(tmp_path, "a/b")
