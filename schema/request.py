"""What a slot asks for: :class:`SlotRequest`, the one definition of the request.

The same models give the REST API its validation and its OpenAPI document, and the daemon its
value checks (``parse_slot_request`` for JSON from anywhere else: the state database,
``nodeagent plan --request``). Placement reads the normalised amounts (``cpu_millis``,
``memory_bytes``, ...) and can trust them: unknown fields, wrong types, negative, huge or
non-finite numbers and malformed quantities never get this far.

JSON form: ``{"name", "qos", "resources": {...}, "worker": WorkerSpec}``; amounts are accepted as
numbers or strings ("4Gi", "500m") and written back as numbers (:func:`request_to_dict`).
"""

from __future__ import annotations

import re
import weakref
from typing import TYPE_CHECKING, Annotated, Any, Literal

import orjson
from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    PlainSerializer,
    ValidationError,
    WithJsonSchema,
    create_model,
    model_validator,
)

from nodeagent.errors import InvalidRequest
from nodeagent.schema.messages import invalid_request
from nodeagent.schema.quantity import (
    MAX_BYTES,
    MILLI,
    MILLIS_PATTERN,
    QUANTITY_PATTERN,
    format_quantity,
    format_quantity_short,
    milli_number,
    parse_milli,
    parse_quantity,
    shown,
)
from nodeagent.schema.strict import AsTuple, StrictModel
from nodeagent.schema.worker import WorkerSpec

QoS = Literal["guaranteed", "burstable", "best-effort"]
QOS_CLASSES: tuple[QoS, ...] = ("guaranteed", "burstable", "best-effort")
NumaPolicy = Literal["single", "prefer", "none"]
NUMA_POLICIES: tuple[NumaPolicy, ...] = ("single", "prefer", "none")

#: A slot name becomes a cgroup directory and a netns name later: keep it a safe identifier.
NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
#: The form of the ids the agent gives slots ("s" and 12 hex digits). Names of this form are
#: refused: an id and a name are looked up alike (GET/DELETE /v1/slots/<id or name>), and a slot
#: named like another's id would make that other slot's id name this one.
SLOT_ID_FORM = re.compile(r"s[0-9a-f]{12}")
_DEVICE_PATH = re.compile(r"/dev/[A-Za-z0-9._+-]+(?:/[A-Za-z0-9._+-]+)*")

MAX_CPUS = 16384
MAX_DEVICES = 1024
MAX_MEMORY_BYTES = MAX_BYTES
MAX_BANDWIDTH_MBIT = 10_000_000
MAX_HOST_PORTS = 64
#: Best-effort priorities: higher is more important (suppressed later, evicted last).
MIN_PRIORITY, MAX_PRIORITY, DEFAULT_PRIORITY = 0, 1000, 0


# --------------------------------------------------------------------------- field types


