"""The worker's file-system view on the real kernel: private /tmp, /dev/shm and /dev, hidden
paths, a read-only or namespaced /sys/fs/cgroup, a read-only root and HOME. Each protection has a
control: the same attempt without it works."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import signal
import stat
import time
from pathlib import Path

import pytest

from nodeagent.runtime.sandbox import (
    DeviceNode,
    Exposed,
    SandboxSpec,
    SandboxStepError,
    enter_sandbox,
    mounts,
)
from tests.runtime.sandbox.child import (
    NOBODY,
    Child,
    check_private_places,
    in_child,
    os_error_of,
    python,
    run,
    start,
)

pytestmark = pytest.mark.root

SAFE_DEV = {
    "null",
    "zero",
    "full",
    "random",
    "urandom",
    "tty",
    "ptmx",
    "pts",
    "shm",
    "fd",
    "stdin",
    "stdout",
    "stderr",
}
CGROUP = Path("/sys/fs/cgroup")


def confined(**fields: object) -> SandboxSpec:
    base: dict[str, object] = {"uid": NOBODY, "gid": NOBODY}
    base.update(fields)
    return SandboxSpec(**base)  # type: ignore[arg-type]


def _name() -> str:
    return f"natest{os.getpid()}-{time.monotonic_ns()}"


WRITE_AND_WAIT = """
import os, sys, time
name = sys.argv[1]
for where in ("/tmp", "/dev/shm"):
    with open(f"{where}/{name}", "w") as f:
        f.write("x" * 4096)
print("written", flush=True)
time.sleep(60)
"""


def test_tmp_and_shm_are_private_and_vanish_when_the_worker_is_killed(sandboxed: list[Child]):
    name = _name()
    child = start(confined(), [*python(WRITE_AND_WAIT), name])
    sandboxed.append(child)
    child.wait_for_output("written")
    inside = Path(f"/proc/{child.pid}/root")
    # The files exist, but only in the worker's own mount namespace.
    assert (inside / "tmp" / name).stat().st_size == 4096
    assert (inside / "dev/shm" / name).stat().st_size == 4096
    assert not Path("/tmp", name).exists()
    assert not Path("/dev/shm", name).exists()
    os.kill(child.pid, signal.SIGKILL)
    assert child.wait().returncode == -signal.SIGKILL
    assert not Path(f"/proc/{child.pid}").exists()
    assert not Path("/tmp", name).exists()
    assert not Path("/dev/shm", name).exists()


def test_control_without_sandbox_the_files_land_on_the_host():
    name = _name()
    code = WRITE_AND_WAIT.replace("time.sleep(60)", "")
    try:
        finished = run(None, [*python(code), name], user=NOBODY)
        assert "written" in finished.output
        assert Path("/tmp", name).exists()
        assert Path("/dev/shm", name).exists()
    finally:
        for where in ("/tmp", "/dev/shm"):
            with contextlib.suppress(FileNotFoundError):
                Path(where, name).unlink()


def test_private_tmp_is_size_limited():
    code = "open('/tmp/big', 'wb').write(b'x' * (2 << 20))"
    finished = run(confined(tmp_bytes=1 << 20), python(code))
    assert finished.returncode == 1
    assert "No space left on device" in finished.output


LIST_DEV = """
import json, os, stat
def describe(path):
    info = os.lstat(path)
    rdev = info.st_rdev
    mode = info.st_mode
    return [stat.S_IFMT(mode), os.major(rdev), os.minor(rdev), stat.S_IMODE(mode), info.st_uid]
with open("/dev/natest0", "w") as slot_device:
    slot_device.write("x")
print(json.dumps({
    "names": sorted(os.listdir("/dev")),
    "natest0": describe("/dev/natest0"),
    "null": describe("/dev/null"),
    "kmsg": os.path.exists("/dev/kmsg"),
    "vda": os.path.exists("/dev/vda"),
    "pty": os.openpty() is not None,
}))
"""


def test_dev_holds_only_the_safe_nodes_and_the_slots_device():
    slot_device = DeviceNode("/dev/natest0", "c", 1, 3, mode=0o600, uid=NOBODY, gid=NOBODY)
    finished = run(confined(devices=(slot_device,)), python(LIST_DEV))
    assert finished.returncode == 0, finished.output
    seen = json.loads(finished.output)
    assert set(seen["names"]) == SAFE_DEV | {"natest0"}
    assert seen["natest0"] == [stat.S_IFCHR, 1, 3, 0o600, NOBODY]
    assert seen["null"] == [stat.S_IFCHR, 1, 3, 0o666, 0]
    assert seen["kmsg"] is False
    assert seen["vda"] is False
    assert seen["pty"] is True


def test_control_host_dev_has_the_nodes_the_sandbox_leaves_out():
    assert Path("/dev/kmsg").exists()
    assert len(os.listdir("/dev")) > len(SAFE_DEV) + 1


@pytest.fixture
def devices_cgroup_without_mknod():
    """A v1 devices cgroup that allows read/write on the safe nodes but never mknod, like a slot's."""
    root = CGROUP / "devices"
    if not (root / "devices.allow").exists():
        pytest.skip("needs the cgroup v1 devices controller")
    made = root / _name()
    made.mkdir()
    (made / "devices.deny").write_text("a")
    for rule in (
        "c 1:3 rw",
        "c 1:5 rw",
        "c 1:7 rw",
        "c 1:8 rw",
        "c 1:9 rw",
        "c 5:0 rw",
        "c 5:2 rw",
        "c 136:* rw",
    ):
        (made / "devices.allow").write_text(rule)
    yield made
    for _ in range(200):
        try:
            made.rmdir()
            break
        except OSError:
            time.sleep(0.01)


