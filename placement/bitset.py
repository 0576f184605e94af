"""CPU sets as Python ints used as bitsets (bit ``i`` set: CPU ``i`` is in the set).

Placement works on masks because union, difference and counting are single int operations,
whatever the number of CPUs; these two functions convert at the edges.
"""

from __future__ import annotations

from collections.abc import Iterable


def mask_of(ids: Iterable[int]) -> int:
    m = 0
    for i in ids:
        m |= 1 << i
    return m


_BITS_OF_BYTE = tuple(tuple(bit for bit in range(8) if value >> bit & 1) for value in range(256))


def ids_of(mask: int) -> tuple[int, ...]:
    out: list[int] = []
    if mask.bit_count() <= 8:
        while mask:
            low = mask & -mask
            out.append(low.bit_length() - 1)
            mask ^= low
        return tuple(out)
    # Dense masks (a shared pool of hundreds of CPUs): a byte at a time rather than a bit at a time.
    for pos, byte in enumerate(mask.to_bytes((mask.bit_length() + 7) // 8, "little")):
        if byte:
            base = pos * 8
            out.extend(base + bit for bit in _BITS_OF_BYTE[byte])
    return tuple(out)
