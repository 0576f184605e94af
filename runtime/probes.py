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

import errno
import http.client
import json
import socket
import subprocess
import time
from dataclasses import dataclass
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


#: How much of a failing answer's body a probe result keeps (one line, for people).
EXCERPT_CHARS = 200


@dataclass(frozen=True)
class ProbeResult:
    """One probe's outcome as people need it when a worker is not ready: whether it passed, what
    exactly came back, when (Unix time), and whether the answer is *definite*: one that will not
    change by itself while the server loads (no such path, authentication asked, a redirect, not
    HTTP, no health service), as opposed to "not yet" (refused, no answer, 503, not serving)."""

    passed: bool
    definite: bool
    detail: str
    at: float
    #: For a failure: the likely cause, and what to look at (empty when nothing better than the
    #: detail can be said).
    cause: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "definite": self.definite,
            "detail": self.detail,
            "at": self.at,
            "cause": self.cause,
        }

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> ProbeResult:
        return cls(
            passed=bool(body["passed"]),
            definite=bool(body.get("definite")),
            detail=str(body.get("detail", "")),
            at=float(body["at"]),
            cause=str(body.get("cause", "")),
        )


def _result(passed: bool, detail: str, *, definite: bool = False, cause: str = "") -> ProbeResult:
    return ProbeResult(passed, definite and not passed, detail, time.time(), "" if passed else cause)


def _unreachable(detail: str, where: str) -> ProbeResult:
    return _result(
        False,
        detail,
        cause=f"nothing answers on {where}: the server is still starting, listens on another port or "
        "interface, or has failed; its log (`nodeagent slots logs`) says which",
    )


def _silent(where: str, timeout: float) -> ProbeResult:
    return _result(
        False,
        f"no answer from {where} within {timeout:g}s",
        cause=f"{where} takes connections but does not answer within {timeout:g}s: the server is busy "
        "or stuck (raise the probe's timeout_seconds if it is only slow)",
    )


#: HTTP answers that do not turn into "ready" while a server loads: the path is not there, or the
#: probe is not let in (a redirect counts too, unless the probe's `status` accepts it).
DEFINITE_HTTP = frozenset({401, 403, 404, 405})


def http_cause(status: int, path: str) -> str:
    """The likely cause of an HTTP answer a probe did not accept, by its status."""
    if status == 404:
        return (
            f"the server answers, but has nothing at {path}: check the probe's path and the model name "
            "the server registered (its log lists the models it loaded)"
        )
    if status == 405:
        return f"the server does not answer GET at {path}: probe a path it answers with GET"
    if status in (401, 403):
        return f"the server refuses the probe's unauthenticated GET {path}: probe a path it answers openly"
    if 300 <= status < 400:
        return f"the server redirects {path}: probe the path it redirects to, or accept 3xx in `status`"
    return "the server answers that it is not ready: it may still be loading; its log says why"


def check_probe(probe: Probe, host: str) -> bool:
    """Run one probe: True when it passes (:func:`run_probe` says why not)."""
    return run_probe(probe, host).passed