def test_nodes_are_bound_from_the_host_when_the_device_cgroup_refuses_mknod(devices_cgroup_without_mknod):
    code = "open('/dev/null', 'w').write('x'); print(open('/proc/self/mountinfo').read())"
    procs = str(devices_cgroup_without_mknod / "cgroup.procs")
    finished = run(confined(), python(code), cgroup_procs=[procs])
    assert finished.returncode == 0, finished.output
    mount_points = {line.split()[4] for line in finished.output.splitlines() if len(line.split()) > 4}
    assert {"/dev/null", "/dev/zero", "/dev/urandom", "/dev/tty"} <= mount_points


def test_a_node_the_host_lacks_cannot_be_bound_and_the_error_says_why(devices_cgroup_without_mknod):
    spec = confined(devices=(DeviceNode("/dev/natest-absent", "c", 1, 3),))

    def attempt() -> list[object]:
        with open(devices_cgroup_without_mknod / "cgroup.procs", "w") as procs:
            procs.write("0")
        try:
            enter_sandbox(spec)
        except SandboxStepError as err:
            return [err.step, err.errno, err.strerror]
        return []

    step, errno_, message = in_child(attempt)  # type: ignore[misc]
    assert (step, errno_) == ("private /dev", errno.EPERM)
    assert "allow mknod ('m')" in message


LIST_HIDDEN = """
import errno, json, sys
state, token = sys.argv[1], sys.argv[2]
try:
    open(f"{state}/planted", "w")
    wrote = "yes"
except OSError as err:
    wrote = errno.errorcode[err.errno]
listing = sorted(__import__("os").listdir(state))
print(json.dumps({"listing": listing, "token": open(token).read(), "write": wrote}))
"""


def test_hidden_paths_are_empty_and_read_only(host_dir: Path):
    state = host_dir / "state"
    state.mkdir(mode=0o755)
    state.chmod(0o755)
    (state / "secret").write_text("s3cret")
    token = host_dir / "token"
    token.write_text("t0ken")
    for path in (state / "secret", token):
        path.chmod(0o644)
    spec = confined(hide_paths=(str(state), str(token)))
    hidden = json.loads(run(spec, [*python(LIST_HIDDEN), str(state), str(token)]).output)
    assert hidden == {"listing": [], "token": "", "write": "EROFS"}
    # Control: the same user without the sandbox sees both.
    seen = run(None, [*python(LIST_HIDDEN), str(state), str(token)], user=NOBODY).output
    assert json.loads(seen)["listing"] == ["secret"]
    assert json.loads(seen)["token"] == "t0ken"
    assert (state / "secret").read_text() == "s3cret"


def _mkdir_in_cgroupfs(spec: SandboxSpec | None) -> int:
    """As root in a child: errno of mkdir in the pids hierarchy (0: made, and removed again)."""
    if spec is not None:
        enter_sandbox(spec)  # still root, with its effective capabilities
    target = CGROUP / "pids" / _name()
    result = os_error_of(lambda: target.mkdir())
    if result == 0:
        target.rmdir()
    return result


@pytest.fixture
def pids_hierarchy() -> None:
    if not (CGROUP / "pids" / "cgroup.procs").exists():
        pytest.skip("needs the cgroup v1 pids hierarchy at /sys/fs/cgroup/pids")


@pytest.mark.usefixtures("pids_hierarchy")
def test_cgroup_tree_is_read_only_even_for_root():
    assert in_child(lambda: _mkdir_in_cgroupfs(confined())) == errno.EROFS


@pytest.mark.usefixtures("pids_hierarchy")
def test_control_cgroup_tree_is_writable_without_the_sandbox_or_with_the_host_view():
    assert in_child(lambda: _mkdir_in_cgroupfs(None)) == 0
    assert in_child(lambda: _mkdir_in_cgroupfs(confined(cgroup_view="host"))) == 0


