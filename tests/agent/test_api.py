"""The REST API against the in-memory fake service: every path, auth, error shapes, hostile input."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from nodeagent.agent.api import create_app, describe_validation_errors
from nodeagent.agent.metrics import Metrics
from nodeagent.cgroups.resources import CgroupStats, OomEvents
from nodeagent.errors import KernelError
from nodeagent.schema.request import NUMA_POLICIES, QOS_CLASSES, SlotRequest
from tests.agent.fake_service import FakeSlotService

TOKEN = "natest-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
GUARANTEED = {
    "name": "llm-a",
    "qos": "guaranteed",
    "resources": {"cpus": 2, "memory": "1Gi", "numa": "single"},
}


class AppClient:
    """A synchronous client that calls the ASGI app in-process (httpx's ASGITransport).

    starlette.testclient is avoided on purpose: with plain httpx installed it emits a deprecation
    warning, and warnings are errors here.
    """

    def __init__(self, app: FastAPI, headers: dict[str, str] | None = None) -> None:
        self.app = app
        self.headers = headers or {}

    def request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        async def call() -> httpx.Response:
            transport = httpx.ASGITransport(app=self.app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://agent", headers=self.headers
            ) as c:
                return await c.request(method, url, **kwargs)

        return asyncio.run(call())

    def get(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("GET", url, **kwargs)

    def post(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("POST", url, **kwargs)

    def patch(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("PATCH", url, **kwargs)

    def delete(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("DELETE", url, **kwargs)


@pytest.fixture
def service() -> FakeSlotService:
    return FakeSlotService()


@pytest.fixture
def client(service: FakeSlotService) -> AppClient:
    return AppClient(create_app(service, token=TOKEN), AUTH)


def error_of(response: httpx.Response) -> tuple[int, str, str]:
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"code", "message"}, body
    return response.status_code, body["error"]["code"], body["error"]["message"]


# --------------------------------------------------------------------------- happy paths


def test_allocate_creates_then_repeats_idempotently_then_conflicts(
    client: AppClient, service: FakeSlotService
) -> None:
    first = client.post("/v1/slots", json=GUARANTEED)
    assert first.status_code == 201
    slot = first.json()
    assert first.headers["location"] == f"/v1/slots/{slot['id']}"
    assert (slot["name"], slot["state"], slot["assignment"]["exclusive"]) == ("llm-a", "ready", True)

    again = client.post("/v1/slots", json=GUARANTEED)
    assert (again.status_code, again.json()["id"]) == (200, slot["id"])

    different = {**GUARANTEED, "resources": {"cpus": 4}}
    status, code, message = error_of(client.post("/v1/slots", json=different))
    assert (status, code) == (409, "conflict")
    assert "llm-a" in message
    assert len(service.list_slots()) == 1


def test_slot_lifecycle_through_every_slot_path(client: AppClient, service: FakeSlotService) -> None:
    slot_id = client.post("/v1/slots", json=GUARANTEED).json()["id"]
    assert [s["id"] for s in client.get("/v1/slots").json()["slots"]] == [slot_id]
    assert client.get(f"/v1/slots/{slot_id}").json()["name"] == "llm-a"
    assert client.get("/v1/slots/llm-a").json()["id"] == slot_id  # by name too

    resized = client.patch(f"/v1/slots/{slot_id}", json={"resources": {"cpus": 4}})
    assert resized.status_code == 200
    assert len(resized.json()["assignment"]["cpus"]) == 4
    assert service.calls[-1] == ("resize", (slot_id, {"cpus": 4}))  # only the fields given

    started = client.post(f"/v1/slots/{slot_id}/worker", json={"command": ["sleep", "60"]})
    assert (started.status_code, started.json()["state"]) == (200, "running")
    stopped = client.delete(f"/v1/slots/{slot_id}/worker")
    assert (stopped.status_code, stopped.json()["worker"]["phase"]) == (200, "stopped")

    logs = client.get(f"/v1/slots/{slot_id}/logs", params={"lines": 2})
    assert logs.json()["id"] == slot_id
    assert logs.json()["lines"] == ["llm-a line 3", "llm-a line 4"]
    assert [e["text"] for e in logs.json()["entries"]] == ["llm-a line 3", "llm-a line 4"]

    released = client.delete(f"/v1/slots/{slot_id}")
    assert (released.status_code, released.content) == (204, b"")
    assert error_of(client.get(f"/v1/slots/{slot_id}"))[:2] == (404, "not_found")
    assert client.get("/v1/slots").json() == {"slots": []}


def test_node_topology_and_capacity(client: AppClient) -> None:
    assert client.get("/v1/node").json()["node_id"] == "node-fake"
    topology = client.get("/v1/topology").json()
    assert topology["schema"] == "nodeagent.topology/v1"
    assert len(topology["cpus"]) == 16
    free_before = client.get("/v1/capacity").json()["resources"]["cpus"]["free"]
    client.post("/v1/slots", json=GUARANTEED)
    assert client.get("/v1/capacity").json()["resources"]["cpus"]["free"] == free_before - 2


def test_worker_start_without_body_uses_the_request_and_says_when_there_is_none(client: AppClient) -> None:
    client.post("/v1/slots", json=GUARANTEED)
    status, code, message = error_of(client.post("/v1/slots/llm-a/worker"))
    assert (status, code) == (422, "invalid_request")
    assert "no worker" in message
    with_worker = {**GUARANTEED, "name": "llm-b", "worker": {"command": ["sleep", "1"]}}
    client.post("/v1/slots", json=with_worker)
    assert client.post("/v1/slots/llm-b/worker").status_code == 200


def test_worker_error_is_500_with_the_services_message(client: AppClient, service: FakeSlotService) -> None:
    client.post("/v1/slots", json=GUARANTEED)
    service.fail_worker_start = "exec /opt/model/serve: no such file"
    status, code, message = error_of(client.post("/v1/slots/llm-a/worker", json={"command": ["x"]}))
    assert (status, code, message) == (500, "worker_error", "exec /opt/model/serve: no such file")


# --------------------------------------------------------------------------- auth and health


@pytest.mark.parametrize(
    ("headers", "challenge"),
    [
        pytest.param({}, 'Bearer realm="nodeagent"', id="missing"),
        pytest.param({"Authorization": "Bearer wrong"}, 'error="invalid_token"', id="wrong"),
        pytest.param({"Authorization": f"Basic {TOKEN}"}, 'Bearer realm="nodeagent"', id="wrong-scheme"),
        pytest.param({"Authorization": "Bearer "}, 'Bearer realm="nodeagent"', id="empty"),
        pytest.param({"Authorization": f"Bearer {TOKEN}x"}, 'error="invalid_token"', id="prefix-of-longer"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/slots", "/v1/node", "/metrics", "/v1/nope"])
def test_unauthenticated_requests_get_401(
    service: FakeSlotService, headers: dict[str, str], challenge: str, path: str
) -> None:
    response = AppClient(create_app(service, token=TOKEN), headers).get(path)
    assert error_of(response)[:2] == (401, "unauthenticated")
    assert challenge in response.headers["www-authenticate"]


def test_unauthenticated_post_changes_nothing(service: FakeSlotService) -> None:
    response = AppClient(create_app(service, token=TOKEN)).post("/v1/slots", json=GUARANTEED)
    assert response.status_code == 401
    assert service.calls == []


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/openapi.json"])
def test_health_and_the_document_need_no_token(service: FakeSlotService, path: str) -> None:
    assert AppClient(create_app(service, token=TOKEN)).get(path).status_code == 200


def test_metrics_can_be_opened_to_scrapers(service: FakeSlotService) -> None:
    app = create_app(service, token=TOKEN, metrics_auth=False)
    assert AppClient(app).get("/metrics").status_code == 200
    assert AppClient(app).get("/v1/slots").status_code == 401


def test_readyz_is_503_until_the_service_is_ready_and_changes_wait_for_it(service: FakeSlotService) -> None:
    service.is_ready = False
    client = AppClient(create_app(service, token=TOKEN), AUTH)
    response = client.get("/readyz")
    assert error_of(response)[:2] == (503, "not_ready")
    status, code, _ = error_of(client.post("/v1/slots", json=GUARANTEED))
    assert (status, code) == (503, "not_ready")
    assert service.calls == []
    assert client.get("/v1/slots").status_code == 200  # reads still work
    service.is_ready = True
    assert client.get("/readyz").json() == {"status": "ready"}
    assert client.post("/v1/slots", json=GUARANTEED).status_code == 201


def test_an_empty_token_is_refused() -> None:
    with pytest.raises(Exception, match="non-empty token"):
        create_app(FakeSlotService(), token="  ")


# --------------------------------------------------------------------------- hostile input


def _slot(**resources: Any) -> dict[str, Any]:
    return {"name": "bad", "qos": "guaranteed", "resources": {"cpus": 1, **resources}}


HOSTILE_BODIES = [
    pytest.param(_slot(cpus="lots"), 422, "resources.cpus", id="cpus-string"),
    pytest.param(_slot(cpus=1e308), 422, "resources.cpus", id="cpus-1e308"),
    pytest.param(_slot(cpus=-1), 422, "resources.cpus", id="cpus-negative"),
    pytest.param(_slot(memory=10**400), 422, "resources.memory", id="memory-huge-int"),
    pytest.param(_slot(memory=-1), 422, "resources.memory", id="memory-negative"),
    pytest.param(_slot(memory="4Qi"), 422, "resources.memory", id="memory-bad-unit"),
    pytest.param(_slot(gpus=True), 422, "resources.gpus", id="gpus-bool"),
    pytest.param(_slot(gpus="1"), 422, "resources.gpus", id="gpus-string"),
    pytest.param(_slot(gpus=2**70), 422, "resources.gpus", id="gpus-huge"),
    pytest.param(_slot(numa="everywhere"), 422, "resources.numa", id="numa-unknown"),
    pytest.param(_slot(bogus=1), 422, "resources.bogus", id="unknown-resource-field"),
    pytest.param({**_slot(), "priority": 9}, 422, "priority", id="unknown-top-field"),
    pytest.param({**_slot(), "name": ".."}, 422, "name", id="name-dotdot"),
    pytest.param({**_slot(), "name": "a/b"}, 422, "name", id="name-slash"),
    pytest.param({**_slot(), "name": "x" * 64}, 422, "name", id="name-too-long"),
    pytest.param({**_slot(), "qos": "platinum"}, 422, "qos", id="qos-unknown"),
    pytest.param({"qos": "guaranteed"}, 422, "name", id="name-missing"),
    pytest.param(_slot(devices=["/dev/../etc/passwd"]), 422, "devices", id="device-path-escape"),
    pytest.param(_slot(devices=["/dev/natest-nope"]), 409, "/dev/natest-nope", id="device-unknown"),
    pytest.param(_slot(cpus=64), 409, "64", id="does-not-fit"),
    pytest.param([GUARANTEED], 422, "request: must be an object", id="array"),
    pytest.param("guaranteed", 422, "request: must be an object", id="string"),
]


@pytest.mark.parametrize(("body", "status", "mentions"), HOSTILE_BODIES)
def test_hostile_allocations_get_a_4xx_that_names_the_problem_and_change_nothing(
    client: AppClient, service: FakeSlotService, body: Any, status: int, mentions: str
) -> None:
    free_before = service.capacity()
    got_status, code, message = error_of(client.post("/v1/slots", json=body))
    assert got_status == status
    assert code == ("does_not_fit" if status == 409 else "invalid_request")
    assert mentions in message
    assert service.list_slots() == []
    assert service.capacity() == free_before


@pytest.mark.parametrize(
    ("content", "headers", "status", "code"),
    [
        pytest.param(
            b'{"name": "x", ', {"content-type": "application/json"}, 400, "malformed_json", id="truncated"
        ),
        pytest.param(b"\xff\xfe", {"content-type": "application/json"}, 400, "malformed_json", id="not-utf8"),
        pytest.param(
            b'{"name":"x","qos":"burstable","resources":{"cpus":NaN}}',
            {"content-type": "application/json"},
            422,
            "invalid_request",
            id="nan",
        ),
        pytest.param(
            json.dumps(GUARANTEED).encode(), {}, 415, "unsupported_media_type", id="no-content-type"
        ),
        pytest.param(
            b"{" + b" " * (2 << 20) + b"}",
            {"content-type": "application/json"},
            413,
            "body_too_large",
            id="2MiB",
        ),
    ],
)
def test_unreadable_bodies(
    client: AppClient,
    *,
    service: FakeSlotService,
    content: bytes,
    headers: dict[str, str],
    status: int,
    code: str,
) -> None:
    assert error_of(client.post("/v1/slots", content=content, headers=headers))[:2] == (status, code)
    assert service.calls == []


def test_a_chunked_body_over_the_limit_is_413(service: FakeSlotService) -> None:
    client = AppClient(create_app(service, token=TOKEN, max_body_bytes=1000), AUTH)

    def chunks() -> Iterator[bytes]:
        for _ in range(10):
            yield b" " * 200

    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=client.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://agent", headers=AUTH) as c:

            async def body() -> Any:
                for chunk in chunks():
                    yield chunk

            return await c.post("/v1/slots", content=body(), headers={"content-type": "application/json"})

    assert error_of(asyncio.run(call()))[:2] == (413, "body_too_large")


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "status", "code"),
    [
        pytest.param("GET", "/v1/slots/%2e%2e", {}, 422, "invalid_request", id="dotdot-id"),
        pytest.param("GET", "/v1/slots/..%2Fnode", {}, 404, "not_found", id="encoded-slash"),
        pytest.param("GET", "/v1/slots/UPPER", {}, 422, "invalid_request", id="uppercase-id"),
        pytest.param("DELETE", "/v1/slots/.hidden", {}, 422, "invalid_request", id="leading-dot-delete"),
        pytest.param("GET", "/v1/slots/natest-none", {}, 404, "not_found", id="unknown-slot"),
        pytest.param("DELETE", "/v1/slots/natest-none", {}, 404, "not_found", id="release-unknown"),
        pytest.param("GET", "/v1/nope", {}, 404, "not_found", id="unknown-route"),
        pytest.param("PUT", "/v1/slots", {}, 405, "method_not_allowed", id="wrong-method"),
        pytest.param(
            "GET", "/v1/slots/llm-a/logs", {"params": {"lines": 0}}, 422, "invalid_request", id="lines-0"
        ),
        pytest.param(
            "GET",
            "/v1/slots/llm-a/logs",
            {"params": {"lines": 10001}},
            422,
            "invalid_request",
            id="lines-10001",
        ),
        pytest.param(
            "GET", "/v1/slots/llm-a/logs", {"params": {"lines": "x"}}, 422, "invalid_request", id="lines-x"
        ),
        pytest.param(
            "PATCH",
            "/v1/slots/llm-a",
            {"json": {"cpus": 4}},
            422,
            "invalid_request",
            id="resize-without-resources",
        ),
        pytest.param(
            "PATCH",
            "/v1/slots/llm-a",
            {"json": {"resources": {"cpus": 1e308}}},
            422,
            "invalid_request",
            id="resize-huge",
        ),
        pytest.param(
            "PATCH",
            "/v1/slots/llm-a",
            {"json": {"resources": {"cpus": 64}}},
            409,
            "does_not_fit",
            id="resize-too-big",
        ),
        pytest.param(
            "POST",
            "/v1/slots/llm-a/worker",
            {"json": ["sleep"]},
            422,
            "invalid_request",
            id="worker-spec-array",
        ),
    ],
)
def test_bad_paths_and_parameters(
    client: AppClient, *, method: str, path: str, kwargs: dict[str, Any], status: int, code: str
) -> None:
    client.post("/v1/slots", json=GUARANTEED)
    before = client.get("/v1/slots/llm-a").json()
    assert error_of(client.request(method, path, **kwargs))[:2] == (status, code)
    assert client.get("/v1/slots/llm-a").json() == before


def test_405_says_which_methods_the_path_takes(client: AppClient) -> None:
    response = client.request("PUT", "/v1/slots")
    assert "GET" in response.headers["allow"]


def test_unexpected_exceptions_become_a_500_in_the_error_shape(service: FakeSlotService) -> None:
    def broken() -> Any:
        raise RuntimeError("bug")

    service.list_slots = broken  # type: ignore[method-assign]
    app = create_app(service, token=TOKEN)

    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://agent", headers=AUTH) as c:
            return await c.get("/v1/slots")

    assert error_of(asyncio.run(call())) == (500, "internal", "internal error in the agent; see its log")


def test_validation_errors_for_a_union_are_merged_into_one_line() -> None:
    problems = [
        {
            "loc": ("body", "resources", "cpus", "int"),
            "msg": "Input should be a valid integer",
            "input": None,
            "type": "int_type",
        },
        {
            "loc": ("body", "resources", "cpus", "float"),
            "msg": "Input should be a finite number",
            "input": None,
            "type": "x",
        },
        {"loc": ("body", "name"), "msg": "Field required", "input": {}, "type": "missing"},
    ]
    assert describe_validation_errors(problems, (SlotRequest, "request")) == (
        "request: resources.cpus: must be a whole number, got null or input should be a finite number "
        "(got null); name is missing"
    )


def test_an_unknown_field_is_answered_with_the_known_ones_and_the_closest() -> None:
    app = create_app(FakeSlotService(), token=TOKEN)
    body = {"name": "a", "qos": "burstable", "resources": {"cpu": 1}}
    response = asyncio.run(_post(app, "/v1/slots", body))
    assert response.status_code == 422
    message = response.json()["error"]["message"]
    assert message.startswith("request: resources.cpu: unknown field; known fields: cpus, memory")
    assert message.endswith("did you mean 'cpus'?")


async def _post(app: FastAPI, path: str, body: Any) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://agent", headers=AUTH) as c:
        return await c.post(path, json=body)


def test_request_models_spell_out_the_parsers_choices() -> None:
    schema = create_app(FakeSlotService(), token=TOKEN).openapi()["components"]["schemas"]
    assert tuple(schema["SlotRequest"]["properties"]["qos"]["enum"]) == QOS_CLASSES
    assert tuple(schema["Resources"]["properties"]["numa"]["enum"]) == NUMA_POLICIES


# --------------------------------------------------------------------------- metrics


def _stats(slot_id: str) -> CgroupStats | None:
    if slot_id == "s2":
        raise KernelError("cgroup gone")
    return CgroupStats(
        cpu_usage_ns=2_500_000_000,
        cpu_periods=100,
        cpu_throttled_periods=7,
        cpu_throttled_ns=None,
        memory_current=1 << 20,
        memory_peak=2 << 20,
        oom=OomEvents(oom=None, oom_kill=3),
        pids_current=4,
    )


def test_metrics_expose_slots_capacity_usage_latency_and_reporter(service: FakeSlotService) -> None:
    metrics = Metrics(service, stats_provider=_stats)
    client = AppClient(create_app(service, token=TOKEN, metrics=metrics), AUTH)
    client.post("/v1/slots", json=GUARANTEED)
    client.post("/v1/slots", json={**GUARANTEED, "name": "llm-b"})
    client.post("/v1/slots/llm-a/worker", json={"command": ["x"]})
    client.get("/v1/slots/natest-none")
    AppClient(client.app).get("/v1/slots/llm-a")  # 401, before routing
    metrics.reporter_failures.inc(2)
    metrics.reporter_last_success.set(1234.5)

    text = client.get("/metrics").text
    for series in (
        'nodeagent_slots{qos="guaranteed",state="ready"} 1.0',
        'nodeagent_slots{qos="guaranteed",state="running"} 1.0',
        'nodeagent_slots{qos="burstable",state="failed"} 0.0',
        'nodeagent_capacity{kind="free",resource="cpus"} 10.0',
        'nodeagent_capacity{kind="total",resource="memory_bytes"}',
        'nodeagent_numa_capacity{kind="allocated",numa="0",resource="cpus"} 4.0',
        'nodeagent_slot_cpu_usage_seconds_total{name="llm-a",slot="s1"} 2.5',
        'nodeagent_slot_cpu_throttled_periods_total{name="llm-a",slot="s1"} 7.0',
        'nodeagent_slot_memory_bytes{name="llm-a",slot="s1"} 1.048576e+06',
        'nodeagent_slot_memory_peak_bytes{name="llm-a",slot="s1"} 2.097152e+06',
        'nodeagent_slot_oom_kills_total{name="llm-a",slot="s1"} 3.0',
        'nodeagent_worker_restarts_total{name="llm-a",slot="s1"} 2.0',
        'nodeagent_scrape_errors_total{section="slot_stats"} 1.0',
        'request_duration_seconds_count{method="POST",route="/v1/slots",status="201"} 2.0',
        'request_duration_seconds_count{method="GET",route="/v1/slots/{slot_id}",status="404"} 1.0',
        'request_duration_seconds_count{method="GET",route="/v1/slots/{slot_id}",status="401"} 1.0',
        "nodeagent_reporter_failures_total 2.0",
        "nodeagent_reporter_last_success_timestamp_seconds 1234.5",
        "nodeagent_ready 1.0",
        'nodeagent_agent_info{cgroup_mode="fake",node_id="node-fake",version="0.0.test"} 1.0',
    ):
        assert series in text, series
    assert "nodeagent_slot_cpu_throttled_seconds_total{" not in text  # unknown figures are left out
    assert 'name="llm-b"' not in text.split("nodeagent_slot_cpu_usage")[1].split("# HELP")[0]


def test_metrics_registries_are_private() -> None:
    a, b = Metrics(), Metrics()
    a.reporter_failures.inc()
    assert b"nodeagent_reporter_failures_total 0.0" in b.render()[0]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        pytest.param(
            b'{"name": "a", "name": "b", "qos": "burstable"}', "key 'name' appears twice", id="duplicate-top"
        ),
        pytest.param(
            b'{"name": "a", "qos": "burstable", "resources": {"cpus": 1, "cpus": 2}}',
            "key 'cpus' appears twice",
            id="duplicate-nested",
        ),
        pytest.param(
            b'{"name": "a", "qos": "burstable", "resources": {"cpus": 1e-400}}',
            "1e-400 is too small to be told from 0",
            id="underflow",
        ),
        pytest.param(
            b'{"name": "a", "qos": "burstable", "worker": {"env": ' + b"[" * 1000 + b"]" * 1000 + b"}}",
            "nested 1002 deep",
            id="nested-1000-deep",
        ),
        pytest.param(
            b'{"name": "a", "qos": "burstable", "x": ' + b'{"k": ' * 200 + b"1" + b"}" * 200 + b"}",
            "at most 64",
            id="objects-nested-200-deep",
        ),
    ],
)
def test_json_a_plain_parser_would_bend_is_refused_and_changes_nothing(raw: bytes, message: str) -> None:
    service = FakeSlotService()
    app = create_app(service, token=TOKEN)

    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://agent", headers=AUTH) as c:
            return await c.post("/v1/slots", content=raw, headers={"Content-Type": "application/json"})

    response = asyncio.run(call())
    assert response.status_code == 422
    assert message in response.json()["error"]["message"]
    assert service.calls == []


def test_a_405_lists_every_method_of_the_path() -> None:
    app = create_app(FakeSlotService(), token=TOKEN)

    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://agent", headers=AUTH) as c:
            return await c.put("/v1/slots/a")

    response = asyncio.run(call())
    assert response.status_code == 405
    assert set(response.headers["allow"].split(", ")) >= {"GET", "PATCH", "DELETE"}


def test_a_slots_cdi_spec_is_served_as_the_service_gives_it(client: AppClient) -> None:
    created = client.post("/v1/slots", json={"name": "llm-a", "qos": "guaranteed", "resources": {"cpus": 1}})
    assert created.status_code == 201
    spec = client.get("/v1/slots/llm-a/cdi")
    assert spec.status_code == 200
    assert spec.json()["kind"] == "nodeagent.io/slot"
    assert spec.json()["devices"][0]["name"] == "llm-a"
    assert error_of(client.get("/v1/slots/nope/cdi"))[:2] == (404, "not_found")


def test_an_unknown_query_parameter_is_refused_with_what_the_operation_takes(client: AppClient) -> None:
    # A misspelt ?standy=true must not answer as if nothing had been asked.
    status, code, message = error_of(client.get("/v1/slots", params={"standy": "true"}))
    assert (status, code) == (422, "invalid_request")
    assert "'standy'" in message
    assert "standby" in message
    status, _, message = error_of(client.get("/v1/capacity", params={"numa": "0"}))
    assert status == 422
    assert "takes no query parameters" in message
    assert client.get("/v1/slots").status_code == 200


# --------------------------------------------------------------------------- the fast lane


def _answer(response: httpx.Response) -> tuple[int, dict[str, str], Any]:
    headers = {k: v for k, v in response.headers.items() if k in ("location", "content-type", "retry-after")}
    body = response.json() if response.content else None
    if isinstance(body, dict):
        body = {k: v for k, v in body.items() if k not in ("created_at", "updated_at")}
    return response.status_code, headers, body


def test_the_fast_lane_answers_allocate_and_release_as_fastapi_does() -> None:
    # "application/json" exactly takes the lane; with a charset the same request goes through
    # FastAPI's routing: every answer must be the same either way.
    steps: list[tuple[str, str, Any]] = [
        ("POST", "/v1/slots", GUARANTEED),
        ("POST", "/v1/slots", GUARANTEED),  # the same again: 200
        ("POST", "/v1/slots", {**GUARANTEED, "resources": {"cpus": 4}}),  # conflict
        ("POST", "/v1/slots", {"name": "x", "qos": "guaranteed", "resources": {"cpus": 1e9}}),  # range
        ("POST", "/v1/slots", {"name": "y", "qos": "bogus"}),  # refused by the model
        ("POST", "/v1/slots", [1, 2]),
        ("POST", "/v1/slots", {"name": "p", "pool": "mlp"}),  # a pool claim, no pools here
        ("DELETE", "/v1/slots/nope", None),
        ("DELETE", "/v1/slots/llm-a%0A", None),  # a name and a newline: the path's pattern refuses it
        ("DELETE", "/v1/slots/llm-a", None),
        ("DELETE", "/v1/slots/llm-a", None),
    ]
    answers = {}
    for content_type in ("application/json", "application/json; charset=utf-8"):
        metrics = Metrics()
        client = AppClient(create_app(FakeSlotService(), token=TOKEN, metrics=metrics), AUTH)
        answers[content_type] = [
            _answer(
                client.request(
                    method,
                    path,
                    content=None if body is None else json.dumps(body),
                    headers={"Content-Type": content_type},
                )
            )
            for method, path, body in steps
        ]
        rendered = metrics.render()[0].decode()
        assert 'method="POST",route="/v1/slots",status="201"' in rendered
        assert 'method="DELETE",route="/v1/slots/{slot_id}",status="204"' in rendered
    lane, full = answers.values()
    assert [a[0] for a in lane] == [201, 200, 409, 422, 422, 422, 422, 404, 422, 204, 404]
    for step, (one, other) in enumerate(zip(lane, full, strict=True)):
        assert one[0] == other[0], steps[step]
        assert one[2] == other[2], steps[step]
        assert {k: v for k, v in one[1].items() if k != "content-type"} == {
            k: v for k, v in other[1].items() if k != "content-type"
        }, steps[step]


def test_the_fast_lane_answers_a_service_that_is_not_ready_with_503(service: FakeSlotService) -> None:
    service.is_ready = False
    client = AppClient(create_app(service, token=TOKEN), AUTH)
    response = client.post("/v1/slots", json=GUARANTEED)
    assert error_of(response)[:2] == (503, "not_ready")
    assert response.headers["retry-after"] == "1"
    assert error_of(client.delete("/v1/slots/llm-a"))[:2] == (503, "not_ready")


def test_a_big_listing_gives_its_freed_heap_back_after_it_is_sent(
    client: AppClient, service: FakeSlotService, monkeypatch: pytest.MonkeyPatch
) -> None:
    import nodeagent.agent.api as api_module

    trims: list[int] = []
    monkeypatch.setattr(api_module, "release_freed_memory", lambda: trims.append(1) or True)
    assert client.post("/v1/slots", json=GUARANTEED).status_code == 201
    assert client.get("/v1/slots").status_code == 200
    assert client.get("/metrics").status_code == 200
    assert trims == []  # small answers: nothing to give back
    for i in range(150):
        body = {"name": f"be-{i}", "qos": "best-effort", "resources": {"cpus": 0.01, "memory": "8Mi"}}
        assert client.post("/v1/slots", json=body).status_code == 201
    listing = client.get("/v1/slots")
    assert listing.status_code == 200
    assert len(listing.content) >= api_module.TRIM_AFTER_BYTES
    assert trims == [1]
