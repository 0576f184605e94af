"""systemd's service notification protocol (sd_notify(3)) without a library.

Under ``Type=notify`` systemd passes ``$NOTIFY_SOCKET``: a unix datagram socket, a filesystem path
or, when it starts with ``@``, a name in the abstract namespace. Each datagram is newline-separated
``KEY=VALUE`` assignments (``READY=1``, ``STATUS=...``, ``WATCHDOG=1``, ...). Outside systemd the
variable is unset and every call here is a cheap no-op that returns False, so the daemon calls these
functions unconditionally.

With ``WatchdogSec=`` set, systemd passes ``$WATCHDOG_USEC`` (and ``$WATCHDOG_PID``, the pid meant to
ping) and restarts the service when no ``WATCHDOG=1`` arrives within that time. ``Watchdog`` pings at
half the interval from a thread; the daemon should start it only once it is actually serving, so a
wedged start-up is caught by ``TimeoutStartSec=`` instead.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping, MutableMapping

log = logging.getLogger(__name__)

#: Variables systemd hands to the agent that must not leak into workers' environments: a worker
#: that inherited them could ping the agent's watchdog or claim readiness on its behalf.
NOTIFY_ENV_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def _socket_address(raw: str) -> str | bytes | None:
    if raw.startswith("@"):
        # Abstract namespace: a leading NUL byte instead of '@', no filesystem entry.
        return b"\0" + raw[1:].encode()
    if raw.startswith("/"):
        return raw
    # sd_notify also accepts vsock addresses; a host agent never runs under those, so say so.
    log.warning("NOTIFY_SOCKET=%r is neither a path nor an abstract name; not notifying", raw)
    return None


def notify(*states: str, environ: Mapping[str, str] | None = None) -> bool:
    """Send ``states`` (e.g. ``"READY=1"``, ``"STATUS=reconciling"``) to systemd in one datagram.

    Returns True when the datagram was sent, False when there is no notification socket (not
    running under systemd) or sending failed; a failure is logged, never raised, because losing a
    status line must not take the daemon down.
    """
    env = os.environ if environ is None else environ
    raw = env.get("NOTIFY_SOCKET")
    if not raw or not states:
        return False
    address = _socket_address(raw)
    if address is None:
        return False
    payload = "\n".join(states).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(payload)
    except OSError as err:
        log.warning("sd_notify to %s failed (%s): %s", raw, err.strerror or err, ", ".join(states))
        return False
    return True


def ready(status: str | None = None) -> bool:
    """Tell systemd start-up is complete (``READY=1``), with our pid so NotifyAccess=main holds."""
    states = ["READY=1", f"MAINPID={os.getpid()}"]
    if status:
        states.append(f"STATUS={status}")
    return notify(*states)


def stopping(status: str | None = None) -> bool:
    """Tell systemd we are shutting down on purpose (``STOPPING=1``)."""
    return notify("STOPPING=1", *([f"STATUS={status}"] if status else []))


def status(text: str) -> bool:
    """One line shown by ``systemctl status nodeagent``."""
    return notify(f"STATUS={text}")


def extend_timeout(seconds: float) -> bool:
    """Ask for ``seconds`` more before systemd gives up on start-up or shutdown (a long reconcile)."""
    return notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1_000_000)}")


def watchdog_interval(environ: Mapping[str, str] | None = None) -> float | None:
    """The watchdog timeout in seconds that systemd expects us to honour, or None.

    None when ``WATCHDOG_USEC`` is unset or not a positive integer, or when ``WATCHDOG_PID`` names
    another process (the variable was inherited, the watchdog is not ours).
    """
    env = os.environ if environ is None else environ
    raw_usec = env.get("WATCHDOG_USEC")
    if not raw_usec:
        return None
    raw_pid = env.get("WATCHDOG_PID")
    if raw_pid:
        try:
            if int(raw_pid) != os.getpid():
                return None
        except ValueError:
            return None
    try:
        usec = int(raw_usec)
    except ValueError:
        return None
    return usec / 1_000_000 if usec > 0 else None


def clean_environment(env: MutableMapping[str, str]) -> None:
    """Remove the notification variables from an environment about to be handed to a child."""
    for name in NOTIFY_ENV_VARS:
        env.pop(name, None)


class Watchdog:
    """Pings ``WATCHDOG=1`` every ``interval / 2`` seconds from a daemon thread until stopped.

    ``healthy`` lets the daemon withhold pings when its own loop is stuck (then systemd restarts
    it, which is the point of a watchdog); by default every tick pings.
    """

    def __init__(
        self,
        interval: float,
        *,
        healthy: Callable[[], bool] | None = None,
        send: Callable[[], bool] | None = None,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"watchdog interval must be positive, got {interval}")
        self.period = interval / 2
        self._healthy = healthy or (lambda: True)
        self._send = send or (lambda: notify("WATCHDOG=1"))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.pings = 0

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Watchdog | None:
        """A Watchdog for the interval systemd asked for, or None when it asked for none."""
        interval = watchdog_interval(environ)
        return None if interval is None else cls(interval)

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="nodeagent-watchdog", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        self._tick()
        while not self._stop.wait(self.period):
            self._tick()

    def _tick(self) -> None:
        try:
            healthy = self._healthy()
        except Exception:
            log.exception("watchdog health check raised; withholding the ping")
            return
        if healthy and self._send():
            self.pings += 1
