"""The exec path that enters a slot: runs in a forked child of the (single-threaded) host keeper.

The child is forked before any request exists and does, ahead of time, everything that does not
depend on the request (:func:`prepare_child`: signals, session, stdio, file descriptors, the open
files limit). When the request arrives it enters the slot, builds the worker's sandbox (or joins
the running worker's, for an exec probe) and execs (:func:`enter_slot_and_exec`).

Order matters. Cgroups are joined first, so the child is accounted and confined before anything
the request asks for happens, and long before the worker's first instruction (a child armed to
prepare the default sandbox has built its request-independent part before, in the keeper's
cgroups: sandbox.Prepared; it then reaches the request's cgroup and netns files through the
host's root, since its own view shows the cgroupfs read-only). The network namespace, rlimits and
the memory policy need privileges, so they come before uid/gid are dropped. The sandbox's
namespaces and mounts (runtime/sandbox) come after the cgroups are joined (a cgroup namespace is
rooted where the child is when it unshares) and before the identity switch (they need root); its
seal (capabilities, no_new_privs, seccomp) comes after it, last before exec, so it also covers
what the worker execs later. Any failure is written, as
``step\\0errno\\0message``, to a close-on-exec status pipe: EOF there means exec succeeded.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import resource
import signal
import time
from collections.abc import Sequence
from typing import NoReturn

from nodeagent.libc import libc
from nodeagent.runtime import sandbox
from nodeagent.runtime.launch_request import LaunchRequest, joined_procs
from nodeagent.runtime.process import ProcessIdentity, open_verified_pidfd, read_oom_kills
from nodeagent.runtime.sandbox.mounts import DEV_SHM, TMP

CLONE_NEWNET = 0x40000000
PR_SET_NO_NEW_PRIVS = 38
MPOL_BIND = 2
_SYS_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237, "ppc64le": 261, "s390x": 270}
_PROCS = "cgroup.procs"
#: Marks the part of the keeper's status stream that reports a failure.
FAILED_MARK = b"\x01"
#: A pipe's default capacity: what one write is sure to fit into without the reader's help.
_PIPE_DEFAULT = 65536

#: The process's one libc handle, loaded in the parent so the forked child does no dynamic loading.
_libc = libc

#: Signals Python or the keeper set to something other than default; exec keeps "ignored".
#: SIGPIPE is reset last, just before exec: until then a write to a keeper that died must fail
#: with EPIPE (and be reported), not kill the child silently.
_RESET_SIGNALS = (
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


def join_file(procs_file: str) -> str:
    """The file a single-threaded process writes "0" to in order to join the cgroup of ``procs_file``.

    On cgroup v1 that is the sibling ``tasks`` file. Moving just the calling thread lets the kernel
    skip the global threadgroup rwsem (cgroup_procs_write_start: neither a pid nor a threadgroup
    is named), whose write side otherwise waits for an RCU grace period whenever no migration
    happened for a few tens of ms: 7-20 ms per launch into a fresh slot on a stock kernel. For a
    single-threaded process the thread is the whole process. v2 has no ``tasks`` file (and moves
    threads only within a threaded subtree), so there it stays ``cgroup.procs``.
    """
    if procs_file.endswith("/" + _PROCS):
        tasks = procs_file[: -len(_PROCS)] + "tasks"
        if os.path.exists(tasks):
            return tasks
    return procs_file


def _host_open(path: str, flags: int, prepared: sandbox.Prepared | None) -> int:
    """Open a host path the request names: through the keeper's root when the child holds a
    prepared sandbox (whose cgroupfs is read-only and whose /proc and /dev are its own)."""
    if prepared is None:
        return os.open(path, flags)
    return os.open(prepared.host_path(path), flags, dir_fd=prepared.host_root)


def join_cgroups(procs_files: Sequence[str], prepared: sandbox.Prepared | None = None) -> None:
    """Move the calling process into each cgroup. The caller must be single-threaded."""
    for path in procs_files:
        fd = _host_open(join_file(path), os.O_WRONLY | os.O_CLOEXEC, prepared)
        try:
            # "0" means the writing task itself (cgroup v1 and v2).
            os.write(fd, b"0")
        finally:
            os.close(fd)


def enter_netns(path: str, prepared: sandbox.Prepared | None = None) -> None:
    fd = _host_open(path, os.O_RDONLY | os.O_CLOEXEC, prepared)
    try:
        _check(_libc.setns(fd, CLONE_NEWNET), path)
    finally:
        os.close(fd)


def bind_memory(nodes: tuple[int, ...]) -> None:
    machine = os.uname().machine
    number = _SYS_SET_MEMPOLICY.get(machine)
    if number is None:
        raise OSError(38, f"set_mempolicy is not wired for {machine}")
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


def close_fds_except(keep: Sequence[int]) -> None:
    """Close every descriptor from 3 up, except ``keep`` (close_range(2) between the gaps)."""
    low = 3
    for fd in sorted(set(keep)):
        if fd >= low:
            os.closerange(low, fd)
            low = fd + 1
    os.closerange(low, 1 << 20)


def prepare_child(stdout_fd: int, stderr_fd: int, keep: Sequence[int], open_files: tuple[int, int]) -> None:
    """What a worker child does before its request exists: defaults for signals, a new session,
    stdin from /dev/null, stdout/stderr into the keeper's FIFOs, the open files limit the keeper
    was started with (it raised its own to hold every worker's descriptors), and no other
    descriptor than ``keep`` (all close-on-exec). Raises OSError."""
    signal.set_wakeup_fd(-1)  # the keeper's SIGCHLD wake-up pipe is not ours
    resource.setrlimit(resource.RLIMIT_NOFILE, open_files)
    for sig in _RESET_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(stdout_fd, 1)
    os.dup2(stderr_fd, 2)
    close_fds_except(keep)


class Trace:
    """Debug stamps along the launch path: CLOCK_MONOTONIC ns (comparable across processes) and
    the calling thread's CPU time in ns (comparable between stamps of one process: what a step
    cost, whatever else the shared machine was running meanwhile).

    Off unless the keeper was started with NODEAGENT_LAUNCH_TRACE naming a file; used by
    ``bench/launch.py --profile`` to see where the time goes.
    """

    def __init__(self, fd: int | None) -> None:
        self.fd = fd

    @classmethod
    def from_environment(cls) -> Trace:
        path = os.environ.get("NODEAGENT_LAUNCH_TRACE")
        if not path:
            return cls(None)
        return cls(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600))

    def stamp(self, launch_id: str, stage: str) -> None:
        if self.fd is not None:
            line = f"{launch_id} {stage} {time.perf_counter_ns()} {time.thread_time_ns()}\n"
            os.write(self.fd, line.encode())


def _tell_keeper(keeper_fd: int, oom_kills: int, message: bytes) -> None:
    """One write, read by the keeper only after exec: the slot's OOM count, counted from inside the
    slot so no OOM kill of this worker is missed, and the request, so the keeper knows where to
    record the worker even if the agent dies right now."""
    body = b"%d\n%s" % (oom_kills, message)
    if len(body) > _PIPE_DEFAULT:
        fcntl.fcntl(keeper_fd, fcntl.F_SETPIPE_SZ, len(body))
    os.write(keeper_fd, body)


def _steps(
    req: LaunchRequest,
    message: bytes,
    keeper_fd: int,
    status_fd: int,
    *,
    trace: Trace,
    prepared: sandbox.Prepared | None,
) -> NoReturn:
    step = "join cgroups"
    try:
        # A prepared child set no_new_privs and the Landlock scope already, whatever comes next.
        sealed_ahead = prepared is not None
        if prepared is not None:
            if req.sandbox is None or req.join is not None or not sandbox.fits_prepared(req.sandbox):
                # Its bounding set is gone: it must not run what would have kept one. The agent
                # sends such requests to plain children (keeper_client.child_kind).
                step = "take a child prepared for the default sandbox"
                raise OSError(errno.EINVAL, "this request does not fit the sandbox the child prepared")
            if not prepared.catch_up():
                # The host's mounts changed in a way the prepared view cannot show: build it all
                # from scratch, as without preparation (the bounding set is dropped already).
                prepared.abandon()
                prepared = None
        join_cgroups(joined_procs(req), prepared)
        trace.stamp(req.launch_id, "child-joined")
        if req.netns is not None:
            step = f"enter netns {req.netns}"
            enter_netns(req.netns, prepared)
        if req.cpus is not None:
            step = "sched_setaffinity"
            os.sched_setaffinity(0, req.cpus)
        if req.mems is not None:
            step = "set_mempolicy"
            bind_memory(req.mems)
        step = "setrlimit"
        set_rlimits(req.rlimits)
        if req.oom_score_adj is not None:
            step = "write /proc/self/oom_score_adj"
            set_oom_score_adj(req.oom_score_adj)
        # Counted here, inside the slot, and before a sandbox changes what /sys/fs/cgroup shows.
        oom_kills = read_oom_kills(req.oom_events)
        argv, program_fd = req.argv, None
        if req.sandbox is not None:
            argv, program_fd = _enter_sandbox(req, req.sandbox, (keeper_fd, status_fd), prepared)
            trace.stamp(req.launch_id, "child-sandboxed")
        step = "set uid/gid/groups"
        drop_privileges(req.uid, req.gid, req.groups)
        if req.sandbox is not None:
            # capabilities, no_new_privs, seccomp: last before exec
            sandbox.seal_sandbox(req.sandbox, prepared=sealed_ahead)
            trace.stamp(req.launch_id, "child-sealed")
        elif req.no_new_privs:
            step = "prctl(PR_SET_NO_NEW_PRIVS)"
            _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl")
        os.umask(req.umask)
        if req.cwd is not None:
            step = f"chdir {req.cwd}"
            os.chdir(req.cwd)
        step = "hand the request to the keeper"
        _tell_keeper(keeper_fd, oom_kills, message)
        step = f"exec {argv[0]}"
        trace.stamp(req.launch_id, "child-exec")
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        if program_fd is not None:
            os.execve(program_fd, list(argv), req.env)  # noqa: S606 - the init, opened before the mounts
        os.execvpe(argv[0], list(argv), req.env)  # noqa: S606 - argv, never a shell line
    except sandbox.SandboxStepError as err:
        # Its message starts with the step already; keep the kernel's words only.
        text = (err.strerror or "").removeprefix(f"{err.step}: ")
        raise _StepFailed(err.step, OSError(err.errno, text)) from err
    except OSError as err:
        if err.errno == errno.EACCES and req.sandbox is not None and step.startswith(("exec", "chdir")):
            # The commonest surprise of a worker with its own uid: a program under root's home.
            err = OSError(
                err.errno,
                f"{err.strerror}: the worker runs as uid {req.sandbox.uid}, which must be able to read "
                "it and search every directory above it",
            )
        elif err.errno == errno.ENOENT and req.sandbox is not None and step.startswith(("exec", "chdir")):
            replaced = _replaced_by(req.sandbox, (argv[0] if step.startswith("exec") else req.cwd) or "")
            if replaced is not None:
                err = OSError(
                    err.errno,
                    f"{err.strerror}: it lies under {replaced}, which the sandbox replaces with the slot's "
                    "own; install the worker's files elsewhere (/opt, /srv, /var/tmp)",
                )
        raise _StepFailed(step, err) from err


def _replaced_by(spec: sandbox.SandboxSpec, path: str) -> str | None:
    """The directory the sandbox mounts its own tmpfs on that holds ``path`` (None: none)."""
    for where, size in ((TMP, spec.tmp_bytes), (DEV_SHM, spec.shm_bytes)):
        if size is not None and (path == where or path.startswith(where + "/")):
            return where
    return None


def _enter_sandbox(
    req: LaunchRequest,
    spec: sandbox.SandboxSpec,
    reports: tuple[int, int],
    prepared: sandbox.Prepared | None,
) -> tuple[tuple[str, ...], int | None]:
    """The sandbox's steps before the identity switch (only the request's own ones when the child
    holds a ``prepared`` sandbox that fits); returns the argv to exec (through the namespace's init
    when the worker has a pid namespace of its own, with the init opened before the mounts: the
    agent's own init may lie under a path the sandbox replaces, /tmp say)."""
    if prepared is not None:
        sandbox.enter_prepared_sandbox(spec, prepared)  # a prepared sandbox has no pid namespace
        return req.argv, None
    if req.join is None:
        init = spec.init if "pid" in spec.namespaces else None
        init_fd = os.open(init, os.O_RDONLY | os.O_CLOEXEC) if init else None
        sandbox.enter_sandbox(spec)
        return (sandbox.init_argv(init, req.argv), init_fd) if init else (req.argv, None)
    pidfd = open_verified_pidfd(ProcessIdentity(*req.join))
    if pidfd is None:
        raise sandbox.SandboxStepError(
            "join the worker's namespaces", errno.ESRCH, f"worker {req.join[0]} is no longer running"
        )
    try:
        sandbox.join_sandbox(pidfd, spec)
    finally:
        os.close(pidfd)
    if "pid" in spec.namespaces:
        _fork_into_joined_pid_namespace(reports)
    return req.argv, None


def _fork_into_joined_pid_namespace(reports: tuple[int, int]) -> None:
    """setns(CLONE_NEWPID) places only the caller's children in the worker's pid namespace: fork,
    let the child go on to exec, and stay as its parent, exiting with its status. The parent lets
    go of the status and hand-over pipes first, so the agent and the keeper hear the child's exec
    (or failure) as usual; the child is in the same process group, which the keeper ends."""
    child = os.fork()
    if child == 0:
        return
    for fd in reports:
        os.close(fd)
    _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    os._exit(code if code >= 0 else 128 - code)


def set_oom_score_adj(value: int) -> None:
    """The OOM killer's bias for this process and what it execs (-1000..1000).

    Raising it is always allowed; lowering it below what the process inherited needs
    CAP_SYS_RESOURCE, which some hosts withhold even from root (containers, restricted VMs). There
    the worker keeps the inherited value rather than fail to start: a guaranteed worker then has
    the keeper's protection, not less."""
    fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, str(value).encode())
    except PermissionError:
        pass  # lowering refused (no CAP_SYS_RESOURCE): keep the inherited value
    finally:
        os.close(fd)


