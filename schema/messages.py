"""Validation errors as people read them: which field, what was wrong, what would be accepted.

pydantic reports each problem with a location (``("resources", "cpus")``), a type and a message.
:func:`describe_errors` turns them into one line such as::

    resources.cpu: unknown field; known fields: cpus, memory, gpus, ...; did you mean 'cpus'?
    resources.cpus: 1e+308 is out of range; it must be 0 to 16384
    qos: must be one of guaranteed | burstable | best-effort, got 'gold'

The known fields of the model at a location are found by walking the root model's fields along
the location, so an unknown key is answered with the keys that would have been accepted there.
"""

from __future__ import annotations

import difflib
import json
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from nodeagent.errors import InvalidRequest

#: Locations pydantic adds inside a union ("int", "float", "literal['a','b']", a model's name) or
#: a validator chain ("function-after[...]"): not part of the field's path.
_MEMBER_PREFIXES = ("function-", "literal[", "constrained-", "json-or-python[", "lax-or-strict[")
_MEMBER_TAGS = frozenset({"int", "float", "str", "bool", "none", "list", "dict", "tuple"})
_MISSING = "is missing"
#: Messages for pydantic's constraint errors, filled from the error's context and the value shown.
_BOUNDS = {
    "greater_than_equal": "must be at least {ge}, got {got}",
    "greater_than": "must be above {gt}, got {got}",
    "less_than_equal": "must be at most {le}, got {got}",
    "less_than": "must be below {lt}, got {got}",
    "too_short": "has {actual_length} items; give at least {min_length}",
    "too_long": "has {actual_length} items; give at most {max_length}",
    "string_too_short": "must be at least {min_length} characters long, got {got}",
    "string_too_long": "must be at most {max_length} characters long",
}


def invalid_request(
    err: ValidationError, model: type[BaseModel], what: str, limit: int = 3
) -> InvalidRequest:
    """The project's InvalidRequest for a failed validation of ``model`` (``what`` names the document)."""
    return InvalidRequest(f"{what}: {describe_errors(err.errors(), model, limit=limit)}")


def describe_errors(
    problems: Sequence[Mapping[str, Any]], model: type[BaseModel] | None, limit: int = 3
) -> str:
    """One line for up to ``limit`` problems, merging the per-member errors of a union into one."""
    merged: dict[str, list[str]] = {}
    for problem in problems:
        loc = _path(problem.get("loc", ()))
        merged.setdefault(_dotted(loc), []).append(_message(problem, loc, model))
    parts = []
    for where, messages in list(merged.items())[:limit]:
        text = " or ".join(dict.fromkeys(messages))
        if not where:  # the whole document, or a rule across fields (its message names them)
            parts.append(text)
        elif text.startswith(_MISSING):
            parts.append(f"{where} {text}")
        else:
            parts.append(f"{where}: {text}")
    if len(merged) > limit:
        parts.append(f"and {len(merged) - limit} more")
    return "; ".join(parts)


def _path(loc: Sequence[Any]) -> list[str | int]:
    path: list[str | int] = []
    for part in loc:
        if isinstance(part, int):
            path.append(part)
            continue
        text = str(part)
        if text.startswith(_MEMBER_PREFIXES) or text in _MEMBER_TAGS or (text[:1].isupper() and path):
            continue
        path.append(text)
    return path


def _dotted(path: Sequence[str | int]) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text


def _message(problem: Mapping[str, Any], path: Sequence[str | int], model: type[BaseModel] | None) -> str:
    kind = str(problem.get("type", ""))
    got = _shown(problem["input"]) if "input" in problem else None
    if kind == "extra_forbidden":
        return _unknown_field(path, model)
    if kind == "missing":
        choices = _choices(model, path) if model is not None else ()
        return f"{_MISSING}; use one of {' | '.join(choices)}" if choices else _MISSING
    if kind in _BOUNDS:
        try:
            return _BOUNDS[kind].format(got=got, **problem.get("ctx", {}))
        except (KeyError, IndexError):
            pass  # a context we did not expect: pydantic's own words below
    if kind in ("value_error", "assertion_error"):
        message = str(problem.get("msg", "invalid"))
        return message.removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if kind == "literal_error":
        expected = str(problem.get("ctx", {}).get("expected", "")).replace("'", "").replace(" or ", ", ")
        return f"must be one of {' | '.join(e.strip() for e in expected.split(','))}, got {got}"
    if kind.endswith("_type") or kind.endswith("_parsing"):
        return f"must be {_expected(kind)}, got {got}"
    message = str(problem.get("msg", "invalid"))
    message = message[:1].lower() + message[1:]
    return f"{message} (got {got})" if got is not None else message


def _expected(kind: str) -> str:
    return {
        "int_type": "a whole number",
        "int_parsing": "a whole number",
        "float_type": "a number",
        "float_parsing": "a number",
        "string_type": "a string",
        "bool_type": "true or false",
        "list_type": "a list",
        "tuple_type": "a list",
        "dict_type": "an object",
        "model_type": "an object",
        "model_attributes_type": "an object",
        "none_type": "null",
    }.get(kind, kind.removesuffix("_type").replace("_", " "))


def _unknown_field(path: Sequence[str | int], model: type[BaseModel] | None) -> str:
    known = _known_fields(model, path[:-1]) if model is not None else []
    if not known:
        return "unknown field"
    text = f"unknown field; known fields: {', '.join(known)}"
    close = difflib.get_close_matches(str(path[-1]), known, n=1)
    return f"{text}; did you mean {close[0]!r}?" if close else text


def _choices(model: type[BaseModel], path: Sequence[str | int]) -> tuple[str, ...]:
    """The values a Literal field at ``path`` takes (empty for any other field)."""
    if not path or isinstance(path[-1], int):
        return ()
    owner = _model_at(model, path[:-1])
    fields = getattr(owner, "model_fields", None) or {}
    info = fields.get(path[-1])
    annotation = None if info is None else info.annotation
    if typing.get_origin(annotation) is typing.Literal:
        return tuple(str(a) for a in typing.get_args(annotation))
    return ()


def _known_fields(model: type[BaseModel], path: Sequence[str | int]) -> list[str]:
    fields = getattr(_model_at(model, path), "model_fields", None)
    return list(fields) if fields else []


def _model_at(model: type[BaseModel], path: Sequence[str | int]) -> type[BaseModel] | None:
    """The model found by following ``path`` down from ``model`` (None where it leads to no model)."""
    current: type[BaseModel] | None = model
    for part in path:
        if isinstance(part, int):
            continue  # a list index: the element type was already unwrapped
        fields = getattr(current, "model_fields", None)
        if fields is None or part not in fields:
            return None
        current = _model_in(fields[part].annotation)
    return current


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model a field's annotation holds: itself, in an Optional/union, or as a list's element."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _model_in(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType, list, tuple):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None


def _shown(value: Any) -> str:
    if isinstance(value, bytes):
        text = repr(value)
    else:
        try:
            text = json.dumps(value, allow_nan=True)
        except (TypeError, ValueError):
            text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


__all__ = ["describe_errors", "invalid_request"]
