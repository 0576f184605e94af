"""A network namespace per slot: a routed veth pair to the host, egress shaping, default-deny.

Design (why it looks like this):

- **Routed, no bridge.** Each slot gets one point-to-point subnet (a /30 by default, or a /31)
  carved out of a configurable pool (``10.231.0.0/16``: 16384 slots). The host-side veth holds
  the first usable address, the slot side (``eth0`` inside the netns) the second, and the slot's
  default route points at the host side. The connected route on the host-side veth is the host's
  route back. Without a bridge there is no shared L2 segment, so slots can only talk to each
  other if the host forwards between them.
- **Default deny by netfilter.** A slot reaches only what its request allows
  (:class:`SlotAccess`): by default nothing but replies to connections the host opened into it
  (the agent's probes). The rules live in one nftables table of the agent's own
  (:mod:`nodeagent.isolation.firewall`): its chains drop whatever enters the host from an
  interface with the veth prefix (to any host address, in ``input``; to another slot or
  anywhere else, in ``forward``), and two sets hold the per-slot opt-ins (host ports; egress
  through NAT). Matching the prefix rather than a list of slots makes the deny hold for a veth the
  agent has not registered yet, or forgot in a crash. The backends take the firewall as a
  collaborator (:class:`SlotFirewall`); without one a slot's network is *unfiltered*, which the
  isolator allows only when configured to.
- **Slot-to-slot drop by policy routing, too.** Every slot also gets a policy rule
  ``iif <host veth> to <pool> prohibit`` ahead of the main table. It is the only slot-to-slot
  barrier of an unfiltered slot, answers a filtered slot's attempt at once (ICMP prohibited,
  instead of a silent drop and a connect timeout), and disappears with the slot.
- **Shaping.** Egress (traffic leaving the slot) is a tbf qdisc on the slot-side veth, a real
  shaper that TCP adapts to. Optional ingress (traffic into the slot) is a tbf on the host-side
  veth, out of the slot's reach. The kernel here lacks the police and gact actions, so policing
  is not an option anyway.
- **No forks.** Creating a netns the pyroute2 way forks a helper, and forks are slow here. A
  throwaway thread instead unshares its own network namespace (unshare(CLONE_NEWNET) changes only
  the calling thread), bind-mounts it under /run/netns like ``ip netns add`` does, configures the
  inside over a netlink socket it opens there, and ends; nothing has to switch back.
  :class:`IpBatchBackend` does the same with two ``ip -batch`` runs; on the machines measured it
  is the faster of the two (see :func:`default_backend`). Removal and listing are netlink calls
  in the host netns for both.

Order of a setup: the firewall's elements first (keyed by interface name, so they can precede the
interface), then netns, veth, addresses, routes, the policy rule and shaping; any failure removes
all of it again. Teardown goes the other way round: opt-ins are revoked before the veth goes.

Names: the netns is ``<netns_prefix><slot id>`` (a file under /run/netns, so slot ids are
validated), the host-side veth ``<veth_prefix><hash of slot id>`` (at most 15 characters). Both
prefixes are the ownership mark that :meth:`NetworkBackend.list_owned` uses to find orphans; the
firewall's elements are found by the veth names they carry.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import ipaddress
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

from nodeagent.errors import ConfigError, Conflict, InvalidRequest, NetworkError, os_error_message
from nodeagent.kernelfs import Sysfs
from nodeagent.libc import libc

#: Network interfaces in sysfs: a name there is a link in this (the host's) network namespace.
NET_CLASS = "class/net"
NETNS_RUN_DIR = Path("/run/netns")
IFNAMSIZ = 15  # usable characters of a Linux interface name
_MIN_HASH_CHARS = 4
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_MAX_SLOT_ID = 64
_TABLE_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")

_CLONE_NEWNET = 0x40000000
_MS_BIND = 4096
_MS_REC = 16384
_MS_SHARED = 1 << 20
_MNT_DETACH = 2

_T = TypeVar("_T")


# --------------------------------------------------------------------------- configuration & data


@dataclass(frozen=True)
class SlotNetworkConfig:
    """Where slot addresses come from and how slot objects are named."""

    cidr: str = "10.231.0.0/16"
    subnet_prefixlen: int = 30
    netns_prefix: str = "na-"
    veth_prefix: str = "nah"
    slot_ifname: str = "eth0"
    rule_priority: int = 3231
    shaping_latency_ms: int = 50
    netns_dir: Path = NETNS_RUN_DIR
    #: The agent's own nftables table (family inet) holding every slot's firewall rules.
    nft_table: str = "nodeagent"

    def __post_init__(self) -> None:
        pool = self.pool  # validates cidr
        if self.subnet_prefixlen not in (30, 31):
            raise ConfigError(
                f"network subnet_prefixlen is {self.subnet_prefixlen}; use 30 or 31 (point-to-point subnets)"
            )
        if pool.prefixlen > self.subnet_prefixlen:
            raise ConfigError(
                f"network cidr {self.cidr} is smaller than one /{self.subnet_prefixlen} slot subnet"
            )
        for label, prefix in (("netns_prefix", self.netns_prefix), ("veth_prefix", self.veth_prefix)):
            if not prefix or not _NAME_RE.match(prefix):
                raise ConfigError(f"network {label} {prefix!r} must be letters, digits, '_', '.' or '-'")
        if len(self.veth_prefix) > IFNAMSIZ - _MIN_HASH_CHARS:
            raise ConfigError(
                f"network veth_prefix {self.veth_prefix!r} leaves fewer than {_MIN_HASH_CHARS} of the "
                f"{IFNAMSIZ} interface-name characters for the slot hash; shorten it"
            )
        if not 0 < len(self.slot_ifname) <= IFNAMSIZ or "/" in self.slot_ifname:
            raise ConfigError(f"network slot_ifname {self.slot_ifname!r} is not a valid interface name")
        if not 0 < self.rule_priority < 32766:
            raise ConfigError(f"network rule_priority {self.rule_priority} must lie between 1 and 32765")
        if not _TABLE_RE.match(self.nft_table):
            raise ConfigError(
                f"network nft_table {self.nft_table!r} must be 1-64 letters, digits, '_' or '-', "
                "starting with a letter"
            )

    @property
    def pool(self) -> ipaddress.IPv4Network:
        try:
            return ipaddress.IPv4Network(self.cidr)
        except ValueError as err:
            raise ConfigError(
                f"network cidr {self.cidr!r} is not an IPv4 network such as 10.231.0.0/16: {err}"
            ) from None


Egress = Literal["none", "nat"]
EGRESS_MODES: tuple[Egress, ...] = ("none", "nat")
Transport = Literal["tcp", "udp"]
TRANSPORTS: tuple[Transport, ...] = ("tcp", "udp")


@dataclass(frozen=True, order=True)
class AllowedHostPort:
    """A port on the host that a slot may connect to, at any of the host's IPv4 addresses."""

    port: int
    protocol: Transport = "tcp"

    def __post_init__(self) -> None:
        if self.protocol not in TRANSPORTS:
            raise InvalidRequest(
                f"host port protocol {self.protocol!r} is not one of {', '.join(TRANSPORTS)}"
            )
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 < self.port < 65536:
            raise InvalidRequest(f"host port {self.port!r} is not a port number from 1 to 65535")

    def __str__(self) -> str:
        return f"{self.port}/{self.protocol}"


