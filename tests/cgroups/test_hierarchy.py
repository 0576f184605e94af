"""The agent's cgroup layout and slot names."""

from __future__ import annotations

from pathlib import Path

import pytest

from nodeagent.cgroups import Hierarchy, list_owned
from nodeagent.cgroups import hierarchy as hierarchy_module
from nodeagent.cgroups.detect import CgroupHost
from nodeagent.cgroups.hierarchy import validate_name
from nodeagent.errors import InvalidRequest
from tests.trees import write_tree


@pytest.mark.parametrize(
    ("name", "qos", "path"),
    [
        pytest.param("web", "guaranteed", "nodeagent.slice/web", id="guaranteed"),
        pytest.param("web", "burstable", "nodeagent.slice/burstable/web", id="burstable"),
        pytest.param("batch", "best-effort", "nodeagent.slice/best-effort/batch", id="best-effort"),
    ],
)
def test_slot_paths(name: str, qos: str, path: str) -> None:
    assert Hierarchy().slot_path(name, qos) == path  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "tab\there", "nl\n", "del\x7f", "x" * 201], ids=repr)
def test_bad_names_are_refused(name: str) -> None:
    with pytest.raises(InvalidRequest):
        validate_name(name)


def test_class_names_are_reserved_for_slots() -> None:
    with pytest.raises(InvalidRequest, match="reserved"):
        Hierarchy().slot_path("burstable", "guaranteed")


def test_a_slots_candidate_paths_are_every_class_and_not_kept() -> None:
    layout = Hierarchy("cand.slice")
    assert layout.candidate_paths("web") == (
        "cand.slice/web",
        "cand.slice/burstable/web",
        "cand.slice/best-effort/web",
    )
    # The cache of slot paths holds a slot's own class only (asked for again and again), not the
    # two others each apply looks at once.
    cached = hierarchy_module._slot_path.cache_info().currsize
    layout.candidate_paths("api")
    assert hierarchy_module._slot_path.cache_info().currsize == cached
    with pytest.raises(InvalidRequest, match="reserved"):
        layout.candidate_paths("best-effort")


def test_unknown_class_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="unknown QoS class"):
        Hierarchy().slot_path("web", "gold")  # type: ignore[arg-type]


def test_parent_may_be_nested_but_not_escape() -> None:
    assert Hierarchy("agents/nodeagent.slice").parents()[1] == "agents/nodeagent.slice/burstable"
    with pytest.raises(InvalidRequest):
        Hierarchy("../etc")


def test_list_owned_finds_slots_in_any_hierarchy(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        {
            "memory/nodeagent.slice/g1/": "",
            "memory/nodeagent.slice/burstable/b1/": "",
            "memory/nodeagent.slice/best-effort/": "",
            "pids/nodeagent.slice/burstable/b2/": "",  # an orphan left in one hierarchy only
        },
    )
    host = CgroupHost(mode="v1", v1_mounts={"memory": tmp_path / "memory", "pids": tmp_path / "pids"})
    assert list_owned(host) == [
        "nodeagent.slice/g1",
        "nodeagent.slice/burstable/b1",
        "nodeagent.slice/burstable/b2",
    ]