def enter_slot_and_exec(
    req: LaunchRequest,
    message: bytes,
    status_fd: int,
    keeper_fd: int,
    *,
    trace: Trace | None = None,
    prepared: sandbox.Prepared | None = None,
) -> NoReturn:
    """Enter the slot described by ``req`` and exec its worker, in a child that went through
    :func:`prepare_child` (and, in ``prepared``, perhaps :func:`sandbox.prepare_sandbox`);
    ``message`` is the request as received, passed on to the keeper.
    On failure writes ``step\\0errno\\0message`` to ``status_fd`` and, after FAILED_MARK, to
    ``keeper_fd``, then _exit(127)."""
    try:
        _steps(req, message, keeper_fd, status_fd, trace=trace or Trace(None), prepared=prepared)
    except _StepFailed as failed:
        text = f"{failed.step}\0{failed.err.errno or 0}\0{failed.err.strerror or failed.err}"
        failure = text.encode("utf-8", "replace")
    except BaseException as err:  # noqa: BLE001 - a forked child must never unwind into its parent's code
        failure = f"prepare\0{0}\0{err!r}".encode("utf-8", "replace")
    report_failure(failure, status_fd, keeper_fd)
    os._exit(127)


def report_failure(message: bytes, status_fd: int, keeper_fd: int) -> None:
    for fd, body in ((status_fd, message), (keeper_fd, FAILED_MARK + message)):
        with contextlib.suppress(OSError):  # nobody left to tell; the exit status still says it failed
            os.write(fd, body)
