"""The systemd units, their drop-in examples, the tmpfiles.d entry and systemd/install.

``systemd-analyze verify`` (from the systemd package; systemd need not be PID 1) checks syntax,
values and that ExecStart exists. It only *warns* about unknown keys and unparsable values and
still exits 0, so ``verify`` here also fails on any warning that names our files; deliberately
broken units prove the check can fail. The installed path /usr/local/bin/nodeagent is swapped for
this environment's ``nodeagent`` script, since verify insists the binary exists.

What the units do on a running systemd (delegation across daemon-reload, restarts, the watchdog) is
proven in tests/systemd/vm, inside a VM whose PID 1 is systemd.
"""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nodeagent.runtime.sandbox.caps import ROOT_CAPABILITIES

REPO = Path(__file__).resolve().parent.parent
SYSTEMD_DIR = REPO / "systemd"
UNIT = SYSTEMD_DIR / "nodeagent.service"
SLOTS_UNIT = SYSTEMD_DIR / "nodeagent-slots.service"
SLICE = SYSTEMD_DIR / "nodeagent.slice"
DROPINS = SYSTEMD_DIR / "nodeagent.service.d"
TMPFILES = SYSTEMD_DIR / "nodeagent.tmpfiles"
INSTALL = SYSTEMD_DIR / "install"
INSTALLED_PATHS = ("/usr/local/bin/nodeagent", "/opt/nodeagent/venv/bin/nodeagent")


def nodeagent_script() -> str:
    script = Path(sys.executable).parent / "nodeagent"
    found = str(script) if script.exists() else shutil.which("nodeagent")
    if found is None:
        pytest.fail("the nodeagent console script is not installed; run `pip install -e .` first")
    return found


def localize(text: str) -> str:
    for path in INSTALLED_PATHS:
        text = text.replace(path, nodeagent_script())
    return text


def tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} not found: install the systemd package (apt-get install systemd)")
    return found


