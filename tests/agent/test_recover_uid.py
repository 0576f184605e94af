"""serve --recover after a lost database: a rebuilt slot takes back the uid its worker runs as, or
its worker is ended (issue 21 item 5). The end-to-end case is in test_startup.py; these are the
ways a uid cannot be restored, and the store's side of it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from nodeagent.agent.parts import IdentityPart, process_uid
from nodeagent.agent.recovery import Manifests
from nodeagent.agent.sandbox_config import SandboxConfig
from nodeagent.agent.state import StateStore
from nodeagent.errors import Conflict
from tests.agent.test_state import slot

FIRST, LAST = 700000, 700010


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StateStore]:
    s = StateStore(tmp_path / "state.db", manifests=Manifests(tmp_path / "slots"))
    for slot_id, name in (("s1", "a"), ("s2", "b")):
        s.insert_slot(slot(slot_id, name))
    yield s
    s.close()


@pytest.fixture
def worker() -> Iterator[subprocess.Popen[bytes]]:
    """A process of this test's uid (outside the range): a worker the agent cannot give back."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def identity(store: StateStore) -> IdentityPart:
    sandbox = SimpleNamespace(active=True, config=SandboxConfig(uid_range=f"{FIRST}-{LAST}"))
    return IdentityPart(store, cast(Any, sandbox))


def test_the_manifests_uid_comes_back_when_no_process_runs(store: StateStore) -> None:
    said = identity(store).restore("s1", (), {"sandbox_uid": FIRST + 3})
    assert said == f"; its workers keep uid {FIRST + 3}"
    assert store.get_sandbox_uid("s1") == FIRST + 3
    # Recorded in the manifest too, for the next loss.
    assert store.manifests is not None
    manifest = store.manifests.read("s1")
    assert manifest is not None
    assert manifest["sandbox_uid"] == FIRST + 3


def test_a_restored_uid_no_longer_rests(tmp_path: Path) -> None:
    now = [1000.0]
    s = StateStore(tmp_path / "q.db", clock=lambda: now[0])
    try:
        for slot_id, name in (("s1", "a"), ("s2", "b"), ("s3", "c")):
            s.insert_slot(slot(slot_id, name))
        uid = s.sandbox_uid("s1", FIRST, LAST, lambda u: False, 600)
        s.delete_slot("s1")
        s.restore_sandbox_uid("s2", uid)  # its worker runs as that uid: the slot's own now
        assert s.sandbox_uid("s3", FIRST, LAST, lambda u: False, 600) != uid
        s.delete_slot("s2")  # and it rests again from its own release
        s.insert_slot(slot("s4", "d"))
        assert s.sandbox_uid("s4", FIRST, LAST, lambda u: False, 600) != uid
    finally:
        s.close()


def test_a_uid_another_slot_holds_is_not_restored(store: StateStore) -> None:
    held = store.sandbox_uid("s2", FIRST, LAST, lambda u: False)
    with pytest.raises(Conflict, match=f"uid {held} is held by slot s2"):
        store.restore_sandbox_uid("s1", held)
    said = identity(store).restore("s1", (), {"sandbox_uid": held})
    assert said.startswith(f"; its uid could not be restored (uid {held} is held by slot s2)")
    assert store.get_sandbox_uid("s1") is None  # its next worker gets one of its own
    assert store.get_sandbox_uid("s2") == held


def test_a_worker_running_outside_the_range_is_ended(
    store: StateStore, worker: subprocess.Popen[bytes]
) -> None:
    uid = os.getuid()
    assert process_uid(worker.pid) == uid
    # The kernel's word wins over the manifest's: the uid the processes run as is what matters.
    said = identity(store).restore("s1", (worker.pid,), {"sandbox_uid": FIRST})
    assert f"uid {uid} lies outside [sandbox] uid_range {FIRST}-{LAST}" in said
    assert "its worker was ended and starts anew" in said
    assert worker.wait(timeout=60) == -signal.SIGKILL  # a bound on a hang, not on time
    assert store.get_sandbox_uid("s1") is None


def test_a_gone_process_has_no_uid(worker: subprocess.Popen[bytes]) -> None:
    worker.kill()
    worker.wait()
    assert process_uid(worker.pid) is None
