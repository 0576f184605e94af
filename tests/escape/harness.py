"""The escape suite's harness: a real SlotManager (kernel isolation, host keeper, sandbox) runs
``attempts.py`` as the worker of a default slot next to a victim slot, and the same script runs
once outside every slot as the control, against targets the test owns.

Used by test_escape.py (this host's cgroup v1 or hybrid kernel) and v2vm/test_escape_v2.py (a pure
cgroup v2 kernel): the attempts and their verdicts are the same; only the cgroup files differ.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodeagent.agent.config import AgentConfig, apply_overrides, parse_config
from nodeagent.agent.daemon import build_manager, ensure_state_dir, ensure_token
from nodeagent.agent.manager import SlotManager
from nodeagent.cgroups import detect
from nodeagent.devices.discovery import discover
from nodeagent.errors import NotFound
from nodeagent.runtime.process import ProcessIdentity, open_verified_pidfd, process_start_time
from nodeagent.schema.request import parse_slot_request
from tests.daemon import remove_agent_objects
from tests.escape.attempts import LITTER_PLACES
from tests.workerpy import worker_visible, world_python

ATTEMPTS = Path(__file__).with_name("attempts.py")
CGROUP_ROOT = Path("/sys/fs/cgroup")
PIDS_MAX = 48
#: What the escaping slot may see of the host's devices: nothing like the kernel log.
FORBIDDEN_DEVICE = "/dev/kmsg"
VICTIM = """
import socket, sys
server = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("listening", flush=True)
while True:
    server.accept()[0].close()
"""


def cgroup_files(directory: Path) -> list[Path]:
    """The files that move a task into ``directory``'s cgroup: cgroup.procs, and tasks on v1."""
    return [directory / name for name in ("cgroup.procs", "tasks") if (directory / name).exists()]


def root_cgroup_targets() -> list[str]:
    """The root cgroup of every hierarchy this host mounts (each v1 hierarchy, the v2 one)."""
    host = detect()
    roots = {*host.v1_mounts.values(), *([host.v2_mount] if host.v2_mount else [])}
    return sorted(str(f) for root in roots for f in cgroup_files(root))


@contextlib.contextmanager
def control_cgroups(name: str) -> Iterator[list[str]]:
    """A cgroup the test owns in every hierarchy (all CPUs and memory nodes): where the control
    run may write itself instead of the real root."""
    host = detect()
    roots = sorted({*host.v1_mounts.values(), *([host.v2_mount] if host.v2_mount else [])})
    made = []
    try:
        for root in roots:
            path = root / name
            path.mkdir()
            made.append(path)
            for key in ("cpuset.cpus", "cpuset.mems"):
                # v1 needs them set before a task may join; v2's empty values mean the parent's.
                if (root / key).exists() and (path / key).exists() and not (path / key).read_text().strip():
                    (path / key).write_text((root / key).read_text())
        yield sorted(str(f) for path in made for f in cgroup_files(path))
    finally:
        for path in made:
            for procs in cgroup_files(path):
                for pid in procs.read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
            for _ in range(200):
                try:
                    path.rmdir()
                    break
                except OSError:
                    time.sleep(0.02)


def config_for(
    tmp_path: Path, tag: str, sandbox: dict[str, Any] | None = None, placement: dict[str, Any] | None = None
) -> AgentConfig:
    pid = os.getpid()
    cfg = apply_overrides(
        parse_config(
            {
                "sandbox": sandbox or {},
                "placement": placement or {},
                "cdi": {"dir": str(tmp_path / "cdi")},  # not the host's CDI directory
                "isolation": {
                    "cgroup_parent": f"natest{pid}{tag}.slice",
                    "firewall_table": f"natest{pid}{tag}",
                    "netns_prefix": f"nx{pid}-",
                    "veth_prefix": "ntx",
                    "pids_max": PIDS_MAX,
                    # The suite is about the slot boundary; confining the rest of the host is
                    # tests/isolation's, and a harness that dies mid-run must not leave it squeezed.
                    "host_partitioning": "off",
                },
            }
        ),
        state_dir=tmp_path / "state",
    )
    ensure_state_dir(cfg.state_dir)
    ensure_token(cfg.token_path)
    return cfg


def tear_down(cfg: AgentConfig) -> None:
    remove_agent_objects(cfg)  # kills what is left in the slots, removes netns and firewall


@contextlib.contextmanager
def started_manager(cfg: AgentConfig) -> Iterator[SlotManager]:
    """A manager of ``cfg`` started without supervision; closed and torn down afterwards."""
    made = build_manager(cfg, discover(gpus=False, fpgas=False))
    made.start(supervise=False)
    try:
        yield made
    finally:
        made.close()
        tear_down(cfg)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(what: str, check: Any, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.05)


