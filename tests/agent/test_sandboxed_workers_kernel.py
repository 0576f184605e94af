"""Real workers in default (sandboxed) slots, through the real SlotManager, kernel isolation and
host keeper: an exec probe that can only pass inside its worker's sandbox, and a third-party model
server installed from PyPI (MLServer, CPU only) serving a tiny model built here.

MLServer is installed into a venv of its own for this session (tests.workerpy): in CI a failed
install fails the test rather than skipping it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from nodeagent.agent.config import AgentConfig
from nodeagent.agent.manager import SlotManager
from nodeagent.errors import InvalidRequest, NotFound
from nodeagent.runtime.sandbox import probe
from nodeagent.runtime.sandbox.caps import ROOT_CAPABILITIES, capability_mask
from nodeagent.schema.request import parse_slot_request
from tests.escape.harness import config_for, free_port, started_manager
from tests.workerpy import make_venv, world_python

pytestmark = [pytest.mark.root, pytest.mark.slow]

MLSERVER = "mlserver==1.7.1"
SUPPORT = probe()
#: A model MLServer loads from Python code: doubles its FP32 input (no weights, no model hub).
MODEL = """
import numpy as np
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class Doubler(MLModel):
    async def load(self) -> bool:
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        data = NumpyCodec.decode_input(payload.inputs[0])
        return InferenceResponse(
            model_name=self.name, outputs=[NumpyCodec.encode_output("doubled", data * 2)]
        )
