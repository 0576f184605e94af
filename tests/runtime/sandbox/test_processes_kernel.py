"""A worker cannot see, signal or trace processes outside its slot: hidepid and its own uid for a
non-root worker, a pid namespace with an init for a root one. With controls."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from nodeagent.runtime.sandbox import SandboxSpec, enter_sandbox, fork_into_new_pid_namespace
from nodeagent.runtime.sandbox.caps import ROOT_CAPABILITIES
from tests.runtime.sandbox.child import ENV, INIT, NOBODY, WORKER_PYTHON, Child, python, run, start

pytestmark = pytest.mark.root

LOOK_AROUND = """
import errno, json, os, sys
target = int(sys.argv[1])
try:
    os.kill(target, 0)
    signal = "delivered"
except OSError as err:
    signal = errno.errorcode[err.errno]
print(json.dumps({
    "me": os.getpid(),
    "pids": sorted(int(n) for n in os.listdir("/proc") if n.isdigit()),
    "uids": sorted({os.stat(f"/proc/{n}").st_uid for n in os.listdir("/proc") if n.isdigit()}),
    "target_visible": os.path.exists(f"/proc/{target}"),
    "signal": signal,
}))
"""

ROOT_SPEC = SandboxSpec(
    uid=0,
    gid=0,
    capabilities=ROOT_CAPABILITIES,
    namespaces=("mount", "pid", "ipc", "uts"),
    read_only_root=True,
    init=INIT,
)


@pytest.fixture
def other_process():
    """A process of the host the worker must not reach: a root sleeper this test started."""
    pid = os.fork()
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    yield pid
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def test_non_root_worker_sees_only_its_own_processes(other_process):
    finished = run(SandboxSpec(uid=NOBODY, gid=NOBODY), [*python(LOOK_AROUND), str(other_process)])
    seen = json.loads(finished.output)
    assert seen["target_visible"] is False
    assert seen["signal"] == "EPERM"
    assert seen["uids"] == [NOBODY]  # only its own uid's processes, whatever else runs as it
    assert os.getpid() not in seen["pids"]


def test_control_same_uid_without_sandbox_sees_every_process(other_process):
    seen = json.loads(run(None, [*python(LOOK_AROUND), str(other_process)], user=NOBODY).output)
    assert seen["target_visible"] is True
    assert seen["signal"] == "EPERM"  # the uid alone already refuses the signal
    assert os.getpid() in seen["pids"]
    assert 0 in seen["uids"]


def test_root_worker_in_a_pid_namespace_sees_and_signals_nothing_outside(other_process):
    finished = run(ROOT_SPEC, [*python(LOOK_AROUND), str(other_process)])
    seen = json.loads(finished.output)
    assert seen["me"] == 2  # PID 1 is the init
    assert seen["pids"] == [1, 2]
    assert seen["target_visible"] is False
    assert seen["signal"] == "ESRCH"
    assert Path(f"/proc/{other_process}").exists()  # still alive


def test_control_root_without_pid_namespace_could_signal_the_host(other_process):
    seen = json.loads(run(None, [*python(LOOK_AROUND), str(other_process)]).output)
    assert seen["signal"] == "delivered"


SLEEPER = "print('up', flush=True); import time; time.sleep(60)"


def test_sigterm_reaches_a_worker_without_handler_through_the_init(sandboxed: list[Child]):
    child = start(ROOT_SPEC, python(SLEEPER))
    sandboxed.append(child)
    child.wait_for_output("up")
    os.kill(child.pid, signal.SIGTERM)  # child.pid is the init, as the keeper would see it
    assert child.wait(10).returncode == 128 + signal.SIGTERM


def test_control_a_worker_as_pid_1_ignores_sigterm(sandboxed: list[Child]):
    read_end, write_end = os.pipe()
    pid = fork_into_new_pid_namespace()
    if pid == 0:
        try:
            os.dup2(write_end, 1)
            os.execve(WORKER_PYTHON, python(SLEEPER), ENV)
        finally:
            os._exit(127)
    os.close(write_end)
    child = Child(pid, read_end)
    sandboxed.append(child)
    child.wait_for_output("up")
    os.kill(pid, signal.SIGTERM)
    time.sleep(0.3)
    assert child.poll() is None  # the kernel dropped SIGTERM: PID 1 has no handler for it
    os.kill(pid, signal.SIGKILL)
    assert child.wait(10).returncode == -signal.SIGKILL


def _pid_namespace_of(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/pid")


def _members_of(namespace: str) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") == namespace:
                    members.append(int(entry))
            except OSError:
                continue
    return members


def test_orphans_die_with_the_namespace_when_the_worker_exits(sandboxed: list[Child]):
    orphaning = ["/bin/sh", "-c", "sleep 60 & sleep 60 & echo started; sleep 0.5; exit 5"]
    child = start(ROOT_SPEC, orphaning)
    sandboxed.append(child)
    child.wait_for_output("started")
    namespace = _pid_namespace_of(child.pid)
    assert len(_members_of(namespace)) >= 4  # init, sh, two sleeps
    assert child.wait(10).returncode == 5
    deadline = time.monotonic() + 5
    while _members_of(namespace) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _members_of(namespace) == []


def test_pid_namespace_is_required_to_be_pid_1():
    from tests.runtime.sandbox.child import in_child

    def attempt() -> list[object]:
        try:
            enter_sandbox(ROOT_SPEC)
        except OSError as err:
            return [getattr(err, "step", None), err.errno]
        return []

    assert in_child(attempt) == ["pid namespace", 22]
