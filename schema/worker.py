"""What to run in a slot: :class:`WorkerSpec`, the one definition of the worker spec.

The spec is the client's: a preset (``"preset": "triton"``) stays a name here; the runtime fills in
the preset's command and probes when it launches (``nodeagent.runtime.presets``), and the spec's
own values always win. docs/worker-spec.md documents every field.
"""

from __future__ import annotations

import enum
import resource
import signal
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, ValidationError, WithJsonSchema, model_validator

from nodeagent.schema.messages import invalid_request
from nodeagent.schema.quantity import MAX_BYTES, QUANTITY_PATTERN, parse_quantity, shown
from nodeagent.schema.strict import AsTuple, StrictModel

#: Open Inference Protocol (KServe v2) health paths: the default HTTP probes.
OIP_READY_PATH = "/v2/health/ready"
OIP_LIVE_PATH = "/v2/health/live"

#: The servers the runtime knows how to run (``nodeagent.runtime.presets`` defines each).
PRESET_NAMES = ("triton", "torchserve", "tfserving", "mlserver", "kserve", "sagemaker", "generic")
PresetName = Literal["triton", "torchserve", "tfserving", "mlserver", "kserve", "sagemaker", "generic"]
#: A file the agent writes for the worker (``files``): a plain name in the worker's files directory.
FILE_NAME_PATTERN = "^[A-Za-z0-9_][A-Za-z0-9._-]{0,63}$"
MAX_FILE_BYTES = 64 * 1024
FileName = Annotated[str, Field(pattern=FILE_NAME_PATTERN)]
FileText = Annotated[str, Field(max_length=MAX_FILE_BYTES, pattern="^[^\\u0000]*$")]

#: uid_t and gid_t are 32 bits, and (uid_t)-1 means "no change" to setuid: never an identity.
MAX_ID = 2**32 - 2
MAX_PERIOD_SECONDS = 3600.0
MAX_DELAY_SECONDS = 86400.0


class RestartPolicy(enum.StrEnum):
    NEVER = "never"
    ON_FAILURE = "on-failure"
    ALWAYS = "always"


class ProbeKind(enum.StrEnum):
    HTTP = "http"
    TCP = "tcp"
    GRPC = "grpc"
    EXEC = "exec"


# --------------------------------------------------------------------------- field types


def _not_a_shell_line(value: Any) -> Any:
    if isinstance(value, str):
        raise ValueError(
            f"must be a list of strings (argv), not a shell line: for {shown(value)} give "
            f"{list(value.split())!r}"
        )
    return value


def _argv(value: tuple[str, ...]) -> tuple[str, ...]:
    if not value or not value[0]:
        raise ValueError(
            "give a non-empty list of strings (argv, not a shell line) whose first is the program"
        )
    if any("\0" in arg for arg in value):
        raise ValueError("arguments cannot contain NUL")
    return value


def _absolute(value: str) -> str:
    if not value.startswith("/") or "\0" in value:
        raise ValueError(f"give an absolute path, got {shown(value)}")
    return value


def _url_path(value: str) -> str:
    if not value.startswith("/"):
        raise ValueError(f"give a path starting with '/', got {shown(value)}")
    return value


def _env(value: dict[str, str]) -> dict[str, str]:
    for key, text in value.items():
        if not key or "=" in key or "\0" in key:
            raise ValueError(f"env key {shown(key)}: give a non-empty name without '=' or NUL")
        if "\0" in text:
            raise ValueError(f"env[{key!r}]: give a string without NUL")
    return value


def _rlimits(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    limits: dict[Any, Any] = {}
    for name, given in value.items():
        number = getattr(resource, f"RLIMIT_{name.upper()}", None) if isinstance(name, str) else None
        if not isinstance(number, int):
            raise ValueError(f"unknown rlimit {shown(name)}; use one of {', '.join(RLIMIT_NAMES)}")
        pair = [given, given] if isinstance(given, int) and not isinstance(given, bool) else given
        if (
            not isinstance(pair, list | tuple)
            or len(pair) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= -1 for v in pair)
        ):
            raise ValueError(
                f"rlimits.{name}: give [soft, hard] as integers (-1 is unlimited), got {shown(given)}"
            )
        soft, hard = pair
        if hard != -1 and (soft == -1 or soft > hard):
            raise ValueError(
                f"rlimits.{name}: the soft limit must not exceed the hard limit, got {shown(given)}"
            )
        limits[name] = (soft, hard)
    return limits


