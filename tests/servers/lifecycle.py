"""The checks a real model server passes through the agent's REST API, in slots, sandboxed, on the
real kernel. One sequence for the CI end-to-end tests (tests/agent/test_model_servers_e2e.py:
MLServer, KServe) and for the by-hand validation of the heavier servers
(bench/validate_servers.py: Triton, TorchServe, the SageMaker contract):

  ready         a slot with the server's preset turns `running` (its model-level readiness probe)
  inference     an inference is answered right (and its latency measured)
  side by side  a second slot of the same server beside it: each has every port of the server,
                agent-assigned, none shared, and both answer
  re-adopted    the agent is SIGKILLed and started again: the same worker pid, still answering
  restarted     the main process is SIGKILLed: nothing of its old tree runs on, and the worker is
                restarted on the same ports, answering
  drained       a graceful stop: the worker is `stopping` at once, still answers during the drain,
                then exits on its stop signal, not by SIGKILL
  released      both slots released: no process, no listening port, no file of their uids left

The daemon, its cgroup parent and the clean-up are test_e2e's (names carry "natest" and the pid).
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from nodeagent.runtime.ports import in_use_on_host
from tests.agent.test_e2e import Daemon, clean_up, in_test_parent, parent_dirs
from tests.daemon import wait_until

STARTUP = 240.0  # a cold server on a loaded 2-CPU box; typically a few seconds
BODY = {"inputs": [{"name": "x", "shape": [3], "datatype": "FP32", "data": [1.0, 2.5, -4.0]}]}
DOUBLED = [2.0, 5.0, -8.0]
STEPS = ("ready", "inference", "side by side", "re-adopted", "restarted", "drained", "released")
LATENCY_SAMPLES = 20

#: For asking the servers: no kept-alive connection (nothing left open for a test's end), and one
#: client for all (a new httpx client per request costs more than a local inference).
HTTP = httpx.Client(timeout=30, limits=httpx.Limits(max_keepalive_connections=0))

#: Slot -> the answer of its server to the test input (raises when there is none).
Infer = Callable[[dict[str, Any]], Any]


def first_port() -> int:
    """The start of this process's port range for slots (one hundred ports)."""
    return 20000 + (os.getpid() % 99) * 100


def server_daemon(tmp: Path, state: Path | None = None) -> Daemon:
    """test_e2e's daemon under ``tmp``, assigning worker ports from this process's range.
    ``state``: the agent's default state directory (``serve`` is given no --state-dir; the caller
    makes sure no other agent uses it and removes it after), instead of one under ``tmp``."""
    daemon = Daemon(tmp)
    if state is not None:
        daemon.state = state
        daemon.pass_state_dir = False
    first = first_port()
    text = daemon.config.read_text()
    daemon.config.write_text(text.replace("[workers]\n", f'[workers]\nport_range = "{first}-{first + 99}"\n'))
    return daemon


def remove_daemon(daemon: Daemon) -> None:
    """Stop it and remove everything of its: processes in its slots, cgroups, netns, veths."""
    clean_up(daemon)
    assert not parent_dirs(), f"could not remove the test cgroups {sorted(map(str, parent_dirs()))}"


def url_of(slot: dict[str, Any], port: str = "http") -> str:
    (endpoint,) = [e for e in slot["endpoints"] if e["name"] == port]
    return f"http://{endpoint['address']}:{endpoint['port']}"


def oip_infer(model: str) -> Infer:
    """The Open Inference Protocol's infer of ``model``: its first output's data."""

    def infer(slot: dict[str, Any]) -> list[float]:
        answer = HTTP.post(f"{url_of(slot)}/v2/models/{model}/infer", json=BODY)
        assert answer.status_code == 200, answer.text
        return list(answer.json()["outputs"][0]["data"])

    return infer


@dataclass(frozen=True)
class Case:
    """One server to check: its worker spec (a preset's), the endpoint names it must get, how to
    ask it for an inference and what it must answer."""

    name: str
    worker: dict[str, Any]
    ports: frozenset[str]
    infer: Infer
    expected: Any = field(default_factory=lambda: DOUBLED)
    cpus: float = 1
    memory: str = "1Gi"


def slot_request(name: str, case: Case) -> dict[str, Any]:
    return {
        "name": name,
        "qos": "burstable",
        "resources": {"cpus": case.cpus, "memory": case.memory},
        "worker": {
            **case.worker,
            "startup_timeout_seconds": STARTUP,
            "drain_seconds": 2.0,
            "stop_grace_seconds": 15,
        },
    }


