"""Containers placed through NRI: the translation (agent.nri) and the shim's REST calls over the
fake service (real parser and planner, no kernel)."""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any

import pytest

from nodeagent.agent.api import create_app
from nodeagent.agent.nri import SLOT_PREFIX, managed_devices, pods_cgroups_problems, slot_name, slot_request
from nodeagent.agent.slot import SlotState
from nodeagent.cpulist import parse_cpulist
from nodeagent.errors import InvalidRequest
from nodeagent.placement import PlacementOptions
from nodeagent.schema.nri_messages import NriContainer
from tests.agent.fake_service import FakeSlotService
from tests.agent.test_api import AUTH, TOKEN, AppClient, error_of

CID = "0123456789abcdef" * 4


def container(
    cid: str = CID,
    *,
    qos_class: str = "",
    cgroup_parent: str = "",
    quota: int = 0,
    period: int = 100_000,
    shares: int = 2,
    memory: int = 0,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    return {
        "id": cid,
        "name": "app",
        "pod": {
            "uid": "9b2d6c1e-0000-4000-8000-000000000001",
            "namespace": "default",
            "name": "web",
            "qos_class": qos_class,
            "cgroup_parent": cgroup_parent,
            "annotations": annotations or {},
        },
        "resources": {"cpu_shares": shares, "cpu_quota": quota, "cpu_period": period, "memory_limit": memory},
    }


def translate(**kwargs: Any) -> dict[str, Any]:
    request = slot_request(NriContainer.model_validate(container(**kwargs)))
    return {"qos": request.qos, "cpus": request.resources.cpus, "memory": request.resources.memory}


# --------------------------------------------------------------------------- translation


def test_guaranteed_with_whole_cpus_gets_exclusive_cores() -> None:
    assert translate(qos_class="Guaranteed", quota=200_000, memory=1 << 30, shares=2048) == {
        "qos": "guaranteed",
        "cpus": 2,
        "memory": 1 << 30,
    }


def test_the_class_is_read_from_the_cgroup_parent_when_not_given() -> None:
    assert translate(cgroup_parent="/kubepods/pod1234", quota=100_000, memory=1 << 28)["qos"] == "guaranteed"
    assert translate(cgroup_parent="kubepods-burstable-pod12.slice", quota=100_000, memory=1 << 28)[
        "qos"
    ] == ("burstable")
    assert translate(cgroup_parent="/kubepods/besteffort/pod12")["qos"] == "best-effort"


def test_fractional_guaranteed_is_burstable_with_the_quota() -> None:
    assert translate(qos_class="Guaranteed", quota=150_000, memory=1 << 28) == {
        "qos": "burstable",
        "cpus": 1.5,
        "memory": 1 << 28,
    }


def test_burstable_without_a_cpu_limit_asks_for_its_request_from_shares() -> None:
    assert translate(qos_class="Burstable", shares=512, memory=1 << 28) == {
        "qos": "burstable",
        "cpus": 0.5,
        "memory": 1 << 28,
    }


def test_burstable_without_a_memory_limit_and_besteffort_are_best_effort() -> None:
    assert translate(qos_class="Burstable", shares=512) == {"qos": "best-effort", "cpus": 0.0, "memory": 0}
    assert translate(qos_class="BestEffort") == {"qos": "best-effort", "cpus": 0.0, "memory": 0}


def test_without_a_class_the_limits_decide() -> None:
    assert translate(quota=100_000, memory=1 << 28)["qos"] == "guaranteed"
    assert translate(memory=1 << 28)["qos"] == "burstable"
    assert translate()["qos"] == "best-effort"


def test_known_annotations_set_the_request() -> None:
    request = slot_request(
        NriContainer.model_validate(
            container(
                qos_class="Guaranteed",
                quota=100_000,
                memory=1 << 28,
                annotations={
                    "nodeagent.io/numa": "single",
                    "nodeagent.io/l3": "0.5",
                    "other.io/x": "kept out",
                },
            )
        )
    )
    assert (request.resources.numa, request.resources.l3) == ("single", 0.5)


@pytest.mark.parametrize(
    ("annotations", "words"),
    [
        ({"nodeagent.io/numa-policy": "single"}, "nodeagent.io/numa-policy"),
        ({"nodeagent.io/numa": "sometimes"}, "numa"),
        ({"nodeagent.io/priority": "high"}, "whole number"),
        ({"nodeagent.io/priority": "5"}, "best-effort"),
    ],
)
def test_bad_annotations_are_refused_with_the_reason(annotations: dict[str, str], words: str) -> None:
    with pytest.raises(InvalidRequest, match=words):
        translate(qos_class="Guaranteed", quota=100_000, memory=1 << 28, annotations=annotations)


def test_an_unknown_class_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="qos_class"):
        translate(qos_class="Platinum")


