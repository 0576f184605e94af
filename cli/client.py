"""The CLI's HTTP client for the agent's REST API.

Where to find the agent: ``--api`` / ``NODEAGENT_API`` (default http://127.0.0.1:7070) and the token
in ``--token-file`` / ``NODEAGENT_TOKEN_FILE`` (default: ``<state dir>/token``, the file
``nodeagent serve`` writes on first start). Errors come back as the project's errors carrying the
server's message: the API's ``error.code`` picks the class (``does_not_fit`` -> PlacementError,
``not_found`` -> NotFound, ...), so the CLI prints them as it prints local errors.

The requests go through ``nodeagent.cli.transport`` (HTTP/1.1 on a socket), not httpx: importing
httpx took ~65 ms of the 80 ms a whole ``nodeagent slots list`` may take (see that module's header).
What the CLI relied on from httpx is kept: one keep-alive connection, one timeout (60 s) for
connecting and for each read or write, JSON bodies, and the error messages (a refused connection, a
timeout named ConnectTimeout, WriteTimeout or ReadTimeout, a URL without http:// or https://).
Proxy variables (HTTP_PROXY, ...) are not read: the agent is on this host or reached directly.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple
from urllib.parse import quote, urlencode

from nodeagent import __version__
from nodeagent.cli.transport import ApiEndpoint, Connection, HttpProtocolError, parse_url
from nodeagent.defaults import DEFAULT_API, default_token_file
from nodeagent.errors import (
    CgroupError,
    ConfigError,
    Conflict,
    DeviceAccessError,
    DiscoveryError,
    InvalidRequest,
    KernelError,
    NetworkError,
    NodeAgentError,
    NotFound,
    PlacementError,
    Unsupported,
    WorkerError,
)

API_ENV = "NODEAGENT_API"
TOKEN_FILE_ENV = "NODEAGENT_TOKEN_FILE"  # noqa: S105 - the name of a variable, not a secret
DEFAULT_TIMEOUT_SECONDS = 60.0


class AgentUnreachable(NodeAgentError):
    """The agent's API could not be reached (not running, wrong address, timed out)."""

    code = "unreachable"


_ERRORS_BY_CODE: dict[str, type[NodeAgentError]] = {
    cls.code: cls
    for cls in (
        ConfigError,
        InvalidRequest,
        DiscoveryError,
        PlacementError,
        NotFound,
        Conflict,
        KernelError,
        CgroupError,
        DeviceAccessError,
        NetworkError,
        Unsupported,
        WorkerError,
    )
}
_ERRORS_BY_STATUS: dict[int, type[NodeAgentError]] = {
    400: InvalidRequest,
    401: ConfigError,
    404: NotFound,
    409: Conflict,
    413: InvalidRequest,
    415: InvalidRequest,
    422: InvalidRequest,
}


def resolve_api(api: str | None) -> str:
    return (api or os.environ.get(API_ENV) or DEFAULT_API).rstrip("/")


def resolve_token_file(token_file: Path | None) -> Path:
    if token_file is not None:
        return token_file
    from_env = os.environ.get(TOKEN_FILE_ENV)
    return Path(from_env) if from_env else default_token_file()


def read_token(path: Path) -> str:
    """The bearer token in ``path``; ConfigError saying what to do when it cannot be read."""
    try:
        token = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise ConfigError(
            f"no API token at {path}; `nodeagent serve` writes it on first start. Pass --token-file "
            f"or set {TOKEN_FILE_ENV} to the agent's token file"
        ) from None
    except OSError as err:
        raise ConfigError(
            f"cannot read the API token {path}: {err.strerror or err}; run as the agent's user "
            f"(root for the system service) or pass --token-file"
        ) from err
    if not token:
        raise ConfigError(f"the API token file {path} is empty; restart the agent to write a new one")
    return token


class Response(NamedTuple):
    """One answer of the agent, read whole (the API's bodies are small JSON documents)."""

    method: str
    path: str  #: the URL's path, without the query
    host: str
    status: int
    reason: str
    body: bytes

    @property
    def is_error(self) -> bool:
        return self.status >= 400

    def json(self) -> Any:
        return json.loads(self.body)


