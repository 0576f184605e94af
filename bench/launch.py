"""Time from a launch request to the worker's exec inside an isolated cgroup v1 slot.

Side by side in one run, interleaved launch by launch so the shared machine's noise hits every
contender alike (run as root on a cgroup v1 or hybrid host):

  nodeagent        KeeperClient.launch(): the agent writes the request to a child the host keeper
                   forked ahead of time, which joins the slot (cpuset, memory, pids) and execs;
                   timed until the agent holds the running worker (exec succeeded). Path: Python
                   child (no C shim exists). The keeper runs from a throwaway state directory.
  nodeagent-sandbox  the same with the full default sandbox, as every worker gets it: mount, ipc
                   and uts namespaces, private /proc (hidepid), /tmp, /dev/shm and /dev, read-only
                   /sys/fs/cgroup, the state directory hidden, its own uid (nobody here), no
                   capabilities, no_new_privs and the default seccomp filter; from the children the
                   client keeps for it, which built the request-independent part of that sandbox
                   while they waited (runtime/sandbox: Prepared)
  popen-preexec    subprocess.Popen(preexec_fn=join the slot via cgroup.procs): the by-hand
                   fork/join/exec baseline (preexec_fn forces fork instead of vfork)
  popen-plain      subprocess.Popen with no cgroup at all: the floor
  crun-run         ``crun run`` of the same command with cpuset, memory and pids limits, until crun
                   returns (it creates and removes its cgroups itself, and waits for /bin/true)

Two regimes: "fresh" waits --gap-ms after creating the slot, as when a worker starts in a newly
allocated slot on a host where no cgroup migration happened for a while (a cgroup.procs write
then waits for an RCU grace period: the cold-join penalty); "back-to-back" does not wait. The
worker is /bin/true; the slot exists before the clock starts.

crun (``apt-get install -y crun``) refuses a hybrid host whose cgroup2 mount carries a
controller, so it runs from a helper in a private mount namespace (``unshare -m``) with
/sys/fs/cgroup/unified unmounted there only; the host is not changed. Its bundle is an empty
rootfs (empty /dev, /proc) with /usr bind-mounted read-only and the host's /bin, /lib, /lib64
symlinks, a mount
namespace only, and the same limits as the slot.

    python bench/launch.py [--runs 200] [--gap-ms 50] [--profile]

``--profile`` prints, per stage of nodeagent's path, the median wall time and, for a stage within
one process, its CPU time (the launching child's, from its request to its exec, is the measure a
loaded machine moves least).

To compare with another checkout in the same conditions, run its bench.launch right before or
after this one (``PYTHONPATH`` pointing at a tree of that checkout's packages).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from crun_driver import Crun, serve

from nodeagent.runtime.enter import join_file
from nodeagent.runtime.keeper_client import KeeperClient, stop_keeper
from nodeagent.runtime.launch_request import LaunchRequest
from nodeagent.runtime.sandbox import SandboxSpec

ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("cpuset", "memory", "pids")
MEMORY_LIMIT = 256 << 20
PIDS_LIMIT = 64
WORKER = "/bin/true"
NOBODY = 65534


def make_slot(name: str) -> list[Path]:
    dirs = [ROOT / ctrl / name for ctrl in CONTROLLERS]
    for path in dirs:
        path.mkdir()
    (dirs[0] / "cpuset.cpus").write_text((ROOT / "cpuset" / "cpuset.cpus").read_text())
    (dirs[0] / "cpuset.mems").write_text((ROOT / "cpuset" / "cpuset.mems").read_text())
    (dirs[1] / "memory.limit_in_bytes").write_text(str(MEMORY_LIMIT))
    (dirs[2] / "pids.max").write_text(str(PIDS_LIMIT))
    return dirs


def remove_slot(dirs: list[Path]) -> None:
    for path in dirs:
        for _ in range(200):
            try:
                path.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.005)


def percentile(ordered: list[float], fraction: float) -> float:
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))]


# --- crun, from a helper in a private mount namespace ---------------------------------------------


def crun_bundle(where: Path) -> Path:
    rootfs = where / "rootfs"
    for name in ("usr", "proc", "dev", "tmp"):
        (rootfs / name).mkdir(parents=True)
    for name in ("bin", "lib", "lib64", "sbin"):
        host = Path("/") / name
        if host.is_symlink():
            (rootfs / name).symlink_to(os.readlink(host))
    cpuset = ROOT / "cpuset"
    config = {
        "ociVersion": "1.0.2",
        "process": {
            "args": [WORKER],
            "env": ["PATH=/usr/bin:/bin"],
            "cwd": "/",
            "user": {"uid": NOBODY, "gid": NOBODY},
            "capabilities": {k: [] for k in ("bounding", "effective", "permitted", "inheritable", "ambient")},
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
        "linux": {
            "namespaces": [{"type": t} for t in ("mount", "pid", "ipc", "uts")],
            "resources": {
                "cpu": {
                    "cpus": (cpuset / "cpuset.cpus").read_text().strip(),
                    "mems": (cpuset / "cpuset.mems").read_text().strip(),
                },
                "memory": {"limit": MEMORY_LIMIT},
                "pids": {"limit": PIDS_LIMIT},
            },
        },
    }
    (where / "config.json").write_text(json.dumps(config))
    return where


# --- the contenders ---------------------------------------------------------------------------------


Launch = Callable[[list[str]], "subprocess.Popen[bytes] | None"]


def nodeagent_launcher(
    keeper: KeeperClient, work: Path, tag: str = "bench", sandbox: SandboxSpec | None = None
) -> Launch:
    def launch(procs: list[str]) -> None:
        worker = keeper.launch(
            LaunchRequest(
                launch_id=f"{tag}-{time.monotonic_ns()}",
                argv=(WORKER,),
                env={"PATH": "/usr/bin:/bin"},
                run_dir=str(work / "run"),
                log_dir=str(work / "logs"),
                cgroup_procs=tuple(procs),
                uid=None if sandbox is None else sandbox.uid,
                gid=None if sandbox is None else sandbox.gid,
                groups=None if sandbox is None else sandbox.groups,
                sandbox=sandbox,
            )
        )
        worker.close()  # the keeper reaps and records it; the bench needs nothing more

    return launch


@contextlib.contextmanager
def keeper_in(work: Path) -> Iterator[KeeperClient]:
    """A keeper of its own for the bench, stopped afterwards (its workers, /bin/true, are gone)."""
    client = KeeperClient(work / "keeper")
    try:
        client.connect()
        yield client
    finally:
        client.close()
        stop_keeper(work / "keeper")


def popen_preexec(procs: list[str]) -> subprocess.Popen[bytes]:
    def join() -> None:
        for path in procs:
            with open(path, "w") as handle:
                handle.write("0")

    return subprocess.Popen([WORKER], preexec_fn=join)  # noqa: PLW1509 - the baseline on purpose


def popen_plain(procs: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([WORKER])


def time_once(launch: Launch, name: str, gap: float) -> float:
    dirs = make_slot(name)
    try:
        procs = [str(path / "cgroup.procs") for path in dirs]
        time.sleep(gap)
        started = time.perf_counter()
        child = launch(procs)
        elapsed = (time.perf_counter() - started) * 1000
        if child is not None:
            child.wait()  # Popen returns once exec succeeded; reaping is not part of the launch
        time.sleep(0.005)  # let /bin/true finish so the slot can be removed
    finally:
        remove_slot(dirs)
    return elapsed


def measure(
    contenders: dict[str, Launch], crun: Crun | None, runs: int, gap: float
) -> dict[str, list[float]]:
    times: dict[str, list[float]] = collections.defaultdict(list)
    for index in range(-1, runs):  # round -1 warms everything up and is not counted
        for label, launch in contenders.items():
            elapsed = time_once(launch, f"natest{os.getpid()}-{label}-{index}", gap)
            if index >= 0:
                times[label].append(elapsed)
        if crun is not None:
            elapsed = crun.run(f"natest{os.getpid()}-crun-{gap}-{index}", gap)
            if index >= 0:
                times["crun-run"].append(elapsed)
    return times


def report(title: str, times: dict[str, list[float]]) -> dict[str, float]:
    ours = statistics.median(times["nodeagent"])
    print(f"\n{title}")
    print(f"  {'launcher':<18}{'median ms':>10}{'p99 ms':>10}{'nodeagent/this':>16}")
    medians = {}
    for label, values in times.items():
        ordered = sorted(values)
        median = medians[label] = statistics.median(ordered)
        print(f"  {label:<18}{median:>10.2f}{percentile(ordered, 0.99):>10.2f}{ours / median:>15.2f}x")
    sandboxed = medians.get("nodeagent-sandbox")
    if sandboxed is not None:
        print(f"  sandboxed / unsandboxed nodeagent: {sandboxed / ours:.2f}x", end="")
        crun = medians.get("crun-run")
        print(f"; crun-run / sandboxed nodeagent: {crun / sandboxed:.2f}x" if crun else "")
    return medians


# --- --profile: where the time goes -------------------------------------------------------------------

STAGES = ("agent-request", "agent-send", "child-woke", "child-joined", "child-exec", "agent-done")
SANDBOX_STAGES = (*STAGES[:4], "child-sandboxed", "child-sealed", *STAGES[4:])


def profile(runs: int, gap: float, work: Path) -> None:
    """Stamps along nodeagent's path (NODEAGENT_LAUNCH_TRACE), and the cgroup join alone."""
    trace = work / "trace"
    os.environ["NODEAGENT_LAUNCH_TRACE"] = str(trace)
    try:
        sandbox = SandboxSpec(uid=NOBODY, gid=NOBODY, hide_paths=(str(work),))
        with keeper_in(work) as keeper:
            for regime, pause, spec in (
                ("back-to-back", 0.0, None),
                ("fresh", gap, None),
                ("sandboxed back-to-back", 0.0, sandbox),
                ("sandboxed fresh", gap, sandbox),
            ):
                launch = nodeagent_launcher(keeper, work, regime.replace(" ", "_"), spec)
                for index in range(runs + 1):
                    time_once(launch, f"natest{os.getpid()}-profile-{index}", pause)
                print_stages(regime, trace, SANDBOX_STAGES if spec else STAGES)
    finally:
        del os.environ["NODEAGENT_LAUNCH_TRACE"]
    for regime, pause in (("back-to-back", 0.0), ("fresh", gap)):
        for use_tasks in (False, True):
            label = "tasks" if use_tasks else "cgroup.procs"
            values = sorted(time_join(use_tasks, pause) for _ in range(min(runs, 40)))
            print(f"  join alone, {regime:<12} via {label:<13} median {statistics.median(values):6.3f} ms")


