"""The package's house rules (docs/architecture.md, "One reader, one writer"), kept by reading its source.

Each rule names the one module allowed to do a thing; a hit elsewhere fails with what to use
instead. A real exception goes in the rule's list with the reason beside it.
"""

from __future__ import annotations

import collections
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: The folders that install as the package (pyproject.toml's package-dir).
PACKAGE_DIRS = (
    "nodeagent",
    "agent",
    "cli",
    "devices",
    "isolation",
    "cgroups",
    "runtime",
    "schema",
    "placement",
)


def _sources() -> list[Path]:
    return sorted(p for d in PACKAGE_DIRS for p in (ROOT / d).rglob("*.py"))


def _hits(pattern: str, allowed: dict[str, str]) -> list[str]:
    found = []
    regex = re.compile(pattern)
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        if rel in allowed:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if regex.search(line) and not line.lstrip().startswith("#"):
                found.append(f"{rel}:{number}: {line.strip()}")
    return found


RULES = {
    "libc is loaded once: import `libc` (and `check`) from nodeagent.libc": (
        r"CDLL\(\s*(None|[\"']libc)",
        {"nodeagent/libc.py": "the one handle"},
    ),
    "a file is replaced through nodeagent.atomicfile.write_atomic (temporary, exact mode, fsync, "
    "rename, temporary removed on failure)": (
        r"\bos\.(replace|rename)\(|\.replace\(\s*(path|self\.path|target)\b",
        {
            "nodeagent/atomicfile.py": "the one atomic write",
            "runtime/logs.py": "rotation renames existing log files; nothing is written",
            "runtime/workers.py": "keeps a released slot's existing log directory",
            "runtime/keeper.py": "moves an existing file beside the worker's record",
        },
    ),
    "systemctl runs through nodeagent.cgroups.systemd.run_systemctl": (
        r"[\[(]\s*[\"']systemctl[\"']",
        {"cgroups/systemd.py": "the one runner"},
    ),
    "/proc and /sys are read through nodeagent.kernelfs (Procfs, Sysfs: the root is a setting)": (
        r"(?<![\w.])open\(\s*f?[\"']/(proc|sys)/|Path\(\s*[\"']/(proc|sys)/[^\"']*[\"']\s*\)\.read_",
        {
            "runtime/sandbox/__init__.py": "the forked child: a failure must stay its step's OSError",
            "runtime/sandbox/mounts.py": "the forked child: a failure must stay its step's OSError",
        },
    ),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_one_owner(rule: str) -> None:
    pattern, allowed = RULES[rule]
    hits = _hits(pattern, allowed)
    assert not hits, f"{rule}; found elsewhere:\n" + "\n".join(hits)


#: Module names two folders may share, with why (none today: name each module for what it holds).
SHARED_NAMES: dict[str, str] = {}


def test_no_two_modules_share_a_name() -> None:
    by_name = collections.defaultdict(list)
    for path in _sources():
        if path.name != "__init__.py":
            by_name[path.name].append(path.relative_to(ROOT).as_posix())
    clashes = {name: paths for name, paths in by_name.items() if len(paths) > 1 and name not in SHARED_NAMES}
    assert not clashes, (
        f"modules of one name in two folders: {clashes}; name each for what it holds "
        "(agent/qos_loop.py beside isolation/qos.py)"
    )
    stale = sorted(name for name in SHARED_NAMES if len(by_name.get(name, [])) < 2)
    assert not stale, f"{stale} no longer shared: take them off SHARED_NAMES"


#: Class names two modules may share: none (isolation's record of a host port a slot may reach is
#: AllowedHostPort, beside the request's published HostPort model).
SHARED_CLASSES: set[str] = set()


def test_no_two_classes_share_a_name() -> None:
    by_name = collections.defaultdict(list)
    for path in _sources():
        for match in re.finditer(r"^class (\w+)", path.read_text(), re.M):
            by_name[match.group(1)].append(path.relative_to(ROOT).as_posix())
    clashes = {n: paths for n, paths in by_name.items() if len(paths) > 1 and n not in SHARED_CLASSES}
    assert not clashes, f"classes of one name in two modules: {clashes}; name each for what it is"
    stale = sorted(name for name in SHARED_CLASSES if len(by_name.get(name, [])) < 2)
    assert not stale, f"{stale} no longer shared: take them off SHARED_CLASSES"
