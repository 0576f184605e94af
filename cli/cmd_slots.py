"""``nodeagent slots ...``: list, show, allocate, resize and release slots, and start and stop their
workers, through the agent's API.

Tables for people, ``--json`` for scripts. The group's ``--api`` / ``--token-file`` (or
NODEAGENT_API / NODEAGENT_TOKEN_FILE) say where the agent is; see ``cli.client``.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import click

from nodeagent.bytesize import format_quantity
from nodeagent.cli.client import API_ENV, TOKEN_FILE_ENV, AgentClient
from nodeagent.errors import InvalidRequest, NotFound, WorkerError

F = TypeVar("F", bound=Callable[..., Any])


def api_options(func: F) -> F:
    """``--api`` and ``--token-file``, shared by every command that talks to the agent."""
    func = click.option(
        "--token-file",
        type=click.Path(path_type=Path, dir_okay=False),
        envvar=TOKEN_FILE_ENV,
        help="The agent's API token file [default: <state dir>/token].",
    )(func)
    return click.option(
        "--api",
        envvar=API_ENV,
        metavar="URL",
        help="The agent's API [default: http://127.0.0.1:7070].",
    )(func)


def _override(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    if value is not None:
        meta = ctx.find_root().meta
        api, token_file = meta.get("nodeagent.api") or (None, None)
        meta["nodeagent.api"] = (value, token_file) if param.name == "api" else (api, value)
    return value


def subcommand_api_options(func: F) -> F:
    """The same two options after the subcommand too (``nodeagent slots list --api URL``), which is
    where people type them; a value given there wins over the group's."""
    func = click.option(
        "--token-file",
        type=click.Path(path_type=Path, dir_okay=False),
        expose_value=False,
        callback=_override,
        help="The agent's API token file (as for `nodeagent slots`).",
    )(func)
    return click.option(
        "--api", metavar="URL", expose_value=False, callback=_override, help="The agent's API URL."
    )(func)


def client_from(ctx: click.Context) -> AgentClient:
    """The client for this invocation, built on first use and closed when the command ends."""
    options = ctx.find_root().meta.get("nodeagent.api") or (None, None)
    return ctx.with_resource(AgentClient.from_options(*options))


@click.group("slots")
@api_options
@click.pass_context
def command(ctx: click.Context, api: str | None, token_file: Path | None) -> None:
    """Slots on this host: isolated CPUs, memory and devices with an optional worker."""
    ctx.find_root().meta["nodeagent.api"] = (api, token_file)


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


@command.command("list")
@subcommand_api_options
@json_option
@click.pass_context
def list_command(ctx: click.Context, as_json: bool) -> None:
    """One line per slot."""
    slots = client_from(ctx).list_slots()
    click.echo(_dumps(slots) if as_json else format_slot_table(slots))


@command.command("show")
@subcommand_api_options
@click.argument("slot_id", metavar="ID")
@json_option
@click.pass_context
def show_command(ctx: click.Context, slot_id: str, as_json: bool) -> None:
    """Everything about one slot (by id or name)."""
    slot = client_from(ctx).get_slot(slot_id)
    click.echo(_dumps(slot) if as_json else format_slot(slot))


