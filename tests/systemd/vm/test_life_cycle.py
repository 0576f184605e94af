"""The agent as a systemd service, through systemd's whole life cycle, on a machine whose PID 1 is
systemd 252 on pure cgroup v2 (run-tests: ``cgroup2-vm --systemd``).

The agent is installed the documented way: run-tests builds this checkout's wheel into a virtual
environment with ``systemd/install --skip-units`` (under ``.systemd-vm/``, which the guest shares), and
this test installs the units with ``systemd/install --skip-venv`` and starts them with systemctl. It
then allocates a guaranteed slot (holding /dev/loop0), a burstable and a best-effort one, each with a
worker (/bin/sleep), and puts the agent through daemon-reload, restart, stop and start, SIGKILL and
the automatic restart, ``systemctl kill``, a stop that takes the workers along ([workers]
on_agent_stop = "stop"), host partitioning through ``systemctl set-property``, and a stop of the
slots unit. After each, ``check`` proves:

- every slot cgroup sits below the delegated cgroup of nodeagent-slots.service, with the limits
  and cpusets it had, and its device program: a process placed in the slot opens what the slot may
  (/dev/null; /dev/loop0 in the guaranteed slot) and is refused what it may not (EPERM);
- each worker is the same process as before (re-adopted: same pid, in its slot, running);
- every process sits in a leaf: the agent alone in nodeagent.service, the keeper in keeper/, the pin
  in pin/, nothing in the delegated cgroup or in slots/ themselves;
- nothing was created outside the delegated cgroup but the units' own cgroups;
- the agent is active, READY, with its watchdog armed and its status line; the journal holds its
  entries with their fields.

The figures (start to ready, restart to every worker re-adopted) go to .systemd-vm/figures.json,
which run-tests prints. Everything runs in one VM, in order: each test is one step of one story.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO = Path(__file__).resolve().parents[3]
PREFIX = REPO / ".systemd-vm"
CGROUP = Path("/sys/fs/cgroup")
CONFIG = Path("/etc/nodeagent/config.toml")
ALLOWED, FORBIDDEN, SAFE = "/dev/loop0", "/dev/loop1", "/dev/null"
WORKER = {"command": ["/bin/sleep", "1000000"], "restart": "always", "stop_grace_seconds": 5}
SLOTS = {
    "g": {"qos": "guaranteed", "resources": {"cpus": 1, "memory": "64Mi", "devices": [ALLOWED]}},
    "b": {"qos": "burstable", "resources": {"cpus": 0.5, "memory": "48Mi"}},
    "e": {"qos": "best-effort", "resources": {"memory": "32Mi"}},
}
#: The files whose values make a slot what it is; each must read the same after every event.
LIMIT_FILES = ("cpuset.cpus", "cpuset.mems", "memory.max", "memory.high", "pids.max", "cpu.max", "cpu.weight")
#: An emulated guest runs Python some 50 times slower than the host: the agent's start takes
#: minutes there. The unit's 120 s would be fine on hardware; the test gives the guest more.
SLOW_GUEST = "[Service]\nTimeoutStartSec=15min\nTimeoutStopSec=5min\n"


def run(*argv: str, check: bool = True, timeout: float = 1200) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stdout}{proc.stderr}")
    return proc.stdout


def show(unit: str, *properties: str) -> dict[str, str]:
    out = run("systemctl", "show", f"--property={','.join(properties)}", unit)
    return dict(line.partition("=")[::2] for line in out.splitlines())


def timed(*argv: str) -> float:
    began = time.monotonic()
    run(*argv)
    return time.monotonic() - began


def wait_until(what: str, check: Callable[[], Any], timeout: float = 900.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.2)


def cgroup_dirs() -> set[str]:
    return {str(p.relative_to(CGROUP)) for p in CGROUP.rglob("*") if p.is_dir()}


def procs(relpath: str) -> list[int]:
    return [int(pid) for pid in (CGROUP / relpath / "cgroup.procs").read_text().split()]


def cgroup_of(pid: int) -> str:
    return Path(f"/proc/{pid}/cgroup").read_text().strip().removeprefix("0::/")


def open_from(slot_cgroup: str, *paths: str) -> dict[str, str]:
    """Open each path (read-only) from a process placed in the slot's cgroup: "ok" or why not."""
    script = 'echo $$ > "$1" || exit 1; shift; for p do if ( : < "$p" ) 2>/dev/null; then echo "$p ok"; '
    script += 'else echo "$p $( ( : < "$p" ) 2>&1 )"; fi; done'
    out = run("/bin/sh", "-c", script, "probe", str(CGROUP / slot_cgroup / "cgroup.procs"), *paths)
    return {
        line.split(" ", 1)[0]: ("ok" if line.endswith(" ok") else line.split(" ", 1)[1])
        for line in out.splitlines()
    }


