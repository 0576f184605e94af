"""docs/model-servers.md: a complete request for every preset, each one valid as written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from nodeagent.runtime.presets import PRESETS, resolve
from nodeagent.schema.request import parse_slot_request

DOC = (Path(__file__).resolve().parents[2] / "docs" / "model-servers.md").read_text()
REQUESTS = [json.loads(block) for block in re.findall(r"```json\n(.*?)```", DOC, re.DOTALL)]


@pytest.mark.parametrize("body", REQUESTS, ids=[b["name"] for b in REQUESTS])
def test_every_example_request_is_valid(body: dict[str, object]) -> None:
    request = parse_slot_request(body)
    assert request.worker is not None
    resolve(request.worker)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_has_an_example(preset: str) -> None:
    assert any(b["worker"]["preset"] == preset for b in REQUESTS)  # type: ignore[index]