def run_probe(probe: Probe, host: str) -> ProbeResult:
    """Run one probe. Never raises for what the worker does (a refused connection, a timeout, a
    malformed answer are failures, described)."""
    port = probe.port
    if isinstance(port, str):
        # Port names are bound to numbers before a supervisor exists (runtime.ports.bind).
        raise ValueError(f"probe port {port!r} was never bound to a host port")
    where = f"{host}:{port}"
    try:
        if probe.http is not None:
            return run_http(probe.http, host, probe.timeout_seconds)
        if probe.grpc is not None:
            return run_grpc(probe.grpc, host, probe.timeout_seconds)
        if probe.kind is ProbeKind.TCP:
            with socket.create_connection((host, port or 0), timeout=probe.timeout_seconds):
                return _result(True, f"{where} takes connections")
        completed = subprocess.run(
            list(probe.argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=probe.timeout_seconds,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return _result(False, f"the command did not end within {probe.timeout_seconds:g}s")
    except TimeoutError:
        return _silent(where, probe.timeout_seconds)
    except OSError as err:
        return _unreachable(describe_os_error(err, where), where)
    except http.client.HTTPException as err:
        return _result(
            False,
            f"a malformed HTTP answer from {where}: {type(err).__name__}",
            definite=True,
            cause=f"what listens on {where} does not speak HTTP/1.1: is the port the server's HTTP port?",
        )
    return _result(completed.returncode == 0, f"the command exited with status {completed.returncode}")


def describe_os_error(err: OSError, where: str) -> str:
    if err.errno == errno.ECONNREFUSED:
        return f"connection refused: nothing listens on {where}"
    name = errno.errorcode.get(err.errno or 0, "")
    return f"cannot connect to {where}: {err.strerror or err}" + (f" ({name})" if name else "")


def check_http(check: HttpCheck, host: str, timeout: float) -> bool:
    return run_http(check, host, timeout).passed


def run_http(check: HttpCheck, host: str, timeout: float) -> ProbeResult:
    assert isinstance(check.port, int)
    conn = http.client.HTTPConnection(host, check.port, timeout=timeout)
    try:
        conn.request("GET", check.path, headers={"User-Agent": "nodeagent-probe"})
        answer = conn.getresponse()
        body = answer.read(MAX_PROBE_BODY)
    finally:
        conn.close()
    said = f"GET {check.path}: HTTP {answer.status}"
    if not check.status_passes(answer.status):
        return _result(
            False,
            f"{said} {excerpt(body)}".rstrip(),
            definite=answer.status in DEFINITE_HTTP or 300 <= answer.status < 400,
            cause=http_cause(answer.status, check.path),
        )
    if check.body is not None and not body_matches(check.body, body):
        return _result(
            False,
            f"{said}, but the body does not match: {excerpt(body)}",
            cause="the server answers, but its body is not yet what the probe's `body` check expects "
            "(still loading?)",
        )
    return _result(True, said)


def excerpt(body: bytes) -> str:
    """The start of an answer's body on one line (empty for none)."""
    text = " ".join(body.decode("utf-8", "replace").split())
    return text if len(text) <= EXCERPT_CHARS else text[: EXCERPT_CHARS - 3] + "..."


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
    return run_grpc(check, host, timeout).passed


def run_grpc(check: GrpcCheck, host: str, timeout: float) -> ProbeResult:
    import httpx  # noqa: PLC0415 - only gRPC probes need it (and its HTTP/2 layer)

    assert isinstance(check.port, int)
    where = f"{host}:{check.port}"
    # verify=False: plain text, and no TLS context is built (it costs ~20 ms each time).
    with httpx.Client(http1=False, http2=True, timeout=timeout, verify=False) as client:  # noqa: S501
        try:
            answer = client.post(
                f"http://{_host(host)}:{check.port}{GRPC_HEALTH_PATH}",
                content=grpc_request(check.service),
                headers={"content-type": "application/grpc", "te": "trailers"},
            )
        except httpx.TimeoutException:
            return _silent(where, timeout)
        except httpx.ConnectError as err:
            cause = err.__cause__ or err.__context__
            while cause is not None and not isinstance(cause, OSError):
                cause = cause.__cause__ or cause.__context__
            detail = describe_os_error(cause, where) if cause is not None else f"cannot connect to {where}"
            return _unreachable(detail, where)
        except httpx.HTTPError as err:
            return _result(False, f"gRPC health check of {where}: {type(err).__name__}")
    service = f" of service {check.service!r}" if check.service else ""
    # A failed call (unknown service, UNIMPLEMENTED) answers with grpc-status in trailers only.
    status = answer.headers.get("grpc-status", "0")
    if answer.status_code != 200 or status != "0":
        message = answer.headers.get("grpc-message", "")
        said = f"HTTP {answer.status_code}, grpc-status {status}" + (f" ({message})" if message else "")
        return _result(
            False,
            f"gRPC health check{service}: {said}",
            definite=True,
            cause="the server answers gRPC but not the health check: it may not implement "
            "grpc.health.v1, or not for this service name",
        )
    if not grpc_serving(answer.content):
        return _result(
            False,
            f"gRPC health check{service}: not SERVING",
            cause="the server answers that it is not serving yet: it may still be loading; its log says why",
        )
    return _result(True, f"gRPC health check{service}: SERVING")


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
    "ProbeResult",
    "body_matches",
    "call_http",
    "check_grpc",
    "check_http",
    "check_probe",
    "describe_os_error",
    "excerpt",
    "grpc_request",
    "grpc_serving",
    "http_cause",
    "json_field",
    "run_grpc",
    "run_http",
    "run_probe",
    "same_json",
]