@dataclass
class Node:
    """The installed agent, as the test sees it: its API, where things are, what they were."""

    api: httpx.Client
    holder: str  # the delegated cgroup of nodeagent-slots.service
    before: set[str]  # every cgroup that existed before the install
    slots: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> slot as the API gave it
    limits: dict[str, dict[str, str | None]] = field(default_factory=dict)  # name -> file -> value
    pids: dict[str, int] = field(default_factory=dict)  # name -> worker pid
    figures: dict[str, Any] = field(default_factory=dict)

    def listing(self) -> dict[str, dict[str, Any]]:
        response = self.api.get("/v1/slots")
        response.raise_for_status()
        return {slot["name"]: slot for slot in response.json()["slots"]}

    def limit_values(self, cgroup: str) -> dict[str, str | None]:
        values: dict[str, str | None] = {}
        for name in LIMIT_FILES:
            path = CGROUP / cgroup / name
            values[name] = path.read_text().strip() if path.exists() else None
        return values


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    if os.environ.get("NODEAGENT_IN_SYSTEMD_VM") != "1" or not Path("/run/systemd/system").is_dir():
        pytest.skip("needs a machine whose PID 1 is systemd (run-tests: cgroup2-vm --systemd)")
    if not (PREFIX / "venv/bin/nodeagent").exists():
        pytest.fail(
            f"no agent installed at {PREFIX}/venv: run-tests builds it (systemd/install --skip-units)"
        )
    before = cgroup_dirs()
    host_cpus = os.sched_getaffinity(1)
    run(str(REPO / "systemd/install"), "--prefix", str(PREFIX), "--skip-venv", "--no-start")
    Path("/etc/systemd/system/nodeagent.service.d/50-slow-guest.conf").write_text(SLOW_GUEST)
    CONFIG.write_text(f'[placement]\nallowed_devices = ["{ALLOWED}"]\n')
    run("systemctl", "daemon-reload")
    took = timed("systemctl", "start", "nodeagent.service")  # Type=notify: returns on READY=1
    token = Path("/var/lib/nodeagent/token").read_text().strip()
    holder = show("nodeagent-slots.service", "ControlGroup")["ControlGroup"].strip("/")
    with httpx.Client(
        base_url="http://127.0.0.1:7070", headers={"Authorization": f"Bearer {token}"}, timeout=300
    ) as api:
        made = Node(api, holder, before)
        made.figures["start_to_ready_s"] = round(took, 2)
        yield made
        # Host partitioning (through AllowedCPUs= on the other units) lasts while an exclusive CPU is
        # held: once every slot is released the agent puts the host back, PID 1 included.
        for name in made.listing():
            assert api.delete(f"/v1/slots/{name}").status_code < 300, name
        wait_until("the host put back", lambda: os.sched_getaffinity(1) == host_cpus)
    run("systemctl", "stop", "nodeagent.service", "nodeagent-slots.service")
    (PREFIX / "figures.json").write_text(json.dumps(made.figures, indent=2) + "\n")