@dataclass(frozen=True)
class SlotAccess:
    """What a slot's network may reach besides replies to connections opened into it.

    Nothing by default. ``egress="nat"``: anywhere beyond the host, masqueraded behind the host's
    address (never another slot, never the host itself, never link-local 169.254.0.0/16).
    ``host_ports``: these TCP/UDP ports on the host itself. Held sorted, so equal access compares
    equal whatever order the request listed the ports in.
    """

    egress: Egress = "none"
    host_ports: tuple[AllowedHostPort, ...] = ()

    def __post_init__(self) -> None:
        if self.egress not in EGRESS_MODES:
            raise InvalidRequest(f"network egress {self.egress!r} is not one of {', '.join(EGRESS_MODES)}")
        ports = tuple(sorted(self.host_ports))
        twice = sorted({str(p) for p in ports if ports.count(p) > 1})
        if twice:
            raise InvalidRequest(f"host_ports lists {', '.join(twice)} more than once; list each port once")
        object.__setattr__(self, "host_ports", ports)

    @property
    def nat(self) -> bool:
        return self.egress == "nat"

    def to_json(self) -> dict[str, Any]:
        return {
            "egress": self.egress,
            "host_ports": [{"port": p.port, "protocol": p.protocol} for p in self.host_ports],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SlotAccess:
        return cls(
            egress=data.get("egress", "none"),
            host_ports=tuple(
                AllowedHostPort(p["port"], p.get("protocol", "tcp")) for p in data.get("host_ports", ())
            ),
        )


# Slotted: one per slot with a network, in its AppliedSlot.
@dataclass(frozen=True, slots=True)
class SlotNetwork:
    """What :meth:`NetworkBackend.setup` built for a slot (stored with the slot's state).

    ``filtered``: the firewall's default-deny applies to the slot (False: set up without a
    firewall, as allowed by configuration, or stored before the firewall existed).
    """

    slot_id: str
    netns: str
    netns_path: Path
    host_ifname: str
    slot_ifname: str
    subnet: ipaddress.IPv4Network
    host_address: ipaddress.IPv4Address
    slot_address: ipaddress.IPv4Address
    egress_mbit: float | None = None
    ingress_mbit: float | None = None
    access: SlotAccess = field(default_factory=SlotAccess)
    filtered: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "slot_id": self.slot_id,
            "netns": self.netns,
            "netns_path": str(self.netns_path),
            "host_ifname": self.host_ifname,
            "slot_ifname": self.slot_ifname,
            "subnet": str(self.subnet),
            "host_address": str(self.host_address),
            "slot_address": str(self.slot_address),
            "egress_mbit": self.egress_mbit,
            "ingress_mbit": self.ingress_mbit,
            "access": self.access.to_json(),
            "filtered": self.filtered,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SlotNetwork:
        return cls(
            slot_id=data["slot_id"],
            netns=data["netns"],
            netns_path=Path(data["netns_path"]),
            host_ifname=data["host_ifname"],
            slot_ifname=data["slot_ifname"],
            subnet=ipaddress.IPv4Network(data["subnet"]),
            host_address=ipaddress.IPv4Address(data["host_address"]),
            slot_address=ipaddress.IPv4Address(data["slot_address"]),
            egress_mbit=data.get("egress_mbit"),
            ingress_mbit=data.get("ingress_mbit"),
            # Records written before the firewall existed have neither: no opt-ins, unfiltered.
            access=SlotAccess.from_json(data.get("access") or {}),
            filtered=bool(data.get("filtered", False)),
        )


@dataclass(frozen=True)
class OwnedNetwork:
    """Kernel objects that carry our prefixes: what a reconcile compares with its slots."""

    netns: tuple[str, ...] = ()
    host_veths: tuple[str, ...] = ()
    rule_ifnames: tuple[str, ...] = ()
    #: host veth names that hold firewall opt-ins (set elements) in the agent's table
    firewall_ifnames: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.netns or self.host_veths or self.rule_ifnames or self.firewall_ifnames)


