"""A released slot's worker logs: kept under released-logs/ by id and name, read like a live slot's,
pruned once older than the retention; read_log's complete_only for followers."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from nodeagent.errors import NotFound
from nodeagent.runtime.env import SlotDescription
from nodeagent.runtime.launch import SlotBinding, build_launch_request
from nodeagent.runtime.logs import LogStream, read_log
from nodeagent.runtime.workers import RELEASED_RECORD, KeeperRuntime
from nodeagent.schema.worker import parse_worker_spec


def write_log(log_dir: Path, text: str) -> None:
    log_dir.mkdir(parents=True)
    (log_dir / "worker.log").write_text(text)


@pytest.fixture
def runtime(tmp_path: Path) -> KeeperRuntime:
    return KeeperRuntime(tmp_path / "workers", None)  # connects to no keeper until a launch


def test_released_logs_are_kept_by_id_and_name_and_read_like_live_ones(
    tmp_path: Path, runtime: KeeperRuntime
) -> None:
    write_log(tmp_path / "workers" / "s1" / "logs", "2026-12-03T08:00:00.000000001Z stdout F hello\n")
    runtime.discard("s1", keep_logs_as="web")
    assert not (tmp_path / "workers" / "s1").exists()
    assert runtime.released_logs("s1") == "s1"
    assert runtime.released_logs("web") == "s1"
    assert runtime.released_logs("other") is None
    assert [line.text for line in runtime.log_lines("s1", 10)] == ["hello"]
    assert runtime.logs("s1", 10) == ["hello"]


def test_the_newest_release_of_a_name_wins(tmp_path: Path, runtime: KeeperRuntime) -> None:
    for slot_id in ("s1", "s2"):
        write_log(tmp_path / "workers" / slot_id / "logs", "x\n")
        runtime.discard(slot_id, keep_logs_as="web")
    older = tmp_path / "released-logs" / "s1" / RELEASED_RECORD
    older.write_text(json.dumps({"id": "s1", "name": "web", "released_at": 1.0}))
    assert runtime.released_logs("web") == "s2"


def test_prune_removes_what_is_older_than_the_retention(tmp_path: Path, runtime: KeeperRuntime) -> None:
    for slot_id in ("s1", "s2"):
        write_log(tmp_path / "workers" / slot_id / "logs", "x\n")
        runtime.discard(slot_id, keep_logs_as=slot_id)
    (tmp_path / "released-logs" / "s1" / RELEASED_RECORD).write_text(
        json.dumps({"id": "s1", "name": "s1", "released_at": 100.0})
    )
    assert runtime.prune_released(before=200.0) == ["s1"]
    assert runtime.released_logs("s1") is None
    assert runtime.released_logs("s2") == "s2"
    with pytest.raises(NotFound):
        runtime.log_lines("s1", 10)


def test_without_keep_logs_nothing_is_kept(tmp_path: Path, runtime: KeeperRuntime) -> None:
    write_log(tmp_path / "workers" / "s1" / "logs", "x\n")
    runtime.discard("s1")
    assert runtime.released_logs("s1") is None


def test_a_follower_sees_only_lines_that_have_ended(tmp_path: Path) -> None:
    write_log(
        tmp_path / "logs",
        "2026-12-03T08:00:00.000000001Z stdout F done\n2026-12-03T08:00:00.000000002Z stdout P half\n",
    )
    assert [line.text for line in read_log(tmp_path / "logs", 10)] == ["done", "half"]
    assert [line.text for line in read_log(tmp_path / "logs", 10, complete_only=True)] == ["done"]


def test_worker_directories_of_slots_no_longer_held_are_reaped(
    tmp_path: Path, runtime: KeeperRuntime
) -> None:
    # s1's release was killed between its row and its directory; s2 is still held.
    for slot_id in ("s1", "s2"):
        write_log(tmp_path / "workers" / slot_id / "logs", "2026-12-03T08:00:00.000000001Z stdout F hi\n")
        (tmp_path / "workers" / slot_id / "view" / "home").mkdir(parents=True)
    (tmp_path / "workers" / "stray-file").write_text("")  # not a worker directory: left alone
    assert runtime.reap(["s2", "s3"]) == ["s1"]
    assert sorted(p.name for p in (tmp_path / "workers").iterdir()) == ["s2", "stray-file"]
    assert runtime.reap(["s2"]) == []
    assert KeeperRuntime(tmp_path / "none", None).reap([]) == []


def test_a_worker_directory_and_its_log_are_the_agents_alone_whatever_the_umask(tmp_path: Path) -> None:
    spec = parse_worker_spec({"command": ["/bin/true"]})
    slot = SlotDescription(slot_id="s1", cpus=(0,), numa_nodes=(0,), memory_bytes=None)
    old = os.umask(0)
    try:
        build_launch_request(spec, slot, SlotBinding(cgroup_procs=()), tmp_path / "workers" / "s1")
        stream = LogStream(tmp_path / "workers" / "s1")
        stream.write("stdout", b"secret\n")
        stream.close()
    finally:
        os.umask(old)
    worker_dir = tmp_path / "workers" / "s1"
    assert stat.S_IMODE(worker_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((worker_dir / "worker.log").stat().st_mode) == 0o600
    assert stat.S_IMODE((worker_dir / "view").stat().st_mode) == 0o755  # what the worker is shown
