"""WorkerSpec: what the customer asks us to run in a slot, validated, with presets for common servers.

A spec arrives as JSON (REST body, config) and leaves as a frozen dataclass. ``parse_worker_spec``
checks every field and says which one is wrong; ``apply_preset`` fills in the command and probes
of a known server (Triton, TorchServe, TF Serving, a generic command) where the spec leaves them
out, so the spec's own values always win.
"""

from __future__ import annotations

import dataclasses
import enum
import resource
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nodeagent.errors import InvalidRequest

#: Open Inference Protocol (KServe v2) health paths: the default HTTP probes.
OIP_READY_PATH = "/v2/health/ready"
OIP_LIVE_PATH = "/v2/health/live"


class RestartPolicy(enum.StrEnum):
    NEVER = "never"
    ON_FAILURE = "on-failure"
    ALWAYS = "always"


class ProbeKind(enum.StrEnum):
    HTTP = "http"
    TCP = "tcp"
    EXEC = "exec"


@dataclass(frozen=True)
class Probe:
    """A readiness or liveness check, with Kubernetes' knobs and defaults."""

    kind: ProbeKind
    port: int | None = None
    path: str = OIP_READY_PATH
    argv: tuple[str, ...] = ()
    period_seconds: float = 10.0
    timeout_seconds: float = 1.0
    success_threshold: int = 1
    failure_threshold: int = 3
    initial_delay_seconds: float = 0.0


@dataclass(frozen=True)
class WorkerSpec:
    command: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    workdir: str | None = None
    user: str | int | None = None
    group: str | int | None = None
    supplementary_groups: tuple[str | int, ...] = ()
    restart: RestartPolicy = RestartPolicy.ON_FAILURE
    readiness: Probe | None = None
    liveness: Probe | None = None
    stop_grace_seconds: float = 30.0
    #: resource name as in ``resource.RLIMIT_<NAME>`` (lower case: "nofile") -> (soft, hard); -1 is unlimited.
    rlimits: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    umask: int = 0o022
    preset: str | None = None
    #: Used by presets: the port the server listens on, the model it serves, where models live.
    port: int | None = None
    model_name: str | None = None
    model_repository: str | None = None


def rlimit_resource(name: str) -> int:
    """The ``resource.RLIMIT_*`` number for a lower-case name such as ``"nofile"``."""
    value = getattr(resource, f"RLIMIT_{name.upper()}", None)
    if not isinstance(value, int):
        known = sorted(n[7:].lower() for n in dir(resource) if n.startswith("RLIMIT_"))
        raise InvalidRequest(f"unknown rlimit {name!r}; use one of {', '.join(known)}")
    return value


# --- parsing -----------------------------------------------------------------------------------


def _fail(where: str, found: object, want: str) -> InvalidRequest:
    return InvalidRequest(f"worker spec: {where} is {found!r}; {want}")


def _number(raw: Mapping[str, Any], key: str, default: float, where: str, *, minimum: float = 0.0) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
        raise _fail(f"{where}.{key}", value, f"give a number >= {minimum}")
    return float(value)


def _count(raw: Mapping[str, Any], key: str, default: int, where: str) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _fail(f"{where}.{key}", value, "give a whole number >= 1")
    return value


