"""Host partitioning of a whole (throwaway) pure cgroup v2 host: every process outside the slots, PID
1, kthreadd and unbound kernel threads, the workqueue mask, interrupts, and the cpusets of the
root's other children; all of it put back afterwards. Then the real agent: allocate through the API,
SIGKILL, restart, release.

Collected only inside the cgroup v2 VM (NODEAGENT_IN_CGROUP2_VM=1), where changing the whole host
touches nobody else; every test still puts back what it changed, checked against a snapshot.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent.cgroups import CgroupHost, detect
from nodeagent.cpulist import parse_cpulist
from nodeagent.isolation.host_kernel import parse_mask
from nodeagent.isolation.isolator import SlotIsolator
from nodeagent.isolation.partitioning import RECORD_NAME, host_partitioner
from tests.daemon import DaemonProcess, wait_until
from tests.isolation.specs import guaranteed

# Niced: it only has to be there to be confined, not to slow the agent's start on the VM's 2 CPUs.
BUSY = "import os\nos.nice(19)\nwhile True:\n    pass\n"
WQ = Path("/sys/devices/virtual/workqueue/cpumask")


def last_cpu(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[36])


def sample(pids: list[int], seconds: float) -> set[int]:
    seen: set[int] = set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        seen |= {last_cpu(pid) for pid in pids}
        time.sleep(0.001)
    return seen


def irq_affinities() -> dict[str, str]:
    found = {}
    for entry in Path("/proc/irq").iterdir():
        if entry.name.isdigit() and (entry / "smp_affinity_list").exists():
            found[entry.name] = (entry / "smp_affinity_list").read_text().strip()
    return found


def host_snapshot() -> dict[str, object]:
    """What the host holds that partitioning changes (to prove it is all put back)."""
    kthreadd = next(
        int(p.name)
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and (p / "comm").read_text().strip() == "kthreadd"
    )
    return {
        "pid1": os.sched_getaffinity(1),
        "kthreadd": os.sched_getaffinity(kthreadd),
        "self": os.sched_getaffinity(0),
        "wq": parse_mask(WQ.read_text()),
        "irqs": irq_affinities(),
        "default": parse_mask(Path("/proc/irq/default_smp_affinity").read_text()),
    }


@pytest.fixture
def busy_in_root() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", BUSY])
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def sibling(host: CgroupHost) -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    """A cgroup beside the agent's, with a cpuset of its own and a busy process in it."""
    assert host.v2_mount is not None
    path = host.v2_mount / f"natestsib{os.getpid()}"
    path.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", "import os, sys\nos.read(0, 1)\n" + BUSY], stdin=subprocess.PIPE
    )
    try:
        (path / "cgroup.procs").write_text(str(proc.pid))
        assert proc.stdin is not None
        proc.stdin.write(b"x")
        proc.stdin.flush()
        yield path, proc
    finally:
        proc.kill()
        proc.wait()
        if proc.stdin is not None:
            proc.stdin.close()
        for _ in range(100):
            try:
                path.rmdir()
                break
            except OSError:
                time.sleep(0.05)


