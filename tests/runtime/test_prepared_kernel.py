"""Worker children that build the default sandbox's request-independent part before their request
(runtime/sandbox: Prepared): what the worker gets is the sandbox it would have had without, the
child serves no other request, and the host's mounts made while it waited are the worker's view."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent.runtime.keeper_client import PID_NAMESPACE, PLAIN, PREPARED, KeeperClient, child_kind
from nodeagent.runtime.process import ProcessIdentity
from nodeagent.runtime.sandbox import SandboxSpec
from nodeagent.runtime.sandbox.mounts import MNT_DETACH, MS_PRIVATE, MS_SHARED, mount, umount
from nodeagent.runtime.sandbox.spec import Exposed
from tests.runtime.conftest import current_keeper, kill, make_request, stop_test_keeper, wait_gone, wait_until
from tests.runtime.sandbox.test_mounts_kernel import SAFE_DEV  # the /dev every sandbox has
from tests.runtime.slotcg import V1Slot

NOBODY = 65534
SPEC = SandboxSpec(uid=NOBODY, gid=NOBODY)


def sandboxed(
    tmp_path: Path, slot: V1Slot, argv: list[str], spec: SandboxSpec = SPEC, **extra: object
) -> object:
    return make_request(
        tmp_path, slot, argv, uid=spec.uid, gid=spec.gid, groups=spec.groups, sandbox=spec, **extra
    )


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {key: value.strip() for key, _, value in (line.partition(":") for line in lines)}


def _mountinfo(pid: int) -> list[list[str]]:
    return [line.split() for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()]


def _fstype(entry: list[str]) -> str:
    return entry[entry.index("-") + 1]


def _holds_only_stdio(pid: int) -> None:
    # Once sleep has started up (its C library may hold a file open for a moment at start).
    fds = f"/proc/{pid}/fd"
    wait_until(f"worker {pid} to hold only its stdio", lambda: sorted(os.listdir(fds)) == ["0", "1", "2"])


def _launch(keeper: KeeperClient, req: object, workers: list[ProcessIdentity]) -> int:
    worker = keeper.launch(req)  # type: ignore[arg-type]
    workers.append(worker.identity)
    return worker.identity.pid


def _keep_prepared_children(tmp_path: Path, slot: V1Slot, keeper: KeeperClient) -> list[ProcessIdentity]:
    """The client keeps prepared children from the first launch that takes one; wait for them."""
    # Its exit must not end the slot: the test's own worker goes there next.
    keeper.launch(sandboxed(tmp_path, slot, ["/bin/true"], end_slot_on_exit=False)).close()
    return keeper.idle_children(PREPARED)


def test_which_requests_take_a_prepared_child(tmp_path):
    assert child_kind(make_request(tmp_path, None, ["x"], sandbox=SPEC)) == PREPARED
    assert child_kind(make_request(tmp_path, None, ["x"])) == PLAIN  # no sandbox
    assert child_kind(make_request(tmp_path, None, ["x"], sandbox=SPEC, join=(1, 1))) == PLAIN  # exec probe
    keeps = SandboxSpec(uid=NOBODY, gid=NOBODY, capabilities=("NET_BIND_SERVICE",))
    assert child_kind(make_request(tmp_path, None, ["x"], sandbox=keeps)) == PLAIN  # its bounding set
    in_dev = SandboxSpec(uid=NOBODY, gid=NOBODY, hide_paths=("/dev/x",), expose=(Exposed("/dev/x/y"),))
    assert child_kind(make_request(tmp_path, None, ["x"], sandbox=in_dev)) == PLAIN  # covered ahead
    cgroup_ns = SandboxSpec(
        uid=NOBODY, gid=NOBODY, namespaces=("mount", "ipc", "uts", "cgroup"), cgroup_view="namespace"
    )
    assert child_kind(make_request(tmp_path, None, ["x"], sandbox=cgroup_ns)) == PLAIN
    root = SandboxSpec(
        uid=0, gid=0, namespaces=("mount", "pid", "ipc", "uts"), read_only_root=True, init="/x"
    )
    assert child_kind(make_request(tmp_path, None, ["x"], sandbox=root)) == PID_NAMESPACE


@pytest.mark.root
def test_a_prepared_child_gives_the_worker_the_whole_default_sandbox(tmp_path, slot, keeper, kill_workers):
    first = _keep_prepared_children(tmp_path, slot, keeper)[0]
    pid = _launch(keeper, sandboxed(tmp_path, slot, ["sleep", "60"]), kill_workers)
    assert pid == first.pid
    host_keeper = current_keeper(tmp_path / "keeper")
    for ns in ("mnt", "ipc", "uts"):
        assert os.readlink(f"/proc/{pid}/ns/{ns}") != os.readlink(f"/proc/{host_keeper.pid}/ns/{ns}")
    assert os.readlink(f"/proc/{pid}/ns/net") == os.readlink(f"/proc/{host_keeper.pid}/ns/net")
    status = _status(pid)
    assert (status["Uid"].split()[0], status["CapBnd"], status["CapEff"], status["CapPrm"]) == (
        str(NOBODY),
        "0" * 16,
        "0" * 16,
        "0" * 16,
    )
    assert (status["NoNewPrivs"], status["Seccomp"]) == ("1", "2")
    # Only its stdio: no descriptor the preparation held (the host's root, namespaces, mounts).
    _holds_only_stdio(pid)
    assert f":pids:/{slot.name}\n" in Path(f"/proc/{pid}/cgroup").read_text()
    mountinfo = _mountinfo(pid)
    # Propagation cut: no mount shares events with the host's (or receives them) any more.
    assert not [m for m in mountinfo if any(tag.startswith(("shared:", "master:")) for tag in m[6:])]
    by_point = {m[4]: m for m in mountinfo}
    assert _fstype(by_point["/proc"]) == "proc"
    assert "hidepid=invisible" in by_point["/proc"][-1]
    assert _fstype(by_point["/dev"]) == "tmpfs"
    cgroupfs = [m for m in mountinfo if m[4] == "/sys/fs/cgroup" or m[4].startswith("/sys/fs/cgroup/")]
    assert cgroupfs
    assert all("ro" in m[5].split(",") for m in cgroupfs)
    assert set(os.listdir(f"/proc/{pid}/root/dev")) == SAFE_DEV
    assert {"/tmp", "/dev/shm"} <= set(by_point)


@pytest.mark.root
def test_an_unsandboxed_worker_never_takes_a_prepared_child(tmp_path, slot, keeper, kill_workers):
    prepared = set(_keep_prepared_children(tmp_path, slot, keeper))
    pid = _launch(keeper, make_request(tmp_path, slot, ["sleep", "60"]), kill_workers)
    assert ProcessIdentity(pid, kill_workers[-1].start_time) not in prepared
    host_keeper = current_keeper(tmp_path / "keeper")
    for ns in ("mnt", "ipc", "uts"):
        assert os.readlink(f"/proc/{pid}/ns/{ns}") == os.readlink(f"/proc/{host_keeper.pid}/ns/{ns}")
    assert _status(pid)["CapBnd"] != "0" * 16


@pytest.mark.root
def test_at_rest_only_a_child_of_the_last_launchs_kind_is_kept(tmp_path, slot, kill_workers):
    """A sandboxed host's launches all take prepared children: at rest its plain ones go too (each
    megabytes of PSS), and a plain launch after that pays a fork, then fills its kind up again."""
    client = KeeperClient(tmp_path / "keeper", rest_after=0.5)
    try:
        client.connect()
        plain = client.idle_children(PLAIN)
        assert len(plain) == 2
        assert len(_keep_prepared_children(tmp_path, slot, client)) == 2
        wait_until("the rest", lambda: len(client.idle_children(PREPARED)) == 1)
        assert client.idle_children(PLAIN) == []
        for gone in plain:
            assert wait_gone(gone)
        pid = _launch(client, make_request(tmp_path, slot, ["sleep", "60"]), kill_workers)
        assert ProcessIdentity(pid, kill_workers[-1].start_time) not in plain
        assert len(client.idle_children(PLAIN)) == 2
    finally:
        stop_test_keeper(tmp_path / "keeper", client)


@pytest.mark.root
def test_a_prepared_child_refuses_a_request_it_was_not_prepared_for(tmp_path, slot, keeper):
    _keep_prepared_children(tmp_path, slot, keeper)
    armed = keeper._take_armed(PREPARED)  # what a client sending it the wrong request would hold
    try:
        report = armed.fire(json.dumps(make_request(tmp_path, slot, ["/bin/true"]).to_json()).encode())
        assert report.startswith(b"take a child prepared for the default sandbox\0")
        assert wait_gone(armed.identity)
    finally:
        armed.close()
    assert slot.pids() == []  # nothing ran in the slot


@contextlib.contextmanager
def _host_tmpfs(path: Path, *, propagation: int = 0) -> Iterator[Path]:
    """A tmpfs of the test's own on ``path`` on the host, with a marker file; gone afterwards."""
    path.mkdir()
    try:
        mount("tmpfs", str(path), "tmpfs", 0, "size=64k,mode=0755")
        try:
            if propagation:
                mount(None, str(path), None, propagation)
            (path / "marker").write_text("here\n")
            yield path
        finally:
            umount(str(path), MNT_DETACH)
    finally:
        path.rmdir()


