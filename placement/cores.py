"""Which cores and threads of one NUMA node a guaranteed slot takes.

The order is kubelet's static CPU policy's, whatever the options: whole free cores first, then
single threads, and those from cores already partly used (by other slots, or by a reserved or
isolated sibling) before an entirely free core is split. A slot therefore splits a free core only
when its count cannot be made otherwise, and then exactly one. With ``whole_cores`` (the default)
no core is ever split: :func:`pick_whole_cores` rounds up instead.

Inside a node the cores come from the fewest L3 caches (:func:`order_by_l3`) unless keeping to them
would split a core that spreading over caches would not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from nodeagent.placement.bitset import ids_of
from nodeagent.placement.index import FreeCore


class ThreadPick(NamedTuple):
    """The CPUs taken on one node with ``whole_cores`` off, and how they were made up."""

    cpus: int  #: mask of the CPUs taken
    whole_cores: int  #: entirely free cores taken whole
    spare_threads: int  #: CPUs taken from cores already partly used
    split_core: int | None  #: the entirely free core taken only in part, when the count needed one
    split_threads: int  #: CPUs taken from ``split_core``
    l3_groups: tuple[tuple[int, int], ...]  #: (node, L3 cache id) of the CPUs taken


def order_by_l3(cores: Sequence[FreeCore], want: int) -> list[FreeCore]:
    """Cores from the fewest L3 caches: best fit if one cache holds ``want``, else largest first."""
    groups: dict[tuple[int, int], list[FreeCore]] = {}
    for c in cores:
        groups.setdefault(c[2], []).append(c)
    if len(groups) == 1:
        return list(cores)
    size = {g: sum(c[1].bit_count() for c in members) for g, members in groups.items()}
    order: list[tuple[int, int]] = []
    remaining = want
    while remaining > 0 and len(order) < len(groups):
        left = [g for g in groups if g not in order]
        fitting = [g for g in left if size[g] >= remaining]
        pick = min(fitting, key=lambda g: (size[g], g)) if fitting else max(left, key=lambda g: (size[g], g))
        order.append(pick)
        remaining -= size[pick]
    order += [g for g in groups if g not in order]
    return [c for g in order for c in groups[g]]


def quietest_first(cores: Sequence[FreeCore], irq_load: Mapping[int, int] | None) -> list[FreeCore]:
    """``cores`` with each L3 group's cores reordered by interrupt load (fewest first, then as given).

    An interrupt handler preempts whatever runs on its CPU, and an exclusive CPU cannot keep the
    unmovable (managed) ones away: among cores the rules above rank equal, the quietest go to
    exclusive slots. Groups keep their order and stay contiguous, so no rule before this one changes.
    """
    if not irq_load:
        return list(cores)
    group_rank: dict[tuple[int, int], int] = {}
    for c in cores:
        group_rank.setdefault(c[2], len(group_rank))

    def load(core: FreeCore) -> int:
        mask = core[1]
        return sum(irq_load.get(cpu, 0) for cpu in ids_of(mask))

    ranked = sorted(enumerate(cores), key=lambda ic: (group_rank[ic[1][2]], load(ic[1]), ic[0]))
    return [c for _, c in ranked]


def pick_whole_cores(cores: Sequence[FreeCore], want: int, tpc: int, round_up: bool) -> int | None:
    """Whole cores (``cores`` holds only entirely free ones) making ``want`` CPUs, or rounding up."""
    picked = 0
    remaining = want
    used: set[int] = set()
    # Full-size cores first, then smaller ones (siblings offline) to hit the count exactly.
    for full_only in (True, False):
        for core, cmask, _ in cores:
            size = cmask.bit_count()
            if remaining <= 0:
                break
            if core in used or size > remaining or (full_only and size != tpc):
                continue
            picked |= cmask
            used.add(core)
            remaining -= size
    if remaining > 0 and len({c[1].bit_count() for c in cores}) > 1:
        # Cores of different sizes: the greedy choice can miss an exact count (6 from 4, 3 and 3).
        exact = _exact_whole_cores(cores, want, want)
        if exact is not None:
            picked, remaining = 0, 0
            for c in exact:
                picked |= c[1]
            used = {c[0] for c in exact}
    if remaining > 0 and round_up:
        spare = [c for c in cores if c[0] not in used]
        spare.sort(key=lambda c: c[1].bit_count())
        for _, cmask, _ in spare:
            if remaining <= 0:
                break
            picked |= cmask
            remaining -= cmask.bit_count()
    return picked if remaining <= 0 else None


def pick_threads(
    cores: Sequence[FreeCore], want: int, full: Mapping[int, int], *, uniform: bool = True
) -> ThreadPick | None:
    """``want`` CPUs from ``cores`` (free cores, whole or partly used) splitting as few as possible.

    ``cores`` come as the index lists them, grouped by L3 cache; ``full`` maps a core to all its
    online CPUs (a mask), which tells whole free cores apart; ``uniform`` says that every core of
    the node has the same number of online threads. None when the cores hold fewer than ``want``.
    """
    if not cores or cores[0][2] == cores[-1][2]:  # one L3 cache
        return _pick_in(cores, want, full, uniform)
    groups: dict[tuple[int, int], list[FreeCore]] = {}
    for c in cores:
        groups.setdefault(c[2], []).append(c)
    # One cache, best fit first, as long as it needs no split the node as a whole would avoid.
    size = {g: sum(c[1].bit_count() for c in members) for g, members in groups.items()}
    in_one_cache = None
    for g in sorted((g for g in groups if size[g] >= want), key=lambda g: (size[g], g)):
        pick = _pick_in(groups[g], want, full, uniform)
        if pick is not None and pick.split_core is None:
            return pick
        in_one_cache = in_one_cache or pick
    across = _pick_in(order_by_l3(cores, want), want, full, uniform)
    if in_one_cache is None or (across is not None and across.split_core is None):
        return across
    return in_one_cache


def needs_split(cores: Sequence[FreeCore], want: int, full: Mapping[int, int]) -> bool:
    """Whether ``want`` CPUs from ``cores`` must split an entirely free core (see :func:`pick_threads`).

    For nodes whose cores differ in size; where they do not, a division answers (the planner's).
    """
    whole = [c for c in cores if c[1] == full[c[0]]]
    spare = sum(c[1].bit_count() for c in cores) - sum(c[1].bit_count() for c in whole)
    taken = sum(c[1].bit_count() for c in _whole_cores_for(whole, want, spare, uniform=False))
    return want - taken > spare


def _pick_in(
    cores: Sequence[FreeCore], want: int, full: Mapping[int, int], uniform: bool
) -> ThreadPick | None:
    """Whole cores, then threads of partly used cores, then one split core; ``cores`` in preference order."""
    whole: list[FreeCore] = []
    partly_used: list[FreeCore] = []
    spare = 0
    for c in cores:
        if c[1] == full[c[0]]:
            whole.append(c)
        else:
            partly_used.append(c)
            spare += c[1].bit_count()
    chosen = _whole_cores_for(whole, want, spare, uniform)
    picked = 0
    for c in chosen:
        picked |= c[1]
    remaining = want - picked.bit_count()
    spare_threads = 0
    groups = {c[2] for c in chosen}
    if remaining > 0 and partly_used:
        # kubelet's order for single threads: the most used cores first (fewest free threads),
        # which keeps the less used ones for slots that need more of a core.
        rank: dict[tuple[int, int], int] = {}
        for c in cores:
            rank.setdefault(c[2], len(rank))
        for _, free, l3 in sorted(partly_used, key=lambda c: (rank[c[2]], c[1].bit_count())):
            threads = ids_of(free)[:remaining]
            for cpu in threads:
                picked |= 1 << cpu
            groups.add(l3)
            spare_threads += len(threads)
            remaining -= len(threads)
            if remaining == 0:
                break
    split_core = None
    split_threads = 0
    if remaining > 0:
        # Every whole core left is larger than what remains (the choice above took all that fit),
        # so one core is split, the first in preference order.
        used = {c[0] for c in chosen}
        for core, free, l3 in whole:
            if core in used:
                continue
            threads = ids_of(free)[:remaining]
            for cpu in threads:
                picked |= 1 << cpu
            groups.add(l3)
            remaining -= len(threads)
            if len(threads) < free.bit_count():
                split_core, split_threads = core, len(threads)
            if remaining == 0:
                break
    if remaining > 0:
        return None
    return ThreadPick(picked, len(chosen), spare_threads, split_core, split_threads, tuple(sorted(groups)))


def _whole_cores_for(whole: Sequence[FreeCore], want: int, spare: int, uniform: bool) -> list[FreeCore]:
    """Whole cores making up as much of ``want`` as they can, leaving at most ``spare`` if possible.

    With cores of one size the first ``want // size`` are the answer. Otherwise full-size cores
    come first, and as the greedy choice can miss a combination that avoids a split (6 from cores
    of 4, 3 and 3), an exact search is tried before giving up.
    """
    if uniform:
        return list(whole[: want // whole[0][1].bit_count()]) if whole else []
    chosen: list[FreeCore] = []
    total = 0
    for c in sorted(whole, key=lambda c: -c[1].bit_count()):
        size = c[1].bit_count()
        if total + size <= want:
            chosen.append(c)
            total += size
            if total == want:
                break
    if want - total <= spare:
        return chosen
    return _exact_whole_cores(whole, want - spare, want) or chosen


def _exact_whole_cores(whole: Sequence[FreeCore], low: int, high: int) -> list[FreeCore] | None:
    """Whole cores whose sizes sum to the largest total in [low, high], or None if none does.

    Subset sum over small sizes, as bitsets: ``reach[i]`` has bit s set when the first i cores
    can make s CPUs. Walking back prefers the earlier cores, which come first in preference.
    """
    limit = (1 << (high + 1)) - 1
    reach = [1]
    for c in whole:
        r = reach[-1]
        reach.append((r | r << c[1].bit_count()) & limit)
    in_range = reach[-1] >> max(low, 0)
    if not in_range:
        return None
    target = max(low, 0) + in_range.bit_length() - 1
    chosen: list[FreeCore] = []
    for i in range(len(whole) - 1, -1, -1):
        if reach[i] >> target & 1:
            continue  # reachable without this core
        chosen.append(whole[i])
        target -= whole[i][1].bit_count()
    chosen.reverse()
    return chosen