@dataclass(frozen=True)
class TbfParams:
    rate_bit: int
    burst_bytes: int
    limit_bytes: int


# --------------------------------------------------------------------------- pure helpers


def validate_slot_id(slot_id: str) -> str:
    """Slot ids become file names under /run/netns: no '/', no '..', no surprises."""
    if not (0 < len(slot_id) <= _MAX_SLOT_ID) or not _NAME_RE.match(slot_id) or ".." in slot_id:
        raise InvalidRequest(
            f"slot id {slot_id!r} cannot name a network namespace; use 1-{_MAX_SLOT_ID} letters, digits, "
            "'_', '.' or '-', starting with a letter or digit"
        )
    return slot_id


def netns_name(config: SlotNetworkConfig, slot_id: str) -> str:
    return config.netns_prefix + validate_slot_id(slot_id)


def netns_path(config: SlotNetworkConfig, slot_id: str) -> Path:
    """The file a launcher opens and passes to setns(2) to enter the slot's network namespace."""
    return config.netns_dir / netns_name(config, slot_id)


def host_veth_name(config: SlotNetworkConfig, slot_id: str) -> str:
    digest = hashlib.sha256(validate_slot_id(slot_id).encode()).hexdigest()
    return config.veth_prefix + digest[: IFNAMSIZ - len(config.veth_prefix)]


