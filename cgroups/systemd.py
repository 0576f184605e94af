"""Finding the cgroup systemd delegates to the agent.

systemd documents how a program tells that systemd is the service manager (``sd_booted(3)``: the
directory ``/run/systemd/system`` exists) and that a unit's cgroup is its ``ControlGroup`` property,
not a path to be derived from its name (systemd's CGROUP_DELEGATION notes). The agent asks
``systemctl show`` for the units it cares about, once, at start-up, and decides with
:func:`resolve`, a pure function of what it read:

1. **Its own unit**, when systemd put the agent *below* that unit's cgroup (``DelegateSubgroup=``,
   systemd 254 and later) or the unit is a delegated scope (``systemd-run --scope -p Delegate=yes``):
   that cgroup is the agent's, the agent lives in a leaf of it and the slots go beside it. A service
   that starts the agent *in* its own cgroup does not qualify: systemd starts the next process of the
   unit in that very cgroup, which the kernel refuses once it enables controllers for children, so
   that service could never restart while a slot exists (status 219/CGROUP).
2. **The slots unit** (``nodeagent-slots.service`` unless configured otherwise): a delegated service
   that holds slots, their workers and the keeper, and is never restarted with the agent; used only
   by the unit that is ``PartOf=`` it (nodeagent.service), so that an agent started some other way
   (from a shell, with another state directory) never takes slots that belong to the service.

Anything else is refused with what was found and what to do. Reading the units costs one ``systemctl``
call (about 10 ms, more under emulation).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from nodeagent.cgroups.delegation import AGENT, Delegation
from nodeagent.errors import CgroupError, DiscoveryError
from nodeagent.kernelfs import Procfs
from nodeagent.procfmt import parse_proc_cgroup

#: What sd_booted(3) checks.
BOOTED_MARK = Path("run/systemd/system")
DEFAULT_SLOTS_UNIT = "nodeagent-slots.service"
_PROPERTIES = ("Id", "LoadState", "ActiveState", "ControlGroup", "Delegate", "PartOf")
_UNIT_SUFFIXES = (".service", ".scope")


class NoDelegation(CgroupError):
    """systemd manages the cgroups here, but no cgroup is delegated to the agent."""

    code = "no_delegation"


class DelegationLost(NoDelegation):
    """The slots unit is active but systemd removed its cgroup (every process in it ended)."""

    code = "delegation_lost"


def booted(fs_root: Path = Path("/")) -> bool:
    """Whether systemd is the service manager of this host (sd_booted(3))."""
    return (fs_root / BOOTED_MARK).is_dir()


def own_cgroup(text: str) -> str | None:
    """This process's cgroup as systemd tracks it, from /proc/self/cgroup: the unified ``0::`` line,
    else the ``name=systemd`` line of a cgroup v1 host; without the leading slash ("" for the root)."""
    named = None
    for number, controllers, path in parse_proc_cgroup(text):
        if number == "0" and controllers == "":
            return path.strip().strip("/")
        if "name=systemd" in controllers.split(","):
            named = path.strip().strip("/")
    return named


def unit_of(cgroup: str) -> str | None:
    """The system unit whose cgroup holds ``cgroup``: the first component that is not a slice, when it
    is a service or a scope (what sd_pid_get_unit(3) answers); None in a slice or the root."""
    for part in cgroup.strip("/").split("/"):
        if part.endswith(".slice"):
            continue
        return part if part.endswith(_UNIT_SUFFIXES) else None
    return None


@dataclass(frozen=True)
class UnitState:
    """What ``systemctl show`` says of a unit. ``control_group`` has no leading slash ("" for none)."""

    name: str
    load_state: str
    active_state: str
    control_group: str
    delegate: bool
    part_of: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        return self.name.rpartition(".")[2]

    def describe(self) -> str:
        cgroup = f"cgroup /{self.control_group}" if self.control_group else "no cgroup"
        delegate = "Delegate=yes" if self.delegate else "no Delegate="
        return f"{self.name} ({self.load_state}, {self.active_state}, {cgroup}, {delegate})"


def parse_show(text: str) -> list[UnitState]:
    """``systemctl show -p Id,LoadState,ActiveState,ControlGroup,Delegate,PartOf UNIT...``: one block of
    KEY=VALUE lines per unit, blocks separated by an empty line."""
    units: list[UnitState] = []
    for block in text.strip().split("\n\n"):
        values = dict(line.partition("=")[::2] for line in block.splitlines() if "=" in line)
        if not values.get("Id"):
            continue
        units.append(
            UnitState(
                name=values["Id"],
                load_state=values.get("LoadState", ""),
                active_state=values.get("ActiveState", ""),
                control_group=values.get("ControlGroup", "").strip("/"),
                delegate=values.get("Delegate", "no") == "yes",
                part_of=tuple(values.get("PartOf", "").split()),
            )
        )
    return units


Runner = Callable[[Sequence[str]], str]


def run_systemctl(argv: Sequence[str], timeout: float = 30.0) -> str:
    """Run ``systemctl ARGV...`` and return its output; CgroupError naming the command otherwise."""
    command = ["systemctl", *argv]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise CgroupError(f"cannot run {' '.join(command)}: {err}") from err
    if proc.returncode != 0:
        said = proc.stderr.strip() or proc.stdout.strip()
        raise CgroupError(f"{' '.join(command)} exited with status {proc.returncode}: {said}")
    return proc.stdout


def show_units(names: Iterable[str], run: Runner = run_systemctl) -> dict[str, UnitState]:
    """The state of each unit in ``names`` (a unit systemd does not know reads as LoadState=not-found)."""
    wanted = list(dict.fromkeys(names))
    if not wanted:
        return {}
    text = run(["show", f"--property={','.join(_PROPERTIES)}", "--", *wanted])
    return {unit.name: unit for unit in parse_show(text)}


def resolve(own: str, own_unit: UnitState | None, slots_unit: UnitState | None) -> Delegation:
    """Which delegated cgroup the agent uses, from its own cgroup ``own`` and the two units' states.

    Raises :class:`NoDelegation` (or :class:`DelegationLost`) saying what was found and what to do.
    """
    found: list[str] = []
    if own_unit is not None:
        found.append(own_unit.describe())
        root = own_unit.control_group
        inside = bool(root) and (own == root or own.startswith(root + "/"))
        if own_unit.delegate and inside and own != root:
            # systemd started us in a subgroup (DelegateSubgroup=): it will do so on every start.
            return Delegation(root=root, unit=own_unit.name, agent_leaf=own[len(root) + 1 :].split("/", 1)[0])
        if own_unit.delegate and inside and own_unit.kind == "scope":
            # A scope never has a process started in it by systemd: the agent may leave its root.
            return Delegation(root=root, unit=own_unit.name, agent_leaf=AGENT)
    if slots_unit is not None:
        found.append(slots_unit.describe())
        ours = own_unit is not None and slots_unit.name in own_unit.part_of
        if not ours and slots_unit.load_state == "loaded":
            runs_in = own_unit.name if own_unit else "no unit"
            raise NoDelegation(
                f"the agent runs in /{own} ({runs_in}), which is not PartOf= "
                f"{slots_unit.name}: that unit's cgroup belongs to the agent of nodeagent.service, and two "
                "agents must never share it. Run the agent with systemctl start nodeagent, or in a "
                "delegated scope (systemd-run --scope -p Delegate=yes ...), or set [systemd] delegation = "
                '"off" to create cgroups under [isolation] cgroup_parent behind systemd\'s back'
            )
        if slots_unit.load_state == "loaded" and slots_unit.active_state == "active" and slots_unit.delegate:
            if not slots_unit.control_group:
                raise DelegationLost(
                    f"{slots_unit.name} is active but has no cgroup: every process in it ended, so systemd "
                    f"removed it. Restart it (systemctl restart {slots_unit.name}; this restarts the agent "
                    "too): slots are rebuilt from the agent's state"
                )
            return Delegation(root=slots_unit.control_group, unit=slots_unit.name, pinned=True)
    slots_name = slots_unit.name if slots_unit is not None else DEFAULT_SLOTS_UNIT
    raise NoDelegation(
        f"systemd manages this host's cgroups and delegates none to the agent (in cgroup /{own}; found: "
        f"{'; '.join(found) or 'no unit'}). Start the agent with systemctl start nodeagent (its unit pulls "
        f"in {slots_name}, the delegated cgroup of the slots; docs/systemd.md), or run it in a delegated "
        'scope (systemd-run --scope -p Delegate=yes ...), or set [systemd] delegation = "off" to create '
        "cgroups under [isolation] cgroup_parent behind systemd's back, which systemd may undo"
    )


def discover(
    proc_root: Path = Path("/proc"), slots_unit: str = DEFAULT_SLOTS_UNIT, run: Runner = run_systemctl
) -> tuple[Delegation, str | None]:
    """The delegation for this process, and the name of its own unit (None outside any unit)."""
    try:
        text = Procfs(proc_root).read_text("self/cgroup")
    except DiscoveryError as err:
        raise CgroupError(f"cannot find the agent's unit: {err}", errno_=err.errno) from err
    if text is None:
        raise CgroupError(f"cannot read {proc_root}/self/cgroup to find the agent's unit: no such file")
    own = own_cgroup(text)
    if own is None:
        raise NoDelegation(
            f"{proc_root}/self/cgroup names no systemd cgroup; is systemd the service manager?"
        )
    own_name = unit_of(own)
    units = show_units([n for n in (own_name, slots_unit) if n], run)
    return resolve(own, units.get(own_name) if own_name else None, units.get(slots_unit)), own_name


def pending_job(unit: str, run: Runner = run_systemctl) -> str | None:
    """The type of the job systemd runs on ``unit`` now ("stop", "restart", ...), None when there is none.

    A SIGTERM from ``systemctl stop`` comes with a stop job, one from ``systemctl restart`` with a
    restart job, one from ``systemctl kill`` or ``kill`` with none: the only way to tell them apart.
    """
    text = run(["list-jobs", "--no-legend", "--no-pager", "--", unit])
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[1] == unit:
            return fields[2]
    return None


__all__ = [
    "DEFAULT_SLOTS_UNIT",
    "DelegationLost",
    "NoDelegation",
    "UnitState",
    "booted",
    "discover",
    "own_cgroup",
    "parse_show",
    "pending_job",
    "resolve",
    "run_systemctl",
    "show_units",
    "unit_of",
]
