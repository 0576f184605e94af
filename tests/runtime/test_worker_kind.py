"""The kind of worker is chosen once, from the spec: what each kind answers."""

from __future__ import annotations

from nodeagent.runtime.presets import resolve
from nodeagent.runtime.worker_kind import CONTAINER, PROCESS, kind_of, slot_kind
from nodeagent.schema.request import parse_slot_request
from nodeagent.schema.worker import parse_worker_spec

PROCESS_SPEC = parse_worker_spec({"command": ["/bin/sleep", "60"]})
CONTAINER_SPEC = parse_worker_spec(
    {"container": {"image": "localhost/x:1", "mounts": [{"source": "/srv/models", "target": "/models"}]}}
)


def test_a_spec_with_a_container_is_a_container_and_anything_else_a_process() -> None:
    assert kind_of(PROCESS_SPEC) is PROCESS
    assert kind_of(CONTAINER_SPEC) is CONTAINER
    assert kind_of(None) is PROCESS
    assert (
        slot_kind(
            parse_slot_request(
                {"name": "a", "qos": "burstable", "worker": {"container": {"image": "localhost/x:1"}}}
            )
        )
        is CONTAINER
    )
    assert slot_kind(parse_slot_request({"name": "a", "qos": "burstable"})) is PROCESS


def test_what_each_kind_answers() -> None:
    # A process worker's helpers stop with it; a container's conmon and runtime must outlive it.
    assert PROCESS.signals_whole_slot
    assert not CONTAINER.signals_whole_slot
    assert [str(m.source) for m in CONTAINER.mounts(CONTAINER_SPEC)] == ["/srv/models"]
    assert PROCESS.mounts(PROCESS_SPEC) == ()
    # A container needs a slot made for containers; a process runs in either.
    assert CONTAINER.runs_in(CONTAINER)
    assert not CONTAINER.runs_in(PROCESS)
    assert PROCESS.runs_in(PROCESS)
    assert PROCESS.runs_in(CONTAINER)
    # Presets resolve a process's program; a container's image knows its own.
    assert resolve(CONTAINER_SPEC) is CONTAINER_SPEC
