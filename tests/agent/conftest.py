"""Agent tests. Those in ``v2vm/`` need a pure cgroup v2 kernel; they are collected only when
NODEAGENT_IN_CGROUP2_VM=1 (set inside the VM that runs them), so ordinary runs never see them."""

from __future__ import annotations

import os

collect_ignore = [] if os.environ.get("NODEAGENT_IN_CGROUP2_VM") == "1" else ["v2vm"]
