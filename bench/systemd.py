"""The agent's share of ``systemctl start`` and ``systemctl restart`` (root).

For a ``Type=notify`` service, ``systemctl start`` returns when the service sends READY=1, and the
agent sends it only once it has reconciled and re-adopted every worker and serves its API: the time
to READY=1 is what a start or a restart costs, and "every worker re-adopted" is part of it. This
bench plays systemd's part on any Linux host: it binds a notification socket, runs ``nodeagent
serve`` with NOTIFY_SOCKET pointing at it, and times

  start            exec of ``nodeagent serve`` -> READY=1, no slot
  restart          SIGTERM to the running agent -> READY=1 of the next one, with --slots slots
                   whose workers (sleep) it re-adopts (checked: the same pids, running)

Cgroups go under a test parent ("natest<pid>sd.slice", with --systemd-delegation off, since no unit
delegates one here); everything is removed afterwards. tests/systemd/vm measures the same through
systemctl in a VM whose PID 1 is systemd (the figures it writes to .systemd-vm/figures.json).

    python bench/systemd.py [--rounds 7] [--slots 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `tests` is a package of the repo

from nodeagent.cgroups import detect, remove_subtree
from tests.daemon import free_port, nodeagent_argv

PARENT = f"natest{os.getpid()}sd.slice"


class Agent:
    """``nodeagent serve`` under a stand-in for systemd's notification socket."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.port = free_port()
        (work / "config.toml").write_text(f'[isolation]\ncgroup_parent = "{PARENT}"\n')
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(work / "notify"))
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        """Start the agent; seconds from exec to READY=1."""
        argv = [*nodeagent_argv(), "serve", "--config", str(self.work / "config.toml")]
        argv += ["--state-dir", str(self.work / "state"), "--listen", f"127.0.0.1:{self.port}"]
        argv += ["--systemd-delegation", "off"]
        env = {**os.environ, "NOTIFY_SOCKET": str(self.work / "notify")}
        began = time.monotonic()
        with (self.work / "agent.log").open("ab") as log:
            self.process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        self._wait_ready()
        return time.monotonic() - began

    def _wait_ready(self, timeout: float = 120.0) -> None:
        self.notify.settimeout(timeout)
        while True:
            try:
                message = self.notify.recv(4096).decode()
            except TimeoutError:
                tail = (self.work / "agent.log").read_text()[-2000:]
                raise SystemExit(f"no READY=1 within {timeout:g}s; the agent's log ends:\n{tail}") from None
            if "READY=1" in message.splitlines():
                return

    def stop(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=60)
            self.process = None

    def restart(self) -> float:
        """SIGTERM, then the next agent; seconds from the signal to the new agent's READY=1."""
        began = time.monotonic()
        self.stop()
        self.start()
        return time.monotonic() - began

    def api(self) -> httpx.Client:
        token = (self.work / "state/token").read_text().strip()
        return httpx.Client(
            base_url=f"http://127.0.0.1:{self.port}", headers={"Authorization": f"Bearer {token}"}, timeout=60
        )


def workers(api: httpx.Client) -> dict[str, tuple[str, int | None]]:
    slots = api.get("/v1/slots").json()["slots"]
    return {s["name"]: (s["worker"]["phase"], s["worker"]["pid"]) for s in slots}


def report(name: str, values: list[float]) -> None:
    ms = sorted(v * 1000 for v in values)
    median = statistics.median(ms)
    print(f"{name:<48} median {median:7.1f} ms   min {ms[0]:7.1f}   max {ms[-1]:7.1f}   (n={len(ms)})")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--slots", type=int, default=3)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the agent creates cgroups")
    with tempfile.TemporaryDirectory(prefix="natest-sd-") as tmp:
        agent = Agent(Path(tmp))
        try:
            starts = []
            for _ in range(args.rounds):
                starts.append(agent.start())
                agent.stop()
            agent.start()
            qos = ("guaranteed", "burstable", "best-effort")
            with agent.api() as api:
                for n in range(args.slots):
                    resources = {"cpus": 1} if qos[n % 3] == "guaranteed" else {"cpus": 0.2}
                    body = {"name": f"w{n}", "qos": qos[n % 3], "resources": {**resources, "memory": "32Mi"}}
                    body["worker"] = {"command": ["/bin/sleep", "1000000"], "restart": "always"}
                    api.post("/v1/slots", json=body).raise_for_status()
                deadline = time.monotonic() + 60
                while any(phase != "running" for phase, _ in workers(api).values()):
                    if time.monotonic() > deadline:
                        raise SystemExit(f"workers never ran: {workers(api)}")
                    time.sleep(0.05)
                before = workers(api)
            restarts = []
            for _ in range(args.rounds):
                restarts.append(agent.restart())
                with agent.api() as api:
                    after = workers(api)
                if after != before:
                    raise SystemExit(f"workers were not re-adopted as they were: {before} -> {after}")
            with agent.api() as api:
                for name in before:
                    api.delete(f"/v1/slots/{name}").raise_for_status()
        finally:
            agent.stop()
            remove_subtree(detect(), PARENT)
    print(
        f"nodeagent serve under a notification socket, {os.cpu_count()} CPUs, {args.slots} slots with workers"
    )
    report("start: exec -> READY=1 (no slot)", starts)
    report(f"restart: SIGTERM -> READY=1, {args.slots} workers re-adopted", restarts)


if __name__ == "__main__":
    main()
