"""SandboxSpec: defaults, JSON round trip, and a clear error for each way a spec can be wrong."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from nodeagent.errors import InvalidRequest
from nodeagent.runtime.sandbox import DeviceNode, Exposed, PrivateDir, SandboxSpec, home_directory

INIT = "/usr/local/bin/dumb-init"


def test_defaults_are_the_confined_worker():
    spec = SandboxSpec(uid=1000, gid=1000)
    assert spec.capabilities == ()
    assert spec.seccomp_profile == "default"
    assert spec.seccomp_allow == ()
    assert set(spec.namespaces) == {"mount", "ipc", "uts"}
    assert spec.tmp_bytes
    assert spec.shm_bytes
    assert spec.private_dev
    assert spec.hide_other_processes
    assert spec.cgroup_view == "read-only"


def test_json_round_trip_keeps_every_field():
    spec = SandboxSpec(
        uid=0,
        gid=0,
        groups=(44,),
        capabilities=("NET_BIND_SERVICE",),
        seccomp_allow=("ptrace", "clone"),
        namespaces=("mount", "pid", "ipc", "uts", "cgroup"),
        cgroup_view="namespace",
        devices=(DeviceNode("/dev/nvidia0", "c", 195, 0, 0o666),),
        hide_paths=("/var/lib/nodeagent",),
        expose=(Exposed("/var/lib/nodeagent/workers/s1/view", writable=True),),
        home="/var/lib/nodeagent/homes/a",
        home_mount="/home/worker",
        home_bytes=1 << 20,
        private_dirs=(PrivateDir("/var/lib/nodeagent/workers/s1/view/home", 1 << 20, 0o700, 600001, 600001),),
        tmp_views=("/var/lib/nodeagent/workers/s1/view/tmp",),
        private_views=("/var/tmp",),
        hostname="slot-a",
        read_only_root=True,
        init=INIT,
    )
    assert SandboxSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    assert spec.to_json() == dataclasses.asdict(spec)  # the wire form of before the shallow copy


def test_home_is_the_mount_point_when_there_is_one():
    assert home_directory(SandboxSpec(uid=1, gid=1, home="/srv/h")) == "/srv/h"
    assert home_directory(SandboxSpec(uid=1, gid=1, home="/srv/h", home_mount="/home/w")) == "/home/w"
    assert home_directory(SandboxSpec(uid=1, gid=1)) is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        pytest.param({"uid": -1}, "not a valid id", id="negative-uid"),
        pytest.param({"gid": 2**32 - 1}, "not a valid id", id="gid-minus-one"),
        pytest.param({"capabilities": ("SYS_WIZARD",)}, "unknown capability 'SYS_WIZARD'", id="unknown-cap"),
        pytest.param({"seccomp_profile": "strict"}, "unknown seccomp profile 'strict'", id="unknown-profile"),
        pytest.param({"seccomp_allow": ("read",)}, "does not restrict it", id="opt-out-of-allowed-call"),
        pytest.param(
            {"seccomp_profile": "unconfined", "seccomp_allow": ("mount",)},
            "does not restrict",
            id="opt-out-unconfined",
        ),
        pytest.param({"namespaces": ("mount", "time")}, "unknown namespaces ['time']", id="unknown-ns"),
        pytest.param({"cgroup_view": "namespace"}, "go together", id="cgroup-view-without-ns"),
        pytest.param({"namespaces": ("mount", "cgroup")}, "go together", id="cgroup-ns-without-view"),
        pytest.param({"cgroup_view": "private"}, "cgroup_view 'private'", id="unknown-cgroup-view"),
        pytest.param(
            {"namespaces": ("ipc",)},
            "without a mount namespace the sandbox cannot give a private /tmp",
            id="no-mount-ns",
        ),
        pytest.param({"hostname": "h" * 65}, "1-64 bytes", id="long-hostname"),
        pytest.param(
            {"hostname": "h", "namespaces": ("mount",)}, "needs the uts namespace", id="hostname-no-uts"
        ),
        pytest.param({"namespaces": ("mount", "pid")}, "needs an init binary", id="pid-ns-without-init"),
        pytest.param(
            {"namespaces": ("mount", "pid"), "init": "dumb-init"}, "absolute path", id="relative-init"
        ),
        pytest.param({"uid": 0, "read_only_root": True}, "needs a pid namespace", id="root-without-pid-ns"),
        pytest.param(
            {"uid": 0, "namespaces": ("mount", "pid"), "init": INIT}, "needs read_only_root", id="root-rw"
        ),
        pytest.param({"tmp_bytes": 100}, "at least 4096 bytes", id="tiny-tmp"),
        pytest.param({"hide_paths": ("var/lib",)}, "normalised absolute path", id="relative-hide"),
        pytest.param({"hide_paths": ("/",)}, "other than /", id="hide-root"),
        pytest.param({"home": "/h/../etc"}, "normalised absolute path", id="home-dotdot"),
        pytest.param({"home_mount": "/home/w"}, "needs home", id="home-mount-without-home"),
        pytest.param({"home_bytes": 10}, "at least 4096 bytes", id="tiny-home"),
        pytest.param({"private_dirs": (PrivateDir("/run/lock", 100),)}, "at least 4096 bytes", id="tiny-dir"),
        pytest.param({"private_dirs": (PrivateDir("//run/lock", 8192),)}, "normalised", id="dir-slashes"),
        pytest.param({"tmp_bytes": None, "private_views": ("/var/tmp",)}, "need tmp_bytes", id="view-no-tmp"),
        pytest.param({"private_views": ("/var/tmp/",)}, "normalised", id="view-trailing-slash"),
        pytest.param(
            {"expose": (Exposed("/srv/view"),)}, "no hidden path covers it", id="expose-without-hiding"
        ),
        pytest.param(
            {"hide_paths": ("/srv",), "expose": (Exposed("/srv/v"), Exposed("/srv/v", writable=True))},
            "listed twice",
            id="expose-twice",
        ),
        pytest.param(
            {"hide_paths": ("/srv",), "expose": (Exposed("/srv/../etc"),)},
            "normalised absolute path",
            id="expose-not-normalised",
        ),
        pytest.param(
            {"private_dev": False, "devices": (DeviceNode("/dev/x", "c", 1, 3),)},
            "need private_dev",
            id="devices-no-dev",
        ),
        pytest.param(
            {"devices": (DeviceNode("/dev/x", "c", 1, 3), DeviceNode("/dev/x", "c", 1, 5))},
            "listed twice",
            id="dup-device",
        ),
    ],
)
def test_invalid_spec_says_what_is_wrong(fields, message):
    base = {"uid": 1000, "gid": 1000}
    base.update(fields)
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        SandboxSpec(**base)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        pytest.param({"path": "/srv/gpu"}, "under /dev/", id="outside-dev"),
        pytest.param({"path": "/dev/../etc/x"}, "normalised", id="dotdot"),
        pytest.param({"path": "/dev/null"}, "made by the sandbox", id="safe-name"),
        pytest.param({"path": "/dev/pts/9"}, "made by the sandbox", id="under-pts"),
        pytest.param({"type": "p"}, "'c' (character) or 'b' (block)", id="fifo"),
        pytest.param({"major": 4096}, "outside the kernel's device numbers", id="major"),
        pytest.param({"minor": -1}, "outside the kernel's device numbers", id="minor"),
        pytest.param({"mode": 0o4755}, "permission bits only", id="setuid-mode"),
        pytest.param({"uid": -5}, "owner uid", id="owner"),
    ],
)
def test_invalid_device_node_says_what_is_wrong(fields, message):
    base: dict[str, object] = {"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0}
    base.update(fields)
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        DeviceNode(**base)  # type: ignore[arg-type]


def test_unknown_json_field_is_an_invalid_request():
    with pytest.raises(InvalidRequest, match="unexpected keyword argument 'colour'"):
        SandboxSpec.from_json({"uid": 1, "gid": 1, "colour": "red"})