def _restart(value: Any) -> Any:
    if isinstance(value, str) and value in RestartPolicy.__members__.values():
        return RestartPolicy(value)
    if isinstance(value, RestartPolicy):
        return value
    raise ValueError(f"use never, on-failure or always, got {shown(value)}")


Port = Annotated[int, Field(ge=1, le=65535, description="A TCP port.")]
#: The resource limits setrlimit(2) knows here, by their lower-case names ("nofile").
RLIMIT_NAMES = sorted(name[7:].lower() for name in dir(resource) if name.startswith("RLIMIT_"))
_NO_NUL = "^[^\\u0000]*$"
Argv = Annotated[
    tuple[str, ...],
    AsTuple,
    BeforeValidator(_not_a_shell_line),
    AfterValidator(_argv),
    WithJsonSchema(
        {
            "type": "array",
            "minItems": 1,
            "prefixItems": [{"type": "string", "minLength": 1, "pattern": _NO_NUL}],
            "items": {"type": "string", "pattern": _NO_NUL},
        }
    ),
]
Principal = Annotated[str, Field(min_length=1, max_length=256)] | Annotated[int, Field(ge=0, le=MAX_ID)]
Period = Annotated[float, Field(ge=0.01, le=MAX_PERIOD_SECONDS)]
Delay = Annotated[float, Field(ge=0, le=MAX_DELAY_SECONDS)]
Count = Annotated[int, Field(ge=1, le=1000)]
#: Until a probe first passes it runs this often: a cheap check (a refused connect, one small HTTP
#: answer) 20 times a second costs next to nothing, and the worker is running within 50 ms of
#: being ready instead of up to a full period later.
STARTUP_PERIOD_SECONDS = 0.05


# --------------------------------------------------------------------------- probes


#: A named port of the worker ("http", "grpc", "metrics", "management"): lower case, like a
#: Kubernetes port name, so that it also makes an environment variable (NODEAGENT_PORT_HTTP).
PORT_NAME_PATTERN = "^[a-z][a-z0-9_]{0,14}$"
PortName = Annotated[str, Field(pattern=PORT_NAME_PATTERN)]
#: A probe's port: a number, or the name of one of the worker's ports (the agent assigns it).
ProbePort = Annotated[
    Port | PortName,
    Field(description='A TCP port, or the name of one of the worker\'s ports ("http", "grpc").'),
]
PortProtocol = Literal["http", "grpc", "tcp"]


class WorkerPort(StrictModel):
    """One named port of the worker: a host port the agent assigns from its ``[workers] port_range``,
    or the one asked for here (refused when taken)."""

    port: Port | None = Field(
        default=None, description="This host port exactly (refused when in use); default: one assigned."
    )
    protocol: PortProtocol | None = Field(
        default=None,
        description='What speaks on it: "http", "grpc" or "tcp"; default "grpc" for a port named grpc, '
        '"http" otherwise.',
    )


#: How much of an HTTP probe's answer is read for a body match.
MAX_PROBE_BODY = 64 * 1024
HttpStatus = Annotated[int, Field(ge=100, le=599)]


def _status(value: Any) -> Any:
    if (
        isinstance(value, list | tuple)
        and len(value) == 2
        and all(isinstance(v, int) for v in value)
        and value[0] > value[1]
    ):
        raise ValueError(f"give [lowest, highest], got {shown(value)}")
    return value


class BodyMatch(StrictModel):
    """What a passing answer's body holds: a substring, or a JSON field with a value."""

    contains: Annotated[str, Field(min_length=1, max_length=4096)] | None = Field(
        default=None, description="The body (its first 64 KiB, as UTF-8) contains this text."
    )
    json_field: Annotated[str, Field(min_length=1, max_length=256)] | None = Field(
        default=None,
        description='The body is JSON and this field (dotted; list items by number, "0.workers.0.status") '
        "equals `equals`.",
    )
    equals: Any = Field(default=None, description="The value json_field must have (any JSON value).")

    @model_validator(mode="after")
    def _one_match(self) -> BodyMatch:
        if (self.contains is None) == (self.json_field is None):
            raise ValueError(
                "give exactly one of 'contains' or 'json_field' (with 'equals'), such as "
                "{'contains': 'READY'} or {'json_field': 'status', 'equals': 'READY'}"
            )
        if self.json_field is not None and "equals" not in self.model_fields_set:
            raise ValueError("json_field needs 'equals': the value the field must have")
        if self.contains is not None and "equals" in self.model_fields_set:
            raise ValueError("'equals' goes with json_field, not with contains")
        return self


