"""What the NRI shim (kube/nri-shim) sends the agent about a container, and what it gets back.

The shim forwards containerd's NRI events as these shapes, holding no state and making no
decisions; the agent (``nodeagent.agent.nri``) turns a container into a slot request and the slot
into the adjustment the runtime applies. Only the fields the agent needs travel: the pod's
identity, its QoS class or cgroup parent (the kubelet's class is in the path), the container's
Linux resources as the kubelet computed them, the device nodes the runtime gives it (from the
kubelet's device plugins and CDI), and the pod's ``nodeagent.io/`` annotations.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field

from nodeagent.schema.strict import AsTuple, StrictModel

#: containerd's ids are 64 hex digits; allow any runtime's safe identifier.
CONTAINER_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
MAX_CONTAINERS = 4096
MAX_ANNOTATIONS = 256
MAX_DEVICES = 1024

Text = Annotated[str, Field(max_length=253)]


class PodRef(StrictModel):
    uid: Text = ""
    namespace: Text = ""
    name: Text = ""
    #: the kubelet's QoS class ("Guaranteed", "Burstable", "BestEffort"), when the shim knows it
    qos_class: Text = ""
    #: the pod's cgroup parent (kubepods/burstable/pod<uid>, kubepods-besteffort-pod<uid>.slice, ...)
    cgroup_parent: Annotated[str, Field(max_length=4096)] = ""
    #: the pod's annotations under nodeagent.io/ (others may be sent; they are ignored)
    annotations: Annotated[
        dict[str, Annotated[str, Field(max_length=4096)]], Field(max_length=MAX_ANNOTATIONS)
    ] = Field(default_factory=dict)


class LinuxResources(StrictModel):
    """The container's Linux resources as the kubelet set them (0 or absent: not set)."""

    cpu_shares: Annotated[int, Field(ge=0, le=1 << 40)] = 0
    cpu_quota: Annotated[int, Field(ge=-1, le=1 << 50)] = 0  #: -1 or 0: no quota
    cpu_period: Annotated[int, Field(ge=0, le=1 << 40)] = 0
    memory_limit: Annotated[int, Field(ge=-1, le=1 << 62)] = 0  #: -1 or 0: no limit


class LinuxDevice(StrictModel):
    """A device node of the container's spec: its path inside the container, its type ("c", "b")
    and numbers (the host's node, whatever the path)."""

    path: Annotated[str, Field(max_length=4096)] = ""
    type: Annotated[str, Field(max_length=1)] = ""
    major: Annotated[int, Field(ge=-1, le=1 << 32)] = 0
    minor: Annotated[int, Field(ge=-1, le=1 << 32)] = 0


class NriContainer(StrictModel):
    """One container as the shim sees it (CreateContainer, or one of Synchronize's list)."""

    id: Annotated[str, Field(pattern=f"^{CONTAINER_ID_PATTERN.pattern}$")]
    name: Text = ""
    pod: PodRef = Field(default_factory=PodRef)
    resources: LinuxResources = Field(default_factory=LinuxResources)
    devices: Annotated[tuple[LinuxDevice, ...], AsTuple, Field(max_length=MAX_DEVICES)] = ()


class NriSynchronize(StrictModel):
    """Every container the runtime has (Synchronize at plugin registration)."""

    containers: Annotated[tuple[NriContainer, ...], AsTuple, Field(max_length=MAX_CONTAINERS)] = ()


class NriUpdate(StrictModel):
    """A change to a container the runtime already runs (NRI's ContainerUpdate): a shared
    container's cpuset following the shared pool as guaranteed slots come and go."""

    container_id: str
    cpuset_cpus: str = ""
    cpuset_mems: str = ""


class NriAdjustment(StrictModel):
    """What the runtime is to apply to the container ("" / 0: leave as the kubelet set it).

    A guaranteed container that took CPUs from the shared pool also carries ``updates``: the other
    shared containers' cpusets without those CPUs, which the shim returns with CreateContainer so
    the runtime applies them before the new container starts."""

    container_id: str
    slot_id: str
    slot_name: str
    qos: str
    cpuset_cpus: str = ""
    cpuset_mems: str = ""
    memory_limit: int = 0
    updates: tuple[NriUpdate, ...] = ()
    #: the shared pool the answer follows (as GET /v1/nri/updates gives it)
    pool_version: str = ""


class NriUpdates(StrictModel):
    """GET /v1/nri/updates: every shared container's cpuset for the pool as it is now.

    ``version`` names that pool; a shim that passes it back is answered when the pool differs
    (or at the end of its wait, with no updates)."""

    version: str
    updates: tuple[NriUpdate, ...] = ()


class NriSyncResult(StrictModel):
    """Synchronize's answer: adjustments for the containers the agent holds slots for, and what it
    did: slots kept, made, released, and containers it could not place (with the reason)."""

    updates: tuple[NriAdjustment, ...] = ()
    released: tuple[str, ...] = ()  #: slot names released because their container is gone
    refused: dict[str, str] = Field(default_factory=dict)  #: container id -> why it has no slot


__all__ = [
    "CONTAINER_ID_PATTERN",
    "LinuxDevice",
    "LinuxResources",
    "NriAdjustment",
    "NriContainer",
    "NriSyncResult",
    "NriSynchronize",
    "NriUpdate",
    "NriUpdates",
    "PodRef",
]
