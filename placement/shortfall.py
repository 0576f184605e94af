"""What a request needs (:class:`Demand`) and the words of a refusal when the host falls short.

A refusal says what was asked, what each NUMA node has free of it, and what to do, so that an
operator can act on it without reading the code; tests hold these messages word for word.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from nodeagent.cpulist import format_cpulist
from nodeagent.errors import PlacementError
from nodeagent.placement.bitset import ids_of
from nodeagent.placement.index import PlacementIndex, UsableCpus
from nodeagent.placement.ledger import FreeDevices
from nodeagent.schema.request import SlotRequest, format_quantity


@dataclass(frozen=True, slots=True)
class Demand:
    cpus: int  #: exclusive CPUs (guaranteed) or pool CPUs needed on the node (others, policy single)
    memory: int
    gpus: int
    mig: int
    share: int
    fpgas: int

    def describe(self, request: SlotRequest) -> str:
        parts = []
        if self.cpus:
            parts.append(f"{self.cpus} exclusive CPUs" if request.guaranteed else f"{self.cpus} shared CPUs")
        if self.memory:
            parts.append(f"{format_quantity(self.memory)} memory")
        if self.gpus:
            parts.append(plural(self.gpus, "GPU"))
        if self.mig:
            parts.append(plural(self.mig, "MIG instance") + f" of profile {request.resources.gpu_profile}")
        if self.share:
            parts.append(f"a {request.resources.gpu_share:g} share of a GPU")
        if self.fpgas:
            parts.append(plural(self.fpgas, "FPGA"))
        return ", ".join(parts) or "nothing"

    @property
    def cpu_only(self) -> bool:
        return not any((self.memory, self.gpus, self.mig, self.share, self.fpgas))


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


class Supply(Protocol):
    """What the planner knows of one decision that a refusal reports."""

    index: PlacementIndex
    usable: UsableCpus
    request: SlotRequest
    demand: Demand
    cpus: dict[int, int]  #: free CPUs per node for this request
    floating: FreeDevices  #: free devices on no known node

    def devices(self, node: int | None) -> FreeDevices: ...

    def memory(self, node: int) -> int: ...


def single_node_shortfall(supply: Supply) -> PlacementError:
    """No one node holds everything (``numa: single``)."""
    name, d = supply.request.name, supply.demand
    if d.cpu_only and supply.request.guaranteed:
        best = max(supply.index.node_ids, key=lambda n: (supply.cpus[n], -n))
        return PlacementError(
            f"slot {name!r}: need {d.cpus} exclusive CPUs on one NUMA node; the largest free set is "
            f"{supply.cpus[best]}, on node {best} ({_free_by_node(supply)}); "
            "ask for fewer CPUs, use numa prefer, or release a slot"
        )
    return PlacementError(
        f"slot {name!r}: need {d.describe(supply.request)} on one NUMA node; no node has all of it "
        f"({_free_by_node(supply)}{_floating_note(supply)}); "
        "ask for less, use numa prefer, or release a slot"
    )


def host_shortfall(supply: Supply) -> PlacementError:
    """Even all nodes together do not hold it."""
    reserved = ids_of(supply.usable.reserved)
    note = (
        f"; CPUs {format_cpulist(reserved)} are reserved for the system"
        if reserved and supply.demand.cpus
        else ""
    )
    return PlacementError(
        f"slot {supply.request.name!r}: need {supply.demand.describe(supply.request)}; the host does not "
        f"have that much free ({_free_by_node(supply)}{_floating_note(supply)}){note}; "
        "ask for less or release a slot"
    )


def _free_by_node(supply: Supply) -> str:
    d = supply.demand
    parts: list[str] = []
    empty: list[int] = []
    for n in supply.index.node_ids:
        s = supply.devices(n)
        have = []
        if d.cpus:
            have.append(f"{supply.cpus[n]} CPUs")
        if d.memory:
            have.append(f"{format_quantity(supply.memory(n))} memory")
        if d.gpus:
            have.append(plural(len(s.gpus), "GPU"))
        if d.mig:
            have.append(plural(len(s.mig), "MIG instance"))
        if d.share:
            have.append(plural(len(s.shares), "shareable GPU"))
        if d.fpgas:
            have.append(plural(len(s.fpgas), "FPGA"))
        if any(not h.startswith("0 ") for h in have):
            parts.append(f"node {n}: " + ", ".join(have))
        else:
            empty.append(n)
    if empty:
        parts.append(f"node{'s' if len(empty) > 1 else ''} {format_cpulist(empty)}: nothing free")
    return "; ".join(parts)


def _floating_note(supply: Supply) -> str:
    fl, d = supply.floating, supply.demand
    count = (
        (len(fl.gpus) if d.gpus else 0) + (len(fl.mig) if d.mig else 0) + (len(fl.fpgas) if d.fpgas else 0)
    )
    return f"; {count} more on no known node" if count else ""