def check(node: Node, event: str, *, same_workers: bool = True) -> None:
    """Everything the module docstring promises, after ``event``."""
    state = show("nodeagent.service", "ActiveState", "SubState", "MainPID", "StatusText", "WatchdogUSec")
    assert (state["ActiveState"], state["SubState"]) == ("active", "running"), (event, state)
    assert state["StatusText"].startswith("serving on"), (event, state)
    assert state["WatchdogUSec"] == "30s", (event, state)
    agent = int(state["MainPID"])
    listing = node.listing()
    assert set(listing) == set(SLOTS), event
    for name, slot in listing.items():
        cgroup = slot["cgroup"].strip("/")
        assert cgroup == node.slots[name]["cgroup"].strip("/"), (event, name)
        assert cgroup.startswith(f"{node.holder}/slots/"), (event, name, cgroup)
        worker = slot["worker"]
        assert worker["phase"] == "running", (event, name, worker)
        if same_workers:
            assert worker["pid"] == node.pids[name], f"{event}: {name}'s worker was not re-adopted: {worker}"
        node.pids[name] = worker["pid"]
        assert cgroup_of(worker["pid"]) == cgroup, (event, name)
        assert node.limit_values(cgroup) == node.limits[name], (event, name)
        opened = open_from(cgroup, SAFE, ALLOWED, FORBIDDEN)
        assert opened[SAFE] == "ok", (event, name, opened)
        assert opened[FORBIDDEN].endswith("Operation not permitted"), (event, name, opened)
        if name == "g":
            assert opened[ALLOWED] == "ok", (event, name, opened)
        else:
            assert opened[ALLOWED].endswith("Operation not permitted"), (event, name, opened)
    # Processes only in leaves; the agent alone in its own cgroup, which has no children.
    assert procs("nodeagent.slice/nodeagent.service") == [agent], event
    assert cgroup_of(agent) == "nodeagent.slice/nodeagent.service", event
    assert not [d for d in (CGROUP / "nodeagent.slice/nodeagent.service").iterdir() if d.is_dir()], event
    for inner in ("", "/slots", "/slots/burstable", "/slots/best-effort"):
        assert procs(node.holder + inner) == [], (event, inner)
    assert procs(f"{node.holder}/keeper"), f"{event}: no keeper in keeper/"
    assert procs(f"{node.holder}/pin"), f"{event}: no pin in pin/"
    # Nothing outside the delegated cgroup but the cgroups of units (systemd's own).
    new = cgroup_dirs() - node.before
    foreign = [d for d in new if not (d == node.holder or d.startswith(node.holder + "/"))]
    assert all(re.fullmatch(r".*\.(slice|service|scope)", d.rsplit("/", 1)[-1]) for d in foreign), (
        event,
        foreign,
    )


def worker_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def wait_for_restart(old_pid: int, restarts: int) -> float:
    """After the agent was killed: wait for systemd's automatic restart (one more than ``restarts``)
    to be READY; returns the seconds it took."""
    began = time.monotonic()

    def back() -> bool:
        state = show("nodeagent.service", "ActiveState", "SubState", "MainPID", "NRestarts")
        return (
            state["ActiveState"] == "active"
            and state["SubState"] == "running"
            and int(state["MainPID"]) not in (0, old_pid)
            and int(state["NRestarts"]) == restarts + 1
        )

    wait_until("the automatic restart", back)
    return time.monotonic() - began


def restarts() -> int:
    return int(show("nodeagent.service", "NRestarts")["NRestarts"])


def all_running(node: Node) -> dict[str, dict[str, Any]] | None:
    listing = node.listing()
    return listing if all(slot["worker"]["phase"] == "running" for slot in listing.values()) else None


def main_pid() -> int:
    return int(show("nodeagent.service", "MainPID")["MainPID"])


# --------------------------------------------------------------------------- the story


def test_started_by_systemd_the_agent_lives_in_its_unit_and_the_slots_in_the_delegated_cgroup(
    node: Node,
) -> None:
    assert node.holder == "nodeagent.slice/nodeagent-slots.service"
    assert (CGROUP / node.holder / "cgroup.subtree_control").read_text().split() == [
        "cpuset",
        "cpu",
        "io",
        "memory",
        "pids",
    ]
    for name, body in SLOTS.items():
        response = node.api.post("/v1/slots", json={"name": name, **body, "worker": WORKER})
        assert response.status_code == 201, response.text
        node.slots[name] = response.json()
    listing = wait_until("every worker running", lambda: all_running(node))
    for name, slot in listing.items():
        node.pids[name] = slot["worker"]["pid"]
        node.limits[name] = node.limit_values(slot["cgroup"].strip("/"))
    guaranteed = node.limits["g"]
    assert guaranteed["memory.max"] == str(64 << 20)
    assert guaranteed["cpuset.cpus"] == ",".join(map(str, listing["g"]["assignment"]["cpus"]))
    check(node, "allocation")


def test_daemon_reload_leaves_everything_as_it_was(node: Node) -> None:
    run("systemctl", "daemon-reload")
    check(node, "daemon-reload")


def test_restart_readopts_every_worker(node: Node) -> None:
    old = main_pid()
    node.figures["restart_to_readopted_s"] = round(timed("systemctl", "restart", "nodeagent.service"), 2)
    assert main_pid() != old
    check(node, "systemctl restart")  # at once: READY=1 comes after every worker was re-adopted


