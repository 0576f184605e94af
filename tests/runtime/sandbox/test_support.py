"""What the host offers the sandbox: read from fake /proc trees (pure), and tried live (root)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nodeagent.runtime.sandbox import SandboxSpec, missing_for, probe, probe_live
from tests.runtime.sandbox.child import INIT

MODERN = {
    "sys/kernel/osrelease": "6.1.0-18-amd64\n",
    "sys/user/max_user_namespaces": "63254\n",
    "sys/kernel/seccomp/actions_avail": "kill_process kill_thread trap errno user_notif trace log allow\n",
    **{f"self/ns/{entry}": "" for entry in ("mnt", "pid", "ipc", "uts", "cgroup", "user", "net")},
}


def tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for relpath, content in files.items():
        path = tmp_path / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    return tmp_path


def test_modern_kernel_offers_everything(tmp_path):
    support = probe(tree(tmp_path, MODERN))
    assert support.kernel == "6.1.0-18-amd64"
    assert support.namespaces == {"mount", "pid", "ipc", "uts", "cgroup", "user"}
    assert support.user_namespaces
    assert support.seccomp_filter
    assert support.hidepid
    assert support.mount_setattr
    assert missing_for(SandboxSpec(uid=1, gid=1), support) == []
    assert support.to_json()["namespaces"] == ["cgroup", "ipc", "mount", "pid", "user", "uts"]


def test_old_kernel_lacks_hidepid_and_mount_setattr(tmp_path):
    support = probe(tree(tmp_path, {**MODERN, "sys/kernel/osrelease": "5.4.0-150-generic\n"}))
    assert not support.hidepid
    assert not support.mount_setattr
    assert missing_for(SandboxSpec(uid=1, gid=1), support) == [
        "hidepid on a private /proc (Linux 5.8+, this is 5.4.0-150-generic)"
    ]
    assert missing_for(SandboxSpec(uid=1, gid=1, hide_other_processes=False), support) == []


def test_missing_namespaces_and_seccomp_are_named(tmp_path):
    files = {k: v for k, v in MODERN.items() if k not in ("self/ns/cgroup", "self/ns/pid")}
    files["sys/kernel/seccomp/actions_avail"] = "kill_thread trap\n"
    support = probe(tree(tmp_path, files))
    spec = SandboxSpec(
        uid=0,
        gid=0,
        namespaces=("mount", "pid", "cgroup"),
        cgroup_view="namespace",
        read_only_root=True,
        init=INIT,
    )
    assert missing_for(spec, support) == [
        "the pid namespace",
        "the cgroup namespace",
        "seccomp filter mode with errno and kill_process actions",
    ]
    assert missing_for(SandboxSpec(uid=1, gid=1, seccomp_profile="unconfined"), support) == []


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        pytest.param({}, True, id="enabled"),
        pytest.param({"sys/user/max_user_namespaces": "0\n"}, False, id="max-zero"),
        pytest.param({"sys/kernel/unprivileged_userns_clone": "0\n"}, False, id="debian-switch-off"),
    ],
)
def test_user_namespaces(tmp_path, files, expected):
    assert probe(tree(tmp_path, {**MODERN, **files})).user_namespaces is expected


def test_empty_tree_offers_nothing(tmp_path):
    support = probe(tmp_path)
    assert support.namespaces == frozenset()
    assert not support.seccomp_filter
    assert not support.hidepid


@pytest.mark.root
def test_live_probe_on_this_host_finds_every_piece_working():
    results = probe_live()
    assert results, "the probe returned nothing"
    assert {key: value for key, value in results.items() if value != "ok"} == {}
    assert "seccomp refuses umount2" in results
