"""Placement stays pure and low in the layering: what its modules may import, and how big they may grow.

Placement is called from the daemon, the CLI's ``plan`` and the benchmarks alike; importing the
daemon (or anything that touches the kernel) from here would make every one of them pay for it and
would let I/O creep into decisions that must be reproducible from a topology file.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PLACEMENT = Path(__file__).resolve().parents[2] / "placement"
MODULES = sorted(PLACEMENT.glob("*.py"))

# Standard-library modules without I/O that the decisions are built from.
PURE_STDLIB = {
    "__future__",
    "bisect",
    "collections",
    "collections.abc",
    "dataclasses",
    "functools",
    "itertools",
    "math",
    "operator",
    "typing",
    "weakref",
}
# The project modules placement may read: the error hierarchy, cpulists, topology data types, requests.
PROJECT_ALLOWED = ("nodeagent.errors", "nodeagent.cpulist", "nodeagent.devices.topology", "nodeagent.schema")
MAX_LINES = 800


def imported_modules(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: relative import; name the module in full"
            found.add(node.module or "")
    return found


def test_the_package_has_its_modules() -> None:
    # Guards the tests below against passing on an empty glob.
    assert {p.stem for p in MODULES} >= {"__init__", "options", "assignment", "ledger", "index", "planner"}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_imports_only_pure_modules(path: Path) -> None:
    for module in sorted(imported_modules(path)):
        project_ok = module.startswith("nodeagent.placement") or any(
            module == allowed or module.startswith(allowed + ".") for allowed in PROJECT_ALLOWED
        )
        assert project_ok or module in PURE_STDLIB, f"{path.name} imports {module}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_module_grows_past_the_limit(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.name} has {lines} lines; split it by concept"


def test_importing_placement_loads_no_daemon_or_kernel_code() -> None:
    code = (
        "import sys, nodeagent.placement\n"
        "print('\\n'.join(m for m in sys.modules if m.startswith('nodeagent.')))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert "nodeagent.placement.planner" in loaded
    layers_above = ("nodeagent.agent", "nodeagent.isolation", "nodeagent.runtime", "nodeagent.cgroups")
    assert [m for m in loaded if m.startswith(layers_above)] == []
