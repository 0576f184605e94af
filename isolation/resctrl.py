"""Cache (L3 CAT) and memory-bandwidth (MBA) isolation through the resctrl filesystem.

A slot that asks for ``l3`` gets a resctrl group of its own with a contiguous run of L3 cache ways
that no other slot's group and not the default group may use (the ways are *exclusive*); a slot
that asks for a memory-bandwidth percentage gets an ``MB`` line in its group. Everything else
stays in the default group (the resctrl root), whose L3 mask shrinks to the ways no slot holds and
grows back when slots go.

Kernel facts this module is built on (Documentation/arch/x86/resctrl.rst):

- ``info/L3/cbm_mask`` is 100% of the cache; a mask's set bits must be contiguous (Intel CAT) and
  number at least ``min_cbm_bits``; ``shareable_bits`` are ways that I/O (DDIO) also fills, so
  exclusive slots avoid them where they can.
- ``num_closids`` bounds the number of control groups, the default group included; the kernel
  uses the smallest count of all enabled resources. mkdir beyond it fails with ENOSPC.
- MBA steps are ``min_bandwidth + N * bandwidth_gran`` percent, and the kernel rounds a value up to
  the next step. On AMD the MB values are absolute bandwidth in 1/8 GB/s (2048 = unlimited), and
  with the ``mba_MBps`` mount option they are MB/s; nodeagent speaks percent only and refuses those.
- Schemata lines are ``L3:<cache id>=<cbm>;...`` and ``MB:<cache id>=<value>;...``, one value per
  L3 domain (cache id); with CDP the cache resource splits into L3CODE and L3DATA.
- Concurrent allocators must serialise with flock on the resctrl root.

Pure decisions (``ways_for_share``, ``plan_exclusive_mask``, ``mba_step``, the schemata parser)
work on plain data; :class:`Resctrl` is the only part that touches the filesystem, and all its
writes go through one function that keeps paths under the root.
"""

from __future__ import annotations

import errno
import fcntl
import math
import os
import re
import shutil
from collections.abc import Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Literal

from nodeagent.cpulist import format_cpulist
from nodeagent.errors import (
    InvalidRequest,
    KernelError,
    NotFound,
    PlacementError,
    Unsupported,
    os_error_message,
)
from nodeagent.kernelfs import Procfs

DEFAULT_ROOT = Path("/sys/fs/resctrl")
MOUNT_HINT = "mount -t resctrl resctrl /sys/fs/resctrl"
RDT_FLAGS = ("rdt_a", "cat_l3", "cdp_l3", "mba")
#: Directory names the kernel puts in the root that are not control groups.
NOT_GROUPS = frozenset({"info", "mon_groups", "mon_data"})
_GROUP_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_CACHE_RESOURCES = (("L3",), ("L3CODE", "L3DATA"))

Schemata = dict[str, dict[int, str]]
MbaUnit = Literal["percent", "amd_eighth_gbps", "mbps"]


class ResctrlError(KernelError):
    """The resctrl filesystem refused an operation (the kernel's reason is quoted)."""

    code = "resctrl_error"


# ---------------------------------------------------------------------------------------------
# What the host offers


@dataclass(frozen=True)
class CacheInfo:
    """``info/L3`` (or ``info/L3CODE`` with CDP): the L3 cache-allocation capabilities."""

    cbm_mask: int
    min_cbm_bits: int
    num_closids: int
    shareable_bits: int = 0
    resources: tuple[str, ...] = ("L3",)

    @property
    def ways(self) -> int:
        return self.cbm_mask.bit_count()


@dataclass(frozen=True)
class MbaInfo:
    """``info/MB``: the memory-bandwidth-allocation capabilities."""

    min_bandwidth: int
    bandwidth_gran: int
    num_closids: int
    delay_linear: bool | None = None
    unit: MbaUnit = "percent"


@dataclass(frozen=True)
class ResctrlSupport:
    """What detection found. ``reason`` says why a part is missing and what to do."""

    mounted: bool
    cpu_flags: frozenset[str]
    l3: CacheInfo | None
    mb: MbaInfo | None
    l3_domains: tuple[int, ...]
    mb_domains: tuple[int, ...]
    reason: str

    @property
    def num_closids(self) -> int:
        counts = [info.num_closids for info in (self.l3, self.mb) if info is not None]
        return min(counts) if counts else 0


