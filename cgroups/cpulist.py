"""The kernel's cpulist format for cpuset files (cgroups/ imports nothing from devices/)."""

from __future__ import annotations

from collections.abc import Iterable

from nodeagent.errors import CgroupError


def format_ids(ids: Iterable[int]) -> str:
    """``{0, 1, 2, 3, 8} -> "0-3,8"``."""
    ordered = sorted(set(ids))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def parse_ids(text: str) -> frozenset[int]:
    """``"0-3,8" -> {0, 1, 2, 3, 8}``; empty text is the empty set."""
    ids: set[int] = set()
    for part in filter(None, (p.strip() for p in text.strip().split(","))):
        lo, _, hi = part.partition("-")
        try:
            ids.update(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise CgroupError(f"cannot parse cpuset list {text!r} at {part!r}") from None
    return frozenset(ids)
