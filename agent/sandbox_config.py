"""``[sandbox]`` of the agent's configuration (docs/configuration.md#sandbox): plain data and its
checks. Apart from agent/sandbox.py, which applies it, so that reading the configuration (every CLI
command does) imports nothing heavy: the checks import the sandbox's tables only when they run.
"""

from __future__ import annotations

from dataclasses import dataclass

from nodeagent.errors import ConfigError

#: systemd's DynamicUser range (61184-65519) is too small for a host of slots and may be in use;
#: this one is above the usual login and container ranges and below 2^31.
DEFAULT_UID_RANGE = "600000-665535"
CGROUP_VIEWS = ("read-only", "namespace")
_MIN_DYNAMIC_UID = 1000
_MAX_UID = 2**31 - 1


@dataclass(frozen=True)
class SandboxConfig:
    """``[sandbox]``: every key is documented in docs/configuration.md."""

    #: false switches the sandbox off for this host (unsafe: workers then run as the agent's
    #: user, root, with every capability, unless their request names another).
    enabled: bool = True
    #: uids (and gids of the same numbers) the agent gives slots, one each: "FIRST-LAST".
    uid_range: str = DEFAULT_UID_RANGE
    #: How long a released slot's uid rests before another slot gets it (what it left in a
    #: world-writable place is not handed over at once).
    uid_quarantine_seconds: float = 3600.0
    #: Whether a request may run its worker as root (worker.user 0 or "root").
    allow_root: bool = False
    #: Whether a request may name a host user or groups (worker.user, group, supplementary_groups).
    allow_named_users: bool = False
    #: Syscalls denied by the default seccomp profile that a request may ask for (allow_syscalls).
    allowed_syscalls: tuple[str, ...] = ()
    #: Capabilities a request may keep (worker.sandbox.capabilities).
    allowed_capabilities: tuple[str, ...] = ()
    #: Whether a request may turn the seccomp filter off (worker.sandbox.seccomp "unconfined").
    allow_unconfined_seccomp: bool = False
    #: Default sizes of the private /tmp and /dev/shm (a request may set its own).
    tmp_size: str = "256Mi"
    shm_size: str = "64Mi"
    #: Default size of the worker's HOME (a tmpfs of its own; a request may set its own).
    home_size: str = "256Mi"
    #: "read-only": the host's /sys/fs/cgroup, read-only; "namespace": only the slot's own subtree.
    cgroup_view: str = "read-only"
    #: More host paths to hide from every worker (the state directory and tokens always are).
    hide_paths: tuple[str, ...] = ()

    def uid_bounds(self) -> tuple[int, int]:
        first, sep, last = self.uid_range.partition("-")
        if not sep or not first.strip().isdigit() or not last.strip().isdigit():
            raise ConfigError(
                f"sandbox.uid_range is {self.uid_range!r}; expected FIRST-LAST, e.g. {DEFAULT_UID_RANGE}"
            )
        low, high = int(first), int(last)
        if not _MIN_DYNAMIC_UID <= low <= high <= _MAX_UID:
            raise ConfigError(
                f"sandbox.uid_range is {self.uid_range!r}; expected {_MIN_DYNAMIC_UID} <= FIRST <= LAST "
                f"<= {_MAX_UID} (below 1000 are the host's system users)"
            )
        return low, high

    def check(self) -> None:
        """ConfigError naming the key of the first bad value."""
        # The sandbox's tables, only when a configuration is checked (the CLI reads it for every
        # command); none of them imports pydantic or the launch path.
        from nodeagent.runtime.sandbox.caps import CAPABILITY_NAMES, NEVER_FOR_ROOT  # noqa: PLC0415
        from nodeagent.runtime.sandbox.paths import lexical  # noqa: PLC0415
        from nodeagent.runtime.sandbox.seccomp import restricted_syscalls  # noqa: PLC0415
        from nodeagent.schema.quantity import parse_quantity  # noqa: PLC0415

        self.uid_bounds()
        restricted = restricted_syscalls("default")
        for name in self.allowed_syscalls:
            if name not in restricted:
                raise ConfigError(
                    f"sandbox.allowed_syscalls: {name!r} is not denied by the default seccomp profile; "
                    f"list only calls it denies: {', '.join(sorted(restricted))}"
                )
        for name in self.allowed_capabilities:
            bare = name.upper().removeprefix("CAP_")
            if bare not in CAPABILITY_NAMES:
                raise ConfigError(f"sandbox.allowed_capabilities: unknown capability {name!r}")
            if bare in NEVER_FOR_ROOT:
                raise ConfigError(
                    f"sandbox.allowed_capabilities: {bare} undoes the slot as a boundary and is never "
                    f"given to a worker (never: {', '.join(NEVER_FOR_ROOT)})"
                )
        if not 0 <= self.uid_quarantine_seconds <= 31_536_000:
            raise ConfigError(
                f"sandbox.uid_quarantine_seconds is {self.uid_quarantine_seconds!r}; expected 0 (no rest) "
                "to 31536000 (a year)"
            )
        for key in ("tmp_size", "shm_size", "home_size"):
            try:
                size = parse_quantity(getattr(self, key))
            except ValueError as err:
                raise ConfigError(f"sandbox.{key}: {err}") from None
            if size < 4096:
                raise ConfigError(
                    f"sandbox.{key} is {getattr(self, key)!r}; a tmpfs needs at least 4096 bytes"
                )
        if self.cgroup_view not in CGROUP_VIEWS:
            raise ConfigError(
                f"sandbox.cgroup_view is {self.cgroup_view!r}; expected one of {', '.join(CGROUP_VIEWS)}"
            )
        for path in self.hide_paths:
            if not path.startswith("/") or lexical(path) != path or path == "/":
                raise ConfigError(
                    f"sandbox.hide_paths: {path!r} must be a normalised absolute path other than /"
                )


__all__ = ["CGROUP_VIEWS", "DEFAULT_UID_RANGE", "SandboxConfig"]
