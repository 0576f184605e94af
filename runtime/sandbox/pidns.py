"""Keeping a worker from seeing, signalling or tracing processes outside its slot.

Two ways, both built here; the sandbox picks by the worker's identity.

(b) The default, for a worker with its own non-root uid: no pid namespace. The worker gets a
    private /proc mounted with hidepid=invisible (mounts.mount_private_proc), so the /proc/PID
    directories of other users' processes do not exist for it; the kernel lets it signal only
    processes of its own uid (and it has no CAP_KILL), and ptrace, process_vm_* and pidfd_getfd are
    denied by seccomp on top of the same uid check. With one uid per slot, that is exactly the
    slot's own processes. It costs one proc mount inside the mount namespace the sandbox makes
    anyway, and no process per worker. What it does not hide: pid numbers stay the host's (kill(pid,
    0) still tells "exists" (EPERM) from "does not" (ESRCH)), and the host-wide counters in
    /proc/loadavg and /proc/stat.

(a) For a root worker (uid 0), which may signal every root process on the host, capabilities or
    not, and which hidepid does not hide root's processes from: a pid namespace. The child that
    will become the worker is forked straight into a new pid namespace by
    :func:`fork_into_new_pid_namespace` (the keeper calls it instead of os.fork), so it is PID 1
    there and no extra process stands between the keeper and it. PID 1 must not be the worker:
    the kernel drops signals to a namespace's init that it has no handler for, so a plain Python
    server would ignore SIGTERM, and orphans would never be reaped. So the child execs a small
    init, dumb-init (a ~20 KB C program from PyPI, a dependency of this package), which starts the
    worker as PID 2, forwards signals to it, reaps, and exits with its status; when it exits the
    kernel kills whatever is left in the namespace. That is one extra process per root worker
    (measured in docs/benchmarks.md), which is why it is not the default.

Figures (bench/sandbox.py, this project's 2-vCPU VM): a private /proc with hidepid costs about as
much as one tmpfs mount; a pid namespace costs the unshare (~0.1 ms) plus the init's exec.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from nodeagent.runtime.sandbox._sys import CLONE_NEWPID, check, libc


def fork_into_new_pid_namespace() -> int:
    """Like os.fork(), but the child is PID 1 of a new pid namespace (os.getpid() == 1 there).
    Returns the child's pid (as the caller's namespace numbers it) in the parent, 0 in the child.

    unshare(CLONE_NEWPID) only changes the namespace the caller's *next* children are born in, and
    a second unshare fails until that is undone, so the parent goes back to its own namespace with
    setns(2) right after the fork. Needs CAP_SYS_ADMIN."""
    own = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    pid = -1
    try:
        check(libc.unshare(CLONE_NEWPID), "unshare(CLONE_NEWPID)")
        try:
            pid = os.fork()
        finally:
            if pid != 0:
                check(libc.setns(own, CLONE_NEWPID), "setns back to the caller's pid namespace")
        return pid
    finally:
        os.close(own)


def init_argv(init: str, argv: Sequence[str]) -> tuple[str, ...]:
    """What PID 1 of a worker's pid namespace execs: the init, which runs ``argv`` as PID 2 in a
    session of its own and forwards every signal to that session's process group."""
    return (init, "--", *argv)
