"""The escape suite: the tests in ``v2vm/`` run only inside a pure cgroup v2 VM (collected when
NODEAGENT_IN_CGROUP2_VM=1, set inside the VM that runs them)."""

from __future__ import annotations

import os

collect_ignore = [] if os.environ.get("NODEAGENT_IN_CGROUP2_VM") == "1" else ["v2vm"]
