"""Keep the API answering when a client opens connections and sends nothing.

uvicorn bounds requests (``limit_concurrency``) and idle keep-alive between requests, but not a
connection that is open and has not sent a request yet: 25,000 of those from one slot took every
descriptor of the agent. This module wraps uvicorn's HTTP protocol:

- a connection over the total limit, or over the per-peer limit (a TCP peer is its address, a unix
  socket peer its uid), is aborted as it is accepted (a reset frees the descriptor at once);
- a connection that spends a whole ``header_timeout`` neither serving a request nor starting a
  new one is aborted (covers the idle connection before its first request and a client that
  trickles a request head byte by byte);
- the event loop's accept errors (``EMFILE`` and the rest) are counted and logged at most once per
  ``ACCEPT_ERROR_LOG_INTERVAL`` seconds, with how many were left out.

Rejections and accept errors are counted through the callbacks of ``Counters``: the daemon wires
them to the metrics.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

#: At most one log record about accept errors per this many seconds.
ACCEPT_ERROR_LOG_INTERVAL = 10.0


@dataclass(frozen=True)
class Limits:
    max_connections: int  #: open connections at once, all peers together
    max_connections_per_peer: int  #: open connections at once from one peer
    header_timeout: float  #: seconds a connection may sit without a request in progress


@dataclass
class Counters:
    """Where rejections go: ``rejected(reason)`` with reason ``total`` | ``peer`` | ``idle``."""

    rejected: Callable[[str], None] = lambda _reason: None
    accept_error: Callable[[], None] = lambda: None


@dataclass
class _Book:
    limits: Limits
    counters: Counters
    total: int = 0
    by_peer: dict[str, int] = field(default_factory=dict)


def peer_key(transport: asyncio.BaseTransport) -> str:
    """The peer a limit applies to: ``ip:ADDR`` for TCP, ``uid:N`` for a unix socket."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family == socket.AF_UNIX:
        try:
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        except OSError:
            return "unix"
        _pid, uid, _gid = struct.unpack("3i", creds)
        return f"uid:{uid}"
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple) and peer:
        return f"ip:{peer[0]}"
    return "unknown"


class _Guarded(asyncio.Protocol):
    """uvicorn's protocol behind the limits; every call the transport makes is passed on."""

    def __init__(self, book: _Book, inner: asyncio.Protocol, loop: asyncio.AbstractEventLoop) -> None:
        self._book = book
        self._inner = inner
        self._loop = loop
        self._peer: str | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._seen_cycle: object = None
        self._transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        book, limits = self._book, self._book.limits
        peer = peer_key(transport)
        reason = None
        if book.total >= limits.max_connections:
            reason = "total"
        elif book.by_peer.get(peer, 0) >= limits.max_connections_per_peer:
            reason = "peer"
        if reason is not None:
            book.counters.rejected(reason)
            _abort(transport)
            return
        self._peer = peer
        self._transport = transport
        book.total += 1
        book.by_peer[peer] = book.by_peer.get(peer, 0) + 1
        self._timer = self._loop.call_later(limits.header_timeout, self._check_idle)
        self._inner.connection_made(transport)

    def _check_idle(self) -> None:
        # uvicorn's protocols keep the request in progress as ``cycle``: a new object per request.
        cycle = getattr(self._inner, "cycle", None)
        idle = cycle is None or getattr(cycle, "response_complete", False)
        if idle and cycle is self._seen_cycle and self._transport is not None:
            self._book.counters.rejected("idle")
            _abort(self._transport)
            return
        self._seen_cycle = cycle
        self._timer = self._loop.call_later(self._book.limits.header_timeout, self._check_idle)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._peer is None:  # refused in connection_made: uvicorn never saw it
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        book = self._book
        book.total -= 1
        left = book.by_peer.get(self._peer, 1) - 1
        if left:
            book.by_peer[self._peer] = left
        else:
            book.by_peer.pop(self._peer, None)
        self._peer = None
        self._transport = None
        self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._peer is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self._peer is None:
            return None
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        if self._peer is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._peer is not None:
            self._inner.resume_writing()


def _abort(transport: asyncio.BaseTransport) -> None:
    abort = getattr(transport, "abort", None)
    if abort is not None:
        abort()
    else:
        transport.close()


def guarded_protocol(
    base: type[asyncio.Protocol], limits: Limits, counters: Counters
) -> type[asyncio.Protocol]:
    """A protocol class for ``uvicorn.Config(http=...)``: ``base`` (uvicorn's HTTP protocol) behind
    ``limits``. One book of open connections is shared by every connection the class makes."""
    book = _Book(limits, counters)

    class GuardedProtocol(_Guarded):
        def __init__(self, *args: Any, _loop: asyncio.AbstractEventLoop | None = None, **kwargs: Any) -> None:
            loop = _loop or asyncio.get_event_loop()
            super().__init__(book, base(*args, _loop=_loop, **kwargs), loop)  # type: ignore[call-arg]

    GuardedProtocol.book = book  # type: ignore[attr-defined]  # for tests and the daemon's view
    return GuardedProtocol


class AcceptErrorHandler:
    """An event-loop exception handler that counts accept errors and logs them at a bounded rate;
    everything else goes to the loop's default handler."""

    def __init__(self, counters: Counters, *, interval: float = ACCEPT_ERROR_LOG_INTERVAL) -> None:
        self._counters = counters
        self._interval = interval
        self._last = float("-inf")
        self._suppressed = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message", ""))
        if not message.startswith("socket.accept()"):
            loop.default_exception_handler(context)
            return
        self._counters.accept_error()
        now = time.monotonic()
        if now - self._last < self._interval:
            self._suppressed += 1
            return
        self._last = now
        exc = context.get("exception")
        log.warning(
            "API cannot accept connections",
            extra={"error": str(exc) if exc else message, "suppressed_since_last": self._suppressed},
        )
        self._suppressed = 0


__all__ = [
    "ACCEPT_ERROR_LOG_INTERVAL",
    "AcceptErrorHandler",
    "Counters",
    "Limits",
    "guarded_protocol",
    "peer_key",
]