def subnet_at(config: SlotNetworkConfig, index: int) -> ipaddress.IPv4Network:
    """The ``index``-th point-to-point subnet of the pool."""
    pool = config.pool
    count = subnet_count(config)
    if not 0 <= index < count:
        raise InvalidRequest(f"slot subnet index {index} is outside {pool}, which holds {count} subnets")
    size = 1 << (32 - config.subnet_prefixlen)
    return ipaddress.IPv4Network((int(pool.network_address) + index * size, config.subnet_prefixlen))


def subnet_count(config: SlotNetworkConfig) -> int:
    return 1 << (config.subnet_prefixlen - config.pool.prefixlen)


def allocate_subnet(
    config: SlotNetworkConfig, used: Iterable[ipaddress.IPv4Network]
) -> ipaddress.IPv4Network:
    """The lowest free slot subnet of the pool; ``used`` may hold networks outside the pool."""
    taken = {net for net in used if net.prefixlen == config.subnet_prefixlen}
    for subnet in config.pool.subnets(new_prefix=config.subnet_prefixlen):
        if subnet not in taken:
            return subnet
    raise NetworkError(
        f"no free /{config.subnet_prefixlen} left in the slot network pool {config.cidr} "
        f"({subnet_count(config)} in use); configure a larger cidr"
    )


def point_to_point_addresses(
    subnet: ipaddress.IPv4Network,
) -> tuple[ipaddress.IPv4Address, ipaddress.IPv4Address]:
    """(host side, slot side): .1 and .2 of a /30, both addresses of a /31 (RFC 3021)."""
    if subnet.prefixlen == 31:
        return subnet.network_address, subnet.network_address + 1
    if subnet.prefixlen == 30:
        return subnet.network_address + 1, subnet.network_address + 2
    raise InvalidRequest(f"slot subnet {subnet} is not a /30 or /31 point-to-point subnet")


def tbf_params(mbit: float, latency_ms: int) -> TbfParams:
    """Token bucket for ``mbit``: a 10 ms burst (at least four full frames), a queue of ``latency_ms``."""
    if not mbit > 0:
        raise InvalidRequest(f"bandwidth limit {mbit} Mbit/s must be positive")
    rate_bit = round(mbit * 1_000_000)
    bytes_per_ms = rate_bit / 8 / 1000
    burst = max(round(bytes_per_ms * 10), 4 * 1514)
    limit = max(round(bytes_per_ms * latency_ms), burst)
    return TbfParams(rate_bit=rate_bit, burst_bytes=burst, limit_bytes=limit)


