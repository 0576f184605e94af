"""What a slot asks for: :class:`SlotRequest` and its strict parser.

The request arrives as decoded JSON (REST body, ``nodeagent plan --request``). Everything is checked
here, once, so placement can trust its input: unknown fields, wrong types, negative, huge or
non-finite numbers and malformed quantities are refused with an InvalidRequest that names the field.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from nodeagent.errors import InvalidRequest

QOS_CLASSES = ("guaranteed", "burstable", "best-effort")
NUMA_POLICIES = ("single", "prefer", "none")

#: A slot name becomes a cgroup directory and a netns name later: keep it a safe identifier.
NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")

MAX_CPUS = 16384
MAX_DEVICES = 1024
MAX_MEMORY_BYTES = 2**63 - 1
MAX_BANDWIDTH_MBIT = 10_000_000
#: CPU quotas and GPU shares are kept in thousandths, like kubelet's millicores, so sums stay exact.
MILLI = 1000

_UNITS = {
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
_QUANTITY = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kKMGTPE]i?)?\s*")
_DEVICE_PATH = re.compile(r"/dev/[A-Za-z0-9._+-]+(?:/[A-Za-z0-9._+-]+)*")

_TOP_FIELDS = ("name", "qos", "resources", "worker")
_RESOURCE_FIELDS = (
    "cpus",
    "memory",
    "gpus",
    "gpu_profile",
    "gpu_share",
    "fpgas",
    "devices",
    "numa",
    "network",
    "l3",
)


@dataclass(frozen=True, slots=True)
class NetworkRequest:
    bandwidth_mbit: int | None = None


@dataclass(frozen=True, slots=True)
class Resources:
    cpu_millis: int = 0  #: CPUs in thousandths; whole CPUs (a multiple of 1000) for guaranteed slots
    memory_bytes: int = 0
    gpus: int = 0  #: whole GPUs, or MIG instances when ``gpu_profile`` is set
    gpu_profile: str | None = None
    gpu_share_millis: int = 0  #: a fraction of one shareable GPU, in thousandths
    fpgas: int = 0
    devices: tuple[str, ...] = ()
    numa: str = "prefer"
    network: NetworkRequest | None = None
    l3_share: float | None = None

    @property
    def cpus(self) -> float:
        return self.cpu_millis / MILLI

    @property
    def whole_cpus(self) -> int:
        return self.cpu_millis // MILLI

    @property
    def gpu_share(self) -> float:
        return self.gpu_share_millis / MILLI


@dataclass(frozen=True)
class SlotRequest:
    name: str
    qos: str
    resources: Resources
    #: The worker to launch; validated by the runtime, carried here untouched.
    worker: Mapping[str, Any] | None = None

    @property
    def guaranteed(self) -> bool:
        return self.qos == "guaranteed"


# --------------------------------------------------------------------------- quantities


def parse_quantity(value: Any, field: str = "memory") -> int:
    """Bytes from an integer or a string such as ``"4Gi"``, ``"512Mi"``, ``"1G"`` or ``"1.5Gi"``."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise _bad(field, 'a byte count or a quantity string such as "4Gi"', value)
    if isinstance(value, int):
        amount = value
    else:
        match = _QUANTITY.fullmatch(value)
        if match is None:
            raise InvalidRequest(
                f"request: {field} {value!r} is not a quantity; use bytes or a number with a unit "
                f"such as 512Mi, 4Gi or 1G (units: {', '.join(u for u in _UNITS if u)})"
            )
        try:
            exact = Decimal(match.group(1)) * _UNITS[match.group(2) or ""]
        except InvalidOperation:  # pragma: no cover - the pattern admits only plain decimals
            raise _bad(field, "a quantity", value) from None
        if exact != exact.to_integral_value():
            raise InvalidRequest(f"request: {field} {value!r} is not a whole number of bytes")
        amount = int(exact)
    if amount < 0 or amount > MAX_MEMORY_BYTES:
        raise InvalidRequest(f"request: {field} {_shown(value)} is out of range; it must be 0 to 8Ei bytes")
    return amount


