"""Helpers for tests on real network namespaces: run Python inside a slot, listen and connect."""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import subprocess
import sys
import threading

from nodeagent.isolation.network import SlotNetwork

Addr = ipaddress.IPv4Address


def base36(number: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        number, rest = divmod(number, 36)
        out = digits[rest] + out
        if not number:
            return out


def python_in(netns: SlotNetwork | str, code: str, timeout: float = 15) -> str:
    """Run ``code`` in the network namespace (a slot's, or a path) and return what it printed."""
    path = netns.netns_path if isinstance(netns, SlotNetwork) else netns
    done = subprocess.run(
        ["nsenter", f"--net={path}", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )
    return done.stdout.strip()


def connect_from(net: SlotNetwork, address: Addr | str, port: int, timeout: float = 1.5) -> str:
    """A TCP connect from inside the slot: "connected", or "failed <why>"."""
    code = (
        "import socket\n"
        f"s = socket.socket(); s.settimeout({timeout})\n"
        "try:\n"
        f"    s.connect(({str(address)!r}, {port})); print('connected')\n"
        "except OSError as err:\n"
        "    print('failed', err)\n"
    )
    return python_in(net, code)


def send_udp_from(net: SlotNetwork, address: Addr | str, port: int, payload: str) -> None:
    code = (
        "import socket\n"
        "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        f"s.sendto({payload.encode()!r}, ({str(address)!r}, {port}))\n"
    )
    python_in(net, code)


def listen_in(
    netns: SlotNetwork | str, processes: list[subprocess.Popen[str]], address: Addr | str | None = None
) -> tuple[int, subprocess.Popen[str]]:
    """A TCP server inside the namespace that prints each peer's address and sends "ok"."""
    path = netns.netns_path if isinstance(netns, SlotNetwork) else netns
    bind = str(address if address is not None else netns.slot_address)  # type: ignore[union-attr]
    code = (
        "import socket\n"
        f"s = socket.create_server(({bind!r}, 0))\n"
        "print(s.getsockname()[1], flush=True)\n"
        "while True:\n"
        "    c, peer = s.accept(); print(peer[0], flush=True); c.sendall(b'ok'); c.close()\n"
    )
    proc = subprocess.Popen(
        ["nsenter", f"--net={path}", sys.executable, "-c", code], stdout=subprocess.PIPE, text=True
    )
    processes.append(proc)
    assert proc.stdout is not None
    return int(proc.stdout.readline()), proc


class HostListener:
    """TCP and UDP sockets on the host, on one address, that record who reached them."""

    def __init__(self, address: str = "0.0.0.0", kind: int = socket.SOCK_STREAM) -> None:
        self.sock = socket.socket(socket.AF_INET, kind)
        self.sock.bind((address, 0))
        self.port: int = self.sock.getsockname()[1]
        self.received: list[bytes] = []
        if kind == socket.SOCK_STREAM:
            self.sock.listen()
        self._thread = threading.Thread(target=self._serve, args=(kind,), daemon=True)
        self._thread.start()

    def _serve(self, kind: int) -> None:
        while True:
            try:
                if kind == socket.SOCK_STREAM:
                    conn, _ = self.sock.accept()
                    conn.close()
                    self.received.append(b"")
                else:
                    self.received.append(self.sock.recv(1 << 16))
            except OSError:
                return  # closed

    def close(self) -> None:
        # shutdown wakes the thread blocked in accept/recv; close alone would not.
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(timeout=5)

    def __enter__(self) -> HostListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