def plan_slot_network(
    config: SlotNetworkConfig,
    slot_id: str,
    subnet: ipaddress.IPv4Network | int,
    egress_mbit: float | None = None,
    ingress_mbit: float | None = None,
    *,
    access: SlotAccess | None = None,
    filtered: bool = False,
) -> SlotNetwork:
    """Everything :meth:`NetworkBackend.setup` will create, decided before touching the kernel."""
    if isinstance(subnet, int):
        subnet = subnet_at(config, subnet)
    if subnet.prefixlen != config.subnet_prefixlen or not subnet.subnet_of(config.pool):
        raise InvalidRequest(
            f"slot subnet {subnet} is not a /{config.subnet_prefixlen} of the pool {config.cidr}; "
            "use allocate_subnet()"
        )
    for mbit in (egress_mbit, ingress_mbit):
        if mbit is not None:
            tbf_params(mbit, config.shaping_latency_ms)
    host, slot = point_to_point_addresses(subnet)
    return SlotNetwork(
        slot_id=slot_id,
        netns=netns_name(config, slot_id),
        netns_path=netns_path(config, slot_id),
        host_ifname=host_veth_name(config, slot_id),
        slot_ifname=config.slot_ifname,
        subnet=subnet,
        host_address=host,
        slot_address=slot,
        egress_mbit=egress_mbit,
        ingress_mbit=ingress_mbit,
        access=access or SlotAccess(),
        filtered=filtered,
    )


# --------------------------------------------------------------------------- the backend interface


class SlotFirewall(Protocol):
    """Default-deny for slot veths, and each slot's opt-ins (:mod:`nodeagent.isolation.firewall`).

    Every method is idempotent and keyed by the host veth's name, so a crash at any point leaves
    nothing that :meth:`list_owned` cannot find.
    """

    def ensure(self) -> None:
        """Make the rules exist and be this version's (at the agent's start)."""
        ...

    def apply(self, plan: SlotNetwork) -> None:
        """Make the rules exist and the slot's opt-ins equal ``plan.access`` (add and remove)."""
        ...

    def remove(self, host_ifname: str) -> None:
        """Revoke the slot's opt-ins; the default-deny stays for the prefix."""
        ...

    def list_owned(self) -> tuple[str, ...]:
        """Host veth names that hold opt-ins."""
        ...

    def remove_owned(self, host_ifnames: Iterable[str]) -> None: ...

    def remove_all(self) -> None:
        """Remove the whole table (uninstall, tests): every slot is unfiltered afterwards."""
        ...


class NetworkBackend(Protocol):
    config: SlotNetworkConfig
    #: None: slots get no firewall (unfiltered); only the isolator decides whether that is allowed.
    firewall: SlotFirewall | None

    def setup(
        self,
        slot_id: str,
        subnet: ipaddress.IPv4Network | int,
        bandwidth_mbit: float | None = None,
        *,
        ingress_mbit: float | None = None,
        access: SlotAccess | None = None,
    ) -> SlotNetwork: ...

    def teardown(self, slot_id: str) -> None: ...

    def list_owned(self) -> OwnedNetwork: ...

    def remove_owned(self, owned: OwnedNetwork) -> None: ...


# --------------------------------------------------------------------------- kernel plumbing


def _libc_call(action: str, name: str, *args: object) -> None:
    if getattr(libc, name)(*args) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), action)


def _ensure_shared_netns_dir(netns_dir: Path) -> None:
    """Make the netns dir a shared mount, as iproute2 does.

    Otherwise a mount namespace created later (by a container runtime, by ``ip netns exec``)
    keeps a private copy of our bind mounts, and that copy pins a removed slot's netns forever.
    """
    netns_dir.mkdir(parents=True, exist_ok=True)
    target = os.fsencode(netns_dir)
    try:
        _libc_call(f"share {netns_dir}", "mount", b"none", target, b"none", _MS_SHARED | _MS_REC, None)
    except OSError as err:
        if err.errno != errno.EINVAL:  # EINVAL: not a mount point yet
            raise
        _libc_call(f"bind {netns_dir}", "mount", target, target, b"none", _MS_BIND | _MS_REC, None)
        _libc_call(f"share {netns_dir}", "mount", b"none", target, b"none", _MS_SHARED | _MS_REC, None)