def format_quantity(nbytes: int) -> str:
    """The shortest exact binary form: 4294967296 -> "4Gi", 1000 -> "1000"."""
    for unit in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        size = _UNITS[unit]
        if nbytes and nbytes % size == 0:
            return f"{nbytes // size}{unit}"
    return str(nbytes)


def format_quantity_short(nbytes: int) -> str:
    """For people: the exact form when it is short ("512Mi"), else one decimal ("6.6Gi")."""
    exact = format_quantity(nbytes)
    if len(exact) <= 6:
        return exact
    for unit in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        if nbytes >= _UNITS[unit]:
            return f"{nbytes / _UNITS[unit]:.1f}{unit}"
    return exact


def parse_milli(value: Any, field: str, *, maximum: int) -> int:
    """A non-negative amount with up to three decimals (or ``"500m"``), in thousandths."""
    if isinstance(value, str) and value.endswith("m") and value[:-1].isdigit():
        millis = int(value[:-1])
    elif isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise _bad(field, "a finite number", value)
        if value < 0 or value > maximum:  # before scaling: 1e308 * 1000 is no longer a number
            raise _out_of_range(field, value, maximum)
        millis = round(value * MILLI)
        if abs(value * MILLI - millis) > 1e-6:
            raise InvalidRequest(
                f"request: {field} {value!r} has more than three decimals; round it to 0.001"
            )
    else:
        raise _bad(field, 'a number (or a millis string such as "500m")', value)
    if millis < 0 or millis > maximum * MILLI:
        raise _out_of_range(field, value, maximum)
    return millis


def _out_of_range(field: str, value: Any, maximum: int) -> InvalidRequest:
    return InvalidRequest(f"request: {field} {_shown(value)} is out of range; it must be 0 to {maximum}")


# --------------------------------------------------------------------------- parsing


def parse_slot_request(obj: Any) -> SlotRequest:
    """Check decoded JSON and build a SlotRequest; InvalidRequest names the first bad field."""
    top = _object(obj, "request")
    _no_unknown(top, _TOP_FIELDS, "")
    name = _name(top.get("name"))
    qos = top.get("qos")
    if qos not in QOS_CLASSES:
        raise _bad("qos", "one of " + " | ".join(QOS_CLASSES), qos)
    resources = _resources(top.get("resources", {}), qos)
    worker = top.get("worker")
    if worker is not None and not isinstance(worker, dict):
        raise _bad("worker", "an object (a WorkerSpec) or null", worker)
    return SlotRequest(name=name, qos=qos, resources=resources, worker=worker)


def _resources(obj: Any, qos: str) -> Resources:
    res = _object(obj, "resources")
    _no_unknown(res, _RESOURCE_FIELDS, "resources.")
    cpu_millis = parse_milli(res.get("cpus", 0), "resources.cpus", maximum=MAX_CPUS)
    if qos == "guaranteed" and (cpu_millis == 0 or cpu_millis % MILLI):
        raise InvalidRequest(
            f"request: resources.cpus is {cpu_millis / MILLI:g} for a guaranteed slot; guaranteed "
            "slots get exclusive CPUs, so ask for a whole number of at least 1 "
            "(or use qos burstable for a fractional quota)"
        )
    memory = parse_quantity(res.get("memory", 0), "resources.memory")
    gpus = _count(res, "gpus")
    profile = _optional_string(res, "gpu_profile")
    share = parse_milli(res.get("gpu_share", 0), "resources.gpu_share", maximum=1)
    if profile is not None and gpus == 0:
        gpus = 1  # a profile alone means one instance of it
    if share and (gpus or profile):
        raise InvalidRequest(
            "request: resources.gpu_share cannot be combined with gpus or gpu_profile; "
            "ask for a share of one GPU, or for whole GPUs / MIG instances"
        )
    return Resources(
        cpu_millis=cpu_millis,
        memory_bytes=memory,
        gpus=gpus,
        gpu_profile=profile,
        gpu_share_millis=share,
        fpgas=_count(res, "fpgas"),
        devices=_devices(res.get("devices", [])),
        numa=_choice(res, "numa", NUMA_POLICIES) or "prefer",
        network=_network(res.get("network")),
        l3_share=_l3(res.get("l3")),
    )


