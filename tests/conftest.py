"""Test-suite policy.

Tests that need root or a kernel feature carry ``@pytest.mark.root`` or ``@pytest.mark.kernel``.
Outside CI such a test skips when its need is not met; when the environment variable ``CI`` is set,
the same skip is turned into a failure, so a green CI run proves these tests really ran.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest
from hypothesis import settings

from tests.workerpy import worker_python

__all__ = ["worker_python"]  # a fixture for every test directory

IN_CI = bool(os.environ.get("CI"))

# In CI, property tests draw the same examples every run, so a landing is never decided by luck;
# locally they explore new random examples each time.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None, print_blob=True)
settings.load_profile("ci" if IN_CI else "dev")
_MUST_RUN_MARKERS = ("root", "kernel", "cgroup2vm", "systemdvm")


#: marker -> the environment variable set inside the VM its tests need (run-tests starts it)
_VM_MARKERS = {"cgroup2vm": "NODEAGENT_IN_CGROUP2_VM", "systemdvm": "NODEAGENT_IN_SYSTEMD_VM"}


def pytest_runtest_setup(item: pytest.Item) -> None:
    # A VM suite's file named on the command line is collected on this host too (collect_ignore
    # keeps it out of directory runs only); run here, its fixtures take this host's /sys/fs/cgroup
    # for the VM's (one read "0" from a plain file and killed the whole run).
    for marker, variable in _VM_MARKERS.items():
        if item.get_closest_marker(marker) and os.environ.get(variable) != "1":
            pytest.skip(f"runs only inside its VM ({variable}=1): ./run-tests -k EXPR takes it there")
    if item.get_closest_marker("root") and os.geteuid() != 0:
        pytest.skip("needs root")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped and any(item.get_closest_marker(m) for m in _MUST_RUN_MARKERS):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"CI is set, so this root/kernel test must run, but it skipped: {reason}"


@pytest.fixture(scope="session", autouse=True)
def _host_left_as_found() -> Generator[None, None, None]:
    """The machine the tests run on is also a developer's and CI's: a test that confines the host
    (host partitioning) must put it back. PID 1's affinity narrowed by the end of the session means
    one did not; it is put back to what it was at the start, and the session fails."""
    before = os.sched_getaffinity(1)
    yield
    after = os.sched_getaffinity(1)
    if after < before:
        os.sched_setaffinity(1, before)
        pytest.fail(
            f"PID 1's CPU affinity went from {sorted(before)} to {sorted(after)} during the tests and was "
            "put back: a host-partitioning test did not restore the host"
        )
