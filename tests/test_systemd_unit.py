"""The systemd unit, its drop-in examples and tmpfiles.d entry.

``systemd-analyze verify`` (from the systemd package; systemd need not be PID 1) checks syntax,
values and that ExecStart exists. It only *warns* about unknown keys and unparsable values and
still exits 0, so ``verify`` here also fails on any warning that names our files; deliberately
broken units prove the check can fail. The installed path /usr/local/bin/nodeagent is swapped for
this environment's ``nodeagent`` script, since verify insists the binary exists.
"""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SYSTEMD_DIR = Path(__file__).resolve().parent.parent / "systemd"
UNIT = SYSTEMD_DIR / "nodeagent.service"
DROPINS = SYSTEMD_DIR / "nodeagent.service.d"
TMPFILES = SYSTEMD_DIR / "nodeagent.tmpfiles"
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


def verify(tmp_path: Path, unit_text: str, dropins: dict[str, str] | None = None) -> list[str]:
    """Problems systemd-analyze finds with the unit (and drop-ins) as written into ``tmp_path``."""
    unit = tmp_path / "nodeagent.service"
    unit.write_text(unit_text)
    for name, text in (dropins or {}).items():
        (tmp_path / "nodeagent.service.d").mkdir(exist_ok=True)
        (tmp_path / "nodeagent.service.d" / name).write_text(text)
    # The trailing ':' keeps systemd's own search path after ours (for network-online.target).
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{tmp_path}:", "SYSTEMD_LOG_COLOR": "0"}
    proc = subprocess.run(
        [tool("systemd-analyze"), "verify", "--man=no", str(unit)],
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


# --------------------------------------------------------------------------- systemd-analyze


@pytest.mark.kernel
def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    assert verify(tmp_path, localize(UNIT.read_text())) == []


@pytest.mark.kernel
def test_install_path_dropin_example_passes_verify(tmp_path: Path) -> None:
    dropin = localize((DROPINS / "10-install-path.conf.example").read_text())
    assert verify(tmp_path, localize(UNIT.read_text()), {"10-install-path.conf": dropin}) == []


@pytest.mark.kernel
@pytest.mark.parametrize(
    ("old", "new"),
    [
        pytest.param("Type=notify", "Type=notifyy", id="bad-value"),
        pytest.param("Restart=always", "Restart=sometimes", id="bad-restart"),
        pytest.param("Delegate=yes", "Delegates=yes", id="unknown-key"),
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


# --------------------------------------------------------------------------- what the unit promises


def test_unit_properties_that_matter() -> None:
    service = parse(UNIT.read_text())["Service"]
    # READY=1 from the main process only; the watchdog is pinged by the agent (agent/notify.py).
    assert (service["Type"], service["NotifyAccess"]) == ("notify", "main")
    assert service["WatchdogSec"] == "30s"
    assert service["Restart"] == "always"
    # Slots live in the delegated subtree; restarting the agent leaves workers running.
    assert service["Delegate"] == "yes"
    assert service["KillMode"] == "process"
    assert service["TasksMax"] == "infinity"
    assert service["StateDirectory"] == "nodeagent"
    assert service["StateDirectoryMode"] == "0700"
    assert service["ExecStart"].startswith("/")


@pytest.mark.parametrize(
    "key",
    [
        # A private mount namespace would hide /run/netns mounts and make /sys read-only.
        "ProtectSystem",
        "PrivateTmp",
        "PrivateDevices",
        "ProtectKernelTunables",
        "ProtectControlGroups",
        "ReadOnlyPaths",
        "MountFlags",
        # Device rules and limits on the unit would cap every slot below it.
        "DeviceAllow",
        "MemoryMax",
        "MemoryLimit",
        "CPUQuota",
        "AllowedCPUs",
        "CPUAffinity",
        "NoNewPrivileges",
    ],
)
def test_unit_sets_nothing_that_slots_would_inherit(key: str) -> None:
    assert key not in parse(UNIT.read_text())["Service"]


def test_device_policy_is_not_restrictive() -> None:
    assert parse(UNIT.read_text())["Service"].get("DevicePolicy", "auto") == "auto"


def test_unit_never_gives_up_restarting() -> None:
    unit = parse(UNIT.read_text())["Unit"]
    assert unit["StartLimitIntervalSec"] == "0"
    assert "network-online.target" in unit["After"]
