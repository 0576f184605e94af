"""Device access rules, modelled in memory (pure): parsing, merging and the v1 minimal diff."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass

from nodeagent.errors import InvalidRequest

_ACCESS_ORDER = "rwm"


@dataclass(frozen=True, order=True)
class DeviceRule:
    """One allowed device class: ``type`` 'c' (char), 'b' (block) or 'a' (both); ``None`` is '*'.

    ``access`` is a subset of "rwm" (read, write, mknod), kept in that order.
    """

    type: str
    major: int | None
    minor: int | None
    access: str = "rwm"

    def __post_init__(self) -> None:
        if self.type not in ("a", "b", "c"):
            raise InvalidRequest(f"device rule type must be 'a', 'b' or 'c', got {self.type!r}")
        if not self.access or set(self.access) - set(_ACCESS_ORDER):
            raise InvalidRequest(
                f"device rule access must be a non-empty subset of 'rwm', got {self.access!r}"
            )
        for name in ("major", "minor"):
            number = getattr(self, name)
            if number is not None and not 0 <= number < 2**32:
                raise InvalidRequest(f"device rule {name} must be 0..2^32-1 or None ('*'), got {number}")
        object.__setattr__(self, "access", "".join(c for c in _ACCESS_ORDER if c in self.access))

    @property
    def key(self) -> tuple[str, int | None, int | None]:
        return (self.type, self.major, self.minor)

    def __str__(self) -> str:
        """The v1 devices.allow / devices.list form: ``c 1:3 rwm``, ``a *:* rwm``."""
        # Interned: every slot's applied state keeps its rules as text, nearly all of them the
        # same default set, so each slot held its own copies of the same few strings.
        return sys.intern(f"{self.type} {_num(self.major)}:{_num(self.minor)} {self.access}")

    @classmethod
    def parse(cls, text: str) -> DeviceRule:
        """Parse ``"c 1:3 rw"`` (the v1 devices.list form); ``*`` is any number."""
        try:
            dev_type, numbers, access = text.split()
            major, minor = numbers.split(":")
        except ValueError:
            raise InvalidRequest(f"cannot parse device rule {text!r}; expected e.g. 'c 1:3 rwm'") from None
        return cls(dev_type, _parse_num(major), _parse_num(minor), access)


ALLOW_ALL = DeviceRule("a", None, None, "rwm")


def _num(value: int | None) -> str:
    return "*" if value is None else str(value)


def _parse_num(text: str) -> int | None:
    if text == "*":
        return None
    try:
        return int(text)
    except ValueError:
        raise InvalidRequest(f"device number must be an integer or '*', got {text!r}") from None


def normalize(rules: Iterable[DeviceRule]) -> frozenset[DeviceRule]:
    """Merge rules for the same device into one with the union of their access (as the v1 kernel does)."""
    merged: dict[tuple[str, int | None, int | None], str] = {}
    for rule in rules:
        merged[rule.key] = merged.get(rule.key, "") + rule.access
    if ALLOW_ALL.key in merged and set(merged[ALLOW_ALL.key]) == set(_ACCESS_ORDER):
        return frozenset({ALLOW_ALL})
    return frozenset(DeviceRule(t, ma, mi, access) for (t, ma, mi), access in merged.items())


def parse_devices_list(text: str) -> frozenset[DeviceRule]:
    """A v1 devices.list: one rule per line; ``a *:* rwm`` alone means "everything allowed"."""
    return normalize(DeviceRule.parse(line) for line in text.splitlines() if line.strip())


@dataclass(frozen=True)
class V1DevicePlan:
    """The writes that turn a v1 devices cgroup's list into the wanted one, in order."""

    deny_all_first: bool
    allow_all: bool
    deny: tuple[DeviceRule, ...]
    allow: tuple[DeviceRule, ...]

    def writes(self) -> list[tuple[str, str]]:
        """(file, value) pairs to write in this order."""
        if self.allow_all:
            return [("devices.allow", "a")]
        out: list[tuple[str, str]] = [("devices.deny", "a")] if self.deny_all_first else []
        out += [("devices.deny", str(rule)) for rule in self.deny]
        out += [("devices.allow", str(rule)) for rule in self.allow]
        return out


def plan_v1(current: frozenset[DeviceRule], wanted: Iterable[DeviceRule]) -> V1DevicePlan:
    """The minimal diff from ``current`` (devices.list) to the allow-list ``wanted``."""
    target = normalize(wanted)
    if target == {ALLOW_ALL}:
        return V1DevicePlan(False, current != {ALLOW_ALL}, (), ())
    if ALLOW_ALL in current:
        # Default-allow cannot be narrowed rule by rule: switch to default-deny, then allow.
        return V1DevicePlan(True, False, (), tuple(sorted(target, key=_sort_key)))
    return V1DevicePlan(
        False,
        False,
        tuple(sorted(current - target, key=_sort_key)),
        tuple(sorted(target - current, key=_sort_key)),
    )


def _sort_key(rule: DeviceRule) -> tuple[str, int, int, str]:
    major = -1 if rule.major is None else rule.major
    minor = -1 if rule.minor is None else rule.minor
    return (rule.type, major, minor, rule.access)
