"""SlotRequest parsing: what is accepted, and the message for each refusal."""

from __future__ import annotations

import gc
import tracemalloc
from typing import Any

import pytest

from nodeagent.errors import InvalidRequest
from nodeagent.schema import request as request_module
from nodeagent.schema.request import (
    NetworkRequest,
    SlotRequest,
    format_quantity,
    format_quantity_short,
    parse_quantity,
    parse_slot_request,
    request_to_dict,
)


def req(qos: str = "guaranteed", **resources: Any) -> dict[str, Any]:
    return {"name": "slot-a", "qos": qos, "resources": resources or {"cpus": 1}}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(0, 0, id="zero"),
        pytest.param(4096, 4096, id="plain-int"),
        pytest.param("4Gi", 4 * 2**30, id="gibibytes"),
        pytest.param("512Mi", 512 * 2**20, id="mebibytes"),
        pytest.param("1G", 10**9, id="decimal-gigabytes"),
        pytest.param("1.5Gi", 3 * 2**29, id="fractional-binary"),
        pytest.param("100", 100, id="digits-string"),
        pytest.param("2k", 2000, id="decimal-kilo"),
    ],
)
def test_parse_quantity_accepts(text: Any, expected: int) -> None:
    assert parse_quantity(text) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        pytest.param("4GB", "'4GB' is not a quantity", id="unknown-unit"),
        pytest.param("-1", "is not a quantity", id="negative-string"),
        pytest.param(-1, "out of range", id="negative-int"),
        pytest.param("0.5", "not a whole number of bytes", id="fraction-of-a-byte"),
        pytest.param("99999Ei", "out of range", id="huge"),
        pytest.param(True, "must be a byte count", id="bool"),
        pytest.param(1.5, "must be a byte count", id="float"),
        pytest.param("", "is not a quantity", id="empty"),
        pytest.param("1ki", "is not a quantity", id="lower-case-binary-kilo"),
    ],
)
def test_parse_quantity_refuses(value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_quantity(value)


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [(4 * 2**30, "4Gi"), (512 * 2**20, "512Mi"), (1000, "1000"), (0, "0"), (3 * 2**29, "1536Mi")],
)
def test_format_quantity_is_exact(nbytes: int, text: str) -> None:
    assert format_quantity(nbytes) == text
    assert parse_quantity(text) == nbytes


def test_full_request_parses() -> None:
    r = parse_slot_request(
        {
            "name": "llm-a.v2_x",
            "qos": "guaranteed",
            "resources": {
                "cpus": 4,
                "memory": "2Gi",
                "gpus": 1,
                "fpgas": 1,
                "devices": ["/dev/fuse"],
                "numa": "single",
                "network": {"bandwidth_mbit": 1000},
                "l3": 0.5,
            },
            "worker": {"command": ["/bin/true"]},
        }
    )
    res = r.resources
    assert (r.name, r.qos, res.whole_cpus, res.memory_bytes) == ("llm-a.v2_x", "guaranteed", 4, 2 * 2**30)
    assert (res.gpus, res.fpgas, res.devices, res.numa) == (1, 1, ("/dev/fuse",), "single")
    assert res.network == NetworkRequest(bandwidth_mbit=1000)
    assert res.l3_share == 0.5
    assert r.worker is not None
    assert r.worker.command == ("/bin/true",)


@pytest.mark.parametrize(
    ("resources", "cpu_millis"),
    [
        pytest.param({"cpus": 1.5}, 1500, id="fractional"),
        pytest.param({"cpus": "250m"}, 250, id="millis-string"),
        pytest.param({"cpus": 0}, 0, id="zero-quota"),
        pytest.param({}, 0, id="no-cpus"),
    ],
)
def test_burstable_takes_fractional_cpus(resources: dict[str, Any], cpu_millis: int) -> None:
    r = parse_slot_request({"name": "b", "qos": "burstable", "resources": resources})
    assert r.resources.cpu_millis == cpu_millis


def test_defaults() -> None:
    r = parse_slot_request({"name": "a", "qos": "best-effort"})
    assert r.resources.numa == "prefer"
    assert r.resources.memory_bytes == 0
    assert r.worker is None


