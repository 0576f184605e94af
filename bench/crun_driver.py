"""``crun run``, timed from a helper process in a private mount namespace (bench/launch.py and
bench/sandbox.py compare the agent's launch with it).

The helper runs ``unshare -m``: there /sys/fs/cgroup/unified is unmounted, because crun refuses a
hybrid host whose cgroup2 mount has no controllers, and the host's mounts are left alone. It reads
one line per run ("<container name> <seconds to wait first>"), runs ``crun run`` of the bundle the
calling bench builds, and answers with the milliseconds until crun returned (the run and the
teardown) as one JSON line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

#: Builds an OCI bundle in the given directory and returns the bundle's path.
BundleBuilder = Callable[[Path], Path]


def serve(build_bundle: BundleBuilder) -> None:
    """The helper's side (call it from the bench's ``--crun-server`` mode, inside ``unshare -m``)."""
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
    if os.path.ismount("/sys/fs/cgroup/unified"):
        subprocess.run(["umount", "/sys/fs/cgroup/unified"], check=True)
    bundle = build_bundle(Path(tempfile.mkdtemp(prefix="natest-crun-")))
    state = bundle / "state"
    try:
        for line in sys.stdin:
            name, _, gap = line.strip().partition(" ")
            time.sleep(float(gap or 0))
            command = ["crun", "--root", str(state), "run", "--bundle", str(bundle), name]
            started = time.perf_counter()
            done = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, check=False)
            elapsed = (time.perf_counter() - started) * 1000
            reply = {"ms": elapsed} if done.returncode == 0 else {"error": done.stderr.decode()[-400:]}
            print(json.dumps(reply), flush=True)
    finally:
        shutil.rmtree(bundle, ignore_errors=True)


class Crun:
    """The bench's side: starts ``unshare -m python <script> --crun-server`` and asks it for runs."""

    def __init__(self, script: str) -> None:
        self.process = subprocess.Popen(
            ["unshare", "-m", sys.executable, script, "--crun-server"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.count = 0

    def run(self, name: str | None = None, gap: float = 0.0) -> float:
        """Milliseconds of one ``crun run`` (``name``: the container's, else a fresh one), after
        the helper waited ``gap`` seconds."""
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        self.count += 1
        self.process.stdin.write(f"{name or f'natest{os.getpid()}-{self.count}'} {gap}\n")
        self.process.stdin.flush()
        reply = json.loads(self.process.stdout.readline() or '{"error": "the crun helper died"}')
        if "error" in reply:
            raise RuntimeError(f"crun run failed: {reply['error']}")
        return float(reply["ms"])

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=30)