CGROUP_VIEW = """
import errno, json, os
def entries(path):
    return sorted(os.listdir(path)) if os.path.isdir(path) else None
try:
    os.mkdir("/sys/fs/cgroup/pids/escape")
    mkdir = "made"
except OSError as err:
    mkdir = errno.errorcode[err.errno]
print(json.dumps({
    "cgroup": open("/proc/self/cgroup").read().split(),
    "top": entries("/sys/fs/cgroup"),
    "pids_dirs": [n for n in os.listdir("/sys/fs/cgroup/pids") if os.path.isdir("/sys/fs/cgroup/pids/" + n)],
    "memory_limit": open("/sys/fs/cgroup/memory/memory.limit_in_bytes").read().strip(),
    "mkdir": mkdir,
}))
"""


def test_cgroup_namespace_shows_the_slot_as_the_whole_tree(slot):
    spec = confined(namespaces=("mount", "ipc", "uts", "cgroup"), cgroup_view="namespace")
    limit = 96 << 20
    (slot.dirs["memory"] / "memory.limit_in_bytes").write_text(str(limit))
    finished = run(spec, python(CGROUP_VIEW), cgroup_procs=slot.procs_files)
    assert finished.returncode == 0, finished.output
    view = json.loads(finished.output)
    for line in view["cgroup"]:
        assert line.endswith(":/"), line  # every hierarchy's root is the slot
    assert set(os.listdir(CGROUP)) <= set(view["top"])  # same hierarchies and links as the host
    assert view["pids_dirs"] == []  # none of the host's other cgroups
    assert view["memory_limit"] == str(limit)
    assert view["mkdir"] == "EROFS"


def test_control_without_cgroup_namespace_the_host_tree_and_path_show(slot):
    finished = run(confined(cgroup_view="host"), python(CGROUP_VIEW), cgroup_procs=slot.procs_files)
    view = json.loads(finished.output)
    assert any(line.endswith(f":/{slot.name}") for line in view["cgroup"])
    assert slot.name in view["pids_dirs"]
    assert view["mkdir"] == "EACCES"  # nobody, host view: refused by permissions, not read-only


TOUCH = """
import errno, sys
for path in sys.argv[1:]:
    try:
        open(path, "w").write("x")
        print(path, "ok")
    except OSError as err:
        print(path, errno.errorcode[err.errno])
"""


def test_read_only_root_keeps_tmp_shm_and_home_writable(host_dir: Path):
    shared = host_dir / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    home = host_dir / "home"
    home.mkdir()
    os.chown(home, NOBODY, NOBODY)
    mount_point = host_dir / "mnt"
    mount_point.mkdir()
    spec = confined(read_only_root=True, home=str(home), home_mount=str(mount_point))
    paths = [str(shared / "x"), "/tmp/x", "/dev/shm/x", str(mount_point / "x")]
    lines = run(spec, [*python(TOUCH), *paths]).output.split("\n")
    assert lines[:4] == [f"{paths[0]} EROFS", "/tmp/x ok", "/dev/shm/x ok", f"{paths[3]} ok"]
    assert (home / "x").read_text() == "x"  # HOME is the host directory
    assert (home / "x").stat().st_uid == NOBODY
    assert not (mount_point / "x").exists()  # the mount point itself was only covered
    control = run(confined(), [*python(TOUCH), paths[0]]).output
    assert control.strip() == f"{paths[0]} ok"


def test_make_read_only_each_keeps_other_flags(host_dir: Path):
    """The pre-5.12 path (one remount per mount), tried on this kernel in a private namespace."""
    outer = host_dir / "outer"
    outer.mkdir()

    def attempt() -> dict[str, object]:
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.unshare(0x00020000) == 0
        mounts.make_private("/")
        mounts.mount_tmpfs(str(outer), 1 << 20, flags=mounts.MS_NOSUID | mounts.MS_NOEXEC)
        (outer / "inner").mkdir()
        mounts.mount_tmpfs(str(outer / "inner"), 1 << 20)
        mounts.make_read_only_each(str(outer), Path("/proc/self/mountinfo").read_text())
        entries = {
            e.mount_point: e.flags for e in mounts.parse_mountinfo(Path("/proc/self/mountinfo").read_text())
        }
        return {
            "outer": os_error_of(lambda: (outer / "f").write_text("x")),
            "inner": os_error_of(lambda: (outer / "inner" / "f").write_text("x")),
            "outer_flags": entries[str(outer)],
        }

    seen = in_child(attempt)
    assert seen["outer"] == errno.EROFS  # type: ignore[index]
    assert seen["inner"] == errno.EROFS  # type: ignore[index]
    flags = seen["outer_flags"]  # type: ignore[index]
    assert flags & mounts.MS_RDONLY
    assert flags & mounts.MS_NOSUID
    assert flags & mounts.MS_NOEXEC
    assert not os.listdir(outer)  # nothing reached the host


