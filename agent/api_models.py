"""The REST API's response models (pydantic): what the OpenAPI document says each answer holds.
The request models are the schema room's (``nodeagent.schema``); the routes are agent/api.py's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class EndpointModel(BaseModel):
    name: str = Field(description='The port\'s name: "http", "grpc", "metrics", "management", ...')
    protocol: Literal["http", "grpc", "tcp"]
    address: str
    port: int


class SlotModel(BaseModel):
    id: str
    name: str
    qos: str
    state: Literal["pending", "ready", "running", "releasing", "failed", "standby"] = Field(
        description="standby: a warm pool's standby, frozen (listed only with ?standby=true and under "
        "its pool)."
    )
    request: dict[str, Any]
    assignment: dict[str, Any] | None = Field(
        description="Which CPUs, NUMA nodes, memory and devices it got."
    )
    cgroup: str | None
    network: dict[str, Any] | None
    worker: dict[str, Any] | None = Field(description="phase, pid, restarts, last exit, message")
    sandbox: dict[str, Any] | None = Field(
        default=None,
        description="The uid and gid the slot's sandboxed workers run as (its own, from [sandbox] "
        "uid_range); null before its first worker, or without a sandbox.",
    )
    reason: str | None = Field(description="Why it failed, when state is failed.")
    created_at: float
    updated_at: float
    foreign_cpu: dict[str, Any] | None = Field(
        default=None,
        description=(
            "Guaranteed slots: CPU time spent on the slot's CPUs by anything that is not the slot "
            "(other tasks, kernel threads, interrupts), since `since` (Unix time): `seconds`, "
            "`fraction` of the slot's CPU capacity over that time, `irq_seconds` of it handling "
            "interrupts. Null where it cannot be measured."
        ),
    )
    qos_actions: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Recent actions of the QoS loop on this slot, newest last (at most 20): action "
        "(cpu_suppress, cpu_release, slot_cpu_quota, memory_throttle, memory_unthrottle, evict, restore, "
        "resctrl_narrow, resctrl_wide), "
        "reason, at (unix time), seq, and the values written (cpus, quota_cpus, memory_high, memory_bytes).",
    )
    qos_evicted: bool = Field(
        default=False,
        description="Its worker is stopped by the QoS loop (memory pressure) and starts again once memory "
        "is calm.",
    )
    endpoints: list[EndpointModel] = Field(
        default_factory=list,
        description="Where its worker serves: one per named port the slot holds (its worker's preset's "
        "and its own `ports`), kept while the slot exists. `address` is where the agent reaches it: the "
        "slot's own address when it has a network namespace, else 127.0.0.1 (the worker is on the "
        "host's network: the node's addresses reach it).",
    )
    pool: str | None = Field(
        default=None,
        description="The warm pool this slot is a standby of (named pool.<pool>.<suffix>); null once a "
        "claim took it, and for every other slot.",
    )


class SlotListModel(BaseModel):
    slots: list[SlotModel]


class LogEntryModel(BaseModel):
    time: str = Field(description='When the keeper read it (RFC 3339, UTC, ns); "" for the agent\'s word.')
    stream: Literal["stdout", "stderr", "agent"]
    text: str


class LogsModel(BaseModel):
    id: str
    lines: list[str]
    entries: list[LogEntryModel] = Field(
        default_factory=list, description="The same lines with their stream and time, for programs."
    )


class CdiDeviceModel(BaseModel):
    name: str = Field(description="The slot's name or id: --device nodeagent.io/slot=<name>.")
    containerEdits: dict[str, Any] = Field(
        description="Device nodes, environment and mounts a runtime adds to the container."
    )


class CdiSpecModel(BaseModel):
    """A Container Device Interface spec, as the CDI specification defines it (docs/containers.md)."""

    cdiVersion: str = Field(description="The oldest CDI version the spec is valid against.")
    kind: str = Field(description='Always "nodeagent.io/slot".')
    devices: list[CdiDeviceModel]


class NodeModel(BaseModel):
    node_id: str
    hostname: str
    agent_version: str
    started_at: float
    cgroup_mode: str
    degraded: list[str] = Field(description="What this agent cannot isolate on this host, and why.")
    host_partitioning: dict[str, Any] | None = Field(
        default=None,
        description=(
            "Whether the rest of the host is kept off exclusive CPUs (`mode`: auto or off), which "
            "`parts` (processes, kernel-threads, workqueue, irqs), whether it is `active`, and the "
            "`last` pass: exclusive and host CPUs, items `moved` and `confined` by kind, what is "
            "`immovable` and why, `problems`, `warnings`; `error` if the last pass failed."
        ),
    )
    sandbox: dict[str, Any] | None = Field(
        default=None,
        description="The workers' sandbox: enabled (configuration), active (in force here), support (what "
        "this kernel offers: namespaces, seccomp filter, hidepid, mount_setattr), uid_range, allow_root, "
        "cgroup_view.",
    )
    integrations: dict[str, list[str]] = Field(
        default_factory=dict,
        description="Each Kubernetes integration that is on (`device_plugin`, `node_resource_topology`) "
        "and what keeps it from working now (an empty list: it works).",
    )


class ErrorDetail(BaseModel):
    code: str
    message: str


class ErrorModel(BaseModel):
    error: ErrorDetail


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorModel} for status in statuses}


class PoolStandbyModel(BaseModel):
    id: str
    name: str
    state: str = Field(
        description="standby (frozen, ready to be taken), or pending/ready/running while it starts"
    )
    numa_nodes: list[int]
    worker: dict[str, Any] | None
    created_at: float


class PoolModel(BaseModel):
    name: str
    size: int
    priority: int
    slot: dict[str, Any] = Field(description="The shape of the pool's slots and the worker its standbys run.")
    created_at: float
    ready: int = Field(description="Frozen standbys, ready to be taken.")
    starting: int = Field(description="Standbys starting (their worker not ready yet).")
    memory_bytes: int = Field(description="Memory the standbys hold.")
    problem: str | None = Field(description="Why the pool is not filling, when it is paused.")
    claims: int = Field(description="Slots taken from a standby since the agent started.")
    cold_claims: int = Field(description="Claims that fell back to a cold start since the agent started.")
    standbys: list[PoolStandbyModel]


class PoolListModel(BaseModel):
    pools: list[PoolModel]
