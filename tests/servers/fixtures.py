"""Real model servers for tests: MLServer and KServe's model server from PyPI (CPU only), each in a
venv a slot's own uid can run (tests.workerpy), with a tiny model built here (tests/servers/*.py):
no model hub, no weights. Session fixtures; the venvs go at the end of the session."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.workerpy import make_venv

MLSERVER = "mlserver==1.7.1"
KSERVE = "kserve==0.21.0"
HERE = Path(__file__).resolve().parent


def new_base(kind: str) -> Path:
    """A world-readable directory in /var/tmp (which a slot's sandbox leaves in place)."""
    base = Path(tempfile.mkdtemp(prefix=f"natest{os.getpid()}-{kind}-", dir="/var/tmp"))
    base.chmod(0o755)
    return base


def _readable(*paths: Path) -> None:
    for path in paths:
        path.chmod(0o755 if path.is_dir() else 0o644)


def build_mlserver(base: Path) -> Path:
    """``base`` with ``venv/`` (MLServer) and ``models/doubler/`` (the test model)."""
    make_venv(base / "venv", [MLSERVER])
    model = base / "models" / "doubler"
    model.mkdir(parents=True)
    shutil.copy(HERE / "mlserver_model.py", model / "mlserver_model.py")
    (model / "model-settings.json").write_text(
        json.dumps({"name": "doubler", "implementation": "mlserver_model.Doubler"})
    )
    _readable(base / "models", model, *model.iterdir())
    return base


def build_kserve(base: Path) -> Path:
    """``base`` with ``venv/`` (KServe) and ``model.py`` (the test model server)."""
    make_venv(base / "venv", [KSERVE])
    shutil.copy(HERE / "kserve_model.py", base / "model.py")
    _readable(base / "model.py")
    return base


@pytest.fixture(scope="session")
def mlserver_install() -> Iterator[Path]:
    base = new_base("mlserver")
    try:
        yield build_mlserver(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def kserve_install() -> Iterator[Path]:
    base = new_base("kserve")
    try:
        yield build_kserve(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
