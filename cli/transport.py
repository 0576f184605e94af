"""HTTP/1.1 over one socket: what the CLI needs to talk to the agent's API, and nothing more.

Why not a library: every ``nodeagent slots ...`` imports its HTTP stack before it sends a byte,
and the whole command has 80 ms. Measured on a 2-vCPU machine, importing httpx (with httpcore,
h11, anyio, idna, certifi) took ~65 ms and the standard library's http.client ~18 ms (it loads the
email package to parse headers, and ssl); this module adds ~1 ms to ``socket``. The peer is one
server we ship (uvicorn) answering small JSON documents, so the protocol subset is small, and
tests/cli/test_client_transport.py drives each part of it against a scripted server.

Handled: keep-alive (a connection the agent has closed while idle is detected before it is reused),
bodies delimited by Content-Length, by chunked transfer coding (a proxy in between may use it) or by
the end of the connection; ``Connection: close`` and HTTP/1.0 answers; interim 1xx answers; HTTPS
(``ssl`` is imported only then, with the system's certificate store). One timeout applies to
connecting and to each read and write. Not handled, because the API never needs them: redirects,
compression, ``Expect: 100-continue``, proxies from the environment (the agent is on this host or
reached directly), unix sockets (the CLI has never had an option for one).
"""

from __future__ import annotations

import select
import socket
from typing import BinaryIO, NamedTuple
from urllib.parse import urlsplit

#: Longest status or header line, and most header lines, accepted from the agent.
MAX_LINE_BYTES = 65536
MAX_HEADERS = 100


class HttpProtocolError(Exception):
    """The other end's answer is not HTTP/1.x as this module reads it."""


class ApiEndpoint(NamedTuple):
    """Where the API is, from its URL."""

    https: bool
    host: str
    port: int | None  #: None: the scheme's own
    path_prefix: str  #: "" unless the API sits under a path (behind a proxy)

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port is None else f"{host}:{self.port}"


def parse_url(url: str) -> ApiEndpoint:
    """The endpoint of an ``http://`` or ``https://`` URL; ValueError saying what is wrong."""
    parts = urlsplit(url)
    if not parts.scheme:
        raise ValueError("Request URL is missing an 'http://' or 'https://' protocol.")
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"Request URL has an unsupported protocol '{parts.scheme}://'.")
    try:
        port = parts.port
    except ValueError as err:
        raise ValueError(f"the URL's port is not valid ({err})") from None
    if not parts.hostname:
        raise ValueError("the URL names no host")
    return ApiEndpoint(parts.scheme == "https", parts.hostname, port, parts.path.rstrip("/"))


class Answer(NamedTuple):
    status: int
    reason: str
    body: bytes


