"""Whole nodes, then whole cores, then single threads: the order of kubelet's static CPU policy.

One table per rule, on named topologies. CPU numbering (Linux's usual, see devices/synthetic.py):
the first thread of every core, then the second threads, and so on, so on a host of C cores core k
holds CPUs k, C+k, 2C+k, ... By default the first physical core is reserved for the system.

- single-socket-ht: 4 cores x 2 threads; core k = CPUs k, 4+k (core 0 reserved: 0, 4).
- dual-socket-ht: 2 sockets (one node each) x 4 cores x 2; core k = CPUs k, 8+k; node 1 = cores 4-7.
- quad-socket-ht: 4 sockets (one node each) x 4 cores x 2; core k = CPUs k, 16+k; node n = cores
  4n..4n+3.
- quad-socket-smt4: 4 sockets (one node each) x 4 cores x 4 threads; core k = CPUs k, 16+k, 32+k,
  48+k; node n = cores 4n..4n+3 (core 0 reserved: 0, 16, 32, 48).
- 8-numa: 2 sockets x 4 nodes x 4 cores x 2; core k = CPUs k, 32+k; node n = cores 4n..4n+3,
  socket 1 = nodes 4-7.
- two-l3: 1 node, 8 cores x 2, two L3 caches (cores 0-3 and 4-7); core k = CPUs k, 8+k.
- smt4-offline: 1 node, 5 cores x 4; core k = CPUs k, 5+k, 10+k, 15+k; CPUs 17 and 18 offline, so
  cores 2 and 3 have 3 threads each (most cores still have 4).

Every case checks the exact CPUs and how many entirely free cores the slot took only in part
("split"), counted here from the topology rather than by the planner.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from nodeagent.devices.synthetic import synthetic_topology
from nodeagent.devices.topology import Topology
from nodeagent.placement import Allocated, PlacementOptions, plan
from nodeagent.schema.request import parse_slot_request

TOPOLOGIES: dict[str, Topology] = {
    "single-socket-ht": synthetic_topology(1, 1, 4, 2),
    "dual-socket-ht": synthetic_topology(2, 1, 4, 2),
    "quad-socket-ht": synthetic_topology(4, 1, 4, 2),
    "quad-socket-smt4": synthetic_topology(4, 1, 4, 4),
    "8-numa": synthetic_topology(2, 4, 4, 2),
    "two-l3": synthetic_topology(1, 1, 8, 2, l3_per_numa=2),
    "smt4-offline": synthetic_topology(1, 1, 5, 4, offline={17, 18}),
}
WHOLE_CORES_ON = ("whole_cores=true",)
WHOLE_CORES_OFF = ("whole_cores=false",)


def split_cores(topo: Topology, unavailable: frozenset[int], cpus: tuple[int, ...]) -> list[int]:
    """Cores that had no online CPU unavailable (held or reserved) and of which ``cpus`` holds only
    some of the online ones."""
    mine = set(cpus)
    split = []
    for core, siblings in sorted(topo.cores.items()):
        online = {c for c in siblings if topo.cpu_by_id[c].online}
        if unavailable.isdisjoint(online) and mine & online and not online <= mine:
            split.append(core)
    return split


def place_and_count_splits(
    topo_name: str, taken: tuple[int, ...], options: tuple[str, ...], cpus: int
) -> tuple[tuple[int, ...], int]:
    topo = TOPOLOGIES[topo_name]
    opts = PlacementOptions.from_strings(options)
    request = parse_slot_request({"name": "a", "qos": "guaranteed", "resources": {"cpus": cpus}})
    a = plan(topo, Allocated(cpus=frozenset(taken)), request, opts)
    reserved = opts.reserved_cpus if opts.reserved_cpus is not None else frozenset(topo.cores[0])
    return a.cpus, len(split_cores(topo, frozenset(taken) | reserved, a.cpus))


def both_ways(cases: list[tuple[str, str, dict[str, Any], tuple[int, ...]]]) -> list[Any]:
    """Each case with whole_cores on and with it off: the rule holds whatever the option says.

    A case is (label, topology, {"cpus": N, "taken": (...), "options": (...)}, expected CPUs).
    """
    return [
        pytest.param(
            topo,
            state.get("taken", ()),
            (*switch, *state.get("options", ())),
            state["cpus"],
            cpus,
            id=f"{label} ({switch[0]})",
        )
        for label, topo, state, cpus in cases
        for switch in (WHOLE_CORES_ON, WHOLE_CORES_OFF)
    ]


# --------------------------------------------------------------------------- whole nodes and sockets

WHOLE_NODE_CASES = both_ways(
    [
        ("2s: 8 CPUs take the free socket", "dual-socket-ht", {"cpus": 8}, (4, 5, 6, 7, 12, 13, 14, 15)),
        (
            "smt4: 16 CPUs take a free socket, not the partly reserved one",
            "quad-socket-smt4",
            {"cpus": 16},
            (*range(4, 8), *range(20, 24), *range(36, 40), *range(52, 56)),
        ),
        (
            "smt4: 32 CPUs take two free sockets",
            "quad-socket-smt4",
            {"cpus": 32},
            (*range(4, 12), *range(20, 28), *range(36, 44), *range(52, 60)),
        ),
        (
            "smt4: 28 CPUs take what socket 0 has left and socket 1",
            "quad-socket-smt4",
            {"cpus": 28},
            (*range(1, 8), *range(17, 24), *range(33, 40), *range(49, 56)),
        ),
        (
            "8numa: 16 CPUs take two nodes of one socket",
            "8-numa",
            {"cpus": 16},
            (*range(4, 12), *range(36, 44)),
        ),
        ("8numa: 32 CPUs take the free socket", "8-numa", {"cpus": 32}, (*range(16, 32), *range(48, 64))),
        (
            "8numa distributed: 32 CPUs still take the free socket",
            "8-numa",
            {"cpus": 32, "options": ("distribute_across_numa=true",)},
            (*range(16, 32), *range(48, 64)),
        ),
    ]
)


@pytest.mark.parametrize(("topo", "taken", "options", "want", "cpus"), WHOLE_NODE_CASES)
def test_a_request_that_fills_a_node_or_socket_takes_it_whole(
    topo: str, taken: tuple[int, ...], options: tuple[str, ...], want: int, cpus: tuple[int, ...]
) -> None:
    assert place_and_count_splits(topo, taken, options, want) == (cpus, 0)


# --------------------------------------------------------------------------- whole cores before threads

WHOLE_CORE_CASES = both_ways(
    [
        # Core 3 is half held: its free thread 7 is no reason to split core 1 or 2 for 2 CPUs.
        (
            "ht: 2 CPUs are a free core, not a spare thread and half a core",
            "single-socket-ht",
            {"cpus": 2, "taken": (3,)},
            (1, 5),
        ),
        # Core 1 has 3 spare threads (17, 33, 49); 4 CPUs are core 2, whole.
        (
            "smt4: 4 CPUs are a free core beside a partly used one",
            "quad-socket-smt4",
            {"cpus": 4, "taken": (1,)},
            (2, 18, 34, 50),
        ),
        ("smt4: 8 CPUs are two whole cores", "quad-socket-smt4", {"cpus": 8}, (1, 2, 17, 18, 33, 34, 49, 50)),
        # Core 1 has 4 threads, cores 2 and 3 three: 6 is 3 + 3 exactly, not 4 and a part of 3.
        (
            "offline siblings: 6 CPUs are two 3-thread cores",
            "smt4-offline",
            {"cpus": 6},
            (2, 3, 7, 8, 12, 13),
        ),
        # Core 1's sibling 33 is held: 2 CPUs are core 2, not CPU 1 and half of core 2.
        (
            "8numa: 2 CPUs are a free core beside a half-used one",
            "8-numa",
            {"cpus": 2, "taken": (33,)},
            (2, 34),
        ),
    ]
)


@pytest.mark.parametrize(("topo", "taken", "options", "want", "cpus"), WHOLE_CORE_CASES)
def test_whole_free_cores_come_before_single_threads(
    topo: str, taken: tuple[int, ...], options: tuple[str, ...], want: int, cpus: tuple[int, ...]
) -> None:
    assert place_and_count_splits(topo, taken, options, want) == (cpus, 0)


ALL_OPTION_COMBINATIONS = [
    tuple(f"{key}={str(value).lower()}" for key, value in zip(keys, values, strict=True))
    for keys in [("whole_cores", "round_up_to_cores", "distribute_across_numa")]
    for values in itertools.product((True, False), repeat=3)
]


@pytest.mark.parametrize("options", ALL_OPTION_COMBINATIONS, ids=" ".join)
@pytest.mark.parametrize(
    ("topo", "taken", "want", "cpus"),
    [
        pytest.param("single-socket-ht", (3,), 2, (1, 5), id="ht half-used core 3"),
        pytest.param("8-numa", (33,), 2, (2, 34), id="8numa half-used core 1"),
        pytest.param("quad-socket-smt4", (1,), 4, (2, 18, 34, 50), id="smt4 partly used core 1"),
        pytest.param(
            "quad-socket-smt4",
            (),
            16,
            (*range(4, 8), *range(20, 24), *range(36, 40), *range(52, 56)),
            id="smt4 a free socket",
        ),
    ],
)
def test_whole_cores_first_under_every_combination_of_options(
    topo: str, taken: tuple[int, ...], want: int, cpus: tuple[int, ...], options: tuple[str, ...]
) -> None:
    assert place_and_count_splits(topo, taken, options, want) == (cpus, 0)


# --------------------------------------------------------------------------- odd counts

ODD_COUNT_CASES = [
    pytest.param("single-socket-ht", (), (), 3, (1, 2, 5), id="ht: 3 = core 1 + half of core 2"),
    pytest.param(
        "quad-socket-smt4", (), (), 6, (1, 2, 17, 18, 33, 49), id="smt4: 6 = core 1 + 2 threads of core 2"
    ),
    pytest.param(
        "quad-socket-smt4", (), (), 7, (1, 2, 17, 18, 33, 34, 49), id="smt4: 7 = core 1 + 3 threads of core 2"
    ),
    pytest.param(
        "quad-socket-smt4",
        (),
        (),
        13,
        (4, 5, 6, 7, 20, 21, 22, 36, 37, 38, 52, 53, 54),
        id="smt4: 13 = 3 cores of socket 1 + 1 thread of its last core",
    ),
    pytest.param(
        "dual-socket-ht",
        (),
        (),
        9,
        (1, 4, 5, 6, 7, 12, 13, 14, 15),
        id="2s: 9 = socket 1 whole + 1 thread on socket 0",
    ),
    pytest.param(
        "8-numa",
        (),
        ("distribute_across_numa=true",),
        9,
        (1, 2, 4, 5, 6, 33, 34, 36, 37),
        id="8numa distributed: 9 = 2 cores + 2 cores and 1 thread",
    ),
    pytest.param(
        "quad-socket-smt4",
        (),
        ("distribute_across_numa=true",),
        18,
        (1, 2, 4, 5, 6, 17, 18, 20, 21, 22, 33, 34, 36, 37, 49, 50, 52, 53),
        id="smt4 distributed: 18 = 2 cores + 2 cores and 2 threads",
    ),
]


@pytest.mark.parametrize(("topo", "taken", "options", "want", "cpus"), ODD_COUNT_CASES)
def test_an_odd_count_splits_exactly_one_core(
    topo: str, taken: tuple[int, ...], options: tuple[str, ...], want: int, cpus: tuple[int, ...]
) -> None:
    assert place_and_count_splits(topo, taken, (*WHOLE_CORES_OFF, *options), want) == (cpus, 1)


@pytest.mark.parametrize(
    ("topo", "want", "cpus"),
    [
        pytest.param("single-socket-ht", 3, (1, 2, 5, 6), id="ht: 3 rounds up to 2 cores"),
        pytest.param(
            "quad-socket-smt4", 6, (1, 2, 17, 18, 33, 34, 49, 50), id="smt4: 6 rounds up to 2 cores"
        ),
        pytest.param(
            "quad-socket-smt4",
            13,
            (*range(4, 8), *range(20, 24), *range(36, 40), *range(52, 56)),
            id="smt4: 13 rounds up to socket 1",
        ),
    ],
)
def test_with_whole_cores_an_odd_count_rounds_up_instead(topo: str, want: int, cpus: tuple[int, ...]) -> None:
    assert place_and_count_splits(topo, (), WHOLE_CORES_ON, want) == (cpus, 0)


# --------------------------------------------------------------------------- spare threads before a split

SPARE_THREAD_CASES = [
    pytest.param("single-socket-ht", (3,), (), 1, (7,), id="ht: 1 CPU is the free half of core 3"),
    pytest.param("single-socket-ht", (3,), (), 3, (1, 5, 7), id="ht: 3 = core 1 + the free half of core 3"),
    pytest.param(
        "single-socket-ht", (), ("reserved_cpus=0",), 1, (4,), id="ht: 1 CPU is the sibling of a reserved CPU"
    ),
    pytest.param(
        "quad-socket-smt4",
        (1, 2),
        (),
        6,
        (3, 17, 19, 33, 35, 51),
        id="smt4: 6 = core 3 + 2 spare threads of core 1",
    ),
    pytest.param(
        "dual-socket-ht",
        (4,),
        (),
        3,
        (5, 12, 13),
        id="2s: a node with a spare thread beats a tighter one that would split a core",
    ),
    pytest.param(
        "dual-socket-ht",
        (4,),
        (),
        9,
        (1, 5, 6, 7, 9, 12, 13, 14, 15),
        id="2s: 9 over both sockets uses the spare thread, splits nothing",
    ),
    pytest.param(
        "two-l3",
        (5,),
        (),
        5,
        (4, 6, 12, 13, 14),
        id="l3: the cache with a spare thread, not the tighter one that would split a core",
    ),
]


@pytest.mark.parametrize(("topo", "taken", "options", "want", "cpus"), SPARE_THREAD_CASES)
def test_spare_threads_of_partly_used_cores_come_before_splitting_a_free_core(
    topo: str, taken: tuple[int, ...], options: tuple[str, ...], want: int, cpus: tuple[int, ...]
) -> None:
    assert place_and_count_splits(topo, taken, (*WHOLE_CORES_OFF, *options), want) == (cpus, 0)


# --------------------------------------------------------------------------- whole cores across nodes

# Spanning nodes, an even request is whole cores on each node before it takes the spare thread
# beside another slot: packing the free CPUs alone filled the first node with its spare thread and
# split a free core on the next for the last CPU.
WHOLE_CORES_ACROSS_NODES = [
    pytest.param(
        "dual-socket-ht",
        (4,),
        8,
        (1, 5, 6, 7, 9, 13, 14, 15),
        id="2s: 8 CPUs are 3 whole cores of node 1 and 1 of node 0, not spare thread 12 and half of core 1",
    ),
    pytest.param(
        "quad-socket-ht",
        (6, 10, 11, 29),
        8,
        (1, 4, 5, 7, 17, 20, 21, 23),
        id="4s: 8 CPUs are 3 whole cores of node 1 and 1 of node 0, not spare thread 22 and half of core 1",
    ),
]


@pytest.mark.parametrize(("topo", "taken", "want", "cpus"), WHOLE_CORES_ACROSS_NODES)
def test_an_even_request_across_nodes_takes_whole_cores_before_spare_threads(
    topo: str, taken: tuple[int, ...], want: int, cpus: tuple[int, ...]
) -> None:
    got, splits = place_and_count_splits(topo, taken, WHOLE_CORES_OFF, want)
    assert (got, splits) == (cpus, 0)
    t = TOPOLOGIES[topo]
    beside_another = [c for c in got if set(taken) & set(t.cores[t.cpu_by_id[c].core])]
    assert beside_another == []


# --------------------------------------------------------------------------- distribute_across_numa

DISTRIBUTE_CASES = both_ways(
    [
        # 10 CPUs = 5 cores: 3 on socket 1 and 2 on socket 0, rather than 5 + 5 threads.
        ("2s: 10 = 3 cores + 2 cores", "dual-socket-ht", {"cpus": 10}, (1, 2, 4, 5, 6, 9, 10, 12, 13, 14)),
        ("8numa: 12 = 3 cores + 3 cores", "8-numa", {"cpus": 12}, (1, 2, 3, 4, 5, 6, 33, 34, 35, 36, 37, 38)),
        # 20 CPUs = 5 cores of 4 threads: 3 on socket 1 and 2 on socket 0, rather than 10 + 10.
        (
            "smt4: 20 = 3 cores + 2 cores",
            "quad-socket-smt4",
            {"cpus": 20},
            (1, 2, 4, 5, 6, 17, 18, 20, 21, 22, 33, 34, 36, 37, 38, 49, 50, 52, 53, 54),
        ),
    ]
)


@pytest.mark.parametrize(("topo", "taken", "options", "want", "cpus"), DISTRIBUTE_CASES)
def test_distribute_across_numa_spreads_whole_cores(
    topo: str, taken: tuple[int, ...], options: tuple[str, ...], want: int, cpus: tuple[int, ...]
) -> None:
    assert place_and_count_splits(topo, taken, (*options, "distribute_across_numa=true"), want) == (cpus, 0)


def test_reasons_say_how_the_cpus_were_made_up() -> None:
    request = parse_slot_request({"name": "a", "qos": "guaranteed", "resources": {"cpus": 3}})
    options = PlacementOptions(whole_cores=False)
    topo = TOPOLOGIES["single-socket-ht"]
    spare = plan(topo, Allocated(cpus=frozenset({3})), request, options)
    assert (
        "node 0: 3 CPUs as 1 whole core and 1 thread of partly used cores; from L3 cache 0" in spare.reasons
    )
    split = plan(topo, Allocated(), request, options)
    assert (
        "node 0: 3 CPUs as 1 whole core and 1 thread of core 2, "
        "split because nothing else made up the count; from L3 cache 0"
    ) in split.reasons
