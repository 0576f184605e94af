"""What a slot is given: an :class:`Assignment` of CPUs, memory and devices, and its JSON form."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nodeagent.cpulist import format_cpulist
from nodeagent.errors import InvalidRequest
from nodeagent.schema.request import MILLI


@dataclass(frozen=True, slots=True)
class MigAssignment:
    gpu_index: int
    uuid: str | None
    gpu_instance_id: int
    compute_instance_id: int | None
    profile: str

    @property
    def key(self) -> str:
        return mig_key(self.gpu_index, self.uuid, self.gpu_instance_id, self.compute_instance_id)


@dataclass(frozen=True, slots=True)
class GpuShare:
    gpu_index: int
    millis: int  #: thousandths of the GPU


@dataclass(frozen=True, slots=True)
class DeviceAssignment:
    path: str
    exclusive: bool


@dataclass(frozen=True, slots=True)
class Assignment:
    name: str
    qos: str
    cpus: tuple[int, ...]  #: exclusive CPUs, or the shared pool when the plan was made
    exclusive: bool
    cpu_quota_millis: int
    numa_nodes: tuple[int, ...]
    memory_bytes: int
    memory_by_node: Mapping[int, int]  #: empty: memory not bound to a node
    gpus: tuple[int, ...] = ()
    gpu_uuids: tuple[str | None, ...] = ()
    mig: tuple[MigAssignment, ...] = ()
    gpu_shares: tuple[GpuShare, ...] = ()
    fpgas: tuple[str, ...] = ()
    devices: tuple[DeviceAssignment, ...] = ()
    reasons: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "qos": self.qos,
            "cpus": list(self.cpus),
            "cpuset": format_cpulist(self.cpus),
            "exclusive": self.exclusive,
            "cpu_quota": self.cpu_quota_millis / MILLI,
            "numa_nodes": list(self.numa_nodes),
            "memory_bytes": self.memory_bytes,
            "memory_bytes_by_node": {str(k): v for k, v in sorted(self.memory_by_node.items())},
            "gpus": list(self.gpus),
            "gpu_uuids": list(self.gpu_uuids),
            "mig": [
                {
                    "gpu_index": m.gpu_index,
                    "uuid": m.uuid,
                    "gpu_instance_id": m.gpu_instance_id,
                    "compute_instance_id": m.compute_instance_id,
                    "profile": m.profile,
                }
                for m in self.mig
            ],
            "gpu_shares": [{"gpu_index": s.gpu_index, "share": s.millis / MILLI} for s in self.gpu_shares],
            "fpgas": list(self.fpgas),
            "devices": [{"path": d.path, "exclusive": d.exclusive} for d in self.devices],
            "reasons": list(self.reasons),
        }

    @classmethod
    def from_dict(cls, obj: Any) -> Assignment:
        """Read back :meth:`to_dict` (as stored in the state database); InvalidRequest if malformed."""
        try:
            return cls(
                name=str(obj["name"]),
                qos=str(obj["qos"]),
                cpus=tuple(int(c) for c in obj["cpus"]),
                exclusive=bool(obj["exclusive"]),
                cpu_quota_millis=round(float(obj["cpu_quota"]) * MILLI),
                numa_nodes=tuple(int(n) for n in obj["numa_nodes"]),
                memory_bytes=int(obj["memory_bytes"]),
                memory_by_node={int(k): int(v) for k, v in obj["memory_bytes_by_node"].items()},
                gpus=tuple(int(g) for g in obj["gpus"]),
                gpu_uuids=tuple(None if u is None else str(u) for u in obj["gpu_uuids"]),
                mig=tuple(
                    MigAssignment(
                        gpu_index=int(m["gpu_index"]),
                        uuid=m["uuid"],
                        gpu_instance_id=int(m["gpu_instance_id"]),
                        compute_instance_id=m["compute_instance_id"],
                        profile=str(m["profile"]),
                    )
                    for m in obj["mig"]
                ),
                gpu_shares=tuple(
                    GpuShare(int(s["gpu_index"]), round(float(s["share"]) * MILLI)) for s in obj["gpu_shares"]
                ),
                fpgas=tuple(str(f) for f in obj["fpgas"]),
                devices=tuple(DeviceAssignment(str(d["path"]), bool(d["exclusive"])) for d in obj["devices"]),
                reasons=tuple(str(r) for r in obj.get("reasons", ())),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise InvalidRequest(f"assignment: malformed JSON ({type(err).__name__}: {err})") from err


def mig_key(gpu_index: int, uuid: str | None, gi: int, ci: int | None) -> str:
    """How the ledger names a MIG instance: its UUID, else gpu:gi:ci."""
    return uuid if uuid is not None else f"{gpu_index}:{gi}:{ci}"
