"""Fake kernel trees (sysfs, procfs, cgroupfs, resctrl) for tests, written from ``{relpath: content}``.

A relpath ending in ``/`` is an empty directory; a :class:`Link` value is a symlink (sysfs is full
of them: ``driver``, ``physfn``, ``virtfn0``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Link:
    target: str


Tree = Mapping[str, "str | Link"]


def write_tree(root: Path, tree: Tree) -> Path:
    """Write ``tree`` under ``root`` (created as needed) and return ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    made: set[Path] = set()
    for rel, content in tree.items():
        path = root / rel
        if rel.endswith("/"):
            path.mkdir(parents=True, exist_ok=True)
            continue
        if path.parent not in made:
            path.parent.mkdir(parents=True, exist_ok=True)
            made.add(path.parent)
        if isinstance(content, Link):
            os.symlink(content.target, path)
        else:
            path.write_text(content)
    return root
