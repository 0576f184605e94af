"""The API keeps answering while a client holds many idle connections (agent/connguard.py).

A real ``nodeagent serve`` with small limits: a flood of connections that never send a request,
from one loopback address, fills that peer's share and no more; the next ones from it are reset at
once, every one is cut after ``header_timeout_s``, and a client at another address is answered the
whole time. /metrics counts the cuts. The flood's sockets are the test's own and closed by it."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from nodeagent.agent.connguard import AcceptErrorHandler, Counters
from tests.daemon import HOST_OFF, DaemonProcess, remove_daemon_objects, wait_until

PARENT = f"natest{os.getpid()}f.slice"
PER_PEER = 16
FLOOD = 200


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    config = (
        f'[isolation]\ncgroup_parent = "{PARENT}"\n'
        f"[api]\nmax_connections = 64\nmax_connections_per_peer = {PER_PEER}\nheader_timeout_s = 1\n"
    )
    d = DaemonProcess(tmp_path, config)
    yield d
    d.stop()
    d.stop_keeper()
    remove_daemon_objects(d, {"cgroup_parent": PARENT, **HOST_OFF})


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the agent has closed (or reset) this connection."""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


@pytest.mark.root
def test_idle_connections_cannot_starve_the_api(daemon: DaemonProcess) -> None:
    client = daemon.start()
    host, port = daemon.url.removeprefix("http://").split(":")
    flood: list[socket.socket] = []
    try:
        for _ in range(FLOOD):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            flood.append(sock)
            sock.bind(("127.0.0.2", 0))  # another loopback address: another peer than the client
            sock.connect((host, int(port)))
        # The peer's share is held, everything past it was reset on accept.
        wait_until(
            "the agent resets connections past the per-peer limit",
            lambda: sum(closed_by_peer(s) for s in flood) >= FLOOD - PER_PEER,
        )
        assert client.get("/healthz").status_code == 200
        assert client.get("/v1/slots").status_code == 200
        # The ones it kept are cut once they sat a header timeout without a request.
        wait_until("the agent closes idle connections", lambda: all(closed_by_peer(s) for s in flood))
        metrics = client.get("/metrics").text
        assert 'nodeagent_api_connections_rejected_total{reason="peer"}' in metrics
        assert 'nodeagent_api_connections_rejected_total{reason="idle"}' in metrics
        # The peer may connect again, and a request made in time is answered.
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2")) as again:
            assert again.get(f"{daemon.url}/healthz").status_code == 200
    finally:
        for sock in flood:
            sock.close()
        client.close()


def test_accept_errors_are_counted_and_logged_at_a_bounded_rate(caplog: pytest.LogCaptureFixture) -> None:
    counted: list[int] = []
    handler = AcceptErrorHandler(Counters(accept_error=lambda: counted.append(1)), interval=3600)
    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level(logging.WARNING, logger="nodeagent.agent.connguard"):
            for _ in range(1000):
                handler(
                    loop, {"message": "socket.accept() out of system resource", "exception": OSError(24, "x")}
                )
    finally:
        loop.close()
    assert len(counted) == 1000
    assert len([r for r in caplog.records if r.name == "nodeagent.agent.connguard"]) == 1


class LowDescriptorDaemon(DaemonProcess):
    """An agent whose descriptor limit (soft and hard) is ``NOFILE``: a flood could exhaust it."""

    def argv(self, *extra: str, url: str | None = None) -> list[str]:
        return ["prlimit", f"--nofile={NOFILE}:{NOFILE}", "--", *super().argv(*extra, url=url)]


NOFILE = 512


@pytest.mark.root
def test_a_flood_past_the_descriptor_limit_leaves_the_api_answering(tmp_path: Path) -> None:
    """With the default limits (1024 connections, 128 per peer) above what 512 descriptors allow,
    the agent lowers the total to fit them: a flood from many peers is cut there and
    never makes accept fail for want of descriptors; once the idle ones are cut (header timeout),
    /healthz is answered again."""
    daemon = DaemonProcess.__new__(LowDescriptorDaemon)
    config = f'[isolation]\ncgroup_parent = "{PARENT}"\n[api]\nheader_timeout_s = 1\n'
    DaemonProcess.__init__(daemon, tmp_path, config)
    flood: list[socket.socket] = []
    try:
        client = daemon.start()
        host, port = daemon.url.removeprefix("http://").split(":")
        for number in range(2 * NOFILE):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            flood.append(sock)
            sock.bind((f"127.0.1.{number % 200 + 1}", 0))  # 200 peers: the per-peer limit never bites
            sock.connect((host, int(port)))

        def answered() -> bool:
            try:
                return client.get("/healthz").status_code == 200
            except httpx.TransportError:
                return False

        wait_until("/healthz answered again", answered)
        metrics = client.get("/metrics").text
        assert 'nodeagent_api_connections_rejected_total{reason="total"}' in metrics
        api_lines = [line for line in metrics.splitlines() if line.startswith("nodeagent_api_acc")]
        refusals = [line for line in daemon.log_tail(100_000).splitlines() if "cannot accept" in line]
        assert "nodeagent_api_accept_errors_total 0.0" in api_lines, (
            api_lines,
            refusals[:3],
        )  # never out of fds
        assert "max_connections lowered to fit the descriptor limit" in daemon.log_tail(100_000)
        client.close()
    finally:
        for sock in flood:
            sock.close()
        daemon.stop()
        daemon.stop_keeper()
        remove_daemon_objects(daemon, {"cgroup_parent": PARENT, **HOST_OFF})
