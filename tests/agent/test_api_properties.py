"""The REST API against its own OpenAPI document: every operation, with bodies generated from the
schema (schemathesis), over a real SlotManager (placement, state database, supervision; fake kernel
and workers). No answer is a 5xx, every error has the one error shape, the answers match the
document, and the state stays consistent: nothing the API accepted makes a later read fail, and no
CPU is held twice."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import positive_data_acceptance

from nodeagent.agent.api import create_app
from nodeagent.agent.manager import SlotManager
from nodeagent.agent.recovery import Manifests
from nodeagent.agent.slot import HOLDING
from nodeagent.agent.state import StateStore
from tests.agent.test_manager import TOPOLOGY, FakeIsolation, FakeRuntime, World

TOKEN = "natest-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

# Built at import: schemathesis generates the test cases from the app's document at collection.
STATE = Path(tempfile.mkdtemp(prefix="natest-api-properties-"))
MANAGER = SlotManager(
    StateStore(STATE / "state.db", manifests=Manifests(STATE / "slots")),
    TOPOLOGY,
    FakeIsolation(World()),
    FakeRuntime(World()),
)
MANAGER.start(supervise=False)
# A run that collects this module without running it (a focused run, --collect-only) still
# removes what the import made.
atexit.register(shutil.rmtree, STATE, ignore_errors=True)
schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(MANAGER, token=TOKEN))


@pytest.fixture(scope="module", autouse=True)
def _close_the_manager() -> Iterator[None]:
    yield
    MANAGER.close()
    shutil.rmtree(STATE, ignore_errors=True)


@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_every_operation_answers_within_its_contract(case: schemathesis.Case) -> None:
    # Every check schemathesis has but "schema-valid data is accepted": what JSON Schema cannot say
    # stays the service's to refuse (422): rules across fields (gpu_share with gpus, soft <= hard
    # rlimits, a guaranteed slot's whole CPUs, a preset's model), the range of a quantity string
    # ("99999Ei"), and what placement says does not fit (409).
    response = case.call_and_validate(headers=AUTH, excluded_checks=[positive_data_acceptance])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"code", "message"}
        assert error["message"]
    slots = MANAGER.list_slots()  # nothing the API accepted makes a read fail
    held = [
        cpu
        for slot in slots
        if slot.state in HOLDING and slot.assignment is not None and slot.assignment.exclusive
        for cpu in slot.assignment.cpus
    ]
    assert len(held) == len(set(held)), f"a CPU is held twice: {sorted(held)}"
