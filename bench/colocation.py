"""Online tail latency and best-effort throughput with colocation: alone, today's weights, the QoS loop.

Run as root: ``python bench/colocation.py [--rounds 5] [--seconds 20] [--rate 100]``.

The online worker is the example Open Inference Protocol server (examples/oip_worker.py) in a
burstable slot with a one-CPU quota; an open-loop client outside the slots sends ``--rate``
inferences a second at fixed intervals and measures each latency from the instant the request was
due (so a stalled server is charged for the requests queued behind it). Best-effort work in a
best-effort slot: one CPU-bound loop per pool CPU and a memory-bandwidth hog (copies of a 64 MiB
buffer). Scenarios, interleaved in rounds because the machine is shared and drifts:

- ``alone``: the online worker under load, nothing else of ours;
- ``weights``: best-effort beside it with today's protection only (cpu.idle, minimal weight);
- ``qos loop``: the same, with the QoS loop (sampler -> decide -> actuator, every ``--period``);
- ``loop, host online``: the loop with ``host_cpu_as_online`` (the host's other CPU use counted
  as online work, the rule before 2026-12-06) beside the loop as shipped, which counts it apart.

Each round starts at another scenario (alone, weights, loop, ...; then weights, loop, ..., alone).

``--other-tenant CPUS`` adds the host's other tenants where the machine has none: a process outside
the slots, at normal priority, busy for that share of every 50 ms on one CPU, running through every
scenario (its CPU shows under "others").

``--step`` adds a load step with the loop and best-effort running: online load at the low rate of
``--step-rates`` for ``--step-seconds``, then the high rate, then the low one again. Reported: each
phase's p99 and online CPU, and the time from each step to the loop's first action that cuts
best-effort (``cpu_suppress``) or gives CPU back (``cpu_release``), in seconds and periods.

Figures per scenario: client p50/p99/p99.9 in ms (median over rounds), p99 as a multiple of the
same round's ``alone`` (median [min-max]); best-effort CPU time as a share of what the online work
left idle (pool CPU-seconds less the online slot's and the client's) and of what was truly idle
(less the host's other processes too, which the loop counts as online load); and the CPUs those
other processes took.

``--squeeze`` adds a memory squeeze: the bench parent cgroup gets a memory limit of ``--node-mib``
(a small node inside this host: the kernel enforces it, and the loop sees it as the node's memory
through the sampler's proc root); a best-effort hog grows towards twice that beside the loaded
online worker, with and without the loop. Reported: online OOM kills, online restarts (none can
happen: the bench has no supervisor, so a kill shows as a dead server), best-effort evictions and
OOM kills, and online p99.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import os
import queue
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from nodeagent.cgroups import CgroupLimits, detect, open_manager
from nodeagent.errors import NodeAgentError
from nodeagent.isolation.colocation import Action, ColocationConfig, Decision, LoopState, Sample, decide
from nodeagent.isolation.colocation_kernel import Actuator, Sampler, SlotInfo
from nodeagent.isolation.isolator import AppliedSlot, SlotIsolator
from nodeagent.isolation.network import SlotNetworkConfig
from nodeagent.isolation.slot_spec import IsolatorConfig, SlotIsolationSpec

MiB = 1 << 20
HERE = Path(__file__).resolve().parent
WORKER = HERE.parent / "examples" / "oip_worker.py"
SCENARIOS = ("alone", "weights", "qos loop", "loop, host online")
LOOPS = {"qos loop": False, "loop, host online": True}  # scenario -> host_cpu_as_online
BODY = json.dumps(
    {"inputs": [{"name": "x", "shape": [1, 64], "datatype": "FP32", "data": [0.01 * i for i in range(64)]}]}
).encode()

CPU_HOG = "while True:\n    pass\n"
BANDWIDTH_HOG = "a = bytearray(64 << 20)\nb = bytearray(64 << 20)\nwhile True:\n    a[:] = b\n"
# Busy for argv[1] of every 50 ms window, asleep for the rest: another tenant's steady load.
DUTY_HOG = (
    "import sys, time\nshare = float(sys.argv[1])\nwhile True:\n    start = time.monotonic()\n"
    "    while time.monotonic() - start < 0.05 * share:\n        pass\n"
    "    time.sleep(max(0.0, 0.05 - (time.monotonic() - start)))\n"
)
GROWING_HOG = (
    "import sys, time\nstep, limit = int(sys.argv[1]) << 20, int(sys.argv[2]) << 20\nblocks = []\n"
    "while len(blocks) * step < limit:\n    blocks.append(b'x' * step)\n    time.sleep(0.1)\n"
    "time.sleep(600)\n"
)


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# --------------------------------------------------------------------------- processes in slots


def start_in(
    slot: AppliedSlot, argv: list[str], env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``argv`` paused on a pipe, move it into the slot, let it run."""
    read_fd, write_fd = os.pipe()
    wrapper = "import os, sys\nos.read(int(sys.argv[1]), 1)\nos.execv(sys.argv[2], sys.argv[2:])\n"
    proc = subprocess.Popen(
        [sys.executable, "-c", wrapper, str(read_fd), *argv],
        pass_fds=(read_fd,),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )
    os.close(read_fd)
    for procs in slot.procs_files:
        Path(procs).write_text(str(proc.pid))
    os.write(write_fd, b"x")
    os.close(write_fd)
    return proc


