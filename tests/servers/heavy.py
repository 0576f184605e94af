"""The model servers, installed for bench/validate_servers.py (the heavier ones are too big for CI):
each in a world-readable directory a slot's own uid can use, with a tiny model built here (no
weights, no model hub), and the lifecycle Case that runs it through its preset.

- MLServer (with a parallel worker) and KServe (a model.py): the CI end-to-end tests' installs and
  cases (tests/servers/fixtures.py).
- PyTriton: nvidia-pytriton from PyPI and a script that binds a Python function and serves
  (tests/servers/pytriton_model.py), through the generic preset.

- Triton: the tritonserver that nvidia-pytriton's wheel bundles (site-packages/pytriton/
  tritonserver: bin/, backends/, its own shared libraries), a Python-backend model "doubler".
- TorchServe: torchserve and torch-model-archiver from PyPI and the host's Java; a doubler.mar
  with a module-level handler (which does not use torch; TorchServe's worker imports it).
- SageMaker contract: the bring-your-own-container `serve` of tests/servers/sagemaker_serve.py.
- TF Serving: tensorflow_model_server is looked for on PATH; there is no package of it on PyPI
  (tensorflow-serving-api is the client) nor in Debian, so it is reported not installable.

Each ``build_*`` fills ``base`` (the same one again finds it done) and returns the server's Case.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from tests.servers.fixtures import build_kserve, build_mlserver, kserve_case, mlserver_case
from tests.servers.lifecycle import HTTP, Case, oip_infer, url_of
from tests.workerpy import make_venv, world_python

PYTRITON = "nvidia-pytriton==0.7.0"
#: TorchServe's Python worker imports torch, yaml and numpy whatever the handler does, and its wheel
#: declares none of them. PyPI's torch runs on CPU (and brings CUDA libraries it does not use
#: there: about 5 GB installed).
TORCHSERVE = ("torchserve==0.12.0", "torch-model-archiver==0.12.0", "torch", "pyyaml", "numpy")
HERE = Path(__file__).resolve().parent
DONE = ".installed"

TRITON_CONFIG = """\
name: "doubler"
backend: "python"
max_batch_size: 0
input [{ name: "x", data_type: TYPE_FP32, dims: [ -1 ] }]
output [{ name: "doubled", data_type: TYPE_FP32, dims: [ -1 ] }]
instance_group [{ kind: KIND_CPU, count: 1 }]
"""


class NotInstallable(Exception):
    """The server cannot be installed on this host (the reason)."""


def readable_tree(top: Path) -> None:
    """Every directory under ``top`` enterable and every file readable by any uid (pip keeps the
    executables' modes)."""
    for root, dirs, files in os.walk(top):
        for name in dirs:
            path = Path(root, name)
            if not path.is_symlink():
                path.chmod(path.stat().st_mode | 0o555)
        for name in files:
            path = Path(root, name)
            if not path.is_symlink():
                path.chmod(path.stat().st_mode | 0o444)
    top.chmod(top.stat().st_mode | 0o555)


def site_packages(venv: Path) -> Path:
    (found,) = venv.glob("lib/python3*/site-packages")
    return found


def _venv(base: Path, packages: list[str]) -> Path:
    if not (base / "venv" / DONE).exists():
        shutil.rmtree(base / "venv", ignore_errors=True)
        make_venv(base / "venv", packages, timeout=1800)
        (base / "venv" / DONE).write_text("")
    return base / "venv"


def triton_prefix(base: Path) -> Path:
    return site_packages(base / "venv") / "pytriton" / "tritonserver"


def build_triton(base: Path) -> Case:
    venv = _venv(base, [PYTRITON])
    prefix = triton_prefix(base)
    if not (prefix / "bin" / "tritonserver").exists():
        raise NotInstallable(f"{PYTRITON} has no bin/tritonserver under {prefix}")
    model = base / "models" / "doubler"
    (model / "1").mkdir(parents=True, exist_ok=True)
    shutil.copy(HERE / "triton_model.py", model / "1" / "model.py")
    (model / "config.pbtxt").write_text(TRITON_CONFIG)
    # The Python backend's stub embeds one Python version; the bundle has one per version, which
    # PyTriton puts in backends/python/ (where the backend looks for it; not the model's directory)
    # of a copy of the bundle before it starts Triton. This venv's bundle is ours: put it there.
    version = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    stub = prefix / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise NotInstallable(f"{PYTRITON} has no Python backend stub for Python {version} ({stub})")
    shutil.copy(stub, prefix / "backends" / "python" / stub.name)
    readable_tree(base)
    worker = {
        "preset": "triton",
        "model_repository": str(base / "models"),
        "model_name": "doubler",
        # The Python backend's stub embeds Python and finds its prefix as python does, by the first
        # `python3` on PATH: the venv's, with numpy (PyTriton puts it first in PATH too).
        "path": [str(prefix / "bin"), str(venv / "bin")],
    }
    return Case("triton", worker, frozenset({"http", "grpc", "metrics"}), oip_infer("doubler"))


def build_pytriton(base: Path) -> Case:
    """PyTriton as its docs run it: ``pip install nvidia-pytriton`` and a script of the user's that
    binds a Python function with ``pytriton.triton.Triton`` and serves (tests/servers/
    pytriton_model.py), through the generic preset with the three ports PyTriton's Triton has."""
    venv = _venv(base, [PYTRITON])
    shutil.copy(HERE / "pytriton_model.py", base / "server.py")
    readable_tree(base)
    worker = {
        "preset": "generic",
        "model_name": "doubler",
        "command": [
            str(venv / "bin" / "python"), str(base / "server.py"),
            "--http-port={port:http}", "--grpc-port={port:grpc}", "--metrics-port={port:metrics}",
        ],
        "ports": {"http": {}, "grpc": {}, "metrics": {}},
        # serve() stops its tritonserver and removes its workspace on SIGINT (KeyboardInterrupt).
        "stop_signal": "SIGINT",
        "stop_scope": "main",
    }  # fmt: skip
    return Case("pytriton", worker, frozenset({"http", "grpc", "metrics"}), oip_infer("doubler"))


def build_mlserver_case(base: Path) -> Case:
    return mlserver_case(build_mlserver(base))


def build_kserve_case(base: Path) -> Case:
    return kserve_case(build_kserve(base))


def build_torchserve(base: Path) -> Case:
    java = shutil.which("java")
    if java is None:
        raise NotInstallable("no java on PATH (TorchServe's frontend is Java: apt-get install a JRE)")
    venv = _venv(base, [*TORCHSERVE])
    store = base / "store"
    if not (store / "doubler.mar").exists():
        store.mkdir(exist_ok=True)
        shutil.copy(HERE / "torchserve_handler.py", base / "handler.py")
        subprocess.run(
            [str(venv / "bin" / "torch-model-archiver"), "--model-name=doubler", "--version=1.0",
             f"--handler={base / 'handler.py'}", f"--export-path={store}", "--force"],
            check=True, capture_output=True, timeout=300,
        )  # fmt: skip
    readable_tree(base)
    worker = {
        "preset": "torchserve",
        "model_repository": str(store),
        "model_name": "doubler",
        "path": [str(venv / "bin")],
    }
    ports = frozenset({"http", "management", "metrics", "grpc", "grpc_management"})
    return Case("torchserve", worker, ports, torchserve_infer)


def torchserve_infer(slot: dict[str, Any]) -> list[float]:
    answer = HTTP.post(f"{url_of(slot)}/predictions/doubler", json=[1.0, 2.5, -4.0])
    assert answer.status_code == 200, answer.text
    return list(answer.json())


def build_sagemaker(base: Path) -> Case:
    (base / "bin").mkdir(exist_ok=True)
    serve = base / "bin" / "serve"
    text = (HERE / "sagemaker_serve.py").read_text()
    serve.write_text(f"#!{world_python()}\n{text}")
    serve.chmod(0o755)
    readable_tree(base)
    worker = {"preset": "sagemaker", "path": [str(base / "bin")]}
    return Case("sagemaker", worker, frozenset({"http"}), sagemaker_infer)


def sagemaker_infer(slot: dict[str, Any]) -> list[float]:
    answer = HTTP.post(f"{url_of(slot)}/invocations", json={"instances": [1.0, 2.5, -4.0]})
    assert answer.status_code == 200, answer.text
    return list(answer.json()["predictions"])


def build_tfserving(base: Path) -> Case:
    program = shutil.which("tensorflow_model_server")
    if program is None:
        raise NotInstallable(
            "tensorflow_model_server is not on PATH and has no package here: PyPI has only the client "
            "(tensorflow-serving-api), Debian none; Google's apt repository and Docker images are "
            "not reachable from this host"
        )
    raise NotInstallable(
        f"{program} is there, but this script has no TensorFlow to build a SavedModel with: "
        "validate it with a model of yours"
    )


BUILDERS = {
    "mlserver": build_mlserver_case,
    "kserve": build_kserve_case,
    "pytriton": build_pytriton,
    "triton": build_triton,
    "torchserve": build_torchserve,
    "tfserving": build_tfserving,
    "sagemaker": build_sagemaker,
}


def versions(base: Path) -> dict[str, str]:
    """The installed distributions' versions of a venv under ``base`` (for the report)."""
    venv = base / "venv"
    if not (venv / "bin" / "python").exists():
        return {}
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import importlib.metadata as m, json; "
         "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))"],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    return dict(json.loads(done.stdout)) if done.returncode == 0 else {}


__all__ = ["BUILDERS", "NotInstallable", "readable_tree", "triton_prefix", "versions"]