def test_slot_names_are_the_container_id() -> None:
    assert slot_name(CID) == SLOT_PREFIX + CID[:59]
    assert slot_name("short-id") == "nri-short-id"
    hashed = slot_name("Upper_Case_ID")
    assert hashed.startswith(SLOT_PREFIX)
    assert len(hashed) == 63
    assert hashed == slot_name("Upper_Case_ID")


# --------------------------------------------------------------------------- the shim's calls


@pytest.fixture
def service() -> FakeSlotService:
    return FakeSlotService()


@pytest.fixture
def client(service: FakeSlotService) -> AppClient:
    return AppClient(create_app(service, token=TOKEN, nri=True), AUTH)


GUARANTEED_1 = {"qos_class": "Guaranteed", "quota": 100_000, "memory": 256 << 20}


def test_create_places_a_guaranteed_container_on_exclusive_cpus(client: AppClient) -> None:
    response = client.post("/v1/nri/containers", json=container(**GUARANTEED_1))
    assert response.status_code == 200, response.text
    body = response.json()
    slot = client.get(f"/v1/slots/{body['slot_id']}").json()
    assert body["slot_name"] == slot["name"] == slot_name(CID)
    assert body["container_id"] == CID
    assert body["qos"] == "guaranteed"
    assert body["cpuset_cpus"] == slot["assignment"]["cpuset"] != ""
    assert body["cpuset_mems"] == ",".join(str(n) for n in slot["assignment"]["numa_nodes"])
    assert body["memory_limit"] == 256 << 20
    # The same event again (a retried CreateContainer) gets the same slot.
    again = client.post("/v1/nri/containers", json=container(**GUARANTEED_1))
    assert again.status_code == 200
    assert again.json() == body
    assert len(client.get("/v1/slots").json()["slots"]) == 1


def cpus_of(cpulist: str) -> set[int]:
    return set(parse_cpulist(cpulist))


def test_a_shared_container_gets_the_shared_pool(client: AppClient, service: FakeSlotService) -> None:
    body = client.post("/v1/nri/containers", json=container(qos_class="Burstable", memory=1 << 28)).json()
    assert (body["qos"], body["cpuset_mems"], body["updates"]) == ("burstable", "", [])
    assert (
        cpus_of(body["cpuset_cpus"]) == set(service.shared_pool()) == {c.id for c in service.topology().cpus}
    )
    assert body["pool_version"] == body["cpuset_cpus"]


def test_a_guaranteed_container_moves_the_shared_ones_off_its_cpus(client: AppClient) -> None:
    shared = "e" * 64
    best_effort = "f" * 64
    client.post("/v1/nri/containers", json=container(shared, qos_class="Burstable", memory=1 << 28))
    client.post("/v1/nri/containers", json=container(best_effort, qos_class="BestEffort"))
    body = client.post("/v1/nri/containers", json=container(**GUARANTEED_1)).json()
    exclusive = cpus_of(body["cpuset_cpus"])
    assert exclusive
    updates = {u["container_id"]: u for u in body["updates"]}
    # Both shared containers, not the new one, are told the pool without its exclusive CPUs.
    assert set(updates) == {shared, best_effort}
    for update in updates.values():
        assert cpus_of(update["cpuset_cpus"]) == cpus_of(body["pool_version"])
        assert not cpus_of(update["cpuset_cpus"]) & exclusive
    # A second shared container placed now gets the smaller pool in its own answer.
    later = client.post("/v1/nri/containers", json=container("9" * 64, qos_class="BestEffort")).json()
    assert later["updates"] == []
    assert not cpus_of(later["cpuset_cpus"]) & exclusive


def test_updates_follow_rest_slots_and_releases(client: AppClient, service: FakeSlotService) -> None:
    shared = "e" * 64
    first = client.post(
        "/v1/nri/containers", json=container(shared, qos_class="Burstable", memory=1 << 28)
    ).json()
    version = first["pool_version"]
    # Nothing changed: an immediate answer with no updates and the same version.
    same = client.get("/v1/nri/updates", params={"version": version, "wait": 0}).json()
    assert same == {"version": version, "updates": []}
    # A shim that knows no version yet gets every shared container.
    fresh = client.get("/v1/nri/updates").json()
    assert [u["container_id"] for u in fresh["updates"]] == [shared]
    # A guaranteed slot made through REST, while the shim waits: its CPUs leave the shared containers.
    answers: list[dict[str, Any]] = []
    waiter = threading.Thread(
        target=lambda: answers.append(
            client.get("/v1/nri/updates", params={"version": version, "wait": 20}).json()
        )
    )
    waiter.start()
    rest = client.post(
        "/v1/slots", json={"name": "rest-g", "qos": "guaranteed", "resources": {"cpus": 2, "memory": "64Mi"}}
    ).json()
    waiter.join(timeout=25)
    assert answers, "the long poll did not return"
    taken = set(rest["assignment"]["cpus"])
    (update,) = answers[0]["updates"]
    assert update["container_id"] == shared
    assert not cpus_of(update["cpuset_cpus"]) & taken
    assert answers[0]["version"] != version
    # Its release gives them back.
    client.delete(f"/v1/slots/{rest['id']}")
    back = client.get("/v1/nri/updates", params={"version": answers[0]["version"], "wait": 0}).json()
    assert cpus_of(back["updates"][0]["cpuset_cpus"]) == set(service.shared_pool())
    assert back["version"] == version


