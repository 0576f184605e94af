"""Presets: how to run and probe the servers the runtime knows (Triton, TorchServe, TF Serving, a
generic Open Inference Protocol server).

A spec names a preset; :func:`resolve` fills in the command and the probes the spec leaves out, so
the spec's own values always win, and binds the worker's named ports (the preset's and the spec's,
:func:`wanted_ports`) to the host ports its slot holds. The supervisor runs the resolved spec.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodeagent.errors import InvalidRequest
from nodeagent.runtime.env import DEFAULT_PATH
from nodeagent.runtime.ports import DEFAULT_PORT_RANGE, PortWant, bind, default_protocol
from nodeagent.runtime.worker_kind import kind_of
from nodeagent.schema.worker import (
    OIP_LIVE_PATH,
    OIP_READY_PATH,
    PRESET_NAMES,
    BodyMatch,
    HttpCheck,
    PortProtocol,
    Probe,
    WorkerSpec,
)


@dataclass(frozen=True)
class PresetPort:
    """A port the server has: its name, protocol and the server's own default number (used only to
    check a spec before the agent assigns the real one)."""

    name: str
    protocol: PortProtocol
    default: int


@dataclass(frozen=True)
class Preset:
    """How to run and probe one kind of server. In every string ``{port:NAME}``, ``{model}``,
    ``{repo}`` and ``{bind}`` (the address the server listens on: :func:`bind_address`) are filled
    in when the worker is bound to its slot, ``{threads}`` (the slot's CPUs, or its quota rounded
    up) and ``{files}`` (its files directory) at launch."""

    #: The server's program and arguments; empty: the spec's own ``command`` runs (a server that is
    #: a Python file of the user's, say), followed by ``args``.
    program: tuple[str, ...]
    ports: tuple[PresetPort, ...]
    #: Readiness path when the model is known, and when it is not; the liveness path.
    model_ready_path: str
    server_ready_path: str
    live_path: str
    #: Added after the program (or after the spec's own command when the preset has no program).
    args: tuple[str, ...] = ()
    #: Added after ``args`` when the spec names its model (``{model}``): how the server learns it.
    model_args: tuple[str, ...] = ()
    #: Whether the server can be told where to listen (``{bind}``); False: it listens on every
    #: interface whatever it is told (KServe's REST and gRPC servers), which its docs say.
    binds: bool = True
    env: tuple[tuple[str, str], ...] = ()
    files: tuple[tuple[str, str], ...] = ()
    #: The port the model's readiness probe checks.
    probe_port: str = "http"
    #: The port of the server's own health path (readiness without a model, liveness) when it is
    #: not ``probe_port`` (TorchServe: /ping is on the inference port, not the management one).
    health_port: str | None = None
    #: What the model's readiness answer holds (JSON field, value), when its status is not enough.
    model_ready_json: tuple[str, str] | None = None
    #: The server's backends next to its program (Triton: <prefix>/bin/tritonserver and
    #: <prefix>/backends): added as this flag when the program is found and the directory exists.
    backend_flag: str | None = None
    #: What must exist for the server to find its model, checked when the spec is submitted (a
    #: typo fails the request with the path named, not every start): directories, then files.
    model_dirs: tuple[str, ...] = ()
    model_files: tuple[str, ...] = ()


#: TorchServe reads its addresses only from a properties file; this one is written for each start.
#: {bind}: loopback for a slot in the host's network namespace, every address of the slot's own
#: namespace otherwise (the agent's probes reach the slot's address). Its two gRPC servers too:
#: left out, they bind 7070 and 7071 and a second TorchServe on the host fails to start.
#: -XX:-UsePerfData: no /tmp/hsperfdata_<user>.
TORCHSERVE_PROPERTIES = """\
inference_address=http://{bind}:{port:http}
management_address=http://{bind}:{port:management}
metrics_address=http://{bind}:{port:metrics}
grpc_inference_address={bind}
grpc_inference_port={port:grpc}
grpc_management_address={bind}
grpc_management_port={port:grpc_management}
number_of_netty_threads={threads}
netty_client_threads={threads}
default_workers_per_model=1
vmargs=-XX:-UsePerfData
"""

PRESETS: dict[str, Preset] = {
    "triton": Preset(
        program=(
            "tritonserver",
            "--model-repository={repo}",
            "--http-port={port:http}",
            "--grpc-port={port:grpc}",
            "--metrics-port={port:metrics}",
            "--http-address={bind}",
            "--grpc-address={bind}",
            "--metrics-address={bind}",
            # Triton's HTTP front end and model loads sized to the slot, not to the host; and the
            # Python backend's request pool (32 threads by default, per model instance: 52 threads
            # for one tiny model in a 1-CPU slot, 21 with this; ignored when no model uses it).
            "--http-thread-count={threads}",
            "--model-load-thread-count={threads}",
            "--backend-config=python,thread-pool-size={threads}",
        ),
        ports=(
            PresetPort("http", "http", 8000),
            PresetPort("grpc", "grpc", 8001),
            PresetPort("metrics", "http", 8002),
        ),
        model_ready_path="/v2/models/{model}/ready",
        server_ready_path=OIP_READY_PATH,
        live_path=OIP_LIVE_PATH,
        backend_flag="--backend-directory",
        model_dirs=("{repo}",),
    ),
    "torchserve": Preset(
        # --ncs: no config snapshots (state the next start would read instead of this request).
        program=(
            "torchserve",
            "--foreground",
            "--ncs",
            "--model-store={repo}",
            "--models={model}={model}.mar",
            "--disable-token-auth",
            "--ts-config={files}/config.properties",
        ),
        ports=(
            PresetPort("http", "http", 8080),
            PresetPort("management", "http", 8081),
            PresetPort("metrics", "http", 8082),
            PresetPort("grpc", "grpc", 7070),
            PresetPort("grpc_management", "grpc", 7071),
        ),
        files=(("config.properties", TORCHSERVE_PROPERTIES),),
        # /ping answers before the model can serve; the management API says per model.
        model_ready_path="/models/{model}",
        model_ready_json=("0.workers.0.status", "READY"),
        server_ready_path="/ping",
        live_path="/ping",
        probe_port="management",
        health_port="http",
        model_dirs=("{repo}",),
        model_files=("{repo}/{model}.mar",),
    ),
    "tfserving": Preset(
        program=(
            "tensorflow_model_server",
            "--port={port:grpc}",
            "--rest_api_port={port:http}",
            "--model_name={model}",
            "--model_base_path={repo}/{model}",
            "--tensorflow_intra_op_parallelism={threads}",
            "--tensorflow_inter_op_parallelism={threads}",
        ),
        ports=(PresetPort("grpc", "grpc", 8500), PresetPort("http", "http", 8501)),
        model_ready_path="/v1/models/{model}",
        model_ready_json=("model_version_status.0.state", "AVAILABLE"),
        server_ready_path="/v1/models/{model}",
        live_path="/v1/models/{model}",
        model_dirs=("{repo}", "{repo}/{model}"),
    ),
    "mlserver": Preset(
        program=("mlserver", "start", "{repo}"),
        ports=(
            PresetPort("http", "http", 8080),
            PresetPort("grpc", "grpc", 8081),
            PresetPort("metrics", "http", 8082),
        ),
        # MLServer reads its settings from MLSERVER_* variables (settings.json in the repository
        # wins over them: leave ports out of it). No parallel worker processes by default: each
        # one is a second copy of the model in memory; a request may set MLSERVER_PARALLEL_WORKERS.
        env=(
            ("MLSERVER_HOST", "{bind}"),  # its HTTP, gRPC and metrics servers alike
            ("MLSERVER_HTTP_PORT", "{port:http}"),
            ("MLSERVER_GRPC_PORT", "{port:grpc}"),
            ("MLSERVER_METRICS_PORT", "{port:metrics}"),
            ("MLSERVER_PARALLEL_WORKERS", "0"),
        ),
        model_ready_path="/v2/models/{model}/ready",
        server_ready_path=OIP_READY_PATH,
        live_path=OIP_LIVE_PATH,
        model_dirs=("{repo}",),
    ),
    "kserve": Preset(
        # KServe's model server is the user's Python file (a kserve.Model and ModelServer().start);
        # kserve's own argument parser reads these.
        program=(),
        args=("--http_port={port:http}", "--grpc_port={port:grpc}", "--workers=1", "--max_threads={threads}"),
        # kserve's parser gives the model its name (default "model"): the user's file passes
        # args.model_name to its kserve.Model, and the readiness path names the same model.
        model_args=("--model_name={model}",),
        # Its REST server binds 0.0.0.0 and its gRPC server [::], whatever it is told.
        binds=False,
        ports=(PresetPort("http", "http", 8080), PresetPort("grpc", "grpc", 8081)),
        model_ready_path="/v2/models/{model}/ready",
        server_ready_path=OIP_READY_PATH,
        live_path=OIP_LIVE_PATH,
    ),
    "sagemaker": Preset(
        # The SageMaker serving contract: the image's `serve`, on the port SAGEMAKER_BIND_TO_PORT
        # names, healthy when GET /ping answers 200.
        program=("serve",),
        ports=(PresetPort("http", "http", 8080),),
        env=(("SAGEMAKER_BIND_TO_PORT", "{port:http}"),),
        model_ready_path="/ping",
        server_ready_path="/ping",
        live_path="/ping",
    ),
    "generic": Preset(
        # The spec's own command; its http port is the spec's `port` or `ports.http`.
        program=(),
        ports=(),
        model_ready_path="/v2/models/{model}/ready",
        server_ready_path=OIP_READY_PATH,
        live_path=OIP_LIVE_PATH,
    ),
}
assert set(PRESETS) == set(PRESET_NAMES), "every preset the schema names is defined here"

#: Finds a program as the worker would: (name, PATH) -> its absolute path, or None.
FindProgram = Callable[[str, str], str | None]


def find_program(name: str, path: str) -> str | None:
    """The program ``name`` on ``path`` as the agent sees the file system (a worker sees the same,
    less what its sandbox hides); an absolute name must exist and be executable."""
    return shutil.which(name, path=path)


#: Where a server in a slot without a network namespace of its own listens: the host's loopback
#: only (its endpoints say 127.0.0.1); a slot's own namespace is the boundary there instead.
LOOPBACK = "127.0.0.1"
EVERY_ADDRESS = "0.0.0.0"  # noqa: S104 - inside the slot's own network namespace


def bind_address(own_network: bool) -> str:
    """The address a preset's server listens on: every address of the slot's own network
    namespace, or the host's loopback for a slot that shares the host's network."""
    return EVERY_ADDRESS if own_network else LOOPBACK


def _fill(template: str, spec: WorkerSpec, bind: str = LOOPBACK) -> str:
    if "{model}" in template and spec.model_name is None:
        raise InvalidRequest(
            f"worker spec: model_name is missing; preset {spec.preset!r} needs the model's name"
        )
    if "{repo}" in template and spec.model_repository is None:
        raise InvalidRequest(
            f"worker spec: model_repository is missing; preset {spec.preset!r} needs the path of the "
            "model repository"
        )
    filled = template.replace("{model}", spec.model_name or "").replace("{repo}", spec.model_repository or "")
    return filled.replace("{bind}", bind)


def wanted_ports(spec: WorkerSpec) -> dict[str, PortWant]:
    """The worker's named ports: its preset's, then the spec's own (which win, name by name)."""
    wants: dict[str, PortWant] = {}
    if spec.preset is not None:
        for p in PRESETS[spec.preset].ports:
            wants[p.name] = PortWant(p.name, p.protocol, None)
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


