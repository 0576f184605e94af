"""What the worker sandbox costs on the launch path, step by step, next to a plain fork + exec.

Side by side in one run, interleaved launch by launch so the machine's noise hits every contender
alike (run as root):

  fork+exec          os.fork(); the child execs /bin/true; the parent waits: the floor
  sandbox+exec       the same child runs enter_sandbox, switches to uid 65534, seal_sandbox, then
                     execs /bin/true: the default confined worker (mount, ipc and uts namespaces,
                     hidepid /proc, read-only /sys/fs/cgroup, private /dev, /dev/shm and /tmp, a
                     hidden directory, no capabilities, the seccomp filter)
  sandbox+cgroupns   the same with a cgroup namespace and fresh read-only cgroupfs mounts
  root+pidns+init    an opted-in root worker: forked into a new pid namespace, the sandbox with a
                     read-only root and the root capability set, exec of dumb-init, which runs
                     /bin/true as PID 2
  crun-run           ``crun run`` of /bin/true with mount, pid, ipc, uts and cgroup namespaces and
                     no capabilities (no seccomp profile: crun has none unless the config lists one),
                     timed until crun returns; from a helper in a private mount namespace with
                     /sys/fs/cgroup/unified unmounted there, because crun refuses hybrid hosts whose
                     cgroup2 mount carries a controller (the host is not changed)

Each contender is timed from fork to the parent's waitpid returning, so the namespace teardown at
exit is included. Then, in separate forked children, each step of the sandbox alone (median / p99
µs, steps timed with perf_counter_ns inside the child), and the memory of one dumb-init.

    python bench/sandbox.py [--runs 200] [--no-crun]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from crun_driver import Crun, serve

from nodeagent.runtime.sandbox import (
    SandboxSpec,
    caps,
    enter_sandbox,
    fork_into_new_pid_namespace,
    init_argv,
    landlock,
    mounts,
    seal_sandbox,
    seccomp,
    switch_user,
    warm_up,
)
from nodeagent.runtime.sandbox._sys import (
    CLONE_NEWCGROUP,
    CLONE_NEWIPC,
    CLONE_NEWNS,
    CLONE_NEWUTS,
    check,
    libc,
)

WORKER = "/bin/true"
NOBODY = 65534
INIT = os.path.join(os.path.dirname(sys.executable), "dumb-init")
HIDDEN = "/var/lib/nodeagent"

CONFINED = SandboxSpec(uid=NOBODY, gid=NOBODY, hide_paths=(HIDDEN,))
CGROUPNS = SandboxSpec(
    uid=NOBODY,
    gid=NOBODY,
    hide_paths=(HIDDEN,),
    namespaces=("mount", "ipc", "uts", "cgroup"),
    cgroup_view="namespace",
)
ROOT = SandboxSpec(
    uid=0,
    gid=0,
    capabilities=caps.ROOT_CAPABILITIES,
    namespaces=("mount", "pid", "ipc", "uts"),
    read_only_root=True,
    hide_paths=(HIDDEN,),
    init=INIT,
)


def percentile(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def _wait(pid: int) -> None:
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"child {pid} failed with status {status:#x}")


#: (µs until exec succeeded, µs from then until waitpid returned) of each launch.
Timing = tuple[float, float]


def _launch(fork: Callable[[], int], setup: Callable[[], list[str]]) -> Timing:
    """Fork, run ``setup`` in the child and exec what it returns. The launch is over when exec
    succeeded, seen as EOF on a close-on-exec pipe (as the spawner sees it); the rest, until
    waitpid, is the worker's run, its exit and the teardown of its namespaces."""
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    started = time.perf_counter()
    pid = fork()
    if pid == 0:
        try:
            os.close(read_end)
            argv = setup()
            os.execv(argv[0], argv)
        finally:
            os._exit(127)
    os.close(write_end)
    os.read(read_end, 1)
    execed = time.perf_counter()
    os.close(read_end)
    _wait(pid)
    return (execed - started) * 1e6, (time.perf_counter() - execed) * 1e6


