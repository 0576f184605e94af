"""The shared pool: pure pool math, write ordering under v1's subset rule, and the updater on a fake tree."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nodeagent.cgroups import CgroupHost, Hierarchy
from nodeagent.devices.cpu import discover_cpu_topology
from nodeagent.devices.topology import Cpu, NumaNode, Topology
from nodeagent.errors import ConfigError, Conflict
from nodeagent.isolation.cpus import (
    CpuLayout,
    CpusetGroup,
    SharedPool,
    follow_affinity,
    limit_cpus,
    plan_cpuset_writes,
    shared_pool,
    shared_slot_cpus,
)
from nodeagent.kernelfs import Sysfs
from tests.devices import sysfs_trees
from tests.trees import write_tree

F = frozenset
TWO_NODES = CpuLayout(online=F(range(8)), node_cpus={0: F(range(4)), 1: F(range(4, 8))})


@pytest.mark.parametrize(
    ("online", "reserved", "exclusive", "pool"),
    [
        pytest.param(F(range(4)), F(), {}, F(range(4)), id="nothing-taken"),
        pytest.param(F(range(4)), F({0}), {}, F({1, 2, 3}), id="reserved-never-shared"),
        pytest.param(F(range(4)), F({0}), {"a": F({2}), "b": F({3})}, F({1}), id="two-exclusive-slots"),
        pytest.param(F(range(2)), F(), {"a": F({0, 1})}, F(), id="all-exclusive-empty-pool"),
    ],
)
def test_shared_pool(
    online: frozenset[int], reserved: frozenset[int], exclusive: dict, pool: frozenset[int]
) -> None:
    assert shared_pool(online, reserved, exclusive) == pool


@pytest.mark.parametrize(
    ("pool", "mems", "expected"),
    [
        pytest.param(F({1, 2, 5, 6}), None, F({1, 2, 5, 6}), id="unbound-gets-the-pool"),
        pytest.param(F({1, 2, 5, 6}), F({1}), F({5, 6}), id="bound-to-node-1"),
        pytest.param(F({1, 2, 5, 6}), F({0, 1}), F({1, 2, 5, 6}), id="bound-to-all-nodes"),
        pytest.param(F({1, 2}), F({1}), F(), id="node-has-no-pool-cpu"),
    ],
)
def test_shared_slot_cpus(
    pool: frozenset[int], mems: frozenset[int] | None, expected: frozenset[int]
) -> None:
    assert shared_slot_cpus(pool, mems, TWO_NODES) == expected


def _simulate_v1(groups: list[CpusetGroup]) -> dict[str, frozenset[int]]:
    """Apply the plan to a model of v1 cpusets, asserting the kernel's subset rule after every write."""
    state = {g.relpath: g.current for g in groups}
    for relpath, cpus in plan_cpuset_writes(groups):
        state[relpath] = cpus
        for child, child_cpus in state.items():
            parent = child.rpartition("/")[0]
            assert parent not in state or child_cpus <= state[parent], (
                f"{child} left its parent after {relpath}"
            )
    return state


def _tree(
    parent: set[int], pool_now: set[int], pool_next: set[int], child_next: set[int] | None = None
) -> list:
    return [
        CpusetGroup("p", F(parent), F(parent)),
        CpusetGroup("p/burstable", F(pool_now), F(pool_next)),
        CpusetGroup("p/best-effort", F(pool_now), F(pool_next)),
        CpusetGroup("p/burstable/a", F(pool_now), F(pool_next if child_next is None else child_next)),
        CpusetGroup("p/best-effort/b", F(pool_now), F(pool_next)),
    ]


@pytest.mark.parametrize(
    ("groups", "first"),
    [
        pytest.param(_tree({0, 1, 2, 3}, {0, 1, 2, 3}, {0, 1}), "p/burstable/a", id="shrink-children-first"),
        pytest.param(_tree({0, 1, 2, 3}, {0, 1}, {0, 1, 2, 3}), "p/best-effort", id="grow-parents-first"),
        pytest.param(_tree({0, 1, 2, 3}, {0, 1}, {2, 3}), "p/best-effort", id="swap-widens-then-cuts"),
        pytest.param(_tree({0, 1, 2, 3}, {0, 1, 2}, {0, 1}, {1}), "p/burstable/a", id="numa-bound-child"),
    ],
)
def test_plan_keeps_every_child_inside_its_parent(groups: list[CpusetGroup], first: str) -> None:
    final = _simulate_v1(groups)
    assert final == {g.relpath: g.target for g in groups}
    assert plan_cpuset_writes(groups)[0][0] == first


