"""sd_notify against real datagram sockets standing in for systemd's, on a path and in the abstract
namespace; the watchdog's pings; and the quiet no-op outside systemd."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nodeagent.agent import notify as sd

BOUND = 10.0


class FakeSystemd:
    """The receiving end of $NOTIFY_SOCKET."""

    def __init__(self, address: str) -> None:
        self.env_value = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(b"\0" + address[1:].encode() if address.startswith("@") else address)
        self.sock.settimeout(BOUND)

    def receive(self) -> list[str]:
        return self.sock.recv(4096).decode().split("\n")

    def nothing_pending(self) -> bool:
        self.sock.setblocking(False)
        try:
            self.sock.recv(4096)
        except BlockingIOError:
            return True
        finally:
            self.sock.settimeout(BOUND)
        return False

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(params=["path", "abstract"])
def systemd(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[FakeSystemd]:
    address = str(tmp_path / "notify") if request.param == "path" else f"@natest-notify-{os.getpid()}"
    fake = FakeSystemd(address)
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    yield fake
    fake.close()


def test_ready_reaches_systemd_with_our_pid(systemd: FakeSystemd) -> None:
    assert sd.ready("serving on 127.0.0.1:7070") is True
    assert systemd.receive() == ["READY=1", f"MAINPID={os.getpid()}", "STATUS=serving on 127.0.0.1:7070"]


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        pytest.param(lambda: sd.stopping(), ["STOPPING=1"], id="stopping"),
        pytest.param(
            lambda: sd.stopping("draining"), ["STOPPING=1", "STATUS=draining"], id="stopping-status"
        ),
        pytest.param(lambda: sd.status("reconciling 3 slots"), ["STATUS=reconciling 3 slots"], id="status"),
        pytest.param(lambda: sd.extend_timeout(90), ["EXTEND_TIMEOUT_USEC=90000000"], id="extend-timeout"),
        pytest.param(lambda: sd.notify("WATCHDOG=1"), ["WATCHDOG=1"], id="watchdog"),
    ],
)
def test_each_message_is_one_datagram(
    systemd: FakeSystemd, call: Callable[[], bool], expected: list[str]
) -> None:
    assert call() is True
    assert systemd.receive() == expected
    assert systemd.nothing_pending()


@pytest.mark.parametrize(
    "value",
    [pytest.param(None, id="unset"), pytest.param("", id="empty"), pytest.param("vsock:2:999", id="vsock")],
)
def test_without_a_usable_socket_notify_returns_false(
    monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    if value is None:
        monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    else:
        monkeypatch.setenv("NOTIFY_SOCKET", value)
    assert sd.notify("READY=1") is False
    assert sd.ready() is False


def test_a_socket_nobody_listens_on_returns_false(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))
    assert sd.notify("READY=1") is False


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        pytest.param({}, None, id="unset"),
        pytest.param({"WATCHDOG_USEC": "30000000"}, 30.0, id="no-pid"),
        pytest.param({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "{pid}"}, 30.0, id="our-pid"),
        pytest.param({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None, id="someone-elses-pid"),
        pytest.param({"WATCHDOG_USEC": "0"}, None, id="zero"),
        pytest.param({"WATCHDOG_USEC": "soon"}, None, id="garbage"),
        pytest.param({"WATCHDOG_USEC": "500000", "WATCHDOG_PID": "x"}, None, id="garbage-pid"),
    ],
)
def test_watchdog_interval(env: dict[str, str], expected: float | None) -> None:
    env = {k: v.format(pid=os.getpid()) for k, v in env.items()}
    assert sd.watchdog_interval(env) == expected


def test_watchdog_pings_at_half_the_interval(systemd: FakeSystemd) -> None:
    watchdog = sd.Watchdog.from_environment({"WATCHDOG_USEC": "200000", "WATCHDOG_PID": str(os.getpid())})
    assert watchdog is not None
    assert watchdog.period == pytest.approx(0.1)
    watchdog.start()
    try:
        for _ in range(3):
            assert systemd.receive() == ["WATCHDOG=1"]
    finally:
        watchdog.stop()
    assert watchdog.pings >= 3


def test_watchdog_withholds_pings_while_unhealthy_and_stops(systemd: FakeSystemd) -> None:
    healthy = [False]
    watchdog = sd.Watchdog(0.1, healthy=lambda: healthy[0])
    watchdog.start()
    time.sleep(0.3)  # several ticks while unhealthy
    assert systemd.nothing_pending()
    healthy[0] = True
    assert systemd.receive() == ["WATCHDOG=1"]
    watchdog.stop()
    assert watchdog._thread is None
    time.sleep(0.2)
    systemd.nothing_pending()  # drain a ping racing the stop
    time.sleep(0.2)
    assert systemd.nothing_pending(), "the watchdog kept pinging after stop()"


def test_no_watchdog_requested() -> None:
    assert sd.Watchdog.from_environment({}) is None
    with pytest.raises(ValueError, match="must be positive"):
        sd.Watchdog(0)


def test_clean_environment_drops_what_workers_must_not_inherit() -> None:
    env = {"NOTIFY_SOCKET": "/run/systemd/notify", "WATCHDOG_USEC": "1", "WATCHDOG_PID": "2", "PATH": "/bin"}
    sd.clean_environment(env)
    assert env == {"PATH": "/bin"}