def alive(identity: ProcessIdentity) -> bool:
    pidfd = open_verified_pidfd(identity)
    if pidfd is None:
        return False
    os.close(pidfd)
    try:
        stat = Path(f"/proc/{identity.pid}/stat").read_text()
    except FileNotFoundError:
        return False  # reaped between the pidfd and the read
    return stat[stat.rindex(")") + 2] != "Z"


@dataclass
class Run:
    """What one run of attempts.py said: its verdicts by attempt, and the rest of its lines."""

    verdicts: dict[str, dict[str, Any]]
    litter: list[str]
    orphan: ProcessIdentity

    @classmethod
    def parse(cls, lines: list[str]) -> Run:
        verdicts, litter, orphan = {}, [], None
        for line in lines:
            if not line.startswith("{"):
                continue  # stderr lines come marked "[stderr] "
            body = json.loads(line)
            if "escaped" in body:
                verdicts[body["attempt"]] = body
            elif body["attempt"] == "litter":
                litter = body["written"]
            elif body["attempt"] == "outlive":
                orphan = ProcessIdentity(body["pid"], body["start_time"])
        assert orphan is not None, f"attempts.py never reported its orphan: {lines[-20:]}"
        return cls(verdicts, litter, orphan)


@dataclass
class Slots:
    manager: SlotManager
    escaper: str  #: the slot running attempts.py
    victim_pid: int
    targets: dict[str, Any]


def start_slots(cfg: AgentConfig, *, network: bool, litter: str, host_port: int) -> Slots:
    """The victim slot (a TCP server) and the escaping slot, both default (sandboxed) slots."""
    manager = build_manager(cfg, discover(gpus=False, fpgas=False))
    manager.start(supervise=False)
    python = world_python()
    victim_port = free_port()
    resources: dict[str, Any] = {"cpus": 0.2, "memory": "64Mi"}
    if network:
        resources["network"] = {}
    victim = manager.allocate(
        parse_slot_request(
            {
                "name": "victim",
                "qos": "burstable",
                "resources": resources,
                "worker": {"command": [python, "-c", VICTIM, str(victim_port)], "stop_grace_seconds": 1},
            }
        )
    ).slot
    assert victim.worker is not None, victim
    assert victim.worker.pid, victim.worker
    cpus = sorted(os.sched_getaffinity(0))
    escaper_cpus = {"cpus": 1, "memory": "128Mi", **({"network": {}} if network else {})}
    connect = []
    if network:
        assert victim.network is not None
        connect = [
            [str(victim.network.slot_address), victim_port],  # another slot
            [str(victim.network.host_address), host_port],  # the host, through its own gateway
        ]
    targets = {
        "cgroup_procs": root_cgroup_targets(),
        "cpus": cpus,
        "device": FORBIDDEN_DEVICE,
        "mknod_dir": "/tmp",
        "mount_dir": "/tmp",
        "token": str(cfg.token_path),
        "state_dir": str(cfg.state_dir),
        "agent_pid": os.getpid(),  # the manager runs in this process: it is the agent here
        "other_pid": victim.worker.pid,
        "connect": connect,
        "forks": PIDS_MAX + 8,
        "litter": litter,
    }
    escaper = manager.allocate(
        parse_slot_request(
            {
                "name": "escaper",
                "qos": "guaranteed",
                "resources": escaper_cpus,
                "worker": {
                    "command": [
                        python,
                        "-I",
                        worker_visible(ATTEMPTS),
                        json.dumps({**targets, "allowed_cpus": []}),
                    ],
                    "stop_grace_seconds": 1,
                    "restart": "never",
                },
            }
        )
    ).slot
    assert escaper.assignment is not None
    # The slot's CPUs are known once it is placed; the script reads them from its own affinity
    # too, but the verdict names what the slot was given.
    return Slots(
        manager, escaper.id, victim.worker.pid, {**targets, "allowed_cpus": list(escaper.assignment.cpus)}
    )


def sandboxed_run(slots: Slots) -> Run:
    def finished() -> list[str] | None:
        try:
            out = slots.manager.logs("escaper", 500)
        except NotFound:
            return None  # the keeper makes the log once it takes custody of the worker
        return out if any(line.endswith("READY") for line in out) else None

    return Run.parse(wait_until("the escaping worker's verdicts", finished, timeout=60))


def kill_escaper(slots: Slots) -> int:
    slot = slots.manager.get_slot("escaper")
    assert slot.worker is not None, slot
    assert slot.worker.pid, slot.worker
    pid = slot.worker.pid
    os.kill(pid, signal.SIGKILL)
    return pid


