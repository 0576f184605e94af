"""Presets: how to run and probe the servers the runtime knows (Triton, TorchServe, TF Serving, a
generic Open Inference Protocol server).

A spec names a preset; :func:`resolve` fills in the command and the probes the spec leaves out, so
the spec's own values always win. The supervisor runs the resolved spec.
"""

from __future__ import annotations

from dataclasses import dataclass

from nodeagent.errors import InvalidRequest
from nodeagent.schema.worker import (
    OIP_LIVE_PATH,
    OIP_READY_PATH,
    PRESET_NAMES,
    HttpCheck,
    Probe,
    WorkerSpec,
)


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
assert set(PRESETS) == set(PRESET_NAMES), "every preset the schema names is defined here"


def _fill(template: str, spec: WorkerSpec, port: int) -> str:
    if "{model}" in template and spec.model_name is None:
        raise InvalidRequest(
            f"worker spec: model_name is missing; preset {spec.preset!r} needs the model's name"
        )
    if "{repo}" in template and spec.model_repository is None:
        raise InvalidRequest(
            f"worker spec: model_repository is missing; preset {spec.preset!r} needs the path of the "
            "model repository"
        )
    return template.format(port=port, model=spec.model_name or "", repo=spec.model_repository or "")


def resolve(spec: WorkerSpec) -> WorkerSpec:
    """The spec as the runtime runs it: the preset's command and probes where the spec has none.
    InvalidRequest when the preset needs a field the spec lacks."""
    if spec.preset is None:
        return spec
    preset = PRESETS[spec.preset]
    port = spec.port or preset.default_port
    command = spec.command or tuple(_fill(arg, spec, port) for arg in preset.command)
    if spec.preset == "generic" and spec.port is None:
        # A generic command without a known port cannot be probed over HTTP; leave probes as given.
        return spec.model_copy(update={"command": command})
    ready_template = preset.model_ready_path if spec.model_name else preset.server_ready_path
    readiness = spec.readiness or Probe(
        http=HttpCheck(port=port, path=_fill(ready_template, spec, port)), period_seconds=2.0
    )
    liveness = spec.liveness or Probe(
        http=HttpCheck(port=port, path=_fill(preset.live_path, spec, port)),
        period_seconds=10.0,
        # Model servers load weights before they answer; do not kill them for being slow to start.
        initial_delay_seconds=30.0,
    )
    return spec.model_copy(
        update={"command": command, "port": port, "readiness": readiness, "liveness": liveness}
    )


__all__ = ["PRESETS", "Preset", "resolve"]
