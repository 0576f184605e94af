"""The worker sandbox: namespaces, a private file-system view, no capabilities, a syscall filter.

Set up in the pre-forked child, after it has joined the slot's cgroups and network namespace and
before it execs the worker, in two calls around the identity switch:

    join cgroups, netns, affinity, mempolicy, rlimits        (runtime/enter.py, as today)
    enter_sandbox(spec)                                      still root, with every capability:
        1. unshare(mount, ipc, uts, cgroup as asked)         the cgroup namespace after the
                                                             cgroups are joined: its root is the
                                                             cgroup the child is in at unshare
        2. sethostname                                       needs the new uts namespace
        3. / made private, recursively                       before any mount, so none propagates
        4. private /proc (hidepid; the pid namespace's own)
        5. /sys/fs/cgroup read-only, or namespaced           reads /proc/self/mountinfo
        6. read-only root (when asked)                       before 7-9, which must stay writable
        7. private /dev: tmpfs, mknod, devpts, /dev/shm      mknod needs CAP_MKNOD and 'm' in the
                                                             slot's device cgroup (its own nodes)
        8. private /tmp; HOME bind
        9. hidden paths                                      after HOME, which may live inside one
       9b. /tmp shown again (TMPDIR); /var/tmp through an    after 9: they lie in the view shown
           overlay; tmpfs of the worker's own (HOME,          again inside the hidden state dir
           /run/lock)
       10. bounding set dropped, ambient cleared,            PR_CAPBSET_DROP needs CAP_SETPCAP,
           keep-caps if a non-root worker keeps some          which setuid takes away
    setgroups, setgid, setuid                                (runtime/enter.py, or switch_user)
    seal_sandbox(spec)
       11. capset: effective = permitted = inheritable =      after setuid, which recomputes them
           the kept set; ambient raised for a non-root
           worker that keeps any
       12. no_new_privs, the Landlock scope (abstract       landlock.py: only the worker's own
           unix sockets), then the seccomp filter          abstract sockets; the filter would refuse steps
                                                             1-10 (unshare, mount), and nothing
                                                             after it but exec should run
    exec (through the init when there is a pid namespace: pidns.init_argv)

Most of it does not depend on the request: an idle child armed for it runs :func:`prepare_sandbox`
while it waits (steps 1, 4, 5, 7 without the slot's devices, /tmp and /dev/shm of the default
sizes, 10, and no_new_privs and the Landlock scope of 12), and the request then runs
:meth:`Prepared.catch_up` (step 3 and a check that the view is the host's as of now) and
:func:`enter_prepared_sandbox` (the rest of 2-9b, a /tmp or /dev/shm of another size replaced)
instead of :func:`enter_sandbox`; only a spec that :func:`fits_prepared` takes such a child.
See :class:`Prepared` and docs/sandbox.md for why that keeps every property.

A pid namespace is not made here: the child must already be PID 1 of one, which is what
:func:`~nodeagent.runtime.sandbox.pidns.fork_into_new_pid_namespace` gives the keeper; see pidns
for why a non-root worker needs none.

Every failure is an :class:`SandboxStepError`, an OSError naming the step and keeping the errno,
so the exec path reports it as ``step\\0errno\\0message`` like any other step.
"""

from __future__ import annotations

import errno
import functools
import os
import select
import sys
import types
from pathlib import Path

from nodeagent.errors import NodeAgentError
from nodeagent.runtime.sandbox import caps, landlock, mounts, seccomp
from nodeagent.runtime.sandbox import spec as spec_module
from nodeagent.runtime.sandbox._sys import (
    CLONE_NEWCGROUP,
    CLONE_NEWIPC,
    CLONE_NEWNS,
    CLONE_NEWPID,
    CLONE_NEWUTS,
    check,
    libc,
)
from nodeagent.runtime.sandbox.pidns import fork_into_new_pid_namespace, init_argv
from nodeagent.runtime.sandbox.spec import (
    DEFAULT_SHM_BYTES,
    DEFAULT_TMP_BYTES,
    DeviceNode,
    Exposed,
    PrivateDir,
    SandboxSpec,
)
from nodeagent.runtime.sandbox.support import SandboxSupport, missing_for, probe, probe_live