def _port(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise _fail(where, value, "give a TCP port between 1 and 65535")
    return value


def _argv(value: object, where: str) -> tuple[str, ...]:
    if not isinstance(value, list | tuple) or not value or not all(isinstance(a, str) for a in value):
        raise _fail(where, value, "give a non-empty list of strings (argv, not a shell line)")
    if not value[0]:
        raise _fail(where, value, "the program (first element) must not be empty")
    return tuple(value)


def parse_probe(raw: object, where: str) -> Probe | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise _fail(where, raw, "give an object such as {'http': {'port': 8000, 'path': '/v2/health/ready'}}")
    kinds = [k for k in ProbeKind if k.value in raw]
    if len(kinds) != 1:
        raise _fail(where, sorted(raw), "give exactly one of 'http', 'tcp' or 'exec'")
    kind = kinds[0]
    body = raw[kind.value]
    if not isinstance(body, Mapping):
        raise _fail(f"{where}.{kind.value}", body, "give an object")
    port: int | None = None
    argv: tuple[str, ...] = ()
    path = OIP_READY_PATH
    if kind is ProbeKind.EXEC:
        argv = _argv(body.get("argv"), f"{where}.exec.argv")
    else:
        port = _port(body.get("port"), f"{where}.{kind.value}.port")
    if kind is ProbeKind.HTTP:
        path = body.get("path", OIP_READY_PATH)
        if not isinstance(path, str) or not path.startswith("/"):
            raise _fail(f"{where}.http.path", path, "give a path starting with '/'")
    success = _count(raw, "success_threshold", 1, where)
    if kind is not ProbeKind.EXEC and where.endswith("liveness") and success != 1:
        raise _fail(f"{where}.success_threshold", success, "a liveness probe's success_threshold must be 1")
    return Probe(
        kind=kind,
        port=port,
        path=path,
        argv=argv,
        period_seconds=_number(raw, "period_seconds", 10.0, where, minimum=0.01),
        timeout_seconds=_number(raw, "timeout_seconds", 1.0, where, minimum=0.01),
        success_threshold=success,
        failure_threshold=_count(raw, "failure_threshold", 3, where),
        initial_delay_seconds=_number(raw, "initial_delay_seconds", 0.0, where),
    )


def _env(raw: object) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise _fail("env", raw, "give an object of string to string")
    for key, value in raw.items():
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            raise _fail("env key", key, "give a non-empty name without '=' or NUL")
        if not isinstance(value, str) or "\0" in value:
            raise _fail(f"env[{key!r}]", value, "give a string without NUL")
    return dict(raw)


def _principal(raw: object, where: str) -> str | int | None:
    if raw is None:
        return None
    if (
        isinstance(raw, bool)
        or not isinstance(raw, str | int)
        or raw == ""
        or (isinstance(raw, int) and raw < 0)
    ):
        raise _fail(where, raw, "give a name or a numeric id >= 0")
    return raw


def _group_entry(raw: object) -> str | int:
    entry = _principal(raw, "supplementary_groups[]")
    if entry is None:
        raise _fail("supplementary_groups[]", raw, "give a group name or a numeric id >= 0")
    return entry


def _rlimits(raw: object) -> dict[str, tuple[int, int]]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise _fail("rlimits", raw, "give an object such as {'nofile': [4096, 8192]}")
    result: dict[str, tuple[int, int]] = {}
    for name, given in raw.items():
        rlimit_resource(name)
        limits = [given, given] if isinstance(given, int) and not isinstance(given, bool) else given
        if (
            not isinstance(limits, list | tuple)
            or len(limits) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= -1 for v in limits)
        ):
            raise _fail(f"rlimits.{name}", limits, "give [soft, hard] as integers (-1 is unlimited)")
        soft, hard = limits
        if hard != -1 and (soft == -1 or soft > hard):
            raise _fail(f"rlimits.{name}", limits, "the soft limit must not exceed the hard limit")
        result[name] = (soft, hard)
    return result


_SPEC_KEYS = frozenset(f.name for f in dataclasses.fields(WorkerSpec))


def parse_worker_spec(raw: object) -> WorkerSpec:
    """Validate a JSON worker spec and apply its preset. Raises InvalidRequest naming the bad field."""
    if not isinstance(raw, Mapping):
        raise _fail("the spec", raw, "give a JSON object")
    unknown = sorted(set(raw) - _SPEC_KEYS)
    if unknown:
        raise _fail("the spec", unknown, f"these keys are unknown; known keys are {sorted(_SPEC_KEYS)}")
    preset = raw.get("preset")
    if preset is not None and preset not in PRESETS:
        raise _fail("preset", preset, f"use one of {sorted(PRESETS)}")
    command = raw.get("command")
    if command is None and preset in (None, "generic"):
        raise _fail("command", None, "give the worker's argv, or a preset that knows its command")
    try:
        restart = RestartPolicy(raw.get("restart", RestartPolicy.ON_FAILURE.value))
    except ValueError:
        raise _fail("restart", raw.get("restart"), "use never, on-failure or always") from None
    umask = raw.get("umask", 0o022)
    if isinstance(umask, bool) or not isinstance(umask, int) or not 0 <= umask <= 0o777:
        raise _fail("umask", umask, "give an integer between 0 and 0o777")
    workdir = raw.get("workdir")
    if workdir is not None and (not isinstance(workdir, str) or not workdir.startswith("/")):
        raise _fail("workdir", workdir, "give an absolute path")
    groups = raw.get("supplementary_groups", [])
    if not isinstance(groups, list | tuple):
        raise _fail("supplementary_groups", groups, "give a list of group names or ids")
    for key in ("model_name", "model_repository"):
        if raw.get(key) is not None and not isinstance(raw[key], str):
            raise _fail(key, raw[key], "give a string")
    spec = WorkerSpec(
        command=_argv(command, "command") if command is not None else (),
        env=_env(raw.get("env")),
        workdir=workdir,
        user=_principal(raw.get("user"), "user"),
        group=_principal(raw.get("group"), "group"),
        supplementary_groups=tuple(_group_entry(g) for g in groups),
        restart=restart,
        readiness=parse_probe(raw.get("readiness"), "readiness"),
        liveness=parse_probe(raw.get("liveness"), "liveness"),
        stop_grace_seconds=_number(raw, "stop_grace_seconds", 30.0, "spec"),
        rlimits=_rlimits(raw.get("rlimits")),
        umask=umask,
        preset=preset,
        port=_port(raw["port"], "port") if raw.get("port") is not None else None,
        model_name=raw.get("model_name"),
        model_repository=raw.get("model_repository"),
    )
    return apply_preset(spec)