def print_stages(regime: str, trace: Path, stages: tuple[str, ...] = STAGES) -> None:
    """Median wall time per stage and, for a stage within one process (the child's, from its
    request to its exec), its CPU time: the measure the shared machine's load does not move."""
    stamps: dict[str, dict[str, tuple[int, int]]] = collections.defaultdict(dict)
    for line in trace.read_text().splitlines():
        launch_id, stage, ns, cpu_ns = line.split()
        if launch_id.startswith(regime.replace(" ", "_") + "-"):
            stamps[launch_id][stage] = (int(ns), int(cpu_ns))
    # The first launch warms up; extra stamps (a scratch one added to find a cost) are allowed.
    complete = [s for s in stamps.values() if all(stage in s for stage in stages)][1:]
    print(f"\nprofile, {regime} ({len(complete)} launches): median ms per stage (wall, CPU)")
    for start, end in itertools.pairwise(stages):
        print(f"  {start + ' -> ' + end:<32} {_median_ms(complete, start, end)}")
    print(f"  {'total':<32} {_median_ms(complete, stages[0], stages[-1])}")
    print(f"  {'child, request to exec':<32} {_median_ms(complete, 'child-woke', 'child-exec')}")


def _median_ms(stamps: list[dict[str, tuple[int, int]]], start: str, end: str) -> str:
    wall = statistics.median((s[end][0] - s[start][0]) / 1e6 for s in stamps)
    if start.partition("-")[0] != end.partition("-")[0]:
        return f"{wall:6.3f}"  # two processes: their CPU clocks do not compare
    cpu = statistics.median((s[end][1] - s[start][1]) / 1e6 for s in stamps)
    return f"{wall:6.3f} {cpu:6.3f}"