def python(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", code, *args]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            conn.request("GET", "/v2/health/ready")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the online worker on port {port} did not become ready in {timeout}s")


# --------------------------------------------------------------------------- the open-loop client


def open_loop(port: int, rate: float, seconds: float, clients: int = 8) -> tuple[list[float], int]:
    """Latencies (ms) from each request's due time; and the count of failed requests."""
    due: queue.Queue[float | None] = queue.Queue()
    latencies: list[float] = []
    failures = [0]
    lock = threading.Lock()

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        while (scheduled := due.get()) is not None:
            try:
                conn.request("POST", "/v2/models/mlp/infer", BODY, {"Content-Type": "application/json"})
                conn.getresponse().read()
                done = time.perf_counter()
                with lock:
                    latencies.append((done - scheduled) * 1000)
            except (OSError, http.client.HTTPException):
                with lock:
                    failures[0] += 1
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    interval = 1.0 / rate
    start = time.perf_counter() + 0.05
    for n in range(round(rate * seconds)):
        at = start + n * interval
        delay = at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        due.put(at)
    for _ in threads:
        due.put(None)
    for thread in threads:
        thread.join(30)
    return latencies, failures[0]


# --------------------------------------------------------------------------- the loop, as the agent runs it


class QosThread:
    """sample -> decide -> act every period on a thread; evictions kill the slot's processes (what
    the agent's loop does once an evicted worker's grace is over)."""

    def __init__(
        self, sampler: Sampler, actuator: Actuator, config: ColocationConfig, slots: list[SlotInfo]
    ) -> None:
        self.sampler, self.actuator, self.config, self.slots = sampler, actuator, config, slots
        self.state = LoopState()
        self.actions: list[Action] = []
        self.busy = 0.0
        self.periods = 0
        self.errors: list[str] = []
        self.samples: list[Sample] = []
        self.timeline: list[tuple[float, Decision]] = []  # (monotonic time, the period's decision)
        self.before_sample: Callable[[], None] = lambda: None
        self.evict: Callable[[str], None] = lambda slot_id: None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.actuator.release()

    def _run(self) -> None:
        while not self._stop.wait(self.config.period_seconds):
            began = time.thread_time()
            try:
                self._period()
            except NodeAgentError as err:  # as the agent's loop: log, count, go on
                self.errors.append(str(err))
            self.busy += time.thread_time() - began
            self.periods += 1

    def _period(self) -> None:
        self.before_sample()
        sample = self.sampler.sample(self.slots, time.monotonic())
        self.samples.append(sample)
        decision = decide(self.config, self.state, sample)
        self.state = decision.state
        self.timeline.append((sample.time, decision))
        for action in decision.actions:
            self.actions.append(action)
            if action.kind == "evict" and action.slot_id is not None:
                self.evict(action.slot_id)
                self.slots = [
                    SlotInfo(s.slot_id, s.qos, running=False, evicted=True)
                    if s.slot_id == action.slot_id
                    else s
                    for s in self.slots
                ]
            elif action.kind != "restore":
                self.actuator.apply(action)
        if self.periods % 10 == 0:  # as the agent: on changes and every 10 s (children inherit)
            self.actuator.tend([s.slot_id for s in self.slots if s.qos == "best-effort"])


