"""Escape attempts, run as a worker: one JSON verdict per attempt on stdout, then "READY".

Stdlib only (it runs under any Python the worker's uid can execute). The targets come as one JSON
argument, so the same script serves a sandboxed slot on cgroup v1, one on pure v2, and the control
run outside every slot (where each attempt must succeed, against targets the test owns):

    {"cgroup_procs": [paths], "cpus": [all CPUs], "allowed_cpus": [the slot's], "device": path,
     "mknod_dir": dir, "mount_dir": dir, "token": path, "state_dir": dir, "agent_pid": int,
     "other_pid": int, "connect": [[address, port], ...], "forks": int, "litter": name}

A verdict is {"attempt": name, "escaped": bool, "detail": text}. After the verdicts it leaves
litter in /tmp and /dev/shm and a detached grandchild ({"attempt": "outlive", "pid", "start_time"})
whose survival the test checks after it SIGKILLs this process; then it prints READY and waits.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import socket
import stat
import sys
import time
from collections.abc import Callable

libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS = 0x00020000
MS_REC, MS_PRIVATE = 16384, 1 << 18
PTRACE_SEIZE = 0x4206


def say(body: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(body) + "\n")
    sys.stdout.flush()


def verdict(name: str, escaped: bool, detail: str) -> None:
    say({"attempt": name, "escaped": escaped, "detail": detail})


def why(err: BaseException) -> str:
    if isinstance(err, OSError) and err.errno:
        return f"{errno.errorcode.get(err.errno, err.errno)} {err.strerror}"
    return repr(err)


def in_child(action: Callable[[], tuple[bool, str]]) -> tuple[bool, str]:
    """Run ``action`` in a forked child (attempts that change the process for good) and return
    what it found."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            try:
                result = action()
            except BaseException as err:  # noqa: BLE001 - reported as the attempt's failure
                result = (False, why(err))
            os.write(write_end, json.dumps(result).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        body = reader.read()
    os.waitpid(pid, 0)
    if not body:
        return False, "the child died before it answered"
    escaped, detail = json.loads(body)
    return bool(escaped), str(detail)


def cgroup_writes(targets: list[str]) -> tuple[bool, str]:
    done, refused = [], []
    for path in targets:
        try:
            with open(path, "w") as handle:
                handle.write(str(os.getpid()))
            done.append(path)
        except OSError as err:
            refused.append(f"{path}: {why(err)}")
    return bool(done), f"joined {done}" if done else "; ".join(refused)


def affinity(spec: dict[str, object]) -> tuple[bool, str]:
    cgroup_writes(list(spec["cgroup_procs"]))  # type: ignore[arg-type]  # first out of the cpuset, if it can
    try:
        os.sched_setaffinity(0, set(spec["cpus"]))  # type: ignore[arg-type]
    except OSError as err:
        return False, f"sched_setaffinity: {why(err)}"
    got = os.sched_getaffinity(0)
    beyond = sorted(got - set(spec["allowed_cpus"]))  # type: ignore[arg-type]
    return bool(beyond), f"runs on {sorted(got)}" + (f", beyond the slot's: {beyond}" if beyond else "")


def open_device(path: str) -> tuple[bool, str]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as err:
        return False, why(err)
    os.close(fd)
    return True, f"opened {path}"


def make_node(directory: str) -> tuple[bool, str]:
    path = os.path.join(directory, f"natest-node-{os.getpid()}")
    try:
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 11))
    except OSError as err:
        return False, f"mknod: {why(err)}"
    os.unlink(path)
    return True, f"made {path} (c 1:11)"


def mount_tmpfs(directory: str) -> tuple[bool, str]:
    # A namespace of its own first where it can, so a control that succeeds changes nothing outside.
    unshared = libc.unshare(CLONE_NEWNS) == 0
    if unshared:
        libc.mount(None, b"/", None, ctypes.c_ulong(MS_REC | MS_PRIVATE), None)
    if libc.mount(b"tmpfs", directory.encode(), b"tmpfs", ctypes.c_ulong(0), None) != 0:
        err = ctypes.get_errno()
        return False, f"mount: {errno.errorcode.get(err, err)} (unshare {'ok' if unshared else 'refused'})"
    return True, f"mounted a tmpfs on {directory}"


def read_file(path: str) -> tuple[bool, str]:
    try:
        with open(path, "rb") as handle:
            data = handle.read(64)
    except OSError as err:
        return False, why(err)
    return bool(data), f"read {len(data)} bytes" if data else "empty"


def list_state(directory: str) -> tuple[bool, str]:
    try:
        names = sorted(os.listdir(directory))
    except OSError as err:
        return False, why(err)
    # What the sandbox shows of the state directory: the way to the slot's own files, nothing else.
    others = [n for n in names if n != "workers"]
    return bool(others), f"lists {names}"