"""


@pytest.fixture
def manager(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[SlotManager, AgentConfig]]:
    """A manager whose [sandbox] section is the test's ``sandbox`` marker's, if any."""
    marker = request.node.get_closest_marker("sandbox")
    cfg = config_for(tmp_path, "w", marker.kwargs if marker else None)
    with started_manager(cfg) as made:
        yield made, cfg


def wait_for_phase(manager: SlotManager, name: str, phase: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        manager.tick()
        worker = manager.get_slot(name).worker
        assert worker is not None
        if worker.phase == phase:
            return worker.to_json()
        assert worker.phase not in ("failed", "crashloop"), f"{worker}\n{manager.logs(name, 40)}"
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{name} is {worker.phase}, not {phase}: {worker.message}\n{manager.logs(name, 40)}"
            )
        time.sleep(0.1)


def test_an_exec_probe_runs_inside_its_workers_sandbox(manager: tuple[SlotManager, AgentConfig]) -> None:
    """The probe passes only where the worker's private /tmp holds its file and only as the slot's
    uid; run from the agent (the host's /tmp, root) the same command fails."""
    slots, _ = manager
    marker = f"natest{os.getpid()}-ready"
    probe = f"test -f /tmp/{marker} && test $(id -u) -ge 600000 && test $(id -u) -le 665535"
    slot = slots.allocate(
        parse_slot_request(
            {
                "name": "probed",
                "qos": "burstable",
                "resources": {"cpus": 0.2, "memory": "64Mi"},
                "worker": {
                    "command": ["/bin/sh", "-c", f"touch /tmp/{marker}; exec sleep 300"],
                    "readiness": {"exec": {"argv": ["/bin/sh", "-c", probe]}, "period_seconds": 0.2},
                    "stop_grace_seconds": 1,
                },
            }
        )
    ).slot
    assert not Path("/tmp", marker).exists()  # the worker's /tmp is its own
    assert os.system(probe) != 0  # the control: the same check from the agent fails
    worker = wait_for_phase(slots, slot.id, "running", timeout=30)
    assert worker["pid"]
    # Probe after probe ends only its own process group, never the slot it runs in.
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        slots.tick()
        time.sleep(0.1)
    again = slots.get_slot(slot.id).worker
    assert again is not None
    assert (again.phase, again.pid, again.restarts) == ("running", worker["pid"], 0)
    slots.release(slot.id)


ROOT_WORKER = """
echo "pid=$$ ppid=$PPID uid=$(id -u)"
grep -E '^CapEff' /proc/self/status
touch /etc/natest-root-probe 2>/dev/null && echo "root fs writable" || echo "root fs read-only"
touch /tmp/ready
exec sleep 300
"""


@pytest.mark.sandbox(allow_root=True)
def test_an_opted_in_root_worker_is_still_confined(manager: tuple[SlotManager, AgentConfig]) -> None:
    slots, _ = manager
    slot = slots.allocate(
        parse_slot_request(
            {
                "name": "rooted",
                "qos": "burstable",
                "resources": {"cpus": 0.2, "memory": "64Mi"},
                "worker": {
                    "user": "root",
                    "command": ["/bin/sh", "-c", ROOT_WORKER],
                    # Passes only inside the worker's pid namespace (small pids) and its own /tmp.
                    "readiness": {
                        "exec": {"argv": ["/bin/sh", "-c", "test -f /tmp/ready && test $$ -lt 100"]},
                        "period_seconds": 0.2,
                    },
                    "stop_grace_seconds": 1,
                },
            }
        )
    ).slot
    worker = wait_for_phase(slots, slot.id, "running", timeout=30)
    lines = slots.logs(slot.id, 10)
    # The shell is a child of its own namespace's init (dumb-init, PID 1), root there and only there.
    # Its own pid is small but not always 2: an exec probe that joins the namespace before dumb-init
    # has forked takes 2.
    found = [line for line in lines if line.startswith("pid=")]
    assert len(found) == 1, lines
    pid, ppid, uid = (int(part.split("=")[1]) for part in found[0].split())
    assert (ppid, uid) == (1, 0), found
    assert 1 < pid < 100, found
    keep = capability_mask(ROOT_CAPABILITIES)
    assert f"CapEff:\t{keep:016x}" in lines
    assert "root fs read-only" in lines
    assert not Path("/etc/natest-root-probe").exists()
    # On the host the worker's main process is dumb-init, a child of the keeper.
    host_status = Path(f"/proc/{worker['pid']}/status").read_text()
    assert "dumb-init" in Path(f"/proc/{worker['pid']}/cmdline").read_text()
    assert int(host_status.split("CapEff:")[1].split()[0], 16) == keep
    slots.release(slot.id)


@pytest.mark.sandbox(
    allow_named_users=True, allowed_syscalls=["unshare"], allowed_capabilities=["NET_BIND_SERVICE"]
)
def test_named_users_and_opt_outs_take_effect_only_when_asked(
    manager: tuple[SlotManager, AgentConfig],
) -> None:
    slots, _ = manager
    show = (
        "import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
        "caps = [l for l in open('/proc/self/status') if l.startswith('CapEff')][0].split()[1]; "
        "print('uid', os.getuid(), 'caps', caps, 'unshare', libc.unshare(0x10000000), ctypes.get_errno(), "
        "flush=True); "
        "os.execv('/bin/sleep', ['sleep', '300'])"
    )

    def start(name: str, **fields: object) -> list[str]:
        slot = slots.allocate(
            parse_slot_request(
                {
                    "name": name,
                    "qos": "burstable",
                    "resources": {"cpus": 0.1, "memory": "64Mi"},
                    "worker": {"command": [world_python(), "-c", show], "stop_grace_seconds": 1, **fields},
                }
            )
        ).slot
        lines = wait_until_logged(slots, slot.id)
        slots.release(slot.id)
        return lines[0].split()

    # Confined: the slot's uid, no capabilities, unshare(CLONE_NEWUSER) refused by seccomp (EPERM).
    plain = start("plain")
    uid, caps, result, err = int(plain[1]), int(plain[3], 16), int(plain[5]), int(plain[6])
    assert 600000 <= uid <= 665535
    assert (caps, result, err) == (0, -1, 1)
    # The same worker as a named host user, keeping NET_BIND_SERVICE, allowed unshare.
    opened = start(
        "opened",
        user="nobody",
        sandbox={"allow_syscalls": ["unshare"], "capabilities": ["NET_BIND_SERVICE"]},
    )
    uid, caps, result = int(opened[1]), int(opened[3], 16), int(opened[5])
    assert uid == 65534
    assert caps == 1 << 10  # CAP_NET_BIND_SERVICE, nothing else
    if SUPPORT.user_namespaces:
        assert result == 0  # the filter let it through, and an unprivileged user may make a user namespace


def wait_until_logged(slots: SlotManager, slot_id: str, timeout: float = 20) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(NotFound):  # the keeper makes the log once it takes custody
            if lines := slots.logs(slot_id, 10):
                return lines
        assert time.monotonic() < deadline, f"{slot_id} printed nothing: {slots.get_slot(slot_id).worker}"
        time.sleep(0.05)


@pytest.fixture(scope="session")
def mlserver() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix=f"natest{os.getpid()}-mlserver-", dir="/var/tmp"))
    base.chmod(0o755)
    try:
        make_venv(base / "venv", [MLSERVER])
        models = base / "models" / "doubler"
        models.mkdir(parents=True)
        (models / "doubler_model.py").write_text(MODEL)
        (models / "model-settings.json").write_text(
            json.dumps({"name": "doubler", "implementation": "doubler_model.Doubler"})
        )
        for path in (base / "models", models, *models.iterdir()):
            path.chmod(0o755 if path.is_dir() else 0o644)
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_mlserver_serves_sandboxed(manager: tuple[SlotManager, AgentConfig], mlserver: Path) -> None:
    slots, _ = manager
    assert world_python()  # the venv's interpreter is one the slot's uid can run
    http, grpc, metrics = free_port(), free_port(), free_port()
    models = mlserver / "models"
    (models / "settings.json").write_text(
        json.dumps({"http_port": http, "grpc_port": grpc, "metrics_port": metrics, "parallel_workers": 0})
    )
    (models / "settings.json").chmod(0o644)
    slot = slots.allocate(
        parse_slot_request(
            {
                "name": "mlserver",
                "qos": "guaranteed",
                "resources": {"cpus": 1, "memory": "1Gi"},
                "worker": {
                    "command": [str(mlserver / "venv" / "bin" / "mlserver"), "start", str(models)],
                    "readiness": {
                        "http": {"port": http, "path": "/v2/models/doubler/ready"},
                        "period_seconds": 0.5,
                    },
                    "startup_timeout_seconds": 240,
                    "stop_grace_seconds": 5,
                },
            }
        )
    ).slot
    worker = wait_for_phase(slots, slot.id, "running", timeout=240)
    status = Path(f"/proc/{worker['pid']}/status").read_text()
    uid = int(status.split("Uid:")[1].split()[0])
    assert 600000 <= uid <= 665535, f"mlserver runs as uid {uid}"
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1.0, 2.5, -4.0]}]}
    answer = httpx.post(f"http://127.0.0.1:{http}/v2/models/doubler/infer", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"][0]["data"] == [2.0, 5.0, -8.0]
    slots.release(slot.id)


def test_a_program_or_argument_under_the_hosts_tmp_is_refused_at_submit_naming_it(
    manager: tuple[SlotManager, AgentConfig],
) -> None:
    """The sandbox gives the slot its own /tmp: a program or a script in the host's is not there,
    and the request is refused naming it rather than failing at every start."""
    slots, _ = manager
    program = Path(tempfile.mkdtemp(prefix=f"natest{os.getpid()}-", dir="/tmp")) / "serve"
    try:
        program.parent.chmod(0o755)
        shutil.copy("/bin/true", program)
        program.chmod(0o755)
        for command, named in (
            ([str(program)], f"the program {str(program)!r}"),
            (["/bin/sh", str(program)], f"the argument 1 {str(program)!r}"),
            (["/bin/true", f"--config={program}"], f"names {program}"),
        ):
            request = {
                "name": "in-tmp",
                "qos": "burstable",
                "resources": {"cpus": 0.2, "memory": "64Mi"},
                "worker": {"command": command, "restart": "never"},
            }
            with pytest.raises(InvalidRequest) as refused:
                slots.allocate(parse_slot_request(request))
            assert named in str(refused.value)
            assert "own /tmp" in str(refused.value)
        assert slots.list_slots() == []
    finally:
        shutil.rmtree(program.parent, ignore_errors=True)


FILLER = """
tag={tag}
fill() {{ dd if=/dev/zero of="$1" bs=65536 count=400 2>&1 | grep -q "No space left" && echo "$2=ENOSPC"; }}
fill "$HOME/fill" home
fill "$TMPDIR/fill" tmpdir
fill /var/tmp/$tag vartmp
echo x > /run/lock/$tag && echo "runlock=written"
echo "staged=$(cat /var/tmp/$tag-staged)"
echo "home=$HOME tmpdir=$TMPDIR"
touch /tmp/ready
exec sleep 300
"""


def test_a_worker_filling_its_home_and_temporary_places_meets_its_own_limits(
    manager: tuple[SlotManager, AgentConfig],
) -> None:
    """HOME, TMPDIR, /var/tmp and /run/lock are the slot's own tmpfs (charged to its memory
    cgroup), not the agent's state file system or the host's shared directories: a worker writing
    past them gets ENOSPC, the host sees none of it, and the agent goes on allocating."""
    slots, cfg = manager
    tag = f"natest{os.getpid()}-fill"
    staged = Path("/var/tmp", f"{tag}-staged")  # what the host puts in /var/tmp stays readable
    staged.write_text("yes\n")
    staged.chmod(0o644)
    try:
        _fill(slots, cfg, tag)
    finally:
        staged.unlink()


def _fill(slots: SlotManager, cfg: AgentConfig, tag: str) -> None:
    slot = slots.allocate(
        parse_slot_request(
            {
                "name": "filler",
                "qos": "burstable",
                "resources": {"cpus": 0.2, "memory": "128Mi"},
                "worker": {
                    "command": ["/bin/sh", "-c", FILLER.format(tag=tag)],
                    "readiness": {"exec": {"argv": ["test", "-f", "/tmp/ready"]}, "period_seconds": 0.2},
                    "sandbox": {"home_size": "4Mi", "tmp_size": "8Mi"},
                    "stop_grace_seconds": 1,
                },
            }
        )
    ).slot
    wait_for_phase(slots, slot.id, "running", timeout=30)
    said = "\n".join(slots.logs(slot.id, 20))
    for place in ("home", "tmpdir", "vartmp"):
        assert f"{place}=ENOSPC" in said, said
    if os.path.isdir("/run/lock"):  # a host without one gets none in the slot either
        assert "runlock=written" in said, said
    assert "staged=yes" in said, said
    assert not Path("/var/tmp", tag).exists()
    assert not Path("/run/lock", tag).exists()
    # Short paths inside its own /tmp (unix sockets below them fit in 108 bytes); on the state
    # file system only the mount point of the private /tmp's view, empty.
    assert "home=/tmp/home tmpdir=/tmp" in said, said
    view = cfg.state_dir / "workers" / slot.id / "view"
    assert not (view / "home").exists()
    assert list((view / "tmp").iterdir()) == []
    other = slots.allocate(
        parse_slot_request(
            {"name": "after", "qos": "burstable", "resources": {"cpus": 0.1, "memory": "32Mi"}}
        )
    ).slot
    slots.release(other.id)
    slots.release(slot.id)