@dataclass(frozen=True)
class GroupAllocation:
    """What :meth:`Resctrl.create_group` wrote for a slot."""

    name: str
    path: Path
    l3_masks: Mapping[int, int] = field(default_factory=dict)  # domain -> exclusive CBM
    mb_value: int | None = None  # percent written to every MB domain
    default_l3_masks: Mapping[int, int] = field(default_factory=dict)  # the default group after


# ---------------------------------------------------------------------------------------------
# Pure decisions


def ways_for_share(share: float, cache: CacheInfo) -> int:
    """Cache ways for an ``l3`` request: a value below 1 is a fraction of the cache, rounded up to
    whole ways; a value of 1 or more is a number of ways. At least ``min_cbm_bits``."""
    if share <= 0:
        raise InvalidRequest(f"l3 share {share} must be positive: a fraction below 1 or a number of ways")
    if share < 1:
        ways = math.ceil(share * cache.ways - 1e-9)
    elif share == int(share):
        ways = int(share)
    else:
        raise InvalidRequest(
            f"l3 share {share} is neither a fraction below 1 nor a whole number of ways; "
            f"this cache has {cache.ways} ways"
        )
    return max(ways, cache.min_cbm_bits, 1)


def contiguous_runs(mask: int) -> list[tuple[int, int]]:
    """The runs of set bits in ``mask`` as (lowest bit, length), lowest first."""
    runs: list[tuple[int, int]] = []
    bit = 0
    while mask >> bit:
        if (mask >> bit) & 1:
            start = bit
            while (mask >> bit) & 1:
                bit += 1
            runs.append((start, bit - start))
        else:
            bit += 1
    return runs


def _run_mask(start: int, length: int) -> int:
    return ((1 << length) - 1) << start


def default_mask(cache: CacheInfo, taken: int) -> int:
    """The default group's mask: the longest contiguous run of ways no exclusive group holds
    (ties go to the lowest run). 0 when every way is taken."""
    runs = contiguous_runs(cache.cbm_mask & ~taken)
    if not runs:
        return 0
    start, length = max(runs, key=lambda run: (run[1], -run[0]))
    return _run_mask(start, length)


def plan_exclusive_mask(cache: CacheInfo, taken: int, ways: int, reserve: int = 1) -> tuple[int, int]:
    """Choose ``ways`` contiguous ways outside ``taken`` for a new exclusive group.

    Returns (the group's mask, the default group's mask afterwards). The choice avoids the
    I/O-shared ways, keeps the default group's run as long as possible (it must stay contiguous and
    keep at least ``max(reserve, min_cbm_bits)`` ways), then fills the tightest free gap, then
    packs towards the high ways. Raises PlacementError when no run fits.
    """
    if ways > cache.ways:
        raise PlacementError(f"l3 asks for {ways} cache ways; this L3 cache has only {cache.ways}")
    keep = max(reserve, cache.min_cbm_bits, 1)
    free = cache.cbm_mask & ~taken
    free_runs = contiguous_runs(free)
    best: tuple[tuple[int, int, int, int], int, int] | None = None
    for run_start, run_length in free_runs:
        for start in range(run_start, run_start + run_length - ways + 1):
            candidate = _run_mask(start, ways)
            remaining_default = default_mask(cache, taken | candidate)
            if remaining_default.bit_count() < keep:
                continue
            key = (
                int(bool(candidate & cache.shareable_bits)),
                -remaining_default.bit_count(),
                run_length,
                -start,
            )
            if best is None or key < best[0]:
                best = (key, candidate, remaining_default)
    if best is None:
        largest = max((length for _, length in free_runs), default=0)
        raise PlacementError(
            f"l3 asks for {ways} contiguous cache ways; the largest free run is {largest} of "
            f"{cache.ways} ways and the default group must keep {keep}; ask for fewer ways or "
            "release a slot that holds cache ways"
        )
    return best[1], best[2]


