"""Interpreters a sandboxed worker can run, for tests that launch real servers in default slots.

A default slot's worker runs under the slot's own unprivileged uid, so its program must be
readable and executable by that uid. This test run's own interpreter may not be: a venv made from
a Python under root's home (0700) is not. So these tests build a small venv from a world-usable
system Python, in a world-readable directory outside /tmp (which the sandbox replaces), with what
the server needs installed by this run's pip, and remove it at the end of the session.
"""

from __future__ import annotations

import atexit
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent.runtime.sandbox.mounts import DEV_SHM, TMP

#: Where the sandbox puts a slot's own tmpfs: a host file there is not what a worker sees.
REPLACED_BY_SANDBOX = (TMP, DEV_SHM)
_copies: dict[Path, Path] = {}

#: System interpreters a non-root user can run, most likely first.
CANDIDATES = ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3")


def usable_by_others(path: str) -> bool:
    """Whether a user who is neither the owner nor in the group can execute ``path``: the file and
    every directory above it (after resolving links) have the "other" execute bit."""
    return _open_to_others(Path(os.path.realpath(path)), stat.S_IXOTH)


def readable_by_others(path: Path) -> bool:
    """Whether such a user can read ``path``: the "other" read bit on it, execute on every
    directory above it."""
    return _open_to_others(path, stat.S_IROTH)


def _open_to_others(path: Path, file_bit: int) -> bool:
    try:
        if not path.stat().st_mode & file_bit:
            return False
        return all(parent.stat().st_mode & stat.S_IXOTH for parent in path.parents)
    except OSError:
        return False


def world_python() -> str:
    """A Python 3 of the host that any uid can run and that can make a venv."""
    for candidate in CANDIDATES:
        if usable_by_others(candidate):
            return candidate
    pytest.fail(f"no Python interpreter usable by an unprivileged uid among {', '.join(CANDIDATES)}")


def worker_visible(path: Path) -> str:
    """``path`` as a sandboxed worker can open it: itself, or, when this checkout lies under /tmp or
    /dev/shm (which the sandbox replaces with the slot's own) or below a directory other users
    cannot enter (a clone under root's 0700 home, or in a ``mktemp -d`` directory), a world-readable
    copy in /var/tmp (removed when the test process exits)."""
    real = path.resolve()
    hidden = any(real.is_relative_to(replaced) for replaced in REPLACED_BY_SANDBOX)
    if not hidden and readable_by_others(real):
        return str(real)
    if real not in _copies:
        base = Path(tempfile.mkdtemp(prefix=f"natest{os.getpid()}-files-", dir="/var/tmp"))
        base.chmod(0o755)
        atexit.register(shutil.rmtree, base, True)
        _copies[real] = base / real.name
        shutil.copy(real, _copies[real])
        _copies[real].chmod(0o644)
    return str(_copies[real])


def make_venv(where: Path, packages: list[str], timeout: float = 900) -> Path:
    """A venv at ``where`` with ``packages``, installed by this run's pip; its python."""
    subprocess.run([world_python(), "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    python = where / "bin" / "python"
    if packages:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", *packages],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            pytest.fail(
                f"installing {packages} into {where} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
            )
    return python


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


@pytest.fixture(scope="session")
def worker_python() -> Iterator[str]:
    """A python with NumPy (the example OIP worker's one dependency) that a slot's uid can run."""
    base = Path(tempfile.mkdtemp(prefix=f"natest{os.getpid()}-py-", dir="/var/tmp"))
    base.chmod(0o755)
    try:
        yield str(make_venv(base / "venv", [f"numpy=={_version('numpy')}"]))
    finally:
        shutil.rmtree(base, ignore_errors=True)