# --------------------------------------------------------------------------- measurement


def cpu_seconds(slot: AppliedSlot) -> float:
    host = detect()
    stats = open_manager(host, slot.cgroup).stats()
    return (stats.cpu_usage_ns or 0) / 1e9


def pool_busy_seconds(pool: frozenset[int]) -> tuple[float, float]:
    """CPU-seconds the pool's CPUs were busy (steal included) and of those, stolen by the hypervisor."""
    busy = steal = 0
    for line in Path("/proc/stat").read_text().splitlines():
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in pool:
            values = [int(v) for v in rest.split()]
            busy += sum(values[i] for i in (0, 1, 2, 5, 6, 7))
            steal += values[7] if len(values) > 7 else 0
    tick = os.sysconf("SC_CLK_TCK")
    return busy / tick, steal / tick


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Result:
    latencies: list[float]
    failures: int
    seconds: float
    online_cpu: float
    client_cpu: float
    best_effort_cpu: float
    pool_busy: float
    pool_cpus: int
    steal: float = 0.0
    loop_busy: float = 0.0
    loop_periods: int = 0
    notes: dict[str, int] = field(default_factory=dict)

    @property
    def idle_left(self) -> float:
        """CPU-seconds the online work (server and client) left in the pool."""
        return self.pool_cpus * self.seconds - self.online_cpu - self.client_cpu

    @property
    def idle(self) -> float:
        """CPU-seconds nobody but best-effort used: what the host's other processes left too."""
        return self.idle_left - self.others

    @property
    def others(self) -> float:
        """CPU-seconds the host's other processes took in the pool."""
        return max(0.0, self.pool_busy - self.online_cpu - self.client_cpu - self.best_effort_cpu)


@dataclass
class Bench:
    args: argparse.Namespace
    isolator: SlotIsolator
    online: AppliedSlot
    batch: AppliedSlot
    port: int
    pool: frozenset[int]

    def scenario(self, name: str, record: Path | None = None) -> Result:
        hogs: list[subprocess.Popen[bytes]] = []
        loop: QosThread | None = None
        try:
            if name != "alone":
                hogs = [start_in(self.batch, python(CPU_HOG)) for _ in self.pool]
                if not self.args.no_bandwidth_hog:
                    hogs.append(start_in(self.batch, python(BANDWIDTH_HOG)))
            if name in LOOPS:
                loop = self.loop(host_as_online=LOOPS[name])
                loop.start()
            time.sleep(self.args.settle)
            before = self.snapshot()
            latencies, failures = open_loop(self.port, self.args.rate, self.args.seconds)
            after = self.snapshot()
        finally:
            if loop is not None:
                loop.stop()
                if record is not None:
                    record.write_text(json.dumps([sample_to_json(x) for x in loop.samples]) + "\n")
            for hog in hogs:
                hog.kill()  # our own children, by pid
                hog.wait()
        return Result(
            latencies=latencies[round(len(latencies) * 0.1) :],  # the first tenth warms up
            failures=failures,
            seconds=after[0] - before[0],
            online_cpu=after[1] - before[1],
            client_cpu=after[2] - before[2],
            best_effort_cpu=after[3] - before[3],
            pool_busy=after[4][0] - before[4][0],
            steal=after[4][1] - before[4][1],
            pool_cpus=len(self.pool),
            loop_busy=0.0 if loop is None else loop.busy,
            loop_periods=0 if loop is None else loop.periods,
        )

    def snapshot(self) -> tuple[float, float, float, float, tuple[float, float]]:
        return (
            time.monotonic(),
            cpu_seconds(self.online),
            own_cpu_seconds(),
            cpu_seconds(self.batch),
            pool_busy_seconds(self.pool),
        )

    def loop(self, proc_root: Path = Path("/proc"), *, host_as_online: bool = False) -> QosThread:
        isolator = self.isolator
        sampler = Sampler(
            isolator.host,
            isolator.hierarchy,
            allowed=isolator.pool.allowed,
            core_of=core_map(),
            proc_root=proc_root,
        )
        slots = [SlotInfo("online", "burstable"), SlotInfo("batch", "best-effort", running=True)]
        config = ColocationConfig(
            period_seconds=self.args.period, cpu_margin=self.args.margin, host_cpu_as_online=host_as_online
        )
        return QosThread(sampler, Actuator(isolator), config, slots)