def test_plan_writes_nothing_when_everything_is_in_place() -> None:
    assert plan_cpuset_writes(_tree({0, 1}, {0}, {0})) == []


cpu_sets = st.frozensets(st.integers(0, 7))


@given(current=cpu_sets, target=cpu_sets, child_now=cpu_sets, child_next=cpu_sets)
def test_any_change_reaches_its_target_within_the_subset_rule(
    current: frozenset[int], target: frozenset[int], child_now: frozenset[int], child_next: frozenset[int]
) -> None:
    groups = [
        CpusetGroup("p", F(range(8)), F(range(8))),
        CpusetGroup("p/burstable", current, target),
        CpusetGroup("p/burstable/a", child_now & current, child_next & target),
    ]
    final = _simulate_v1(groups)
    assert final == {g.relpath: g.target for g in groups}


@pytest.mark.parametrize(
    ("tree", "online", "node_cpus"),
    [
        pytest.param(
            sysfs_trees.four_numa_nps2(),
            F(range(32)),
            {n: F(range(4 * n, 4 * n + 4)) | F(range(16 + 4 * n, 20 + 4 * n)) for n in range(4)},
            id="four-nodes",
        ),
        pytest.param(
            sysfs_trees.offline_cpus(),
            F({0, 1, 2, 4, 6}),
            {0: F({0, 1, 2, 4, 6})},
            id="offline-left-out",
        ),
        pytest.param(
            {k: v for k, v in sysfs_trees.dual_socket_ht().items() if not k.startswith(sysfs_trees.NODE)},
            F(range(16)),
            {0: F(range(16))},
            id="no-numa-is-one-node",
        ),
    ],
)
def test_layout_from_devices_discovery(
    tmp_path: Path, tree: dict[str, str], online: frozenset[int], node_cpus: dict[int, frozenset[int]]
) -> None:
    write_tree(tmp_path / "sys", tree)
    (tmp_path / "proc").mkdir()  # a kernel without NUMA sends discovery to meminfo: absent here
    topology = discover_cpu_topology(Sysfs(tmp_path / "sys"), proc_root=tmp_path / "proc")
    layout = CpuLayout.of(topology)
    assert (layout.online, layout.node_cpus) == (online, node_cpus)


