"""Host paths a request brings into a slot, weighed against the paths every worker is kept from
(the agent's state directory, its token files): one spelling for each path, and whether it meets
a hidden one.

A path is compared in two spellings, and meets a hidden path if either does: the kernel's
(symlinks resolved component by component, ``..`` after the link it follows: what a bind mount of
it would show) and the lexical one (``//`` collapsed, ``.`` and ``..`` folded, no trailing ``/``),
so neither a link nor a spelling such as ``//var/lib/nodeagent//state.db`` or
``/var/tmp/../lib/nodeagent`` slips past. A path that does not exist (yet) is resolved as far as it
does exist.
"""

from __future__ import annotations

import os.path
from collections.abc import Iterable
from enum import Enum


class Relation(Enum):
    """Where a path lies against a hidden path."""

    IN = "is"
    BELOW = "lies inside"
    ABOVE = "contains"


def lexical(path: str) -> str:
    """``path`` normalised without the file system: ``//`` (POSIX keeps a leading one), ``.``,
    ``..`` and a trailing ``/`` folded away."""
    folded = os.path.normpath(path)
    return "/" + folded.lstrip("/") if folded.startswith("/") else folded


def spellings(path: str) -> tuple[str, ...]:
    """The lexical and the resolved spelling of an absolute ``path`` (one if they agree)."""
    return tuple(dict.fromkeys((lexical(path), os.path.realpath(path))))


def relation(path: str, hidden: str) -> Relation | None:
    """How normalised ``path`` lies against normalised ``hidden``: the same, inside it, above it."""
    if path == hidden:
        return Relation.IN
    if path.startswith(hidden.rstrip("/") + "/"):
        return Relation.BELOW
    if hidden.startswith(path.rstrip("/") + "/"):
        return Relation.ABOVE
    return None


def meets_hidden(path: str, hidden: Iterable[str], *, above: bool = True) -> tuple[str, Relation, str] | None:
    """(the spelling of ``path`` that meets it, how, the hidden path) for the first hidden path
    ``path`` is, lies inside or (with ``above``) contains; None when it meets none. ``hidden``
    holds resolved paths (SandboxPolicy.hidden)."""
    covered = tuple(hidden)
    for spelling in spellings(path):
        for secret in covered:
            found = relation(spelling, secret)
            if found is not None and (above or found is not Relation.ABOVE):
                return spelling, found, secret
    return None


def describe(what: str, path: str, met: tuple[str, Relation, str]) -> str:
    """The sentence of a refusal: what was asked, what is wrong, what to do."""
    spelling, how, secret = met
    seen = f"{path!r}" if spelling == path else f"{path!r} (that is {spelling!r})"
    return (
        f"{what} {seen} {how.value} {secret!r}, which the agent keeps from every worker (its state "
        "directory or a token file); name a path outside it"
    )


__all__ = ["Relation", "describe", "lexical", "meets_hidden", "relation", "spellings"]
