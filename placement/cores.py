"""Which cores and threads of one NUMA node a guaranteed slot takes."""

from __future__ import annotations

from collections.abc import Sequence

from nodeagent.placement.bitset import ids_of
from nodeagent.placement.index import FreeCore


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


def pick_whole_cores(cores: Sequence[FreeCore], want: int, tpc: int, round_up: bool) -> int | None:
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
    if remaining > 0 and round_up:
        spare = [c for c in cores if c[0] not in used]
        spare.sort(key=lambda c: c[1].bit_count())
        for _, cmask, _ in spare:
            if remaining <= 0:
                break
            picked |= cmask
            remaining -= cmask.bit_count()
    return picked if remaining <= 0 else None


def first_cpus(cores: Sequence[FreeCore], want: int) -> tuple[int, ...]:
    out: list[int] = []
    for _, free, _ in cores:
        for cpu in ids_of(free):
            if len(out) == want:
                return tuple(out)
            out.append(cpu)
    return tuple(out)