def test_stop_keeps_workers_by_default_and_start_readopts_them(node: Node) -> None:
    run("systemctl", "stop", "nodeagent.service")
    assert show("nodeagent.service", "ActiveState")["ActiveState"] == "inactive"
    assert all(worker_alive(pid) for pid in node.pids.values())
    check_stopped_slots_intact(node)
    node.figures["stop_start_to_readopted_s"] = round(timed("systemctl", "start", "nodeagent.service"), 2)
    check(node, "systemctl stop, start")


def check_stopped_slots_intact(node: Node) -> None:
    for name, slot in node.slots.items():
        assert node.limit_values(slot["cgroup"].strip("/")) == node.limits[name], name


def test_sigkill_and_the_automatic_restart(node: Node) -> None:
    # From here on the agent is configured to stop workers when it is stopped: SIGKILL, systemctl
    # kill and restart must still leave them alone.
    CONFIG.write_text(f'[placement]\nallowed_devices = ["{ALLOWED}"]\n\n[workers]\non_agent_stop = "stop"\n')
    old, count = main_pid(), restarts()
    run("systemctl", "kill", "--signal=SIGKILL", "nodeagent.service")
    node.figures["sigkill_to_readopted_s"] = round(wait_for_restart(old, count), 2)
    check(node, "SIGKILL and Restart=always")


def test_systemctl_kill_and_the_automatic_restart(node: Node) -> None:
    old, count = main_pid(), restarts()
    run("systemctl", "kill", "nodeagent.service")  # SIGTERM without a stop job: not a stop
    wait_for_restart(old, count)
    check(node, "systemctl kill")


def test_restart_never_stops_workers(node: Node) -> None:
    run("systemctl", "restart", "nodeagent.service")
    check(node, "systemctl restart (on_agent_stop = stop)")


def test_stop_takes_the_workers_along_when_configured_and_start_brings_them_back(node: Node) -> None:
    old = dict(node.pids)
    run("systemctl", "stop", "nodeagent.service")
    assert not any(worker_alive(pid) for pid in old.values()), "on_agent_stop = stop left workers running"
    check_stopped_slots_intact(node)  # slots stay: limits and cpusets as they were
    run("systemctl", "start", "nodeagent.service")
    wait_until("every worker running again", lambda: all_running(node))
    check(node, "systemctl stop, start (on_agent_stop = stop)", same_workers=False)
    assert not set(node.pids.values()) & set(old.values())


def test_host_partitioning_through_systemd_leaves_the_slots_their_cpus(node: Node) -> None:
    """What host partitioning does: confine system.slice (and the other top-level units) to the
    shared CPUs with systemctl set-property. The slots, in nodeagent.slice, keep theirs."""
    exclusive = node.limits["g"]["cpuset.cpus"]
    assert exclusive is not None
    online = Path("/sys/devices/system/cpu/online").read_text().strip()
    others = sorted(set(range(os.cpu_count() or 1)) - {int(c) for c in exclusive.split(",")})
    assert others, f"no CPU outside the guaranteed slot's {exclusive} (online {online})"
    run("systemctl", "set-property", "--runtime", "system.slice", f"AllowedCPUs={','.join(map(str, others))}")
    try:
        run("systemctl", "daemon-reload")
        effective = (
            (CGROUP / node.slots["g"]["cgroup"].strip("/") / "cpuset.cpus.effective").read_text().strip()
        )
        assert effective == exclusive
        assert (CGROUP / "system.slice/cpuset.cpus.effective").read_text().strip() == ",".join(
            map(str, others)
        )
        check(node, "set-property system.slice AllowedCPUs=")
    finally:
        run("systemctl", "set-property", "--runtime", "system.slice", "AllowedCPUs=")


def test_stopping_the_slots_unit_ends_everything_and_the_agent_rebuilds_the_slots(node: Node) -> None:
    old = dict(node.pids)
    run("systemctl", "stop", "nodeagent-slots.service")
    assert show("nodeagent.service", "ActiveState")["ActiveState"] == "inactive"  # PartOf=
    assert not any(worker_alive(pid) for pid in old.values())
    assert not (CGROUP / node.holder).exists()
    run("systemctl", "start", "nodeagent.service")  # pulls the slots unit back in
    node.holder = show("nodeagent-slots.service", "ControlGroup")["ControlGroup"].strip("/")
    wait_until("every worker running again", lambda: all_running(node))
    check(node, "systemctl stop nodeagent-slots, start nodeagent", same_workers=False)