def test_profile_alone_means_one_instance() -> None:
    r = parse_slot_request(req(cpus=1, gpu_profile="1g.10gb"))
    assert (r.resources.gpus, r.resources.gpu_profile) == (1, "1g.10gb")


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        pytest.param({"qos": "guaranteed"}, "name is missing", id="no-name"),
        pytest.param({"name": "Bad Name", "qos": "guaranteed"}, "is not a safe identifier", id="name-spaces"),
        pytest.param(
            {"name": "../etc", "qos": "guaranteed"}, "is not a safe identifier", id="name-traversal"
        ),
        pytest.param({"name": "a" * 64, "qos": "guaranteed"}, "is not a safe identifier", id="name-too-long"),
        pytest.param(
            {"name": "s0123456789ab", "qos": "guaranteed"}, "has the form of a slot id", id="name-like-an-id"
        ),
        pytest.param({"name": "a", "qos": "gold"}, "qos must be one of guaranteed | burstable", id="bad-qos"),
        pytest.param({"name": "a"}, "qos is missing; use one of guaranteed | burstable", id="no-qos"),
        pytest.param(
            {"name": "a", "qos": "guaranteed", "colour": 1},
            "colour: unknown field; known fields: name, qos, resources, priority, worker",
            id="unknown-top",
        ),
        pytest.param(
            req(cpus=1, gpu=1),
            "resources.gpu: unknown field; known fields: cpus, .*; did you mean 'gpus'",
            id="unknown-resource",
        ),
        pytest.param(req(cpus=1.5), "guaranteed slots get exclusive CPUs", id="guaranteed-fraction"),
        pytest.param(req(cpus=0), "ask for a whole number of at least 1", id="guaranteed-zero"),
        pytest.param(req(cpus=-2), "out of range", id="negative-cpus"),
        pytest.param(req(cpus=float("nan")), "must be a finite number", id="nan-cpus"),
        pytest.param(req(cpus=float("inf")), "must be a finite number", id="inf-cpus"),
        pytest.param(req(cpus=10**9), "out of range", id="huge-cpus"),
        pytest.param(req("burstable", cpus=1e308), "out of range", id="float-too-big-to-scale"),
        pytest.param(
            req(cpus=1, memory=10**400), r"memory: 1000+\.\.\. is out of range", id="huge-memory-shortened"
        ),
        pytest.param(req(cpus=True), "must be a number", id="bool-cpus"),
        pytest.param(req("burstable", cpus=0.0001), "below the smallest amount, 0.001", id="too-fine"),
        pytest.param(req("burstable", cpus=1.0001), "more than three decimals", id="too-many-decimals"),
        pytest.param(req(cpus=1, memory="lots"), "memory: 'lots' is not a quantity", id="bad-memory"),
        pytest.param(req(cpus=1, gpus=-1), "resources.gpus: must be at least 0, got -1", id="negative-gpus"),
        pytest.param(req(cpus=1, gpus=1.0), "resources.gpus: must be a whole number", id="float-gpus"),
        pytest.param(req(cpus=1, gpu_share=1.5), "gpu_share: 1.5 is out of range", id="share-above-one"),
        pytest.param(req(cpus=1, gpu_share=0.5, gpus=1), "cannot be combined", id="share-and-gpus"),
        pytest.param(req(cpus=1, numa="strict"), "resources.numa: must be one of single", id="bad-numa"),
        pytest.param(
            req(cpus=1, devices=["/etc/passwd"]), r"devices\[0\]: must be a device path", id="not-dev"
        ),
        pytest.param(
            req(cpus=1, devices=["/dev/../etc"]), r"devices\[0\]: must be a device path", id="dev-dots"
        ),
        pytest.param(req(cpus=1, devices=["/dev/a", "/dev/a"]), "lists a path twice", id="dev-twice"),
        pytest.param(
            req(cpus=1, network={"bandwidth_mbit": 0}), "bandwidth_mbit: must be at least 1", id="zero-bw"
        ),
        pytest.param(
            req(cpus=1, network={"burst": 1}),
            "resources.network.burst: unknown field; known fields: bandwidth_mbit",
            id="net-key",
        ),
        pytest.param(req(cpus=1, l3=2), "resources.l3: must be at most 1", id="l3-above-one"),
        pytest.param(
            {"name": "a", "qos": "burstable", "worker": "run"}, "worker: must be an object", id="worker"
        ),
        pytest.param([], "request: must be an object", id="not-an-object"),
        pytest.param(
            {"name": "a", "qos": "best-effort", "priority": -1},
            "priority: must be at least 0",
            id="priority-low",
        ),
        pytest.param(
            {"name": "a", "qos": "best-effort", "priority": 1001},
            "priority: must be at most 1000",
            id="priority-high",
        ),
        pytest.param(
            {"name": "a", "qos": "best-effort", "priority": "high"},
            "priority: must be a whole number",
            id="priority-text",
        ),
        pytest.param(
            {"name": "a", "qos": "burstable", "resources": {"memory": "1Mi"}, "priority": 5},
            "priority is 5 for a burstable slot; priority orders best-effort slots only",
            id="priority-online",
        ),
    ],
)
def test_refusals_name_the_field(obj: Any, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        parse_slot_request(obj)


@pytest.mark.parametrize(
    "obj",
    [
        pytest.param(req(cpus=4, memory="2Gi", gpus=2, numa="single"), id="guaranteed-gpus"),
        pytest.param(req("burstable", cpus=0.25, gpu_share=0.5), id="burstable-share"),
        pytest.param(req(cpus=1, gpu_profile="1g.10gb", devices=["/dev/fuse"]), id="mig-device"),
        pytest.param(req(cpus=2, network={"bandwidth_mbit": 100}, l3=0.25), id="network-l3"),
    ],
)
def test_round_trip_through_json(obj: dict[str, Any]) -> None:
    parsed = parse_slot_request(obj)
    assert parse_slot_request(request_to_dict(parsed)) == parsed


@pytest.mark.parametrize(
    ("nbytes", "shown"),
    [(512 * 2**20, "512Mi"), (6907624 * 1024, "6.6Gi"), (1000, "1000"), (123456789, "117.7Mi"), (0, "0")],
)
def test_format_quantity_short(nbytes: int, shown: str) -> None:
    assert format_quantity_short(nbytes) == shown


def test_priority_orders_best_effort_and_defaults_to_zero() -> None:
    assert parse_slot_request({"name": "a", "qos": "best-effort", "priority": 700}).priority == 700
    body = {"name": "a", "qos": "guaranteed", "resources": {"cpus": 1, "memory": "1Mi"}}
    default = parse_slot_request(body)
    assert default.priority == 0
    # A stored request from before the field existed reads back the same.
    assert request_to_dict(default)["priority"] == 0
    assert parse_slot_request(request_to_dict(default)) == default


def test_a_requests_json_form_is_dumped_once_and_each_call_gets_objects_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    request = parse_slot_request(
        {"name": "a", "qos": "burstable", "resources": {"cpus": 0.5}, "worker": {"command": ["x"]}}
    )
    first = request_to_dict(request)
    monkeypatch.setattr(SlotRequest, "model_dump", _no_second_dump)
    second = request_to_dict(request)
    assert second == first
    assert list(second) == list(first)  # the same keys in the same order: the same JSON
    second["resources"]["cpus"] = 9
    second["worker"]["command"].append("y")
    assert request_to_dict(request) == first


def test_a_remembered_json_form_goes_with_its_request() -> None:
    request = parse_slot_request({"name": "a", "qos": "burstable"})
    request_to_dict(request)
    key = id(request)
    assert key in request_module._DUMPED
    del request
    gc.collect()
    assert key not in request_module._DUMPED


def test_a_remembered_json_form_holds_no_more_than_its_text() -> None:
    # orjson's bytes keep the 4 KiB buffer they were written into; 500 slots remember one each.
    requests = [parse_slot_request({"name": f"r{i}", "qos": "burstable"}) for i in range(50)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for request in requests:
            request_to_dict(request)
        held = (tracemalloc.get_traced_memory()[0] - before) / len(requests)
    finally:
        tracemalloc.stop()
    assert held < 1024


def _no_second_dump(*_: Any, **__: Any) -> Any:
    raise AssertionError("dumped again")