def _locate(command: tuple[str, ...], spec: WorkerSpec, find: FindProgram) -> str:
    """The program's absolute path, looked up on the worker's PATH; InvalidRequest at once (not a
    restart loop) when it is not there."""
    path = spec.env.get("PATH") or ":".join((*spec.path, DEFAULT_PATH))
    found = find(command[0], path)
    if found is None:
        where = "" if "/" in command[0] else f" on the worker's PATH ({path})"
        raise InvalidRequest(
            f"worker spec: program {command[0]!r} not found{where}; install it, give its absolute path "
            'in command, or put its directory in "path"'
        )
    return found


def check_model_files(preset: Preset, spec: WorkerSpec) -> None:
    """InvalidRequest naming the path when what the server needs to find its model is not there
    (as the agent sees the file system; the worker's sandbox shows the same, less what it hides)."""
    for template, wanted, is_there in (
        *((t, "directory", os.path.isdir) for t in preset.model_dirs),
        *((t, "file", os.path.isfile) for t in preset.model_files),
    ):
        if "{model}" in template and spec.model_name is None:
            continue  # the server serves whatever the repository holds
        path = _fill(template, spec)
        if not is_there(path):
            raise InvalidRequest(
                f"worker spec: preset {spec.preset!r} needs the {wanted} {path}, and there is none; "
                + (
                    "check model_repository and model_name"
                    if "{model}" in template
                    else "check model_repository"
                )
            )


