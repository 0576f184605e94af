"""End to end through containerd's NRI, without a kubelet: containerd (``kube/cluster containerd``),
a test agent (``nodeagent serve`` with NRI on, its own state dir and cgroup parent, host
partitioning off), the shim (``kube/nri-shim``), and crictl creating containers as the kubelet would.

Run by ``kube/nri-e2e`` (root; the components from kube/build's cache). Checks:

1. a Guaranteed-like container (quota 100000 / period 100000, 64 MiB) gets a guaranteed slot, and the
   container's own cgroup has the slot's exclusive CPU as its cpuset and the slot's memory limit;
2. a container removed while the shim is down has its slot released at the shim's next Synchronize;
3. a running container keeps its slot (the same id) across a shim restart, a containerd restart
   and an agent SIGKILL and restart; removed while the agent is down, its slot is released once
   the agent is back (the shim registers anew and containerd synchronizes it); with
   ``-fail-open`` a container created while the agent is down is placed by that Synchronize;
4. a REST guaranteed slot beside a container's never gets its CPU (one ledger); stopping and
   removing the container releases the slot;
5. a container asking for more CPUs than the host has fails its creation with the agent's reason,
   and leaves no slot.

Everything it starts is ended in ``finally``: the shim, the agent (then ``nodeagent uninstall
--release-slots`` for its cgroups, keeper and firewall table), the pods (the wrapper's
``kube/cluster stop`` ends containerd and removes its work directory).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.daemon import DaemonProcess, nodeagent_argv, wait_until

PARENT = f"natestnri{os.getpid()}.slice"
#: NRI_E2E_HOST_PARTITIONING=auto: run the agent with host partitioning (the kubelet's pod cgroups
#: left to NRI) and check that the host is kept off the container's exclusive CPU while the
#: container stays on it (for a VM: it confines every task of the host).
PARTITIONING = os.environ.get("NRI_E2E_HOST_PARTITIONING", "off") == "auto"
KUBE_CGROUP_ROOT = os.environ.get("KUBE_CGROUP_ROOT", "nodeagent-kube")
NRI_PREFIX = "nri-"
#: What containerd logs once a plugin registered and its Synchronize is done.
SYNCHRONIZED = 'plugin \\"10-nodeagent\\" connected and synchronized'


def say(text: str) -> None:
    print(f"nri-e2e: {text}", flush=True)


class Crictl:
    def __init__(self, binary: Path, work: Path) -> None:
        endpoint = f"unix://{work}/containerd/containerd.sock"
        self.argv = [
            str(binary),
            "--runtime-endpoint",
            endpoint,
            "--image-endpoint",
            endpoint,
            "--timeout",
            "30s",
        ]
        self.work = work

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([*self.argv, *args], capture_output=True, text=True, timeout=120, check=False)
        if check and done.returncode != 0:
            raise AssertionError(f"crictl {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
        return done

    def write(self, name: str, body: dict[str, Any]) -> str:
        path = self.work / f"nri-e2e-{name}.json"
        path.write_text(json.dumps(body))
        return str(path)


def pod_config(work: Path, uid: str) -> dict[str, Any]:
    logs = work / "pod-logs" / uid
    logs.mkdir(parents=True, exist_ok=True)
    return {
        "metadata": {"name": "nri-e2e", "namespace": "default", "uid": uid, "attempt": 0},
        # A Guaranteed pod's cgroup parent as the kubelet (cgroupfs driver) names it: directly under
        # kubepods, inside kube/cluster's own subtree (stop removes it).
        "linux": {
            "cgroup_parent": f"/{KUBE_CGROUP_ROOT}/kubepods/pod{uid}",
            "security_context": {"namespace_options": {"network": 2}},  # the host's network: no CNI
        },
        "log_directory": str(logs),
    }


def container_config(name: str, quota: int, memory: int) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "image": {"image": "nodeagent.local/busybox:1"},
        "command": ["/bin/sleep", "3600"],
        "linux": {
            "resources": {
                "cpu_period": 100_000,
                "cpu_quota": quota,
                "cpu_shares": quota * 1024 // 100_000,
                "memory_limit_in_bytes": memory,
            }
        },
        "log_path": f"{name}.log",
    }


def cgroup_file(pid: int, controller: str, name: str) -> str:
    """A file of the container's own cgroup (v1: the controller's hierarchy; v2: the unified one,
    where the CPUs it gets are ``cpuset.cpus.effective``)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        if controller in ctrls.split(","):
            return (Path("/sys/fs/cgroup") / controller / path.lstrip("/") / name).read_text().strip()
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            v2 = {"cpuset.cpus": "cpuset.cpus.effective", "memory.limit_in_bytes": "memory.max"}[name]
            return (Path("/sys/fs/cgroup") / line[3:].lstrip("/") / v2).read_text().strip()
    raise AssertionError(f"no {controller} cgroup for pid {pid}")


