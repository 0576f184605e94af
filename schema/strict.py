"""What every schema model shares: strictness, and small reusable field types.

Strict: no silent coercion ("2" is not 2, true is not 1); unknown fields are errors; NaN and
Infinity (which Python's JSON parser accepts) are never a value; models are frozen, so a request
that passed validation cannot change afterwards.

Lists arrive from JSON; the models hold them as tuples (immutable), so list fields take a list or a
tuple (:data:`AsTuple`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, BeforeValidator, ConfigDict


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


def _as_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


#: Put in an ``Annotated[tuple[...], AsTuple]`` field: a JSON list becomes the field's tuple.
AsTuple = BeforeValidator(_as_tuple)


__all__ = ["AsTuple", "StrictModel"]