_UNSHARE_FLAGS = {"mount": CLONE_NEWNS, "ipc": CLONE_NEWIPC, "uts": CLONE_NEWUTS, "cgroup": CLONE_NEWCGROUP}
_SETNS_FLAGS = {**_UNSHARE_FLAGS, "pid": CLONE_NEWPID}
CGROUP_ROOT = "/sys/fs/cgroup"

__all__ = [
    "DeviceNode",
    "Exposed",
    "Prepared",
    "PrivateDir",
    "SandboxSpec",
    "SandboxStepError",
    "SandboxSupport",
    "enter_prepared_sandbox",
    "enter_sandbox",
    "fits_prepared",
    "fork_into_new_pid_namespace",
    "home_directory",
    "init_argv",
    "join_sandbox",
    "missing_for",
    "prepare_sandbox",
    "probe",
    "probe_live",
    "seal_sandbox",
    "switch_user",
    "warm_up",
]


class SandboxStepError(OSError):
    """A sandbox step failed; ``step`` names it, ``errno`` is the kernel's answer."""

    def __init__(self, step: str, errno_: int, message: str) -> None:
        super().__init__(errno_, f"{step}: {message}")
        self.step = step


@functools.lru_cache(maxsize=1)
def _last_capability() -> int:
    return caps.last_capability()


@functools.lru_cache(maxsize=16)
def _filter(profile: str, allow: tuple[str, ...]) -> seccomp.Installable | None:
    program = seccomp.filter_for(profile, allow)
    return None if program is None else seccomp.Installable(program)


def warm_up(specs: tuple[SandboxSpec, ...] = ()) -> None:
    """Do, in the long-lived parent (the keeper) before it forks, what every child would otherwise
    redo: read cap_last_cap, assemble the seccomp filters (for ``specs`` and the default) ready to
    install, and make capset's arguments for a worker that keeps no capability."""
    _last_capability()
    landlock.abi()
    _filter("default", ())
    caps.capset_arguments(0)
    seccomp.restricted_syscalls("default")
    for spec in specs:
        _filter(spec.seccomp_profile, tuple(sorted(spec.seccomp_allow)))


def home_directory(spec: SandboxSpec) -> str | None:
    """What HOME should say in the worker's environment."""
    return spec.home_mount or spec.home


class _Steps:
    """Runs named steps and turns any failure into a SandboxStepError naming the step."""

    def __init__(self) -> None:
        self.name = "sandbox"

    def __call__(self, name: str) -> _Steps:
        self.name = name
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, err: BaseException | None, tb: object) -> None:
        if err is None or isinstance(err, SandboxStepError):
            return
        if isinstance(err, OSError):
            raise SandboxStepError(self.name, err.errno or 0, _describe(err)) from err
        if isinstance(err, NodeAgentError):
            raise SandboxStepError(self.name, errno.EOPNOTSUPP, str(err)) from err


def _describe(err: OSError) -> str:
    text = err.strerror or str(err)
    return f"{text} ({err.filename})" if err.filename else text


def enter_sandbox(spec: SandboxSpec) -> None:
    """Steps 1-10 (see the module docstring), in a single-threaded child that is still root and
    has joined the slot's cgroups. Raises SandboxStepError."""
    step = _Steps()
    if "pid" in spec.namespaces:
        with step("pid namespace"):
            if os.getpid() != 1:
                raise OSError(
                    errno.EINVAL,
                    "the spec asks for a pid namespace but this child is not PID 1 of one "
                    "(fork it with fork_into_new_pid_namespace)",
                )
    flags = 0
    for name in spec.namespaces:
        flags |= _UNSHARE_FLAGS.get(name, 0)
    if flags:
        with step(f"unshare({', '.join(n for n in spec.namespaces if n in _UNSHARE_FLAGS)})"):
            check(libc.unshare(flags), "unshare")
    if spec.hostname is not None:
        with step("sethostname"):
            hostname = spec.hostname.encode()
            check(libc.sethostname(hostname, len(hostname)), "sethostname")
    if "mount" in spec.namespaces:
        _mounts(spec, step)
    _drop_bounding_set(spec, step)


