"""Capabilities: names and the root set (pure), and the sets a sandboxed worker ends up with,
read back from /proc/self/status after exec (root)."""

from __future__ import annotations

import errno

import pytest

from nodeagent.errors import InvalidRequest
from nodeagent.runtime.sandbox import SandboxSpec
from nodeagent.runtime.sandbox.caps import (
    CAPABILITY_NAMES,
    NEVER_FOR_ROOT,
    ROOT_CAPABILITIES,
    capability_mask,
    capability_number,
    names_of,
    read_capability_sets,
)
from tests.runtime.sandbox.child import INIT, NOBODY, python, run

#: The container runtimes' default set (moby's oci/caps/defaults.go, containerd's the same).
RUNTIME_DEFAULT = {
    "CHOWN", "DAC_OVERRIDE", "FSETID", "FOWNER", "MKNOD", "NET_RAW", "SETGID", "SETUID", "SETFCAP",
    "SETPCAP", "NET_BIND_SERVICE", "SYS_CHROOT", "KILL", "AUDIT_WRITE",
}  # fmt: skip
STATUS_CAPS = (
    "import re; print(' '.join(re.findall(r'^Cap\\w+:\\s*\\w+', open('/proc/self/status').read(), re.M)))"
)


def test_names_and_numbers():
    assert capability_number("CHOWN") == 0
    assert capability_number("CAP_NET_BIND_SERVICE") == 10
    assert capability_number("sys_admin") == 21
    assert CAPABILITY_NAMES[40] == "CHECKPOINT_RESTORE"
    assert names_of(capability_mask(["KILL", "SETUID"])) == ("KILL", "SETUID")
    with pytest.raises(InvalidRequest, match="unknown capability 'CAP_FLY'"):
        capability_number("CAP_FLY")


def test_root_set_is_the_runtime_default_without_mknod_and_net_raw():
    assert set(ROOT_CAPABILITIES) == RUNTIME_DEFAULT - {"MKNOD", "NET_RAW"}
    assert not set(ROOT_CAPABILITIES) & set(NEVER_FOR_ROOT)
    assert set(NEVER_FOR_ROOT) == {
        "SYS_ADMIN", "SYS_PTRACE", "SYS_MODULE", "SYS_RAWIO", "NET_ADMIN", "DAC_READ_SEARCH", "SYS_BOOT",
        "MKNOD",
    }  # fmt: skip


def test_read_capability_sets_parses_status():
    text = "Name:\tx\nCapInh:\t0000000000000000\nCapPrm:\t0000000000000400\nCapEff:\t0000000000000400\n"
    text += "CapBnd:\t000001ffffffffff\nCapAmb:\t0000000000000400\n"
    assert read_capability_sets(text) == {
        "CapInh": 0, "CapPrm": 0x400, "CapEff": 0x400, "CapBnd": 0x1FFFFFFFFFF, "CapAmb": 0x400,
    }  # fmt: skip


def _worker_caps(spec: SandboxSpec | None, **kwargs: object) -> dict[str, int]:
    finished = run(spec, python(STATUS_CAPS), **kwargs)  # type: ignore[arg-type]
    assert finished.returncode == 0, finished.output
    return read_capability_sets(finished.output.replace(" Cap", "\nCap"))


@pytest.mark.root
def test_confined_worker_has_no_capability_at_all():
    sets = _worker_caps(SandboxSpec(uid=NOBODY, gid=NOBODY))
    assert sets == {"CapInh": 0, "CapPrm": 0, "CapEff": 0, "CapBnd": 0, "CapAmb": 0}


@pytest.mark.root
def test_control_root_child_without_sandbox_has_every_capability():
    sets = _worker_caps(None)
    assert sets["CapEff"] != 0
    assert sets["CapBnd"] != 0


@pytest.mark.root
def test_non_root_worker_keeps_just_net_bind_service_across_exec():
    mask = capability_mask(["NET_BIND_SERVICE"])
    sets = _worker_caps(SandboxSpec(uid=NOBODY, gid=NOBODY, capabilities=("NET_BIND_SERVICE",)))
    assert sets == {"CapInh": mask, "CapPrm": mask, "CapEff": mask, "CapBnd": mask, "CapAmb": mask}


BIND_LOW_PORT = """
import errno, socket
s = socket.socket()
try:
    s.bind(("127.0.0.1", 0))  # a free port number...
    port = s.getsockname()[1]
    s.close()
    s = socket.socket()
    s.bind(("127.0.0.1", 1023))  # ...and one below 1024 (EADDRINUSE also proves the permission)
    print("bound")
except OSError as err:
    print("bound" if err.errno == errno.EADDRINUSE else errno.errorcode[err.errno])
"""


@pytest.mark.root
def test_kept_capability_works_and_its_absence_is_felt():
    kept = run(SandboxSpec(uid=NOBODY, gid=NOBODY, capabilities=("NET_BIND_SERVICE",)), python(BIND_LOW_PORT))
    without = run(SandboxSpec(uid=NOBODY, gid=NOBODY), python(BIND_LOW_PORT))
    assert kept.output.strip() == "bound"
    assert without.output.strip() == errno.errorcode[errno.EACCES]


@pytest.mark.root
def test_opted_in_root_has_exactly_the_root_set():
    spec = SandboxSpec(
        uid=0,
        gid=0,
        capabilities=ROOT_CAPABILITIES,
        namespaces=("mount", "pid", "ipc", "uts"),
        read_only_root=True,
        init=INIT,
    )
    mask = capability_mask(ROOT_CAPABILITIES)
    sets = _worker_caps(spec)
    assert sets["CapBnd"] == mask
    assert sets["CapEff"] == mask
    assert sets["CapPrm"] == mask
    assert sets["CapAmb"] == 0
    assert not mask & capability_mask(NEVER_FOR_ROOT)
