"""When the pools' thread runs a round: on its period, and on a slot change only where there is a
pool to tend. Without a pool, every allocate and release (three change notices a pair) woke the
thread for a round with nothing to do, and the hand-over of the interpreter to it was part of
each REST call's time (issue 23 item 7)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nodeagent.agent.pools import Pools
from nodeagent.agent.slot import Slot
from nodeagent.agent.state import StateStore
from nodeagent.errors import Unsupported
from nodeagent.schema.pool import parse_pool_spec

SPEC = {
    "name": "web",
    "size": 1,
    "slot": {
        "qos": "burstable",
        "resources": {"cpus": 0.5, "memory": "64Mi"},
        "worker": {"command": ["true"], "readiness": {"exec": {"argv": ["true"]}}},
    },
}


class CountingManager:
    """The manager's side the pools use: change notices out, standbys listed (one call a round)."""

    def __init__(self) -> None:
        self.subscribers: list[Callable[[], None]] = []
        self.rounds = 0
        self.lock = threading.Lock()

    def attach_pools(self, *_: Any) -> None:
        pass

    def subscribe(self, callback: Callable[[], None]) -> None:
        self.subscribers.append(callback)

    def notify(self) -> None:
        for callback in self.subscribers:
            callback()

    def standby_slots(self, pool: str | None = None) -> list[Slot]:
        if pool is None:
            with self.lock:
                self.rounds += 1
        return []

    def allocate(self, *_: Any) -> Any:
        raise Unsupported("no room in this test")  # the pool pauses; the round is still counted

    def reserve_for_claims(self, *_: Any) -> None:
        pass


def rounds(manager: CountingManager) -> int:
    with manager.lock:
        return manager.rounds


def rounds_after(manager: CountingManager, notices: int, *, expect: bool) -> int:
    """Rounds the pools ran after ``notices`` change notices: waited for up to 10 s where one is
    expected (a loaded machine may be slow to run the thread), 0.2 s where none is."""
    before = rounds(manager)
    for _ in range(notices):
        manager.notify()
        time.sleep(0.01)
    deadline = time.monotonic() + (10 if expect else 0.2)
    while time.monotonic() < deadline and not (expect and rounds(manager) > before):
        time.sleep(0.01)
    return rounds(manager) - before


def wait_rounds(manager: CountingManager, count: int) -> None:
    deadline = time.monotonic() + 10
    while rounds(manager) < count and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_change_wakes_the_pools_only_where_there_is_a_pool(tmp_path: Path) -> None:
    manager = CountingManager()
    store = StateStore(tmp_path / "state.db")
    pools = Pools(manager, store, period_seconds=3600)  # type: ignore[arg-type]
    pools.start()
    try:
        wait_rounds(manager, 1)  # the first round, at start
        assert rounds(manager) == 1
        assert rounds_after(manager, 10, expect=False) == 0  # no pool: nothing to tend, no round
        pools.create(parse_pool_spec(SPEC))
        wait_rounds(manager, 2)  # the round the creation asks for
        assert rounds_after(manager, 5, expect=True) >= 1  # a pool: a change may free room for its standby
    finally:
        pools.close()
        store.close()