def _drop_bounding_set(spec: SandboxSpec, step: _Steps) -> None:
    keep = caps.capability_mask(spec.capabilities)
    with step("drop capabilities from the bounding set"):
        caps.drop_bounding_set(keep, _last_capability())
        caps.clear_ambient()
        if keep and spec.uid != 0:
            caps.keep_across_setuid()


def join_sandbox(pidfd: int, spec: SandboxSpec) -> None:
    """Instead of :func:`enter_sandbox`: join the namespaces of the running worker whose pidfd is
    ``pidfd`` (made from ``spec``) with one setns(2) call (a pidfd and several flags: Linux 5.8+),
    then drop the bounding set as enter_sandbox does. What the worker's sandbox built (its private
    /tmp, /dev, /proc, hidden paths) is then this process's view too: an exec probe sees what its
    worker sees. With a pid namespace only the children of the caller are born inside it: the
    caller must fork once more (see runtime/enter.py). Raises SandboxStepError."""
    step = _Steps()
    flags = 0
    for name in spec.namespaces:
        flags |= _SETNS_FLAGS.get(name, 0)
    with step(f"join the worker's namespaces ({', '.join(spec.namespaces)})"):
        check(libc.setns(pidfd, flags), "setns")
    _drop_bounding_set(spec, step)


def _mounts(spec: SandboxSpec, step: _Steps) -> None:
    with step("open the paths to expose"):
        exposed = mounts.open_exposed([(e.path, e.writable) for e in spec.expose])
    try:
        _mount_all(spec, step, exposed)
    finally:
        mounts.close_exposed(exposed)


def _mount_all(spec: SandboxSpec, step: _Steps, exposed: dict[str, tuple[int, bool]]) -> None:
    with step("make / private"):
        mounts.make_private("/")
    if spec.hide_other_processes or "pid" in spec.namespaces:
        with step("private /proc"):
            mounts.mount_private_proc(hide_other_processes=spec.hide_other_processes)
    if spec.cgroup_view == "read-only":
        with step(f"{CGROUP_ROOT} read-only"):
            mounts.make_read_only(CGROUP_ROOT)
    elif spec.cgroup_view == "namespace":
        with step(f"{CGROUP_ROOT} from the cgroup namespace"):
            # Read here, not through nodeagent.kernelfs: this runs in the forked child, where a
            # failure must stay the OSError the step reports (step, errno, message). The text is
            # parsed by nodeagent.procfmt all the same.
            mounts.cgroup_namespace_view(CGROUP_ROOT, Path("/proc/self/mountinfo").read_text())
    if spec.read_only_root:
        with step("read-only root"):
            mounts.make_read_only("/")
    if spec.private_dev:
        with step("private /dev"):
            mounts.build_private_dev(spec.devices, shm_bytes=spec.shm_bytes)
    elif spec.shm_bytes is not None:
        with step("private /dev/shm"):
            mounts.mount_tmpfs(mounts.DEV_SHM, spec.shm_bytes)
    _mount_request_part(spec, step, exposed)


