"""docs/worker-spec.md documents every field of the worker spec and of its probes, and every preset."""

from __future__ import annotations

from pathlib import Path

import pytest

from nodeagent.runtime.presets import PRESETS
from nodeagent.schema.worker import ContainerMount, ContainerSpec, Probe, WorkerSpec

DOC = (Path(__file__).resolve().parents[2] / "docs" / "worker-spec.md").read_text()


@pytest.mark.parametrize(
    "field",
    [
        *WorkerSpec.model_fields,
        *Probe.model_fields,
        *ContainerSpec.model_fields,
        *ContainerMount.model_fields,
    ],
)
def test_every_field_has_a_row(field: str) -> None:
    assert f"| `{field}` |" in DOC, f"docs/worker-spec.md has no row for {field}"


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_has_a_row(preset: str) -> None:
    assert f"| `{preset}` |" in DOC
