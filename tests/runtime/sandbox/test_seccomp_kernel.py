"""The seccomp filter installed in forked children: what it denies fails with EPERM (clone3 with
ENOSYS) while Python goes on working; each denial has a control without the filter."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from nodeagent.runtime.sandbox import mounts, seccomp
from nodeagent.runtime.sandbox.syscalls import ARCHITECTURES
from tests.runtime.sandbox.child import in_child, os_error_of

pytestmark = pytest.mark.root

libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWUTS = 0x04000000
MS_BIND = 4096
PTRACE_SEIZE = 0x4206
CLONE_NEWNS = 0x00020000


def _syscall(name: str, *args: int) -> int:
    number = ARCHITECTURES[seccomp.native_arch()][1][name]
    if libc.syscall(number, *(ctypes.c_long(arg) for arg in args)) == -1:
        return ctypes.get_errno()
    return 0


def _socket(family: int) -> int:
    """errno of socket(family, SOCK_STREAM) (0: it was made, and is closed again)."""
    try:
        socket.socket(family, socket.SOCK_STREAM).close()
    except OSError as err:
        return err.errno or -1
    return 0


def _attempts() -> dict[str, int]:
    """errno of each attempt (0: it worked), in a throwaway child that already has a private mount
    namespace, so a mount that gets through never reaches the host."""
    target = os.fork()
    if target == 0:  # a process of our own to trace
        time.sleep(30)
        os._exit(0)
    try:
        return {
            "unshare": _syscall("unshare", CLONE_NEWUTS),
            "mount": os_error_of(lambda: _check(libc.mount(b"/tmp", b"/tmp", None, MS_BIND, None))),
            # PTRACE_SEIZE attaches without stopping the tracee.
            "ptrace": _syscall("ptrace", PTRACE_SEIZE, target, 0, 0),
            "process_vm_readv": _syscall("process_vm_readv", target, 0, 0, 0, 0, 0),
            "clone3": _syscall("clone3", 0, 0),
            "keyctl": _syscall("keyctl", 0, 0),
            "vsock": _socket(seccomp.AF_VSOCK),
            "inet": _socket(socket.AF_INET),
        }
    finally:
        os.kill(target, signal.SIGKILL)
        os.waitpid(target, 0)


def _private_mounts() -> None:
    _check(libc.unshare(CLONE_NEWNS))
    mounts.make_private("/")


def _check(result: int) -> None:
    if result == -1:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _filtered(*allow: str) -> dict[str, int]:
    _private_mounts()
    program = seccomp.filter_for("default", allow)
    assert program is not None
    seccomp.install(program)
    return _attempts()


def test_filter_denies_namespace_mount_and_ptrace_calls():
    assert in_child(_filtered) == {
        "unshare": errno.EPERM,
        "mount": errno.EPERM,
        "ptrace": errno.EPERM,
        "process_vm_readv": errno.EPERM,
        "clone3": errno.ENOSYS,
        "keyctl": errno.EPERM,
        "vsock": errno.EPERM,
        "inet": 0,
    }


def test_control_without_filter_the_same_calls_reach_the_kernel():
    def unfiltered() -> dict[str, int]:
        _private_mounts()
        return _attempts()

    seen = in_child(unfiltered)
    assert seen["unshare"] == 0
    assert seen["mount"] == 0
    assert seen["ptrace"] == 0
    # Bad arguments, but past the entry: the kernel itself answered.
    assert seen["process_vm_readv"] == 0
    assert seen["clone3"] not in (0, errno.ENOSYS, errno.EPERM)
    assert seen["keyctl"] not in (0, errno.EPERM)
    # Made, or refused by the kernel itself where no vsock transport is loaded.
    assert seen["vsock"] in (0, errno.EAFNOSUPPORT)
    assert seen["inet"] == 0


def test_opt_out_lets_the_named_call_through_and_nothing_else():
    seen = in_child(lambda: _filtered("ptrace", "unshare"))
    assert seen["ptrace"] == 0
    assert seen["unshare"] == 0
    assert seen["mount"] == errno.EPERM


def _python_still_works() -> dict[str, object]:
    results: list[int] = []
    threads = [threading.Thread(target=lambda n=n: results.append(n * n)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    listener = socket.create_server(("127.0.0.1", 0))
    with listener, socket.create_connection(listener.getsockname()) as client:
        peer, _ = listener.accept()
        with peer:
            client.sendall(b"ping")
            echoed = peer.recv(4)
    true = subprocess.run(["/bin/true"], check=False).returncode
    forked = os.fork()
    if forked == 0:
        os._exit(7)
    _, status = os.waitpid(forked, 0)
    return {
        "json": json.loads(json.dumps({"a": [1, 2]})),
        "threads": sorted(results),
        "socket": echoed.decode(),
        "true": true,
        "fork": os.waitstatus_to_exitcode(status),
        "python": subprocess.run(
            [sys.executable, "-c", "print(6*7)"], capture_output=True, text=True, check=False
        ).stdout,
    }


def test_python_runs_normally_under_the_filter():
    def filtered() -> dict[str, object]:
        program = seccomp.filter_for("default")
        assert program is not None
        seccomp.install(program)
        return _python_still_works()

    assert in_child(filtered) == {
        "json": {"a": [1, 2]},
        "threads": [n * n for n in range(8)],
        "socket": "ping",
        "true": 0,
        "fork": 7,
        "python": "42\n",
    }


def test_filter_is_kept_across_exec():
    def filtered_exec() -> object:
        program = seccomp.filter_for("default")
        assert program is not None
        seccomp.install(program)
        code = "import ctypes as t; c = t.CDLL(None, use_errno=1); print(c.unshare(0x4000000), t.get_errno())"
        return subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=False
        ).stdout

    assert in_child(filtered_exec) == f"-1 {errno.EPERM}\n"