@command.command("allocate")
@subcommand_api_options
@click.option(
    "--request",
    "request_text",
    metavar="JSON|@FILE|-",
    help="The SlotRequest as JSON, @FILE to read it from a file, or - for stdin.",
)
@click.option("--name", help="Slot name (when not using --request).")
@click.option("--qos", type=click.Choice(["guaranteed", "burstable", "best-effort"]), default=None)
@click.option("--cpus", help="Whole CPUs (guaranteed) or a quota such as 0.5 or 500m.")
@click.option("--memory", help="Bytes or a quantity such as 4Gi.")
@click.option("--gpus", type=int)
@click.option("--numa", type=click.Choice(["single", "prefer", "none"]))
@click.option("--worker-cmd", metavar="COMMAND", help="The worker's command line (split like a shell).")
@click.option(
    "--pool", help="Take the slot from this warm pool (its shape and worker; see `nodeagent pools`)."
)
@click.option(
    "--fallback",
    type=click.Choice(["none", "cold"]),
    help="With --pool: cold starts the pool's worker in a new slot when no standby is ready.",
)
@click.option(
    "--wait",
    is_flag=True,
    help="With a worker: wait until it is running (ready); exit 1 if it fails or times out.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(0, 3600),
    default=60.0,
    show_default=True,
    help="Seconds --wait waits before giving up.",
)
@json_option
@click.pass_context
def allocate_command(
    ctx: click.Context, /, request_text: str | None, as_json: bool, wait: bool, timeout: float, **flags: Any
) -> None:
    """Allocate a slot from --request, or from --name/--qos/--cpus/... flags.

    Idempotent by name: the same request again shows the existing slot.
    """
    request = _request_from(request_text, flags)
    client = client_from(ctx)
    slot, created = client.allocate(request)
    if wait and slot.get("worker") is not None:
        slot = _wait_for_start(client, slot, timeout)
    if as_json:
        click.echo(_dumps(slot))
        return
    verb = "allocated" if created else "already allocated with this request:"
    click.echo(f"{verb} slot {slot['id']} ({slot['name']})")
    click.echo(format_slot(slot))


@command.command("resize")
@subcommand_api_options
@click.argument("slot_id", metavar="ID")
@click.option("--resources", "resources_text", metavar="JSON", help="A partial resources object.")
@click.option("--cpus", help="New CPU count or quota.")
@click.option("--memory", help="New memory limit.")
@json_option
@click.pass_context
def resize_command(
    ctx: click.Context,
    /,
    slot_id: str,
    *,
    resources_text: str | None,
    cpus: str | None,
    memory: str | None,
    as_json: bool,
) -> None:
    """Change a slot's resources in place."""
    resources = json_object(resources_text, "--resources") if resources_text else {}
    resources.update(_resource_flags(cpus=cpus, memory=memory))
    if not resources:
        raise InvalidRequest("resize: nothing to change; give --cpus, --memory or --resources JSON")
    slot = client_from(ctx).resize(slot_id, resources)
    click.echo(_dumps(slot) if as_json else format_slot(slot))


@command.command("release")
@subcommand_api_options
@click.argument("slot_id", metavar="ID")
@click.pass_context
def release_command(ctx: click.Context, slot_id: str) -> None:
    """Stop a slot's worker, remove its kernel objects and free its resources."""
    client_from(ctx).release(slot_id)
    click.echo(f"released {slot_id}")


#: Worker phases (runtime.supervisor.Phase) in which a process runs, and those a start ends in.
_ALIVE_PHASES = frozenset({"starting", "running", "unready", "stopping"})
_START_FAILED_PHASES = frozenset({"failed", "exited", "crashloop", "stopped"})
_POLL_SECONDS = 0.2

_wait_options = (
    click.option("--wait", is_flag=True, help="Wait until the worker got there (see --timeout)."),
    click.option(
        "--timeout",
        type=click.FloatRange(0, 3600),
        default=60.0,
        show_default=True,
        help="Seconds --wait waits before giving up.",
    ),
)


def wait_options(func: F) -> F:
    for option in reversed(_wait_options):
        func = option(func)
    return func


@command.command("start")
@subcommand_api_options
@click.argument("slot_id", metavar="ID")
@click.option(
    "--spec",
    "spec_text",
    metavar="JSON|@FILE|-",
    help="The WorkerSpec as JSON, @FILE or - for stdin [default: the worker in the slot's request].",
)
@wait_options
@json_option
@click.pass_context
def start_command(
    ctx: click.Context, /, slot_id: str, *, spec_text: str | None, wait: bool, timeout: float, as_json: bool
) -> None:
    """Start the slot's worker; with --wait, until it is running (ready)."""
    spec = None if spec_text is None else json_object(read_argument(spec_text, "spec"), "--spec")
    client = client_from(ctx)
    slot = client.start_worker(slot_id, spec)
    if wait:
        slot = _wait_for_start(client, slot, timeout)
    _print_worker_change(slot, as_json)