def low_ways(mask: int, ways: int) -> int:
    """The lowest ``ways`` ways of ``mask``'s lowest contiguous run (the whole run when shorter):
    a small share that stays inside the mask and contiguous, as CAT requires."""
    runs = contiguous_runs(mask)
    if not runs:
        return 0
    start, length = runs[0]
    return _run_mask(start, min(ways, length))


def mba_step(percent: int, mba: MbaInfo) -> int:
    """The MB value the kernel will apply for ``percent``: at least ``min_bandwidth``, rounded up to
    the next ``min_bandwidth + N * bandwidth_gran`` step (as the kernel rounds), at most 100."""
    if mba.unit != "percent":
        raise Unsupported(_mba_unit_message(mba.unit))
    if not 1 <= percent <= 100:
        raise InvalidRequest(f"memory bandwidth {percent}% must be between 1 and 100")
    if percent <= mba.min_bandwidth:
        return mba.min_bandwidth
    gran = max(mba.bandwidth_gran, 1)
    steps = math.ceil((percent - mba.min_bandwidth) / gran)
    return min(100, mba.min_bandwidth + steps * gran)


def _mba_unit_message(unit: MbaUnit) -> str:
    if unit == "amd_eighth_gbps":
        what = "this AMD CPU sets memory bandwidth as an absolute limit in 1/8 GB/s"
    else:
        what = "resctrl is mounted with mba_MBps, so memory bandwidth is set in MB/s"
    return (
        f"{what}, not as a percentage; nodeagent sets memory bandwidth in percent only, so run the "
        "slot without a memory-bandwidth limit (L3 cache ways still work)"
    )


def parse_schemata(text: str) -> Schemata:
    """``"L3:0=7ff;1=7ff\\nMB:0=100;1=100"`` -> ``{"L3": {0: "7ff", 1: "7ff"}, "MB": {...}}``.

    Tolerates the padding AMD kernels print (``MB:0=2048;1=  16``)."""
    result: Schemata = {}
    for line in text.splitlines():
        resource, sep, values = line.strip().partition(":")
        if not sep or not resource:
            continue
        domains: dict[int, str] = {}
        for item in values.split(";"):
            domain, eq, value = item.strip().partition("=")
            if eq and domain.strip().isdigit():
                domains[int(domain)] = value.strip()
        result[resource] = domains
    return result