def worker_of(client: httpx.Client, name: str) -> dict[str, Any]:
    slot: dict[str, Any] = client.get(f"/v1/slots/{name}").json()
    return slot.get("worker") or {}


def running(client: httpx.Client, name: str, *, restarts: int = 0) -> dict[str, Any]:
    """The slot once its worker is running (after at least ``restarts`` restarts)."""

    def ready() -> dict[str, Any] | None:
        slot: dict[str, Any] = client.get(f"/v1/slots/{name}").json()
        worker = slot.get("worker") or {}
        assert worker.get("phase") not in ("failed", "crashloop"), f"{name}: {worker}"
        return slot if worker.get("phase") == "running" and worker.get("restarts", 0) >= restarts else None

    return wait_until(f"{name} to be running", ready, STARTUP)  # type: ignore[no-any-return]


def uid_of(pid: int) -> int:
    return Path(f"/proc/{pid}").stat().st_uid


def _live_processes_of(uid: int, attrs: list[str]) -> list[dict[str, Any]]:
    """psutil's ``attrs`` of every live (not zombie) process whose effective uid is ``uid`` and that
    runs in this test's cgroup parent: another agent on the host (another test run's) gives its
    slots uids from the same range, so a uid alone also finds its workers."""
    found = []
    for process in psutil.process_iter(["pid", "uids", "status", *attrs]):
        uids, status = process.info["uids"], process.info["status"]
        ours = uids is not None and uids.effective == uid and status != psutil.STATUS_ZOMBIE
        if ours and in_test_parent(process.info["pid"]):
            found.append(process.info)
    return found


def processes_of(uid: int) -> set[int]:
    """Every process of this test's slots running as ``uid`` (a slot's own: only its worker's tree
    has it)."""
    return {info["pid"] for info in _live_processes_of(uid, ["pid"])}


def threads_of(uid: int) -> dict[str, int]:
    """Threads of ``uid``'s processes in this test's slots, by program name (several processes of
    one name add up)."""
    counts: dict[str, int] = {}
    for info in _live_processes_of(uid, ["name", "num_threads"]):
        name = info["name"] or "?"
        counts[name] = counts.get(name, 0) + (info["num_threads"] or 0)
    return counts


def files_of(uid: int, state: Path) -> list[str]:
    """Files the slot's uid left in the host's shared places and in this agent's state directory.
    Other tests' trees under /tmp are theirs, and so are other agents' state directories wherever
    they lie (a slot uid is reused by the next agent's slots: another agent's worker directories
    may hold that uid's files)."""
    left = []
    for top in ("/tmp", "/var/tmp", "/dev/shm", str(state)):
        for root, dirs, files in os.walk(top):
            if root == "/tmp":
                dirs[:] = [d for d in dirs if not d.startswith("pytest-of-")]
            if root != str(state) and "workers" in dirs and os.path.exists(os.path.join(root, "token")):
                dirs.remove("workers")
            for name in dirs + files:
                path = os.path.join(root, name)
                try:
                    if os.lstat(path).st_uid == uid:
                        left.append(path)
                except OSError:
                    continue
    return left