def plain() -> Timing:
    return _launch(os.fork, lambda: [WORKER])


def sandboxed(spec: SandboxSpec) -> Callable[[], Timing]:
    def setup() -> list[str]:
        enter_sandbox(spec)
        switch_user(spec)
        seal_sandbox(spec)
        return [WORKER] if spec.init is None else list(init_argv(spec.init, [WORKER]))

    fork = fork_into_new_pid_namespace if "pid" in spec.namespaces else os.fork
    return lambda: _launch(fork, setup)


# --- crun ------------------------------------------------------------------------------------------


def crun_bundle(where: Path) -> Path:
    rootfs = where / "rootfs"
    for name in ("usr", "proc", "dev", "tmp"):
        (rootfs / name).mkdir(parents=True)
    for name in ("bin", "lib", "lib64", "sbin"):
        host = Path("/") / name
        if host.is_symlink():
            (rootfs / name).symlink_to(os.readlink(host))
    config = {
        "ociVersion": "1.0.2",
        "process": {
            "args": [WORKER],
            "env": ["PATH=/usr/bin:/bin"],
            "cwd": "/",
            "user": {"uid": NOBODY, "gid": NOBODY},
            "capabilities": {
                "bounding": [],
                "effective": [],
                "permitted": [],
                "inheritable": [],
                "ambient": [],
            },
            "noNewPrivileges": True,
        },
        "root": {"path": "rootfs", "readonly": True},
        "mounts": [
            {"destination": "/usr", "type": "bind", "source": "/usr", "options": ["rbind", "ro"]},
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {
                "destination": "/tmp",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": ["nosuid", "nodev", "size=256m"],
            },
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "mode=755"]},
        ],
        "linux": {"namespaces": [{"type": t} for t in ("mount", "pid", "ipc", "uts", "cgroup")]},
    }
    (where / "config.json").write_text(json.dumps(config))
    return where



# --- steps -----------------------------------------------------------------------------------------


