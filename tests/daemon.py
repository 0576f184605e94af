"""``nodeagent serve`` as a real process for end-to-end tests and benchmarks: a tmp state directory,
a free loopback port, and the caller's configuration (a test cgroup parent, never the real one)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def nodeagent_argv() -> list[str]:
    """The installed console script next to this interpreter (as an operator runs it)."""
    script = Path(sys.executable).parent / "nodeagent"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from nodeagent.cli import main; main()"]


def wait_until(what: str, check: Callable[[], Any], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.05)


class DaemonProcess:
    """One ``nodeagent serve``; ``start`` may be called again after ``kill``/``stop`` (same state)."""

    def __init__(self, work: Path, config_toml: str) -> None:
        work.mkdir(parents=True, exist_ok=True)
        self.state = work / "state"
        self.config = work / "config.toml"
        self.config.write_text(config_toml)
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log_path = work / "daemon.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def token_file(self) -> Path:
        return self.state / "token"

    @property
    def pid(self) -> int:
        assert self.process is not None, "the daemon is not running"
        return self.process.pid

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text()[-chars:] if self.log_path.exists() else ""

    def start(self, timeout: float = 30.0) -> httpx.Client:
        """Start it, wait for /readyz, and return an authenticated client."""
        argv = [*nodeagent_argv(), "serve", "--config", str(self.config)]
        argv += ["--listen", self.url.removeprefix("http://"), "--state-dir", str(self.state)]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

        def ready() -> bool:
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(
                    f"the daemon exited during start-up ({self.process.returncode}):\n{self.log_tail()}"
                )
            try:
                return httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_until("the daemon's /readyz", ready, timeout)
        token = self.token_file.read_text().strip()
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=60)

    def cli(self, *args: str) -> str:
        """``nodeagent slots ARGS`` against this daemon; its stdout (the command must succeed)."""
        argv = [*nodeagent_argv(), "slots", "--api", self.url, "--token-file", str(self.token_file), *args]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, f"{' '.join(args)} failed: {done.stderr}"
        return done.stdout

    def kill(self) -> None:
        """SIGKILL, as a crash would: nothing of the daemon's runs afterwards."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
        self.process = None

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM and wait (SIGKILL after ``timeout``); the exit status, None if it was not running."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
        code, self.process = self.process.returncode, None
        return code