class AgentClient:
    """Calls the agent's /v1 API; returns decoded JSON, raises the project's errors."""

    def __init__(self, base_url: str, token: str, *, timeout: float = DEFAULT_TIMEOUT_SECONDS) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._headers = {
            "Authorization": f"Bearer {token}",
            "Accept": "application/json",
            "User-Agent": f"nodeagent-cli/{__version__}",
        }
        self._connection: Connection | None = None

    @classmethod
    def from_options(cls, api: str | None = None, token_file: Path | None = None) -> AgentClient:
        """The client the CLI options (or their environment variables and defaults) describe."""
        return cls(resolve_api(api), read_token(resolve_token_file(token_file)))

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    # --- the API

    def node(self) -> dict[str, Any]:
        return self._json("GET", "/v1/node")

    def topology(self) -> dict[str, Any]:
        return self._json("GET", "/v1/topology")

    def capacity(self) -> dict[str, Any]:
        return self._json("GET", "/v1/capacity")

    def list_slots(self) -> list[dict[str, Any]]:
        slots: list[dict[str, Any]] = self._json("GET", "/v1/slots")["slots"]
        return slots

    def get_slot(self, slot_id: str) -> dict[str, Any]:
        return self._json("GET", _slot_path(slot_id))

    def allocate(self, request: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
        """The slot, and True when it was created (False: it existed with the same request)."""
        response = self._send("POST", "/v1/slots", body=dict(request))
        return _decode(response), response.status == 201

    def resize(self, slot_id: str, resources: Mapping[str, Any]) -> dict[str, Any]:
        return self._json("PATCH", _slot_path(slot_id), body={"resources": dict(resources)})

    def release(self, slot_id: str) -> None:
        self._send("DELETE", _slot_path(slot_id))

    def start_worker(self, slot_id: str, spec: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return self._json("POST", _slot_path(slot_id, "worker"), body=None if spec is None else dict(spec))

    def stop_worker(self, slot_id: str) -> dict[str, Any]:
        return self._json("DELETE", _slot_path(slot_id, "worker"))

    def logs(self, slot_id: str, lines: int = 100) -> list[str]:
        body = self._json("GET", _slot_path(slot_id, "logs"), query={"lines": lines})
        return [str(line) for line in body["lines"]]

    def cdi_spec(self, slot_id: str) -> dict[str, Any]:
        return self._json("GET", _slot_path(slot_id, "cdi"))

    def log_entries(self, slot_id: str, lines: int = 100, since: str | None = None) -> list[dict[str, str]]:
        """The lines with their stream and time (``since``: only complete lines after that time)."""
        query: dict[str, Any] = {"lines": lines}
        if since is not None:
            query["since"] = since
        body = self._json("GET", _slot_path(slot_id, "logs"), query=query)
        keys = ("time", "stream", "text")
        return [{key: str(e.get(key, "")) for key in keys} for e in body.get("entries", [])]

    def list_pools(self) -> list[dict[str, Any]]:
        pools: list[dict[str, Any]] = self._json("GET", "/v1/pools")["pools"]
        return pools

    def get_pool(self, name: str) -> dict[str, Any]:
        return self._json("GET", _pool_path(name))

    def create_pool(self, spec: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
        """The pool, and True when it was created (False: it existed with the same spec)."""
        response = self._send("POST", "/v1/pools", body=dict(spec))
        return _decode(response), response.status == 201

    def resize_pool(self, name: str, size: int) -> dict[str, Any]:
        return self._json("PATCH", _pool_path(name), body={"size": size})

    def delete_pool(self, name: str) -> None:
        self._send("DELETE", _pool_path(name))

    # --- the I/O boundary

    def get(self, path: str, query: Mapping[str, Any] | None = None) -> Response:
        """One GET of ``path`` (``/metrics``, ``/v1/slots``), its answer read whole and not parsed:
        for a caller that wants the bytes as they came (or, a benchmark, their time alone)."""
        return self._send("GET", path, query=query)

    def _json(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        return _decode(self._send(method, path, **kwargs))

    def _send(
        self, method: str, path: str, *, body: Any = None, query: Mapping[str, Any] | None = None
    ) -> Response:
        """One request; ``body`` (when not None) is sent as JSON. Raises AgentUnreachable when no
        answer came, and the project's error for an error answer."""
        endpoint = self._endpoint()
        target = endpoint.path_prefix + path
        headers = dict(self._headers)
        payload = None
        if body is not None:
            payload = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        stage = "ConnectTimeout"
        try:
            connection = self._connection_to(endpoint)
            connection.open()
            stage = "WriteTimeout"
            connection.send(method, target + (f"?{urlencode(query)}" if query else ""), headers, payload)
            stage = "ReadTimeout"
            answer = connection.receive(method)
        except TimeoutError as err:
            self.close()
            raise AgentUnreachable(
                f"the agent at {self.base_url} did not answer {method} {path} in time ({stage})"
            ) from err
        except (OSError, HttpProtocolError) as err:
            self.close()
            raise self._unreachable(str(err) or type(err).__name__) from err
        response = Response(method, target, endpoint.host, answer.status, answer.reason, answer.body)
        if response.is_error:
            raise error_from_response(response)
        return response

    def _endpoint(self) -> ApiEndpoint:
        try:
            return parse_url(self.base_url)
        except ValueError as err:
            raise self._unreachable(str(err)) from None

    def _connection_to(self, endpoint: ApiEndpoint) -> Connection:
        if self._connection is None:
            self._connection = Connection(endpoint, self.timeout)
        return self._connection

    def _unreachable(self, reason: str) -> AgentUnreachable:
        return AgentUnreachable(
            f"cannot reach the agent at {self.base_url}: {reason}; "
            f"is `nodeagent serve` running? (set --api or {API_ENV} if it listens elsewhere)"
        )


def _pool_path(name: str) -> str:
    from nodeagent.schema.pool import POOL_NAME  # noqa: PLC0415

    if POOL_NAME.fullmatch(name) is None:
        raise InvalidRequest(
            f"{name!r} is not a pool name; they are 1-48 characters of a-z, 0-9, '_' or '-' starting with "
            "a letter or digit (`nodeagent pools list` shows them)"
        )
    return f"/v1/pools/{name}"


def _slot_path(slot_id: str, *rest: str) -> str:
    # Checked here as well as by the server: an id with '/' would otherwise address another path.
    # The schema is imported here, not at the top: `slots list` names no slot and need not load it.
    from nodeagent.schema.request import NAME_PATTERN  # noqa: PLC0415

    if NAME_PATTERN.fullmatch(slot_id) is None:
        raise InvalidRequest(
            f"{slot_id!r} is not a slot id or name; they are 1-63 characters of a-z, 0-9, '.', '_' or '-' "
            "starting with a letter or digit (`nodeagent slots list` shows them)"
        )
    return "/".join(("/v1/slots", quote(slot_id, safe=""), *rest))


def _decode(response: Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError as err:
        raise NodeAgentError(
            f"the agent answered {response.method} {response.path} with "
            f"HTTP {response.status} but not JSON; is {response.host} a nodeagent?"
        ) from err
    if not isinstance(body, dict):
        raise NodeAgentError(f"the agent answered with {type(body).__name__}, expected a JSON object")
    return body


def error_from_response(response: Response) -> NodeAgentError:
    """The project's error for an API error response, with the server's message."""
    code, message = _error_body(response)
    cls = _ERRORS_BY_CODE.get(code) or _ERRORS_BY_STATUS.get(response.status, NodeAgentError)
    if response.status == 401:
        message += "; check --token-file / " + TOKEN_FILE_ENV
    return cls(message)


def _error_body(response: Response) -> tuple[str, str]:
    fallback = f"the agent answered HTTP {response.status} {response.reason}"
    try:
        error = response.json()["error"]
        return str(error["code"]), str(error["message"])
    except (ValueError, KeyError, TypeError):
        return "", fallback