def format_schemata(schemata: Schemata) -> str:
    """The inverse of :func:`parse_schemata`, one line per resource."""
    lines = [
        f"{resource}:" + ";".join(f"{domain}={value}" for domain, value in sorted(domains.items()))
        for resource, domains in schemata.items()
    ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# The filesystem edge


class Resctrl:
    """The resctrl filesystem at ``root``; ``proc_root`` gives the CPU flags and mount options."""

    def __init__(
        self, root: Path = DEFAULT_ROOT, proc_root: Path = Path("/proc"), *, default_reserve_ways: int = 1
    ) -> None:
        self.root = root
        self.proc_root = proc_root
        self.procfs = Procfs(proc_root)
        self.default_reserve_ways = default_reserve_ways

    # -- detection ------------------------------------------------------------------------------

    def detect(self) -> ResctrlSupport:
        """Describe what resctrl offers here; never raises for a missing feature."""
        flags = self._cpu_flags()
        if not (self.root / "info").is_dir():
            return ResctrlSupport(False, flags, None, None, (), (), self._unmounted_reason(flags))
        schemata = parse_schemata(self._read_or_empty("schemata"))
        l3 = self._cache_info()
        mb = self._mba_info()
        l3_domains = tuple(sorted(schemata.get(l3.resources[0], {}))) if l3 else ()
        mb_domains = tuple(sorted(schemata.get("MB", {}))) if mb else ()
        missing = [name for name, info in (("L3 cache allocation", l3), ("memory bandwidth", mb)) if not info]
        reason = f"resctrl is mounted but offers no {' and no '.join(missing)} on this CPU" if missing else ""
        return ResctrlSupport(True, flags, l3, mb, l3_domains, mb_domains, reason)

    def require(self, *, l3: bool = False, mb: bool = False) -> ResctrlSupport:
        """Detect, then raise Unsupported unless the asked-for parts are usable."""
        support = self.detect()
        if not support.mounted:
            raise Unsupported(support.reason)
        if l3 and support.l3 is None:
            raise Unsupported(
                "the slot asks for L3 cache ways but this CPU's resctrl has no L3 cache allocation "
                f"(no {self.root / 'info' / 'L3'}); run the slot without l3"
            )
        if mb and support.mb is None:
            raise Unsupported(
                "the slot asks for a memory-bandwidth limit but this CPU's resctrl has no memory "
                f"bandwidth allocation (no {self.root / 'info' / 'MB'}); run the slot without it"
            )
        if mb and support.mb is not None and support.mb.unit != "percent":
            raise Unsupported(_mba_unit_message(support.mb.unit))
        return support

    def _unmounted_reason(self, flags: frozenset[str]) -> str:
        if not flags & {"cat_l3", "mba", "rdt_a"}:
            return (
                "the CPU has no RDT cache or memory-bandwidth allocation (no rdt_a, cat_l3 or mba flag "
                f"in {self.proc_root / 'cpuinfo'}), so cache and memory-bandwidth isolation is not "
                "available on this host; slots run without l3 or memory-bandwidth limits"
            )
        have = ", ".join(sorted(flags))
        filesystems = self.procfs.read_text("filesystems")
        if filesystems is not None and "resctrl" not in filesystems.split():
            return (
                f"the CPU supports RDT ({have}) but this kernel has no resctrl filesystem; use a kernel "
                "built with CONFIG_X86_CPU_RESCTRL"
            )
        return f"resctrl is not mounted at {self.root} although the CPU supports it ({have}): {MOUNT_HINT}"

    def _cpu_flags(self) -> frozenset[str]:
        text = self.procfs.read_text("cpuinfo") or ""
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "flags":
                return frozenset(value.split()) & frozenset(RDT_FLAGS)
        return frozenset()

    def _cpu_vendor(self) -> str:
        text = self.procfs.read_text("cpuinfo") or ""
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "vendor_id":
                return value.strip()
        return ""

    def _mount_options(self) -> frozenset[str]:
        text = self.procfs.read_text("self/mountinfo") or ""
        for line in text.splitlines():
            _, sep, after = line.partition(" - ")
            fields = after.split()
            if sep and fields and fields[0] == "resctrl":
                return frozenset(fields[2].split(",")) if len(fields) > 2 else frozenset()
        return frozenset()

    def _cache_info(self) -> CacheInfo | None:
        for resources in _CACHE_RESOURCES:
            info_dir = f"info/{resources[0]}"
            if (self.root / info_dir).is_dir():
                return CacheInfo(
                    cbm_mask=int(self._read(f"{info_dir}/cbm_mask").strip(), 16),
                    min_cbm_bits=self._read_int(f"{info_dir}/min_cbm_bits"),
                    num_closids=self._read_int(f"{info_dir}/num_closids"),
                    shareable_bits=int(self._read_or_empty(f"{info_dir}/shareable_bits").strip() or "0", 16),
                    resources=resources,
                )
        return None

    def _mba_info(self) -> MbaInfo | None:
        if not (self.root / "info/MB").is_dir():
            return None
        delay = self._read_or_empty("info/MB/delay_linear").strip()
        unit: MbaUnit = "percent"
        if "mba_MBps" in self._mount_options():
            unit = "mbps"
        elif self._cpu_vendor() in ("AuthenticAMD", "HygonGenuine"):
            unit = "amd_eighth_gbps"
        return MbaInfo(
            min_bandwidth=self._read_int("info/MB/min_bandwidth"),
            bandwidth_gran=self._read_int("info/MB/bandwidth_gran"),
            num_closids=self._read_int("info/MB/num_closids"),
            delay_linear=(delay == "1") if delay else None,
            unit=unit,
        )

    # -- groups ---------------------------------------------------------------------------------

    def groups(self) -> tuple[str, ...]:
        """The control groups other than the default one."""
        try:
            entries = sorted(os.scandir(self.root), key=lambda e: e.name)
        except OSError as err:
            raise ResctrlError(os_error_message(f"listing {self.root}", err), errno_=err.errno) from err
        return tuple(e.name for e in entries if e.is_dir(follow_symlinks=False) and e.name not in NOT_GROUPS)

    def schemata(self, group: str | None = None) -> Schemata:
        """The parsed schemata of ``group`` (None: the default group)."""
        return parse_schemata(self._read(self._group_rel(group, "schemata")))

    def create_group(
        self,
        name: str,
        *,
        l3: float | None = None,
        mb_percent: int | None = None,
        l3_domains: Collection[int] | None = None,
    ) -> GroupAllocation:
        """Create the control group ``name`` with exclusive L3 ways and/or an MBA percentage.

        ``l3``: a fraction below 1 of the cache, or a number of ways. ``l3_domains``: the L3 cache
        ids where the slot's CPUs are (None: all); elsewhere the group shares the default group's
        ways. Serialised with other allocators by flock on the root; rolled back on failure.
        """
        _check_group_name(name)
        if l3 is None and mb_percent is None:
            raise InvalidRequest(f"resctrl group {name!r}: asks for neither l3 nor memory bandwidth")
        support = self.require(l3=l3 is not None, mb=mb_percent is not None)
        with self._locked():
            if (self.root / name).exists():
                raise InvalidRequest(f"resctrl group {name!r} already exists under {self.root}")
            self._check_closids(support)
            return self._create_locked(name, support, l3, mb_percent, l3_domains)

    def _create_locked(
        self,
        name: str,
        support: ResctrlSupport,
        l3: float | None,
        mb_percent: int | None,
        l3_domains: Collection[int] | None,
    ) -> GroupAllocation:
        lines: Schemata = {}
        masks: dict[int, int] = {}
        defaults: dict[int, int] = {}
        if support.l3 is not None:
            masks, defaults = self._plan_l3(support, l3, l3_domains)
            full = {d: masks.get(d, defaults[d]) for d in support.l3_domains}
            for resource in support.l3.resources:
                lines[resource] = {d: f"{mask:x}" for d, mask in full.items()}
        mb_value = None
        if mb_percent is not None and support.mb is not None:
            mb_value = mba_step(mb_percent, support.mb)
            lines["MB"] = dict.fromkeys(support.mb_domains, str(mb_value))
        if masks:
            self._apply_default_masks(support, defaults)
        self._mkdir(name)
        try:
            self._update_schemata(name, lines)
            if masks:
                self._write(self._group_rel(name, "mode"), "exclusive")
        except BaseException:
            self._remove(name)
            if masks:
                self._restore_default(support)
            raise
        return GroupAllocation(name, self.root / name, masks, mb_value, defaults if masks else {})

    def _plan_l3(
        self, support: ResctrlSupport, l3: float | None, l3_domains: Collection[int] | None
    ) -> tuple[dict[int, int], dict[int, int]]:
        assert support.l3 is not None
        cache = support.l3
        taken = self._exclusive_masks(support)
        defaults = {d: default_mask(cache, taken.get(d, 0)) for d in support.l3_domains}
        if l3 is None:
            return {}, defaults
        wanted = support.l3_domains if l3_domains is None else tuple(sorted(l3_domains))
        unknown = sorted(set(wanted) - set(support.l3_domains))
        if unknown:
            raise InvalidRequest(
                f"l3 asks for cache ways on L3 domains {unknown}; this host has domains "
                f"{list(support.l3_domains)}"
            )
        ways = ways_for_share(l3, cache)
        masks: dict[int, int] = {}
        for domain in wanted:
            try:
                masks[domain], defaults[domain] = plan_exclusive_mask(
                    cache, taken.get(domain, 0), ways, self.default_reserve_ways
                )
            except PlacementError as err:
                raise PlacementError(f"L3 domain {domain}: {err}") from None
        return masks, defaults

    def _exclusive_masks(self, support: ResctrlSupport) -> dict[int, int]:
        """Per domain, the union of the masks of the groups in exclusive mode."""
        assert support.l3 is not None
        resource = support.l3.resources[0]
        taken: dict[int, int] = {}
        for group in self.groups():
            if self._read_or_empty(self._group_rel(group, "mode")).strip() != "exclusive":
                continue
            for domain, value in self.schemata(group).get(resource, {}).items():
                taken[domain] = taken.get(domain, 0) | int(value, 16)
        return taken

    def _apply_default_masks(self, support: ResctrlSupport, defaults: Mapping[int, int]) -> None:
        """Give the default group, and every shareable group, exactly the non-exclusive ways: the
        kernel refuses an exclusive mask that overlaps any other group."""
        assert support.l3 is not None
        lines = {r: {d: f"{m:x}" for d, m in defaults.items()} for r in support.l3.resources}
        shareable = [
            g for g in self.groups() if self._read_or_empty(self._group_rel(g, "mode")).strip() == "shareable"
        ]
        for group in [None, *shareable]:
            self._update_schemata(group, lines)

    def _restore_default(self, support: ResctrlSupport) -> None:
        assert support.l3 is not None
        taken = self._exclusive_masks(support)
        self._apply_default_masks(
            support, {d: default_mask(support.l3, taken.get(d, 0)) for d in support.l3_domains}
        )

    def ensure_shared_group(self, name: str, *, l3_share: float | None, mb_percent: int | None) -> bool:
        """A control group that shares a few cache ways with the default group (best-effort's):
        per L3 domain the lowest ways of the default group's mask, ``l3_share`` of the cache (a
        fraction, or a number of ways), and an MBA percentage. Created when missing, corrected when
        it drifted (a new exclusive slot group rewrites shareable groups to the default's whole
        mask). Parts the CPU lacks are left out; Unsupported when resctrl offers neither. True when
        anything was written."""
        _check_group_name(name)
        support = self.detect()
        if not support.mounted or (support.l3 is None and support.mb is None):
            why = support.reason or f"resctrl at {self.root} offers no cache or bandwidth control"
            raise Unsupported(why)
        with self._locked():
            wanted: Schemata = {}
            if l3_share is not None and support.l3 is not None:
                ways = ways_for_share(l3_share, support.l3)
                defaults = self.schemata(None).get(support.l3.resources[0], {})
                masks = {d: low_ways(int(defaults.get(d, "0"), 16), ways) for d in support.l3_domains}
                for resource in support.l3.resources:
                    wanted[resource] = {d: f"{mask:x}" for d, mask in masks.items()}
            if mb_percent is not None and support.mb is not None:
                wanted["MB"] = dict.fromkeys(support.mb_domains, str(mba_step(mb_percent, support.mb)))
            created = not (self.root / name).is_dir()
            if created:
                self._check_closids(support)
                self._mkdir(name)
            current = parse_schemata(self._read_or_empty(self._group_rel(name, "schemata")))
            drifted = any(
                int(current.get(resource, {}).get(domain, "-1"), 16) != int(value, 16)
                for resource, domains in wanted.items()
                for domain, value in domains.items()
            )
            if drifted:
                self._update_schemata(name, wanted)
            return created or drifted

    def delete_group(self, name: str) -> bool:
        """Remove group ``name`` (its tasks fall back to the default group) and give its cache ways
        back to the default group. False when it was already gone."""
        _check_group_name(name)
        with self._locked():
            if not (self.root / name).is_dir():
                return False
            self._remove(name)
            support = self.detect()
            if support.l3 is not None:
                self._restore_default(support)
        return True

    def assign_tasks(self, name: str, pids: Iterable[int]) -> None:
        """Move each pid into the group (the kernel takes one pid per write)."""
        _check_group_name(name)
        self._require_group(name)
        for pid in pids:
            self._write(self._group_rel(name, "tasks"), str(pid))

    def assign_cpus(self, name: str, cpus: Iterable[int]) -> None:
        """Make the group own these CPUs (for tasks of the default group running on them)."""
        _check_group_name(name)
        self._require_group(name)
        self._write(self._group_rel(name, "cpus_list"), format_cpulist(cpus))

    def _check_closids(self, support: ResctrlSupport) -> None:
        existing = self.groups()
        # The default group holds CLOSID 0.
        if len(existing) + 1 >= support.num_closids:
            raise PlacementError(
                f"resctrl has {support.num_closids} CLOSIDs and all are in use (the default group and "
                f"{len(existing)} groups: {', '.join(existing)}); release a slot with cache or "
                "memory-bandwidth isolation, or run this slot without them"
            )

    def _require_group(self, name: str) -> None:
        if not (self.root / name).is_dir():
            raise NotFound(f"resctrl group {name!r} does not exist under {self.root}")

    # -- the one gateway to the filesystem ------------------------------------------------------

    def _group_rel(self, group: str | None, filename: str) -> str:
        return filename if group is None else f"{group}/{filename}"

    def _path(self, relpath: str) -> Path:
        rel = PurePosixPath(relpath)
        path = self.root / rel
        real_root = os.path.realpath(self.root)
        real = os.path.realpath(path)
        if (
            rel.is_absolute()
            or ".." in rel.parts
            or not (real == real_root or real.startswith(real_root + "/"))
        ):
            raise ResctrlError(
                f"refusing resctrl path {relpath!r}: it leaves {self.root}", errno_=errno.EXDEV
            )
        return path

    def _write(self, relpath: str, value: str) -> None:
        """One write(2) of ``value``; a refusal quotes the value and the kernel's last_cmd_status."""
        path = self._path(relpath)
        try:
            # O_CREAT is harmless on resctrl (its files exist once the group does) and lets a fake
            # tree in a plain directory stand in for the kernel's.
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, value.encode())
            finally:
                os.close(fd)
        except OSError as err:
            status = self._read_or_empty("info/last_cmd_status").strip()
            detail = f"; the kernel says: {status}" if status and status != "ok" else ""
            message = os_error_message(f"writing {value.strip()!r} to {path}", err) + detail
            raise ResctrlError(message, errno_=err.errno) from err

    def _update_schemata(self, group: str | None, changes: Schemata) -> None:
        """Rewrite the group's schemata with ``changes`` merged in; every line is written back so
        the file stays whole (the kernel keeps unwritten lines as they were)."""
        if not changes:
            return
        current = parse_schemata(self._read_or_empty(self._group_rel(group, "schemata")))
        for resource, domains in changes.items():
            current.setdefault(resource, {}).update(domains)
        self._write(self._group_rel(group, "schemata"), format_schemata(current))

    def _mkdir(self, name: str) -> None:
        path = self._path(name)
        try:
            path.mkdir()
        except OSError as err:
            if err.errno == errno.ENOSPC:
                raise PlacementError(
                    f"creating resctrl group {name!r}: the kernel has no free CLOSID or RMID; release a "
                    "slot with cache or memory-bandwidth isolation"
                ) from err
            raise ResctrlError(
                os_error_message(f"creating resctrl group {path}", err), errno_=err.errno
            ) from err

    def _remove(self, name: str) -> None:
        path = self._path(name)
        try:
            path.rmdir()
        except FileNotFoundError:
            return
        except OSError as err:
            # The kernel's rmdir takes a group with its files; only a fake tree in a plain directory
            # answers ENOTEMPTY, and there the files are ours to delete.
            if err.errno != errno.ENOTEMPTY:
                message = os_error_message(f"removing resctrl group {path}", err)
                raise ResctrlError(message, errno_=err.errno) from err
            shutil.rmtree(path)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as err:
            raise ResctrlError(os_error_message(f"opening {self.root}", err), errno_=err.errno) from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _read(self, relpath: str) -> str:
        path = self._path(relpath)
        try:
            return path.read_text()
        except OSError as err:
            raise ResctrlError(os_error_message(f"reading {path}", err), errno_=err.errno) from err

    def _read_or_empty(self, relpath: str) -> str:
        try:
            return self._read(relpath)
        except ResctrlError as err:
            if err.errno == errno.ENOENT:
                return ""
            raise

    def _read_int(self, relpath: str) -> int:
        text = self._read(relpath).strip()
        try:
            return int(text)
        except ValueError:
            raise ResctrlError(f"{self.root / relpath} holds {text!r}, not a number") from None


def _check_group_name(name: str) -> None:
    if not _GROUP_NAME.match(name) or name in NOT_GROUPS or name in (".", ".."):
        raise InvalidRequest(
            f"resctrl group name {name!r} is not allowed: use 1-64 letters, digits, '.', '_' or '-', "
            f"and none of {sorted(NOT_GROUPS)}"
        )