def time_join(use_tasks: bool, gap: float) -> float:
    """A forked child joins a fresh slot; it times its own writes and reports them on a pipe."""
    dirs = make_slot(f"natest{os.getpid()}-join")
    try:
        time.sleep(gap)
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            started = time.perf_counter_ns()
            for path in dirs:
                procs = str(path / "cgroup.procs")
                with open(join_file(procs) if use_tasks else procs, "w") as handle:
                    handle.write("0")
            os.write(write_end, str(time.perf_counter_ns() - started).encode())
            os._exit(0)
        os.close(write_end)
        elapsed = int(os.read(read_end, 64)) / 1e6
        os.close(read_end)
        os.waitpid(pid, 0)
    finally:
        remove_slot(dirs)
    return elapsed


@contextlib.contextmanager
def optional_crun(wanted: bool) -> Iterator[Crun | None]:
    if not wanted or shutil.which("crun") is None or shutil.which("unshare") is None:
        print("crun-run: skipped (crun or unshare not installed; apt-get install -y crun)")
        yield None
        return
    crun = Crun(__file__)
    try:
        yield crun
    finally:
        crun.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--gap-ms", type=float, default=50.0)
    parser.add_argument("--no-crun", action="store_true")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the whole comparison, for the spread")
    parser.add_argument("--profile", action="store_true", help="stage breakdown of nodeagent's path instead")
    parser.add_argument("--crun-server", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.crun_server:
        serve(crun_bundle)
        return
    work = Path(tempfile.mkdtemp(prefix="natest-bench-"))
    try:
        if args.profile:
            profile(args.runs, args.gap_ms / 1000, work)
            return
        rss = Path("/proc/self/status").read_text().split("VmRSS:")[1].split("\n")[0].strip()
        print(
            f"launch -> exec of {WORKER} in a cpuset+memory+pids slot, {args.runs} runs each, interleaved; "
            f"agent RSS {rss}, load {os.getloadavg()[0]:.2f}; nodeagent path: Python child (no C shim)"
        )
        # The agent's default for a worker: its own uid, the state directory hidden, the rest as built.
        sandbox = SandboxSpec(uid=NOBODY, gid=NOBODY, hide_paths=(str(work),))
        rounds: dict[str, list[dict[str, float]]] = collections.defaultdict(list)
        with keeper_in(work) as keeper, optional_crun(not args.no_crun) as crun:
            contenders = {
                "nodeagent": nodeagent_launcher(keeper, work),
                "nodeagent-sandbox": nodeagent_launcher(keeper, work, "bench-sandbox", sandbox),
                "popen-preexec": popen_preexec,
                "popen-plain": popen_plain,
            }
            for number in range(args.rounds):
                print(f"\n== round {number + 1} of {args.rounds}, load {os.getloadavg()[0]:.2f}")
                for title, gap in (
                    (f"fresh slot ({args.gap_ms:g} ms idle before each launch)", args.gap_ms / 1000),
                    ("back-to-back", 0.0),
                ):
                    rounds[title.split(" (")[0]].append(
                        report(title, measure(contenders, crun, args.runs, gap))
                    )
        if args.rounds > 1:
            print("\nspread of the medians over the rounds (ms, min-max)")
            for regime, found in rounds.items():
                spread = ", ".join(
                    f"{label} {min(r[label] for r in found):.2f}-{max(r[label] for r in found):.2f}"
                    for label in found[0]
                )
                print(f"  {regime}: {spread}")
        print(f"\nload at the end {os.getloadavg()[0]:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
