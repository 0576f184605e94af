"""Running one probe for real: an HTTP answer (its status, and what its body holds), a TCP connect, a
gRPC health check, or a command (without the keeper: tests and unsandboxed use).

The gRPC check is the standard ``grpc.health.v1.Health/Check`` over HTTP/2 without TLS ("prior
knowledge", as gRPC clients speak to a plain-text port), sent with httpx and its HTTP/2 layer
(``h2``, pure Python). Why not grpcio: the agent makes one unary call with a one-field request and
a one-field answer; grpcio would bring a C core with threads of its own, and generated stubs, into
a daemon that otherwise has neither, for a message that is five bytes of framing and a varint.
The two protobuf messages are encoded and decoded by hand below (field 1 of each).
"""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
from typing import Any

from nodeagent.schema.worker import (
    MAX_PROBE_BODY,
    BodyMatch,
    GrpcCheck,
    HttpCall,
    HttpCheck,
    Probe,
    ProbeKind,
)

#: grpc.health.v1.HealthCheckResponse.ServingStatus.SERVING
GRPC_SERVING = 1
GRPC_HEALTH_PATH = "/grpc.health.v1.Health/Check"


def check_probe(probe: Probe, host: str) -> bool:
    """Run one probe: True when it passes. Never raises for what the worker does (a refused
    connection, a timeout, a malformed answer are failures)."""
    port = probe.port
    if isinstance(port, str):
        # Port names are bound to numbers before a supervisor exists (runtime.ports.bind).
        raise ValueError(f"probe port {port!r} was never bound to a host port")
    try:
        if probe.http is not None:
            return check_http(probe.http, host, probe.timeout_seconds)
        if probe.grpc is not None:
            return check_grpc(probe.grpc, host, probe.timeout_seconds)
        if probe.kind is ProbeKind.TCP:
            with socket.create_connection((host, port or 0), timeout=probe.timeout_seconds):
                return True
        completed = subprocess.run(
            list(probe.argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=probe.timeout_seconds,
            check=False,
        )
    except (OSError, http.client.HTTPException, subprocess.TimeoutExpired):
        return False
    return completed.returncode == 0


def check_http(check: HttpCheck, host: str, timeout: float) -> bool:
    assert isinstance(check.port, int)
    conn = http.client.HTTPConnection(host, check.port, timeout=timeout)
    try:
        conn.request("GET", check.path, headers={"User-Agent": "nodeagent-probe"})
        answer = conn.getresponse()
        if not check.status_passes(answer.status):
            return False
        return check.body is None or body_matches(check.body, answer.read(MAX_PROBE_BODY))
    finally:
        conn.close()


def call_http(call: HttpCall, host: str, timeout: float) -> bool:
    """A pre_stop request: True on a 2xx or 3xx answer."""
    assert isinstance(call.port, int)
    conn = http.client.HTTPConnection(host, call.port, timeout=timeout)
    try:
        conn.request(call.method, call.path, headers={"User-Agent": "nodeagent-pre-stop"})
        return 200 <= conn.getresponse().status < 400
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def body_matches(match: BodyMatch, body: bytes) -> bool:
    if match.contains is not None:
        return match.contains in body.decode("utf-8", "replace")
    try:
        document = json.loads(body)
    except ValueError:
        return False
    found, value = json_field(document, match.json_field or "")
    return found and same_json(value, match.equals)


def same_json(a: Any, b: Any) -> bool:
    """JSON equality: 1 == 1.0, but true is not 1 and "1" is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    return type(a) is type(b) and bool(a == b)


def json_field(document: Any, path: str) -> tuple[bool, Any]:
    """``"0.workers.0.status"`` in ``document``: (found, value); list items by number."""
    value = document
    for part in path.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return False, None
    return True, value


def grpc_request(service: str) -> bytes:
    """A length-prefixed, uncompressed gRPC message holding HealthCheckRequest{service}."""
    raw = service.encode()
    message = b"" if not raw else b"\x0a" + _varint(len(raw)) + raw
    return b"\x00" + len(message).to_bytes(4, "big") + message


def grpc_serving(body: bytes) -> bool:
    """Whether a gRPC answer body holds HealthCheckResponse{status: SERVING}."""
    if len(body) < 5 or body[0] != 0:  # compressed: we asked for none
        return False
    message = body[5 : 5 + int.from_bytes(body[1:5], "big")]
    status, at = 0, 0
    while at < len(message):
        key, at = _read_varint(message, at)
        if key & 7 != 0:  # only varints are expected; anything else is not a health answer
            return False
        value, at = _read_varint(message, at)
        if key >> 3 == 1:
            status = value
    return status == GRPC_SERVING


def check_grpc(check: GrpcCheck, host: str, timeout: float) -> bool:
    import httpx  # noqa: PLC0415 - only gRPC probes need it (and its HTTP/2 layer)

    assert isinstance(check.port, int)
    # verify=False: plain text, and no TLS context is built (it costs ~20 ms each time).
    with httpx.Client(http1=False, http2=True, timeout=timeout, verify=False) as client:  # noqa: S501
        try:
            answer = client.post(
                f"http://{_host(host)}:{check.port}{GRPC_HEALTH_PATH}",
                content=grpc_request(check.service),
                headers={"content-type": "application/grpc", "te": "trailers"},
            )
        except httpx.HTTPError:
            return False
    # A failed call (unknown service, UNIMPLEMENTED) answers with grpc-status in trailers only.
    if answer.status_code != 200 or answer.headers.get("grpc-status", "0") != "0":
        return False
    return grpc_serving(answer.content)


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _read_varint(data: bytes, at: int) -> tuple[int, int]:
    value, shift = 0, 0
    while at < len(data):
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if not byte & 0x80:
            return value, at
        shift += 7
    return -1, at


__all__ = [
    "body_matches",
    "call_http",
    "check_grpc",
    "check_http",
    "check_probe",
    "grpc_request",
    "grpc_serving",
    "json_field",
    "same_json",
]
