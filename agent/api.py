"""The REST API: a thin HTTP shell over the slot service (``agent.service.SlotService``).

Paths (JSON; versioned under /v1)::

    GET    /v1/node                    who this agent is, and what it cannot isolate here
    GET    /v1/topology                nodeagent.topology/v1
    GET    /v1/capacity                total/reserved/allocatable/allocated/free per resource and NUMA node
    GET    /v1/slots                   {"slots": [Slot, ...]}
    POST   /v1/slots                   allocate: 201 created; 200 the same request again (idempotent
                                       by name); 409 a different request under an existing name
    GET    /v1/slots/{id}              by id or name
    PATCH  /v1/slots/{id}              {"resources": {...partial...}} -> resize in place
    DELETE /v1/slots/{id}              release: 204, no body
    POST   /v1/slots/{id}/worker       start its worker (optional WorkerSpec body) -> Slot
    DELETE /v1/slots/{id}/worker       stop its worker -> Slot
    POST   /v1/nri/containers          a container the NRI shim saw created -> its slot's adjustment
                                       (idempotent by container id; 409 does_not_fit, 422 refused)
    DELETE /v1/nri/containers/{id}     the container stopped or was removed: release its slot (204)
    POST   /v1/nri/synchronize         every container the runtime has: keep, release, allocate
                                       (422 unsupported unless ``[kubernetes] nri = true``)
    GET    /v1/nri/updates?version=V&wait=S  shared containers' cpusets once the shared pool is
                                       not V (long poll, S <= 30 s)
    POST   /v1/pools                   create a warm standby pool (PoolSpec) -> Pool (201; 200 same again)
    GET    /v1/pools, /v1/pools/{name} pools with their standbys; PATCH {"size": N}; DELETE (204)
    POST   /v1/slots {"name", "pool"}  allocate from a pool: a frozen standby placed and thawed
    GET    /v1/slots/{id}/logs?lines=N the last N (1..10000, default 100) lines of worker output
    GET    /v1/slots/{id}/cdi          the slot's CDI spec (kind nodeagent.io/slot) for container runtimes
    GET    /healthz                    the process answers (no token)
    GET    /readyz                     503 until start-up reconciliation is done (no token)
    GET    /metrics                    Prometheus text (token unless ``metrics_auth=False``)
    GET    /openapi.json               this API's description (no token: it is published in docs/)

Authentication: ``Authorization: Bearer <token>`` (the agent's token file), compared in constant
time; a missing or wrong token is 401 with ``WWW-Authenticate: Bearer``, checked before the body is
read. Scrapers that cannot send a token get /metrics open with ``metrics_auth=False``.

Errors always have the body ``{"error": {"code": str, "message": str}}``. Status rule:

- 400 ``malformed_json``: the body could not be read as JSON;
- 401 ``unauthenticated``; 404 ``not_found`` (unknown slot or route); 405 ``method_not_allowed``;
- 409 ``conflict`` (the name is taken by a different request) or ``does_not_fit`` (placement);
- 413 ``body_too_large`` (over ``max_body_bytes``, 1 MiB by default);
- 415 ``unsupported_media_type``: a body sent without ``Content-Type: application/json``;
- 422 the body or a parameter was read but is not acceptable: wrong types, unknown fields or query
  parameters, values out of range, unknown devices (``invalid_request``), or a feature the host
  lacks (``unsupported``);
- 500 the kernel or a worker refused (``kernel_error``, ``cgroup_error``, ``worker_error``, ...);
- 507 ``insufficient_storage``: the state directory's filesystem is full; nothing was changed (or a
  retry of the same call finishes what was begun), the message names the directory;
- 503 ``not_ready``: changes are refused until start-up reconciliation is done (reads still work).

The request models below check shapes (types, unknown fields) and document them; the service stays
the authority on values, so its messages (which name the field and the allowed range) reach the
client unchanged. The API is transport-agnostic: ``nodeagent serve`` runs it on TCP or a unix socket.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import secrets
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Annotated, Any, NamedTuple, cast

import orjson
from fastapi import Body, Depends, FastAPI, Path, Query, Request
from fastapi.dependencies.models import Dependant
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, Discriminator, Tag, TypeAdapter, ValidationError
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nodeagent import __version__
from nodeagent.agent.api_models import (
    CdiSpecModel,
    LogsModel,
    NodeModel,
    PoolListModel,
    PoolModel,
    SlotListModel,
    SlotModel,
    error_responses,
)
from nodeagent.agent.metrics import Metrics
from nodeagent.agent.nri import SLOT_PREFIX as NRI_SLOT_PREFIX
from nodeagent.agent.nri import NriContainers
from nodeagent.agent.pools import Pools
from nodeagent.agent.service import SlotService
from nodeagent.agent.slot import Slot
from nodeagent.devices.topology import topology_to_dict
from nodeagent.errors import (
    ConfigError,
    Conflict,
    InsufficientStorage,
    InvalidRequest,
    NodeAgentError,
    NotFound,
    PlacementError,
    Unsupported,
)
from nodeagent.libc import release_freed_memory
from nodeagent.schema.messages import describe_errors
from nodeagent.schema.nri_messages import (
    CONTAINER_ID_PATTERN,
    NriAdjustment,
    NriContainer,
    NriSynchronize,
    NriSyncResult,
    NriUpdates,
)
from nodeagent.schema.pool import POOL_NAME, PoolClaim, PoolResize, PoolSpec, is_standby_name
from nodeagent.schema.request import NAME_PATTERN, Resize, SlotRequest
from nodeagent.schema.worker import WorkerSpec

log = logging.getLogger(__name__)


class JSONBody(JSONResponse):
    """The API's JSON answers, encoded with orjson: the same bytes as the standard encoder's compact
    form for what the agent sends, about 8x faster (a 500-slot listing: 8.5 ms -> 1.1 ms of JSON),
    and a NaN becomes null instead of failing the answer."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS)


