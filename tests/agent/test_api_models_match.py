"""One model per schema: what the API publishes is the typed records' own JSON (``to_json``), and
its response models (agent/api_models.py, the OpenAPI document) must say exactly those fields,
no more and no fewer, and accept every value the records produce. A field added to a record
and not to its model (or the other way round) fails here, not in a client."""

from __future__ import annotations

import dataclasses

from pydantic import BaseModel

from nodeagent.agent.api_models import EndpointModel, NodeModel, SlotModel
from nodeagent.agent.service import NodeInfo
from nodeagent.agent.slot import SlotState
from nodeagent.isolation.foreign import ForeignCpu
from nodeagent.runtime.ports import Endpoint
from nodeagent.runtime.process import ExitRecord
from nodeagent.runtime.supervisor import Phase, WorkerStatus
from tests.agent.test_state import applied, slot


def _fields(model: type[BaseModel]) -> set[str]:
    return set(model.model_fields)


def test_a_slot_as_published_is_what_its_model_says() -> None:
    full = dataclasses.replace(
        slot(state=SlotState.RUNNING),
        applied=applied("s1"),
        worker=WorkerStatus(
            phase=Phase.RUNNING,
            pid=42,
            restarts=1,
            consecutive_failures=0,
            last_exit=ExitRecord(code=3, signal=None, oom_killed=False, finished_at=1.0, reason="exited"),
            next_restart_in=None,
            message="",
        ),
        foreign_cpu=ForeignCpu(seconds=0.5, fraction=0.01, since=1.0, irq_seconds=0.1, elapsed=10.0),
        sandbox_uid=600001,
        qos_actions=({"action": "memory_throttle", "at": 1.0},),
        endpoints=(Endpoint("http", "http", "127.0.0.1", 20001),),
    )
    for published in (full.to_json(), slot().to_json()):
        assert set(published) == _fields(SlotModel)
        SlotModel.model_validate(published)
    endpoint = Endpoint("grpc", "grpc", "10.231.0.2", 20002).to_json()
    assert set(endpoint) == _fields(EndpointModel)
    EndpointModel.model_validate(endpoint)


def test_the_node_as_published_is_what_its_model_says() -> None:
    node = NodeInfo(node_id="n", hostname="h", agent_version="0", started_at=1.0, cgroup_mode="v1").to_dict()
    assert set(node) == _fields(NodeModel)
    NodeModel.model_validate(node)