def _health_port(preset: Preset) -> str:
    return preset.health_port or preset.probe_port


def _ready_probe(preset: Preset, spec: WorkerSpec) -> Probe:
    if spec.model_name is None:
        check = HttpCheck(port=_health_port(preset), path=_fill(preset.server_ready_path, spec))
        return Probe(http=check, period_seconds=2.0)
    body = None
    if preset.model_ready_json is not None:
        field, value = preset.model_ready_json
        body = BodyMatch(json_field=field, equals=value)
    check = HttpCheck(port=preset.probe_port, path=_fill(preset.model_ready_path, spec), body=body)
    return Probe(http=check, period_seconds=2.0)


def resolve(
    spec: WorkerSpec,
    ports: Mapping[str, int] | None = None,
    *,
    find: FindProgram | None = None,
    listen_on: str = LOOPBACK,
) -> WorkerSpec:
    """The spec as the runtime runs it: the preset's command, arguments, environment, files and
    probes where the spec has none (the spec's own always win, and its ``args``, ``env`` and
    ``files`` add to the preset's), with every port filled in (``ports``: name -> host port, as the
    slot holds them; None: check the spec with :func:`preview_ports`). ``find``: look the program
    up now, run it by its absolute path, and refuse the spec when it is missing.

    InvalidRequest when the preset needs a field the spec lacks, something refers to a port the
    worker does not have, or (with ``find``) the program is not there. ``listen_on``: where the
    server listens (:func:`bind_address`)."""
    if not kind_of(spec).uses_presets:
        return spec  # a container's image knows its program; the schema refuses a preset beside one
    numbers = preview_ports(spec) if ports is None else dict(ports)
    missing = sorted(set(wanted_ports(spec)) - set(numbers))
    if missing:
        raise InvalidRequest(f"worker spec: no host port for {', '.join(missing)}")  # an agent bug
    preset = PRESETS[spec.preset] if spec.preset is not None else None
    command = spec.command
    extra: tuple[str, ...] = ()
    if preset is not None and (command is None or not preset.program):
        command = command or tuple(_fill(arg, spec, listen_on) for arg in preset.program)
        extra = tuple(_fill(arg, spec, listen_on) for arg in preset.args)
        if spec.model_name is not None:
            extra += tuple(_fill(arg, spec, listen_on) for arg in preset.model_args)
    if not command:
        raise InvalidRequest(
            "worker spec: command is missing; give the worker's argv or a preset that knows it"
        )
    update: dict[str, Any] = {}
    if find is not None:
        program = _locate(command, spec, find)
        if preset is not None and spec.command is None:
            check_model_files(preset, spec)
        command = (program, *command[1:])
        if preset is not None and preset.backend_flag and spec.command is None:
            backends = Path(program).resolve().parent.parent / "backends"
            if backends.is_dir():
                extra = (f"{preset.backend_flag}={backends}", *extra)
    update["command"] = (*command, *extra, *spec.args)
    update["args"] = ()
    if preset is not None:
        update["env"] = {**{k: _fill(v, spec, listen_on) for k, v in preset.env}, **spec.env}
        update["files"] = {**{k: _fill(v, spec, listen_on) for k, v in preset.files}, **spec.files}
        if preset.probe_port in numbers and _health_port(preset) in numbers:
            update["readiness"] = spec.readiness or _ready_probe(preset, spec)
            update["liveness"] = spec.liveness or Probe(
                http=HttpCheck(port=_health_port(preset), path=_fill(preset.live_path, spec)),
                period_seconds=10.0,
                # Model servers load weights before they answer; do not kill them for being slow to start.
                initial_delay_seconds=30.0,
            )
        if "http" in numbers:
            update["port"] = numbers["http"]
    return bind(spec.model_copy(update=update), numbers)


#: What :func:`resolve` may change that only the launch request carries (the argv it runs).
_ARGV_FIELDS = frozenset({"command", "args"})


def only_argv_resolved(spec: WorkerSpec, resolved: WorkerSpec) -> bool:
    """Whether ``resolved`` (:func:`resolve`'s result for ``spec``) differs from ``spec`` in its
    argv alone: the program's absolute path, the args folded in. Then everything a supervisor
    reads of its spec after the launch request is built (probes, restart and stop policy) is the
    same in both, and it can keep ``spec``, which the slot's records hold anyway, instead of a
    second copy per slot."""
    return resolved is spec or all(
        getattr(spec, name) == getattr(resolved, name)
        for name in type(spec).model_fields
        if name not in _ARGV_FIELDS
    )


__all__ = [
    "EVERY_ADDRESS",
    "LOOPBACK",
    "PRESETS",
    "FindProgram",
    "Preset",
    "PresetPort",
    "bind_address",
    "check_model_files",
    "find_program",
    "only_argv_resolved",
    "preview_ports",
    "resolve",
    "wanted_ports",
]
