"""The kernel's cpulist format ("0-3,8,10-11"), used by sysfs, cpusets, isolcpus and resctrl.

It lives in the package root because every layer reads or writes it (devices, cgroups, isolation,
placement); it depends on nothing but the error hierarchy.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from nodeagent.errors import InvalidRequest


def parse_cpulist(text: str) -> frozenset[int]:
    """Parse a kernel cpulist such as ``"0-3,8,10-11"`` (also ``"0-7:2"`` strides).

    An empty string is the empty set. Raises InvalidRequest for anything else malformed.
    """
    result: set[int] = set()
    text = text.strip()
    if not text:
        return frozenset()
    for raw in text.split(","):
        part = raw.strip()
        try:
            if "-" in part:
                span, _, stride_text = part.partition(":")
                lo_text, _, hi_text = span.partition("-")
                lo, hi = int(lo_text), int(hi_text)
                stride = int(stride_text) if stride_text else 1
                if lo < 0 or hi < lo or stride < 1:
                    raise ValueError(part)
                result.update(range(lo, hi + 1, stride))
            else:
                cpu = int(part)
                if cpu < 0:
                    raise ValueError(part)
                result.add(cpu)
        except ValueError:
            raise InvalidRequest(
                f"cannot parse cpulist {text!r}: {part!r} is not a CPU number or range; "
                "use a form such as '0-3,8,10-11'"
            ) from None
    return frozenset(result)


def format_cpulist(cpus: Iterable[int]) -> str:
    """Format CPU ids as the shortest kernel cpulist (``[0,1,2,3,8] -> "0-3,8"``)."""
    return _format_sorted(tuple(sorted(set(cpus))))


def shared_ids(ids: Iterable[int]) -> frozenset[int]:
    """One frozenset per distinct set of CPU (or node) ids, the same object for every caller: each
    slot on the shared pool keeps the pool's CPUs in its records, and 500 equal copies were
    ~200 bytes a slot each (issue 23)."""
    return _one_of(frozenset(ids))


@functools.lru_cache(maxsize=256)
def _one_of(ids: frozenset[int]) -> frozenset[int]:
    return ids


@functools.lru_cache(maxsize=1024)
def _format_sorted(ordered: tuple[int, ...]) -> str:
    # Cached: listing or scraping 500 slots formats the same few sets (the shared pool of every
    # burstable and best-effort slot) again and again; on a big host the loop below was half of
    # GET /v1/slots' time.
    if not ordered:
        return ""
    parts: list[str] = []
    start = prev = ordered[0]
    for cpu in ordered[1:]:
        if cpu == prev + 1:
            prev = cpu
            continue
        parts.append(f"{start}-{prev}" if prev > start else str(start))
        start = prev = cpu
    parts.append(f"{start}-{prev}" if prev > start else str(start))
    return ",".join(parts)