def _name(value: Any) -> str:
    if value is None:
        raise InvalidRequest("request: name is missing; give the slot a unique name such as 'llm-a'")
    if not isinstance(value, str) or NAME_PATTERN.fullmatch(value) is None:
        raise InvalidRequest(
            f"request: name {_shown(value)} is not a safe identifier; use 1-63 characters of a-z, 0-9, "
            "'.', '_' or '-', starting with a letter or digit"
        )
    return value


def _count(res: Mapping[str, Any], key: str) -> int:
    value = res.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_DEVICES:
        raise _bad(f"resources.{key}", f"a whole number from 0 to {MAX_DEVICES}", value)
    return value


def _optional_string(res: Mapping[str, Any], key: str) -> str | None:
    value = res.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > 64:
        raise _bad(f"resources.{key}", 'a non-empty string such as "1g.10gb"', value)
    return value


def _devices(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > MAX_DEVICES:
        raise _bad("resources.devices", f"a list of at most {MAX_DEVICES} device paths", value)
    for i, path in enumerate(value):
        if not isinstance(path, str) or not _DEVICE_PATH.fullmatch(path) or "/../" in path + "/":
            raise _bad(f"resources.devices[{i}]", "a device path under /dev such as /dev/fuse", path)
    if len(set(value)) != len(value):
        raise InvalidRequest("request: resources.devices lists a path twice; list each device once")
    return tuple(value)


def _network(value: Any) -> NetworkRequest | None:
    if value is None:
        return None
    net = _object(value, "resources.network")
    _no_unknown(net, ("bandwidth_mbit",), "resources.network.")
    bw = net.get("bandwidth_mbit")
    if bw is not None and (
        isinstance(bw, bool) or not isinstance(bw, int) or not 1 <= bw <= MAX_BANDWIDTH_MBIT
    ):
        raise _bad("resources.network.bandwidth_mbit", f"a whole number from 1 to {MAX_BANDWIDTH_MBIT}", bw)
    return NetworkRequest(bandwidth_mbit=bw)


def _l3(value: Any) -> float | None:
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not 0 < value <= 1
    ):
        raise _bad("resources.l3", "a share of the L3 cache above 0 and at most 1", value)
    return float(value)


def _choice(res: Mapping[str, Any], key: str, allowed: tuple[str, ...]) -> str | None:
    value = res.get(key)
    if value is None:
        return None
    if value not in allowed:
        raise _bad(f"resources.{key}", "one of " + " | ".join(allowed), value)
    return str(value)


def _object(obj: Any, where: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise _bad(where, "an object", obj)
    return obj


def _no_unknown(obj: Mapping[str, Any], known: tuple[str, ...], prefix: str) -> None:
    for key in obj:
        if key not in known:
            raise InvalidRequest(
                f"request: unknown field {prefix}{key}; known fields: {', '.join(prefix + k for k in known)}"
            )


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _bad(field: str, expected: str, got: Any) -> InvalidRequest:
    return InvalidRequest(f"request: {field} must be {expected}, got {_shown(got)}")


# --------------------------------------------------------------------------- JSON out


def _number(millis: int) -> int | float:
    return millis // MILLI if millis % MILLI == 0 else millis / MILLI


def request_to_dict(request: SlotRequest) -> dict[str, Any]:
    """The JSON form; ``parse_slot_request(request_to_dict(r)) == r``."""
    res = request.resources
    resources: dict[str, Any] = {
        "cpus": _number(res.cpu_millis),
        "memory": res.memory_bytes,
        "gpus": res.gpus,
        "gpu_profile": res.gpu_profile,
        "gpu_share": _number(res.gpu_share_millis),
        "fpgas": res.fpgas,
        "devices": list(res.devices),
        "numa": res.numa,
        "network": None if res.network is None else {"bandwidth_mbit": res.network.bandwidth_mbit},
        "l3": res.l3_share,
    }
    out: dict[str, Any] = {"name": request.name, "qos": request.qos, "resources": resources}
    if request.worker is not None:
        out["worker"] = dict(request.worker)
    return out