def verify(
    tmp_path: Path, unit_text: str, dropins: dict[str, str] | None = None, *, only_agent: bool = False
) -> list[str]:
    """Problems systemd-analyze finds with the units (the agent's as ``unit_text``, and drop-ins) as
    written into ``tmp_path``; the slice and the slots unit are verified too unless ``only_agent``."""
    unit = tmp_path / "nodeagent.service"
    unit.write_text(unit_text)
    shutil.copy(SLOTS_UNIT, tmp_path)
    shutil.copy(SLICE, tmp_path)
    for name, text in (dropins or {}).items():
        (tmp_path / "nodeagent.service.d").mkdir(exist_ok=True)
        (tmp_path / "nodeagent.service.d" / name).write_text(text)
    targets = [unit] if only_agent else [unit, tmp_path / SLOTS_UNIT.name, tmp_path / SLICE.name]
    # The trailing ':' keeps systemd's own search path after ours (for network-online.target).
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{tmp_path}:", "SYSTEMD_LOG_COLOR": "0"}
    proc = subprocess.run(
        [tool("systemd-analyze"), "verify", "--man=no", *map(str, targets)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    problems = [line for line in (proc.stdout + proc.stderr).splitlines() if "nodeagent" in line]
    if proc.returncode != 0:
        problems.append(f"exit status {proc.returncode}")
    return problems


def parse(text: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, delimiters=("=",), strict=True)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(text)
    return parser


def systemd_version() -> int:
    out = subprocess.run([tool("systemctl"), "--version"], capture_output=True, text=True, check=True).stdout
    return int(out.split()[1])


# --------------------------------------------------------------------------- systemd-analyze


@pytest.mark.kernel
def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    assert verify(tmp_path, localize(UNIT.read_text())) == []


@pytest.mark.kernel
def test_install_path_dropin_example_passes_verify(tmp_path: Path) -> None:
    dropin = localize((DROPINS / "10-install-path.conf.example").read_text())
    assert verify(tmp_path, localize(UNIT.read_text()), {"10-install-path.conf": dropin}) == []


@pytest.mark.kernel
def test_subgroup_dropin_example_is_valid_where_systemd_knows_delegate_subgroup(tmp_path: Path) -> None:
    dropin = (DROPINS / "20-cgroup2-subgroup.conf.example").read_text()
    problems = verify(tmp_path, localize(UNIT.read_text()), {"20-cgroup2-subgroup.conf": dropin})
    if systemd_version() < 254:  # DelegateSubgroup= came with systemd 254: the only thing it may not know
        problems = [p for p in problems if "DelegateSubgroup" not in p]
    assert problems == []


@pytest.mark.kernel
@pytest.mark.parametrize(
    ("old", "new"),
    [
        pytest.param("Type=notify", "Type=notifyy", id="bad-value"),
        pytest.param("Restart=always", "Restart=sometimes", id="bad-restart"),
        pytest.param("Slice=nodeagent.slice", "Slices=nodeagent.slice", id="unknown-key"),
        pytest.param("~@clock", "~@clocks", id="unknown-syscall-group"),
        pytest.param(
            "ExecStart=/usr/local/bin/nodeagent", "ExecStart=/nonexistent/natest", id="missing-exec"
        ),
        pytest.param(
            "ExecStart=/usr/local/bin/nodeagent", "ExecStart=natest-not-on-path", id="exec-not-on-path"
        ),
    ],
)
def test_a_broken_unit_fails_verify(tmp_path: Path, old: str, new: str) -> None:
    text = UNIT.read_text()
    assert old in text
    assert verify(tmp_path, localize(text.replace(old, new))) != []


@pytest.mark.kernel
def test_a_broken_slots_unit_fails_verify(tmp_path: Path) -> None:
    shutil.copy(SLICE, tmp_path)
    broken = SLOTS_UNIT.read_text().replace("Delegate=yes", "Delegate=maybe")
    (tmp_path / SLOTS_UNIT.name).write_text(broken)
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{tmp_path}:", "SYSTEMD_LOG_COLOR": "0"}
    proc = subprocess.run(
        [tool("systemd-analyze"), "verify", "--man=no", str(tmp_path / SLOTS_UNIT.name)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert re.search(r"nodeagent-slots\.service:\d+: Invalid controller name 'maybe'", proc.stderr)


@pytest.mark.kernel
def test_a_broken_dropin_fails_verify(tmp_path: Path) -> None:
    problems = verify(tmp_path, localize(UNIT.read_text()), {"99-bad.conf": "[Service]\nKillMode=gently\n"})
    assert problems != []


@pytest.mark.kernel
def test_tmpfiles_create_the_directories(tmp_path: Path) -> None:
    subprocess.run(
        [tool("systemd-tmpfiles"), "--create", f"--root={tmp_path}", str(TMPFILES)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    modes = {
        p: (tmp_path / p).stat().st_mode & 0o7777 for p in ("run/netns", "var/lib/nodeagent", "etc/nodeagent")
    }
    assert modes == {"run/netns": 0o755, "var/lib/nodeagent": 0o700, "etc/nodeagent": 0o755}


@pytest.mark.kernel
def test_a_broken_tmpfiles_line_fails(tmp_path: Path) -> None:
    bad = tmp_path / "bad.conf"
    bad.write_text(TMPFILES.read_text() + "d relative/path 0755 root root -\n")
    proc = subprocess.run(
        [tool("systemd-tmpfiles"), "--create", f"--root={tmp_path / 'root'}", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode != 0
    assert "not absolute" in proc.stderr


# --------------------------------------------------------------------------- systemd/install


@pytest.mark.kernel
def test_install_writes_units_that_verify_and_run_the_given_venv(tmp_path: Path) -> None:
    prefix = tmp_path / "opt"
    (prefix / "venv/bin").mkdir(parents=True)
    (prefix / "venv/bin/nodeagent").symlink_to(nodeagent_script())
    root = tmp_path / "root"
    tool("systemd-tmpfiles")
    subprocess.run(
        [str(INSTALL), "--skip-venv", "--prefix", str(prefix), "--root", str(root)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    units = root / "etc/systemd/system"
    assert sorted(p.name for p in units.iterdir()) == [
        "nodeagent-slots.service",
        "nodeagent.service",
        "nodeagent.service.d",
        "nodeagent.slice",
    ]
    dropin = (units / "nodeagent.service.d/10-install-path.conf").read_text()
    assert f"ExecStart={prefix}/venv/bin/nodeagent serve" in dropin
    assert (root / "var/lib/nodeagent").stat().st_mode & 0o777 == 0o700
    # The packaged ExecStart need not exist: the drop-in replaces it.
    (tmp_path / "check").mkdir()
    assert verify(tmp_path / "check", UNIT.read_text(), {"10-install-path.conf": dropin}) == []


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--prefix", "relative/dir"], "--prefix must be an absolute path"),
        (["--bogus"], "unknown argument --bogus"),
        (
            ["--skip-venv", "--prefix", "/nonexistent/natest"],
            "/nonexistent/natest/venv/bin/nodeagent is missing",
        ),
    ],
)
def test_install_refuses_bad_arguments(args: list[str], says: str) -> None:
    proc = subprocess.run([str(INSTALL), *args], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode != 0
    assert says in proc.stderr


# --------------------------------------------------------------------------- what the units promise


def service(path: Path) -> configparser.SectionProxy:
    return parse(path.read_text())["Service"]


def test_the_agent_unit() -> None:
    agent = service(UNIT)
    # READY=1 from the main process only; the watchdog is pinged by the agent (agent/notify.py).
    assert (agent["Type"], agent["NotifyAccess"]) == ("notify", "main")
    assert agent["WatchdogSec"] == "30s"
    assert agent["Restart"] == "always"
    assert agent["ExecStart"].startswith("/")
    assert agent["StateDirectory"] == "nodeagent"
    assert agent["StateDirectoryMode"] == "0700"
    # The agent's cgroup holds the agent alone: the slots' cgroup is the slots unit's, in one slice.
    assert "Delegate" not in agent
    assert agent["Slice"] == "nodeagent.slice"
    assert agent["KillMode"] == "mixed"
    unit = parse(UNIT.read_text())["Unit"]
    assert "nodeagent-slots.service" in unit["Wants"].split()
    assert "nodeagent-slots.service" in unit["After"].split()
    assert unit["PartOf"] == "nodeagent-slots.service"


def test_the_slots_unit_holds_a_delegated_cgroup_it_never_restarts() -> None:
    slots = service(SLOTS_UNIT)
    assert (slots["Delegate"], slots["Slice"]) == ("yes", "nodeagent.slice")
    assert slots["TasksMax"] == "infinity"
    assert slots["KillMode"] == "control-group"  # stopping it ends every worker
    assert slots["RemainAfterExit"] == "yes"  # the pin's death does not
    assert "Restart" not in slots
    pin = slots["ExecStart"].split()
    assert pin[1:] == ["infinity"]
    assert Path(pin[0]).exists()


@pytest.mark.parametrize(
    "key",
    [
        # A mount (or UTS) namespace the keeper and workers would inherit: /run/netns hidden from the
        # host, /sys and /proc read-only.
        "ProtectSystem",
        "ProtectHome",
        "PrivateTmp",
        "PrivateDevices",
        "ProtectKernelTunables",
        "ProtectKernelModules",
        "ProtectKernelLogs",
        "ProtectControlGroups",
        "ProtectClock",
        "ProtectHostname",
        "ProtectProc",
        "PrivateMounts",
        "ReadOnlyPaths",
        "InaccessiblePaths",
        "MountFlags",
        # Inherited by every worker, which may opt out of them by name.
        "NoNewPrivileges",
        "RestrictNamespaces",
        "RestrictAddressFamilies",
        "MemoryDenyWriteExecute",
        "RestrictRealtime",
        "PrivateNetwork",
        "PrivateUsers",
    ],
)
def test_agent_unit_sets_nothing_the_keeper_and_workers_would_inherit(key: str) -> None:
    assert key not in service(UNIT)


@pytest.mark.parametrize(
    "key",
    [
        # Rules and limits on the delegated cgroup bound every slot below it.
        "DeviceAllow",
        "PrivateDevices",
        "ProtectClock",
        "IPAddressDeny",
        "IPAddressAllow",
        "MemoryMax",
        "MemoryHigh",
        "MemoryLimit",
        "CPUQuota",
        "CPUWeight",
        "AllowedCPUs",
        "AllowedMemoryNodes",
        "IOWeight",
        "RestrictNetworkInterfaces",
        "SocketBindDeny",
    ],
)
def test_slots_unit_and_slice_set_nothing_that_bounds_the_slots(key: str) -> None:
    assert key not in service(SLOTS_UNIT)
    assert key not in parse(SLICE.read_text())["Slice"]
    assert service(SLOTS_UNIT).get("DevicePolicy", "auto") == "auto"


#: What the agent and the sandbox do: mounts and namespaces, cgroups and device programs, pidfds,
#: dropping privileges, seccomp; and what workers commonly need (profilers, NUMA, io_uring).
NEEDED_SYSCALLS = (
    "mount", "umount2", "pivot_root", "unshare", "setns", "clone", "clone3", "bpf", "pidfd_open",
    "pidfd_send_signal", "setuid", "setgid", "setgroups", "capset", "prctl", "seccomp", "ioctl",
    "mknodat", "perf_event_open", "ptrace", "mbind", "set_mempolicy", "sched_setaffinity",
    "io_uring_setup", "memfd_create", "clock_gettime", "clock_nanosleep", "personality",
)  # fmt: skip


@pytest.mark.kernel
def test_the_system_call_filter_denies_only_what_nobody_needs() -> None:
    spec = service(UNIT)["SystemCallFilter"]
    assert spec.startswith("~"), "an allow-list would bound every worker's system calls"
    out = subprocess.run(
        [tool("systemd-analyze"), "syscall-filter", "--no-pager", *spec[1:].split()],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    denied = {line.strip() for line in out.splitlines() if re.fullmatch(r"\s+[a-z0-9_]+", line)}
    assert not denied & set(NEEDED_SYSCALLS)
    assert {"reboot", "kexec_load", "init_module", "settimeofday", "iopl", "swapon"} <= denied
    assert service(UNIT)["SystemCallErrorNumber"] == "EPERM"


#: What the agent itself needs: cgroups, mounts, namespaces (SYS_ADMIN), networks (NET_ADMIN), device
#: programs (BPF, PERFMON), signals and pidfds of any uid (KILL, SYS_PTRACE), rlimits and scheduling
#: of workers (SYS_RESOURCE, SYS_NICE), dropping to worker users (SETUID, SETGID, SETPCAP), device nodes
#: in private /dev (MKNOD), its files (CHOWN, FOWNER, DAC_OVERRIDE, DAC_READ_SEARCH).
AGENT_CAPABILITIES = (
    "SYS_ADMIN", "NET_ADMIN", "BPF", "PERFMON", "KILL", "SYS_PTRACE", "SYS_RESOURCE", "SYS_NICE",
    "SETUID", "SETGID", "SETPCAP", "MKNOD", "CHOWN", "FOWNER", "DAC_OVERRIDE", "DAC_READ_SEARCH",
    "SYS_CHROOT", "NET_RAW", "IPC_LOCK",
)  # fmt: skip


def test_the_capability_bounding_set_keeps_what_the_agent_and_workers_use() -> None:
    spec = service(UNIT)["CapabilityBoundingSet"]
    assert spec.startswith("~"), "dropping a list, not keeping one"
    dropped = {name.removeprefix("CAP_") for name in spec[1:].split()}
    assert not dropped & set(AGENT_CAPABILITIES)
    assert not dropped & set(ROOT_CAPABILITIES), "the capabilities a root worker keeps must stay grantable"
    assert {"SYS_BOOT", "SYS_MODULE", "SYS_TIME"} <= dropped


def test_units_never_give_up_restarting_the_agent() -> None:
    unit = parse(UNIT.read_text())["Unit"]
    assert unit["StartLimitIntervalSec"] == "0"
    assert "network-online.target" in unit["After"]
