"""A TorchServe handler for tests: a module-level entry point that doubles the JSON list it is sent
(no weights, no model hub; torch unused, though TorchServe's worker imports it). Packed into
doubler.mar by torch-model-archiver (tests/servers/heavy.py); POST /predictions/doubler with
[1.0, 2.5, -4.0] answers [2.0, 5.0, -8.0]."""

from __future__ import annotations

import json
from typing import Any


def _values(row: dict[str, Any]) -> list[float]:
    body = row.get("body") if row.get("body") is not None else row.get("data")
    if isinstance(body, bytes | bytearray):
        body = json.loads(body)
    return [float(v) for v in body]


def handle(data: list[dict[str, Any]] | None, context: Any) -> list[list[float]] | None:
    """TorchServe calls this with None once at load (initialise), then with each batch of requests."""
    if data is None:
        return None
    return [[2 * v for v in _values(row)] for row in data]
