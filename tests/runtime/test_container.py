"""Container workers: the podman command line (pure) and the checks before a launch."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from nodeagent.errors import InvalidRequest, WorkerError
from nodeagent.runtime.container import (
    ContainerLauncher,
    PodmanConfig,
    container_launch_spec,
    container_name,
    default_runtime,
    exec_argv,
    run_argv,
)
from nodeagent.runtime.launch_request import LaunchRequest
from nodeagent.runtime.sandbox.spec import DEFAULT_NAMESPACES, SandboxSpec
from nodeagent.runtime.supervisor import WorkerHandle
from nodeagent.schema.worker import WorkerSpec, parse_worker_spec

SPEC = parse_worker_spec(
    {
        "container": {
            "image": "localhost/oip:1",
            "command": ["/bin/server"],
            "args": ["--port", "8011"],
            "read_only": True,
            "mounts": [
                {"source": "/srv/models", "target": "/models"},
                {"source": "/srv/out", "target": "/out", "read_only": False},
            ],
        },
        "env": {"MODEL": "mlp"},
        "workdir": "/models",
        "rlimits": {"nofile": [1024, 2048]},
        "umask": 0o027,
    }
)
CONFIG = PodmanConfig(runtime="runc")
SANDBOX = SandboxSpec(uid=600001, gid=600001, capabilities=("NET_BIND_SERVICE",), shm_bytes=64 << 20)


def argv(spec: WorkerSpec = SPEC, **overrides: object) -> list[str]:
    assert spec.container is not None
    kwargs: dict[str, object] = {
        "slot_id": "s0123456789ab",
        "cgroup": "nodeagent.slice/guaranteed/s0123456789ab",
        "sandbox": SANDBOX,
        "init": "/usr/bin/catatonit",
        "ulimits": {"nofile": (20000, 20000), "nproc": (32768, 32768)},
    }
    kwargs.update(overrides)
    return list(run_argv("/usr/bin/podman", CONFIG, spec, spec.container, **kwargs))  # type: ignore[arg-type]


def test_the_container_lands_below_the_slot_with_its_devices_network_and_identity() -> None:
    line = argv()
    assert line[:5] == ["/usr/bin/podman", "--cgroup-manager=cgroupfs", "--runtime=runc", "run", "--rm"]
    assert "--replace" in line
    assert "--name=nodeagent-s0123456789ab" in line
    assert "--cgroup-parent=/nodeagent.slice/guaranteed/s0123456789ab" in line
    assert "--device=nodeagent.io/slot=s0123456789ab" in line
    assert "--network=host" in line  # the netns podman runs in: the slot's when it has one
    assert "--pull=never" in line
    assert line[line.index("--init") : line.index("--init") + 2] == [
        "--init",
        "--init-path=/usr/bin/catatonit",
    ]
    # The sandbox's identity and capabilities, no more.
    assert "--user=600001:600001" in line
    assert "--cap-drop=all" in line
    assert "--cap-add=NET_BIND_SERVICE" in line
    assert "--security-opt=no-new-privileges" in line
    assert f"--shm-size={64 << 20}" in line
    # The spec's limits win over the defaults; the others stay.
    assert "--ulimit=nofile=1024:2048" in line
    assert "--ulimit=nproc=32768:32768" in line
    assert "--umask=0027" in line
    assert "--read-only" in line
    assert "--volume=/srv/models:/models:ro" in line
    assert "--volume=/srv/out:/out:rw" in line
    assert "--workdir=/models" in line
    assert "--env=MODEL=mlp" in line
    # Entrypoint, image, then its arguments, last.
    assert line[-4:] == ['--entrypoint=["/bin/server"]', "localhost/oip:1", "--port", "8011"]


def test_without_sandbox_or_cgroup() -> None:
    spec = parse_worker_spec({"container": {"image": "busybox"}})
    line = argv(spec, sandbox=None, cgroup=None, init=None)
    assert not [a for a in line if a.startswith(("--user", "--cap-", "--cgroup-parent", "--init"))]
    assert line[-1] == "busybox"


def test_a_mount_that_became_a_link_to_a_hidden_path_is_refused_at_launch(tmp_path: Path) -> None:
    # Checked at submit; a link swapped in later is caught again when the command line is built.
    state = tmp_path / "state"
    state.mkdir()
    (tmp_path / "models").symlink_to(state)
    spec = parse_worker_spec(
        {"container": {"image": "busybox", "mounts": [{"source": f"{tmp_path}/models", "target": "/m"}]}}
    )
    hiding = SandboxSpec(uid=600001, gid=600001, hide_paths=(str(state),))
    with pytest.raises(InvalidRequest, match=r"mounts\[0\]\.source .* is '.*/state'"):
        argv(spec, sandbox=hiding)


def test_the_launch_path_runs_podman_as_root_with_nothing_of_the_worker() -> None:
    launched = container_launch_spec(SPEC, ("/usr/bin/podman", "run", "x"))
    assert launched.command == ("/usr/bin/podman", "run", "x")
    assert (launched.container, launched.env, launched.user, launched.workdir, launched.rlimits) == (
        None,
        {},
        None,
        None,
        {},
    )
    assert launched.readiness == SPEC.readiness


def test_exec_probes_and_names() -> None:
    assert exec_argv("podman", CONFIG, "s1", ("cat", "/ready")) == (
        "podman",
        "--cgroup-manager=cgroupfs",
        "--runtime=runc",
        "exec",
        "nodeagent-s1",
        "cat",
        "/ready",
    )
    assert container_name("s1") == "nodeagent-s1"
    assert default_runtime(True) == "runc"  # crun refuses hybrid hosts
    assert default_runtime(False) == ""


class RecordingKeeper:
    def __init__(self) -> None:
        self.launched: list[LaunchRequest] = []

    def launch(self, req: LaunchRequest) -> WorkerHandle:
        self.launched.append(req)
        raise WorkerError("recorded")


REQ = LaunchRequest(
    launch_id="s1-1", argv=("podman",), env={}, run_dir="/nonexistent/run", log_dir="/nonexistent/logs"
)


def fake_podman(tmp_path: Path, exit_code: int, stderr: str = "") -> str:
    script = tmp_path / "podman"
    script.write_text(f"#!/bin/sh\necho '{stderr}' >&2\nexit {exit_code}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def test_no_podman_fails_the_launch_with_what_to_do() -> None:
    keeper = RecordingKeeper()
    with pytest.raises(WorkerError, match=r"podman on PATH not found; install podman"):
        ContainerLauncher(keeper, None, PodmanConfig(), "localhost/x:1").launch(REQ)
    assert keeper.launched == []


def test_a_missing_image_fails_the_launch_and_says_it_is_never_pulled(tmp_path: Path) -> None:
    keeper = RecordingKeeper()
    launcher = ContainerLauncher(keeper, fake_podman(tmp_path, 1), CONFIG, "localhost/absent:1")
    with pytest.raises(WorkerError, match=r"'localhost/absent:1' is not in this host's local storage"):
        launcher.launch(REQ)
    assert keeper.launched == []


def test_a_present_image_goes_on_to_the_keeper(tmp_path: Path) -> None:
    keeper = RecordingKeeper()
    with pytest.raises(WorkerError, match="recorded"):
        ContainerLauncher(keeper, fake_podman(tmp_path, 0), CONFIG, "localhost/x:1").launch(REQ)
    assert keeper.launched == [REQ]
    broken = ContainerLauncher(keeper, fake_podman(tmp_path, 125, "database locked"), CONFIG, "localhost/x:1")
    with pytest.raises(WorkerError, match="database locked"):
        broken.launch(REQ)


def test_podman_config_finds_its_binary(tmp_path: Path) -> None:
    assert PodmanConfig(podman=str(tmp_path / "absent")).binary() is None
    exe = fake_podman(tmp_path, 0)
    assert PodmanConfig(podman=exe).binary() == exe
    assert os.path.basename(PodmanConfig(podman=exe).global_args()[0]) == "--cgroup-manager=cgroupfs"


def test_v1_oom_kills_below_the_slot_count_for_the_slot(tmp_path: Path) -> None:
    from nodeagent.runtime.process import read_oom_kills

    slot = tmp_path / "slot"
    (slot / "libpod-abc").mkdir(parents=True)
    (slot / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    (slot / "libpod-abc" / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    assert read_oom_kills(str(slot / "memory.oom_control")) == 3
    # v2's memory.events counts its descendants already: read as it is.
    (slot / "memory.events").write_text("oom 1\noom_kill 4\n")
    (slot / "libpod-abc" / "memory.events").write_text("oom 1\noom_kill 4\n")
    assert read_oom_kills(str(slot / "memory.events")) == 4


def test_a_host_that_cannot_run_containers_says_why_at_launch() -> None:
    keeper = RecordingKeeper()
    config = PodmanConfig(unsupported="not supported on a pure cgroup v2 host yet")
    with pytest.raises(WorkerError, match="container worker: not supported on a pure cgroup v2 host yet"):
        ContainerLauncher(keeper, "/usr/bin/podman", config, "localhost/x:1").launch(REQ)
    assert keeper.launched == []


def test_a_root_sandbox_keeps_its_read_only_root_in_a_container() -> None:
    spec = parse_worker_spec({"container": {"image": "busybox"}})
    root = SandboxSpec(
        uid=0,
        gid=0,
        capabilities=("CHOWN",),
        read_only_root=True,
        namespaces=(*DEFAULT_NAMESPACES, "pid"),
        init="/usr/bin/dumb-init",
    )
    line = argv(spec, sandbox=root)
    assert "--read-only" in line
    assert "--user=0:0" in line
    assert "--cap-add=CHOWN" in line


def test_v2_the_slot_is_prepared_before_the_launch_and_a_failure_says_why(tmp_path: Path) -> None:
    from nodeagent.errors import CgroupError

    keeper = RecordingKeeper()
    made: list[str] = []
    launcher = ContainerLauncher(
        keeper, fake_podman(tmp_path, 0), CONFIG, "localhost/x:1", prepare=lambda: made.append("leaves")
    )
    with pytest.raises(WorkerError, match="recorded"):
        launcher.launch(REQ)
    assert made == ["leaves"]
    assert keeper.launched == [REQ]

    def busy() -> None:
        raise CgroupError("write cgroup.subtree_control: Device or resource busy")

    podman = fake_podman(tmp_path, 0)
    refused = ContainerLauncher(RecordingKeeper(), podman, CONFIG, "localhost/x:1", prepare=busy)
    with pytest.raises(WorkerError, match=r"cannot make the slot's child cgroups: .*busy"):
        refused.launch(REQ)


def test_a_cgroup_leaf_is_joined_instead_of_the_slot_and_travels_only_when_set() -> None:
    from nodeagent.runtime.launch_request import joined_procs

    procs = ("/sys/fs/cgroup/a.slice/s1/cgroup.procs",)
    plain = LaunchRequest(launch_id="s1", argv=("x",), env={}, run_dir="/r", log_dir="/l", cgroup_procs=procs)
    assert "cgroup_leaf" not in plain.to_json()  # a keeper older than the field reads it unchanged
    assert joined_procs(plain) == procs
    leaf = LaunchRequest.from_json({**plain.to_json(), "cgroup_leaf": "worker"})
    assert leaf.cgroup_procs == procs  # the keeper still ends the whole slot's tree
    assert joined_procs(leaf) == ("/sys/fs/cgroup/a.slice/s1/worker/cgroup.procs",)
    assert LaunchRequest.from_json(leaf.to_json()) == leaf