def test_mountinfo_parsing_unescapes_and_reads_flags():
    text = (
        "31 23 0:28 / /sys/fs/cgroup ro,nosuid,nodev,noexec - tmpfs tmpfs ro,mode=755\n"
        "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
        "40 27 8:1 /a\\040b /mnt/with\\040space rw shared:3 - ext4 /dev/sda1 rw\n"
    )
    entries = mounts.parse_mountinfo(text)
    assert entries[0].flags == mounts.MS_RDONLY | mounts.MS_NOSUID | mounts.MS_NODEV | mounts.MS_NOEXEC
    assert entries[1].super_options == "rw,cpu,cpuacct"
    assert entries[2].mount_point == "/mnt/with space"
    assert entries[2].root == "/a b"
    assert [e.mount_point for e in mounts.mounts_under("/sys/fs/cgroup", entries)] == [
        "/sys/fs/cgroup",
        "/sys/fs/cgroup/cpu,cpuacct",
    ]


def test_a_failed_step_is_named_with_its_errno(host_dir: Path):
    spec = confined(home=str(host_dir), home_mount="/nonexistent-natest")

    def attempt() -> list[object]:
        try:
            enter_sandbox(spec)
        except SandboxStepError as err:
            return [err.step, err.errno]
        return []

    assert in_child(attempt) == ["HOME on /nonexistent-natest", errno.ENOENT]


def test_hidepid_is_refused_where_it_would_change_the_hosts_proc():
    """Before Linux 5.8 every proc mount of a pid namespace shared one set of options; the sandbox
    must then refuse rather than set hidepid on the host's /proc (simulated in a child)."""

    def attempt() -> list[object]:
        mounts.PER_MOUNT_PROC_OPTIONS = False
        try:
            enter_sandbox(confined())
        except SandboxStepError as err:
            return [err.step, err.errno, "Linux 5.8" in (err.strerror or "")]
        return []

    assert in_child(attempt) == ["private /proc", errno.EOPNOTSUPP, True]


SEE_VIEW = """
import errno, json, os, sys
state, view = sys.argv[1], sys.argv[2]
def attempt(action):
    try:
        return action()
    except OSError as err:
        return errno.errorcode[err.errno]
def write(path):
    with open(path, "w") as handle:
        handle.write("mine")
    return "ok"
print(json.dumps({
    "state": attempt(lambda: sorted(os.listdir(state))),
    "secret": attempt(lambda: open(os.path.join(state, "secret")).read()),
    "slot": attempt(lambda: open(os.path.join(view, "slot.json")).read()),
    "home": attempt(lambda: write(os.path.join(view, "home", "f"))),
    "replace slot": attempt(lambda: os.rename(f"{view}/home/f", f"{view}/slot.json")),
    "beside view": attempt(lambda: write(os.path.join(os.path.dirname(view), "x"))),
    "mode of the way": oct(os.stat(os.path.dirname(view)).st_mode & 0o777),
}))
"""


def test_a_hidden_directory_shows_only_what_is_exposed_in_it(host_dir: Path):
    """The agent's layout: the state directory hidden, the slot's view/ bound again at its path."""
    state = host_dir / "state"
    view = state / "workers" / "s1" / "view"
    (view / "home").mkdir(parents=True)
    for path in (state, state / "workers", view.parent, view):
        path.chmod(0o755)
    os.chown(view / "home", NOBODY, NOBODY)
    (view / "slot.json").write_text('{"slot": 1}')
    (view / "slot.json").chmod(0o644)
    (state / "secret").write_text("s3cret")
    (state / "secret").chmod(0o644)
    spec = confined(hide_paths=(str(state),), expose=(Exposed(str(view), writable=True),))
    seen = json.loads(run(spec, [*python(SEE_VIEW), str(state), str(view)]).output)
    assert seen == {
        "state": "EACCES",  # traverse-only: its neighbours are not listed
        "secret": "ENOENT",
        "slot": '{"slot": 1}',
        "home": "ok",
        "replace slot": "EACCES",  # view/ is root's: the slot file stays the agent's
        "beside view": "EROFS",
        "mode of the way": "0o711",
    }
    assert (view / "home" / "f").read_text() == "mine"  # the host's directory, written through
    # Control: the same user without the sandbox sees the whole state directory.
    free = json.loads(run(None, [*python(SEE_VIEW), str(state), str(view)], user=NOBODY).output)
    assert free["state"] == ["secret", "workers"]
    assert free["secret"] == "s3cret"


def test_home_and_var_tmp_are_private_limited_and_charged_to_the_slot(slot, host_dir: Path):
    usage = slot.dirs["memory"] / "memory.usage_in_bytes"
    check_private_places(
        lambda spec, argv: run(spec, argv, cgroup_procs=slot.procs_files), str(usage), host_dir / "home"
    )
