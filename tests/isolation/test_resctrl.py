"""resctrl on fake trees shaped after Documentation/arch/x86/resctrl.rst (this CPU has no RDT)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nodeagent.errors import InvalidRequest, NotFound, PlacementError, Unsupported
from nodeagent.isolation.resctrl import (
    CacheInfo,
    MbaInfo,
    Resctrl,
    ResctrlError,
    contiguous_runs,
    default_mask,
    format_schemata,
    low_ways,
    mba_step,
    parse_schemata,
    plan_exclusive_mask,
    ways_for_share,
)
from tests.trees import write_tree

INTEL_FLAGS = "fpu vme de pse tsc msr pae cx8 rdt_a cat_l3 cdp_l3 cqm_llc cqm_occup_llc mba avx512f"
PLAIN_FLAGS = "fpu vme de pse tsc msr pae cx8 sse sse2 avx2"
FILESYSTEMS = "nodev\tsysfs\nnodev\tproc\nnodev\tcgroup\nnodev\tcgroup2\nnodev\tresctrl\n\text4\n"
MOUNTINFO = "22 1 0:21 / /sys rw - sysfs sysfs rw\n"
RESCTRL_MOUNT = "60 22 0:40 / /sys/fs/resctrl rw,relatime - resctrl resctrl rw{opts}\n"


def cpuinfo(vendor: str, flags: str) -> str:
    block = f"processor\t: {{n}}\nvendor_id\t: {vendor}\nmodel name\t: Test CPU\nflags\t\t: {flags}\n\n"
    return "".join(block.format(n=n) for n in range(2))


def proc_files(vendor: str = "GenuineIntel", flags: str = INTEL_FLAGS, mount_opts: str | None = "") -> dict:
    mountinfo = MOUNTINFO + (RESCTRL_MOUNT.format(opts=mount_opts) if mount_opts is not None else "")
    return {"cpuinfo": cpuinfo(vendor, flags), "filesystems": FILESYSTEMS, "self/mountinfo": mountinfo}


# A two-socket Intel host: 11-way L3 per socket (cbm_mask 7ff), MBA in 10% steps from 10%.
INTEL_2S = {
    "info/last_cmd_status": "ok\n",
    "info/L3/cbm_mask": "7ff\n",
    "info/L3/min_cbm_bits": "1\n",
    "info/L3/num_closids": "16\n",
    "info/L3/shareable_bits": "0\n",
    "info/L3/bit_usage": "0=SSSSSSSSSSS;1=SSSSSSSSSSS\n",
    "info/MB/min_bandwidth": "10\n",
    "info/MB/bandwidth_gran": "10\n",
    "info/MB/delay_linear": "1\n",
    "info/MB/num_closids": "16\n",
    "info/MB/thread_throttle_mode": "max\n",
    "info/L3_MON/num_rmids": "176\n",
    "info/L3_MON/mon_features": "llc_occupancy\nmbm_total_bytes\nmbm_local_bytes\n",
    "schemata": "L3:0=7ff;1=7ff\nMB:0=100;1=100\n",
    "tasks": "1\n2\n",
    "cpus": "ffff\n",
    "cpus_list": "0-15\n",
    "mode": "shareable\n",
    "size": "L3:0=39321600;1=39321600\nMB:0=100;1=100\n",
    "mon_data/mon_L3_00/llc_occupancy": "1048576\n",
    "mon_data/mon_L3_01/llc_occupancy": "524288\n",
    "mon_groups/.keep": "",
}

# An AMD EPYC-like host: 16-way L3 per CCX, MB as absolute bandwidth in 1/8 GB/s (2048 = no limit).
AMD_4CCX = {
    "info/last_cmd_status": "ok\n",
    "info/L3/cbm_mask": "ffff\n",
    "info/L3/min_cbm_bits": "1\n",
    "info/L3/num_closids": "16\n",
    "info/L3/shareable_bits": "0\n",
    "info/MB/min_bandwidth": "0\n",
    "info/MB/bandwidth_gran": "1\n",
    "info/MB/delay_linear": "0\n",
    "info/MB/num_closids": "16\n",
    "schemata": "MB:0=2048;1=  16;2=2048;3=2048\nL3:0=ffff;1=ffff;2=ffff;3=ffff\n",
    "tasks": "",
    "mode": "shareable\n",
}

# Code and data prioritisation: the L3 splits into two resources with half the CLOSIDs.
INTEL_CDP = {
    "info/last_cmd_status": "ok\n",
    "info/L3CODE/cbm_mask": "7ff\n",
    "info/L3CODE/min_cbm_bits": "1\n",
    "info/L3CODE/num_closids": "8\n",
    "info/L3CODE/shareable_bits": "0\n",
    "info/L3DATA/cbm_mask": "7ff\n",
    "info/L3DATA/min_cbm_bits": "1\n",
    "info/L3DATA/num_closids": "8\n",
    "info/L3DATA/shareable_bits": "0\n",
    "schemata": "L3DATA:0=7ff\nL3CODE:0=7ff\n",
    "mode": "shareable\n",
}

# Cache monitoring only (Haswell-like): resctrl mounts, but there is nothing to allocate.
MONITOR_ONLY = {"info/last_cmd_status": "ok\n", "info/L3_MON/num_rmids": "56\n", "tasks": ""}


def make(tmp_path: Path, tree: dict[str, str] | None, proc: dict[str, str] | None = None) -> Resctrl:
    root = tmp_path / "resctrl"
    root.mkdir()
    if tree is not None:
        write_tree(root, tree)
    return Resctrl(root=root, proc_root=write_tree(tmp_path / "proc", proc or proc_files()))


def read(resctrl: Resctrl, rel: str) -> str:
    return (resctrl.root / rel).read_text()


# ---- detection -------------------------------------------------------------------------------


def test_detect_intel_two_sockets(tmp_path: Path) -> None:
    support = make(tmp_path, INTEL_2S).detect()
    assert support.mounted
    assert support.reason == ""
    assert support.l3 == CacheInfo(cbm_mask=0x7FF, min_cbm_bits=1, num_closids=16, shareable_bits=0)
    assert support.l3.ways == 11
    assert support.mb == MbaInfo(min_bandwidth=10, bandwidth_gran=10, num_closids=16, delay_linear=True)
    assert (support.l3_domains, support.mb_domains) == ((0, 1), (0, 1))
    assert support.cpu_flags == {"rdt_a", "cat_l3", "cdp_l3", "mba"}
    assert support.num_closids == 16


def test_detect_takes_the_smallest_closid_count(tmp_path: Path) -> None:
    support = make(tmp_path, {**INTEL_2S, "info/MB/num_closids": "8\n"}).detect()
    assert support.num_closids == 8


@pytest.mark.parametrize(
    ("proc", "unit"),
    [
        pytest.param(proc_files("AuthenticAMD", "fpu cat_l3 cdp_l3 mba"), "amd_eighth_gbps", id="amd"),
        pytest.param(proc_files(mount_opts=",mba_MBps"), "mbps", id="intel-mba-mbps-mount"),
    ],
)
def test_non_percent_mba_is_detected_and_refused(tmp_path: Path, proc: dict[str, str], unit: str) -> None:
    tree = AMD_4CCX if unit == "amd_eighth_gbps" else INTEL_2S
    resctrl = make(tmp_path, tree, proc)
    support = resctrl.detect()
    assert support.mb is not None
    assert support.mb.unit == unit
    with pytest.raises(Unsupported, match="percent only"):
        resctrl.require(mb=True)
    with pytest.raises(Unsupported, match="percent only"):
        resctrl.create_group("natest-mb", mb_percent=50)
    assert not (resctrl.root / "natest-mb").exists()


def test_amd_cache_ways_still_allocate(tmp_path: Path) -> None:
    resctrl = make(tmp_path, AMD_4CCX, proc_files("AuthenticAMD", "fpu cat_l3 cdp_l3 mba"))
    allocation = resctrl.create_group("natest-amd", l3=0.25, l3_domains=[2])
    assert allocation.l3_masks == {2: 0xF000}
    assert parse_schemata(read(resctrl, "natest-amd/schemata"))["L3"] == {
        0: "ffff",
        1: "ffff",
        2: "f000",
        3: "ffff",
    }
    assert parse_schemata(read(resctrl, "schemata"))["MB"] == {0: "2048", 1: "16", 2: "2048", 3: "2048"}


@pytest.mark.parametrize(
    ("tree", "proc", "message"),
    [
        pytest.param(None, proc_files(flags=PLAIN_FLAGS, mount_opts=None), "the CPU has no RDT", id="no-rdt"),
        pytest.param(
            None,
            proc_files(mount_opts=None),
            "mount -t resctrl resctrl /sys/fs/resctrl",
            id="rdt-not-mounted",
        ),
        pytest.param(
            None,
            {**proc_files(mount_opts=None), "filesystems": "nodev\tsysfs\n"},
            "CONFIG_X86_CPU_RESCTRL",
            id="kernel-without-resctrl",
        ),
    ],
)
def test_unusable_hosts_say_why(
    tmp_path: Path, tree: dict | None, proc: dict[str, str], message: str
) -> None:
    resctrl = make(tmp_path, tree, proc)
    support = resctrl.detect()
    assert not support.mounted
    assert message in support.reason
    with pytest.raises(Unsupported, match=message):
        resctrl.create_group("natest-x", l3=2)


def test_monitoring_only_host_refuses_allocation(tmp_path: Path) -> None:
    resctrl = make(tmp_path, MONITOR_ONLY)
    support = resctrl.detect()
    assert support.mounted
    assert (support.l3, support.mb) == (None, None)
    assert "no L3 cache allocation and no memory bandwidth" in support.reason
    with pytest.raises(Unsupported, match="no L3 cache allocation"):
        resctrl.create_group("natest-x", l3=1)
    with pytest.raises(Unsupported, match="no memory bandwidth allocation"):
        resctrl.create_group("natest-x", mb_percent=20)


def test_detect_on_this_host_does_not_raise() -> None:
    support = Resctrl().detect()
    if support.mounted:
        pytest.skip("resctrl is mounted here; the fake trees cover the rest")
    assert support.reason


# ---- pure decisions --------------------------------------------------------------------------

L3_11 = CacheInfo(cbm_mask=0x7FF, min_cbm_bits=1, num_closids=16)


@pytest.mark.parametrize(
    ("share", "cache", "ways"),
    [
        pytest.param(0.25, L3_11, 3, id="quarter-of-11-rounds-up"),
        pytest.param(0.5, L3_11, 6, id="half-of-11"),
        pytest.param(0.01, L3_11, 1, id="sliver-is-one-way"),
        pytest.param(1, L3_11, 1, id="one-way"),
        pytest.param(4, L3_11, 4, id="four-ways"),
        pytest.param(1, CacheInfo(0xFFFFF, 2, 16), 2, id="min-cbm-bits"),
        pytest.param(0.25, CacheInfo(0xFFFFF, 1, 16), 5, id="quarter-of-20"),
    ],
)
def test_ways_for_share(share: float, cache: CacheInfo, ways: int) -> None:
    assert ways_for_share(share, cache) == ways


@pytest.mark.parametrize("share", [0, -0.5, 1.5], ids=["zero", "negative", "fraction-above-one"])
def test_ways_for_share_refuses(share: float) -> None:
    with pytest.raises(InvalidRequest, match="l3 share"):
        ways_for_share(share, L3_11)


@pytest.mark.parametrize(
    ("cache", "taken", "ways", "slot", "default"),
    [
        pytest.param(L3_11, 0, 3, 0x700, 0x0FF, id="empty-packs-high"),
        pytest.param(L3_11, 0x700, 2, 0x0C0, 0x03F, id="next-below-first"),
        pytest.param(L3_11, 0x730, 2, 0x0C0, 0x00F, id="fills-the-hole"),
        pytest.param(L3_11, 0, 10, 0x7FE, 0x001, id="all-but-the-default-reserve"),
        pytest.param(CacheInfo(0x7FF, 1, 16, shareable_bits=0x600), 0, 3, 0x007, 0x7F8, id="avoids-io-ways"),
        pytest.param(CacheInfo(0xFFFFF, 2, 16), 0xF0000, 2, 0x0C000, 0x03FFF, id="twenty-ways"),
    ],
)
def test_plan_exclusive_mask(cache: CacheInfo, taken: int, ways: int, slot: int, default: int) -> None:
    assert plan_exclusive_mask(cache, taken, ways) == (slot, default)
    assert len(contiguous_runs(slot)) == 1
    assert len(contiguous_runs(default)) == 1
    assert slot & (taken | default) == 0


@pytest.mark.parametrize(
    ("taken", "ways", "reserve"),
    [
        pytest.param(0, 11, 1, id="whole-cache"),
        pytest.param(0, 12, 1, id="more-than-the-cache"),
        pytest.param(0x7F0, 4, 1, id="only-default-left"),
        pytest.param(0x700, 6, 4, id="reserve-for-default"),
    ],
)
def test_plan_exclusive_mask_refuses(taken: int, ways: int, reserve: int) -> None:
    with pytest.raises(PlacementError, match=f"{ways} "):
        plan_exclusive_mask(L3_11, taken, ways, reserve)


def test_default_mask_is_longest_run() -> None:
    assert default_mask(L3_11, 0x7C0 | 0x004) == 0x038
    assert default_mask(L3_11, 0x7C0 | 0x00C) == 0x003  # a tie goes to the lowest run
    assert default_mask(L3_11, 0x7FF) == 0


INTEL_MBA = MbaInfo(min_bandwidth=10, bandwidth_gran=10, num_closids=16)


@pytest.mark.parametrize(
    ("percent", "mba", "value"),
    [
        pytest.param(55, INTEL_MBA, 60, id="rounds-up-like-the-kernel"),
        pytest.param(60, INTEL_MBA, 60, id="on-a-step"),
        pytest.param(5, INTEL_MBA, 10, id="below-minimum"),
        pytest.param(100, INTEL_MBA, 100, id="unlimited"),
        pytest.param(33, MbaInfo(min_bandwidth=10, bandwidth_gran=1, num_closids=8), 33, id="fine-grained"),
        pytest.param(97, MbaInfo(min_bandwidth=20, bandwidth_gran=15, num_closids=8), 100, id="capped"),
    ],
)
def test_mba_step(percent: int, mba: MbaInfo, value: int) -> None:
    assert mba_step(percent, mba) == value


@pytest.mark.parametrize("percent", [0, 101])
def test_mba_step_refuses_out_of_range(percent: int) -> None:
    with pytest.raises(InvalidRequest, match="between 1 and 100"):
        mba_step(percent, INTEL_MBA)


def test_schemata_round_trip_and_amd_padding() -> None:
    parsed = parse_schemata("MB:0=2048;1=  16\n    L3:0=ffff;1=ffff\n")
    assert parsed == {"MB": {0: "2048", 1: "16"}, "L3": {0: "ffff", 1: "ffff"}}
    assert format_schemata(parsed) == "MB:0=2048;1=16\nL3:0=ffff;1=ffff\n"
    assert parse_schemata(format_schemata(parsed)) == parsed


# ---- groups on the fake tree -----------------------------------------------------------------


def test_create_exclusive_group_shrinks_default(tmp_path: Path) -> None:
    resctrl = make(tmp_path, INTEL_2S)
    allocation = resctrl.create_group("natest-a", l3=0.25, mb_percent=45)
    assert allocation.l3_masks == {0: 0x700, 1: 0x700}
    assert allocation.mb_value == 50
    assert allocation.default_l3_masks == {0: 0xFF, 1: 0xFF}
    assert parse_schemata(read(resctrl, "natest-a/schemata")) == {
        "L3": {0: "700", 1: "700"},
        "MB": {0: "50", 1: "50"},
    }
    assert read(resctrl, "natest-a/mode") == "exclusive"
    assert parse_schemata(read(resctrl, "schemata")) == {"L3": {0: "ff", 1: "ff"}, "MB": {0: "100", 1: "100"}}
    assert resctrl.groups() == ("natest-a",)


def test_groups_stack_and_release_gives_ways_back(tmp_path: Path) -> None:
    resctrl = make(tmp_path, INTEL_2S)
    first = resctrl.create_group("natest-1", l3=3)
    second = resctrl.create_group("natest-2", l3=2)
    third = resctrl.create_group("natest-3", l3=2)
    assert [a.l3_masks[0] for a in (first, second, third)] == [0x700, 0x0C0, 0x030]
    assert resctrl.schemata()["L3"] == {0: "f", 1: "f"}

    assert resctrl.delete_group("natest-2")
    # The freed ways are a hole above the default's run; the default keeps its contiguous run.
    assert resctrl.schemata()["L3"] == {0: "f", 1: "f"}
    refill = resctrl.create_group("natest-4", l3=2)
    assert refill.l3_masks == {0: 0x0C0, 1: 0x0C0}

    for name in ("natest-1", "natest-3", "natest-4"):
        assert resctrl.delete_group(name)
    assert resctrl.schemata()["L3"] == {0: "7ff", 1: "7ff"}
    assert resctrl.groups() == ()
    assert not resctrl.delete_group("natest-1")


def test_ways_only_on_the_slots_domain(tmp_path: Path) -> None:
    resctrl = make(tmp_path, INTEL_2S)
    allocation = resctrl.create_group("natest-n1", l3=4, l3_domains=[1])
    assert allocation.l3_masks == {1: 0x780}
    assert resctrl.schemata("natest-n1")["L3"] == {0: "7ff", 1: "780"}
    assert resctrl.schemata()["L3"] == {0: "7ff", 1: "7f"}
    with pytest.raises(InvalidRequest, match=r"L3 domains \[2\]"):
        resctrl.create_group("natest-n2", l3=1, l3_domains=[2])


def test_shareable_groups_follow_the_default_mask(tmp_path: Path) -> None:
    resctrl = make(tmp_path, INTEL_2S)
    resctrl.create_group("natest-bw", mb_percent=20)
    assert resctrl.schemata("natest-bw") == {"L3": {0: "7ff", 1: "7ff"}, "MB": {0: "20", 1: "20"}}
    (resctrl.root / "natest-bw/mode").write_text("shareable\n")  # what the kernel shows for it
    resctrl.create_group("natest-ways", l3=0.5)
    assert resctrl.schemata("natest-bw")["L3"] == {0: "1f", 1: "1f"}
    assert resctrl.schemata("natest-bw")["MB"] == {0: "20", 1: "20"}


def test_cdp_writes_code_and_data(tmp_path: Path) -> None:
    resctrl = make(tmp_path, INTEL_CDP)
    support = resctrl.detect()
    assert support.l3 is not None
    assert support.l3.resources == ("L3CODE", "L3DATA")
    assert support.mb is None
    resctrl.create_group("natest-cdp", l3=2)
    assert resctrl.schemata("natest-cdp") == {"L3CODE": {0: "600"}, "L3DATA": {0: "600"}}
    assert resctrl.schemata() == {"L3DATA": {0: "1ff"}, "L3CODE": {0: "1ff"}}


def test_no_room_leaves_nothing_behind(tmp_path: Path) -> None:
    resctrl = make(tmp_path, INTEL_2S)
    resctrl.create_group("natest-big", l3=9)
    before = read(resctrl, "schemata")
    with pytest.raises(PlacementError, match="L3 domain 0: l3 asks for 2 contiguous cache ways"):
        resctrl.create_group("natest-more", l3=2)
    assert resctrl.groups() == ("natest-big",)
    assert read(resctrl, "schemata") == before


def test_closid_exhaustion_is_a_clear_error(tmp_path: Path) -> None:
    resctrl = make(tmp_path, {**INTEL_2S, "info/L3/num_closids": "4\n", "info/MB/num_closids": "4\n"})
    for n in range(3):
        resctrl.create_group(f"natest-c{n}", mb_percent=50)
    with pytest.raises(PlacementError, match="4 CLOSIDs and all are in use"):
        resctrl.create_group("natest-c3", mb_percent=50)
    assert not (resctrl.root / "natest-c3").exists()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        pytest.param({}, InvalidRequest, "neither l3 nor memory bandwidth", id="empty-request"),
        pytest.param({"l3": 1.5}, InvalidRequest, "neither a fraction", id="bad-share"),
        pytest.param({"l3": 11}, PlacementError, "default group must keep 1", id="whole-cache"),
        pytest.param({"l3": 12}, PlacementError, "has only 11", id="more-than-the-cache"),
        pytest.param({"mb_percent": 0}, InvalidRequest, "between 1 and 100", id="bad-percent"),
    ],
)
def test_bad_requests_leave_nothing_behind(tmp_path: Path, kwargs: dict, error: type, message: str) -> None:
    resctrl = make(tmp_path, INTEL_2S)
    with pytest.raises(error, match=message):
        resctrl.create_group("natest-bad", **kwargs)
    assert resctrl.groups() == ()
    assert read(resctrl, "schemata") == INTEL_2S["schemata"]


@pytest.mark.parametrize("name", ["../etc", "a/b", "info", "mon_groups", "", "x" * 65])
def test_group_names_are_checked(tmp_path: Path, name: str) -> None:
    resctrl = make(tmp_path, INTEL_2S)
    with pytest.raises(InvalidRequest, match="not allowed"):
        resctrl.create_group(name, l3=1)
    with pytest.raises(InvalidRequest, match="not allowed"):
        resctrl.delete_group(name)


def test_existing_group_is_refused(tmp_path: Path) -> None:
    resctrl = make(tmp_path, INTEL_2S)
    resctrl.create_group("natest-dup", l3=1)
    with pytest.raises(InvalidRequest, match="already exists"):
        resctrl.create_group("natest-dup", l3=1)


def test_assign_tasks_and_cpus(tmp_path: Path) -> None:
    resctrl = make(tmp_path, INTEL_2S)
    resctrl.create_group("natest-t", l3=1)
    resctrl.assign_tasks("natest-t", [4242])
    assert read(resctrl, "natest-t/tasks") == "4242"
    resctrl.assign_cpus("natest-t", [0, 1, 2, 3, 8])
    assert read(resctrl, "natest-t/cpus_list") == "0-3,8"
    with pytest.raises(NotFound, match="natest-none"):
        resctrl.assign_tasks("natest-none", [1])


def test_refused_write_quotes_value_and_kernel_status(tmp_path: Path) -> None:
    resctrl = make(tmp_path, {**INTEL_2S, "info/last_cmd_status": "mask f7 has non-consecutive 1-bits\n"})
    resctrl.create_group("natest-w", l3=1)
    (resctrl.root / "natest-w/tasks").mkdir()  # a write the "kernel" refuses
    with pytest.raises(ResctrlError, match=r"writing '77' to .*natest-w/tasks.*non-consecutive 1-bits"):
        resctrl.assign_tasks("natest-w", [77])


def test_paths_stay_under_the_root(tmp_path: Path) -> None:
    resctrl = make(tmp_path, INTEL_2S)
    (resctrl.root / "natest-link").symlink_to(tmp_path)
    with pytest.raises(ResctrlError, match="leaves"):
        resctrl.assign_tasks("natest-link", [1])


@pytest.mark.parametrize(
    ("mask", "ways", "expected"),
    [
        pytest.param(0x7FF, 2, 0x3, id="low-end"),
        pytest.param(0x7F0, 2, 0x30, id="inside-the-run"),
        pytest.param(0x1F, 8, 0x1F, id="whole-short-run"),
        pytest.param(0, 2, 0, id="no-ways"),
    ],
)
def test_low_ways(mask: int, ways: int, expected: int) -> None:
    assert low_ways(mask, ways) == expected


def test_shared_group_takes_a_few_default_ways_and_mends_drift(tmp_path: Path) -> None:
    resctrl = make(tmp_path, INTEL_2S)
    assert resctrl.ensure_shared_group("natest-be", l3_share=0.2, mb_percent=15) is True
    # 20% of 11 ways is 3 (rounded up), the lowest of the default run; MBA rounds up to 20%.
    assert resctrl.schemata("natest-be") == {"L3": {0: "7", 1: "7"}, "MB": {0: "20", 1: "20"}}
    assert resctrl.ensure_shared_group("natest-be", l3_share=0.2, mb_percent=15) is False
    # An exclusive slot group rewrites shareable groups to the default's whole mask; mended.
    (resctrl.root / "natest-be/mode").write_text("shareable\n")
    resctrl.create_group("natest-slot", l3=0.5)
    assert resctrl.schemata("natest-be")["L3"] == {0: "1f", 1: "1f"}
    assert resctrl.ensure_shared_group("natest-be", l3_share=0.2, mb_percent=15) is True
    assert resctrl.schemata("natest-be")["L3"] == {0: "7", 1: "7"}
    assert resctrl.schemata()["L3"] == {0: "1f", 1: "1f"}  # the default group keeps its ways


def test_best_effort_group_narrows_under_online_load_and_widens_when_idle(tmp_path: Path) -> None:
    # The colocation actuator's resctrl_narrow/resctrl_wide on a fake two-socket tree.
    from types import SimpleNamespace

    from nodeagent.isolation.colocation import Action
    from nodeagent.isolation.colocation_kernel import Actuator

    resctrl = make(tmp_path, INTEL_2S)
    isolator = SimpleNamespace(host=None, hierarchy=None)
    actuator = Actuator(
        isolator,  # type: ignore[arg-type]
        resctrl=resctrl,
        resctrl_group="natest-be",
        l3_share=0.2,
        mb_percent=15,
        sched_idle=False,
    )
    assert actuator.prepare_resctrl() == "natest-be"
    assert actuator.resctrl_ready
    narrow = {"L3": {0: "7", 1: "7"}, "MB": {0: "20", 1: "20"}}
    assert resctrl.schemata("natest-be") == narrow  # made with the small share
    actuator.apply(Action("resctrl_wide", None, "online idle"))
    assert resctrl.schemata("natest-be") == {"L3": {0: "7ff", 1: "7ff"}, "MB": {0: "100", 1: "100"}}
    # A refresh mends the group to the share in force, not back to the small one.
    assert actuator.prepare_resctrl() == "natest-be"
    assert resctrl.schemata("natest-be")["MB"] == {0: "100", 1: "100"}
    actuator.apply(Action("resctrl_narrow", None, "online busy"))
    assert resctrl.schemata("natest-be") == narrow


def test_shared_group_without_resctrl_says_why(tmp_path: Path) -> None:
    resctrl = make(tmp_path, None, proc_files(flags=PLAIN_FLAGS))
    with pytest.raises(Unsupported):
        resctrl.ensure_shared_group("natest-be", l3_share=0.1, mb_percent=None)