def task_cpus(pid: int) -> str:
    """The CPUs a task may run on (its ``Cpus_allowed_list``)."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return next(line.split(":", 1)[1].strip() for line in status if line.startswith("Cpus_allowed_list"))


def cpus_of(cri: Crictl, ctr: str) -> str:
    """The CPUs the container's cgroup gives it."""
    pid = int(json.loads(cri.run("inspect", ctr).stdout)["info"]["pid"])
    return cgroup_file(pid, "cpuset", "cpuset.cpus")


def nri_slots(client: Any) -> list[dict[str, Any]]:
    slots = client.get("/v1/slots").json()["slots"]
    return [s for s in slots if s["name"].startswith(NRI_PREFIX)]


def released(client: Any, what: str) -> None:
    """Wait until no container's slot is left: a release that puts the host back (partitioning
    on) finishes after the answer, the slot ``releasing`` meanwhile."""
    try:
        wait_until(what, lambda: nri_slots(client) == [], 30)
    except AssertionError:
        raise AssertionError(f"{what}: {nri_slots(client)}") from None


def start_shim(
    args: argparse.Namespace, daemon: DaemonProcess, shim_log: Path, *extra: str
) -> subprocess.Popen[bytes]:
    """Start the shim and wait until containerd has registered it (and synchronized it)."""
    seen = registrations(args)
    with shim_log.open("ab") as log:
        shim = subprocess.Popen(
            [
                str(args.shim),
                "-agent-socket",
                str(daemon.config.parent / "agent.sock"),
                "-token-file",
                str(daemon.token_file),
                "-nri-socket",
                str(args.work / "containerd" / "nri.sock"),
                *extra,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    args.procs.append(shim)
    wait_until(
        "containerd to register the shim",
        lambda: shim.poll() is None and registrations(args) > seen,
        timeout=30,
    )
    return shim


def registrations(args: argparse.Namespace) -> int:
    """How often containerd's current log says it registered and synchronized the shim."""
    return (args.work / "log" / "containerd.log").read_text().count(SYNCHRONIZED)


def restart_containerd(args: argparse.Namespace, cri: Crictl) -> None:
    """Stop the containerd kube/cluster started (by its recorded pid) and start it again the same
    way, recording the new pid for ``kube/cluster stop``; its log starts afresh."""
    pid_file = args.work / "pid" / "containerd"
    pid = int(pid_file.read_text())
    os.kill(pid, signal.SIGTERM)
    wait_until("containerd to stop", lambda: not Path(f"/proc/{pid}").exists(), timeout=30)
    with (args.work / "log" / "containerd.log").open("wb") as log:
        proc = subprocess.Popen(
            [str(args.bin / "containerd"), "--config", str(args.work / "containerd" / "config.toml")],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    pid_file.write_text(f"{proc.pid}\n")
    args.containerd = proc
    wait_until("containerd to answer", lambda: cri.run("version", check=False).returncode == 0, timeout=60)


def stop_shim(shim: subprocess.Popen[bytes]) -> None:
    shim.terminate()
    shim.wait(timeout=10)


def guaranteed(cri: Crictl, client: Any, pod: str, pod_json: str, name: str) -> tuple[str, dict[str, Any]]:
    """Create and start a 1-CPU 64 MiB container; check its cgroup against its slot."""
    started = time.monotonic()
    ctr = cri.run(
        "create", pod, cri.write(name, container_config(name, 100_000, 64 << 20)), pod_json
    ).stdout.strip()
    created_s = time.monotonic() - started
    cri.run("start", ctr)
    slots = nri_slots(client)
    assert [s["name"] for s in slots] == [NRI_PREFIX + ctr[:59]], slots
    slot = slots[0]
    assignment = slot["assignment"]
    assert slot["qos"] == "guaranteed"
    assert assignment["exclusive"], assignment
    pid = int(json.loads(cri.run("inspect", ctr).stdout)["info"]["pid"])
    cpuset = cgroup_file(pid, "cpuset", "cpuset.cpus")
    memory = cgroup_file(pid, "memory", "memory.limit_in_bytes")
    allowed = task_cpus(pid)
    say(
        f"container {ctr[:13]} (crictl create took {created_s:.2f}s): slot {slot['id']} "
        f"{slot['name'][:20]}... exclusive cpuset {assignment['cpuset']} numa {assignment['numa_nodes']}; "
        f"container cgroup cpuset.cpus={cpuset} memory limit={memory}; its task's Cpus_allowed_list={allowed}"
    )
    assert memory == str(64 << 20), memory
    if PARTITIONING:
        # This test is one of the host's tasks: once the partitioner's pass has run it is off the CPU.
        exclusive = set(assignment["cpus"])
        wait_until(
            "the host to be kept off the slot's CPU", lambda: not os.sched_getaffinity(0) & exclusive, 15
        )
        cpuset = cgroup_file(pid, "cpuset", "cpuset.cpus")
        allowed = task_cpus(pid)
        host = sorted(os.sched_getaffinity(0))
        say(f"host partitioned: the test runs on {host}, the container on {allowed}")
    assert cpuset == assignment["cpuset"], (cpuset, assignment["cpuset"])
    assert allowed == assignment["cpuset"], (allowed, assignment["cpuset"])
    return ctr, slot


def run(args: argparse.Namespace, daemon: DaemonProcess, cri: Crictl, shim_log: Path) -> None:
    work: Path = args.work
    client = daemon.start(timeout=180)  # a slow emulated VM takes a while to import
    say(f"agent up ({daemon.url}, unix socket {daemon.config.parent / 'agent.sock'})")
    shim = start_shim(args, daemon, shim_log)
    say("shim registered with containerd's NRI")

    uid = f"nrie2e{os.getpid()}"
    pod_json = cri.write("pod", pod_config(work, uid))
    pod = cri.run("runp", pod_json).stdout.strip()
    args.pods.append(pod)
    say(f"pod sandbox {pod[:13]}")

    # 1. Guaranteed: 1 whole CPU, 64 MiB -> an exclusive CPU in the container's own cgroup.
    first, _ = guaranteed(cri, client, pod, pod_json, "first")

    # 2. The container goes while the shim is down: the next Synchronize releases its slot.
    stop_shim(shim)
    cri.run("stop", first)
    cri.run("rm", first)
    assert len(nri_slots(client)) == 1, "no shim: nothing told the agent"
    shim = start_shim(args, daemon, shim_log)
    wait_until(
        "Synchronize to release the gone container's slot", lambda: nri_slots(client) == [], timeout=10
    )
    say("container removed while the shim was down: released at the shim's next Synchronize")

    # 3. A running container survives a shim restart: Synchronize keeps the same slot.
    second, slot = guaranteed(cri, client, pod, pod_json, "second")
    stop_shim(shim)
    shim = start_shim(args, daemon, shim_log)
    assert [s["id"] for s in nri_slots(client)] == [slot["id"]], nri_slots(client)
    say("shim restarted with the container running: Synchronize kept its slot")

    # 3a. containerd restarted with the container running: the shim registers again, and the
    # Synchronize of that registration keeps the slot.
    restart_containerd(args, cri)
    wait_until("the shim to register with the new containerd", lambda: registrations(args) > 0, timeout=60)
    assert shim.poll() is None, "the shim ended with containerd"
    assert [s["id"] for s in nri_slots(client)] == [slot["id"]], nri_slots(client)
    say("containerd restarted with the container running: the shim registered again, the slot kept")

    # 3b. The agent killed (SIGKILL) and started again: the slot is still held, the same one.
    daemon.kill()
    client = daemon.start(timeout=180)
    assert [s["id"] for s in nri_slots(client)] == [slot["id"]], nri_slots(client)
    say("agent SIGKILLed and restarted with the container running: its slot is still held")

    # 3c. The container goes while the agent is down: the shim's calls fail, and once the agent
    # answers again the shim registers anew; containerd's Synchronize releases the slot.
    daemon.kill()
    cri.run("stop", second)
    cri.run("rm", second)
    client = daemon.start(timeout=180)
    back = client
    wait_until("the shim to register anew and synchronize", lambda: nri_slots(back) == [], timeout=30)
    say("container removed while the agent was down: released at the shim's new registration's Synchronize")

    # 3d. -fail-open: a container created while the agent is down runs unplaced; the Synchronize
    # once the agent is back allocates its slot and the shim's update moves it onto the slot's CPU.
    stop_shim(shim)
    shim = start_shim(args, daemon, shim_log, "-fail-open")
    daemon.kill()
    late = cri.run("create", pod, cri.write("late", container_config("late", 100_000, 64 << 20)), pod_json)
    late_id = late.stdout.strip()
    cri.run("start", late_id)
    before = cpus_of(cri, late_id)
    client = daemon.start(timeout=180)
    again = client
    wait_until("the Synchronize to place the late container", lambda: len(nri_slots(again)) == 1, timeout=30)
    late_slot = nri_slots(client)[0]
    assert late_slot["name"] == NRI_PREFIX + late_id[:59], late_slot
    wanted = late_slot["assignment"]["cpuset"]
    wait_until("the update to reach the container", lambda: cpus_of(cri, late_id) == wanted, timeout=10)
    say(f"-fail-open: created with the agent down (CPUs {before}), put on its slot's {wanted} by Synchronize")
    cri.run("stop", late_id)
    cri.run("rm", late_id)
    released(client, "the late container's slot to be released")

    # 4. Stop and remove: the slot is released (StopContainer releases it; RemoveContainer again).
    third, held = guaranteed(cri, client, pod, pod_json, "third")

    # One ledger: a REST slot cannot take the container's CPU (it gets another, or does not fit).
    body = {"name": "e2e-rest", "qos": "guaranteed", "resources": {"cpus": 1, "memory": "32Mi"}}
    rest = client.post("/v1/slots", json=body)  # (left over, uninstall --release-slots takes it)
    assert rest.status_code in (201, 409), rest.text
    if rest.status_code == 201:
        theirs = rest.json()["assignment"]["cpus"]
        assert not set(theirs) & set(held["assignment"]["cpus"]), (theirs, held["assignment"])
        assert client.delete("/v1/slots/e2e-rest").status_code == 204
        say(f"a REST guaranteed slot got CPU(s) {theirs}, not the container's {held['assignment']['cpuset']}")
    else:
        say(f"a REST guaranteed slot does not fit beside the container: {rest.json()['error']['message']}")
    cri.run("stop", third)
    released(client, "the stopped container's slot to be released")
    cri.run("rm", third)
    assert nri_slots(client) == []
    say("container stopped and removed: slot released")

    # 5. More CPUs than the host has: creation fails with the agent's reason.
    too_many = (os.cpu_count() or 1) * 100_000 + 100_000
    refused = cri.run(
        "create",
        pod,
        cri.write("too-big", container_config("too-big", too_many, 64 << 20)),
        pod_json,
        check=False,
    )
    assert refused.returncode != 0, refused.stdout
    reason = refused.stderr.strip()
    say(f"too big: crictl create failed: {reason[-400:]}")
    assert "nodeagent refused (409 does_not_fit)" in reason, reason
    assert nri_slots(client) == []
    say("PASS (with host partitioning)" if PARTITIONING else "PASS")


def clean_up(
    args: argparse.Namespace, daemon: DaemonProcess, cri: Crictl, tell: Callable[[str], None] = say
) -> None:
    for pod in args.pods:
        cri.run("stopp", pod, check=False)
        cri.run("rmp", "-f", pod, check=False)
    for proc in args.procs:
        if proc.poll() is None:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    daemon.stop()
    daemon.stop_keeper()
    done = subprocess.run(
        [
            *nodeagent_argv(),
            "uninstall",
            "--config",
            str(daemon.config),
            "--state-dir",
            str(daemon.state),
            "--release-slots",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    tell(f"uninstall ({done.returncode}): {(done.stdout + done.stderr).strip()}")


def nri_agent(
    work: Path,
    short: str,
    parent: str,
    *,
    partitioning: str = "off",
    placement: str = "",
    kubernetes: str = "",
    cdi: str = "",
) -> DaemonProcess:
    """A test agent in ``work`` with NRI on, its API on a unix socket (``work/agent.sock``, where
    the shim calls it), its own cgroup parent and network names (``short``: two letters), and the
    ``[placement]``, further ``[kubernetes]`` and ``[cdi]`` lines given (no ``[cdi]``: specs in a
    directory of its own)."""
    pid = os.getpid()
    return DaemonProcess(
        work,
        f'[api]\nunix_socket = "{work / "agent.sock"}"\n\n'
        f'[isolation]\nhost_partitioning = "{partitioning}"\ncgroup_parent = "{parent}"\n'
        f'netns_prefix = "{short}{pid}-"\nveth_prefix = "{short}e"\n'
        f'firewall_table = "{parent.removesuffix(".slice")}"\n\n'
        + (f"[placement]\n{placement}\n\n" if placement else "")
        + (f"[cdi]\n{cdi}\n\n" if cdi else "")
        + f"[kubernetes]\nnri = true\n{kubernetes}",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin", type=Path, required=True, help="kube/build's bin directory")
    parser.add_argument("--shim", type=Path, required=True, help="the nri-shim binary")
    parser.add_argument("--work", type=Path, required=True, help="kube/cluster's work directory")
    args = parser.parse_args(argv)
    args.procs, args.pods = [], []
    agent_dir = Path(tempfile.mkdtemp(prefix="nri-e2e-agent-"))
    daemon = nri_agent(
        agent_dir,
        "nn",
        PARENT,
        partitioning="auto" if PARTITIONING else "off",
        kubernetes=f'pods_cgroups = ["{KUBE_CGROUP_ROOT}/kubepods"]\n',
    )
    cri = Crictl(args.bin / "crictl", args.work)
    status = 1
    try:
        run(args, daemon, cri, agent_dir / "shim.log")
        status = 0
    except AssertionError as err:
        say(f"FAIL: {err}")
    finally:
        clean_up(args, daemon, cri)
        for name in ("daemon.log", "shim.log"):
            path = agent_dir / name
            if status and path.exists():
                say(f"--- {name} (tail)\n{path.read_text()[-3000:]}")
        shutil.rmtree(agent_dir, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
