"""docs/openapi.json is the API's published description: it must match what the code serves."""

from __future__ import annotations

import json
from pathlib import Path

from nodeagent.agent.api import main, openapi_document

DOC = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"
REFRESH = "python -m nodeagent.agent.api --openapi > docs/openapi.json"


def test_published_document_is_current(tmp_path: Path) -> None:
    fresh = tmp_path / "openapi.json"
    fresh.write_text(openapi_document())
    assert DOC.is_file(), f"docs/openapi.json is missing; create it with: {REFRESH}"
    assert json.loads(DOC.read_text()) == json.loads(fresh.read_text()), (
        f"docs/openapi.json is stale; refresh it with: {REFRESH}"
    )


def test_document_describes_every_path_with_bearer_auth_except_health() -> None:
    doc = json.loads(openapi_document())
    assert set(doc["paths"]) == {
        "/healthz",
        "/readyz",
        "/metrics",
        "/v1/node",
        "/v1/topology",
        "/v1/capacity",
        "/v1/slots",
        "/v1/slots/{slot_id}",
        "/v1/slots/{slot_id}/worker",
        "/v1/slots/{slot_id}/logs",
        "/v1/slots/{slot_id}/cdi",
        "/v1/nri/containers",
        "/v1/nri/containers/{container_id}",
        "/v1/nri/synchronize",
        "/v1/nri/updates",
        "/v1/pools",
        "/v1/pools/{name}",
    }
    assert doc["security"] == [{"bearerAuth": []}]
    assert doc["paths"]["/healthz"]["get"]["security"] == []
    assert "security" not in doc["paths"]["/v1/slots"]["post"]  # inherits the global requirement
    post = doc["paths"]["/v1/slots"]["post"]
    assert set(post["responses"]) >= {"200", "201", "409", "413", "422"}
    assert post["responses"]["409"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorModel")


def test_main_prints_the_document_and_refuses_other_arguments(capsys) -> None:
    assert main(["--openapi"]) == 0
    assert json.loads(capsys.readouterr().out)["info"]["title"] == "nodeagent"
    assert main([]) == 2
    assert REFRESH in capsys.readouterr().err
