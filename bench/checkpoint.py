"""Scale from zero with CRIU (issue 25 item 5): a ready model server checkpointed to disk, then
restored into a new cgroup, against its cold start, side by side in one run.

Run as root with a CRIU that passes ``criu check`` on this kernel:
``python bench/checkpoint.py --criu PATH [--servers oip,mlserver,kserve] [--rounds 3]``.

Per server and round: **cold** = the server started by hand until its first inference is answered
(polled every 5 ms); **dump** = ``criu dump`` of that ready server (which ends it), its time and
image size; **restore** = ``criu restore`` run from a fresh cgroup under the bench's cgroup parent
(so the restored tree lands there, as it would in a new slot's), until the first inference is
answered again. The restored processes are checked to be in that cgroup, then killed with it.

What a server needs to be checkpointable, found on kernel 6.18 with CRIU 4.1.1 (docs/pools.md):

- its own pid namespace, with the server its init and session leader (``unshare --pid --fork
  setsid``): restored pids are the dumped ones, and in the host's namespace they are taken by then;
- libuv without io_uring (``UV_USE_IO_URING=0``: CRIU cannot dump an io_uring; uvloop's libuv
  uses one since 1.45);
- ``--link-remap`` for multiprocessing's unlinked POSIX semaphores, ``--tcp-established``;
- no regular file open for writing that changes after the dump (standard output to /dev/null).

Objects: cgroups under "natest<pid>k.slice", images in a tmp directory; all removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from nodeagent.cgroups import detect, open_manager
from nodeagent.cgroups.factory import remove_subtree

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `tests` is a package of the repo
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/model_servers.py, a script beside

from elasticity import BODIES
from model_servers import MODEL, Server, installed, servers

PARENT = f"natest{os.getpid()}k.slice"
KINDS = ("oip", "mlserver", "kserve")
STARTUP = 120.0
POLLER = httpx.Client(timeout=2.0, limits=httpx.Limits(max_keepalive_connections=0))
DUMP_OPTIONS = ("--tcp-established", "--link-remap", "--file-locks")


@dataclass
class Round:
    cold: float
    dump: float
    image_mb: float
    restore: float


def first_answer(url: str, body: dict[str, Any], began: float) -> float:
    while True:
        try:
            if POLLER.post(url, json=body).status_code == 200:
                return time.perf_counter() - began
        except httpx.HTTPError:
            pass
        if time.perf_counter() - began > STARTUP:
            raise RuntimeError(f"no inference answered at {url} within {STARTUP:g}s")
        time.sleep(0.005)


def one_round(criu: str, server: Server, work: Path, n: int) -> Round:
    ports = {name: 39400 + 10 * n + i for i, name in enumerate(server.ports)}
    workdir = work / f"{server.name}-{n}"
    workdir.mkdir()
    argv, env = server.by_hand(ports, workdir)
    body = BODIES["oip" if server.name == "oip" else "doubler"]
    url = f"http://127.0.0.1:{ports['http']}/v2/models/{MODEL}/infer"
    host = detect()
    cold_path, relpath = f"{PARENT}/cold-{server.name}-{n}", f"{PARENT}/restored-{server.name}-{n}"
    started = open_manager(host, cold_path)
    started.create()  # the server's whole tree, whatever becomes of unshare: removed with it
    began = time.perf_counter()
    starter = subprocess.Popen(
        ["unshare", "--pid", "--fork", "setsid", *argv],
        env={**os.environ, **env, "UV_USE_IO_URING": "0"},
        cwd=workdir,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=lambda: started.add_pid(os.getpid()),  # noqa: PLW1509 - the bench starts no threads
    )
    restored = open_manager(host, relpath)
    try:
        cold = first_answer(url, body, began)
        # The pid namespace's init: unshare's one child.
        children = Path(f"/proc/{starter.pid}/task/{starter.pid}/children").read_text().split()
        root = int(children[0])
        images = workdir / "images"
        images.mkdir()
        began = time.perf_counter()
        subprocess.run(
            [
                criu,
                "dump",
                "--tree",
                str(root),
                "--images-dir",
                str(images),
                "--log-file",
                "dump.log",
                *DUMP_OPTIONS,
            ],
            check=True,
            capture_output=True,
        )
        dump = time.perf_counter() - began
        starter.wait(timeout=10)
        image_mb = sum(f.stat().st_size for f in images.iterdir()) / 1e6
        restored.create()
        began = time.perf_counter()
        subprocess.run(
            [
                criu,
                "restore",
                "--images-dir",
                str(images),
                "--log-file",
                "restore.log",
                "--restore-detached",
                "--manage-cgroups=ignore",
                *DUMP_OPTIONS[:1],
                "--file-locks",
            ],
            check=True,
            capture_output=True,
            # criu forks the restored tree from itself: started in the new cgroup, it lands there.
            preexec_fn=lambda: restored.add_pid(os.getpid()),
        )
        restore = first_answer(url, body, began)
        if not restored.procs():  # (its host pid is another: only the namespace's pids are kept)
            raise RuntimeError(f"the restored server answers, but not from {relpath}")
        return Round(cold, dump, image_mb, restore)
    except subprocess.CalledProcessError as err:
        log = next(iter(sorted(workdir.glob("images/*.log"))), None)
        tail = "" if log is None else log.read_text()[-1200:]
        raise RuntimeError(f"{err.cmd[1]} failed ({err.returncode}):\n{tail}") from None
    finally:
        if starter.poll() is None:
            starter.kill()  # our own child, by pid; its namespace's processes die with their init
            starter.wait()
        for path in (cold_path, relpath):
            remove_subtree(host, path)  # and every process left in it


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.0f} [{min(values) * 1000:.0f}-{max(values) * 1000:.0f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--criu", default=shutil.which("criu"), help="the criu binary (4.x for kernels >= 6.x)"
    )
    parser.add_argument("--servers", default="oip,mlserver", help=f"comma-separated: {', '.join(KINDS)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--keep-venvs", type=Path, default=None, help="the installs in (and kept in) DIR/<server>"
    )
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: CRIU and the bench's cgroups need it")
    if not args.criu:
        raise SystemExit("no criu found; pass --criu PATH (docs/pools.md says how one was built)")
    check = subprocess.run([args.criu, "check"], check=False, capture_output=True, text=True)
    if check.returncode != 0:
        raise SystemExit(f"{args.criu} check failed on this kernel:\n{check.stdout}{check.stderr}")
    version = subprocess.run(
        [args.criu, "--version"], check=False, capture_output=True, text=True
    ).stdout.split()
    kinds = [k for k in args.servers.split(",") if k]
    host = detect()
    parent = open_manager(host, PARENT)
    parent.create()
    work = Path(tempfile.mkdtemp(prefix=f"natest{os.getpid()}-criu-"))
    rows: dict[str, list[Round]] = {}
    problems: dict[str, str] = {}
    try:
        keep = args.keep_venvs.resolve() if args.keep_venvs else None
        with installed(sorted(set(kinds), key=KINDS.index), keep) as (installs, workers):
            found = servers(installs, workers, 1.0)
            for n in range(args.rounds):
                for kind in kinds:
                    if kind in problems:
                        continue
                    try:
                        result = one_round(args.criu, found[kind], work, n * len(KINDS) + KINDS.index(kind))
                    except RuntimeError as err:
                        problems[kind] = str(err)
                        print(f"{kind}: {err}", flush=True)
                        continue
                    rows.setdefault(kind, []).append(result)
                    print(
                        f"{kind} {n + 1}/{args.rounds}: cold {result.cold * 1000:.0f} ms, dump "
                        f"{result.dump * 1000:.0f} ms ({result.image_mb:.1f} MB), restore -> first inference "
                        f"{result.restore * 1000:.0f} ms",
                        flush=True,
                    )
    finally:
        remove_subtree(host, PARENT)
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nCRIU {' '.join(version[1:2])}, kernel {os.uname().release}; ms, median [min-max] over rounds")
    heads = ("cold: first inference", "dump", "image MB", "restore: first inference")
    print(f"{'server':10} " + " ".join(f"{h:>26}" for h in heads) + f" {'cold/restore':>13}")
    for kind, results in rows.items():
        cold, restore = [r.cold for r in results], [r.restore for r in results]
        print(
            f"{kind:10} {ms(cold):>26} {ms([r.dump for r in results]):>26} "
            f"{statistics.median(r.image_mb for r in results):>26.1f} {ms(restore):>26} "
            f"{statistics.median(cold) / statistics.median(restore):>12.1f}x"
        )
    for kind, problem in problems.items():
        print(f"{kind}: not checkpointable here: {problem.splitlines()[0]}")


if __name__ == "__main__":
    main()