def _slot_name(value: str) -> str:
    if NAME_PATTERN.fullmatch(value) is None:
        raise ValueError(
            f"{shown(value)} is not a safe identifier; use 1-63 characters of a-z, 0-9, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    if SLOT_ID_FORM.fullmatch(value) is not None:
        raise ValueError(
            f"{shown(value)} has the form of a slot id ('s' and 12 hex digits), which the agent gives "
            "slots; ids and names are looked up alike, so choose a name of another form"
        )
    return value


def _amount_json(maximum: int) -> WithJsonSchema:
    return WithJsonSchema(
        {
            "oneOf": [
                {"type": "number", "minimum": 0, "maximum": maximum},
                {"type": "string", "pattern": MILLIS_PATTERN},
            ]
        }
    )


#: Amounts with up to three decimals, taken as a number or a millis string ("500m") and held as a
#: float that is an exact number of thousandths; written back as a plain number.
_AS_NUMBER = PlainSerializer(lambda value: milli_number(round(value * MILLI)), return_type=float)
CpuAmount = Annotated[
    float,
    BeforeValidator(lambda value: parse_milli(value, maximum=MAX_CPUS) / MILLI),
    _AS_NUMBER,
    _amount_json(MAX_CPUS),
]
GpuShareAmount = Annotated[
    float, BeforeValidator(lambda value: parse_milli(value, maximum=1) / MILLI), _AS_NUMBER, _amount_json(1)
]


def _device_path(value: str) -> str:
    if not _DEVICE_PATH.fullmatch(value) or "/../" in value + "/":
        raise ValueError(f"must be a device path under /dev such as /dev/fuse, got {shown(value)}")
    return value


def _numa(value: Any) -> Any:
    return "prefer" if value is None else value


SlotName = Annotated[
    str,
    AfterValidator(_slot_name),
    Field(
        description="1-63 characters of a-z, 0-9, '.', '_' or '-', starting with a letter or digit, and "
        "not of the form of a slot id ('s' and 12 hex digits); unique on the node, and the idempotency key.",
        json_schema_extra={"pattern": f"^{NAME_PATTERN.pattern}$", "maxLength": 63},
        examples=["llm-a"],
    ),
]
Bytes = Annotated[
    int,
    BeforeValidator(parse_quantity),
    WithJsonSchema(
        {
            "description": 'Bytes, or a quantity such as "512Mi", "4Gi", "1G".',
            "oneOf": [
                # The largest multiple of 1024 below 2^63: exact as a double too, so generators
                # that pass the bound through a float stay inside it.
                {"type": "integer", "minimum": 0, "maximum": MAX_BYTES - 1023},
                {"type": "string", "pattern": QUANTITY_PATTERN},
            ],
        }
    ),
]
DeviceCount = Annotated[int, Field(ge=0, le=MAX_DEVICES)]
_DEVICE_PATH_JSON = {"type": "string", "pattern": "^(?!.*/\\.\\.(/|$))/dev(/[A-Za-z0-9._+-]+)+$"}
DevicePath = Annotated[str, AfterValidator(_device_path), WithJsonSchema(_DEVICE_PATH_JSON)]


# --------------------------------------------------------------------------- models


class HostPort(StrictModel):
    """A port on the host that the slot may connect to."""

    port: Annotated[int, Field(ge=1, le=65535)] = Field(description="The port number on the host.")
    protocol: Literal["tcp", "udp"] = "tcp"


class NetworkRequest(StrictModel):
    """A network namespace of the slot's own. It reaches nothing but replies to connections opened
    into it (the agent's probes), unless ``egress`` or ``host_ports`` say otherwise."""

    bandwidth_mbit: Annotated[int, Field(ge=1, le=MAX_BANDWIDTH_MBIT)] | None = Field(
        default=None, description="Egress shaping of the slot's network namespace, in Mbit/s."
    )
    egress: Literal["none", "nat"] = Field(
        default="none",
        description="none: nothing beyond the host; nat: connections to anywhere beyond the host "
        "(never other slots, the host itself or link-local 169.254.0.0/16), masqueraded behind the "
        "host's address. IPv4 only.",
    )
    host_ports: Annotated[tuple[HostPort, ...], AsTuple, Field(max_length=MAX_HOST_PORTS)] = Field(
        default=(),
        description="Ports on the host the slot may connect to (a model store, a metrics gateway), "
        "at its gateway address or any other host address; IPv4 only.",
    )

    @model_validator(mode="after")
    def _ports_once(self) -> NetworkRequest:
        seen = [f"{p.protocol} port {p.port}" for p in self.host_ports]
        twice = sorted({s for s in seen if seen.count(s) > 1})
        if twice:
            raise ValueError(f"host_ports lists {', '.join(twice)} more than once; list each port once")
        return self


class Resources(StrictModel):
    """What a slot asks for. Omitted fields take their defaults."""

    cpus: CpuAmount = Field(
        default=0.0,
        description="CPUs. Guaranteed slots: a whole number of exclusive CPUs (whole physical cores). "
        'Burstable and best-effort: a quota on the shared pool, with up to 3 decimals or "500m".',
    )
    memory: Bytes = Field(
        default=0,
        description="Memory limit: required for guaranteed and burstable slots; left out of a best-effort "
        "slot, it has no limit of its own (what others leave). An explicit 0 is refused.",
    )
    gpus: DeviceCount = Field(default=0, description="Whole GPUs, or MIG instances when gpu_profile is set.")
    gpu_profile: Annotated[str, Field(min_length=1, max_length=64)] | None = Field(
        default=None, description='A MIG profile such as "1g.10gb"; alone it means one instance.'
    )
    gpu_share: GpuShareAmount = Field(
        default=0.0,
        description="A fraction of one shareable GPU (0 to 1); not combined with gpus or gpu_profile.",
    )
    fpgas: DeviceCount = 0
    devices: Annotated[
        tuple[DevicePath, ...],
        AsTuple,
        Field(max_length=MAX_DEVICES),
        WithJsonSchema(
            {"type": "array", "items": _DEVICE_PATH_JSON, "maxItems": MAX_DEVICES, "uniqueItems": True}
        ),
    ] = Field(
        default=(),
        description="Device paths under /dev the slot may use (they must be in the agent's allow-list).",
    )
    numa: Annotated[NumaPolicy, BeforeValidator(_numa)] = Field(
        default="prefer",
        description="single: CPUs, memory and devices on one NUMA node (or refuse); prefer (default): "
        "one node when possible; none: anywhere.",
    )
    network: NetworkRequest | None = Field(default=None, description="null: no network namespace of its own.")
    l3: Annotated[float, Field(gt=0, le=1)] | None = Field(
        default=None, description="A share of the L3 cache (resctrl), above 0 and at most 1."
    )

    @model_validator(mode="before")
    @classmethod
    def _profile_means_one_instance(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("gpu_profile") is not None and not data.get("gpus"):
            return {**data, "gpus": 1}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Resources:
        if self.gpu_share and (self.gpus or self.gpu_profile):
            raise ValueError(
                "gpu_share cannot be combined with gpus or gpu_profile; ask for a share of one GPU, "
                "or for whole GPUs / MIG instances"
            )
        if len(set(self.devices)) != len(self.devices):
            raise ValueError("devices lists a path twice; list each device once")
        return self

    # --- normalised amounts, as placement counts them

    @property
    def cpu_millis(self) -> int:
        """CPUs in thousandths; whole CPUs (a multiple of 1000) for guaranteed slots."""
        return round(self.cpus * MILLI)

    @property
    def whole_cpus(self) -> int:
        return self.cpu_millis // MILLI

    @property
    def memory_bytes(self) -> int:
        return self.memory

    @property
    def gpu_share_millis(self) -> int:
        return round(self.gpu_share * MILLI)

    @property
    def l3_share(self) -> float | None:
        return self.l3


class SlotRequest(StrictModel):
    """A slot request. ``name`` is unique on the node and is the idempotency key."""

    name: SlotName
    qos: QoS = Field(
        description="guaranteed: exclusive whole cores; burstable: a quota on the shared pool; "
        "best-effort: what is left over, yielding to everything else."
    )
    resources: Resources = Field(default_factory=Resources)
    priority: Annotated[int, Field(ge=MIN_PRIORITY, le=MAX_PRIORITY)] = Field(
        default=DEFAULT_PRIORITY,
        description="Best-effort slots only: 0 (default) to 1000, higher is more important. Under CPU "
        "suppression higher priorities get best-effort's CPU first; under memory pressure the lowest "
        "priority (then the most recently allocated slot) is evicted first and the highest restored "
        "first. Fixed for the slot's life.",
    )
    worker: WorkerSpec | None = Field(default=None, description="The worker to launch in the slot.")

    @model_validator(mode="after")
    def _priority_orders_best_effort(self) -> SlotRequest:
        if self.priority != DEFAULT_PRIORITY and self.qos != "best-effort":
            raise ValueError(
                f"priority is {self.priority} for a {self.qos} slot; priority orders best-effort slots only "
                "(online slots are never suppressed or evicted), so leave it out or use qos best-effort"
            )
        return self

    @model_validator(mode="after")
    def _guaranteed_cpus(self) -> SlotRequest:
        millis = self.resources.cpu_millis
        if self.qos == "guaranteed" and (millis == 0 or millis % MILLI):
            raise ValueError(
                f"resources.cpus is {millis / MILLI:g} for a guaranteed slot; guaranteed slots get exclusive "
                "CPUs, so ask for a whole number of at least 1 (or use qos burstable for a fractional quota)"
            )
        return self

    @property
    def guaranteed(self) -> bool:
        return self.qos == "guaranteed"


class ResourceChanges(StrictModel):
    """A resize: any subset of a slot's resources; the others keep their values. The fields are
    Resources' own, each optional (:data:`ResourcesPatch`), so each is checked as it is there."""

    def changes(self) -> dict[str, Any]:
        """The fields the client sent, in their JSON form (the merged request is validated as a whole)."""
        return self.model_dump(mode="json", exclude_unset=True)


if TYPE_CHECKING:  # a model built at run time; type checkers see its base
    ResourcesPatch = ResourceChanges
else:
    ResourcesPatch = create_model(
        "ResourcesPatch",
        __base__=ResourceChanges,
        __doc__=ResourceChanges.__doc__,
        **{
            name: (info.rebuild_annotation() | None, Field(default=None, description=info.description))
            for name, info in Resources.model_fields.items()
        },
    )


class Resize(StrictModel):
    """The body of a resize (PATCH /v1/slots/{id})."""

    resources: ResourcesPatch


# --------------------------------------------------------------------------- JSON in and out


def parse_slot_request(obj: Any) -> SlotRequest:
    """Check decoded JSON and build a SlotRequest; InvalidRequest names each bad field."""
    try:
        return SlotRequest.model_validate(obj)
    except ValidationError as err:
        raise invalid_request(err, SlotRequest, "request") from None


def request_to_dict(request: SlotRequest) -> dict[str, Any]:
    """The JSON form: every resource spelled out, the worker as the client gave it.
    ``parse_slot_request(request_to_dict(r)) == r``.

    A request is frozen, and a stored one is the same object from one listing of the slots to the
    next: its form is dumped once and remembered as JSON text for as long as the request lives
    (two pydantic dumps per slot were a third of GET /v1/slots at 500 slots, issue 23). Each call
    still returns objects of its own, which callers may change (orjson parses the text ~5x faster
    than the dumps)."""
    remembered = _DUMPED.get(id(request))
    if remembered is not None and remembered() is request:
        body: dict[str, Any] = orjson.loads(remembered.text)
        return body
    body = request.model_dump(mode="json", exclude={"worker"})
    if request.worker is not None:
        body["worker"] = request.worker.model_dump(mode="json", exclude_unset=True)
    _remember(request, body)
    return body


class _Dumped(weakref.ref[SlotRequest]):
    """A remembered request, weakly, with its JSON text: one object per stored slot, whose
    callback is the module's one function (a closure per request cost ~200 bytes more)."""

    __slots__ = ("key", "text")
    key: int
    text: bytes


#: id(request) -> the request, weakly, with its JSON form. The weak reference's callback drops the
#: entry when the request goes, before its id can name another object.
_DUMPED: dict[int, _Dumped] = {}


def _forget(ref: _Dumped) -> None:
    if _DUMPED.get(ref.key) is ref:
        del _DUMPED[ref.key]


def _remember(request: SlotRequest, body: dict[str, Any]) -> None:
    try:
        dumped = orjson.dumps(body)
    except TypeError:  # orjson's limits (integers past 64 bits): dumped again each time instead
        return
    # orjson's result keeps the buffer it wrote into (4 KiB at least, whatever the text's length):
    # a copy of the text is ~300 bytes, and 500 slots keep one each.
    text = bytes(memoryview(dumped))
    remembered = _Dumped(request, _forget)
    remembered.key = id(request)
    remembered.text = text
    _DUMPED[remembered.key] = remembered


#: What a client's explicit ``memory: 0`` would mean, and why it is refused.
ZERO_MEMORY = (
    "resources.memory: 0 is not a limit (it would leave the slot's memory unlimited); give a size, "
    "or leave memory out of a best-effort slot to have it bounded only by what others leave"
)


def check_client_request(request: SlotRequest) -> None:
    """What only a client's own words can get wrong (stored requests spell every default out):
    an explicit ``memory: 0``."""
    if "memory" in request.resources.model_fields_set and request.resources.memory == 0:
        raise InvalidRequest(ZERO_MEMORY)


def apply_patch(request: SlotRequest, patch: ResourceChanges) -> SlotRequest:
    """``request`` with the resources ``patch`` names changed; InvalidRequest if the result is not valid."""
    if patch.changes().get("memory") == 0:
        raise InvalidRequest(ZERO_MEMORY)
    body = request_to_dict(request)
    body["resources"] = {**body["resources"], **patch.changes()}
    return parse_slot_request(body)


__all__ = [
    "MAX_BANDWIDTH_MBIT",
    "MAX_CPUS",
    "MAX_DEVICES",
    "MAX_HOST_PORTS",
    "MAX_MEMORY_BYTES",
    "MAX_PRIORITY",
    "MILLI",
    "MIN_PRIORITY",
    "NAME_PATTERN",
    "NUMA_POLICIES",
    "QOS_CLASSES",
    "HostPort",
    "NetworkRequest",
    "NumaPolicy",
    "QoS",
    "Resize",
    "ResourceChanges",
    "Resources",
    "ResourcesPatch",
    "SlotRequest",
    "apply_patch",
    "check_client_request",
    "format_quantity",
    "format_quantity_short",
    "parse_quantity",
    "parse_slot_request",
    "request_to_dict",
]
