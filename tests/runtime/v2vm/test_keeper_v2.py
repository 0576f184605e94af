"""The host keeper on a unified-only (cgroup v2) kernel: a worker joins its slot through cgroup.procs
(v2 has no tasks file) before its first instruction, and once its main process exits, what is left
in the slot is ended before the exit is recorded."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent.runtime.keeper_client import KeeperClient
from nodeagent.runtime.logs import read_log
from tests.runtime.conftest import current_keeper, make_request, wait_for_exit, wait_until

ROOT = Path("/sys/fs/cgroup")


@pytest.fixture
def slot() -> Iterator[Path]:
    path = ROOT / f"natest{os.getpid()}k"
    path.mkdir()
    yield path
    if (path / "cgroup.kill").exists():
        (path / "cgroup.kill").write_text("1")
    deadline = time.monotonic() + 5
    while (path / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.02)
    path.rmdir()


def test_a_worker_joins_its_v2_slot_and_leaves_nothing_behind(tmp_path, slot: Path, keeper: KeeperClient):
    script = "cat /proc/self/cgroup; sleep 300 & sleep 300 & sleep 0.3; exit 4"
    req = make_request(
        tmp_path,
        None,
        ["sh", "-c", script],
        cgroup_procs=(str(slot / "cgroup.procs"),),
        stop_grace_seconds=0.5,
    )
    keeper.launch(req).close()
    record = wait_for_exit(Path(req.run_dir))
    assert (record.code, record.reason) == (4, "exited")
    assert (slot / "cgroup.procs").read_text() == ""  # the helpers were ended before the record
    log_dir = Path(req.log_dir)
    lines = wait_until("the worker's output", lambda: read_log(log_dir, 5))
    assert lines[0].text == f"0::/{slot.name}"  # sh itself (exec'd, not forked) was in the slot
    assert (
        f"0::/{slot.name}" not in Path(f"/proc/{current_keeper(tmp_path / 'keeper').pid}/cgroup").read_text()
    )
