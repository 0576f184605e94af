"""The agent's sandbox policy on plain data: what a request may leave out of the sandbox under
which configuration, the SandboxSpec each kind of worker gets, and the [sandbox] section."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from nodeagent.agent.config import parse_config
from nodeagent.agent.manager import SlotManager
from nodeagent.agent.sandbox import SandboxConfig, SandboxPolicy, device_nodes
from nodeagent.agent.state import StateStore
from nodeagent.errors import ConfigError, InvalidRequest, Unsupported
from nodeagent.runtime.sandbox import SandboxSupport
from nodeagent.runtime.sandbox.caps import ROOT_CAPABILITIES
from nodeagent.schema.request import parse_slot_request
from nodeagent.schema.worker import parse_worker_spec
from tests.agent.test_manager import TOPOLOGY, FakeIsolation, FakeRuntime, World

FULL = SandboxSupport(
    kernel="6.1.0",
    namespaces=frozenset({"mount", "pid", "ipc", "uts", "cgroup", "user"}),
    user_namespaces=True,
    seccomp_filter=True,
    hidepid=True,
    mount_setattr=True,
)
INIT = "/opt/na/bin/dumb-init"
STATE = "/var/lib/nodeagent"


def policy(support: SandboxSupport = FULL, **config: object) -> SandboxPolicy:
    return SandboxPolicy(SandboxConfig(**config), (STATE,), support, init=INIT)  # type: ignore[arg-type]


def worker(**fields: object) -> object:
    return parse_worker_spec({"command": ["/usr/bin/server"], **fields})


def test_a_default_worker_gets_the_slots_uid_and_the_whole_sandbox() -> None:
    spec = policy().spec_for(worker(), uid=600007, devices=())  # type: ignore[arg-type]
    assert (spec.uid, spec.gid, spec.groups) == (600007, 600007, ())
    assert spec.capabilities == ()
    assert (spec.seccomp_profile, spec.seccomp_allow) == ("default", ())
    assert spec.namespaces == ("mount", "ipc", "uts")
    assert spec.hide_paths == (STATE,)
    assert (spec.tmp_bytes, spec.shm_bytes) == (256 << 20, 64 << 20)
    assert spec.private_dev
    assert spec.hide_other_processes
    assert spec.cgroup_view == "read-only"
    assert not spec.read_only_root
    assert spec.init is None


def test_a_root_worker_gets_the_root_confinement() -> None:
    spec = policy(allow_root=True).spec_for(worker(user="root"), uid=600007, devices=())  # type: ignore[arg-type]
    assert (spec.uid, spec.gid) == (0, 0)
    assert "pid" in spec.namespaces
    assert spec.init == INIT
    assert spec.read_only_root
    assert set(spec.capabilities) == set(ROOT_CAPABILITIES)


def test_opt_outs_and_sizes_reach_the_spec() -> None:
    allowed = policy(allowed_syscalls=("perf_event_open",), allowed_capabilities=("NET_BIND_SERVICE",))
    request = worker(
        sandbox={
            "allow_syscalls": ["perf_event_open"],
            "capabilities": ["CAP_NET_BIND_SERVICE"],
            "shm_size": "1Gi",
            "tmp_size": 8192,
        }
    )
    allowed.check(request)  # type: ignore[arg-type]
    spec = allowed.spec_for(request, uid=600001, devices=())  # type: ignore[arg-type]
    assert spec.seccomp_allow == ("perf_event_open",)
    assert spec.capabilities == ("NET_BIND_SERVICE",)
    assert (spec.shm_bytes, spec.tmp_bytes) == (1 << 30, 8192)


def test_a_cgroup_namespace_view_adds_the_namespace() -> None:
    spec = policy(cgroup_view="namespace").spec_for(worker(), uid=600001, devices=())  # type: ignore[arg-type]
    assert "cgroup" in spec.namespaces
    assert spec.cgroup_view == "namespace"


@pytest.mark.parametrize(
    ("config", "fields", "message"),
    [
        pytest.param({}, {"user": "root"}, r"root is not allowed.*allow_root = true", id="root"),
        pytest.param({}, {"user": 0}, r"root is not allowed", id="uid-0"),
        pytest.param(
            {}, {"user": "nobody"}, r"naming a host user.*allow_named_users = true", id="named-user"
        ),
        pytest.param({}, {"supplementary_groups": [44]}, r"allow_named_users", id="groups"),
        pytest.param(
            {"allow_named_users": True}, {"user": 600100}, r"in the agent's own range", id="uid-in-the-pool"
        ),
        pytest.param(
            {},
            {"sandbox": {"allow_syscalls": ["ptrace"]}},
            r"allow_syscalls: ptrace not allowed.*allowed_syscalls lists nothing",
            id="syscall",
        ),
        pytest.param(
            {"allowed_syscalls": ("ptrace",)},
            {"sandbox": {"allow_syscalls": ["read"]}},
            r"read is not denied by the default seccomp profile",
            id="syscall-not-restricted",
        ),
        pytest.param(
            {}, {"sandbox": {"seccomp": "unconfined"}}, r"allow_unconfined_seccomp", id="unconfined"
        ),
        pytest.param({}, {"sandbox": {"capabilities": ["NET_RAW"]}}, r"NET_RAW not allowed", id="capability"),
        pytest.param(
            {}, {"sandbox": {"capabilities": ["SYS_ADMIN"]}}, r"SYS_ADMIN undoes the slot", id="never"
        ),
        pytest.param({}, {"sandbox": {"capabilities": ["WIZARD"]}}, r"unknown capability", id="unknown-cap"),
        pytest.param(
            {}, {"workdir": "/tmp/models"}, r"workdir '/tmp/models' is not reachable", id="workdir-tmp"
        ),
        pytest.param({}, {"workdir": f"{STATE}/x"}, r"lies inside '/var/lib/nodeagent'", id="workdir-hidden"),
        pytest.param(
            {},
            {"workdir": "//var//lib//nodeagent//x/"},
            r"workdir '//var//lib//nodeagent//x/' \(that is '/var/lib/nodeagent/x'\) lies inside",
            id="workdir-doubled-slashes",
        ),
        pytest.param(
            {},
            {"workdir": "/var/tmp/../lib/nodeagent"},
            r"workdir .* is '/var/lib/nodeagent'",
            id="workdir-dotdot",
        ),
    ],
)
def test_what_the_configuration_does_not_allow_is_refused(
    config: dict[str, object], fields: dict[str, object], message: str
) -> None:
    with pytest.raises(InvalidRequest, match=message):
        policy(**config).check(worker(**fields))  # type: ignore[arg-type]


def test_allowed_opt_outs_pass() -> None:
    relaxed = policy(allow_root=True, allow_named_users=True, allow_unconfined_seccomp=True)
    for fields in ({"user": "root"}, {"user": "nobody"}, {"sandbox": {"seccomp": "unconfined"}}):
        relaxed.check(worker(**fields))  # type: ignore[arg-type]
    # A root worker may name capabilities of the root set without [sandbox] allowed_capabilities.
    relaxed.check(worker(user="root", sandbox={"capabilities": ["CHOWN"]}))  # type: ignore[arg-type]


def test_a_host_that_lacks_a_piece_refuses_as_unsupported() -> None:
    old = SandboxSupport("5.4.0", FULL.namespaces, True, True, hidepid=False, mount_setattr=False)
    with pytest.raises(Unsupported, match=r"lacks hidepid on a private /proc \(Linux 5.8\+, this is 5.4.0\)"):
        policy(old).check(worker())  # type: ignore[arg-type]
    no_pidns = SandboxSupport("6.1", frozenset({"mount", "ipc", "uts"}), False, True, True, True)
    policy(no_pidns).check(worker())  # type: ignore[arg-type]  # a default worker needs no pid namespace
    with pytest.raises(Unsupported, match="the pid namespace"):
        policy(no_pidns, allow_root=True).check(worker(user="root"))  # type: ignore[arg-type]
    assert policy(old).degraded() == (
        "worker sandbox: this host lacks hidepid on a private /proc (Linux 5.8+, this is 5.4.0)",
    )


def test_switched_off_or_unavailable_says_so_and_checks_nothing() -> None:
    off = SandboxPolicy(SandboxConfig(enabled=False), (STATE,), None)
    off.check(worker(user="root"))  # type: ignore[arg-type]
    assert not off.active
    assert "enabled = false" in off.degraded()[0]
    assert off.to_json()["enabled"] is False
    unavailable = SandboxPolicy(SandboxConfig(), (STATE,), None, unavailable="worker sandbox: not root")
    assert unavailable.degraded() == ("worker sandbox: not root",)
    assert policy().degraded() == ()
    assert policy().to_json()["active"] is True


def test_device_nodes_are_the_hosts_numbers_owned_by_the_worker() -> None:
    kmsg = os.stat("/dev/kmsg")
    assert stat.S_ISCHR(kmsg.st_mode)
    nodes = device_nodes(["/dev/null", "/dev/kmsg", "/dev/natest-missing"], 600003, 600003)
    # /dev/null is made by the sandbox itself; a node gone from the host is left out.
    assert [(n.path, n.type, n.major, n.minor, n.uid, n.gid, n.mode) for n in nodes] == [
        ("/dev/kmsg", "c", os.major(kmsg.st_rdev), os.minor(kmsg.st_rdev), 600003, 600003, 0o660)
    ]


@pytest.mark.parametrize(
    ("section", "message"),
    [
        pytest.param({"uid_range": "600000"}, "expected FIRST-LAST", id="no-dash"),
        pytest.param({"uid_range": "10-20"}, "below 1000", id="system-uids"),
        pytest.param({"uid_range": "700-600"}, "FIRST <= LAST", id="reversed"),
        pytest.param(
            {"allowed_syscalls": ["read"]}, "not denied by the default seccomp profile", id="syscall"
        ),
        pytest.param({"allowed_capabilities": ["SYS_PTRACE"]}, "never given", id="never"),
        pytest.param({"allowed_capabilities": ["WIZARD"]}, "unknown capability", id="unknown"),
        pytest.param({"shm_size": "1k"}, "at least 4096", id="tiny"),
        pytest.param({"tmp_size": "lots"}, "not a quantity", id="not-a-size"),
        pytest.param({"cgroup_view": "host"}, "read-only, namespace", id="view"),
        pytest.param({"hide_paths": ["relative"]}, "normalised absolute path", id="relative"),
        pytest.param({"enabled": "yes"}, "true or false", id="not-a-bool"),
        pytest.param({"uid_rnage": "1-2"}, "did you mean 'uid_range'", id="typo"),
    ],
)
def test_bad_sandbox_configuration_names_the_key(section: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"sandbox": section}, "/etc/nodeagent/config.toml")


def test_the_default_configuration_confines() -> None:
    config = parse_config({})
    assert config.sandbox.enabled
    assert config.sandbox.uid_bounds() == (600000, 665535)
    assert not config.sandbox.allow_root
    assert not config.sandbox.allow_named_users
    assert config.sandbox.allowed_syscalls == config.sandbox.allowed_capabilities == ()


def container(*mounts: tuple[str, str]) -> object:
    return parse_worker_spec(
        {
            "container": {
                "image": "localhost/server:1",
                "mounts": [{"source": source, "target": target} for source, target in mounts],
            }
        }
    )


@pytest.mark.parametrize(
    ("source", "how"),
    [
        (f"{STATE}/state.db", "lies inside"),
        (f"{STATE}/state.db-wal", "lies inside"),
        ("//var/lib//nodeagent/./state.db", "lies inside"),
        (f"{STATE}/", "is"),
        ("/var/lib/", "contains"),
        ("/", "contains"),
        ("/srv/../var/lib/nodeagent/workers", "lies inside"),
    ],
)
def test_a_container_mount_of_a_hidden_path_is_refused_whatever_its_spelling(source: str, how: str) -> None:
    # Also with the sandbox off: the mount would show the state database to the container's user.
    for who in (policy(), policy(enabled=False)):
        with pytest.raises(InvalidRequest, match=rf"mounts\[1\]\.source .*{how} '/var/lib/nodeagent'"):
            who.check(container(("/srv/models", "/models"), (source, "/data")))  # type: ignore[arg-type]


def test_a_container_mount_through_a_link_to_a_hidden_path_is_refused(tmp_path: Path) -> None:
    base = tmp_path
    state = base / "state"
    state.mkdir()
    (base / "link").symlink_to(state)
    who = SandboxPolicy(SandboxConfig(), (str(state),), FULL, init=INIT)
    with pytest.raises(InvalidRequest, match=r"that is '.*/state/state.db'\) lies inside"):
        who.check(container((str(base / "link" / "state.db"), "/db")))  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match=r"target '//' is the container's root"):
        who.check(container(("/srv", "//")))  # type: ignore[arg-type]
    who.check(container(("/srv/models", "/var/lib/nodeagent")))  # type: ignore[arg-type]  # a target is the container's


def test_allocate_refuses_a_container_mount_of_the_state_database_before_anything_is_placed(
    tmp_path: Path,
) -> None:
    world = World()
    store = StateStore(tmp_path / "state.db")
    # The sandbox off (not root here): the mount would still show the database to the container.
    who = SandboxPolicy(SandboxConfig(enabled=False), (str(tmp_path),), None)
    manager = SlotManager(store, TOPOLOGY, FakeIsolation(world), FakeRuntime(world), sandbox=who)
    manager.start(supervise=False)
    try:
        worker = {
            "container": {
                "image": "localhost/x:1",
                "mounts": [{"source": f"{tmp_path}//state.db-wal", "target": "/w"}],
            }
        }
        request = {
            "name": "thief",
            "qos": "burstable",
            "resources": {"cpus": 0.5, "memory": "64Mi"},
            "worker": worker,
        }
        with pytest.raises(InvalidRequest, match=r"mounts\[0\]\.source .* lies inside"):
            manager.allocate(parse_slot_request(request))
        assert manager.list_slots() == []
        assert world.cgroups == {}
    finally:
        manager.close()