def test_layout_of_a_topology_drops_offline_cpus_from_their_node() -> None:
    cpus = tuple(Cpu(id=i, core=i, socket=0, numa=i // 2, l3=None, online=i != 3) for i in range(4))
    nodes = (NumaNode(0, (0, 1), None, None), NumaNode(1, (2, 3), None, None), NumaNode(2, (), None, None))
    layout = CpuLayout.of(Topology("h", cpus, nodes))
    assert layout.online == F({0, 1, 2})
    assert layout.node_cpus == {0: F({0, 1}), 1: F({2}), 2: F()}
    assert layout.cpus_of([1, 2]) == F({2})


# --------------------------------------------------------------------------- the updater on a fake tree

PARENT = "na.slice"


def _cpuset(cpus: str, mems: str = "0-1") -> dict[str, str]:
    return {"cpuset.cpus": cpus, "cpuset.mems": mems}


def _fake_host(tmp_path: Path, groups: dict[str, dict[str, str]]) -> tuple[CgroupHost, Path]:
    mount = tmp_path / "cpuset"
    files = {"cpuset.cpus": "0-7\n", "cpuset.mems": "0-1\n", "cgroup.procs": ""}
    for relpath, values in groups.items():
        files.update({f"{relpath}/{name}": value for name, value in values.items()})
    write_tree(mount, files)
    return CgroupHost(mode="v1", v1_mounts={"cpuset": mount}, can_write=True), mount


@pytest.fixture
def fake_pool(
    tmp_path: Path,
) -> Callable[[dict[str, dict[str, str]], frozenset[int]], tuple[SharedPool, Path]]:
    def build(groups: dict[str, dict[str, str]], reserved: frozenset[int] = F()) -> tuple[SharedPool, Path]:
        host, mount = _fake_host(tmp_path, groups)
        return SharedPool(host, Hierarchy(PARENT), TWO_NODES, reserved), mount

    return build


def _cpus(mount: Path, relpath: str) -> str:
    return (mount / relpath / "cpuset.cpus").read_text().strip()


def test_sync_keeps_exclusive_cpus_out_of_every_shared_group(fake_pool) -> None:
    pool, mount = fake_pool(
        {
            PARENT: _cpuset("0-7"),
            f"{PARENT}/guaranteed-a": _cpuset("2-3", "0"),
            f"{PARENT}/burstable": _cpuset("0-7"),
            f"{PARENT}/best-effort": _cpuset("0-7"),
            f"{PARENT}/burstable/web": _cpuset("0-7"),
            f"{PARENT}/burstable/numa1": _cpuset("0-7", "1"),
            f"{PARENT}/best-effort/batch": _cpuset("0-7"),
        },
        F({0}),
    )
    assert pool.exclusive_by_slot() == {"guaranteed-a": F({2, 3})}
    assert pool.sync() == F({1, 4, 5, 6, 7})
    assert _cpus(mount, PARENT) == "1-7"
    assert _cpus(mount, f"{PARENT}/guaranteed-a") == "2-3"
    for relpath in ("burstable", "best-effort", "burstable/web", "best-effort/batch"):
        assert _cpus(mount, f"{PARENT}/{relpath}") == "1,4-7"
    assert _cpus(mount, f"{PARENT}/burstable/numa1") == "4-7"


def test_sync_with_an_override_cuts_the_pool_for_a_slot_not_yet_created(fake_pool) -> None:
    pool, mount = fake_pool(
        {
            PARENT: _cpuset("0-7"),
            f"{PARENT}/burstable": _cpuset("0-7"),
            f"{PARENT}/best-effort": _cpuset("0-7"),
            f"{PARENT}/burstable/web": _cpuset("0-7"),
        }
    )
    assert pool.sync({"new": F({6, 7})}) == F(range(6))
    assert _cpus(mount, f"{PARENT}/burstable/web") == "0-5"
    assert pool.sync() == F(range(8))  # the slot never came: the pool grows back
    assert _cpus(mount, f"{PARENT}/burstable/web") == "0-7"


def test_sync_refuses_to_leave_a_numa_bound_shared_slot_without_cpus(fake_pool) -> None:
    pool, mount = fake_pool(
        {
            PARENT: _cpuset("0-7"),
            f"{PARENT}/burstable": _cpuset("0-7"),
            f"{PARENT}/best-effort": _cpuset("0-7"),
            f"{PARENT}/burstable/numa1": _cpuset("4-7", "1"),
        }
    )
    with pytest.raises(Conflict, match=r"burstable/numa1 .* would be left with no CPU"):
        pool.sync({"big": F({4, 5, 6, 7})})
    assert _cpus(mount, f"{PARENT}/burstable") == "0-7"  # refused before any write


def test_reserving_every_cpu_is_a_config_error(tmp_path: Path) -> None:
    host, _ = _fake_host(tmp_path, {})
    with pytest.raises(ConfigError, match="leave none of the online CPUs"):
        SharedPool(host, Hierarchy(PARENT), TWO_NODES, F(range(8)))


def test_cgroups_a_container_runtime_made_below_a_slot_follow_its_cpus(fake_pool) -> None:
    # podman's cgroups below a slot hold a copy of the slot's CPUs; v1 refuses to cut the slot
    # below them (EBUSY), so they are planned with the slot, each cut before its parent.
    pool, mount = fake_pool(
        {
            PARENT: _cpuset("0-7"),
            f"{PARENT}/burstable": _cpuset("0-7"),
            f"{PARENT}/best-effort": _cpuset("0-7"),
            f"{PARENT}/burstable/web": _cpuset("0-7"),
            f"{PARENT}/burstable/web/libpod-abc": _cpuset("0-7"),
            f"{PARENT}/burstable/web/conmon": _cpuset("0-7"),
            f"{PARENT}/guaranteed-a": _cpuset("2-3", "0"),
            f"{PARENT}/guaranteed-a/libpod-def": _cpuset("2-3", "0"),
        }
    )
    assert pool.sync() == F({0, 1, 4, 5, 6, 7})
    for relpath in ("burstable/web", "burstable/web/libpod-abc", "burstable/web/conmon"):
        assert _cpus(mount, f"{PARENT}/{relpath}") == "0-1,4-7"
    pool.follow(f"{PARENT}/guaranteed-a", F({3, 4}))
    assert _cpus(mount, f"{PARENT}/guaranteed-a") == "3-4"
    assert _cpus(mount, f"{PARENT}/guaranteed-a/libpod-def") == "3-4"
    groups = [
        CpusetGroup(f"{PARENT}/guaranteed-a", F({2, 3}), F({3})),
        CpusetGroup(f"{PARENT}/guaranteed-a/libpod-def", F({2, 3}), F({3})),
    ]
    assert [path for path, _ in plan_cpuset_writes(groups)] == [groups[1].relpath, groups[0].relpath]


@pytest.mark.parametrize(
    ("cpus", "limit", "expected"),
    [
        pytest.param(F({0, 1, 2, 3}), None, F({0, 1, 2, 3}), id="no-limit"),
        pytest.param(F({0, 1, 2, 3}), F({2, 3}), F({2, 3}), id="within"),
        pytest.param(F({0, 1}), F({6, 7}), F({1}), id="outside-keeps-the-highest"),
        pytest.param(F(), F({1}), F(), id="nothing-to-limit"),
    ],
)
def test_limit_cpus(cpus: frozenset[int], limit: frozenset[int] | None, expected: frozenset[int]) -> None:
    assert limit_cpus(cpus, limit) == expected


def test_sync_keeps_best_effort_within_its_limit_and_burstable_on_the_whole_pool(fake_pool) -> None:
    pool, mount = fake_pool(
        {
            PARENT: _cpuset("0-7"),
            f"{PARENT}/burstable": _cpuset("0-7"),
            f"{PARENT}/best-effort": _cpuset("0-7"),
            f"{PARENT}/burstable/web": _cpuset("0-7"),
            f"{PARENT}/best-effort/batch": _cpuset("0-7"),
            f"{PARENT}/best-effort/numa0": _cpuset("0-3", "0"),
        }
    )
    pool.best_effort_limit = F({6, 7})
    assert pool.sync() == F(range(8))
    assert _cpus(mount, f"{PARENT}/burstable/web") == "0-7"
    assert _cpus(mount, f"{PARENT}/best-effort/batch") == "6-7"
    # Bound to node 0, which has nothing of the limit: its highest pool CPU, and the parent holds it.
    assert _cpus(mount, f"{PARENT}/best-effort/numa0") == "3"
    assert _cpus(mount, f"{PARENT}/best-effort") == "3,6-7"
    # An exclusive slot taking CPU 7 moves nothing outside the limit.
    assert pool.sync({"g": F({7})}) == F(range(7))
    assert _cpus(mount, f"{PARENT}/best-effort/batch") == "6"
    pool.best_effort_limit = None
    pool.sync()
    assert _cpus(mount, f"{PARENT}/best-effort/batch") == "0-7"
    assert _cpus(mount, f"{PARENT}/best-effort") == "0-7"


@pytest.mark.parametrize(
    ("seen", "old", "new", "expected"),
    [
        pytest.param({0}, {0}, {0, 1}, {0, 1}, id="launched-on-a-one-cpu-pool-follows-its-growth"),
        pytest.param({0, 1}, {0, 1}, {0}, {0}, id="follows-a-shrink"),
        pytest.param({1}, {1}, {0}, {0}, id="follows-a-move"),
        pytest.param({2}, {0, 1, 2, 3}, {0, 1, 2, 3, 4, 5}, {2}, id="narrowed-keeps-its-choice"),
        pytest.param({2, 3}, {0, 1, 2, 3}, {0, 1, 3}, {3}, id="narrowed-keeps-what-is-left"),
        pytest.param({2}, {0, 1, 2}, {0, 1}, {0, 1}, id="narrowed-to-nothing-left-takes-the-new-cpuset"),
    ],
)
def test_a_task_follows_its_cpuset_unless_its_program_narrowed_it(
    seen: set[int], old: set[int], new: set[int], expected: set[int]
) -> None:
    assert follow_affinity(frozenset(seen), frozenset(old), frozenset(new)) == frozenset(expected)