#: An answer at least this big (a scrape or a slot listing of some hundred slots) has its garbage
#: given back to the system once it is sent (:func:`release_freed_memory`, ~0.4 ms at 500 slots).
TRIM_AFTER_BYTES = 64 * 1024


def _after_big_answer(size: int) -> BackgroundTask | None:
    """What runs after an answer of ``size`` bytes is sent: the freed heap pages given back for a
    big one, else nothing. After, not before: the client does not wait for it."""
    return BackgroundTask(release_freed_memory) if size >= TRIM_AFTER_BYTES else None


MAX_BODY_BYTES = 1024 * 1024
MAX_LOG_LINES = 10_000
DEFAULT_LOG_LINES = 100
#: The longest GET /v1/nri/updates waits for a change of the shared pool; the shim asks again.
MAX_NRI_WAIT_S = 30.0
#: Slot ids and names become cgroup and netns names: the same safe identifier everywhere.
SLOT_ID_PATTERN = f"^{NAME_PATTERN.pattern}$"
PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/openapi.json"})


class NotReady(NodeAgentError):
    code = "not_ready"


#: First match wins, so subclasses come before their bases.
_STATUS_BY_ERROR: tuple[tuple[type[NodeAgentError], int], ...] = (
    (NotReady, 503),
    (InsufficientStorage, 507),
    (InvalidRequest, 422),
    (ConfigError, 422),
    (Unsupported, 422),
    (NotFound, 404),
    (PlacementError, 409),
    (Conflict, 409),
)
_CODE_BY_STATUS = {
    400: "malformed_json",
    401: "unauthenticated",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    415: "unsupported_media_type",
    422: "invalid_request",
    503: "not_ready",
}


def status_for(err: NodeAgentError) -> int:
    """The HTTP status of one of the project's errors (see the module docstring for the rule)."""
    for cls, status in _STATUS_BY_ERROR:
        if isinstance(err, cls):
            return status
    return 500


