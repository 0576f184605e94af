"""Placement options: the knobs an operator sets (config file or ``--option KEY=VALUE``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from nodeagent.cpulist import format_cpulist, parse_cpulist
from nodeagent.errors import ConfigError, InvalidRequest


@dataclass(frozen=True)
class PlacementOptions:
    whole_cores: bool = True  #: never split a physical core's hyperthreads between two slots
    round_up_to_cores: bool = True  #: with whole_cores, an odd request takes whole cores (else: refused)
    distribute_across_numa: bool = False  #: wide guaranteed slots: whole cores spread over the fewest nodes
    reserved_cpus: frozenset[int] | None = None  #: None: the first physical core on hosts with >= 4 CPUs
    use_isolated_cpus: bool = False  #: hand isolcpus CPUs to guaranteed slots (never to the pool)
    burstable_overcommit: float = 1.0  #: burstable quota may reach pool CPUs x this
    best_effort_overcommit: float = 4.0  #: best effort yields to everyone, so it may overcommit more
    shareable_gpus: frozenset[str] = frozenset()  #: GPU indexes or UUIDs that take gpu_share slots
    max_shares_per_gpu: int = 4
    allowed_devices: frozenset[str] = frozenset()  #: device paths a request may name
    shared_devices: frozenset[str] = frozenset()  #: allowed paths many slots may hold at once

    @classmethod
    def from_strings(cls, items: Iterable[str]) -> PlacementOptions:
        """Parse ``KEY=VALUE`` strings (the CLI's ``--option``); ConfigError names bad ones."""
        values: dict[str, Any] = {}
        for item in items:
            key, sep, raw = item.partition("=")
            key = key.strip()
            if not sep:
                raise ConfigError(f"placement option {item!r} is not KEY=VALUE; e.g. whole_cores=false")
            if key not in _OPTION_PARSERS:
                raise ConfigError(
                    f"unknown placement option {key!r}; known options: {', '.join(sorted(_OPTION_PARSERS))}"
                )
            parse, expected = _OPTION_PARSERS[key]
            try:
                values[key] = parse(raw.strip())
            except (ValueError, InvalidRequest):
                raise ConfigError(f"placement option {key}={raw!r}: expected {expected}") from None
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return {
            "whole_cores": self.whole_cores,
            "round_up_to_cores": self.round_up_to_cores,
            "distribute_across_numa": self.distribute_across_numa,
            "reserved_cpus": None if self.reserved_cpus is None else format_cpulist(self.reserved_cpus),
            "use_isolated_cpus": self.use_isolated_cpus,
            "burstable_overcommit": self.burstable_overcommit,
            "best_effort_overcommit": self.best_effort_overcommit,
            "shareable_gpus": sorted(self.shareable_gpus),
            "max_shares_per_gpu": self.max_shares_per_gpu,
            "allowed_devices": sorted(self.allowed_devices),
            "shared_devices": sorted(self.shared_devices),
        }


def _parse_bool(raw: str) -> bool:
    lowered = raw.lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise ValueError(raw)


def _parse_ratio(raw: str) -> float:
    value = float(raw)
    if not math.isfinite(value) or not 0 < value <= 1000:
        raise ValueError(raw)
    return value


def _parse_count(raw: str) -> int:
    value = int(raw)
    if not 1 <= value <= 1000:
        raise ValueError(raw)
    return value


def _parse_words(raw: str) -> frozenset[str]:
    return frozenset(w.strip() for w in raw.split(",") if w.strip())


_OPTION_PARSERS: dict[str, tuple[Callable[[str], Any], str]] = {
    "whole_cores": (_parse_bool, "true or false"),
    "round_up_to_cores": (_parse_bool, "true or false"),
    "distribute_across_numa": (_parse_bool, "true or false"),
    "reserved_cpus": (parse_cpulist, "a cpulist such as 0,1 or 0-3 (empty for none)"),
    "use_isolated_cpus": (_parse_bool, "true or false"),
    "burstable_overcommit": (_parse_ratio, "a ratio above 0, such as 1.0 or 1.5"),
    "best_effort_overcommit": (_parse_ratio, "a ratio above 0, such as 4"),
    "shareable_gpus": (_parse_words, "comma-separated GPU indexes or UUIDs"),
    "max_shares_per_gpu": (_parse_count, "a whole number from 1 to 1000"),
    "allowed_devices": (_parse_words, "comma-separated device paths"),
    "shared_devices": (_parse_words, "comma-separated device paths"),
}