# --- presets -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    """How to run and probe one kind of server. ``{port}``, ``{model}`` and ``{repo}`` are filled in."""

    command: tuple[str, ...]
    default_port: int
    #: Readiness path when the model is known, and when it is not.
    model_ready_path: str
    server_ready_path: str
    live_path: str


PRESETS: dict[str, Preset] = {
    "triton": Preset(
        command=("tritonserver", "--model-repository={repo}", "--http-port={port}"),
        default_port=8000,
        model_ready_path="/v2/models/{model}/ready",
        server_ready_path=OIP_READY_PATH,
        live_path=OIP_LIVE_PATH,
    ),
    "torchserve": Preset(
        # TorchServe's own inference API answers /ping; its KServe v2 front end is opt-in.
        command=(
            "torchserve",
            "--foreground",
            "--model-store={repo}",
            "--models={model}={model}.mar",
            "--disable-token-auth",
        ),
        default_port=8080,
        model_ready_path="/ping",
        server_ready_path="/ping",
        live_path="/ping",
    ),
    "tfserving": Preset(
        command=(
            "tensorflow_model_server",
            "--rest_api_port={port}",
            "--model_name={model}",
            "--model_base_path={repo}/{model}",
        ),
        default_port=8501,
        model_ready_path="/v1/models/{model}",
        server_ready_path="/v1/models/{model}",
        live_path="/v1/models/{model}",
    ),
    "generic": Preset(
        command=(),
        default_port=8000,
        model_ready_path="/v2/models/{model}/ready",
        server_ready_path=OIP_READY_PATH,
        live_path=OIP_LIVE_PATH,
    ),
}


def _fill(template: str, spec: WorkerSpec, port: int) -> str:
    needs_model = "{model}" in template
    needs_repo = "{repo}" in template
    if needs_model and spec.model_name is None:
        raise _fail("model_name", None, f"preset {spec.preset!r} needs the model's name")
    if needs_repo and spec.model_repository is None:
        raise _fail("model_repository", None, f"preset {spec.preset!r} needs the model repository's path")
    return template.format(port=port, model=spec.model_name or "", repo=spec.model_repository or "")


def apply_preset(spec: WorkerSpec) -> WorkerSpec:
    """Fill the command and probes a preset knows; fields the spec sets are kept as they are."""
    if spec.preset is None:
        return spec
    preset = PRESETS[spec.preset]
    port = spec.port or preset.default_port
    command = spec.command or tuple(_fill(arg, spec, port) for arg in preset.command)
    if spec.preset == "generic" and spec.port is None:
        # A generic command without a known port cannot be probed over HTTP; leave probes as given.
        return dataclasses.replace(spec, command=command)
    ready_template = preset.model_ready_path if spec.model_name else preset.server_ready_path
    readiness = spec.readiness or Probe(
        kind=ProbeKind.HTTP, port=port, path=_fill(ready_template, spec, port), period_seconds=2.0
    )
    liveness = spec.liveness or Probe(
        kind=ProbeKind.HTTP,
        port=port,
        path=_fill(preset.live_path, spec, port),
        period_seconds=10.0,
        # Model servers load weights before they answer; do not kill them for being slow to start.
        initial_delay_seconds=30.0,
    )
    return dataclasses.replace(spec, command=command, port=port, readiness=readiness, liveness=liveness)