def test_a_removed_container_gets_no_updates(client: AppClient) -> None:
    shared = "e" * 64
    client.post("/v1/nri/containers", json=container(shared, qos_class="BestEffort"))
    client.delete(f"/v1/nri/containers/{shared}")
    assert client.get("/v1/nri/updates").json()["updates"] == []


def test_a_numa_bound_shared_container_stays_on_its_node(client: AppClient, service: FakeSlotService) -> None:
    body = client.post(
        "/v1/nri/containers",
        json=container(qos_class="Burstable", memory=1 << 28, annotations={"nodeagent.io/numa": "single"}),
    ).json()
    (node,) = cpus_of(body["cpuset_mems"])
    on_node = {c for n in service.topology().numa_nodes if n.id == node for c in n.cpus}
    assert cpus_of(body["cpuset_cpus"]) == on_node


def test_updates_need_nri(service: FakeSlotService) -> None:
    client = AppClient(create_app(service, token=TOKEN), AUTH)
    assert error_of(client.get("/v1/nri/updates"))[:2] == (422, "unsupported")
    nri = AppClient(create_app(service, token=TOKEN, nri=True), AUTH)
    assert nri.get("/v1/nri/updates", params={"wait": 31}).status_code == 422


def test_a_container_that_does_not_fit_is_refused_with_the_reason(client: AppClient) -> None:
    response = client.post(
        "/v1/nri/containers", json=container(qos_class="Guaranteed", quota=6_400_000, memory=1 << 28)
    )
    status, code, message = error_of(response)
    assert (status, code) == (409, "does_not_fit")
    assert "cpus" in message.lower() or "cpu" in message.lower()
    assert client.get("/v1/slots").json()["slots"] == []


def test_an_unknown_annotation_is_422(client: AppClient) -> None:
    response = client.post(
        "/v1/nri/containers", json=container(annotations={"nodeagent.io/gpu-share": "0.5"})
    )
    status, code, message = error_of(response)
    assert (status, code) == (422, "invalid_request")
    assert "nodeagent.io/gpu-share" in message


def test_remove_releases_and_is_idempotent(client: AppClient, service: FakeSlotService) -> None:
    client.post("/v1/nri/containers", json=container(**GUARANTEED_1))
    assert client.delete(f"/v1/nri/containers/{CID}").status_code == 204
    assert client.get("/v1/slots").json()["slots"] == []
    assert client.delete(f"/v1/nri/containers/{CID}").status_code == 204
    assert ("release", slot_name(CID)) in service.calls