def sample_to_json(sample: Sample) -> dict[str, object]:
    """A sample as JSON (for recorded series the decision's tests replay)."""
    body = dataclasses.asdict(sample)
    body["pool"] = sorted(sample.pool)
    body["exclusive"] = sorted(sample.exclusive)
    return body


def core_map() -> dict[int, int]:
    cores: dict[int, int] = {}
    for cpu_dir in Path("/sys/devices/system/cpu").glob("cpu[0-9]*"):
        core = cpu_dir / "topology" / "core_id"
        package = cpu_dir / "topology" / "physical_package_id"
        if core.exists():
            cores[int(cpu_dir.name[3:])] = int(package.read_text()) * 4096 + int(core.read_text())
    return cores


# --------------------------------------------------------------------------- the memory squeeze


def squeeze(bench: Bench, with_loop: bool, tmp: Path) -> dict[str, float | int | str]:
    """The bench parent limited to --node-mib; a best-effort hog grows towards twice that."""
    host = bench.isolator.host
    parent = open_manager(host, bench.isolator.hierarchy.parent)
    node = bench.args.node_mib * MiB
    parent.set(CgroupLimits(memory_max=node))
    proc = tmp / ("proc-loop" if with_loop else "proc-weights")
    proc.mkdir()
    for name in ("stat", "pressure"):
        (proc / name).symlink_to(Path("/proc") / name)

    peak = [0]

    def write_meminfo() -> None:
        used = parent.stats().memory_current or 0
        peak[0] = max(peak[0], used)
        (proc / "meminfo").write_text(
            f"MemTotal: {node // 1024} kB\nMemAvailable: {max(0, node - used) // 1024} kB\n"
        )

    online_oom_before = open_manager(host, bench.online.cgroup).stats().oom.oom_kill or 0
    batch_oom_before = open_manager(host, bench.batch.cgroup).stats().oom.oom_kill or 0
    write_meminfo()
    peak[0] = 0
    loop: QosThread | None = None
    evictions: list[str] = []
    hog = start_in(bench.batch, python(GROWING_HOG, str(bench.args.grow_mib), str(2 * bench.args.node_mib)))
    try:
        if with_loop:
            loop = bench.loop(proc_root=proc)
            loop.before_sample = write_meminfo

            def evict(slot_id: str) -> None:
                evictions.append(slot_id)
                open_manager(host, bench.batch.cgroup).kill(timeout=5.0)

            loop.evict = evict
            loop.start()
        watcher = threading.Thread(
            target=lambda: _watch(write_meminfo, bench.args.squeeze_seconds), daemon=True
        )
        watcher.start()
        latencies, failures = open_loop(bench.port, bench.args.rate, bench.args.squeeze_seconds)
        watcher.join()
    finally:
        if loop is not None:
            loop.stop()
        hog_ended = hog.poll()
        hog.kill()
        hog.wait()
        parent.set(CgroupLimits(memory_max=-1))
    online_alive = bench_online_alive(bench)
    throttles = 0 if loop is None else sum(a.kind == "memory_throttle" for a in loop.actions)
    return {
        "scenario": "squeeze, qos loop" if with_loop else "squeeze, weights",
        "p99_ms": percentile(latencies, 0.99) if latencies else float("nan"),
        "failed_requests": failures,
        "online_oom_kills": (open_manager(host, bench.online.cgroup).stats().oom.oom_kill or 0)
        - online_oom_before,
        "online_alive": int(online_alive),
        "best_effort_oom_kills": (open_manager(host, bench.batch.cgroup).stats().oom.oom_kill or 0)
        - batch_oom_before,
        "best_effort_throttles": throttles,
        "best_effort_evictions": len(evictions),
        "hog_ended_by_itself": str(hog_ended),
        "node_peak_percent": round(100 * peak[0] / node, 1),
    }