@command.command("stop")
@subcommand_api_options
@click.argument("slot_id", metavar="ID")
@wait_options
@json_option
@click.pass_context
def stop_command(ctx: click.Context, /, slot_id: str, *, wait: bool, timeout: float, as_json: bool) -> None:
    """Stop the slot's worker gracefully (the slot stays); with --wait, until it has ended."""
    client = client_from(ctx)
    slot = client.stop_worker(slot_id)
    if wait:
        slot = _poll(client, slot, timeout, lambda phase: phase not in _ALIVE_PHASES, "end")
    _print_worker_change(slot, as_json)


#: A worker without a readiness probe is "running" once its process runs; --wait holds on this
#: long more, so a worker that exits at once (a bad argument, a missing file) fails the wait.
_UNPROBED_HOLD_SECONDS = 1.0


def _wait_for_start(client: AgentClient, slot: dict[str, Any], timeout: float) -> dict[str, Any]:
    slot = _poll(
        client, slot, timeout, lambda phase: phase == "running" or phase in _START_FAILED_PHASES, "run"
    )
    worker = slot.get("worker") or {}
    if worker.get("phase") == "running" and worker.get("ready_when") == "started":
        slot = _hold(client, slot)
        worker = slot.get("worker") or {}
    if worker.get("phase") != "running":
        why = f": {worker['message']}" if worker.get("message") else ""
        raise WorkerError(
            f"the worker of slot {slot['id']} did not start: {_worker_summary(worker)}{why}"
            f"{_probe_advice(worker)}; `nodeagent slots logs {slot['id']}` shows its output"
        )
    return slot


def _hold(client: AgentClient, slot: dict[str, Any]) -> dict[str, Any]:
    """The slot once its probe-less worker ran for :data:`_UNPROBED_HOLD_SECONDS` (the same
    process), or as soon as it stopped running; a restart meanwhile is a failed start."""
    pid = (slot.get("worker") or {}).get("pid")
    until = time.monotonic() + _UNPROBED_HOLD_SECONDS
    while time.monotonic() < until:
        time.sleep(_POLL_SECONDS)
        slot = client.get_slot(str(slot["id"]))
        worker = slot.get("worker") or {}
        if worker.get("phase") != "running":
            return slot
        if worker.get("pid") != pid:
            raise WorkerError(
                f"the worker of slot {slot['id']} did not start: pid {pid} ended within its first "
                f"{_UNPROBED_HOLD_SECONDS:g}s and was restarted as pid {worker.get('pid')}; "
                f"`nodeagent slots logs {slot['id']}` shows its output"
            )
    return slot


def _probe_advice(worker: Mapping[str, Any]) -> str:
    """``; last probe: GET /ready: HTTP 404 (2s ago); likely: ...`` for a worker whose readiness
    probe has said something, else empty."""
    probe = worker.get("last_probe")
    if not probe or probe.get("passed"):
        return ""
    text = f"; last readiness probe: {probe.get('detail', '?')}"
    if probe.get("cause"):
        text += f"; likely: {probe['cause']}"
    return text


