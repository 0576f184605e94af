"""The exec path that enters a slot: runs in a freshly forked child of the (single-threaded) keeper.

Order matters. Cgroups are joined first, so the child is accounted and confined before anything
else happens, and long before the worker's first instruction. The network namespace, rlimits and
the memory policy need privileges, so they come before uid/gid are dropped; no_new_privs comes
after setuid so it also covers what the worker execs later. Any failure is written, as
``step\\0errno\\0message``, to a close-on-exec status pipe the keeper reads: EOF there means exec
succeeded.
"""

from __future__ import annotations

import ctypes
import os
import platform
import resource
import signal
from typing import NoReturn

from nodeagent.runtime.request import LaunchRequest

CLONE_NEWNET = 0x40000000
PR_SET_NO_NEW_PRIVS = 38
MPOL_BIND = 2
_SYS_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237, "ppc64le": 261, "s390x": 270}

#: Loaded once in the parent so the forked child does no dynamic loading.
_libc = ctypes.CDLL(None, use_errno=True)

#: Signals Python or the spawner set to something other than default; exec keeps "ignored".
_RESET_SIGNALS = (
    signal.SIGPIPE,
    signal.SIGXFSZ,
    signal.SIGCHLD,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGTERM,
)


class _StepFailed(Exception):
    def __init__(self, step: str, err: OSError) -> None:
        super().__init__(step)
        self.step = step
        self.err = err


def _check(result: int, what: str) -> None:
    if result != 0:
        errno_ = ctypes.get_errno()
        raise OSError(errno_, os.strerror(errno_), what)


def join_cgroups(procs_files: tuple[str, ...]) -> None:
    for path in procs_files:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            # "0" means the writing task itself (cgroup v1 and v2).
            os.write(fd, b"0")
        finally:
            os.close(fd)


def enter_netns(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(_libc.setns(fd, CLONE_NEWNET), path)
    finally:
        os.close(fd)


def bind_memory(nodes: tuple[int, ...]) -> None:
    number = _SYS_SET_MEMPOLICY.get(platform.machine())
    if number is None:
        raise OSError(38, f"set_mempolicy is not wired for {platform.machine()}")
    words = max(nodes) // 64 + 1
    mask = (ctypes.c_ulong * words)()
    for node in nodes:
        mask[node // 64] |= 1 << (node % 64)
    # The kernel counts one bit fewer than maxnode (numactl passes bits + 1 for the same reason).
    _check(_libc.syscall(number, MPOL_BIND, mask, ctypes.c_ulong(words * 64 + 1)), "set_mempolicy")


def set_rlimits(rlimits: dict[str, tuple[int, int]]) -> None:
    for name, (soft, hard) in rlimits.items():
        number = getattr(resource, f"RLIMIT_{name.upper()}")
        resource.setrlimit(
            number,
            (resource.RLIM_INFINITY if soft == -1 else soft, resource.RLIM_INFINITY if hard == -1 else hard),
        )


def drop_privileges(uid: int | None, gid: int | None, groups: tuple[int, ...] | None) -> None:
    if groups is not None:
        os.setgroups(list(groups))
    elif uid is not None:
        os.setgroups([])  # never let a worker keep root's supplementary groups
    if gid is not None:
        os.setgid(gid)
    if uid is not None:
        os.setuid(uid)


def _wire_stdio(stdout_fd: int, stderr_fd: int) -> None:
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(stdout_fd, 1)
    os.dup2(stderr_fd, 2)


def _steps(req: LaunchRequest, stdout_fd: int, stderr_fd: int, status_fd: int) -> NoReturn:
    step = "join cgroups"
    try:
        join_cgroups(req.cgroup_procs)
        step = "reset signals"
        for sig in _RESET_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        step = "setsid"
        os.setsid()
        if req.netns is not None:
            step = f"enter netns {req.netns}"
            enter_netns(req.netns)
        if req.cpus is not None:
            step = "sched_setaffinity"
            os.sched_setaffinity(0, req.cpus)
        if req.mems is not None:
            step = "set_mempolicy"
            bind_memory(req.mems)
        step = "setrlimit"
        set_rlimits(req.rlimits)
        step = "set uid/gid/groups"
        drop_privileges(req.uid, req.gid, req.groups)
        if req.no_new_privs:
            step = "prctl(PR_SET_NO_NEW_PRIVS)"
            _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl")
        os.umask(req.umask)
        if req.cwd is not None:
            step = f"chdir {req.cwd}"
            os.chdir(req.cwd)
        step = "wire stdio"
        _wire_stdio(stdout_fd, stderr_fd)
        os.closerange(3, status_fd)
        os.closerange(status_fd + 1, 1 << 20)
        step = f"exec {req.argv[0]}"
        os.execvpe(req.argv[0], list(req.argv), req.env)  # noqa: S606 - argv, never a shell line
    except OSError as err:
        raise _StepFailed(step, err) from err


def enter_slot_and_exec(req: LaunchRequest, stdout_fd: int, stderr_fd: int, status_fd: int) -> NoReturn:
    """Enter the slot described by ``req`` and exec its worker; on failure report and _exit(127)."""
    try:
        _steps(req, stdout_fd, stderr_fd, status_fd)
    except _StepFailed as failed:
        message = f"{failed.step}\0{failed.err.errno or 0}\0{failed.err.strerror or failed.err}"
        os.write(status_fd, message.encode("utf-8", "replace"))
    except BaseException as err:  # noqa: BLE001 - a forked child must never unwind into its parent's code
        os.write(status_fd, f"prepare\0{0}\0{err!r}".encode("utf-8", "replace"))
    os._exit(127)