class HttpCheck(StrictModel):
    port: ProbePort
    path: Annotated[str, AfterValidator(_url_path), Field(pattern="^/")] = Field(
        default=OIP_READY_PATH, description="Answered with 2xx or 3xx when healthy (or as `status` says)."
    )
    status: (
        Annotated[HttpStatus | Annotated[tuple[HttpStatus, HttpStatus], AsTuple], BeforeValidator(_status)]
        | None
    ) = Field(
        default=None,
        description="The status a passing answer has: one (200) or a range ([200, 299]); "
        "default: 200 to 399.",
    )
    body: BodyMatch | None = Field(default=None, description="What a passing answer's body holds.")

    def status_passes(self, status: int) -> bool:
        if self.status is None:
            return 200 <= status < 400
        if isinstance(self.status, int):
            return status == self.status
        return self.status[0] <= status <= self.status[1]


class TcpCheck(StrictModel):
    port: ProbePort


class GrpcCheck(StrictModel):
    port: ProbePort
    service: Annotated[str, Field(max_length=256)] = Field(
        default="",
        description="The service asked about in grpc.health.v1.Health/Check; empty: the server as a whole.",
    )


class ExecCheck(StrictModel):
    argv: Argv = Field(description="Succeeds when it exits 0.")


class Probe(StrictModel):
    """A readiness or liveness check with Kubernetes' knobs and defaults: one of http, tcp, grpc or
    exec."""

    http: HttpCheck | None = None
    tcp: TcpCheck | None = None
    grpc: GrpcCheck | None = None
    exec: ExecCheck | None = None
    period_seconds: Period = 10.0
    startup_period_seconds: Period = Field(
        default=STARTUP_PERIOD_SECONDS,
        description="Until the probe first passes it runs this often (at most every period_seconds), "
        "so a worker is running within about this long of being ready.",
    )
    timeout_seconds: Period = 1.0
    success_threshold: Count = 1
    failure_threshold: Count = 3
    initial_delay_seconds: Delay = 0.0

    @model_validator(mode="after")
    def _one_check(self) -> Probe:
        given = [kind for kind in ProbeKind if getattr(self, kind.value) is not None]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of 'http', 'tcp', 'grpc' or 'exec', such as "
                "{'http': {'port': 8000, 'path': '/v2/health/ready'}}"
            )
        return self

    @property
    def kind(self) -> ProbeKind:
        return next(kind for kind in ProbeKind if getattr(self, kind.value) is not None)

    @property
    def port(self) -> int | str | None:
        """The port checked: a number, or a port's name until the agent has bound the spec to its
        slot's ports (``nodeagent.runtime.ports``)."""
        check = self.http or self.tcp or self.grpc
        return None if check is None else check.port

    @property
    def path(self) -> str:
        return self.http.path if self.http is not None else OIP_READY_PATH

    @property
    def argv(self) -> tuple[str, ...]:
        return self.exec.argv if self.exec is not None else ()


# --------------------------------------------------------------------------- stopping


def _signal_name(value: Any) -> Any:
    """ "TERM", "SIGTERM" or 15 -> "SIGTERM"; a signal that cannot stop a process is refused."""
    if isinstance(value, bool):
        return value
    try:
        if isinstance(value, int):
            sig = signal.Signals(value)
        elif isinstance(value, str):
            name = value.upper()
            sig = signal.Signals[name if name.startswith("SIG") else "SIG" + name]
        else:
            return value
    except (KeyError, ValueError):
        raise ValueError(
            f"unknown signal {shown(value)}; use a name such as SIGTERM, SIGINT or SIGQUIT"
        ) from None
    if sig in (signal.SIGSTOP, signal.SIGCONT, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU):
        raise ValueError(f"{sig.name} does not stop a process; use SIGTERM, SIGINT or SIGQUIT")
    return sig.name


class HttpCall(StrictModel):
    port: ProbePort
    path: Annotated[str, AfterValidator(_url_path), Field(pattern="^/")]
    method: Literal["GET", "POST", "PUT", "DELETE"] = "GET"


