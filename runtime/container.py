"""Container workers: a worker spec's ``container`` run through podman, inside its slot.

The worker process the keeper launches is ``podman run`` itself, in the foreground: it joins the
slot's cgroups and network namespace like any worker, its output is the container's (podman
attaches), its exit is the container's, and SIGTERM to it is forwarded to the container
(``--sig-proxy``, podman's default). Supervision, probes, restart policy, logs and re-adoption are
therefore the command worker's, unchanged. What podman adds (docs/containers.md says why each):

- ``--cgroup-manager=cgroupfs --cgroup-parent=/<slot's cgroup>``: the container (and conmon, in
  ``<slot>/conmon``) get cgroups *below* the slot's in every hierarchy, so the slot's cpuset,
  memory, pids and device limits bound them (hierarchically, on v1 as on v2). On v2 the parent is
  ``<slot>/containers`` and podman runs in the leaf ``<slot>/worker``: a cgroup whose controllers
  reach its children holds no process there (runtime/workers.py makes both);
- ``--device nodeagent.io/slot=<slot id>``: the slot's CDI spec (device nodes, wiring env, slot
  file), written by the agent;
- ``--network=host``: the network namespace podman runs in, which is the slot's when it has one
  (the keeper's child entered it before exec), else the host's as for a command worker; probes
  reach it where they reach a command worker;
- ``--user <slot uid>:<gid> --cap-drop=all --security-opt=no-new-privileges`` with the sandbox on:
  the slot's own uid, as a command worker; ``--init`` (catatonit) as PID 1 to reap and forward
  signals;
- ``--rm --replace --name nodeagent-<slot id>``: one container per slot, a leftover of a killed run
  replaced at the next start, removed when it ends; ``--pull=never``: images are the host's
  (a missing one fails the launch at once, it is not retried).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from nodeagent.errors import CgroupError, InvalidRequest, WorkerError
from nodeagent.runtime.launch_request import LaunchRequest
from nodeagent.runtime.sandbox.paths import describe, meets_hidden
from nodeagent.runtime.sandbox.spec import SandboxSpec
from nodeagent.runtime.supervisor import Launcher, WorkerHandle
from nodeagent.schema.worker import ContainerSpec, WorkerSpec

#: Every container of the agent is named so: one per slot.
NAME_PREFIX = "nodeagent-"
#: A CDI kind of the agent's (isolation.cdi.SLOT_KIND; not imported: the runtime does not depend
#: on isolation's CDI writer, only on the name it gives).
SLOT_DEVICE_KIND = "nodeagent.io/slot"
#: podman 4.3 lowers its own RLIMIT_NPROC to 32768 when it cannot raise it (no CAP_SYS_RESOURCE,
#: measured here) and a runtime refuses to give a container more than it holds itself: the
#: default process limit of a container is the agent's, capped at this.
PODMAN_NPROC_CEILING = 32768
#: Known static inits for ``--init`` (podman's own default path first).
INIT_PATHS = ("/usr/libexec/podman/catatonit", "/usr/bin/catatonit")
#: On cgroup v2, the slot's children: the worker (podman) runs in the first, a leaf, and podman's
#: ``--cgroup-parent`` is the second (the container's ``libpod-<id>`` and ``conmon`` go below it).
WORKER_CGROUP = "worker"
CONTAINERS_CGROUP = "containers"
#: How long the checks before a launch (``podman image exists``) may take.
CHECK_TIMEOUT_SECONDS = 30.0


def container_name(slot_id: str) -> str:
    return f"{NAME_PREFIX}{slot_id}"


@dataclass(frozen=True)
class PodmanConfig:
    """How to call podman on this host (``[containers]``)."""

    #: the binary; "" finds podman on PATH when used
    podman: str = ""
    #: the OCI runtime; "" lets podman choose
    runtime: str = ""
    cgroup_manager: str = "cgroupfs"
    #: why container workers cannot run on this host ("" when they can): said at every launch
    unsupported: str = ""

    def binary(self) -> str | None:
        if self.podman:
            return self.podman if os.access(self.podman, os.X_OK) else None
        return shutil.which("podman")

    def global_args(self) -> list[str]:
        args = [f"--cgroup-manager={self.cgroup_manager}"]
        if self.runtime:
            args.append(f"--runtime={self.runtime}")
        return args


def default_runtime(hybrid_or_v1: bool) -> str:
    """runc on v1 and hybrid hosts: crun 1.8 refuses a hybrid host ("cgroups in hybrid mode not
    supported") whatever the container asks; "" (podman's choice) on pure v2."""
    return "runc" if hybrid_or_v1 else ""


def init_path() -> str | None:
    return next((p for p in INIT_PATHS if os.access(p, os.X_OK)), None)


def _default_ulimits() -> dict[str, tuple[int, int]]:
    """nofile and nproc as the agent has them (a container gets no more than its runtime holds)."""
    limits = {}
    for name, number in (("nofile", resource.RLIMIT_NOFILE), ("nproc", resource.RLIMIT_NPROC)):
        soft, hard = resource.getrlimit(number)
        if name == "nproc":
            hard = PODMAN_NPROC_CEILING if hard < 0 else min(hard, PODMAN_NPROC_CEILING)
            soft = hard if soft < 0 else min(soft, hard)
        limits[name] = (soft, hard)
    return limits


def _limit(value: int) -> str:
    return "-1" if value < 0 else str(value)


def run_argv(
    podman: str,
    config: PodmanConfig,
    spec: WorkerSpec,
    container: ContainerSpec,
    *,
    slot_id: str,
    cgroup: str | None,
    sandbox: SandboxSpec | None,
    init: str | None,
    ulimits: Mapping[str, tuple[int, int]] | None = None,
) -> tuple[str, ...]:
    """The ``podman run`` command line of a container worker (pure: every host fact is an argument).

    ``cgroup``: the slot's cgroup relative to each hierarchy's root (None: the slot has none, the
    container gets podman's default place); ``sandbox``: the
    identity and capabilities the agent chose for the slot's worker (None: the sandbox is off, the
    image's user and podman's default capabilities)."""
    argv = [podman, *config.global_args(), "run", "--rm", "--replace", f"--name={container_name(slot_id)}"]
    argv += ["--pull=never", "--log-driver=none", f"--device={SLOT_DEVICE_KIND}={slot_id}"]
    if cgroup is not None:
        argv += [f"--cgroup-parent=/{cgroup.strip('/')}", "--cgroupns=private"]
    # The network namespace podman runs in is the slot's already (the keeper's child entered it
    # before exec), and "host" keeps the container in it. Naming it (--network=ns:PATH) would work
    # too, but then podman adds its default net.* sysctls, which runc refuses in a namespace it did
    # not create ("sysctl net.ipv4.ping_group_range not allowed in host network namespace").
    argv.append("--network=host")
    if init is not None:
        argv += ["--init", f"--init-path={init}"]
    if sandbox is not None:
        argv.append(f"--user={sandbox.uid}:{sandbox.gid}")
        argv += ["--cap-drop=all", "--security-opt=no-new-privileges"]
        argv += [f"--cap-add={cap}" for cap in sorted(sandbox.capabilities)]
        if sandbox.seccomp_profile == "unconfined":
            argv.append("--security-opt=seccomp=unconfined")
        if sandbox.shm_bytes is not None:
            argv.append(f"--shm-size={sandbox.shm_bytes}")
    limits = dict(_default_ulimits() if ulimits is None else ulimits)
    limits.update(spec.rlimits)
    argv += [f"--ulimit={name}={_limit(lo)}:{_limit(hi)}" for name, (lo, hi) in sorted(limits.items())]
    argv.append(f"--umask={spec.umask:04o}")
    if container.read_only or (sandbox is not None and sandbox.read_only_root):
        argv.append("--read-only")  # a root worker's sandbox always has a read-only root
    for index, mount in enumerate(container.mounts):
        # Again at launch, where the submit's check may be stale (a link changed since): the
        # container's user must never see what the sandbox hides.
        met = None if sandbox is None else meets_hidden(mount.source, sandbox.hide_paths)
        if met is not None:
            raise InvalidRequest(describe(f"worker.container.mounts[{index}].source", mount.source, met))
        options = "ro" if mount.read_only else "rw"
        argv.append(f"--volume={mount.source}:{mount.target}:{options}")
    if spec.workdir is not None:
        argv.append(f"--workdir={spec.workdir}")
    # The slot's wiring comes with the CDI device; the spec's own env is given here (and written
    # into the CDI device where it overrides the wiring: a runtime applies CDI env last).
    argv += [f"--env={name}={value}" for name, value in sorted(spec.env.items())]
    if container.command is not None:
        argv.append(f"--entrypoint={_json_list(container.command)}")
    argv.append(container.image)
    argv += list(container.args)
    return tuple(argv)


def _json_list(items: Sequence[str]) -> str:
    return json.dumps(list(items))


def exec_argv(podman: str, config: PodmanConfig, slot_id: str, argv: Sequence[str]) -> tuple[str, ...]:
    """An exec probe inside the slot's container (as the container's user, in its namespaces)."""
    return (podman, *config.global_args(), "exec", container_name(slot_id), *argv)


def container_slots(podman: str, config: PodmanConfig) -> list[str]:
    """The slot ids of every container named like one of the agent's, in any state (one podman
    call; a leftover of any agent on this host may be among them)."""
    listed = _podman(
        podman,
        config,
        "list containers",
        "ps",
        "--all",
        "--filter",
        f"name=^{NAME_PREFIX}",
        "--format",
        "{{.Names}}",
    )
    return [name.removeprefix(NAME_PREFIX) for name in listed.split() if name.startswith(NAME_PREFIX)]


def remove_container(podman: str, config: PodmanConfig, slot_id: str) -> None:
    """Remove the slot's container whatever its state (gone already is fine); raises WorkerError
    when podman fails otherwise."""
    name = container_name(slot_id)
    _podman(podman, config, f"remove container {name}", "rm", "--force", "--ignore", "--time=0", name)


def _podman(podman: str, config: PodmanConfig, what: str, *args: str) -> str:
    """Run a short podman command; its output, or WorkerError saying ``what`` failed and why."""
    try:
        done = subprocess.run(
            [podman, *config.global_args(), *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=CHECK_TIMEOUT_SECONDS,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise WorkerError(f"{what}: {err}") from err
    if done.returncode != 0:
        raise WorkerError(f"{what}: {done.stderr.strip()}")
    return done.stdout


class ContainerLauncher:
    """Launches a container worker through the keeper, after the checks that would otherwise turn
    into a crash loop: podman present, the image in local storage. A failed check raises
    WorkerError, which the supervisor records as a failed launch (FAILED, not retried)."""

    def __init__(
        self,
        keeper: Launcher,
        podman: str | None,
        config: PodmanConfig,
        image: str,
        *,
        prepare: Callable[[], None] | None = None,
    ) -> None:
        """``prepare``: run before every launch (the slot's v2 child cgroups, made if missing)."""
        self._keeper = keeper
        self._podman = podman
        self._config = config
        self._image = image
        self._prepare = prepare

    def launch(self, req: LaunchRequest) -> WorkerHandle:
        if self._config.unsupported:
            raise WorkerError(f"container worker: {self._config.unsupported}")
        if self._podman is None:
            where = self._config.podman or "podman on PATH"
            raise WorkerError(
                f"container worker: {where} not found; install podman (apt-get install podman runc) "
                "or set [containers] podman"
            )
        try:
            done = subprocess.run(
                [self._podman, *self._config.global_args(), "image", "exists", self._image],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=CHECK_TIMEOUT_SECONDS,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as err:
            raise WorkerError(f"container worker: cannot ask podman about {self._image}: {err}") from err
        if done.returncode == 1:
            raise WorkerError(
                f"container worker: image {self._image!r} is not in this host's local storage; pull or "
                "load it first (podman pull / podman load): the agent never pulls"
            )
        if done.returncode != 0:
            raise WorkerError(f"container worker: podman image exists {self._image}: {done.stderr.strip()}")
        if self._prepare is not None:
            try:
                self._prepare()
            except CgroupError as err:
                raise WorkerError(f"container worker: cannot make the slot's child cgroups: {err}") from err
        return self._keeper.launch(req)


def container_launch_spec(spec: WorkerSpec, argv: tuple[str, ...]) -> WorkerSpec:
    """The spec the launch path carries out for a container worker: podman's argv, run as root
    (podman needs it; the container gets the worker's identity) with nothing of the worker's own
    environment, directory or limits on the podman process (they are the container's, in argv)."""
    return spec.model_copy(
        update={
            "command": argv,
            "container": None,
            "env": {},
            "workdir": None,
            "user": None,
            "group": None,
            "supplementary_groups": (),
            "rlimits": {},
        }
    )


__all__ = [
    "CONTAINERS_CGROUP",
    "INIT_PATHS",
    "NAME_PREFIX",
    "PODMAN_NPROC_CEILING",
    "WORKER_CGROUP",
    "ContainerLauncher",
    "PodmanConfig",
    "container_launch_spec",
    "container_name",
    "default_runtime",
    "exec_argv",
    "init_path",
    "remove_container",
    "run_argv",
]