def _mount_request_part(
    spec: SandboxSpec, step: _Steps, exposed: dict[str, tuple[int, bool]], *, tmp_mounted: bool = False
) -> None:
    """Steps 8-9b: what differs from worker to worker (sizes, the slot's paths). ``tmp_mounted``:
    the private /tmp of the spec's size is in place already (prepared)."""
    if spec.tmp_bytes is not None and not tmp_mounted:
        with step("private /tmp"):
            mounts.mount_tmpfs(mounts.TMP, spec.tmp_bytes)
    if spec.home is not None and spec.home_mount is not None:
        with step(f"HOME on {spec.home_mount}"):
            mounts.mount_home(spec.home, spec.home_mount)
    if spec.hide_paths:
        with step("hide paths"):
            mounts.hide(spec.hide_paths, exposed)
    for where in spec.tmp_views:
        with step(f"private /tmp on {where}"):
            mounts.bind(mounts.TMP, where, flags=mounts.MS_NOSUID | mounts.MS_NODEV)
    if spec.tmp_bytes is not None:
        for where in spec.private_views:
            with step(f"private view of {where}"):
                mounts.private_overlay(where, spec.tmp_bytes)
    for private in spec.private_dirs:
        with step(f"private {private.path}"):
            mounts.mount_private_dir(private)


# -- prepared ahead of the request ---------------------------------------------------------------

#: What a prepared sandbox has made: the default spec's namespaces, and its mounts that no request
#: changes (the rest of the file system view depends on the request's sizes, slot and paths).
PREPARED_NAMESPACES = frozenset(("mount", "ipc", "uts"))
#: Where the prepared mounts cover the host's tree: a path shown again from there must be opened
#: before they exist, so a spec exposing one is built from scratch. (The prepared /tmp is set aside
#: instead when a path shown again lies there: :func:`_open_exposed_beside_prepared_tmp`.)
_PREPARED_COVERS = ("/proc", "/dev")
#: Sizes of the private /tmp and /dev/shm a prepared child mounts while it waits: the spec's
#: defaults, which are the agent's ([sandbox] tmp_size, shm_size). A request asking for another
#: size (or for the host's) has the prepared one replaced (unmounted).
PREPARED_TMP_BYTES = DEFAULT_TMP_BYTES
PREPARED_SHM_BYTES = DEFAULT_SHM_BYTES


def fits_prepared(spec: SandboxSpec) -> bool:
    """Whether ``spec`` is built on exactly what :func:`prepare_sandbox` makes (the agent's default
    spec is): the launch path then does only the request's own steps."""
    return (
        frozenset(spec.namespaces) == PREPARED_NAMESPACES
        and spec.hide_other_processes
        and spec.cgroup_view == "read-only"
        and not spec.read_only_root  # would make the prepared /dev read-only too
        and spec.private_dev
        and not spec.capabilities  # the bounding set is dropped whole ahead of the request
        and not any(
            e.path == top or e.path.startswith(top + "/") for e in spec.expose for top in _PREPARED_COVERS
        )
    )


