"""A worker's rlimits against what the agent's launch can set on this host (runtime/limits.py)."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest

from nodeagent.errors import InvalidRequest
from nodeagent.kernelfs import Procfs
from nodeagent.runtime.limits import LARGEST, RlimitCeilings, host_ceilings
from tests.trees import write_tree

CEILINGS = RlimitCeilings({"nofile": 20000, "core": None})


@pytest.mark.parametrize(
    ("rlimits", "refusal"),
    [
        pytest.param({"nofile": (4096, 8192)}, None, id="within"),
        pytest.param({"nofile": (20000, 20000)}, None, id="at-the-ceiling"),
        pytest.param({"nofile": (4096, 20001)}, "the hard limit 20001 is more than", id="hard-above"),
        pytest.param({"nofile": (4096, -1)}, r"the hard limit unlimited \(-1\) is more than", id="unlimited"),
        pytest.param({"nofile": (10**32, 10**32)}, "the hard limit 1000", id="1e32"),
        pytest.param({"core": (-1, -1)}, None, id="no-ceiling-unlimited"),
        pytest.param({"core": (LARGEST + 1, LARGEST + 1)}, "more than this host lets", id="past-rlim-t"),
    ],
)
def test_rlimits_above_what_the_launch_can_set_are_refused_naming_the_ceiling(
    rlimits: dict[str, tuple[int, int]], refusal: str | None
) -> None:
    if refusal is None:
        CEILINGS.check(rlimits)
        return
    with pytest.raises(InvalidRequest, match=refusal):
        CEILINGS.check(rlimits)


def status(cap_eff: str) -> str:
    return f"Name:\tnodeagent\nCapEff:\t{cap_eff}\n"


def test_without_cap_sys_resource_the_ceiling_is_the_agents_own_hard_limit(tmp_path: Path) -> None:
    write_tree(tmp_path, {"self/status": status("000001fffeffffff"), "sys/fs/nr_open": "1048576\n"})
    limits = {resource.RLIMIT_NOFILE: (1024, 20000), resource.RLIMIT_CORE: (0, resource.RLIM_INFINITY)}

    def getrlimit(number: int) -> tuple[int, int]:
        return limits.get(number, (0, 0))

    ceilings = host_ceilings(Procfs(tmp_path), getrlimit)
    assert (ceilings.by_name["nofile"], ceilings.by_name["core"]) == (20000, None)


def test_with_cap_sys_resource_nofile_goes_up_to_nr_open(tmp_path: Path) -> None:
    write_tree(tmp_path, {"self/status": status("000001ffffffffff"), "sys/fs/nr_open": "1048576\n"})
    ceilings = host_ceilings(Procfs(tmp_path), lambda number: (0, 0))
    assert (ceilings.by_name["nofile"], ceilings.by_name["stack"]) == (1048576, None)