def test_synchronize_keeps_releases_and_places(client: AppClient) -> None:
    kept, gone, new, refused = ("a" * 64, "b" * 64, "c" * 64, "d" * 64)
    client.post("/v1/nri/containers", json=container(kept, **GUARANTEED_1))
    client.post("/v1/nri/containers", json=container(gone, **GUARANTEED_1))
    rest = client.post(
        "/v1/slots",
        json={"name": "rest-slot", "qos": "burstable", "resources": {"cpus": 1, "memory": "64Mi"}},
    )
    assert rest.status_code == 201
    before = {s["name"]: s["id"] for s in client.get("/v1/slots").json()["slots"]}
    response = client.post(
        "/v1/nri/synchronize",
        json={
            "containers": [
                container(kept, **GUARANTEED_1),
                container(new, qos_class="BestEffort"),
                container(refused, qos_class="Guaranteed", quota=6_400_000, memory=1 << 28),
            ]
        },
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["released"] == [slot_name(gone)]
    assert sorted(u["container_id"] for u in body["updates"]) == [kept, new]
    by_id = {u["container_id"]: u for u in body["updates"]}
    # The best-effort container is told the shared pool as it is once the kept one holds its CPU.
    assert not cpus_of(by_id[new]["cpuset_cpus"]) & cpus_of(by_id[kept]["cpuset_cpus"])
    assert list(body["refused"]) == [refused]
    after = {s["name"]: s["id"] for s in client.get("/v1/slots").json()["slots"]}
    # The kept container's slot is the same slot; the REST slot is not the shim's to release.
    assert after[slot_name(kept)] == before[slot_name(kept)]
    assert set(after) == {slot_name(kept), slot_name(new), "rest-slot"}


def test_rest_clients_cannot_take_the_prefix_while_nri_is_on(client: AppClient) -> None:
    response = client.post("/v1/slots", json={"name": "nri-mine", "qos": "best-effort"})
    status, code, message = error_of(response)
    assert (status, code) == (422, "invalid_request")
    assert "nri-" in message


def test_nri_is_off_by_default(service: FakeSlotService) -> None:
    client = AppClient(create_app(service, token=TOKEN), AUTH)
    status, code, message = error_of(client.post("/v1/nri/containers", json=container(**GUARANTEED_1)))
    assert (status, code) == (422, "unsupported")
    assert "[kubernetes] nri = true" in message
    assert client.post("/v1/slots", json={"name": "nri-mine", "qos": "best-effort"}).status_code == 201


def test_bad_container_ids_are_refused(client: AppClient) -> None:
    assert client.post("/v1/nri/containers", json=container("../etc")).status_code == 422
    assert client.delete("/v1/nri/containers/..%2Fetc").status_code in (404, 422)


def test_a_failed_slot_of_the_container_is_made_again(client: AppClient, service: FakeSlotService) -> None:
    first = client.post("/v1/nri/containers", json=container(**GUARANTEED_1)).json()
    held = service._slots[first["slot_id"]]
    held.view = replace(held.view, state=SlotState.FAILED, reason="the kernel refused")
    again = client.post("/v1/nri/containers", json=container(**GUARANTEED_1)).json()
    assert again["slot_id"] != first["slot_id"]
    assert again["cpuset_cpus"] != ""
    assert [s["state"] for s in client.get("/v1/slots").json()["slots"]] == ["ready"]


# --------------------------------------------------------------------------- devices


NULL_DEVICE = {"path": "/dev/accel-in-the-container", "type": "c", "major": 1, "minor": 3}  # /dev/null's
OTHER_DEVICE = {"path": "/dev/fuse", "type": "c", "major": 10, "minor": 229}


def test_the_agents_devices_the_runtime_gives_a_container_are_held_by_its_slot(tmp_path: Any) -> None:
    """Matched by number (the path inside the container may differ from the host's); devices the
    agent does not manage, and allowed paths that are missing or not device nodes, are left out."""
    regular = tmp_path / "not-a-device"
    regular.write_text("")
    managed = managed_devices(["/dev/null", str(regular), str(tmp_path / "missing")])
    assert managed == {("c", 1, 3): "/dev/null"}
    body = container(**GUARANTEED_1)
    body["devices"] = [NULL_DEVICE, OTHER_DEVICE, NULL_DEVICE]
    request = slot_request(NriContainer.model_validate(body), managed)
    assert request.resources.devices == ("/dev/null",)
    assert slot_request(NriContainer.model_validate(body)).resources.devices == ()  # none managed
    assert NriContainer.model_validate(container()).devices == ()  # an older shim sends none


def test_create_holds_the_containers_allowed_device_in_its_slot() -> None:
    """The ledger then counts it: a second container given the same device does not fit."""
    service = FakeSlotService(options=PlacementOptions(allowed_devices=frozenset({"/dev/null"})))
    client = AppClient(create_app(service, token=TOKEN, nri=True, nri_devices=["/dev/null"]), AUTH)
    body = container(**GUARANTEED_1)
    body["devices"] = [NULL_DEVICE, OTHER_DEVICE]
    response = client.post("/v1/nri/containers", json=body)
    assert response.status_code == 200, response.text
    slot = client.get(f"/v1/slots/{response.json()['slot_id']}").json()
    assert slot["request"]["resources"]["devices"] == ["/dev/null"]
    other = container("f" * 64, **GUARANTEED_1)
    other["devices"] = [NULL_DEVICE]
    refused = client.post("/v1/nri/containers", json=other)
    assert refused.status_code == 409, refused.text
    assert "/dev/null" in error_of(refused)[2]


def test_pods_cgroups_that_are_nowhere_are_a_problem_until_they_appear(tmp_path: Any) -> None:
    """With host partitioning on, pods_cgroups that name no cgroup would leave the kubelet's pods to
    be confined with the host: GET /v1/node (and `nodeagent doctor`) says so until they exist."""
    roots = [tmp_path / "cpuset", tmp_path / "memory"]
    for root in roots:
        root.mkdir()
    (said,) = pods_cgroups_problems(["kubepods", "kubepods.slice"], roots)
    assert "none of [kubernetes] pods_cgroups (kubepods, kubepods.slice)" in said
    assert "cgroup root followed by kubepods" in said
    (roots[0] / "kube" / "kubepods").mkdir(parents=True)  # the kubelet started, --cgroup-root=kube
    assert pods_cgroups_problems(["/kube/kubepods/"], roots) == ()
    assert pods_cgroups_problems(["kubepods"], roots) != ()