class Prepared:
    """Steps 1, 4, 5, 7, 10 and the first half of 12 of the default sandbox (its namespaces, /proc,
    the read-only cgroupfs, /dev without the slot's devices, /dev/shm and /tmp of the default
    sizes, the bounding set dropped whole, no_new_privs and the Landlock scope), done by an idle
    keeper child before any request exists: they are the same for every worker that keeps no
    capability, so they need not wait for one (a request asking for other sizes of /tmp or
    /dev/shm, or for the host's, has the prepared one unmounted first). None of them takes a
    capability from the child's effective set, so the request's own steps (joining cgroups and
    the netns, mounts, setuid) still work; they do take what no worker
    of this kind gets back, so a prepared child serves only a request whose spec
    :func:`fits_prepared`. The child is used for one launch only and the namespaces are its own
    (unshared by it, never shared with another slot); the worker keeps them, as it would have
    kept the ones built after the request.

    While it waits, / is a slave of the host's mounts: what the host mounts and unmounts meanwhile
    (a slot's netns file, a volume) reaches the prepared view, and nothing goes the other way.
    :meth:`catch_up`, the request's first step, cuts that (step 3, / private, as without
    preparation) and checks the view is still the host's as of now, else the child builds its
    sandbox from scratch.

    It keeps descriptors on the keeper's namespaces, to go back when the request turns out not to
    want this sandbox (:meth:`abandon`); on the host's root, through which the request's cgroup and
    network namespace are reached (the prepared view shows the cgroupfs read-only and a /proc and
    /dev of its own); on the host's /dev (a slot device the device cgroup refuses to mknod is bound
    from there); and on the host's and its own mount tables, whose changes poll(2) reports. All are
    close-on-exec and closed before exec (:meth:`close`); the worker never holds one."""

    __slots__ = (
        "cwd",
        "host_dev",
        "host_ipc",
        "host_mnt",
        "host_mounts",
        "host_root",
        "host_uts",
        "mount_tables",
        "own_mounts",
        "tops",
    )

    def __init__(self) -> None:
        self.host_mnt = self.host_ipc = self.host_uts = self.host_root = self.cwd = -1
        self.host_dev = self.host_mounts = self.own_mounts = -1
        #: st_dev of the prepared /proc, /dev, /dev/pts, /dev/shm and /tmp: still on top at the request?
        self.tops: tuple[int, ...] = ()
        #: poll(2) on both mount tables, registered while waiting (a change shows as POLLPRI).
        self.mount_tables: select.poll | None = None

    @property
    def tmp_device(self) -> int:
        """st_dev of the prepared /tmp (the last of the prepared tops)."""
        return self.tops[-1]

    def host_path(self, path: str) -> str:
        """``path`` relative to ``host_root`` (for ``dir_fd``): the host's file, not this view's."""
        return path.lstrip("/") or "."

    def catch_up(self) -> bool:
        """Make / private (nothing the host mounts from now on reaches the worker, as without
        preparation) and check that the view is the host's mounts as of now plus the prepared
        ones on top; re-apply the read-only cgroupfs to what arrived meanwhile. False: the view
        is not (a host mount that does not propagate changed, or one landed on a prepared mount
        point), and the caller abandons it. Raises SandboxStepError."""
        step = _Steps()
        with step("make / private"):
            mounts.make_private("/")
        assert self.mount_tables is not None
        if not self.mount_tables.poll(0):
            return True  # neither mount table changed since the preparation
        with step("compare the prepared view with the host's"):
            host = [m.mount_point for m in mounts.parse_mountinfo(_read_from_start(self.host_mounts))]
            own = [m.mount_point for m in mounts.parse_mountinfo(_read_from_start(self.own_mounts))]
            if sorted(own) != sorted([*host, *_PREPARED_TOPS]) or _top_devices() != self.tops:
                return False
        with step(f"{CGROUP_ROOT} read-only"):
            mounts.make_read_only(CGROUP_ROOT)
        return True

    def abandon(self) -> None:
        """Back to the keeper's mount, ipc and uts namespaces and working directory (the prepared
        ones are freed with their last process, this one); then close everything."""
        with _Steps()("leave the prepared sandbox"):
            for fd, flag in (
                (self.host_mnt, CLONE_NEWNS),
                (self.host_ipc, CLONE_NEWIPC),
                (self.host_uts, CLONE_NEWUTS),
            ):
                check(libc.setns(fd, flag), "setns")
            os.fchdir(self.cwd)  # setns(CLONE_NEWNS) moved it to the namespace's root
        self.close()

    def close(self) -> None:
        self.mount_tables = None
        for name in self.__slots__:
            fd = getattr(self, name)
            if isinstance(fd, int) and fd >= 0:
                os.close(fd)
                setattr(self, name, -1)


#: The mounts the preparation adds on top of the host's (mount points, as mountinfo lists them);
#: /tmp last (Prepared.tmp_device).
_PREPARED_TOPS = ("/proc", "/dev", "/dev/pts", mounts.DEV_SHM, mounts.TMP)


def _top_devices() -> tuple[int, ...]:
    return tuple(os.stat(path).st_dev for path in _PREPARED_TOPS)


def _read_from_start(fd: int) -> str:
    data = b""
    offset = 0
    while chunk := os.pread(fd, 65536, offset):
        data += chunk
        offset += len(chunk)
    return data.decode()