class Connection:
    """One HTTP/1.1 connection; ``open``, then ``send`` and ``receive`` in turn, as often as the
    agent keeps it open (``is_open`` says whether it still is)."""

    def __init__(self, endpoint: ApiEndpoint, timeout: float) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._reader: BinaryIO | None = None

    @property
    def is_open(self) -> bool:
        return self._sock is not None

    def open(self) -> None:
        """Connect, unless connected and still usable: an idle keep-alive connection that has
        something to read holds only the agent's end of file (uvicorn closes idle ones after 5 s)."""
        if self._sock is not None:
            readable, _, _ = select.select([self._sock], [], [], 0)
            if not readable:
                return
            self.close()
        default_port = 443 if self.endpoint.https else 80
        sock = socket.create_connection(
            (self.endpoint.host, self.endpoint.port or default_port), self.timeout
        )
        if self.endpoint.https:
            import ssl  # noqa: PLC0415 - ~10 ms that plain-HTTP commands (the usual case) never pay

            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=self.endpoint.host)
        self._sock = sock
        self._reader = sock.makefile("rb")

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def send(self, method: str, target: str, headers: dict[str, str], body: bytes | None) -> None:
        if self._sock is None:
            raise HttpProtocolError("send on a connection that is not open")
        lines = [f"{method} {target} HTTP/1.1", f"Host: {self.endpoint.host_header}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        if body is not None or method in ("POST", "PUT", "PATCH"):
            lines.append(f"Content-Length: {len(body or b'')}")
        # One write: the request is small, and a split head and body would wait on Nagle's algorithm.
        self._sock.sendall("\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + (body or b""))

    def receive(self, method: str) -> Answer:
        """The answer to the request just sent, read whole."""
        status, reason, version = self._read_status()
        headers = self._read_headers()
        while 100 <= status < 200:  # interim answers (100 Continue, 103 Early Hints) precede the real one
            status, reason, version = self._read_status()
            headers = self._read_headers()
        connection_tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
        keep_alive = "close" not in connection_tokens and (
            version != "HTTP/1.0" or "keep-alive" in connection_tokens
        )
        if method == "HEAD" or status in (204, 304):
            body = b""
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            body = self._read_chunked()
        elif "content-length" in headers:
            body = self._read_exactly(_content_length(headers["content-length"]))
        else:
            body = self._reader_or_fail().read()  # delimited by the end of the connection
            keep_alive = False
        if not keep_alive:
            self.close()
        return Answer(status, reason, body)

    # --- reading

    def _reader_or_fail(self) -> BinaryIO:
        if self._reader is None:
            raise HttpProtocolError("receive on a connection that is not open")
        return self._reader

    def _read_line(self) -> bytes:
        line = self._reader_or_fail().readline(MAX_LINE_BYTES + 1)
        if len(line) > MAX_LINE_BYTES:
            raise HttpProtocolError(f"the answer has a line longer than {MAX_LINE_BYTES} bytes")
        return line

    def _read_status(self) -> tuple[int, str, str]:
        line = self._read_line()
        if not line:
            raise HttpProtocolError("the connection was closed before an answer came")
        version, _, rest = line.decode("latin-1").rstrip("\r\n").partition(" ")
        code, _, reason = rest.partition(" ")
        if not version.startswith("HTTP/1.") or len(code) != 3 or not code.isdigit():
            raise HttpProtocolError(f"the answer does not start with an HTTP/1.x status line: {line[:60]!r}")
        return int(code), reason.strip(), version

    def _read_headers(self) -> dict[str, str]:
        headers: dict[str, str] = {}
        for _ in range(MAX_HEADERS + 1):
            line = self._read_line()
            if line in (b"\r\n", b"\n"):
                return headers
            name, colon, value = line.decode("latin-1").partition(":")
            if not colon:
                raise HttpProtocolError(f"the answer has a malformed header line: {line[:60]!r}")
            key = name.strip().lower()
            headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
        raise HttpProtocolError(
            f"the answer has more than {MAX_HEADERS} header lines, or its head never ends"
        )

    def _read_exactly(self, size: int) -> bytes:
        data = self._reader_or_fail().read(size)
        if len(data) < size:
            raise HttpProtocolError(f"the connection was closed {len(data)} bytes into a {size}-byte answer")
        return data

    def _read_chunked(self) -> bytes:
        chunks = []
        while True:
            size_text = self._read_line().split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise HttpProtocolError(
                    f"the answer has a malformed chunk size: {size_text[:20]!r}"
                ) from None
            if size == 0:
                break
            chunks.append(self._read_exactly(size))
            if self._read_line() not in (b"\r\n", b"\n"):
                raise HttpProtocolError("a chunk of the answer does not end where its size says")
        while self._read_line() not in (b"\r\n", b"\n", b""):
            pass  # trailer fields: none that matter here
        return b"".join(chunks)


def _content_length(value: str) -> int:
    # Repeated identical values arrive joined ("12, 12"); differing ones mean the answer is unreadable.
    values = {v.strip() for v in value.split(",")}
    if len(values) != 1 or not next(iter(values)).isdigit():
        raise HttpProtocolError(f"the answer has an unusable Content-Length: {value[:40]!r}")
    return int(values.pop())