def _steps_in_child(cgroup_namespace: bool) -> dict[str, float]:
    """Each step of enter_sandbox + seal_sandbox on its own, in µs, in this (forked) child."""
    times: dict[str, float] = {}

    def timed(name: str, action: Callable[[], object]) -> None:
        started = time.perf_counter_ns()
        action()
        times[name] = (time.perf_counter_ns() - started) / 1000

    flags = CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS | (CLONE_NEWCGROUP if cgroup_namespace else 0)
    timed("unshare", lambda: check(libc.unshare(flags), "unshare"))
    timed("make / private", lambda: mounts.make_private("/"))
    timed("/proc hidepid", lambda: mounts.mount_private_proc(hide_other_processes=True))
    if cgroup_namespace:
        info = Path("/proc/self/mountinfo").read_text()
        timed("cgroupfs from the namespace", lambda: mounts.cgroup_namespace_view("/sys/fs/cgroup", info))
    else:
        timed("cgroupfs read-only", lambda: mounts.make_read_only("/sys/fs/cgroup"))
    timed("/dev + /dev/shm", lambda: mounts.build_private_dev((), shm_bytes=64 << 20))
    timed("/tmp", lambda: mounts.mount_tmpfs(mounts.TMP, 256 << 20))
    timed("hide a directory", lambda: mounts.hide([HIDDEN]))
    last = caps.last_capability()
    timed("bounding set + ambient", lambda: (caps.drop_bounding_set(0, last), caps.clear_ambient()))
    timed("setuid", lambda: switch_user(CONFINED))
    timed("capset", lambda: caps.set_capabilities(0, ambient=False))
    timed("no_new_privs", lambda: check(libc.prctl(seccomp.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl"))
    timed("landlock scope", landlock.scope_abstract_unix_sockets)
    program = seccomp.filter_for("default")
    assert program is not None
    timed("seccomp install", lambda: seccomp.install(program))
    return times


def measure_steps(runs: int, cgroup_namespace: bool) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(runs):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(read_end)
                os.write(write_end, json.dumps(_steps_in_child(cgroup_namespace)).encode())
            finally:
                os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as reader:
            body = reader.read()
        os.waitpid(pid, 0)
        for name, value in json.loads(body).items():
            samples[name].append(value)
    return samples


def init_memory() -> dict[str, int]:
    """RSS and PSS (kB) of a dumb-init holding a sleeping root worker."""
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    pid = fork_into_new_pid_namespace()
    if pid == 0:
        try:
            os.close(read_end)
            enter_sandbox(ROOT)
            switch_user(ROOT)
            seal_sandbox(ROOT)
            argv = list(init_argv(INIT, ["/bin/sleep", "2"]))
            os.execv(argv[0], argv)
        finally:
            os._exit(127)
    os.close(write_end)
    os.read(read_end, 1)
    os.close(read_end)
    time.sleep(0.5)
    rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    _wait(pid)
    fields = {line.split()[0].rstrip(":"): int(line.split()[1]) for line in rollup.splitlines()[1:]}
    return {"rss_kb": fields["Rss"], "pss_kb": fields["Pss"]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--no-crun", action="store_true")
    parser.add_argument("--crun-server", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.crun_server:
        serve(crun_bundle)
        return
    if os.geteuid() != 0:
        sys.exit("bench/sandbox.py needs root (namespaces, mounts, setuid)")
    warm_up((CONFINED, CGROUPNS, ROOT))
    contenders: dict[str, Callable[[], Timing]] = {
        "fork+exec": plain,
        "sandbox+exec": sandboxed(CONFINED),
        "sandbox+cgroupns": sandboxed(CGROUPNS),
        "root+pidns+init": sandboxed(ROOT),
    }
    crun = None if args.no_crun or not shutil.which("crun") or not shutil.which("unshare") else Crun(__file__)
    launch_us: dict[str, list[float]] = collections.defaultdict(list)
    after_us: dict[str, list[float]] = collections.defaultdict(list)
    try:
        for index in range(args.runs + 5):
            for name, launch in contenders.items():
                until_exec, after_exec = launch()
                if index >= 5:  # the first few warm caches
                    launch_us[name].append(until_exec)
                    after_us[name].append(after_exec)
            if crun is not None:
                elapsed = crun.run()
                if index >= 5:
                    launch_us["crun-run"].append(elapsed * 1000)
    finally:
        if crun is not None:
            crun.close()
    floor = statistics.median(launch_us["fork+exec"])
    sandbox = statistics.median(launch_us["sandbox+exec"])
    print(f"launch of {WORKER}, {args.runs} runs each, interleaved: µs from fork to exec done")
    print("(crun-run: until crun returned, which includes the run and the teardown)")
    header = (
        f"{'contender':<20}{'median':>9}{'p99':>9}{'× fork+exec':>13}{'× sandbox':>11}{'exit+teardown':>15}"
    )
    print(header)
    for name, samples in launch_us.items():
        median = statistics.median(samples)
        after = f"{statistics.median(after_us[name]):>15.0f}" if name in after_us else f"{'-':>15}"
        p99 = percentile(samples, 0.99)
        row = f"{name:<20}{median:>9.0f}{p99:>9.0f}{median / floor:>13.2f}{median / sandbox:>11.2f}"
        print(row + after)
    for cgroup_namespace in (False, True):
        steps = measure_steps(args.runs, cgroup_namespace)
        title = "with a cgroup namespace" if cgroup_namespace else "default spec"
        print(f"\nsteps, each in its own forked child, {title} (µs)")
        print(f"{'step':<30}{'median':>10}{'p99':>10}")
        total = 0.0
        for name, samples in steps.items():
            total += statistics.median(samples)
            print(f"{name:<30}{statistics.median(samples):>10.0f}{percentile(samples, 0.99):>10.0f}")
        print(f"{'sum of medians':<30}{total:>10.0f}")
    memory = init_memory()
    print(f"\ndumb-init holding a root worker: RSS {memory['rss_kb']} kB, PSS {memory['pss_kb']} kB")


if __name__ == "__main__":
    main()
