"""Byte counts for people, in binary units: 4294967296 -> "4Gi", 6.6 GiB -> "6.6Gi".

The CLI prints every memory figure with these, and the request schema writes quantities back with
them (``nodeagent.schema.quantity`` parses). They live here, on their own, because the CLI must not
import the request schema only to print a table: that import alone was ~5 ms of the 80 ms a
``nodeagent slots list`` may take.
"""

from __future__ import annotations

#: Largest first, so the first unit that divides a count exactly is the shortest exact form.
BINARY_UNITS = (("Ei", 2**60), ("Pi", 2**50), ("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10))


def format_quantity(nbytes: int) -> str:
    """The shortest exact binary form: 4294967296 -> "4Gi", 1000 -> "1000"."""
    for unit, size in BINARY_UNITS:
        if nbytes and nbytes % size == 0:
            return f"{nbytes // size}{unit}"
    return str(nbytes)


def format_quantity_short(nbytes: int) -> str:
    """The exact form when it is short ("512Mi"), else one decimal ("6.6Gi")."""
    exact = format_quantity(nbytes)
    if len(exact) <= 6:
        return exact
    for unit, size in BINARY_UNITS:
        if nbytes >= size:
            return f"{nbytes / size:.1f}{unit}"
    return exact


__all__ = ["BINARY_UNITS", "format_quantity", "format_quantity_short"]
