"""A default (sandboxed) slot's own devices, through the real agent path: the worker opens the
nodes its slot holds even where the host's node is root's 0600, opens nothing it does not hold,
and the host's nodes keep their owner and mode.

The devices are loop devices, which both this host and the pure cgroup v2 VM have, and whose open
does nothing (no ioctl is made): the test makes its OWN nodes of their numbers under the host's
/dev (root's, 0600; a slot may name only paths under /dev), so no node of the host is touched. The
slot holds a block node (a loop device's numbers) and a character node (loop-control's numbers);
a second loop device it does not hold is offered to it in a directory it can see, mode 0666 (so
only the slot's device cgroup stands in the way), and at the host's /dev path (which its private
/dev does not have). Control: the same nodes open as root outside every slot.

Used by test_own_devices.py (this host: cgroup v1 or hybrid) and v2vm/test_own_devices_v2.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from nodeagent.agent.daemon import build_manager
from nodeagent.devices.discovery import discover
from nodeagent.errors import NotFound
from nodeagent.schema.request import parse_slot_request
from tests.escape.harness import config_for, tear_down, wait_until
from tests.workerpy import world_python

#: What the slot's worker runs: open each path as asked; one JSON line, then READY.
OPENER = """
import errno, json, os, stat, sys
asked = json.loads(sys.argv[1])
def attempt(path, flags):
    try:
        os.close(os.open(path, flags))
    except OSError as err:
        return errno.errorcode[err.errno]
    return "ok"
seen = {"uid": os.getuid(), "gid": os.getgid(), "nodes": {}, "opens": {}}
for path in asked["held"]:
    info = os.stat(path)
    seen["nodes"][path] = [stat.S_IFMT(info.st_mode), info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)]
for path, how in asked["opens"]:
    seen["opens"][path + " " + how] = attempt(path, getattr(os, how))