class PreStop(StrictModel):
    """What runs before the worker is signalled to stop: one of http (a request to the worker) or
    exec (a command in the worker's slot and sandbox, as exec probes run)."""

    http: HttpCall | None = None
    exec: ExecCheck | None = None
    timeout_seconds: Annotated[float, Field(gt=0, le=MAX_PERIOD_SECONDS)] = Field(
        default=10.0, description="How long the hook may take; the stop goes on after it either way."
    )

    @model_validator(mode="after")
    def _one_action(self) -> PreStop:
        if (self.http is None) == (self.exec is None):
            raise ValueError(
                "give exactly one of 'http' or 'exec', such as "
                "{'http': {'port': 'http', 'path': '/drain', 'method': 'POST'}}"
            )
        return self


# --------------------------------------------------------------------------- the sandbox


_SYSCALL_NAME = "^[a-z][a-z0-9_]{0,63}$"
_CAPABILITY_NAME = "^(CAP_)?[A-Z][A-Z_]{0,31}$"
SyscallName = Annotated[str, Field(pattern=_SYSCALL_NAME)]
CapabilityName = Annotated[str, Field(pattern=_CAPABILITY_NAME)]
#: A private tmpfs's size: at least one page, at most what the kernel takes.
TmpfsBytes = Annotated[
    int,
    BeforeValidator(parse_quantity),
    Field(ge=4096, le=MAX_BYTES),
    WithJsonSchema(
        {
            "description": 'Bytes, or a quantity such as "64Mi", "1Gi" (at least 4096).',
            "oneOf": [
                {"type": "integer", "minimum": 4096, "maximum": MAX_BYTES - 1023},
                {"type": "string", "pattern": QUANTITY_PATTERN},
            ],
        }
    ),
]


class WorkerSandbox(StrictModel):
    """What the worker's sandbox leaves out for this slot: each opt-out by name, and each must be
    allowed by the agent's ``[sandbox]`` configuration (docs/sandbox.md). Everything not named here
    stays confined."""

    allow_syscalls: Annotated[tuple[SyscallName, ...], AsTuple] = Field(
        default=(),
        max_length=64,
        description="System calls the default seccomp profile denies that this worker may make "
        '(e.g. ["perf_event_open"] for a profiler, ["io_uring_setup", "io_uring_enter", '
        '"io_uring_register"]).',
    )
    seccomp: Literal["default", "unconfined"] = Field(
        default="default", description='"unconfined": no seccomp filter at all (no_new_privs stays).'
    )
    capabilities: Annotated[tuple[CapabilityName, ...], AsTuple] = Field(
        default=(),
        max_length=41,
        description="Capabilities the worker keeps, by name with or without CAP_ "
        '(e.g. ["NET_BIND_SERVICE"]); a non-root worker keeps none by default.',
    )
    shm_size: TmpfsBytes | None = Field(
        default=None, description="Size of the private /dev/shm (default: the agent's [sandbox] shm_size)."
    )
    tmp_size: TmpfsBytes | None = Field(
        default=None, description="Size of the private /tmp (default: the agent's [sandbox] tmp_size)."
    )
    home_size: TmpfsBytes | None = Field(
        default=None,
        description="Size of the worker's HOME, a tmpfs of its own (default: [sandbox] home_size).",
    )

    @model_validator(mode="after")
    def _no_repeats(self) -> WorkerSandbox:
        for name in ("allow_syscalls", "capabilities"):
            values = [v.removeprefix("CAP_") for v in getattr(self, name)]
            repeated = sorted({v for v in values if values.count(v) > 1})
            if repeated:
                raise ValueError(f"{name} lists {', '.join(repeated)} more than once")
        if self.seccomp == "unconfined" and self.allow_syscalls:
            raise ValueError('allow_syscalls means nothing with seccomp "unconfined" (no filter at all)')
        return self


# --------------------------------------------------------------------------- containers


def _mount_path(value: str) -> str:
    if not value.startswith("/") or any(c in value for c in ":,\0"):
        raise ValueError(f"give an absolute path without ':' or ',', got {shown(value)}")
    return value


MountPath = Annotated[
    str, AfterValidator(_mount_path), Field(min_length=1, max_length=4096, pattern="^/[^:,\\u0000]*$")
]


class ContainerMount(StrictModel):
    """A host path bind-mounted into the container."""

    source: MountPath = Field(description="The host path (absolute).")
    target: MountPath = Field(description="Where it appears in the container (absolute).")
    read_only: bool = Field(default=True, description="Read-only unless false.")