def test_the_whole_host_leaves_the_exclusive_cpu_and_comes_back(
    tmp_path: Path,
    host: CgroupHost,
    isolator: SlotIsolator,
    busy_in_root: subprocess.Popen[bytes],
    sibling: tuple[Path, subprocess.Popen[bytes]],
) -> None:
    before = host_snapshot()
    sibling_dir, sibling_proc = sibling
    sibling_cpus = (sibling_dir / "cpuset.cpus").read_text()
    isolator.apply(guaranteed("g", frozenset({1})))
    p = host_partitioner(host, state_dir=tmp_path, cgroup_parent=isolator.config.cgroup_parent)
    try:
        report = p.apply(frozenset({1}))
        assert os.sched_getaffinity(1) == {0}
        assert os.sched_getaffinity(busy_in_root.pid) == {0}
        assert parse_mask(WQ.read_text()) == {0}
        assert parse_mask(Path("/proc/irq/default_smp_affinity").read_text()) == {0}
        assert (sibling_dir / "cpuset.cpus").read_text().strip() == "0"
        assert os.sched_getaffinity(sibling_proc.pid) == {0}  # through its cgroup's cpuset
        assert report.moved["cgroup"] == 1
        # Every movable interrupt left CPU 1; the managed ones (virtio-blk queues) are reported.
        stuck = {irq for irq, cpus in irq_affinities().items() if 1 in parse_cpulist(cpus)}
        for irq in stuck:
            assert any(f"interrupt {irq} " in line for line in report.immovable), (irq, report.immovable)
        assert any("ksoftirqd/1" in line or "cpuhp/1" in line for line in report.immovable)
        assert 1 not in sample([busy_in_root.pid, sibling_proc.pid], 1.0)
        # A child started now inherits the confinement.
        child = subprocess.run(
            [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert child.stdout.strip() == "[0]"
    finally:
        isolator.release("g")
        p.restore()
    assert host_snapshot() == before
    # Empty again (it follows the root), or, since a cgroup with tasks cannot be emptied, the root's CPUs.
    assert parse_cpulist((sibling_dir / "cpuset.cpus").read_text()) in (
        parse_cpulist(sibling_cpus),
        frozenset(before["pid1"]),  # type: ignore[arg-type]
    )
    assert not (tmp_path / RECORD_NAME).exists()


def test_the_agent_partitions_the_host_survives_sigkill_and_puts_it_back(
    tmp_path: Path, isolator: SlotIsolator
) -> None:
    before = host_snapshot()
    parent = isolator.config.cgroup_parent
    daemon = DaemonProcess(
        tmp_path,
        f'[isolation]\ncgroup_parent = "{parent}"\nhost_partitioning = "auto"\nhost_sweep_seconds = 0.5\n',
    )
    busy_in_root: subprocess.Popen[bytes] | None = None
    try:
        client = daemon.start(timeout=180)
        # Started once the agent is up: under emulation a busy neighbour slows its start a lot.
        busy_in_root = subprocess.Popen([sys.executable, "-c", BUSY])
        created = client.post(
            "/v1/slots", json={"name": "g", "qos": "guaranteed", "resources": {"cpus": 1, "memory": "64Mi"}}
        )
        assert created.status_code == 201, created.text
        slot = created.json()
        cpu = slot["assignment"]["cpus"][0]
        host = set(before["pid1"]) - {cpu}  # type: ignore[call-overload]
        assert os.sched_getaffinity(busy_in_root.pid) == host
        assert os.sched_getaffinity(1) == host
        node = client.get("/v1/node").json()["host_partitioning"]
        assert node["active"] is True
        assert node["last"]["exclusive_cpus"] == str(cpu)
        # The owner widens it; the sweep (every 0.5 s here) puts it back within a few periods.
        os.sched_setaffinity(busy_in_root.pid, before["pid1"])  # type: ignore[arg-type]
        try:
            wait_until("the sweep", lambda: os.sched_getaffinity(busy_in_root.pid) == host, timeout=20)
        except AssertionError as err:
            raise AssertionError(f"{err}; the agent's log:\n{daemon.log_tail()}") from None
        time.sleep(1.0)
        foreign = client.get(f"/v1/slots/{slot['id']}").json()["foreign_cpu"]
        assert foreign is not None
        assert set(foreign) == {"seconds", "fraction", "since", "irq_seconds"}
        metrics = client.get("/metrics").text
        assert f'nodeagent_slot_foreign_cpu_seconds_total{{name="g",slot="{slot["id"]}"}}' in metrics
        client.close()
        daemon.kill()
        # Dead agent: the host stays confined (the slot lives), and the record says what to undo.
        assert os.sched_getaffinity(1) == host
        assert (daemon.state / RECORD_NAME).exists()
        client = daemon.start(timeout=180)
        assert os.sched_getaffinity(1) == host
        assert client.delete(f"/v1/slots/{slot['id']}").status_code == 204
        assert os.sched_getaffinity(1) == before["pid1"]
        assert os.sched_getaffinity(busy_in_root.pid) == before["pid1"]
        assert not (daemon.state / RECORD_NAME).exists()
        client.close()
    finally:
        if busy_in_root is not None:
            busy_in_root.kill()
            busy_in_root.wait()
        if daemon.process is not None:
            daemon.process.send_signal(signal.SIGTERM)
            daemon.process.wait(timeout=30)
        put_back(daemon, parent)
    assert host_snapshot() == before


def test_restore_host_puts_back_what_a_killed_agent_left(tmp_path: Path, isolator: SlotIsolator) -> None:
    before = host_snapshot()
    parent = isolator.config.cgroup_parent
    daemon = DaemonProcess(tmp_path, f'[isolation]\ncgroup_parent = "{parent}"\nhost_partitioning = "auto"\n')
    client = daemon.start(timeout=180)
    created = client.post(
        "/v1/slots", json={"name": "g", "qos": "guaranteed", "resources": {"cpus": 1, "memory": "64Mi"}}
    )
    assert created.status_code == 201, created.text
    client.close()
    daemon.kill()
    try:
        assert os.sched_getaffinity(1) != before["pid1"]
        restore_in_a_new_process(daemon)
        # Checked before the safety net below runs: the restore alone must have done it.
        assert host_snapshot() == before
        assert not (daemon.state / RECORD_NAME).exists()
    finally:
        put_back(daemon, parent)


def put_back(daemon: DaemonProcess, parent: str) -> None:
    """Whatever a failed test left confined goes back, so the next test starts from a whole host."""
    if (daemon.state / RECORD_NAME).exists():
        host_partitioner(detect(), state_dir=daemon.state, cgroup_parent=parent).restore()


def restore_in_a_new_process(daemon: DaemonProcess) -> None:
    script = (
        "import sys\nfrom pathlib import Path\n"
        "from nodeagent.agent.config import apply_overrides, load_config\n"
        "from nodeagent.agent.daemon import restore_host\n"
        "config = apply_overrides(load_config(Path(sys.argv[1])), state_dir=Path(sys.argv[2]))\n"
        "print(restore_host(config).moved)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(daemon.config), str(daemon.state)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