def prepare_sandbox() -> Prepared | None:
    """Build the request-independent part of the default sandbox in this (idle, forked,
    single-threaded, root) child; None where it cannot (not root, an older kernel: the request's
    own steps then fail or succeed as they would have, and report which)."""
    prepared = Prepared()
    try:
        prepared.host_mnt = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        prepared.host_ipc = os.open("/proc/self/ns/ipc", os.O_RDONLY | os.O_CLOEXEC)
        prepared.host_uts = os.open("/proc/self/ns/uts", os.O_RDONLY | os.O_CLOEXEC)
        prepared.host_root = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        prepared.cwd = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        # Bound to the host's namespace at open: poll(2) says when its mount table changes.
        prepared.host_mounts = os.open("/proc/self/mountinfo", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        prepared.close()
        return None
    if libc.unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS) != 0:
        prepared.close()
        return None
    try:
        mounts.make_slave("/")
        mounts.mount_private_proc(hide_other_processes=True)
        mounts.make_read_only(CGROUP_ROOT)
        prepared.host_dev = os.open("/dev", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        mounts.build_base_dev(prepared.host_dev)
        # Empty until the worker writes: their pages are charged to the slot it will be in by then.
        mounts.mount_tmpfs(mounts.DEV_SHM, PREPARED_SHM_BYTES)
        mounts.mount_tmpfs(mounts.TMP, PREPARED_TMP_BYTES)
        prepared.tops = _top_devices()
        prepared.own_mounts = os.open("/proc/self/mountinfo", os.O_RDONLY | os.O_CLOEXEC)
        prepared.mount_tables = select.poll()
        for fd in (prepared.host_mounts, prepared.own_mounts):
            prepared.mount_tables.register(fd, select.POLLPRI)
    except (OSError, NodeAgentError):
        _abandon_or_exit(prepared)
        return None
    # Last: these cannot be undone, so nothing may fail after them. The first drop fails (without
    # CAP_SETPCAP) before any capability is gone, and the child then serves any request unprepared.
    try:
        caps.drop_bounding_set(0, _last_capability())
    except OSError:
        _abandon_or_exit(prepared)
        return None
    try:
        caps.clear_ambient()
        check(libc.prctl(seccomp.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        landlock.scope_abstract_unix_sockets()
    except OSError:
        os._exit(127)  # half-sealed, it can serve no request; the launch that takes it says so
    _fault_in_the_request_steps()
    return prepared


def _fault_in_the_request_steps() -> None:
    """Touch the functions and classes the request's sandbox steps run (their code and the
    constants it loads), so the copy-on-write faults on the keeper's pages that hold them happen
    now rather than between request and exec: a Python call writes the reference counts of what
    it touches. The pages are this child's from now on and freed at its exec, as they would have
    been; only the sandbox's own modules, whose code only a sandboxed launch runs."""
    for module in (sys.modules[__name__], mounts, caps, seccomp, landlock, spec_module):
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__module__ == module.__name__:
                for member in list(vars(value).values()):
                    _touch_code(getattr(member, "__code__", None))
            else:
                _touch_code(getattr(value, "__code__", None))


def _touch_code(code: object) -> None:
    if isinstance(code, types.CodeType):
        for const in code.co_consts:  # nested code too (comprehensions, lambdas), not docstrings
            if isinstance(const, types.CodeType):
                _touch_code(const)


def _abandon_or_exit(prepared: Prepared) -> None:
    try:
        prepared.abandon()
    except SandboxStepError:
        os._exit(127)  # stuck half-way in a namespace of its own: never serve a request


def enter_prepared_sandbox(spec: SandboxSpec, prepared: Prepared) -> None:
    """:func:`enter_sandbox` for a child holding ``prepared`` (which must fit ``spec``, and has
    caught up): only the request's own steps (hostname, the slot's devices, /dev/shm and /tmp
    when the spec's sizes are not the prepared ones, HOME, the hidden and exposed paths, private
    views and directories). Closes ``prepared``; :func:`seal_sandbox` follows with
    ``prepared=True``. Raises SandboxStepError."""
    step = _Steps()
    if spec.hostname is not None:
        with step("sethostname"):
            hostname = spec.hostname.encode()
            check(libc.sethostname(hostname, len(hostname)), "sethostname")
    with step("open the paths to expose"):
        exposed, tmp_prepared = _open_exposed_beside_prepared_tmp(spec, prepared.tmp_device)
    try:
        if spec.devices:
            with step("private /dev"):
                mounts.add_devices(spec.devices, prepared.host_dev)
        if spec.shm_bytes != PREPARED_SHM_BYTES:
            with step("private /dev/shm"):
                mounts.umount(mounts.DEV_SHM, mounts.MNT_DETACH)  # the private /dev's empty directory
                if spec.shm_bytes is not None:
                    mounts.mount_tmpfs(mounts.DEV_SHM, spec.shm_bytes)
        tmp_mounted = tmp_prepared and spec.tmp_bytes == PREPARED_TMP_BYTES
        if tmp_prepared and not tmp_mounted:
            with step("private /tmp"):
                mounts.umount(mounts.TMP, mounts.MNT_DETACH)  # the host's, or one of the spec's size next
        _mount_request_part(spec, step, exposed, tmp_mounted=tmp_mounted)
    finally:
        mounts.close_exposed(exposed)
        prepared.close()


def _open_exposed_beside_prepared_tmp(
    spec: SandboxSpec, tmp_device: int
) -> tuple[dict[str, tuple[int, bool]], bool]:
    """The paths to show again, opened on the host's file system as :func:`enter_sandbox` opens
    them (before its /tmp exists), and whether the prepared /tmp is still mounted. A path that
    lies in /tmp (by its name or through a link) finds nothing in the prepared, empty one, or
    finds that one: the prepared /tmp is then unmounted and they are opened again, and the
    caller mounts the spec's /tmp after them, as without preparation."""
    wanted = [(e.path, e.writable) for e in spec.expose]
    if not wanted:
        return {}, True
    try:
        exposed = mounts.open_exposed(wanted)
    except OSError:
        exposed = None
    if exposed is not None and all(os.fstat(fd).st_dev != tmp_device for fd, _ in exposed.values()):
        return exposed, True
    if exposed is not None:
        mounts.close_exposed(exposed)
    mounts.umount(mounts.TMP, mounts.MNT_DETACH)
    return mounts.open_exposed(wanted), False


def switch_user(spec: SandboxSpec) -> None:
    """setgroups, setgid, setuid to the spec's identity (what runtime/enter.py's drop_privileges
    does with the request's ids; here for callers that carry only a spec)."""
    with _Steps()("set uid/gid/groups"):
        os.setgroups(list(spec.groups))
        os.setgid(spec.gid)
        os.setuid(spec.uid)


def seal_sandbox(spec: SandboxSpec, *, prepared: bool = False) -> None:
    """Steps 11-12, after setuid and just before exec (``prepared``: the child set no_new_privs
    and the Landlock scope while it waited, see :class:`Prepared`). Raises SandboxStepError."""
    step = _Steps()
    keep = caps.capability_mask(spec.capabilities)
    with step("set capabilities"):
        caps.set_capabilities(keep, ambient=bool(keep) and spec.uid != 0)
    if not prepared:
        with step("landlock scope (abstract unix sockets)"):
            # Landlock needs no_new_privs from a process without CAP_SYS_ADMIN; the seccomp filter
            # after it would set it anyway, and may not allow the Landlock calls.
            check(libc.prctl(seccomp.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
            landlock.scope_abstract_unix_sockets()
    with step(f"seccomp filter {spec.seccomp_profile!r}"):
        allow = tuple(sorted(spec.seccomp_allow)) if spec.seccomp_allow else ()
        program = _filter(spec.seccomp_profile, allow)
        if program is None:
            check(libc.prctl(seccomp.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        else:
            program.install()
