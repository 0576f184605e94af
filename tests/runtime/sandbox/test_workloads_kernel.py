"""Real programs under the whole sandbox: a multi-threaded Python that forks, execs and talks on a
socket, and ``python -m http.server`` answering from inside, for a non-root worker and for an
opted-in root one."""

from __future__ import annotations

import json
import socket
import urllib.request

import pytest

from nodeagent.runtime.sandbox import DeviceNode, SandboxSpec
from nodeagent.runtime.sandbox.caps import ROOT_CAPABILITIES
from tests.runtime.sandbox.child import INIT, NOBODY, WORKER_PYTHON, Child, python, run, start

pytestmark = pytest.mark.root

FULL = SandboxSpec(
    uid=NOBODY,
    gid=NOBODY,
    devices=(DeviceNode("/dev/natest0", "c", 1, 3, mode=0o666),),
    hide_paths=("/var/lib/nodeagent",),
    hostname="slot-test",
)
ROOT = SandboxSpec(
    uid=0,
    gid=0,
    capabilities=ROOT_CAPABILITIES,
    namespaces=("mount", "pid", "ipc", "uts", "cgroup"),
    cgroup_view="namespace",
    read_only_root=True,
    init=INIT,
)

BUSY_PYTHON = """
import concurrent.futures, json, multiprocessing, os, socket, subprocess, tempfile, threading
def square(n):
    return n * n
with concurrent.futures.ThreadPoolExecutor(8) as pool:
    threads = sum(pool.map(square, range(100)))
with multiprocessing.get_context("fork").Pool(2) as processes:
    forked = sum(processes.map(square, range(10)))
listener = socket.create_server(("127.0.0.1", 0))
client = socket.create_connection(listener.getsockname())
peer, _ = listener.accept()
client.sendall(b"ping")
with tempfile.NamedTemporaryFile(dir="/dev/shm") as shm, tempfile.TemporaryFile() as tmp:
    shm.write(b"x"); tmp.write(b"y")
print(json.dumps({
    "threads": threads, "forked": forked, "socket": peer.recv(4).decode(),
    "true": subprocess.run(["/bin/true"]).returncode,
    "hostname": socket.gethostname(),
    "semaphore": multiprocessing.get_context("fork").Semaphore(2).get_value(),
}))
"""


@pytest.mark.parametrize("spec", [FULL, ROOT], ids=["non-root", "root-opt-in"])
def test_multithreaded_python_forks_execs_and_talks(spec, slot):
    finished = run(spec, python(BUSY_PYTHON), cgroup_procs=slot.procs_files)
    assert finished.returncode == 0, finished.output
    seen = json.loads(finished.output)
    assert seen["threads"] == sum(n * n for n in range(100))
    assert seen["forked"] == sum(n * n for n in range(10))
    assert seen["socket"] == "ping"
    assert seen["true"] == 0
    assert seen["semaphore"] == 2
    if spec.hostname:
        assert seen["hostname"] == spec.hostname


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize("spec", [FULL, ROOT], ids=["non-root", "root-opt-in"])
def test_http_server_serves_from_inside(spec, slot, sandboxed: list[Child]):
    port = _free_port()
    argv = [
        WORKER_PYTHON,
        "-I",
        "-u",
        "-m",
        "http.server",
        str(port),
        "--bind",
        "127.0.0.1",
        "--directory",
        "/tmp",
    ]
    child = start(spec, argv, cgroup_procs=slot.procs_files)
    sandboxed.append(child)
    child.wait_for_output("Serving HTTP")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as response:
        assert response.status == 200
        body = response.read().decode()
    assert "Directory listing for /" in body
    assert "<li>" not in body  # the worker's /tmp is its own, and empty
    slot.kill_all(5.0)
    child.wait(10)