def test_the_journal_keeps_the_agents_fields(node: Node) -> None:
    entries = [
        json.loads(line)
        for line in run(
            "journalctl", "--unit=nodeagent.service", "--output=json", "SYSLOG_IDENTIFIER=nodeagent"
        ).splitlines()
    ]
    serving = [e for e in entries if e.get("MESSAGE") == "serving"]
    assert len(serving) == 8, [e.get("MESSAGE") for e in entries]  # one per start of the agent
    assert {e["PRIORITY"] for e in serving} == {"6"}
    assert all(float(e["STARTUP_SECONDS"]) > 0 and e["LISTEN"] == "127.0.0.1:7070" for e in serving)
    assert all(e["_TRANSPORT"] == "journal" for e in serving)  # the native protocol, not stdout
    node.figures["agent_startup_seconds"] = [float(e["STARTUP_SECONDS"]) for e in serving]
    delegated = [e for e in entries if e.get("MESSAGE") == "cgroups delegated by systemd"]
    assert delegated
    assert delegated[0]["DELEGATED_CGROUP"] == "/nodeagent.slice/nodeagent-slots.service"
    stopped = [e for e in entries if e.get("MESSAGE") == "workers stopped with the agent"]
    # systemctl stop nodeagent, and stopping the slots unit (which stops the agent first): both with
    # on_agent_stop = "stop"; no restart, kill or crash stopped a worker.
    assert len(stopped) == 2
    assert sorted(json.loads(stopped[0]["SLOTS"])) == sorted(s["id"] for s in node.slots.values())
    assert "Watchdog timeout" not in run("journalctl", "--unit=nodeagent.service", "--output=cat")
    node.figures["note"] = (
        f"systemd {run('systemctl', '--version').split()[1]}, {os.cpu_count()} CPUs; "
        "wall-clock seconds of each systemctl command, or from the kill to READY"
    )


def test_the_watchdog_is_pinged(node: Node) -> None:
    """WATCHDOG=1 every 15 s (WatchdogSec=30s): systemd's record of the last ping moves on."""
    first = int(show("nodeagent.service", "WatchdogTimestampMonotonic")["WatchdogTimestampMonotonic"])
    time.sleep(16)
    second = int(show("nodeagent.service", "WatchdogTimestampMonotonic")["WatchdogTimestampMonotonic"])
    assert second > first > 0


def test_in_a_delegated_scope_the_agent_moves_into_a_leaf_of_it(node: Node, tmp_path: Path) -> None:
    """The other way to hand the agent a cgroup (a trial run): ``systemd-run --scope -p Delegate=yes``.
    A scope never has a process started in it by systemd, so the agent leaves the scope's root for
    agent/ and puts the keeper and the slots beside it. (Last: its cgroups are not nodeagent's.)"""
    scope = "natest-island.scope"
    (tmp_path / "config.toml").write_text("")
    argv = [str(PREFIX / "venv/bin/nodeagent"), "serve", "--config", str(tmp_path / "config.toml")]
    argv += ["--state-dir", str(tmp_path / "state"), "--listen", "127.0.0.1:7071"]
    with (tmp_path / "log").open("wb") as log:
        agent = subprocess.Popen(
            ["systemd-run", "--scope", "--quiet", f"--unit={scope}", "-p", "Delegate=yes", "--", *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd="/",
        )
    try:
        root = wait_until("the scope", lambda: show(scope, "ControlGroup")["ControlGroup"].strip("/"))

        def ready() -> bool:
            assert agent.poll() is None, (tmp_path / "log").read_text()[-3000:]
            try:
                return httpx.get("http://127.0.0.1:7071/readyz", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        wait_until("the agent in the scope", ready)
        token = (tmp_path / "state/token").read_text().strip()
        with httpx.Client(
            base_url="http://127.0.0.1:7071", headers={"Authorization": f"Bearer {token}"}, timeout=300
        ) as api:
            response = api.post("/v1/slots", json={"name": "b", **SLOTS["b"], "worker": WORKER})
            assert response.status_code == 201, response.text
            slot = response.json()
            assert slot["cgroup"].strip("/") == f"{root}/slots/burstable/{slot['id']}"
            worker = wait_until(
                "the worker", lambda: (w := api.get(f"/v1/slots/{slot['id']}").json()["worker"])["pid"] and w
            )
        assert procs(f"{root}/agent") == [agent.pid]
        assert procs(root) == []
        assert procs(f"{root}/keeper")
        assert cgroup_of(worker["pid"]) == f"{root}/slots/burstable/{slot['id']}"
    finally:
        run("systemctl", "stop", scope, check=False)  # ends the agent, its keeper and worker
        agent.wait(timeout=120)
