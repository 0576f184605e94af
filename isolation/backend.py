"""The isolation side as the agent's slot manager sees it.

:class:`IsolationBackend` is the seam (the manager's tests plug a fake in). Two implementations:

- :class:`KernelIsolation`: the real one, :class:`~nodeagent.isolation.isolator.SlotIsolator` on this
  host's cgroups. The isolator keeps the shared pool right by itself (it cuts the pool before an
  exclusive slot gets its CPUs and grows it after a release), so the manager never has to.
- :class:`NoIsolation`: the stand-in when this host cannot isolate (no root, no writable cgroups).
  ``degraded`` says why; slots are bookkeeping only and ``apply`` builds nothing (None).

Every method is idempotent: start-up reconciliation calls them again after a crash.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

from nodeagent.cgroups import open_manager
from nodeagent.errors import NodeAgentError, Unsupported
from nodeagent.isolation.isolator import AppliedSlot, Frozen, OwnedSlot, SlotIsolator
from nodeagent.isolation.qos import QosClassName
from nodeagent.isolation.slot_spec import SlotIsolationSpec


class IsolationBackend(Protocol):
    @property
    def cgroup_mode(self) -> str: ...

    @property
    def isolates(self) -> bool:
        """Whether slots get kernel isolation at all (False: bookkeeping only)."""
        ...

    def degraded(self) -> tuple[str, ...]:
        """What this host cannot isolate, and why (empty when everything works). Not empty does not
        mean nothing is isolated: a host may lack one mechanism only (see :attr:`isolates`)."""
        ...

    def prepare(self) -> None:
        """Create the agent's parent objects (cgroup parents, the shared pool)."""
        ...

    def apply(self, spec: SlotIsolationSpec) -> AppliedSlot | None:
        """Create or correct the slot's kernel objects; what was built (None: nothing, unisolated)."""
        ...

    def exists(self, applied: AppliedSlot) -> bool:
        """Whether the slot's cgroup is still there."""
        ...

    def release(self, slot_id: str) -> None:
        """Kill what runs in the slot and remove its objects; missing objects are fine."""
        ...

    def remove_orphans(self, keep: Collection[str]) -> list[str]:
        """Remove our objects that belong to no slot id in ``keep``; say what went."""
        ...

    def owned_slots(self) -> list[OwnedSlot]:
        """Every slot cgroup under the agent's parent, with the processes in it."""
        ...

    def freeze(self, slot_id: str, qos: QosClassName) -> None:
        """Freeze the slot's processes (returns once the kernel says they are)."""
        ...

    def thaw(self, slot_id: str, qos: QosClassName) -> None: ...

    def frozen(self, slot_id: str, qos: QosClassName) -> Frozen:
        """How a standby's cgroup stands: gone, empty (its worker died), thawed or frozen."""
        ...

    def change_class(self, spec: SlotIsolationSpec, from_qos: QosClassName) -> AppliedSlot | None:
        """Build the slot as ``spec`` says in its (other) QoS class and move its processes there."""
        ...


class KernelIsolation:
    """:class:`IsolationBackend` over a :class:`SlotIsolator`."""

    def __init__(self, isolator: SlotIsolator, *, extra_degraded: Sequence[str] = ()) -> None:
        self.isolator = isolator
        self._extra_degraded = tuple(extra_degraded)
        self._firewall_failure: tuple[str, ...] = ()

    @property
    def cgroup_mode(self) -> str:
        return self.isolator.host.mode

    @property
    def isolates(self) -> bool:
        return self.isolator.host.can_write

    def degraded(self) -> tuple[str, ...]:
        host = self.isolator.host
        reasons = [*self._extra_degraded, *self.isolator.degraded(), *self._firewall_failure]
        if not host.can_write:
            reasons.insert(
                0, f"cgroups (mode {host.mode}) are not writable: no CPU, memory or device isolation"
            )
        return tuple(reasons)

    def prepare(self) -> None:
        self.isolator.ensure_hierarchy()
        try:
            self.isolator.ensure_firewall()
        except NodeAgentError as err:
            # Availability first: the agent still serves, and says why network slots will fail.
            self._firewall_failure = (f"network filtering: the firewall table could not be set up: {err}",)
        else:
            self._firewall_failure = ()

    def apply(self, spec: SlotIsolationSpec) -> AppliedSlot:
        return self.isolator.apply(spec)

    def exists(self, applied: AppliedSlot) -> bool:
        return open_manager(self.isolator.host, applied.cgroup).exists()

    def release(self, slot_id: str) -> None:
        self.isolator.release(slot_id)

    def owned_slots(self) -> list[OwnedSlot]:
        return self.isolator.owned_slots()

    def freeze(self, slot_id: str, qos: QosClassName) -> None:
        self.isolator.freeze(slot_id, qos)

    def thaw(self, slot_id: str, qos: QosClassName) -> None:
        self.isolator.thaw(slot_id, qos)

    def frozen(self, slot_id: str, qos: QosClassName) -> Frozen:
        return self.isolator.frozen(slot_id, qos)

    def change_class(self, spec: SlotIsolationSpec, from_qos: QosClassName) -> AppliedSlot:
        return self.isolator.change_class(spec, from_qos)

    def remove_orphans(self, keep: Collection[str]) -> list[str]:
        removed = self.isolator.remove_orphans(keep)
        return (
            [f"cgroup {path}" for path in removed.cgroups.values()]
            + [f"netns {name}" for name in removed.network.netns]
            + [f"veth {name}" for name in removed.network.host_veths]
            + [f"firewall opt-ins of {name}" for name in removed.network.firewall_ifnames]
            + [f"resctrl group {name}" for name in removed.resctrl_groups]
        )


class NoIsolation:
    """:class:`IsolationBackend` of a host that cannot isolate: bookkeeping only, workers run unconfined."""

    def __init__(self, reasons: Sequence[str], cgroup_mode: str = "none") -> None:
        self._reasons = tuple(reasons)
        self._mode = cgroup_mode

    @property
    def cgroup_mode(self) -> str:
        return self._mode

    @property
    def isolates(self) -> bool:
        return False

    def degraded(self) -> tuple[str, ...]:
        return self._reasons

    def prepare(self) -> None:
        return None

    def apply(self, spec: SlotIsolationSpec) -> None:
        return None

    def freeze(self, slot_id: str, qos: QosClassName) -> None:
        raise Unsupported("this agent cannot freeze slots (no writable cgroups); warm pools need it")

    def thaw(self, slot_id: str, qos: QosClassName) -> None:
        return None

    def frozen(self, slot_id: str, qos: QosClassName) -> Frozen:
        return "gone"

    def change_class(self, spec: SlotIsolationSpec, from_qos: QosClassName) -> None:
        return None

    def exists(self, applied: AppliedSlot) -> bool:
        return True

    def release(self, slot_id: str) -> None:
        return None

    def remove_orphans(self, keep: Collection[str]) -> list[str]:
        return []

    def owned_slots(self) -> list[OwnedSlot]:
        return []


__all__ = ["IsolationBackend", "KernelIsolation", "NoIsolation", "OwnedSlot"]