@pytest.mark.root
def test_host_mounts_made_while_the_child_waited_are_in_the_workers_view(
    tmp_path, slot, keeper, kill_workers
):
    # A shared mount of the test's own (as systemd makes / on most hosts): what is mounted under it
    # reaches the copies in other namespaces, the prepared view's among them.
    with _host_tmpfs(Path(f"/run/natest{os.getpid()}-shared"), propagation=MS_SHARED) as shared:
        _keep_prepared_children(tmp_path, slot, keeper)
        time.sleep(0.1)  # the idle children have prepared (their views are copies from before now)
        with _host_tmpfs(shared / "early") as early:
            pid = _launch(keeper, sandboxed(tmp_path, slot, ["sleep", "60"]), kill_workers)
            assert Path(f"/proc/{pid}/root{early}/marker").read_text() == "here\n"
            with _host_tmpfs(shared / "later") as later:
                assert not Path(f"/proc/{pid}/root{later}/marker").exists()  # none after the launch
            kill(kill_workers[-1])
            assert wait_gone(kill_workers[-1])


@pytest.mark.root
def test_a_host_mount_that_does_not_propagate_makes_the_child_build_its_view_afresh(
    tmp_path, slot, keeper, kill_workers
):
    with _host_tmpfs(Path(f"/run/natest{os.getpid()}-private"), propagation=MS_PRIVATE) as private:
        _keep_prepared_children(tmp_path, slot, keeper)
        time.sleep(0.1)  # prepared with a copy of the private mount, which hears nothing more
        with _host_tmpfs(private / "sub") as sub:
            pid = _launch(keeper, sandboxed(tmp_path, slot, ["sleep", "60"]), kill_workers)
            wait_until("the worker's exec", lambda: Path(f"/proc/{pid}/exe").resolve().name == "sleep")
            assert Path(f"/proc/{pid}/root{sub}/marker").read_text() == "here\n"
            status = _status(pid)
            assert (status["CapBnd"], status["NoNewPrivs"], status["Seccomp"]) == ("0" * 16, "1", "2")
            _holds_only_stdio(pid)
            kill(kill_workers[-1])
            assert wait_gone(kill_workers[-1])