def control_run(targets: dict[str, Any], work: Path) -> tuple[Run, subprocess.Popen[bytes]]:
    """attempts.py outside every slot, as root, without a sandbox: each attempt must succeed."""
    out = work / "control.out"
    with out.open("wb") as handle:
        process = subprocess.Popen(
            [world_python(), "-I", str(ATTEMPTS), json.dumps(targets)],
            stdout=handle,
            stderr=subprocess.STDOUT,
        )
    wait_until(
        "the control's verdicts", lambda: b"READY" in out.read_bytes() or process.poll() is not None, 60
    )
    return Run.parse(out.read_text().splitlines()), process


def litter_places() -> tuple[str, ...]:
    """Where the escaper leaves litter: the shared writable places this host has (attempts.py)."""
    return tuple(p for p in LITTER_PLACES if os.path.isdir(p))


def start_time(pid: int) -> int | None:
    return process_start_time(pid)


#: Attempts each run must report.
EXPECTED = (
    "cgroup escape",
    "affinity beyond the slot's CPUs",
    "open a device not allowed",
    "mknod",
    "mount",
    "read the agent's token",
    "list the agent's state",
    "read the agent's memory",
    "signal the agent",
    "ptrace the agent",
    "signal another slot's worker",
    "ptrace another slot's worker",
    "fork past pids.max",
)


def escape_suite(tmp_path: Path, tag: str, *, network: bool) -> None:
    """Every attempt fails from a default slot; each succeeds in the control (see the module doc)."""
    cfg = config_for(tmp_path, tag)
    litter = f"natest{os.getpid()}-{tag}-litter"
    host_listener = socket.create_server(("0.0.0.0", 0))
    host_port = host_listener.getsockname()[1]
    slots: Slots | None = None
    control: subprocess.Popen[bytes] | None = None
    orphans: list[ProcessIdentity] = []
    try:
        slots = start_slots(cfg, network=network, litter=litter, host_port=host_port)
        confined = sandboxed_run(slots)
        orphans.append(confined.orphan)
        expected = [*EXPECTED, *(f"connect to {a}:{p}" for a, p in slots.targets["connect"])]
        assert sorted(confined.verdicts) == sorted(expected)
        for name, v in confined.verdicts.items():
            print(f"slot:    {name:32} escaped={v['escaped']!s:5} {v['detail']}")
        escaped = {name: v["detail"] for name, v in confined.verdicts.items() if v["escaped"]}
        assert not escaped, f"escaped from a default slot: {escaped}"
        assert confined.litter == list(litter_places()), confined.litter  # written, in its own mounts

        # SIGKILL the worker: nothing of its tree may keep running, nothing may be left behind.
        killed = kill_escaper(slots)
        wait_until(
            f"the escaper's orphan {confined.orphan.pid} to be ended", lambda: not alive(confined.orphan)
        )
        wait_until(f"the escaper {killed} to be gone", lambda: not Path(f"/proc/{killed}").exists(), 10)
        for where in litter_places():
            assert not Path(where, litter).exists(), f"the worker left {where}/{litter} on the host"

        # The control: the same attempts, as root outside every slot, without a sandbox, against
        # targets the test owns (its own cgroups, a test directory), must all succeed.
        scratch = Path(os.path.realpath("/var/tmp")) / f"natest{os.getpid()}-{tag}"
        scratch.mkdir()
        try:
            with control_cgroups(f"natest{os.getpid()}{tag}-escape") as own_cgroups:
                targets = {
                    **slots.targets,
                    "cgroup_procs": own_cgroups,
                    "mknod_dir": str(scratch),
                    "mount_dir": str(scratch),
                }
                free, control = control_run(targets, tmp_path)
                orphans.append(free.orphan)
                for name, v in free.verdicts.items():
                    print(f"control: {name:32} escaped={v['escaped']!s:5} {v['detail']}")
                refused = {name: v["detail"] for name, v in free.verdicts.items() if not v["escaped"]}
                assert sorted(free.verdicts) == sorted(expected)
                assert not refused, f"the control could not do what the slot was kept from: {refused}"
                assert all(Path(where, litter).exists() for where in litter_places())
                control.kill()
                control.wait(timeout=10)
                assert alive(free.orphan), "the control's orphan should outlive it (nothing ends its tree)"
        finally:
            scratch.rmdir()
    finally:
        for identity in orphans:
            pidfd = open_verified_pidfd(identity)
            if pidfd is not None:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                os.close(pidfd)
        if control is not None and control.poll() is None:
            control.kill()
            control.wait(timeout=10)
        for where in litter_places():
            with contextlib.suppress(FileNotFoundError):
                Path(where, litter).unlink()
        host_listener.close()
        if slots is not None:
            slots.manager.close()
        tear_down(cfg)