def error_response(
    status: int, code: str, message: str, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    return JSONBody({"error": {"code": code, "message": message}}, status_code=status, headers=headers)


# --------------------------------------------------------------------------- the app

_READ_ERRORS = error_responses(401, 404, 422)
_WRITE_ERRORS = error_responses(400, 401, 404, 409, 413, 415, 422, 500, 503, 507)

PoolNameParam = Annotated[
    str,
    Path(pattern=f"^{POOL_NAME.pattern}$", max_length=48, description="The pool's name.", examples=["mlp"]),
]
SlotId = Annotated[
    str,
    Path(
        pattern=SLOT_ID_PATTERN,
        max_length=63,
        description="The slot's id or name.",
        examples=["llm-a"],
    ),
]


def _query_names(dependant: Dependant) -> frozenset[str]:
    """The query parameters an operation takes, its dependencies' included."""
    names = {p.alias for p in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_names(sub)
    return frozenset(names)


async def _refuse_unknown_query(request: Request) -> None:
    """A query parameter the operation does not take is refused (422), not ignored: a misspelt
    ``?standy=true`` would otherwise answer as if it had not been asked. ``async``: FastAPI runs a
    plain function dependency in its thread pool, a hop (50-70 us) every request paid for a check
    of a few attributes."""
    if not request.query_params:
        return
    route = request.scope.get("route")
    if not isinstance(route, APIRoute):
        return
    known = _query_names(route.dependant)  # a few attributes: only asked when a query is sent
    unknown = sorted(set(request.query_params) - known)
    if unknown:
        takes = ", ".join(sorted(known)) if known else "no query parameters"
        raise InvalidRequest(
            f"{request.method} {route.path}: unknown query parameter{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(repr(u) for u in unknown)}; it takes {takes}"
        )


def create_app(
    service: SlotService,
    *,
    token: str,
    metrics: Metrics | None = None,
    metrics_auth: bool = True,
    max_body_bytes: int = MAX_BODY_BYTES,
    nri: bool = False,
    nri_devices: Sequence[str] = (),
    pools: Pools | None = None,
) -> FastAPI:
    """The agent's ASGI app over ``service``; every /v1 path and (by default) /metrics need ``token``.
    ``nri_devices``: the allowed devices a container placed through NRI holds in its slot when the
    runtime gives them to it."""
    if not token.strip():
        raise ConfigError("the API needs a non-empty token; the agent keeps it in <state dir>/token")
    if metrics is None:
        metrics = Metrics(service)
    app = FastAPI(
        title="nodeagent",
        version=__version__,
        summary="Per-host agent: isolated slots of CPUs, NUMA memory and accelerators for inference workers.",
        docs_url=None,
        redoc_url=None,
        dependencies=[Depends(_refuse_unknown_query)],
    )
    hot = _add_routes(app, service, metrics, nri, pools)
    _add_nri_routes(app, service, nri, nri_devices)
    _add_pool_routes(app, pools)
    _add_error_handlers(app)
    public = PUBLIC_PATHS if metrics_auth else PUBLIC_PATHS | {"/metrics"}
    # Added innermost first: requests meet latency timing, then the token check, then the size
    # limit, then the fast lane for allocate and release (everything else goes on to FastAPI).
    app.add_middleware(_FastLane, hot=hot, routes=app.routes)
    app.add_middleware(_BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(_BearerAuth, token=token, public_paths=public)
    app.add_middleware(_Timing, metrics=metrics)
    _document_auth(app, public)
    return app


def _slot_json(slot: Slot, status: int = 200, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONBody(slot.to_json(), status_code=status, headers=headers)


def _require_ready(service: SlotService) -> None:
    if not service.ready():
        raise NotReady(
            "the agent is still reconciling its state with the kernel after start-up; retry in a moment"
        )


def _add_routes(
    app: FastAPI, service: SlotService, metrics: Metrics, nri: bool, pools: Pools | None
) -> _HotCalls:
    _add_node_routes(app, service, metrics)
    return _add_slot_routes(app, service, nri, pools)


def _add_node_routes(app: FastAPI, service: SlotService, metrics: Metrics) -> None:
    @app.get("/healthz", tags=["health"], summary="The process is alive")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"], summary="Ready to accept work", responses=error_responses(503))
    def readyz() -> JSONResponse:
        if not service.ready():
            return error_response(503, "not_ready", "start-up reconciliation is still running")
        return JSONBody({"status": "ready"})

    @app.get(
        "/metrics",
        tags=["health"],
        summary="Prometheus metrics",
        response_class=Response,
        responses={200: {"content": {"text/plain": {}}}, **error_responses(401)},
    )
    def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type, background=_after_big_answer(len(body)))

    @app.get("/v1/node", tags=["node"], response_model=NodeModel, responses=error_responses(401))
    def node() -> JSONResponse:
        return JSONBody(service.node().to_dict())

    @app.get(
        "/v1/topology",
        tags=["node"],
        summary="Hardware topology (nodeagent.topology/v1)",
        response_model=dict[str, Any],
        responses=error_responses(401),
    )
    def topology() -> JSONResponse:
        return JSONBody(topology_to_dict(service.topology()))

    @app.get(
        "/v1/capacity",
        tags=["node"],
        summary="Total, reserved, allocatable, allocated and free per resource and NUMA node",
        response_model=dict[str, Any],
        responses=error_responses(401),
    )
    def capacity() -> JSONResponse:
        return JSONBody(service.capacity())


def _which_allocate(value: Any) -> str | None:
    if isinstance(value, dict):
        return "pool" if "pool" in value else "slot"
    if isinstance(value, SlotRequest | PoolClaim):
        return "pool" if isinstance(value, PoolClaim) else "slot"
    return None  # not an object: refused as a whole (415 for a body that was not sent as JSON)


#: POST /v1/slots: a slot request, or a claim on a warm pool (a body with ``pool``).
AllocateBody = Annotated[
    Annotated[SlotRequest, Tag("slot")] | Annotated[PoolClaim, Tag("pool")],
    Discriminator(_which_allocate, custom_error_type="dict_type"),
    Body(),
]


def _add_slot_routes(app: FastAPI, service: SlotService, nri: bool, pools: Pools | None) -> _HotCalls:
    @app.get("/v1/slots", tags=["slots"], response_model=SlotListModel, responses=error_responses(401))
    def list_slots(
        standby: Annotated[bool, Query(description="Also warm pools' standby slots.")] = False,
    ) -> JSONResponse:
        slots = service.list_slots(standby=True) if standby else service.list_slots()
        answer = JSONBody({"slots": [s.to_json() for s in slots]})
        answer.background = _after_big_answer(len(answer.body))
        return answer

    @app.post(
        "/v1/slots",
        tags=["slots"],
        summary="Allocate a slot (idempotent by name)",
        status_code=201,
        response_model=SlotModel,
        responses={
            **_WRITE_ERRORS,
            200: {"model": SlotModel, "description": "The same request again: the existing slot"},
        },
    )
    def allocate(body: AllocateBody) -> JSONResponse:
        _require_ready(service)
        if nri and body.name.startswith(NRI_SLOT_PREFIX):
            raise InvalidRequest(
                f"name: {body.name!r} starts with {NRI_SLOT_PREFIX!r}, which names the slots of containers "
                "placed through NRI; choose a name without that prefix"
            )
        if is_standby_name(body.name):
            raise InvalidRequest(
                f"name: {body.name!r} has the form of a warm pool's standby (pool.<pool>.<6 hex digits>); "
                "choose another name"
            )
        if isinstance(body, PoolClaim):
            if pools is None:
                raise Unsupported(
                    f"pool: {body.pool!r}: this agent keeps no warm pools (it cannot isolate slots); "
                    "allocate without a pool"
                )
            result = pools.claim(body)
        else:
            result = service.allocate(body)
        if not result.created:
            return _slot_json(result.slot)
        return _slot_json(result.slot, 201, {"Location": f"/v1/slots/{result.slot.id}"})

    @app.get("/v1/slots/{slot_id}", tags=["slots"], response_model=SlotModel, responses=_READ_ERRORS)
    def get_slot(slot_id: SlotId) -> JSONResponse:
        return _slot_json(service.get_slot(slot_id))

    @app.patch(
        "/v1/slots/{slot_id}",
        tags=["slots"],
        summary="Resize a slot in place",
        response_model=SlotModel,
        responses=_WRITE_ERRORS,
    )
    def resize(slot_id: SlotId, body: Resize) -> JSONResponse:
        _require_ready(service)
        return _slot_json(service.resize(slot_id, body.resources))

    @app.delete(
        "/v1/slots/{slot_id}",
        tags=["slots"],
        summary="Release a slot: stop its worker, remove its kernel objects, free its resources",
        status_code=204,
        response_class=Response,
        responses=_WRITE_ERRORS,
    )
    def release(slot_id: SlotId) -> Response:
        _require_ready(service)
        service.release(slot_id)
        return Response(status_code=204)

    _add_worker_routes(app, service)
    return _HotCalls(allocate, release)


def _add_pool_routes(app: FastAPI, pools: Pools | None) -> None:
    """Warm standby pools (agent/pools.py, docs/pools.md)."""

    def the_pools() -> Pools:
        if pools is None:
            raise Unsupported("this agent keeps no warm pools: it cannot isolate slots (see GET /v1/node)")
        return pools

    @app.post(
        "/v1/pools",
        tags=["pools"],
        summary="Create a warm standby pool (idempotent by name)",
        status_code=201,
        response_model=PoolModel,
        responses={**_WRITE_ERRORS, 200: {"model": PoolModel, "description": "The same pool again"}},
    )
    def create_pool(body: PoolSpec) -> JSONResponse:
        view, created = the_pools().create(body)
        if not created:
            return JSONBody(view.to_json())
        return JSONBody(view.to_json(), status_code=201, headers={"Location": f"/v1/pools/{body.name}"})

    @app.get("/v1/pools", tags=["pools"], response_model=PoolListModel, responses=error_responses(401, 422))
    def list_pools() -> JSONResponse:
        return JSONBody({"pools": [v.to_json() for v in the_pools().views()]})

    @app.get("/v1/pools/{name}", tags=["pools"], response_model=PoolModel, responses=_READ_ERRORS)
    def get_pool(name: PoolNameParam) -> JSONResponse:
        return JSONBody(the_pools().get(name).to_json())

    @app.patch(
        "/v1/pools/{name}",
        tags=["pools"],
        summary="Change a pool's size",
        response_model=PoolModel,
        responses=_WRITE_ERRORS,
    )
    def resize_pool(name: PoolNameParam, body: PoolResize) -> JSONResponse:
        return JSONBody(the_pools().resize(name, body.size).to_json())

    @app.delete(
        "/v1/pools/{name}",
        tags=["pools"],
        summary="Delete a pool and its standbys (slots taken from it stay)",
        status_code=204,
        response_class=Response,
        responses=_WRITE_ERRORS,
    )
    def delete_pool(name: PoolNameParam) -> Response:
        the_pools().delete(name)
        return Response(status_code=204)


def _add_nri_routes(app: FastAPI, service: SlotService, enabled: bool, devices: Sequence[str]) -> None:
    """The NRI shim's calls (kube/nri-shim); every decision is agent.nri's."""
    containers = NriContainers(service, devices) if enabled else None

    def require_nri() -> NriContainers:
        if containers is None:
            raise Unsupported(
                "this agent does not place containers from NRI; set [kubernetes] nri = true in its config "
                "and restart it"
            )
        _require_ready(service)
        return containers

    @app.post(
        "/v1/nri/containers",
        tags=["nri"],
        summary="A container is being created: place it as a slot (idempotent by container id)",
        response_model=NriAdjustment,
        responses=_WRITE_ERRORS,
    )
    def nri_create(body: NriContainer) -> JSONResponse:
        return JSONBody(require_nri().create(body).model_dump(mode="json"))

    @app.delete(
        "/v1/nri/containers/{container_id}",
        tags=["nri"],
        summary="A container stopped or was removed: release its slot (204 also when it had none)",
        status_code=204,
        response_class=Response,
        responses=_WRITE_ERRORS,
    )
    def nri_remove(
        container_id: Annotated[str, Path(pattern=f"^{CONTAINER_ID_PATTERN.pattern}$", max_length=128)],
    ) -> Response:
        require_nri().remove(container_id)
        return Response(status_code=204)

    @app.post(
        "/v1/nri/synchronize",
        tags=["nri"],
        summary="Every container the runtime has: keep their slots, release the others, place new ones",
        response_model=NriSyncResult,
        responses=_WRITE_ERRORS,
    )
    def nri_synchronize(body: NriSynchronize) -> JSONResponse:
        return JSONBody(require_nri().synchronize(body.containers).model_dump(mode="json"))

    @app.get(
        "/v1/nri/updates",
        tags=["nri"],
        summary="Shared containers' cpusets once the shared pool differs from `version` (long poll)",
        response_model=NriUpdates,
        responses=_READ_ERRORS,
    )
    def nri_updates(
        version: Annotated[
            str,
            Query(max_length=4096, description="the pool the caller's containers follow; empty: none yet"),
        ] = "",
        wait: Annotated[
            float, Query(ge=0, le=MAX_NRI_WAIT_S, description="seconds to wait for a change of the pool")
        ] = 0,
    ) -> JSONResponse:
        return JSONBody(require_nri().updates(version, wait).model_dump(mode="json"))


def _add_worker_routes(app: FastAPI, service: SlotService) -> None:
    @app.post(
        "/v1/slots/{slot_id}/worker",
        tags=["workers"],
        summary="Start the slot's worker (the body's spec, or the one in its request)",
        response_model=SlotModel,
        responses=_WRITE_ERRORS,
    )
    def start_worker(
        slot_id: SlotId,
        spec: Annotated[WorkerSpec | None, Body(description="The worker; none: the slot request's.")] = None,
    ) -> JSONResponse:
        _require_ready(service)
        return _slot_json(service.start_worker(slot_id, spec))

    @app.delete(
        "/v1/slots/{slot_id}/worker",
        tags=["workers"],
        summary="Stop the slot's worker (the slot stays)",
        response_model=SlotModel,
        responses=_WRITE_ERRORS,
    )
    def stop_worker(slot_id: SlotId) -> JSONResponse:
        _require_ready(service)
        return _slot_json(service.stop_worker(slot_id))

    @app.get(
        "/v1/slots/{slot_id}/logs",
        tags=["workers"],
        summary="The last lines of the worker's output (stdout and stderr interleaved); also of a "
        "released slot while [workers] log_retention_seconds keeps them",
        response_model=LogsModel,
        responses=_READ_ERRORS,
    )
    def logs(
        slot_id: SlotId,
        lines: Annotated[int, Query(ge=1, le=MAX_LOG_LINES)] = DEFAULT_LOG_LINES,
        since: Annotated[
            str | None,
            Query(
                pattern=r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z$",
                description="Only complete lines after this time (an entry's `time`): how "
                "`nodeagent slots logs --follow` asks for what is new.",
            ),
        ] = None,
    ) -> JSONResponse:
        found, entries = service.log_entries(slot_id, lines, since)
        return JSONBody(
            {"id": found, "lines": [e.render() for e in entries], "entries": [e.to_json() for e in entries]}
        )

    @app.get(
        "/v1/slots/{slot_id}/cdi",
        tags=["slots"],
        summary="The slot's CDI spec: what podman run --device nodeagent.io/slot=NAME gives a container",
        response_model=CdiSpecModel,
        responses=_READ_ERRORS,
    )
    def cdi_spec(slot_id: SlotId) -> JSONResponse:
        return JSONBody(service.cdi_spec(slot_id))


# --------------------------------------------------------------------------- errors


def _add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(NodeAgentError, _on_agent_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _on_validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _on_http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _on_unexpected)


async def _on_agent_error(_request: Request, err: NodeAgentError) -> JSONResponse:
    status = status_for(err)
    headers = {"Retry-After": "1"} if status == 503 else None
    if status >= 500:
        log.error("api: %s: %s", err.code, err)
    return error_response(status, err.code, str(err), headers)


#: The body of each route that takes one: its model (to name the known fields when one is unknown)
#: and what the service's own errors call it.
_BODIES: dict[tuple[str, str], tuple[type[BaseModel], str]] = {
    ("POST", "/v1/slots"): (SlotRequest, "request"),
    ("POST", "/v1/pools"): (PoolSpec, "pool"),
    ("PATCH", "/v1/pools/{name}"): (PoolResize, "resize"),
    ("PATCH", "/v1/slots/{slot_id}"): (Resize, "resize"),
    ("POST", "/v1/slots/{slot_id}/worker"): (WorkerSpec, "worker spec"),
}


async def _on_validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
    problems = list(err.errors())
    if any(p.get("type") == "json_invalid" for p in problems):
        return error_response(400, "malformed_json", "the body is not valid JSON; send a JSON object")
    if any(tuple(p.get("loc", ())) == ("body",) and isinstance(p.get("input"), bytes) for p in problems):
        # FastAPI parses a body as JSON only when the request says so (a CSRF guard).
        return error_response(
            415, "unsupported_media_type", "send the body as JSON with 'Content-Type: application/json'"
        )
    route = (request.method, _route_template(request.scope))
    body = _BODIES.get(route)
    if route == ("POST", "/v1/slots"):
        # The body is a slot request or a pool claim, told apart by "pool"; name the one it was.
        if any(tuple(p.get("loc", ()))[1:2] == ("pool",) for p in problems):
            body = (PoolClaim, "claim")
        problems = [{**p, "loc": _untagged(tuple(p.get("loc", ())))} for p in problems]
    return error_response(422, "invalid_request", describe_validation_errors(problems, body))


def _untagged(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """A problem's place without the union's tag: ("body", "slot", "qos") -> ("body", "qos")."""
    if loc[:1] == ("body",) and loc[1:2] in (("slot",), ("pool",)):
        return (loc[0], *loc[2:])
    return loc


async def _on_http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
    code = _CODE_BY_STATUS.get(err.status_code, "http_error")
    headers = dict(err.headers or {})
    if err.status_code == 405:
        # Starlette's Allow names the methods of the one route it matched first; a path served by
        # several routes (GET, PATCH and DELETE of a slot) takes all of theirs.
        allowed = _methods_of(request.scope)
        headers["Allow"] = ", ".join(allowed)
        message = f"{request.method} is not one of this path's methods ({', '.join(allowed)})"
    else:
        message = {404: "no such path; see /openapi.json for this API's paths"}.get(
            err.status_code, str(err.detail)
        )
    return error_response(err.status_code, code, message, headers)


def _methods_of(scope: Scope) -> list[str]:
    """Every method some route of the app serves at the request's path."""
    methods: set[str] = set()
    for route in getattr(scope.get("app"), "routes", ()):
        match, _ = route.matches({**scope, "type": "http", "method": "GET"})
        if match != Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)


async def _on_unexpected(_request: Request, err: Exception) -> JSONResponse:
    # Not one of ours: a bug. The traceback goes to the log; the client gets no internals.
    log.error("api: unexpected %s", type(err).__name__, exc_info=err)
    return error_response(500, "internal", "internal error in the agent; see its log")


def describe_validation_errors(
    problems: Sequence[Mapping[str, Any]], body: tuple[type[BaseModel], str] | None = None, limit: int = 3
) -> str:
    """One line naming each bad field. Problems in the body read as the service's own refusals do
    (``request: resources.cpus: 1e+308 is out of range; ...``), with the known fields (and the
    closest) for an unknown one; others keep their place (``query.lines: must be at most 10000``)."""
    if body is not None and all(tuple(p.get("loc", ()))[:1] == ("body",) for p in problems):
        model, what = body
        inside = [{**p, "loc": tuple(p["loc"])[1:]} for p in problems]
        return f"{what}: {describe_errors(inside, model, limit)}"
    return describe_errors(problems, None, limit)


# --------------------------------------------------------------------------- middleware


class _HotCalls(NamedTuple):
    """The endpoints of the two calls a client makes most (an allocate and its release)."""

    allocate: Callable[[Any], Response]
    release: Callable[[str], Response]


_ALLOCATE_BODY: TypeAdapter[Any] = TypeAdapter(AllocateBody)
_SLOT_ID = re.compile(SLOT_ID_PATTERN)


class _FastLane:
    """POST /v1/slots and DELETE /v1/slots/{id} in their common form, straight to their endpoints.

    FastAPI's routing, dependency solving, exception and exit-stack middleware cost about 0.3 ms
    of a 0.6-1 ms round trip here (issue 23 item 7: REST within 1.3x of the in-process allocate).
    The lane takes a request only when FastAPI would do nothing else with it: no query string
    (so nothing for the unknown-query check to refuse), ``Content-Type: application/json``
    exactly, a body that the standard parser reads and the endpoint's own model accepts, a slot
    id the path parameter's pattern accepts. Everything else, invalid requests included, goes on
    to FastAPI untouched (the body replayed), so refusals keep their exact answers; the
    endpoint's own errors are answered by the same handlers as FastAPI's. The endpoint runs in
    the same thread pool, and the route is noted in the scope for the latency metrics.
    """

    def __init__(self, app: ASGIApp, hot: _HotCalls, routes: Sequence[Any]) -> None:
        self.app = app
        self.hot = hot
        self.allocate_route = _route(routes, "POST", "/v1/slots")
        self.release_route = _route(routes, "DELETE", "/v1/slots/{slot_id}")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not scope.get("query_string"):
            method, path = scope["method"], scope["path"]
            if method == "POST" and path == "/v1/slots":
                await self._allocate(scope, receive, send)
                return
            if method == "DELETE" and path.startswith("/v1/slots/"):
                slot_id = path[len("/v1/slots/") :]
                if len(slot_id) <= 63 and _SLOT_ID.fullmatch(slot_id):
                    scope["route"] = self.release_route
                    await self._answer(scope, receive, send, self.hot.release, slot_id)
                    return
        await self.app(scope, receive, send)

    async def _allocate(self, scope: Scope, receive: Receive, send: Send) -> None:
        if _header(scope, b"content-type") != "application/json":
            await self.app(scope, receive, send)
            return
        chunks: list[Message] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: FastAPI's to handle
                await self.app(scope, _replay_messages([*chunks, message], receive), send)
                return
            chunks.append(message)
            if not message.get("more_body", False):
                break
        body = b"".join(m.get("body", b"") for m in chunks)
        try:
            request = _ALLOCATE_BODY.validate_python(json.loads(body))
        except (ValueError, ValidationError):  # malformed or refused: FastAPI answers it
            await self.app(scope, _replay(body, receive), send)
            return
        scope["route"] = self.allocate_route
        await self._answer(scope, receive, send, self.hot.allocate, request)

    async def _answer(self, scope: Scope, receive: Receive, send: Send, call: Any, arg: Any) -> None:
        try:
            response = await run_in_threadpool(call, arg)
        except NodeAgentError as err:
            response = await _on_agent_error(Request(scope), err)
        except Exception as err:  # noqa: BLE001 - answered as FastAPI's handler answers it
            response = await _on_unexpected(Request(scope), err)
        await response(scope, receive, send)


def _route(routes: Sequence[Any], method: str, path: str) -> APIRoute:
    for route in routes:
        if isinstance(route, APIRoute) and route.path == path and method in (route.methods or ()):
            return route
    raise LookupError(f"no route {method} {path}")


def _replay_messages(messages: list[Message], receive: Receive) -> Receive:
    left = list(messages)

    async def replay() -> Message:
        return left.pop(0) if left else await receive()

    return replay


class _BodyLimit:
    """Reads the body up to ``max_bytes`` (413 beyond), refuses JSON that Python's parser would
    silently bend (:func:`json_ambiguity`: 422), then hands it on unchanged."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._too_large(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        problem = json_ambiguity(body) if body and _is_json(scope) else None
        if problem is not None:
            await error_response(422, "invalid_request", f"body: {problem}")(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"the body is larger than {self.max_bytes} bytes; slot requests are a few KiB"
        await error_response(413, "body_too_large", message, {"Connection": "close"})(scope, receive, send)


class _Ambiguous(ValueError):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    body: dict[str, Any] = {}
    for key, value in pairs:
        if key in body:
            raise _Ambiguous(f"key {key!r} appears twice in one object; send each key once")
        body[key] = value
    return body


def _exact_float(text: str) -> float:
    value = float(text)
    if value == 0 and any(c in "123456789" for c in text.split("e", maxsplit=1)[0].split("E", maxsplit=1)[0]):
        raise _Ambiguous(f"the number {text} is too small to be told from 0; send 0 or a larger number")
    return value


#: The deepest nesting a body may have: a slot request is about 6 deep; a body nested near
#: Python's recursion limit would fail deep inside the parsers (a 500) instead of being refused.
MAX_JSON_DEPTH = 64
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_JSON_BRACKET = re.compile(rb"[\[\]{}]")


def json_depth(body: bytes) -> int:
    """How deep a JSON body's arrays and objects nest (strings left out: brackets in them count
    for nothing); a malformed body's figure is the parser's to refuse."""
    depth = deepest = 0
    for bracket in _JSON_BRACKET.finditer(_JSON_STRING.sub(b'""', body)):
        if bracket.group() in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def json_ambiguity(body: bytes) -> str | None:
    """What in a JSON body a plain parse would silently bend: a key given twice (the last one would
    win) or a non-zero number that underflows to 0 (1e-400); or nesting deeper than any request
    needs (:data:`MAX_JSON_DEPTH`). None when there is nothing, or when the body is not JSON at all
    (that answer, 400, is the framework's)."""
    depth = json_depth(body)
    if depth > MAX_JSON_DEPTH:
        return f"nested {depth} deep; requests nest a few levels, at most {MAX_JSON_DEPTH}"
    try:
        json.loads(body, object_pairs_hook=_no_duplicate_keys, parse_float=_exact_float)
    except _Ambiguous as err:
        return str(err)
    except ValueError:
        return None
    return None


def _is_json(scope: Scope) -> bool:
    content_type = _header(scope, b"content-type") or ""
    return content_type.split(";")[0].strip().lower() in ("application/json", "")


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return str(value.decode("latin-1").strip())
    return None


class _BearerAuth:
    def __init__(self, app: ASGIApp, token: str, public_paths: frozenset[str]) -> None:
        self.app = app
        self.token = token.encode()
        self.public_paths = public_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.public_paths:
            await self.app(scope, receive, send)
            return
        problem = self._problem(_header(scope, b"authorization"))
        if problem is None:
            await self.app(scope, receive, send)
            return
        message, challenge = problem
        response = error_response(401, "unauthenticated", message, {"WWW-Authenticate": challenge})
        await response(scope, receive, send)

    def _problem(self, header: str | None) -> tuple[str, str] | None:
        if not header:
            return (
                "missing bearer token; send 'Authorization: Bearer <token>' with the token from the "
                "agent's token file (<state dir>/token)",
                'Bearer realm="nodeagent"',
            )
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return "the Authorization header must be 'Bearer <token>'", 'Bearer realm="nodeagent"'
        if not hmac.compare_digest(given.strip().encode(), self.token):
            return (
                "the bearer token does not match this agent's token; read it from the agent's token file",
                'Bearer realm="nodeagent", error="invalid_token"',
            )
        return None


class _Timing:
    """Records each request's latency by method, route template and status."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = _route_template(scope)
            self.metrics.observe_request(scope["method"], route, status, time.perf_counter() - start)


def _route_template(scope: Scope) -> str:
    """The matched path template (``/v1/slots/{slot_id}``), never the raw path: labels stay bounded."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    if isinstance(path, str):
        return path
    # Rejected before routing (401, 413): find the template the path would have matched.
    app = scope.get("app")
    for candidate in getattr(app, "routes", ()):
        match, _ = candidate.matches({**scope, "type": "http"})
        if match != Match.NONE:
            return str(candidate.path)
    return "unmatched"


def _document_auth(app: FastAPI, public: frozenset[str]) -> None:
    """Add the bearer scheme to the OpenAPI document (auth itself is enforced by middleware)."""
    build: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        components = schema.setdefault("components", {})
        components.setdefault("securitySchemes", {})["bearerAuth"] = {"type": "http", "scheme": "bearer"}
        schema["security"] = [{"bearerAuth": []}]
        for path, operations in schema.get("paths", {}).items():
            if path in public:
                for operation in operations.values():
                    operation["security"] = []
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


# --------------------------------------------------------------------------- python -m


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m nodeagent.agent.api --openapi``: print the OpenAPI document (for docs/openapi.json)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args != ["--openapi"]:
        print("usage: python -m nodeagent.agent.api --openapi > docs/openapi.json", file=sys.stderr)
        return 2
    print(openapi_document())
    return 0


def openapi_document() -> str:
    """The OpenAPI document as published in docs/openapi.json (stable key order, trailing newline)."""
    app = create_app(cast(SlotService, _NoService()), token=secrets.token_urlsafe())
    return json.dumps(app.openapi(), indent=2, sort_keys=True) + "\n"


class _NoService:
    """Enough of a service to build the app's routes; never called while generating the document."""

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        raise NodeAgentError(f"no service behind the API document generator (asked for {name})")


if __name__ == "__main__":
    raise SystemExit(main())