class Lifecycle:
    """The checks of one server against one (started) daemon, in order (:data:`STEPS`); what they
    measured in :attr:`measured`."""

    def __init__(self, daemon: Daemon, case: Case) -> None:
        self.daemon = daemon
        self.case = case
        self.names = (f"natest-{case.name}-a", f"natest-{case.name}-b")
        self.client = daemon.start()
        self.a: dict[str, Any] = {}
        self.b: dict[str, Any] = {}
        #: Timings (seconds) and counts: ready, restart, inference median, threads by program.
        self.measured: dict[str, Any] = {}
        #: The workers' last output lines when a step failed.
        self.failure_logs = ""

    def run(self, record: Callable[[str, float, BaseException | None], None] | None = None) -> None:
        """Every step in order, each reported to ``record`` (name, seconds, error); the first
        failure is raised after it is reported."""
        steps = dict(zip(STEPS, self._steps(), strict=True))
        try:
            for name, step in steps.items():
                began = time.monotonic()
                try:
                    step()
                except (AssertionError, httpx.HTTPError, OSError, KeyError, ValueError) as err:
                    self.failure_logs = self.logs()
                    if record is not None:
                        record(name, time.monotonic() - began, err)
                    raise
                if record is not None:
                    record(name, time.monotonic() - began, None)
        finally:
            self.client.close()

    def logs(self, lines: int = 80) -> str:
        """The last lines of each slot's worker output (for a failure's report)."""
        shown = []
        for name in self.names:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                answer = self.client.get(f"/v1/slots/{name}/logs", params={"lines": lines})
                if answer.status_code == 200:
                    shown.append(f"--- {name}\n" + "\n".join(answer.json()["lines"]))
        return "\n".join(shown)

    def _steps(self) -> tuple[Callable[[], None], ...]:
        return (
            self.ready,
            self.inference,
            self.side_by_side,
            self.readopted,
            self.restarted,
            self.drained,
            self.released,
        )

    def _create(self, name: str) -> dict[str, Any]:
        created = self.client.post("/v1/slots", json=slot_request(name, self.case))
        assert created.status_code == 201, created.text
        slot = running(self.client, name)
        self.daemon.remember(slot)
        return slot

    def _answers(self, slot: dict[str, Any]) -> None:
        answer = self.case.infer(slot)
        assert answer == self.case.expected, f"{self.case.name} answered {answer!r}"

    def ready(self) -> None:
        began = time.monotonic()
        self.a = self._create(self.names[0])
        self.measured["ready_s"] = time.monotonic() - began
        assert uid_of(int(self.a["worker"]["pid"])) == self.a["sandbox"]["uid"]

    def inference(self) -> None:
        self._answers(self.a)
        latencies = []
        for _ in range(LATENCY_SAMPLES):
            began = time.monotonic()
            self.case.infer(self.a)
            latencies.append(time.monotonic() - began)
        self.measured["latency_s"] = statistics.median(latencies)
        self.measured["threads"] = threads_of(self.a["sandbox"]["uid"])

    def side_by_side(self) -> None:
        self.b = self._create(self.names[1])
        for slot in (self.a, self.b):
            assert {e["name"] for e in slot["endpoints"]} == self.case.ports, slot["endpoints"]
        ports_a = {e["port"] for e in self.a["endpoints"]}
        assert ports_a.isdisjoint(e["port"] for e in self.b["endpoints"])
        self._answers(self.b)

    def readopted(self) -> None:
        self.daemon.kill()
        self.client.close()
        self.client = self.daemon.start()
        again = running(self.client, self.names[0])
        assert again["worker"]["pid"] == self.a["worker"]["pid"]
        self._answers(again)

    def restarted(self) -> None:
        uid, pid = self.a["sandbox"]["uid"], int(self.a["worker"]["pid"])
        old_tree = processes_of(uid)
        assert pid in old_tree
        began = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        restarted = running(self.client, self.names[0], restarts=1)
        self.measured["restart_s"] = time.monotonic() - began
        self.daemon.remember(restarted)
        assert restarted["worker"]["pid"] != self.a["worker"]["pid"]
        assert processes_of(uid).isdisjoint(old_tree), "a process of the killed worker's tree runs on"
        self._answers(restarted)
        assert {e["port"] for e in restarted["endpoints"]} == {e["port"] for e in self.a["endpoints"]}

    def drained(self) -> None:
        name = self.names[1]
        stopping = self.client.delete(f"/v1/slots/{name}/worker")
        assert stopping.status_code == 200, stopping.text
        assert stopping.json()["worker"]["phase"] == "stopping"
        self._answers(self.b)  # drain_seconds: requests still answered
        wait_until(f"{name} to stop", lambda: worker_of(self.client, name).get("phase") == "stopped", 60)
        last_exit = worker_of(self.client, name)["last_exit"]
        self.measured["last_exit"] = last_exit
        assert last_exit["signal"] != signal.SIGKILL, f"it had to be killed: {last_exit}"

    def released(self) -> None:
        uids = {self.a["sandbox"]["uid"], self.b["sandbox"]["uid"]}
        for name in self.names:
            assert self.client.delete(f"/v1/slots/{name}").status_code == 204
        for slot_uid in uids:
            wait_until(f"uid {slot_uid}'s processes to end", lambda u=slot_uid: not processes_of(u), 30)
            left = files_of(slot_uid, self.daemon.state)
            assert left == [], f"uid {slot_uid} left {left}"
        for slot in (self.a, self.b):
            for endpoint in slot["endpoints"]:
                assert not in_use_on_host(endpoint["port"]), f"port {endpoint['port']} still listened on"
            assert not (self.daemon.state / "workers" / slot["id"]).exists()


__all__ = [
    "BODY",
    "DOUBLED",
    "HTTP",
    "STEPS",
    "Case",
    "Lifecycle",
    "oip_infer",
    "remove_daemon",
    "server_daemon",
    "url_of",
]