def _poll(
    client: AgentClient,
    slot: dict[str, Any],
    timeout: float,
    arrived: Callable[[str], bool],
    goal: str,
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while not arrived(str((slot.get("worker") or {}).get("phase"))):
        if time.monotonic() >= deadline:
            worker = slot.get("worker") or {}
            probe = worker.get("last_probe") or {}
            # Waiting longer helps a server still loading, not one whose answer is a definite no.
            longer = "" if probe.get("definite") else "; wait longer with --timeout"
            raise WorkerError(
                f"the worker of slot {slot['id']} did not {goal} within {timeout:g}s; it is "
                f"{_worker_summary(worker)}{_probe_advice(worker)}{longer}"
            )
        time.sleep(_POLL_SECONDS)
        slot = client.get_slot(str(slot["id"]))
    return slot


def _print_worker_change(slot: Mapping[str, Any], as_json: bool) -> None:
    if as_json:
        click.echo(_dumps(slot))
        return
    click.echo(f"worker of slot {slot['id']} ({slot['name']}): {_worker_summary(slot.get('worker') or {})}")


@command.command("logs")
@subcommand_api_options
@click.argument("slot_id", metavar="ID")
@click.option("--lines", "-n", type=click.IntRange(1, 10_000), default=100, show_default=True)
@click.option(
    "--follow", "-f", is_flag=True, help="Then print new lines as they come, until Ctrl-C or release."
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line: time, stream, text.")
@click.pass_context
def logs_command(ctx: click.Context, slot_id: str, lines: int, follow: bool, as_json: bool) -> None:
    """The last lines of the slot's worker output (also of a slot released not long ago)."""
    client = client_from(ctx)
    entries = client.log_entries(slot_id, lines)
    last = _print_entries(entries, as_json, "")
    if not follow:
        return
    try:
        released = False
        while not released:
            time.sleep(FOLLOW_POLL_SECONDS)
            # Asked before the lines: whatever the worker wrote before its release is read after.
            released = not _slot_exists(client, slot_id)
            try:
                entries = client.log_entries(slot_id, MAX_FOLLOW_LINES, since=last or EPOCH)
            except NotFound:
                return  # released (and its logs not kept): nothing more will come
            last = _print_entries(entries, as_json, last)
    except KeyboardInterrupt:
        return


def _slot_exists(client: AgentClient, slot_id: str) -> bool:
    try:
        client.get_slot(slot_id)
    except NotFound:
        return False
    return True


#: How often --follow asks for new lines: output shows within this long of being written.
FOLLOW_POLL_SECONDS = 0.5
MAX_FOLLOW_LINES = 10_000
EPOCH = "1970-01-01T00:00:00.000000000Z"


def _print_entries(entries: Sequence[Mapping[str, str]], as_json: bool, last: str) -> str:
    """Print the entries; the newest time among them (or ``last``)."""
    for entry in entries:
        if as_json:
            click.echo(json.dumps(dict(entry), ensure_ascii=False))
        else:
            stream, text = entry["stream"], entry["text"]
            click.echo(text if stream == "stdout" else f"[{stream}] {text}")
        last = max(last, entry.get("time") or "")
    return last


@command.command("cdi")
@subcommand_api_options
@click.argument("slot_id", metavar="ID")
@click.pass_context
def cdi_command(ctx: click.Context, slot_id: str) -> None:
    """The slot's CDI spec (JSON): what `podman run --device nodeagent.io/slot=NAME` gives a container."""
    click.echo(_dumps(client_from(ctx).cdi_spec(slot_id)))


# --------------------------------------------------------------------------- requests from options


def _request_from(request_text: str | None, flags: Mapping[str, Any]) -> dict[str, Any]:
    given = {k: v for k, v in flags.items() if v is not None}
    if request_text is not None:
        if given:
            raise InvalidRequest(
                f"allocate: --request and --{next(iter(given)).replace('_', '-')} both given; use one way"
            )
        return json_object(read_argument(request_text, "request"), "--request")
    if "pool" in given:
        if "name" not in given:
            raise InvalidRequest("allocate: --pool needs --name (the slot's name)")
        claim: dict[str, Any] = {"name": given["name"], "pool": given["pool"]}
        if "fallback" in given:
            claim["fallback"] = given["fallback"]
        if "qos" in given:
            claim["qos"] = given["qos"]
        return claim
    if "fallback" in given:
        raise InvalidRequest("allocate: --fallback goes with --pool")
    if "name" not in given or "qos" not in given:
        raise InvalidRequest(
            "allocate: give --request JSON, or at least --name and --qos (or --name and --pool)"
        )
    request: dict[str, Any] = {"name": given["name"], "qos": given["qos"]}
    resources = _resource_flags(cpus=given.get("cpus"), memory=given.get("memory"))
    if "gpus" in given:
        resources["gpus"] = given["gpus"]
    if "numa" in given:
        resources["numa"] = given["numa"]
    request["resources"] = resources
    if "worker_cmd" in given:
        request["worker"] = {"command": shlex.split(given["worker_cmd"])}
    return request


def _resource_flags(*, cpus: str | None, memory: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if cpus is not None:
        out["cpus"] = _number_or_text(cpus)
    if memory is not None:
        out["memory"] = int(memory) if memory.isdigit() else memory
    return out


def _number_or_text(text: str) -> int | float | str:
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            continue
    return text  # e.g. "500m": the agent parses it


def read_argument(text: str, what: str) -> str:
    if text == "-":
        return sys.stdin.read()
    if text.startswith("@"):
        path = Path(text[1:])
        try:
            return path.read_text(encoding="utf-8")
        except OSError as err:
            raise InvalidRequest(f"cannot read the {what} file {path}: {err.strerror or err}") from err
    return text


def json_object(text: str, option: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as err:
        raise InvalidRequest(f"{option} is not valid JSON: {err}") from err
    if not isinstance(value, dict):
        raise InvalidRequest(f"{option} must be a JSON object, got {type(value).__name__}")
    return value


# --------------------------------------------------------------------------- output


def _dumps(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True)


_COLUMNS = ("ID", "NAME", "QOS", "STATE", "CPUS", "MEMORY", "NUMA", "DEVICES", "WORKER", "AGE")


def format_slot_table(slots: Sequence[Mapping[str, Any]], now: float | None = None) -> str:
    if not slots:
        return "no slots"
    at = time.time() if now is None else now
    rows = [_COLUMNS, *(_row(s, at) for s in slots)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def _row(slot: Mapping[str, Any], now: float) -> tuple[str, ...]:
    assignment = slot.get("assignment") or {}
    return (
        str(slot["id"]),
        str(slot["name"]),
        str(slot["qos"]),
        str(slot["state"]),
        _cpus(assignment),
        _memory(assignment),
        ",".join(map(str, assignment.get("numa_nodes", []))) or "-",
        _devices(assignment),
        _worker(slot.get("worker")),
        _age(now - float(slot.get("created_at", now))),
    )


def _cpus(assignment: Mapping[str, Any]) -> str:
    if not assignment:
        return "-"
    if assignment.get("exclusive"):
        return str(assignment.get("cpuset") or "-")
    return f"{assignment.get('cpu_quota', 0):g} of pool"


def _memory(assignment: Mapping[str, Any]) -> str:
    nbytes = assignment.get("memory_bytes")
    return format_quantity(int(nbytes)) if nbytes else "-"


def _devices(assignment: Mapping[str, Any]) -> str:
    names = [f"gpu{g}" for g in assignment.get("gpus", [])]
    names += [f"mig:{m.get('profile')}" for m in assignment.get("mig", [])]
    names += [f"gpu{s.get('gpu_index')}:{s.get('share')}" for s in assignment.get("gpu_shares", [])]
    names += [str(f) for f in assignment.get("fpgas", [])]
    names += [str(d.get("path")) for d in assignment.get("devices", [])]
    return ",".join(names) or "-"


def _worker(worker: Mapping[str, Any] | None) -> str:
    if not worker:
        return "-"
    phase = str(worker.get("phase", "?"))
    restarts = worker.get("restarts")
    return f"{phase} ({restarts} restarts)" if restarts else phase


def _age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def format_slot(slot: Mapping[str, Any], now: float | None = None) -> str:
    assignment = slot.get("assignment") or {}
    lines = [
        f"slot {slot['id']} ({slot['name']}): {slot['qos']}, {slot['state']}",
        f"  cpus      {_cpus(assignment)}",
        f"  memory    {_memory(assignment)}",
        f"  numa      {','.join(map(str, assignment.get('numa_nodes', []))) or '-'}",
        f"  devices   {_devices(assignment)}",
        f"  cgroup    {slot.get('cgroup') or '-'}",
    ]
    lines += _worker_lines(slot.get("worker"), time.time() if now is None else now)
    lines.extend(f"  endpoint  {_endpoint(e)}" for e in slot.get("endpoints") or [])
    if slot.get("reason"):
        lines.append(f"  reason    {slot['reason']}")
    foreign = slot.get("foreign_cpu")
    if foreign:
        lines.append(f"  foreign   {_foreign(foreign)}")
    lines.extend(f"  why       {r}" for r in assignment.get("reasons", []))
    return "\n".join(lines)


def _endpoint(endpoint: Mapping[str, Any]) -> str:
    """``http  127.0.0.1:20000 (http)``: a named port and where it is reached."""
    where = f"{endpoint.get('address')}:{endpoint.get('port')}"
    return f"{endpoint.get('name')}  {where} ({endpoint.get('protocol')})"


def _foreign(foreign: Mapping[str, Any]) -> str:
    """CPU time others spent on a guaranteed slot's CPUs: ``0.42 s, 0.80 % of its CPUs since 10:02:11``."""
    seconds, fraction = float(foreign.get("seconds") or 0), float(foreign.get("fraction") or 0)
    text = f"{seconds:.2f} s, {100 * fraction:.2f} % of its CPUs"
    since = foreign.get("since")
    if since is not None:
        text += " since " + time.strftime("%H:%M:%S", time.localtime(float(since)))
    irq = foreign.get("irq_seconds")
    if irq:
        text += f" (interrupts {float(irq):.2f} s)"
    return text


def _worker_lines(worker: Mapping[str, Any] | None, now: float) -> list[str]:
    """The worker's status for people: phase, pid and restarts; its last exit; the supervisor's message."""
    if not worker:
        return ["  worker    -"]
    lines = [f"  worker    {_worker_summary(worker)}"]
    last_exit = worker.get("last_exit")
    if last_exit:
        lines.append(f"  last exit {_describe_exit(last_exit, now)}")
    if worker.get("message"):
        lines.append(f"  message   {worker['message']}")
    probe = worker.get("last_probe")
    if probe:
        verdict = "passed" if probe.get("passed") else "failed"
        lines.append(
            f"  probe     {verdict}: {probe.get('detail', '?')}, {_age(now - float(probe['at']))} ago"
        )
        if probe.get("cause") and not probe.get("passed"):
            lines.append(f"  likely    {probe['cause']}")
    return lines


def _worker_summary(worker: Mapping[str, Any]) -> str:
    """``running (pid 4242, 2 restarts)``; ``backoff (3 restarts, next in 4s)``."""
    details = []
    if worker.get("pid"):
        details.append(f"pid {worker['pid']}")
    restarts = int(worker.get("restarts") or 0)
    details.append("1 restart" if restarts == 1 else f"{restarts} restarts")
    if worker.get("next_restart_in") is not None:
        details.append(f"next in {float(worker['next_restart_in']):.0f}s")
    return f"{worker.get('phase', '?')} ({', '.join(details)})"


def _describe_exit(last_exit: Mapping[str, Any], now: float) -> str:
    text = str(last_exit.get("description") or _exit_fallback(last_exit))
    finished = last_exit.get("finished_at")
    if finished is not None:
        text += f", {_age(now - float(finished))} ago"
    return text


def _exit_fallback(last_exit: Mapping[str, Any]) -> str:
    if last_exit.get("signal") is not None:
        return f"killed by signal {last_exit['signal']}"
    return f"exited with status {last_exit.get('code')}"