def _tmpfs_size(mountinfo: list[list[str]], point: str) -> str | None:
    """The size option of the tmpfs last mounted at ``point`` in the worker's view (None: none)."""
    on_top = [m for m in mountinfo if m[4] == point]
    if not on_top or _fstype(on_top[-1]) != "tmpfs":
        return None
    return next((o for o in on_top[-1][-1].split(",") if o.startswith("size=")), None)


@pytest.mark.root
@pytest.mark.parametrize(
    "sizes",
    [(256 << 20, 64 << 20), (8 << 20, 4 << 20), (None, None)],
    ids=["the-prepared-sizes", "other-sizes", "the-hosts"],
)
def test_the_prepared_tmp_and_shm_become_what_the_request_asks(tmp_path, slot, keeper, kill_workers, sizes):
    # The prepared child mounted a /tmp and a /dev/shm of the default sizes while it waited.
    tmp_bytes, shm_bytes = sizes
    spec = SandboxSpec(uid=NOBODY, gid=NOBODY, tmp_bytes=tmp_bytes, shm_bytes=shm_bytes)
    prepared = set(_keep_prepared_children(tmp_path, slot, keeper))
    pid = _launch(keeper, sandboxed(tmp_path, slot, ["sleep", "60"], spec), kill_workers)
    assert ProcessIdentity(pid, kill_workers[-1].start_time) in prepared
    wait_until("the worker's exec", lambda: Path(f"/proc/{pid}/exe").resolve().name == "sleep")
    mountinfo = _mountinfo(pid)
    for point, size in (("/tmp", tmp_bytes), ("/dev/shm", shm_bytes)):
        if size is not None:
            assert _tmpfs_size(mountinfo, point) == f"size={size // 1024}k"
    root = f"/proc/{pid}/root"
    if tmp_bytes is None:  # the host's /tmp, with what the test left there
        assert os.stat(f"{root}/tmp").st_dev == os.stat("/tmp").st_dev
        assert Path(f"{root}{tmp_path}").is_dir()
    if shm_bytes is None:  # the private /dev's empty directory, as without preparation
        assert os.stat(f"{root}/dev/shm").st_dev == os.stat(f"{root}/dev").st_dev
        assert os.listdir(f"{root}/dev/shm") == []


@pytest.mark.root
def test_a_path_shown_again_from_the_hosts_tmp_is_opened_before_the_private_tmp_covers_it(
    tmp_path, slot, keeper, kill_workers
):
    assert str(tmp_path).startswith("/tmp/")  # pytest's base directory: the host's /tmp
    hidden = tmp_path / "state"
    (hidden / "view").mkdir(parents=True)
    (hidden / "view" / "slot.json").write_text("the slot's\n")
    spec = SandboxSpec(
        uid=NOBODY, gid=NOBODY, hide_paths=(str(hidden),), expose=(Exposed(str(hidden / "view")),)
    )
    prepared = set(_keep_prepared_children(tmp_path, slot, keeper))
    pid = _launch(keeper, sandboxed(tmp_path, slot, ["sleep", "60"], spec), kill_workers)
    assert ProcessIdentity(pid, kill_workers[-1].start_time) in prepared
    wait_until("the worker's exec", lambda: Path(f"/proc/{pid}/exe").resolve().name == "sleep")
    root = f"/proc/{pid}/root"
    # Shown again inside the worker's own /tmp, where the private /tmp left its place (as built
    # without preparation); the rest of the host's /tmp is not there.
    assert Path(f"{root}{hidden}/view/slot.json").read_text() == "the slot's\n"
    assert _tmpfs_size(_mountinfo(pid), "/tmp") == f"size={(256 << 20) // 1024}k"
    assert not Path(f"{root}{tmp_path}/run").exists()