def agent_memory(pid: int) -> tuple[bool, str]:
    try:
        with open(f"/proc/{pid}/maps") as maps:
            start = int(maps.readline().split("-")[0], 16)
        with open(f"/proc/{pid}/mem", "rb") as mem:
            mem.seek(start)
            data = mem.read(16)
    except OSError as err:
        return False, why(err)
    return bool(data), f"read {len(data)} bytes of pid {pid}'s memory"


def signal_zero(pid: int) -> tuple[bool, str]:
    try:
        os.kill(pid, 0)
    except OSError as err:
        return False, why(err)
    return True, f"may signal pid {pid}"


def ptrace_seize(pid: int) -> tuple[bool, str]:
    # PTRACE_SEIZE does not stop the target; the tracer's exit (this child's) detaches it.
    if libc.ptrace(ctypes.c_long(PTRACE_SEIZE), ctypes.c_long(pid), None, None) != 0:
        err = ctypes.get_errno()
        return False, f"ptrace: {errno.errorcode.get(err, err)}"
    return True, f"traces pid {pid}"


def connect(address: str, port: int) -> tuple[bool, str]:
    try:
        with socket.create_connection((address, port), timeout=1.5):
            return True, f"connected to {address}:{port}"
    except OSError as err:
        return False, f"{address}:{port}: {why(err) if not isinstance(err, TimeoutError) else 'timed out'}"


def fork_many(count: int) -> tuple[bool, str]:
    read_end, write_end = os.pipe()
    children, failure = [], ""
    for _ in range(count):
        try:
            pid = os.fork()
        except OSError as err:
            failure = why(err)
            break
        if pid == 0:
            os.close(write_end)
            os.read(read_end, 1)  # until the parent closes its end
            os._exit(0)
        children.append(pid)
    os.close(write_end)
    os.close(read_end)
    for pid in children:
        os.waitpid(pid, 0)
    return len(children) >= count, f"forked {len(children)} of {count}" + (f" ({failure})" if failure else "")


#: Shared writable places of the host: a slot's litter in them must stay in its own mounts.
LITTER_PLACES = ("/tmp", "/dev/shm", "/var/tmp", "/run/lock")


def litter(name: str) -> None:
    written = []
    for where in (p for p in LITTER_PLACES if os.path.isdir(p)):
        try:
            with open(f"{where}/{name}", "w") as handle:
                handle.write("litter")
            written.append(where)
        except OSError as err:
            written.append(f"{where}: {why(err)}")
    say({"attempt": "litter", "written": written})


def outlive() -> None:
    """A grandchild in a session of its own, reparented away from us, sleeping."""
    read_end, write_end = os.pipe()
    if os.fork() == 0:
        os.setsid()
        pid = os.fork()
        if pid:
            os.write(write_end, str(pid).encode())
            os._exit(0)
        os.close(read_end)
        os.close(write_end)
        time.sleep(600)
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as reader:
        pid = int(reader.read())
    os.wait()
    with open(f"/proc/{pid}/stat") as handle:
        start_time = int(handle.read().rpartition(")")[2].split()[19])
    say({"attempt": "outlive", "pid": pid, "start_time": start_time})


def main() -> None:
    spec = json.loads(sys.argv[1])
    # Where this process may run as it starts (its slot's CPUs), unless the test says.
    spec["allowed_cpus"] = spec.get("allowed_cpus") or sorted(os.sched_getaffinity(0))
    targets = list(spec["cgroup_procs"])
    attempts: list[tuple[str, Callable[[], tuple[bool, str]]]] = [
        ("cgroup escape", lambda: in_child(lambda: cgroup_writes(targets))),
        ("affinity beyond the slot's CPUs", lambda: in_child(lambda: affinity(spec))),
        ("open a device not allowed", lambda: open_device(spec["device"])),
        ("mknod", lambda: make_node(spec["mknod_dir"])),
        ("mount", lambda: in_child(lambda: mount_tmpfs(spec["mount_dir"]))),
        ("read the agent's token", lambda: read_file(spec["token"])),
        ("list the agent's state", lambda: list_state(spec["state_dir"])),
        ("read the agent's memory", lambda: agent_memory(spec["agent_pid"])),
        ("signal the agent", lambda: signal_zero(spec["agent_pid"])),
        ("ptrace the agent", lambda: in_child(lambda: ptrace_seize(spec["agent_pid"]))),
        ("signal another slot's worker", lambda: signal_zero(spec["other_pid"])),
        ("ptrace another slot's worker", lambda: in_child(lambda: ptrace_seize(spec["other_pid"]))),
        ("fork past pids.max", lambda: fork_many(int(spec["forks"]))),
    ]
    for address, port in spec.get("connect", []):
        attempts.append((f"connect to {address}:{port}", lambda a=address, p=port: connect(a, p)))
    for name, attempt in attempts:
        try:
            escaped, detail = attempt()
        except Exception as err:  # noqa: BLE001 - an attempt that crashes did not escape
            escaped, detail = False, f"crashed: {why(err)}"
        verdict(name, escaped, detail)
    litter(spec["litter"])
    outlive()
    say({"attempt": "done"})
    print("READY", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
