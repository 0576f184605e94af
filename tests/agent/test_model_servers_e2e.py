"""Real model servers through the agent's REST API, sandboxed, on the real kernel: MLServer (with a
parallel worker process, from its repository's settings.json) and KServe's model server (a model.py
as KServe's examples write one), from PyPI, CPU only, a tiny model built in tests/servers, each
through its preset as docs/model-servers.md shows it, put through tests/servers/lifecycle.py's
checks:

- two slots of the same server, ready through the preset's model probe, on ports the agent
  assigned, each answering an inference;
- re-adopted after the agent is SIGKILLed (same pid, still answering);
- restarted after its main process is SIGKILLed, with nothing of the old tree left;
- a graceful stop drains (the worker is `stopping` at once and still answers during the drain,
  then exits on its stop signal, not by SIGKILL);
- release leaves no process, no listening port and no file of the slot's uid behind.

The heavier servers (Triton, TorchServe, the SageMaker contract) get the same checks by hand:
bench/validate_servers.py. The daemon, its cgroup parent and the clean-up are test_e2e's (names
carry "natest" and this pid).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.agent.test_e2e import Daemon
from tests.servers.fixtures import kserve_case, kserve_install, mlserver_case, mlserver_install
from tests.servers.lifecycle import Case, Lifecycle, remove_daemon, server_daemon

pytestmark = [pytest.mark.root, pytest.mark.slow]

__all__ = ["kserve_install", "mlserver_install"]  # fixtures


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = server_daemon(tmp_path)
    try:
        yield d
    finally:
        remove_daemon(d)


SERVERS: dict[str, tuple[str, Callable[[Path], Case]]] = {
    "mlserver": ("mlserver_install", mlserver_case),
    "kserve": ("kserve_install", kserve_case),
}


@pytest.mark.parametrize("server", sorted(SERVERS))
def test_a_real_model_server_through_the_agent(
    server: str, daemon: Daemon, request: pytest.FixtureRequest
) -> None:
    fixture, case = SERVERS[server]
    install: Path = request.getfixturevalue(fixture)
    Lifecycle(daemon, case(install)).run()