print(json.dumps(seen), flush=True)
print("READY", flush=True)
"""
#: Where the not-held node is offered to the worker: a directory it can read on a file system
#: that allows device nodes (the root file system; not /tmp, /var/tmp or /dev/shm, which the
#: sandbox replaces with nodev mounts of the slot's own).
VISIBLE_PARENT = "/var/lib"


@dataclass(frozen=True)
class Node:
    path: str
    kind: int
    major: int
    minor: int

    def make(self, mode: int) -> None:
        os.mknod(self.path, self.kind | mode, os.makedev(self.major, self.minor))
        os.chmod(self.path, mode)  # whatever the umask

    def owner_and_mode(self) -> tuple[int, int, int]:
        info = os.stat(self.path)
        return info.st_uid, info.st_gid, info.st_mode


def _loop_numbers() -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """(major, minor) of two loop devices and of loop-control; skip where the host has them not."""
    loops = sorted(
        (int(m.group(1)), f"/dev/{name}")
        for name in os.listdir("/dev")
        if (m := re.fullmatch(r"loop(\d+)", name)) and stat.S_ISBLK(os.stat(f"/dev/{name}").st_mode)
    )
    if len(loops) < 2 or not os.path.exists("/dev/loop-control"):
        pytest.skip("needs two loop devices and /dev/loop-control")
    numbers = [os.stat(path).st_rdev for _, path in (loops[-1], loops[-2])]
    control = os.stat("/dev/loop-control").st_rdev
    held, other = ((os.major(n), os.minor(n)) for n in numbers)
    return held, other, (os.major(control), os.minor(control))


@contextlib.contextmanager
def own_nodes(tag: str) -> Iterator[tuple[Node, Node, Node, Node]]:
    """The test's nodes: held block and character nodes and the not-held one under /dev (root,
    0600), and the not-held one again, 0666, in a directory a worker can read. Removed after."""
    (held_major, held_minor), (other_major, other_minor), (ctl_major, ctl_minor) = _loop_numbers()
    prefix = f"/dev/natest{os.getpid()}{tag}"
    block = Node(f"{prefix}-blk", stat.S_IFBLK, held_major, held_minor)
    char = Node(f"{prefix}-chr", stat.S_IFCHR, ctl_major, ctl_minor)
    other = Node(f"{prefix}-other", stat.S_IFBLK, other_major, other_minor)
    visible_dir = tempfile.mkdtemp(prefix=f"natest{os.getpid()}{tag}-", dir=VISIBLE_PARENT)
    try:
        os.chmod(visible_dir, 0o755)
        offered = Node(f"{visible_dir}/other", stat.S_IFBLK, other_major, other_minor)
        for node in (block, char, other):
            node.make(0o600)
        offered.make(0o666)
        yield block, char, other, offered
    finally:
        for node in (block, char, other):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(node.path)
        shutil.rmtree(visible_dir, ignore_errors=True)


def open_as_root(path: str, flags: int) -> str:
    try:
        os.close(os.open(path, flags))
    except OSError as err:
        return os.strerror(err.errno)
    return "ok"


def own_devices_scenario(tmp_path: Path, tag: str) -> None:
    """The slot's worker opens its own 0600 nodes and nothing else; the host's nodes unchanged."""
    with own_nodes(tag) as (block, char, other, offered):
        held = [block.path, char.path]
        before = {node.path: node.owner_and_mode() for node in (block, char, other)}
        # The control: as root outside every slot, each node opens.
        for node, how in (
            (block, os.O_RDONLY),
            (char, os.O_RDWR),
            (other, os.O_RDONLY),
            (offered, os.O_RDONLY),
        ):
            assert open_as_root(node.path, how) == "ok", node
        cfg = config_for(tmp_path, tag, placement={"allowed_devices": held})
        manager = None
        try:
            manager = build_manager(cfg, discover(gpus=False, fpgas=False))
            manager.start(supervise=False)
            asked = {
                "held": held,
                "opens": [
                    [block.path, "O_RDONLY"],
                    [char.path, "O_RDWR"],
                    [other.path, "O_RDONLY"],
                    [offered.path, "O_RDONLY"],
                ],
            }
            manager.allocate(
                parse_slot_request(
                    {
                        "name": "devices",
                        "qos": "burstable",
                        "resources": {"cpus": 0.2, "memory": "64Mi", "devices": held},
                        "worker": {
                            "command": [world_python(), "-I", "-c", OPENER, json.dumps(asked)],
                            "stop_grace_seconds": 1,
                            "restart": "never",
                        },
                    }
                )
            )
            seen = _verdict(manager)
            slot_uid = seen["uid"]
            assert slot_uid != 0, seen
            # Its own nodes: made for its uid in its private /dev, whatever the host's node says.
            assert seen["nodes"] == {
                block.path: [stat.S_IFBLK, slot_uid, seen["gid"], 0o660],
                char.path: [stat.S_IFCHR, slot_uid, seen["gid"], 0o660],
            }
            assert seen["opens"] == {
                f"{block.path} O_RDONLY": "ok",
                f"{char.path} O_RDWR": "ok",
                # Not held: absent from its /dev, and refused by its device cgroup where a node of
                # it is in sight and open to every uid.
                f"{other.path} O_RDONLY": "ENOENT",
                f"{offered.path} O_RDONLY": "EPERM",
            }
        finally:
            if manager is not None:
                manager.close()
            tear_down(cfg)
        after = {node.path: node.owner_and_mode() for node in (block, char, other)}
        assert after == before
        assert all(uid == 0 and stat.S_IMODE(mode) == 0o600 for uid, _, mode in after.values())


def _verdict(manager: Any) -> dict[str, Any]:
    def finished() -> list[str] | None:
        try:
            out = manager.logs("devices", 100)
        except NotFound:
            return None  # the keeper makes the log once it takes custody of the worker
        return out if any(line.endswith("READY") for line in out) else None

    lines = wait_until("the device worker's verdict", finished, timeout=60)
    found = [json.loads(line) for line in lines if line.startswith("{")]
    assert found, lines
    return found[-1]
