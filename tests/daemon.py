"""``nodeagent serve`` as a real process for end-to-end tests and benchmarks: a tmp state directory,
a free loopback port, and the caller's configuration (a test cgroup parent, never the real one)."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from nodeagent.agent.config import AgentConfig, load_config
from nodeagent.isolation.api_guard import ApiGuard, table_name
from nodeagent.isolation.firewall import LibNftables
from nodeagent.runtime import keeper_protocol
from nodeagent.runtime.keeper_client import stop_keeper

#: Host partitioning off: a test's agent on a developer's or CI machine must not confine the whole
#: host (every process, interrupts) unless the test is about exactly that and scopes it.
HOST_OFF = {"host_partitioning": "off"}


def without_host_partitioning(config_toml: str) -> str:
    """``config_toml`` with ``[isolation] host_partitioning = "off"`` unless it says otherwise."""
    if "host_partitioning" in config_toml:
        return config_toml
    line = 'host_partitioning = "off"\n'
    if "[isolation]\n" in config_toml:
        # A key right after the table header belongs to that table, whatever follows it.
        return config_toml.replace("[isolation]\n", "[isolation]\n" + line, 1)
    return f"[isolation]\n{line}\n{config_toml}"


def with_private_cdi_dir(config_toml: str, work: Path) -> str:
    """``config_toml`` with ``[cdi] dir`` in ``work`` unless it says otherwise: a test's agent must
    not share the host's CDI directory, whose stale specs every agent removes at start."""
    if "[cdi]" in config_toml:
        return config_toml
    return f'{config_toml}\n[cdi]\ndir = "{work / "cdi-specs"}"\n'


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


def wait_until(what: str, check: Callable[[], Any], timeout: float = 30.0, every: float = 0.05) -> Any:
    """``check()`` every ``every`` seconds until it returns something true, and that; an
    AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(every)


def keeper_status(keeper_dir: Path) -> dict[str, Any] | None:
    """The keeper's own account of its custody, asked over a bare connection (a KeeperClient would
    start a keeper when none runs, and arm children); None when no keeper answers."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as raw:
        raw.settimeout(10)
        try:
            raw.connect(str(keeper_dir / keeper_protocol.SOCKET_NAME))
            keeper_protocol.send(raw, {"op": "hello", "protocol": keeper_protocol.PROTOCOL})
            keeper_protocol.receive(raw)
            keeper_protocol.send(raw, {"op": "status"})
            reply, _ = keeper_protocol.receive(raw)
        except OSError:
            return None
    return reply


class DaemonProcess:
    """One ``nodeagent serve``; ``start`` may be called again after ``kill``/``stop`` (same state)."""

    def __init__(self, work: Path, config_toml: str) -> None:
        work.mkdir(parents=True, exist_ok=True)
        self.state = work / "state"
        self.config = work / "config.toml"
        self.config.write_text(with_private_cdi_dir(without_host_partitioning(config_toml), work))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log_path = work / "daemon.log"
        self.process: subprocess.Popen[bytes] | None = None
        #: False: ``serve`` gets no --state-dir and uses its default (set ``state`` to it too).
        self.pass_state_dir = True

    @property
    def token_file(self) -> Path:
        return self.state / "token"

    @property
    def keeper_dir(self) -> Path:
        """Where the daemon's host keeper lives (it outlives the daemon: stop it with stop_keeper)."""
        return self.state / "keeper"

    @property
    def pid(self) -> int:
        assert self.process is not None, "the daemon is not running"
        return self.process.pid

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text()[-chars:] if self.log_path.exists() else ""

    def argv(self, *extra: str, url: str | None = None) -> list[str]:
        argv = [*nodeagent_argv(), "serve", "--config", str(self.config)]
        argv += ["--listen", (url or self.url).removeprefix("http://")]
        if self.pass_state_dir:
            argv += ["--state-dir", str(self.state)]
        return [*argv, *extra]

    def start_and_fail(self, *extra: str, url: str | None = None, timeout: float = 60.0) -> tuple[int, str]:
        """Run ``nodeagent serve`` expecting it to refuse to start: its exit status and output."""
        done = subprocess.run(
            self.argv(*extra, url=url), capture_output=True, text=True, timeout=timeout, check=False
        )
        return done.returncode, done.stdout + done.stderr

    def start(self, *extra: str, timeout: float = 30.0) -> httpx.Client:
        """Start it, wait for /readyz, and return an authenticated client."""
        argv = self.argv(*extra)
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
        # No kept-alive connections: tests drop their clients without closing them, and an idle
        # socket collected later is a ResourceWarning (an error) in whichever test runs then.
        return httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=60,
            limits=httpx.Limits(max_keepalive_connections=0),
        )

    def cli(self, *args: str) -> str:
        """``nodeagent slots ARGS`` against this daemon; its stdout (the command must succeed)."""
        argv = [*nodeagent_argv(), "slots", "--api", self.url, "--token-file", str(self.token_file), *args]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, f"{' '.join(args)} failed: {done.stderr}"
        return done.stdout

    def stop_keeper(self) -> None:
        """Stop the host keeper the daemon started (workers it leaves are the caller's to end), and
        remove the daemon's API firewall rule, which a killed daemon leaves (the next start of an
        agent would replace it; a test's agent has no next start)."""
        stop_keeper(self.keeper_dir)
        with contextlib.suppress(Exception):  # no libnftables: the daemon made no rule either
            config = load_config(self.config)
            ApiGuard(LibNftables(), table_name(config.isolation.firewall_table)).remove()

    def kill(self) -> None:
        """SIGKILL, as a crash would: nothing of the daemon's runs afterwards (the keeper does)."""
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


def remove_agent_objects(config: AgentConfig) -> None:
    """Everything an agent of ``config`` left on the host: its keeper, the processes in its slots,
    its cgroups, network namespaces, veths and firewall table (the uninstall path)."""
    from nodeagent.agent.daemon import build_isolation
    from nodeagent.cgroups import detect
    from nodeagent.devices.discovery import discover
    from nodeagent.isolation.backend import KernelIsolation

    stop_keeper(config.state_dir / "keeper")
    kernel = build_isolation(config, discover(gpus=False, fpgas=False), detect())
    if isinstance(kernel, KernelIsolation):
        kernel.isolator.remove_all()


def remove_daemon_objects(daemon: DaemonProcess, isolation: dict[str, Any]) -> None:
    """:func:`remove_agent_objects` for a daemon whose ``[isolation]`` keys were ``isolation``."""
    from nodeagent.agent.config import apply_overrides, parse_config

    remove_agent_objects(apply_overrides(parse_config({"isolation": isolation}), state_dir=daemon.state))
