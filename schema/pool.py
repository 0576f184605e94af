"""Warm standby pools (docs/pools.md): what a pool is (:class:`PoolSpec`) and what an allocate that
takes a slot from one says (:class:`PoolClaim`).

A pool keeps ``size`` standby workers of one worker spec started, ready (their readiness probe
passed) and then frozen, each in a standby slot that already has its uid, sandbox, ports, cgroups
and network namespace. An allocate naming the pool takes one: the slot is placed then (exclusive
cores, NUMA node, limits), the standby's cgroup gets that placement, it is thawed and answers at
once. The slot shape is the pool's: its workers sized their thread counts for it when they
started, so a claim that asks for another shape is refused (or cold-started when it says so).

JSON form of a pool: ``{"name", "size", "slot": {"qos", "resources", "priority", "worker"}}``.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, ValidationError, model_validator

from nodeagent.schema.messages import invalid_request
from nodeagent.schema.request import NAME_PATTERN, QoS, Resources, SlotName, SlotRequest
from nodeagent.schema.strict import StrictModel
from nodeagent.schema.worker import WorkerSpec

#: Standby slots are named ``pool.<pool>.<6 hex digits>``: a name clients may not give their slots.
STANDBY_NAME = re.compile(r"pool\.([a-z0-9][a-z0-9_-]{0,47})\.([0-9a-f]{6})")
#: A pool's name: short enough that its standbys' names are slot names too.
POOL_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,47}")
#: Standbys a pool may keep: each is a started worker holding its memory.
MAX_POOL_SIZE = 64


def _pool_name(value: str) -> str:
    if not POOL_NAME.fullmatch(value):
        raise ValueError(
            f"{value!r} is not a pool name: use 1 to 48 lower-case letters, digits, '-' or '_', "
            "starting with a letter or digit"
        )
    return value


PoolName = Annotated[
    str, AfterValidator(_pool_name), Field(json_schema_extra={"pattern": f"^{POOL_NAME.pattern}$"})
]


def is_standby_name(name: str) -> bool:
    """Whether ``name`` has the form of a standby slot's name (refused for clients' slots)."""
    return STANDBY_NAME.fullmatch(name) is not None


def standby_pool(name: str) -> str | None:
    """The pool a standby slot of this name belongs to; None for any other name."""
    if not name.startswith("pool."):
        return None  # most names, asked every second of every slot: no regular expression
    found = STANDBY_NAME.fullmatch(name)
    return None if found is None else found.group(1)


def standby_name(pool: str, suffix: str) -> str:
    name = f"pool.{pool}.{suffix}"
    assert STANDBY_NAME.fullmatch(name), name
    assert NAME_PATTERN.fullmatch(name), name
    return name


class PoolSlot(StrictModel):
    """The shape of the pool's slots and the worker each standby runs (a slot request without a name)."""

    qos: QoS
    resources: Resources = Field(default_factory=Resources)
    priority: int = 0
    worker: WorkerSpec = Field(description="The worker every standby runs: a preset or any command.")


class PoolSpec(StrictModel):
    """A warm standby pool (``POST /v1/pools``)."""

    name: PoolName
    size: Annotated[int, Field(ge=0, le=MAX_POOL_SIZE)] = Field(
        description="How many standby workers to keep started, ready and frozen."
    )
    slot: PoolSlot
    priority: Annotated[int, Field(ge=-1000, le=1000)] = Field(
        default=0,
        description="When an allocate needs the memory standbys hold, pools of lower priority give "
        "their standbys up first.",
    )

    @model_validator(mode="after")
    def _poolable(self) -> PoolSpec:
        self.request("pool-check")  # the slot request rules (guaranteed whole CPUs, ...) hold
        res = self.slot.resources
        if res.gpus or res.gpu_share or res.fpgas or res.devices:
            raise ValueError(
                "slot.resources asks for devices (GPUs, FPGAs or device paths); pools of slots with "
                "devices are not supported yet: allocate such slots without a pool"
            )
        if res.network is not None and res.network.host_ports:
            raise ValueError(
                "slot.resources.network.host_ports names fixed host ports, which only one standby could "
                "hold; leave them out (each standby gets its own ports from the worker's named ports)"
            )
        if self.slot.worker.readiness is None and self.slot.worker.preset is None:
            raise ValueError(
                "slot.worker has no readiness probe: a standby is frozen once its probe passes, so give "
                "worker.readiness (or a preset, which brings its own)"
            )
        if self.slot.worker.container is not None:
            raise ValueError("slot.worker.container: pools of container workers are not supported yet")
        if self.slot.qos != "burstable" and not res.memory:
            raise ValueError(
                "slot.resources.memory is missing: a standby holds its memory while frozen, so a pool's "
                "slots need a memory size"
            )
        return self

    def request(self, name: str) -> SlotRequest:
        """The slot request a claim from this pool amounts to, named ``name``."""
        body = self.slot.model_dump(mode="json", exclude_unset=True, exclude={"worker"})
        return SlotRequest.model_validate({**body, "name": name, "worker": self.slot.worker}, strict=False)

    def standby_request(self, name: str) -> SlotRequest:
        """What a standby slot is while it waits: a burstable slot on the shared pool with the
        pool's memory and NUMA policy and no CPU quota (it runs only while it starts, at the
        default weight, never on an exclusive core; frozen, it takes no CPU)."""
        res = self.slot.resources
        return SlotRequest.model_validate(
            {
                "name": name,
                "qos": "burstable",
                "resources": {"memory": res.memory, "numa": res.numa, "network": res.network},
                "worker": self.slot.worker,
            },
            strict=False,
        )


class PoolResize(StrictModel):
    """The body of ``PATCH /v1/pools/{name}``."""

    size: Annotated[int, Field(ge=0, le=MAX_POOL_SIZE)]


class PoolClaim(StrictModel):
    """An allocate that takes a standby from a pool (``POST /v1/slots`` with ``pool``)."""

    name: SlotName
    pool: PoolName
    fallback: Literal["none", "cold"] = Field(
        default="none",
        description="none: no standby ready means the allocate fails; cold: start the pool's worker in a "
        "new slot instead (its whole start time).",
    )
    #: Optional, and must then be the pool's: the shape its standbys were started for.
    qos: QoS | None = None
    resources: Resources | None = None


def parse_pool_spec(obj: Any) -> PoolSpec:
    try:
        return PoolSpec.model_validate(obj)
    except ValidationError as err:
        raise invalid_request(err, PoolSpec, "pool") from None


__all__ = [
    "MAX_POOL_SIZE",
    "PoolClaim",
    "PoolName",
    "PoolResize",
    "PoolSlot",
    "PoolSpec",
    "is_standby_name",
    "parse_pool_spec",
    "standby_name",
    "standby_pool",
]