def _watch(measure: Callable[[], None], seconds: float) -> None:
    """The node's peak memory also in the scenario without the loop (which reads it each period)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        measure()
        time.sleep(0.1)


def bench_online_alive(bench: Bench) -> bool:
    try:
        wait_ready(bench.port, timeout=2.0)
    except RuntimeError:
        return False
    return True


# --------------------------------------------------------------------------- the load step


def step_response(bench: Bench) -> dict[str, object]:
    """Best-effort hogs and the loop running; online load low, high, low. Each phase's p99 and
    online CPU, and how long after each step the loop cut best-effort and gave CPU back."""
    low, high = bench.args.step_rates
    seconds = bench.args.step_seconds
    hidden, layers = bench.args.step_model
    # A heavier model than the rounds' in a burstable slot of its own with room above one CPU: at the
    # high rate online work must take enough of the pool for best-effort's allowance to fall.
    slot = bench.isolator.apply(
        SlotIsolationSpec("online-step", "burstable", cpu_quota=2.0, memory_bytes=1024 * MiB)
    )
    port = free_port()
    server = start_in(
        slot,
        [sys.executable, str(WORKER), "--port", str(port), "--hidden", str(hidden), "--layers", str(layers)],
        {"OMP_NUM_THREADS": "1"},
    )
    hogs = [start_in(bench.batch, python(CPU_HOG)) for _ in bench.pool]
    if not bench.args.no_bandwidth_hog:
        hogs.append(start_in(bench.batch, python(BANDWIDTH_HOG)))
    loop = bench.loop()
    phases: list[dict[str, object]] = []
    steps: list[float] = []
    try:
        wait_ready(port)
        open_loop(port, low, 1.0)  # warm it up
        loop.start()
        time.sleep(bench.args.settle + 3 * bench.args.period)  # the loop's window sees the low load
        for rate in (low, high, low):
            steps.append(time.monotonic())
            online_before = cpu_seconds(slot)
            latencies, failures = open_loop(port, rate, seconds)
            online_cpu = (cpu_seconds(slot) - online_before) / (time.monotonic() - steps[-1])
            phases.append(
                {
                    "rate": rate,
                    "p50_ms": round(percentile(latencies, 0.5), 2),
                    "p99_ms": round(percentile(latencies, 0.99), 2),
                    "online_cpus": round(online_cpu, 2),
                    "failed": failures,
                }
            )
    finally:
        loop.stop()
        for proc in (*hogs, server):
            proc.kill()  # our own children, by pid
            proc.wait()
        bench.isolator.release(slot.slot_id)
    period = bench.args.period

    def first_after(at: float, kind: str, until: float) -> dict[str, object]:
        for when, decision in loop.timeline:
            if at < when <= until and any(a.kind == kind for a in decision.actions):
                action = next(a for a in decision.actions if a.kind == kind)
                return {
                    "seconds": round(when - at, 2),
                    "periods": round((when - at) / period, 2),
                    "quota": action.quota_cpus,
                    "cpuset": sorted(action.cpus or ()),
                }
        return {"seconds": None, "note": f"no {kind} within the phase"}

    allowed = [
        (when, d.measured.allowed_cpus, d.measured.online_cpu)
        for when, d in loop.timeline
        if d.measured is not None
    ]
    end = time.monotonic()
    return {
        "phases": phases,
        "suppress_after_step_up": first_after(steps[1], "cpu_suppress", steps[2]),
        "give_back_after_step_down": first_after(steps[2], "cpu_release", end),
        "allowed_per_period": [
            (round(when - steps[0], 1), round(value, 2), round(online, 2)) for when, value, online in allowed
        ],
    }


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=20.0, help="measured load per scenario and round")
    parser.add_argument("--rate", type=float, default=100.0, help="inferences per second (open loop)")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds before measuring")
    parser.add_argument("--period", type=float, default=1.0, help="the QoS loop's period")
    parser.add_argument("--margin", type=float, default=0.1, help="the loop's cpu_margin")
    parser.add_argument("--squeeze", action="store_true", help="also run the memory squeeze")
    parser.add_argument(
        "--no-bandwidth-hog", action="store_true", help="best-effort runs CPU hogs only (no bandwidth hog)"
    )
    parser.add_argument("--node-mib", type=int, default=1024, help="the squeezed node's memory")
    parser.add_argument("--grow-mib", type=int, default=16, help="the hog's growth per 0.1 s")
    parser.add_argument("--squeeze-seconds", type=float, default=45.0)
    parser.add_argument(
        "--record", type=Path, default=None, help="write the loop's samples of the first round here (JSON)"
    )
    parser.add_argument(
        "--other-tenant",
        type=float,
        default=0.0,
        help="CPUs (0-1) another tenant outside the slots takes throughout (duty-cycled busy loop)",
    )
    parser.add_argument("--step", action="store_true", help="also run the load step")
    parser.add_argument(
        "--step-rates",
        type=lambda text: tuple(float(v) for v in text.split(",")),
        default=(20.0, 200.0),
        help="low,high online rates of the load step (req/s)",
    )
    parser.add_argument("--step-seconds", type=float, default=10.0, help="seconds of each phase of the step")
    parser.add_argument(
        "--step-model",
        type=lambda text: tuple(int(v) for v in text.split(",")),
        default=(4096, 3),
        help="hidden width,layers of the load step's online model (heavier than the rounds')",
    )
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root: the bench creates cgroups")

    tag = f"nabench{os.getpid() % 10000}"
    network = SlotNetworkConfig(netns_prefix=f"{tag}-", veth_prefix=tag, nft_table=f"{tag}-fw")
    isolator = SlotIsolator(
        detect(),
        IsolatorConfig(
            cgroup_parent=f"natestbench{os.getpid()}.slice",
            network=network,
            resctrl_prefix=f"{tag}-",
            resctrl_root=Path("/nonexistent-resctrl"),
        ),
    )
    server: subprocess.Popen[bytes] | None = None
    tenant: subprocess.Popen[bytes] | None = None
    results: dict[str, list[Result]] = {s: [] for s in SCENARIOS}
    squeezes: list[dict[str, float | int | str]] = []
    step: dict[str, object] | None = None
    try:
        if args.other_tenant > 0:
            # Outside the slots, at normal priority: the host's other load, as the loop sees it.
            tenant = subprocess.Popen(python(DUTY_HOG, str(args.other_tenant)))
        online = isolator.apply(
            SlotIsolationSpec("online", "burstable", cpu_quota=1.0, memory_bytes=512 * MiB)
        )
        batch = isolator.apply(SlotIsolationSpec("batch", "best-effort"))
        pool = isolator.pool.pool()
        port = free_port()
        server = start_in(
            online, [sys.executable, str(WORKER), "--port", str(port)], {"OMP_NUM_THREADS": "1"}
        )
        wait_ready(port)
        bench = Bench(args, isolator, online, batch, port, pool)
        print(
            f"pool CPUs {sorted(pool)}; online: OIP worker (burstable, 1 CPU quota) at {args.rate:g} req/s "
            f"open loop; best-effort: {len(pool)} CPU hogs"
            f"{'' if args.no_bandwidth_hog else ' + a memory-bandwidth hog'}; "
            f"{f'another tenant at {args.other_tenant:g} CPU; ' if tenant else ''}{args.rounds} "
            f"interleaved rounds of {args.seconds:g} s; load average {os.getloadavg()[0]:.2f}",
            flush=True,
        )
        open_loop(port, args.rate, 2.0)  # warm the server up
        for round_no in range(args.rounds):
            # Each round starts at another scenario, so none always follows the same one.
            order = SCENARIOS[round_no % len(SCENARIOS) :] + SCENARIOS[: round_no % len(SCENARIOS)]
            for name in order:
                record = args.record if round_no == 0 and name == "qos loop" else None
                results[name].append(bench.scenario(name, record))
            print(
                f"round {round_no + 1}/{args.rounds} done (load average {os.getloadavg()[0]:.2f})",
                file=sys.stderr,
            )
        if args.step:
            step = step_response(bench)
        if args.squeeze:
            with_tmp = Path(tempfile.mkdtemp(prefix=f"{tag}-squeeze-"))
            with_tmp.mkdir(exist_ok=True)
            try:
                for with_loop in (False, True):
                    squeezes.append(squeeze(bench, with_loop, with_tmp))
            finally:
                shutil.rmtree(with_tmp, ignore_errors=True)
    finally:
        if tenant is not None:
            tenant.kill()  # our own child, by pid
            tenant.wait()
        if server is not None:
            server.terminate()
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        isolator.remove_all()
    report(results, squeezes, step)


def report(
    results: dict[str, list[Result]],
    squeezes: list[dict[str, float | int | str]],
    step: dict[str, object] | None = None,
) -> None:
    if not results["alone"]:
        results = {}
    alone = [percentile(r.latencies, 0.99) for r in results.get("alone", [])]
    print(
        f"\n{'scenario':<18}{'p50':>7}{'p99':>8}{'p99.9':>8}  p99/alone median [min-max]"
        f"   best-effort / idle left [range] / truly idle   others' CPU   loop CPU/period   steal"
    )
    for name, rounds in results.items():
        p50, p99, p999 = (
            statistics.median(percentile(r.latencies, q) for r in rounds) for q in (0.5, 0.99, 0.999)
        )
        ratios = [percentile(r.latencies, 0.99) / a for r, a in zip(rounds, alone, strict=True)]
        shares = [r.best_effort_cpu / r.idle_left for r in rounds if r.idle_left > 0]
        truly = [r.best_effort_cpu / r.idle for r in rounds if r.idle > 0.05 * r.seconds]
        share = "-"
        if name != "alone":
            share = f"{statistics.median(shares):.0%} [{min(shares):.0%}-{max(shares):.0%}]"
            share += f" / {statistics.median(truly):.0%}" if truly else " / -"
        others = statistics.median(r.others / r.seconds for r in rounds)
        steal = statistics.median(r.steal / r.seconds for r in rounds)
        periods = sum(r.loop_periods for r in rounds)
        loop_cpu = f"{sum(r.loop_busy for r in rounds) / periods * 1000:.2f} ms" if periods else "-"
        failures = sum(r.failures for r in rounds)
        print(
            f"{name:<18}{p50:>7.2f}{p99:>8.2f}{p999:>8.2f}  {statistics.median(ratios):.2f}x "
            f"[{min(ratios):.2f}-{max(ratios):.2f}]      {share:<22}{others:>6.2f} CPUs   {loop_cpu:<8}"
            f"{steal:>6.3f} CPUs" + (f"   ({failures} failed requests)" if failures else "")
        )
    per_round = {
        name: [round(percentile(r.latencies, 0.99), 2) for r in rounds] for name, rounds in results.items()
    }
    print(f"\np99 per round (ms): {per_round}")
    for row in squeezes:
        print(
            "squeeze: "
            + ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
        )
    if step is not None:
        print("\nload step (loop and best-effort running):")
        for key, value in step.items():
            print(f"  {key}: {value}")


if __name__ == "__main__":
    main()
