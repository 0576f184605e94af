"""The host keeper's protocol: JSON messages over a unix SOCK_SEQPACKET socket, descriptors by SCM_RIGHTS.

Why hand-written: the keeper must stay small (stdlib only: no grpc, protobuf or pydantic in its
memory), and the protocol's point is handing over file descriptors (a worker child's pipes, pidfds,
notice pipes), which SCM_RIGHTS carries and no RPC library among our dependencies does.
SOCK_SEQPACKET keeps message boundaries and delivers a message's descriptors with it, so framing is
the kernel's; JSON keeps the messages readable in a debugger or strace. The protocol is strictly
request/reply and in order: the keeper answers each request, in the order received, and never
speaks first (exits and keeper deaths reach the agent through descriptors, not messages).

Requests (agent -> keeper) and replies (``fds`` travel with the reply)::

    {"op": "hello", "protocol": 2}        -> {"op": "welcome", "protocol": 2, "pid", "start_time"}
                                             | {"op": "error", "request": "hello", "message"}
    {"op": "arm"[, "pid_namespace": true]} -> {"op": "armed", "pid", "start_time", "pid_namespace"}
        [, "prepare_sandbox": true]          fds: request (w), status (r), done (w), notice (r), pidfd

``prepare_sandbox`` (no protocol change: a keeper that predates it ignores it and arms a plain
child, which serves the same requests) asks for a child that builds the default sandbox's
request-independent part while it waits (sandbox.Prepared); it serves only a request whose spec
fits it.
    {"op": "watch", "run_dir", "launch_id"} -> {"op": "watching", "pid", "start_time"}  fds: notice (r)
                                             | {"op": "final"}   (no live custody: read worker.json)
    {"op": "status", "offset": 0}         -> {"op": "status", "pid", "start_time", "total",
                                              "workers": [up to 100 from offset], "idle_children"}
    anything else                         -> {"op": "error", "request": <op>, "message"}

``hello`` must come first on a connection; a protocol number other than the keeper's is refused
with an error that says what to do. An ``armed`` child waits for its request on the request pipe;
EOF on its status pipe means it exec'd (or ``step\\0errno\\0message`` says why not); closing the
done pipe tells the keeper the agent is finished with that launch (or dropped the child unused).
A notice pipe turns readable (EOF) once the worker's exit record is final, or the keeper is gone.
"""

from __future__ import annotations

import array
import json
import os
import socket
from collections.abc import Sequence
from typing import Any

#: 2: launch requests carry the worker's sandbox; ``arm`` may ask for a pid namespace.
#: 3: launch requests carry the slot's OOM score adjustment.
#: 4: launch requests carry the log's reserve (``log_reserve_bytes``) and the sandbox's private
#:    places (``home_bytes``, ``private_dirs``, ``tmp_views``, ``private_views``).
PROTOCOL = 4
SOCKET_NAME = "keeper.sock"
LOCK_NAME = "keeper.lock"
LOG_NAME = "keeper.log"
#: Exit status of ``python -m nodeagent.runtime.keeper`` when another keeper holds the lock.
EXIT_ALREADY_RUNNING = 3
MAX_MESSAGE = 1 << 16
MAX_FDS = 8
_FD_SIZE = array.array("i").itemsize


class ProtocolError(Exception):
    """A message that is not a JSON object with an "op", or too many descriptors."""


def send(sock: socket.socket, body: dict[str, Any], fds: Sequence[int] = (), flags: int = 0) -> None:
    data = json.dumps(body).encode()
    if len(data) > MAX_MESSAGE:
        raise ProtocolError(f"a {body.get('op')!r} message of {len(data)} bytes is over {MAX_MESSAGE}")
    if fds:
        socket.send_fds(sock, [data], list(fds), flags)
    else:
        sock.send(data, flags)


def receive(sock: socket.socket, flags: int = 0) -> tuple[dict[str, Any] | None, list[int]]:
    """One message and its descriptors (close-on-exec); (None, []) at EOF."""
    # recvmsg, not socket.recv_fds: before Python 3.12 recv_fds ignores its flags, and descriptors
    # must arrive close-on-exec (the agent runs probes as subprocesses).
    data, ancillary, _, _ = sock.recvmsg(
        MAX_MESSAGE, socket.CMSG_SPACE(MAX_FDS * _FD_SIZE), flags | socket.MSG_CMSG_CLOEXEC
    )
    fds: list[int] = []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(payload) - len(payload) % _FD_SIZE
            fds.extend(array.array("i", payload[:usable]))
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    try:
        body = json.loads(data)
    except ValueError as err:
        for fd in fds:
            os.close(fd)
        raise ProtocolError(f"not JSON: {data[:80]!r}") from err
    if not isinstance(body, dict) or not isinstance(body.get("op"), str):
        for fd in fds:
            os.close(fd)
        raise ProtocolError(f"not a message with an 'op': {data[:80]!r}")
    return body, fds
