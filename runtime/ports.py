"""A worker's named ports: what it asks for, the host ports it gets, and the spec bound to them.

A worker declares named ports (``"ports": {"http": {}, "grpc": {"port": 9001}}``) or gets its
preset's; the agent gives each one a host port (the one asked for, or a free one from
``[workers] port_range``) and keeps it while the slot exists (agent/state.py). The spec is then
*bound*: ``{port:NAME}`` in its command and env becomes the number, probes that name a port get its
number, and ``NODEAGENT_PORT_<NAME>`` is set for each. Plain data and one socket check; no state.
"""

from __future__ import annotations

import errno
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nodeagent.errors import ConfigError, InvalidRequest
from nodeagent.runtime.env import DEFAULT_PATH
from nodeagent.schema.worker import PortProtocol, PreStop, Probe, WorkerSpec

#: ``{port:http}`` in a command argument or an env value: replaced by the port's number.
PLACEHOLDER = re.compile(r"\{port:([^{}]*)\}")
#: The default ``[workers] port_range``: below Linux's ephemeral range (32768-60999), so an
#: assigned port is not one the kernel hands out for outgoing connections.
DEFAULT_PORT_RANGE = "20000-29999"


@dataclass(frozen=True)
class PortWant:
    """One named port as the worker asks for it: a host port exactly, or None for any free one."""

    name: str
    protocol: PortProtocol
    port: int | None = None


@dataclass(frozen=True)
class SlotPort:
    """A named port as the slot holds it."""

    name: str
    protocol: PortProtocol
    port: int


@dataclass(frozen=True)
class Endpoint:
    """Where a slot's worker serves: the published form of a slot's port."""

    name: str
    protocol: PortProtocol
    address: str
    port: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "protocol": self.protocol, "address": self.address, "port": self.port}


def default_protocol(name: str) -> PortProtocol:
    return "grpc" if name == "grpc" else "http"


def env_name(name: str) -> str:
    """``NODEAGENT_PORT_HTTP`` for the port named ``http``."""
    return "NODEAGENT_PORT_" + name.upper()


def parse_port_range(text: str, key: str = "workers.port_range") -> tuple[int, int]:
    """``"20000-29999"`` -> (20000, 29999); ConfigError naming ``key`` otherwise."""
    match = re.fullmatch(r"\s*(\d{1,5})\s*-\s*(\d{1,5})\s*", text)
    first, last = (int(match.group(1)), int(match.group(2))) if match else (0, 0)
    if not match or not 1 <= first <= last <= 65535:
        raise ConfigError(
            f"{key} is {text!r}; give FIRST-LAST with 1 <= FIRST <= LAST <= 65535, "
            f"such as {DEFAULT_PORT_RANGE!r}"
        )
    return first, last


def in_use_on_host(port: int) -> bool:
    """True when something on this host listens on TCP ``port`` (any address, IPv4 or dual-stack IPv6).

    Binding the wildcard address conflicts with every listener on the port; SO_REUSEADDR lets a port
    that only has connections in TIME_WAIT count as free, as the server's own bind will.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))  # noqa: S104 - a bind check, closed at once
        except OSError as err:
            if err.errno in (errno.EADDRINUSE, errno.EACCES):
                return True
            raise
    return False


def placeholders(spec: WorkerSpec) -> set[str]:
    """The port names ``{port:NAME}`` refers to in the spec's command, args, env and files."""
    texts = [*(spec.command or ()), *spec.args, *spec.env.values(), *spec.files.values()]
    return {name for text in texts for name in PLACEHOLDER.findall(text)}


def substitute(text: str, ports: Mapping[str, int], where: str) -> str:
    def number(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in ports:
            raise InvalidRequest(
                f"worker spec: {where} refers to {match.group(0)}, but the worker has no port named "
                f"{name!r}; declare it in ports (such as \"ports\": {{{name!r}: {{}}}}) or use one of: "
                + (", ".join(sorted(ports)) or "none declared")
            )
        return str(ports[name])

    return PLACEHOLDER.sub(number, text)


def _probe_port(probe: Probe | None, ports: Mapping[str, int], where: str) -> Probe | None:
    if probe is None or not isinstance(probe.port, str):
        return probe
    name = probe.port
    if name not in ports:
        raise InvalidRequest(
            f"worker spec: {where} names port {name!r}, which the worker does not have; declare it in "
            f"ports or use one of: {', '.join(sorted(ports)) or 'none declared'}"
        )
    for kind in (probe.http, probe.tcp, probe.grpc):
        if kind is not None:
            check = kind.model_copy(update={"port": ports[name]})
            return probe.model_copy(update={probe.kind.value: check})
    return probe


def _pre_stop_port(spec: WorkerSpec, ports: Mapping[str, int]) -> PreStop | None:
    hook = spec.pre_stop
    if hook is None or hook.http is None or not isinstance(hook.http.port, str):
        return hook
    name = hook.http.port
    if name not in ports:
        raise InvalidRequest(
            f"worker spec: pre_stop names port {name!r}, which the worker does not have; declare it in "
            f"ports or use one of: {', '.join(sorted(ports)) or 'none declared'}"
        )
    return hook.model_copy(update={"http": hook.http.model_copy(update={"port": ports[name]})})


def bind(spec: WorkerSpec, ports: Mapping[str, int]) -> WorkerSpec:
    """The spec with its ports filled in: ``{port:NAME}`` in command, env and files, probes' and
    pre_stop's port names, and ``NODEAGENT_PORT_<NAME>`` for each; ``path`` put before the worker's
    PATH (the spec's own env wins over both). InvalidRequest naming what refers to a port the
    worker does not have."""
    command = None
    if spec.command is not None:
        command = tuple(substitute(arg, ports, f"command[{i}]") for i, arg in enumerate(spec.command))
    env = {env_name(name): str(number) for name, number in sorted(ports.items())}
    if spec.path:
        env["PATH"] = ":".join((*spec.path, DEFAULT_PATH))
    env.update({key: substitute(value, ports, f"env[{key!r}]") for key, value in spec.env.items()})
    files = {name: substitute(text, ports, f"files[{name!r}]") for name, text in spec.files.items()}
    return spec.model_copy(
        update={
            "command": command,
            "env": env,
            "files": files,
            "readiness": _probe_port(spec.readiness, ports, "readiness"),
            "liveness": _probe_port(spec.liveness, ports, "liveness"),
            "pre_stop": _pre_stop_port(spec, ports),
        }
    )


__all__ = [
    "DEFAULT_PORT_RANGE",
    "PLACEHOLDER",
    "Endpoint",
    "PortWant",
    "SlotPort",
    "bind",
    "default_protocol",
    "env_name",
    "in_use_on_host",
    "parse_port_range",
    "placeholders",
    "substitute",
]
