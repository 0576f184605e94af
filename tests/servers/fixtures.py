"""Real model servers for tests: MLServer and KServe's model server from PyPI (CPU only), each in a
venv a slot's own uid can run (tests.workerpy), with a tiny model built here (tests/servers/*.py):
no model hub, no weights, and the lifecycle Case that runs each through its preset (also used by
bench/validate_servers.py). Session fixtures; the venvs go at the end of the session."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers.lifecycle import Case, oip_infer
from tests.workerpy import make_venv

#: MLServer 1.7.1's parallel workers fail to start with uvloop 0.22 and later, which a plain
#: `pip install mlserver` brings ("There is no current event loop", SeldonIO/MLServer#2286, not
#: fixed in a release): every model fails to load, with or without the agent.
MLSERVER = ("mlserver==1.7.1", "uvloop<0.22")
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


#: MLServer's own settings for the test repository, as its docs write them: models served by one
#: parallel worker process (the preset's MLSERVER_PARALLEL_WORKERS=0 is what this overrides), the
#: shape that needs a writable working directory (.metrics/, .envs/).
MLSERVER_SETTINGS = {"parallel_workers": 1}
DONE = ".installed"


def _make_venv_once(venv: Path, packages: list[str]) -> None:
    """``make_venv`` unless an earlier run finished it (a kept install directory)."""
    if (venv / DONE).exists():
        return
    shutil.rmtree(venv, ignore_errors=True)
    make_venv(venv, packages)
    (venv / DONE).write_text("")


def build_mlserver(base: Path) -> Path:
    """``base`` with ``venv/`` (``pip install mlserver``) and ``models/`` (MLServer's settings.json
    and the test model, ``doubler/``)."""
    _make_venv_once(base / "venv", [*MLSERVER])
    model = base / "models" / "doubler"
    model.mkdir(parents=True, exist_ok=True)
    (base / "models" / "settings.json").write_text(json.dumps(MLSERVER_SETTINGS))
    shutil.copy(HERE / "mlserver_model.py", model / "mlserver_model.py")
    (model / "model-settings.json").write_text(
        json.dumps({"name": "doubler", "implementation": "mlserver_model.Doubler"})
    )
    _readable(base / "models", model, base / "models" / "settings.json", *model.iterdir())
    return base


def build_kserve(base: Path) -> Path:
    """``base`` with ``venv/`` (``pip install kserve``) and ``model.py`` (the test model server,
    written as KServe's examples write one)."""
    _make_venv_once(base / "venv", [KSERVE])
    shutil.copy(HERE / "kserve_model.py", base / "model.py")
    _readable(base / "model.py")
    return base


def mlserver_case(base: Path) -> Case:
    """MLServer through its preset as docs/model-servers.md shows it (parallel workers from the
    repository's settings.json)."""
    worker = {
        "preset": "mlserver",
        "model_repository": str(base / "models"),
        "model_name": "doubler",
        "path": [str(base / "venv" / "bin")],
    }
    return Case("mlserver", worker, frozenset({"http", "grpc", "metrics"}), oip_infer("doubler"))


def kserve_case(base: Path) -> Case:
    """KServe's model server: the user's model.py run by the venv's python, through the preset."""
    worker = {
        "preset": "kserve",
        "command": [str(base / "venv" / "bin" / "python"), str(base / "model.py")],
        "model_name": "doubler",
    }
    return Case("kserve", worker, frozenset({"http", "grpc"}), oip_infer("doubler"))


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
