"""Amounts in requests: byte quantities ("4Gi", "512Mi", "1G") and thousandths ("1.5", "500m").

Pure functions on plain values; every refusal is a ValueError whose text says what is wrong with the
value and what would be accepted (the schema's error formatter adds which field it was).
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation
from typing import Any

from nodeagent.bytesize import format_quantity, format_quantity_short

#: CPU quotas and GPU shares are kept in thousandths, like kubelet's millicores, so sums stay exact.
MILLI = 1000
MAX_BYTES = 2**63 - 1

UNITS = {
    "": 1,
    "k": 10**3,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}
# "k" is only decimal: the binary unit is "Ki" (Kubernetes spells them the same way).
QUANTITY_PATTERN = r"^\s*[0-9]+(\.[0-9]+)?\s*(k|[KMGTPE]i?)?\s*$"
_QUANTITY = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(k|[KMGTPE]i?)?\s*")
MILLIS_PATTERN = r"^[0-9]+m$"


def shown(value: Any) -> str:
    """A value as an error message quotes it: repr, shortened."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_quantity(value: Any) -> int:
    """Bytes from an integer or a string such as ``"4Gi"``, ``"512Mi"``, ``"1G"`` or ``"1.5Gi"``."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f'must be a byte count or a quantity string such as "4Gi", got {shown(value)}')
    if isinstance(value, int):
        amount = value
    else:
        match = _QUANTITY.fullmatch(value)
        if match is None:
            raise ValueError(
                f"{shown(value)} is not a quantity; use bytes or a number with a unit such as 512Mi, "
                f"4Gi or 1G (units: {', '.join(u for u in UNITS if u)})"
            )
        try:
            exact = Decimal(match.group(1)) * UNITS[match.group(2) or ""]
        except InvalidOperation:  # pragma: no cover - the pattern admits only plain decimals
            raise ValueError(f"{shown(value)} is not a quantity") from None
        if exact != exact.to_integral_value():
            raise ValueError(f"{shown(value)} is not a whole number of bytes")
        amount = int(exact)
    if amount < 0 or amount > MAX_BYTES:
        raise ValueError(f"{shown(value)} is out of range; it must be 0 to 8Ei bytes")
    return amount


def parse_milli(value: Any, *, maximum: int) -> int:
    """A non-negative amount with up to three decimals (or ``"500m"``), in thousandths."""
    if isinstance(value, str) and value.endswith("m") and value[:-1].isdigit():
        millis = int(value[:-1])
    elif isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ValueError(f"must be a finite number, got {shown(value)}")
        if value < 0 or value > maximum:  # before scaling: 1e308 * 1000 is no longer a number
            raise ValueError(f"{shown(value)} is out of range; it must be 0 to {maximum}")
        if 0 < value < 1 / MILLI / 2:
            # 1e-400 reaches us as 0.0, but 1e-300 does not: an amount that rounds to nothing is
            # refused rather than silently becoming "no quota".
            raise ValueError(
                f"{shown(value)} is below the smallest amount, 0.001; ask for 0 or at least 0.001"
            )
        millis = round(value * MILLI)
        if abs(value * MILLI - millis) > 1e-6:
            raise ValueError(f"{shown(value)} has more than three decimals; round it to 0.001")
    else:
        raise ValueError(f'must be a number (or a millis string such as "500m"), got {shown(value)}')
    if millis > maximum * MILLI:
        raise ValueError(f"{shown(value)} is out of range; it must be 0 to {maximum}")
    return millis


def milli_number(millis: int) -> int | float:
    """The JSON number for an amount in thousandths: 2000 -> 2, 1500 -> 1.5."""
    return millis // MILLI if millis % MILLI == 0 else millis / MILLI


__all__ = [
    "MAX_BYTES",
    "MILLI",
    "format_quantity",
    "format_quantity_short",
    "milli_number",
    "parse_milli",
    "parse_quantity",
    "shown",
]