class ContainerSpec(StrictModel):
    """Run the worker as a container (podman, inside the slot's cgroups; docs/containers.md)."""

    image: Annotated[str, Field(min_length=1, max_length=4096, pattern="^[^\\s\\u0000]+$")] = Field(
        description="An image in the host's local storage (never pulled), e.g. localhost/server:1."
    )
    command: Argv | None = Field(
        default=None, description="Replaces the image's entrypoint (argv, not a shell line)."
    )
    args: Annotated[tuple[Annotated[str, Field(pattern=_NO_NUL)], ...], AsTuple] = Field(
        default=(), max_length=4096, description="Arguments to the entrypoint (the image's CMD when empty)."
    )
    read_only: bool = Field(default=False, description="A read-only root file system (/tmp, /run writable).")
    mounts: Annotated[tuple[ContainerMount, ...], AsTuple] = Field(default=(), max_length=64)


# --------------------------------------------------------------------------- the spec


class WorkerSpec(StrictModel):
    """What to run in a slot, and how to keep it alive."""

    command: Argv | None = Field(
        default=None,
        description="argv of the worker (not a shell line); optional with a preset that knows it.",
    )
    env: Annotated[
        dict[str, str],
        AfterValidator(_env),
        WithJsonSchema(
            {
                "type": "object",
                "propertyNames": {"pattern": "^[^=\\u0000]+$"},
                "additionalProperties": {"type": "string", "pattern": _NO_NUL},
            }
        ),
    ] = Field(
        default_factory=dict, description="Added to the slot's environment; wins over the agent's wiring."
    )
    workdir: Annotated[str, AfterValidator(_absolute), Field(pattern="^/[^\\u0000]*$")] | None = None
    user: Principal | None = Field(default=None, description="A user name or uid to run as.")
    group: Principal | None = Field(default=None, description="A group name or gid (default: the user's).")
    supplementary_groups: Annotated[tuple[Principal, ...], AsTuple] = ()
    restart: Annotated[RestartPolicy, BeforeValidator(_restart)] = RestartPolicy.ON_FAILURE
    readiness: Probe | None = None
    liveness: Probe | None = None
    stop_grace_seconds: Annotated[float, Field(ge=0, le=MAX_PERIOD_SECONDS)] = Field(
        default=30.0, description="After the stop signal, how long before the slot's processes are killed."
    )
    stop_signal: Annotated[str, BeforeValidator(_signal_name)] = Field(
        default="SIGTERM",
        description='The signal that asks the worker to stop ("SIGTERM", "SIGINT", "SIGQUIT", ...).',
    )
    stop_scope: Literal["slot", "main"] = Field(
        default="slot",
        description='Who gets the stop signal: "slot", every process in the slot, each once; "main", the '
        "main process only (a server that stops its own helpers). SIGKILL after the grace reaches all. A "
        "container worker is always signalled through podman, which passes the signal to the container.",
    )
    pre_stop: PreStop | None = Field(
        default=None, description="A request or command run before the stop signal (within drain and grace)."
    )
    drain_seconds: Annotated[float, Field(ge=0, le=MAX_PERIOD_SECONDS)] = Field(
        default=0.0,
        description="On a stop, the worker is shown not ready at once and signalled only this long after "
        "(requests under way finish, balancers move away); skipped for a worker that was never ready.",
    )
    startup_timeout_seconds: Annotated[float, Field(gt=0, le=MAX_DELAY_SECONDS)] = Field(
        default=300.0,
        description="A worker with a readiness probe that has not passed this long after its start is "
        "stopped and counted as failed (then restarted by its policy).",
    )
    rlimits: Annotated[
        dict[str, tuple[int, int]],
        BeforeValidator(_rlimits),
        WithJsonSchema(
            {
                "type": "object",
                "propertyNames": {"enum": RLIMIT_NAMES},
                "additionalProperties": {
                    "oneOf": [
                        {"type": "integer", "minimum": -1},
                        {
                            "type": "array",
                            "prefixItems": [{"type": "integer", "minimum": -1}] * 2,
                            "minItems": 2,
                            "maxItems": 2,
                        },
                    ]
                },
            }
        ),
    ] = Field(
        default_factory=dict,
        description='Resource limits by lower-case name: {"nofile": [4096, 8192]} or {"nofile": 4096}; '
        "-1 is unlimited.",
    )
    umask: Annotated[int, Field(ge=0, le=0o777)] = 0o022
    preset: PresetName | None = Field(
        default=None, description="A known server whose command and probes fill what the spec leaves out."
    )
    args: Annotated[tuple[Annotated[str, Field(pattern=_NO_NUL)], ...], AsTuple] = Field(
        default=(),
        max_length=256,
        description="Arguments added after the command (the preset's or the spec's own).",
    )
    path: Annotated[
        tuple[Annotated[str, AfterValidator(_absolute), Field(pattern="^/[^:\\u0000]*$")], ...], AsTuple
    ] = Field(
        default=(),
        max_length=32,
        description="Directories put before the worker's PATH, where its program (and the ones it runs) "
        "are looked up; an `env` PATH replaces it instead.",
    )
    files: Annotated[dict[FileName, FileText], Field(max_length=16)] = Field(
        default_factory=dict,
        description="Files written for the worker before each start (name -> text) in its files "
        'directory ("{files}" in command, args, env and files; NODEAGENT_FILES_DIR), with "{port:NAME}" '
        'and "{threads}" filled in: configuration a server only reads from a file.',
    )
    port: Port | None = Field(
        default=None,
        description="With a preset: the host port of its `http` port (the same as "
        '`"ports": {"http": {"port": N}}`); default: one the agent assigns.',
    )
    ports: Annotated[dict[PortName, WorkerPort], Field(max_length=16)] = Field(
        default_factory=dict,
        description='Named ports ({"http": {}, "grpc": {"port": 9001}}), added to its preset\'s: each gets a '
        "free host port from the agent's range (or the one asked for), kept while the slot exists, "
        'substituted for "{port:NAME}" in command and env, and shown as the slot\'s endpoints.',
    )
    model_name: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    model_repository: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    sandbox: WorkerSandbox | None = Field(
        default=None,
        description="Opt-outs from the worker's sandbox, each by name and each allowed by the agent's "
        "configuration; without it the worker is fully confined.",
    )
    container: ContainerSpec | None = Field(
        default=None,
        description="Run the worker as this container instead of a command (podman, in the slot's cgroups).",
    )

    @model_validator(mode="after")
    def _complete(self) -> WorkerSpec:
        if self.container is not None:
            self._container_fits()
        elif self.command is None and self.preset in (None, "generic"):
            raise ValueError(
                "command is missing; give the worker's argv, a container, or a preset that knows its command"
            )
        if self.liveness is not None and self.liveness.success_threshold != 1:
            raise ValueError("liveness.success_threshold must be 1")
        asked = self.ports.get("http")
        if self.port is not None and asked is not None and asked.port not in (None, self.port):
            raise ValueError(
                f"port is {self.port} but ports.http.port is {asked.port}; they name the same port, give one"
            )
        numbers = [p.port for p in self.ports.values() if p.port is not None]
        repeated = sorted({n for n in numbers if numbers.count(n) > 1})
        if repeated:
            raise ValueError(
                f"ports: port {repeated[0]} is asked for by more than one name; give each its own"
            )
        return self

    def _container_fits(self) -> None:
        if self.command is not None:
            raise ValueError(
                "give command or container, not both; a container's own command is container.command"
            )
        if self.preset is not None:
            raise ValueError("preset does not apply to a container; give container.command/args and probes")
        if self.group is not None or self.supplementary_groups:
            raise ValueError("group and supplementary_groups do not apply to a container (it runs as user)")
        if self.sandbox is not None and (
            self.sandbox.allow_syscalls
            or self.sandbox.tmp_size is not None
            or self.sandbox.home_size is not None
        ):
            raise ValueError(
                "sandbox.allow_syscalls, sandbox.tmp_size and sandbox.home_size do not apply to a container "
                "(podman's seccomp profile; its /tmp and HOME are the image's)"
            )


def parse_worker_spec(obj: Any) -> WorkerSpec:
    """Check a decoded JSON worker spec; InvalidRequest names each bad field."""
    try:
        return WorkerSpec.model_validate(obj)
    except ValidationError as err:
        raise invalid_request(err, WorkerSpec, "worker spec") from None


__all__ = [
    "FILE_NAME_PATTERN",
    "MAX_FILE_BYTES",
    "MAX_PROBE_BODY",
    "OIP_LIVE_PATH",
    "OIP_READY_PATH",
    "PORT_NAME_PATTERN",
    "PRESET_NAMES",
    "STARTUP_PERIOD_SECONDS",
    "BodyMatch",
    "ContainerMount",
    "ContainerSpec",
    "ExecCheck",
    "GrpcCheck",
    "HttpCall",
    "HttpCheck",
    "PortProtocol",
    "PreStop",
    "PresetName",
    "Probe",
    "ProbeKind",
    "RestartPolicy",
    "TcpCheck",
    "WorkerPort",
    "WorkerSandbox",
    "WorkerSpec",
    "parse_worker_spec",
]
