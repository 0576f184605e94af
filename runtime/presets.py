"""Presets: how to run and probe the servers the runtime knows (Triton, TorchServe, TF Serving, a
generic Open Inference Protocol server).

A spec names a preset; :func:`resolve` fills in the command and the probes the spec leaves out, so
the spec's own values always win, and binds the worker's named ports (the preset's and the spec's,
:func:`wanted_ports`) to the host ports its slot holds. The supervisor runs the resolved spec.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from nodeagent.errors import InvalidRequest
from nodeagent.runtime.ports import DEFAULT_PORT_RANGE, PortWant, bind, default_protocol
from nodeagent.schema.worker import (
    OIP_LIVE_PATH,
    OIP_READY_PATH,
    PRESET_NAMES,
    HttpCheck,
    PortProtocol,
    Probe,
    WorkerSpec,
)


@dataclass(frozen=True)
class PresetPort:
    """A port the server has: its name, protocol and the server's own default number. ``fixed``: the
    preset cannot tell the server another number, so the worker asks for the default itself."""

    name: str
    protocol: PortProtocol
    default: int
    fixed: bool = False


@dataclass(frozen=True)
class Preset:
    """How to run and probe one kind of server. ``{port:NAME}``, ``{model}`` and ``{repo}`` are
    filled in."""

    command: tuple[str, ...]
    ports: tuple[PresetPort, ...]
    #: Readiness path when the model is known, and when it is not.
    model_ready_path: str
    server_ready_path: str
    live_path: str


PRESETS: dict[str, Preset] = {
    "triton": Preset(
        command=(
            "tritonserver",
            "--model-repository={repo}",
            "--http-port={port:http}",
            "--grpc-port={port:grpc}",
            "--metrics-port={port:metrics}",
        ),
        ports=(
            PresetPort("http", "http", 8000),
            PresetPort("grpc", "grpc", 8001),
            PresetPort("metrics", "http", 8002),
        ),
        model_ready_path="/v2/models/{model}/ready",
        server_ready_path=OIP_READY_PATH,
        live_path=OIP_LIVE_PATH,
    ),
    "torchserve": Preset(
        # TorchServe's own inference API answers /ping; its KServe v2 front end is opt-in. Its ports
        # come from a config.properties file only, which this preset does not write: they are
        # TorchServe's defaults, asked for as such (a second TorchServe on the host is refused).
        command=(
            "torchserve",
            "--foreground",
            "--model-store={repo}",
            "--models={model}={model}.mar",
            "--disable-token-auth",
        ),
        ports=(
            PresetPort("http", "http", 8080, fixed=True),
            PresetPort("management", "http", 8081, fixed=True),
            PresetPort("metrics", "http", 8082, fixed=True),
        ),
        model_ready_path="/ping",
        server_ready_path="/ping",
        live_path="/ping",
    ),
    "tfserving": Preset(
        command=(
            "tensorflow_model_server",
            "--port={port:grpc}",
            "--rest_api_port={port:http}",
            "--model_name={model}",
            "--model_base_path={repo}/{model}",
        ),
        ports=(PresetPort("grpc", "grpc", 8500), PresetPort("http", "http", 8501)),
        model_ready_path="/v1/models/{model}",
        server_ready_path="/v1/models/{model}",
        live_path="/v1/models/{model}",
    ),
    "generic": Preset(
        # The spec's own command; its http port is the spec's `port` or `ports.http`.
        command=(),
        ports=(),
        model_ready_path="/v2/models/{model}/ready",
        server_ready_path=OIP_READY_PATH,
        live_path=OIP_LIVE_PATH,
    ),
}
assert set(PRESETS) == set(PRESET_NAMES), "every preset the schema names is defined here"


def _fill(template: str, spec: WorkerSpec) -> str:
    if "{model}" in template and spec.model_name is None:
        raise InvalidRequest(
            f"worker spec: model_name is missing; preset {spec.preset!r} needs the model's name"
        )
    if "{repo}" in template and spec.model_repository is None:
        raise InvalidRequest(
            f"worker spec: model_repository is missing; preset {spec.preset!r} needs the path of the "
            "model repository"
        )
    return template.replace("{model}", spec.model_name or "").replace("{repo}", spec.model_repository or "")


def wanted_ports(spec: WorkerSpec) -> dict[str, PortWant]:
    """The worker's named ports: its preset's, then the spec's own (which win, name by name)."""
    wants: dict[str, PortWant] = {}
    if spec.preset is not None:
        for p in PRESETS[spec.preset].ports:
            wants[p.name] = PortWant(p.name, p.protocol, p.default if p.fixed else None)
        if spec.port is not None:
            http = wants.get("http")
            wants["http"] = PortWant("http", http.protocol if http else "http", spec.port)
    for name, asked in spec.ports.items():
        base = wants.get(name)
        protocol = asked.protocol or (base.protocol if base else default_protocol(name))
        number = asked.port if asked.port is not None else (base.port if base is not None else None)
        wants[name] = PortWant(name, protocol, number)
    return wants


def preview_ports(spec: WorkerSpec) -> dict[str, int]:
    """Numbers for checking a spec before the agent assigns its ports: the one asked for, else the
    server's own default, else a stand-in from the default range."""
    defaults = {p.name: p.default for p in PRESETS[spec.preset].ports} if spec.preset else {}
    stand_in = int(DEFAULT_PORT_RANGE.split("-")[0])
    return {
        name: want.port or defaults.get(name) or stand_in + i
        for i, (name, want) in enumerate(sorted(wanted_ports(spec).items()))
    }


def resolve(spec: WorkerSpec, ports: Mapping[str, int] | None = None) -> WorkerSpec:
    """The spec as the runtime runs it: the preset's command and probes where the spec has none, and
    every port filled in (``ports``: name -> host port, as the slot holds them; None: check the spec
    with :func:`preview_ports`). InvalidRequest when the preset needs a field the spec lacks, or
    something refers to a port the worker does not have."""
    numbers = preview_ports(spec) if ports is None else dict(ports)
    missing = sorted(set(wanted_ports(spec)) - set(numbers))
    if missing:
        raise InvalidRequest(f"worker spec: no host port for {', '.join(missing)}")  # an agent bug
    if spec.preset is None:
        return bind(spec, numbers)
    preset = PRESETS[spec.preset]
    command = spec.command or tuple(_fill(arg, spec) for arg in preset.command)
    if "http" not in numbers:
        # A generic command without an http port cannot be probed over HTTP; leave probes as given.
        return bind(spec.model_copy(update={"command": command}), numbers)
    ready_template = preset.model_ready_path if spec.model_name else preset.server_ready_path
    readiness = spec.readiness or Probe(
        http=HttpCheck(port="http", path=_fill(ready_template, spec)), period_seconds=2.0
    )
    liveness = spec.liveness or Probe(
        http=HttpCheck(port="http", path=_fill(preset.live_path, spec)),
        period_seconds=10.0,
        # Model servers load weights before they answer; do not kill them for being slow to start.
        initial_delay_seconds=30.0,
    )
    update = {"command": command, "port": numbers["http"], "readiness": readiness, "liveness": liveness}
    return bind(spec.model_copy(update=update), numbers)


__all__ = ["PRESETS", "Preset", "PresetPort", "preview_ports", "resolve", "wanted_ports"]