def _unmount_netns(path: Path) -> None:
    try:
        _libc_call(f"unmount {path}", "umount2", os.fsencode(path), _MNT_DETACH)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOENT):
            raise
    path.unlink(missing_ok=True)


def _in_thread(func: Callable[[], _T]) -> _T:
    """Run ``func`` in a throwaway thread, so namespace switches die with the thread."""
    result: list[_T] = []
    failure: list[BaseException] = []

    def body() -> None:
        try:
            result.append(func())
        except Exception as err:  # noqa: BLE001 - re-raised in the caller's thread
            failure.append(err)

    thread = threading.Thread(target=body, name="nodeagent-netns", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


def _netlink_errno(err: Exception) -> int | None:
    code = getattr(err, "code", None)
    return code if isinstance(code, int) else None


def _network_error(action: str, err: Exception) -> NetworkError:
    code = _netlink_errno(err) if not isinstance(err, OSError) else err.errno
    if code is None:
        return NetworkError(f"{action}: {err}")
    os_err = OSError(code, os.strerror(code))
    return NetworkError(os_error_message(action, os_err), errno_=code)


@contextmanager
def _step(action: str) -> Iterator[None]:
    """Translate whatever a netlink or mount call raises into NetworkError naming the step."""
    try:
        yield
    except (NetworkError, Conflict, InvalidRequest):
        raise
    except Exception as err:
        raise _network_error(action, err) from err


def _ignore_missing(err: Exception) -> bool:
    return _netlink_errno(err) in (errno.ENOENT, errno.ENODEV, errno.ESRCH, errno.EADDRNOTAVAIL)


# --------------------------------------------------------------------------- pyroute2 backend


@dataclass
class Pyroute2Backend:
    """Netlink through pyroute2, from a throwaway thread that unshares its netns (no forks)."""

    config: SlotNetworkConfig = field(default_factory=SlotNetworkConfig)
    firewall: SlotFirewall | None = None
    _dir_ready: bool = field(default=False, init=False, repr=False)

    def setup(
        self,
        slot_id: str,
        subnet: ipaddress.IPv4Network | int,
        bandwidth_mbit: float | None = None,
        *,
        ingress_mbit: float | None = None,
        access: SlotAccess | None = None,
    ) -> SlotNetwork:
        plan = _plan(
            self, slot_id, subnet, egress_mbit=bandwidth_mbit, ingress_mbit=ingress_mbit, access=access
        )
        self._prepare(plan)
        try:
            if self.firewall is not None:
                self.firewall.apply(plan)
            _in_thread(lambda: self._build(plan))
        except BaseException:
            self.teardown(slot_id)
            raise
        return plan

    def teardown(self, slot_id: str) -> None:
        host_ifname = host_veth_name(self.config, slot_id)
        if self.firewall is not None:
            self.firewall.remove(host_ifname)
        self._remove(netns_path(self.config, slot_id), host_ifname)

    def list_owned(self) -> OwnedNetwork:
        prefix = self.config.veth_prefix
        with _step("list network objects"), _netlink() as ipr:
            veths = sorted(
                name for msg in ipr.link("dump") if (name := msg.get("ifname") or "").startswith(prefix)
            )
            rules = sorted(
                {
                    name
                    for msg in ipr.rule("dump")
                    if (name := msg.get("FRA_IIFNAME") or "").startswith(prefix)
                    and msg.get("FRA_PRIORITY") == self.config.rule_priority
                }
            )
        return OwnedNetwork(
            netns=_owned_netns(self.config),
            host_veths=tuple(veths),
            rule_ifnames=tuple(rules),
            firewall_ifnames=_firewall_owned(self.firewall),
        )

    def remove_owned(self, owned: OwnedNetwork) -> None:
        if owned.firewall_ifnames and self.firewall is not None:
            self.firewall.remove_owned(owned.firewall_ifnames)
        if owned.host_veths or owned.rule_ifnames:
            self._remove_links_and_rules(owned)
        for name in owned.netns:
            with _step(f"remove netns {name}"):
                _unmount_netns(self.config.netns_dir / name)

    def _remove_links_and_rules(self, owned: OwnedNetwork) -> None:
        with _netlink() as ipr:
            for name in owned.host_veths:
                _delete_link(ipr, name)
            for name in owned.rule_ifnames:
                _delete_rules(ipr, self.config, name)

    # -- internals

    def _prepare(self, plan: SlotNetwork) -> None:
        if not self._dir_ready:
            with _step(f"prepare {self.config.netns_dir}"):
                _ensure_shared_netns_dir(self.config.netns_dir)
            self._dir_ready = True
        if plan.netns_path.exists():
            raise Conflict(
                f"network namespace {plan.netns} for slot {plan.slot_id} already exists; "
                "tear the slot's network down before setting it up again"
            )
        if Sysfs().exists(f"{NET_CLASS}/{plan.host_ifname}"):
            raise Conflict(
                f"host interface {plan.host_ifname} for slot {plan.slot_id} already exists "
                "(a leftover, or another slot id with the same hash); tear it down first"
            )

    def _build(self, plan: SlotNetwork) -> None:
        with _step("open netlink in the host netns"):
            host_ns = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            with _netlink() as host:
                with _step(f"create netns {plan.netns}"):
                    fd = os.open(plan.netns_path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0)
                    os.close(fd)
                    # Only this thread moves into the new netns; the thread ends afterwards.
                    _libc_call("unshare a netns", "unshare", _CLONE_NEWNET)
                    _libc_call(
                        f"bind {plan.netns_path}",
                        "mount",
                        b"/proc/thread-self/ns/net",
                        os.fsencode(plan.netns_path),
                        b"none",
                        _MS_BIND,
                        None,
                    )
                with _netlink() as inside:
                    self._build_inside(inside, plan, host_ns)
                self._build_host(host, plan)
        finally:
            os.close(host_ns)

    def _build_inside(self, ipr: Any, plan: SlotNetwork, host_ns: int) -> None:
        with _step(f"bring up lo in {plan.netns}"):
            ipr.link("set", index=1, state="up")
        with _step(f"create veth {plan.slot_ifname}/{plan.host_ifname}"):
            ipr.link(
                "add",
                ifname=plan.slot_ifname,
                kind="veth",
                peer={"ifname": plan.host_ifname, "net_ns_fd": host_ns},
            )
            index = ipr.link_lookup(ifname=plan.slot_ifname)[0]
        with _step(f"address {plan.slot_address} on {plan.slot_ifname} in {plan.netns}"):
            ipr.addr("add", index=index, address=str(plan.slot_address), prefixlen=plan.subnet.prefixlen)
            ipr.link("set", index=index, state="up")
        with _step(f"default route via {plan.host_address} in {plan.netns}"):
            ipr.route("add", dst="0.0.0.0/0", gateway=str(plan.host_address))
        if plan.egress_mbit is not None:
            with _step(f"shape egress of {plan.netns} to {plan.egress_mbit} Mbit/s"):
                _add_tbf(ipr, index, tbf_params(plan.egress_mbit, self.config.shaping_latency_ms))

    def _build_host(self, ipr: Any, plan: SlotNetwork) -> None:
        with _step(f"address {plan.host_address} on host veth {plan.host_ifname}"):
            index = ipr.link_lookup(ifname=plan.host_ifname)[0]
            ipr.addr("add", index=index, address=str(plan.host_address), prefixlen=plan.subnet.prefixlen)
            ipr.link("set", index=index, state="up")
        with _step(f"drop traffic from {plan.host_ifname} to other slots in {self.config.cidr}"):
            ipr.rule("add", **_rule_spec(self.config, plan.host_ifname))
        if plan.ingress_mbit is not None:
            with _step(f"shape ingress of {plan.netns} to {plan.ingress_mbit} Mbit/s"):
                _add_tbf(ipr, index, tbf_params(plan.ingress_mbit, self.config.shaping_latency_ms))

    def _remove(self, path: Path, host_ifname: str) -> None:
        # The veth goes first and explicitly: a removed netns is destroyed asynchronously, and
        # its veth would linger for a moment and block a quick re-setup of the same slot.
        with _step(f"open netlink to remove {host_ifname}"), _netlink() as ipr:
            _delete_link(ipr, host_ifname)
            _delete_rules(ipr, self.config, host_ifname)
        with _step(f"remove netns {path}"):
            _unmount_netns(path)


def _plan(
    backend: NetworkBackend,
    slot_id: str,
    subnet: ipaddress.IPv4Network | int,
    *,
    egress_mbit: float | None,
    ingress_mbit: float | None,
    access: SlotAccess | None,
) -> SlotNetwork:
    return plan_slot_network(
        backend.config,
        slot_id,
        subnet,
        egress_mbit,
        ingress_mbit,
        access=access,
        filtered=backend.firewall is not None,
    )


def _firewall_owned(firewall: SlotFirewall | None) -> tuple[str, ...]:
    return () if firewall is None else firewall.list_owned()


def _rule_spec(config: SlotNetworkConfig, host_ifname: str) -> dict[str, Any]:
    pool = config.pool
    return {
        "iifname": host_ifname,
        "dst": str(pool.network_address),
        "dst_len": pool.prefixlen,
        "action": "FR_ACT_PROHIBIT",
        "priority": config.rule_priority,
    }


def _add_tbf(ipr: Any, index: int, params: TbfParams) -> None:
    ipr.tc(
        "add",
        "tbf",
        index=index,
        handle="1:",
        rate=f"{params.rate_bit}bit",
        burst=params.burst_bytes,
        limit=params.limit_bytes,
    )


def _netlink() -> Any:
    """pyroute2's netlink socket, imported on first use: it costs the daemon ~9 MB of memory, and a
    host whose slots have no network never needs it (listing owned objects reads sysfs instead)."""
    from pyroute2 import IPRoute as _IPRoute  # noqa: PLC0415

    return _IPRoute()


def _delete_link(ipr: Any, name: str) -> None:
    with _step(f"delete host veth {name}"):
        try:
            ipr.link("del", ifname=name)
        except Exception as err:
            if not _ignore_missing(err):
                raise


def _delete_rules(ipr: Any, config: SlotNetworkConfig, host_ifname: str) -> None:
    with _step(f"delete the slot-to-slot rule of {host_ifname}"):
        while True:  # a crash between retries could have added it twice
            try:
                ipr.rule("del", **_rule_spec(config, host_ifname))
            except Exception as err:
                if _ignore_missing(err):
                    return
                raise


def _owned_netns(config: SlotNetworkConfig) -> tuple[str, ...]:
    try:
        names = os.listdir(config.netns_dir)
    except FileNotFoundError:
        return ()
    except OSError as err:
        raise _network_error(f"list {config.netns_dir}", err) from err
    return tuple(sorted(n for n in names if n.startswith(config.netns_prefix)))


def default_backend(
    config: SlotNetworkConfig | None = None, firewall: SlotFirewall | None = None
) -> NetworkBackend:
    """The faster backend where it can run (bench/network.py: ``ip -batch`` sets up a slot ~2 ms
    quicker than pyroute2 0.9, whose asyncio core costs more than two execs here), else pyroute2."""
    # Imported here: network_ipbatch builds on this module's data types and netlink helpers.
    from nodeagent.isolation.network_ipbatch import IpBatchBackend  # noqa: PLC0415

    config = config or SlotNetworkConfig()
    if config.netns_dir == NETNS_RUN_DIR and shutil.which("ip") and shutil.which("tc"):
        return IpBatchBackend(config, firewall)
    return Pyroute2Backend(config, firewall)
