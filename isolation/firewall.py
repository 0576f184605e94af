"""Default-deny for slot networks: nftables rules through libnftables' JSON API.

What it enforces (the request's opt-ins are :class:`~nodeagent.isolation.network.SlotAccess`):

- a slot reaches no address of the host (its gateway, the host's other addresses, other slots'
  host-side veth addresses, loopback if the host routes it), dropped in ``input``;
- a slot reaches no other slot and nothing beyond the host, dropped in ``forward``, whatever the
  host's ``ip_forward`` says and whatever conntrack says;
- replies to connections the host opened into a slot (the agent's probes of a worker) pass, as
  conntrack ``established``/``related`` traffic;
- opt-in ``host_ports``: the slot may open TCP/UDP connections to those ports on the host
  (IPv4, any host address); opt-in ``egress="nat"``: the slot may open connections beyond the
  host, from its own address only, masqueraded behind the host's address; never to link-local
  169.254.0.0/16 (a cloud's instance-metadata service hands out credentials);
- nothing is forwarded *into* a slot except replies;
- IPv6: slots get no IPv6 address, and every IPv6 packet from a slot veth is dropped in ``input``
  and ``forward`` (the link-local address each veth gets would otherwise reach host services on
  ``[::]``); the opt-ins are IPv4 only.

How (why it looks like this):

- **One table of the agent's own**, ``inet <nft_table>`` (``nodeagent``), so the rules never mix
  with the host's own firewall and one ``delete table`` removes them. Its three base chains have
  ``policy accept`` and act only on interfaces carrying the veth prefix (``iifname "nah*"``): the
  host's other traffic passes untouched. An accept here is not final, so a stricter host firewall
  still applies on top; a drop here is.
- **Sets, not per-slot chains.** The per-slot state is set elements of two kinds: ``host_ports``
  (``ifname . inet_proto . inet_service``) and ``egress`` (``ifname . ipv4_addr``: the slot's own
  address, so a slot cannot send forged sources beyond the host). A slot's setup is one
  transaction that adds its elements, its teardown one that deletes them; the rules never change
  while slots come and go, and a lookup costs the same for 1 or 10,000 slots. (A verdict map to a
  chain per slot would make teardown need only the name, but libnftables 1.0.6 then reads every
  chain on each change: 6-15 ms per slot at 1,000 slots, against ~0.1 ms for an element.)
  Masquerade needs no per-slot state: only egress slots' packets get past ``forward``, so the NAT
  rule matches the slot pool as a source (``iifname`` is not known in ``postrouting``).
- **The kernel is the record, memory a cache of it.** The elements carry the host veth name, so
  orphan listing and removal after a crash read them from the table. Listing the table costs
  ~45 ms at 1,000 slots, so the firewall reads it once (first use, orphan searches) and then keeps
  a mirror of each slot's elements in step with its own changes; a deletion is sent as "add, then
  delete" in one transaction, which cannot fail on an element that is already gone. Any refused
  transaction drops the mirror, reads the kernel again and retries once. A ruleset marker (a
  comment holding a hash of the rules) tells whether the table is there and current at that read:
  a missing table (``nft flush ruleset``) or an older agent's rules are rebuilt in the same
  transaction as the next slot's elements; every setup names the table (its egress element, added
  or discarded), so a vanished table is noticed at the next setup, opt-ins or not.
- **libnftables, JSON, ctypes.** libnftables is the maintained library behind ``nft``; its JSON
  API is the documented machine interface. Debian's ``python3-nftables`` is a ctypes wrapper
  over the same library, but it installs into the system interpreter's ``dist-packages``, which
  the agent's virtual environment (any Python 3.11 build) does not see, and it pulls jsonschema
  in; the nine functions used here are bound below instead (:class:`LibNftables`). No ``nft``
  process is started; a slot's setup or teardown is one transaction (~0.1-0.4 ms with 1,000
  other slots in the table, bench/network.py).
- **ip_forward**: a slot with egress needs the host to forward. The first such slot turns
  ``net.ipv4.ip_forward`` on if it was off and records the previous value under
  ``/run/nodeagent/ip_forward`` (:class:`IpForwarding`); when the last egress slot of every
  holder is gone the value is restored. ``/run`` empties at boot, as the sysctl resets, so a
  record never outlives what it describes. Slot-to-slot forwarding stays dropped regardless.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import os
import re
import socket
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from nodeagent.atomicfile import write_atomic
from nodeagent.errors import NetworkError, Unsupported, os_error_message
from nodeagent.isolation.network import SlotAccess, SlotNetwork, SlotNetworkConfig

LIBRARY = "libnftables.so.1"
FAMILY = "inet"
HOST_PORTS = "host_ports"
EGRESS = "egress"
SET_TYPES: Mapping[str, tuple[str, ...]] = {
    HOST_PORTS: ("ifname", "inet_proto", "inet_service"),
    EGRESS: ("ifname", "ipv4_addr"),
}
#: chain name -> (type, hook, priority): filter at the standard priority, NAT at srcnat.
CHAINS: Mapping[str, tuple[str, str, int]] = {
    "input": ("filter", "input", 0),
    "forward": ("filter", "forward", 0),
    "postrouting": ("nat", "postrouting", 100),
}
LINK_LOCAL = ("169.254.0.0", 16)
FORWARDING_REGISTRY = Path("/run/nodeagent/ip_forward")
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")

_NFT_CTX_OUTPUT_JSON = 1 << 4
_NETLINK_NETFILTER = 12
_PROTOCOL_NUMBERS = {6: "tcp", 17: "udp"}
_HOLDER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")

Command = dict[str, Any]
Expr = dict[str, Any]


class NftError(NetworkError):
    """libnftables refused a command (the message is the library's, with what we asked)."""


# --------------------------------------------------------------------------- the library


class Nft(Protocol):
    def run(self, commands: Sequence[Command], *, dry_run: bool = False) -> list[dict[str, Any]]:
        """Run ``commands`` as one transaction; the objects a listing returned (else [])."""
        ...


class LibNftables:
    """libnftables.so.1 through ctypes: one context, JSON in and out, calls serialised by a lock.

    The context's netlink socket belongs to the network namespace of the thread that makes the
    first call: the agent calls from its own threads, all in the host namespace (the throwaway
    threads that enter a slot's namespace never get here).
    """

    def __init__(self, library: str = LIBRARY) -> None:
        self.library = library
        self._lib: Any = None
        self._ctx: int | None = None
        self._lock = threading.Lock()

    def load(self) -> None:
        """Load the library and make the context; Unsupported when the library is missing."""
        with self._lock:
            self._load()

    def run(self, commands: Sequence[Command], *, dry_run: bool = False) -> list[dict[str, Any]]:
        text = json.dumps({"nftables": list(commands)}).encode()
        with self._lock:
            lib, ctx = self._load()
            lib.nft_ctx_set_dry_run(ctx, dry_run)
            try:
                rc = lib.nft_run_cmd_from_buffer(ctx, text)
            finally:
                lib.nft_ctx_set_dry_run(ctx, False)
            # Reading a buffer also empties it, so both are read after every call.
            out = lib.nft_ctx_get_output_buffer(ctx) or b""
            err = lib.nft_ctx_get_error_buffer(ctx) or b""
        if rc != 0:
            raise NftError(_error_text(err) or f"{self.library} returned {rc} without a message")
        if not out.strip():
            return []
        return [obj for obj in json.loads(out).get("nftables", []) if "metainfo" not in obj]

    def close(self) -> None:
        with self._lock:
            if self._ctx is not None:
                self._lib.nft_ctx_free(self._ctx)
                self._ctx = None

    def _load(self) -> tuple[Any, int]:
        if self._ctx is not None:
            return self._lib, self._ctx
        try:
            # libnftables 1.0.6 calls exit() when it cannot open its netlink socket (a kernel
            # without nfnetlink): it would end the agent. Open one here first, where a failure
            # is only an error.
            socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_NETFILTER).close()
        except OSError as err:
            raise Unsupported(
                f"the kernel offers no netfilter netlink socket ({err.strerror}), which nftables needs: "
                "use a kernel with CONFIG_NETFILTER_NETLINK and CONFIG_NF_TABLES"
            ) from err
        try:
            lib = ctypes.CDLL(self.library)
        except OSError as err:
            raise Unsupported(
                f"{self.library} cannot be loaded ({err}); install nftables (Debian: apt-get install "
                "nftables, which brings libnftables1)"
            ) from err
        c_void_p, c_char_p, c_int, c_uint = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint
        for name, restype, argtypes in (
            ("nft_ctx_new", c_void_p, [ctypes.c_uint32]),
            ("nft_ctx_free", None, [c_void_p]),
            ("nft_ctx_output_set_flags", None, [c_void_p, c_uint]),
            ("nft_ctx_buffer_output", c_int, [c_void_p]),
            ("nft_ctx_buffer_error", c_int, [c_void_p]),
            ("nft_ctx_get_output_buffer", c_char_p, [c_void_p]),
            ("nft_ctx_get_error_buffer", c_char_p, [c_void_p]),
            ("nft_ctx_set_dry_run", None, [c_void_p, ctypes.c_bool]),
            ("nft_run_cmd_from_buffer", c_int, [c_void_p, c_char_p]),
        ):
            function = getattr(lib, name)
            function.restype = restype
            function.argtypes = argtypes
        ctx = lib.nft_ctx_new(0)
        if not ctx:
            raise NftError(f"{self.library}: nft_ctx_new failed")
        # JSON output also makes nft_run_cmd_from_buffer parse its input as JSON.
        lib.nft_ctx_output_set_flags(ctx, _NFT_CTX_OUTPUT_JSON)
        if lib.nft_ctx_buffer_output(ctx) != 0 or lib.nft_ctx_buffer_error(ctx) != 0:
            lib.nft_ctx_free(ctx)
            raise NftError(f"{self.library}: cannot buffer its output")
        self._lib, self._ctx = lib, ctx
        return lib, ctx


def _error_text(raw: bytes) -> str:
    """The library's message without its location prefix ("internal:0:0-0: Error: ...")."""
    lines = [line.strip() for line in raw.decode(errors="replace").splitlines() if line.strip()]
    text = "; ".join(re.sub(r"^internal:\d+:\d+-\d+: ", "", line) for line in lines)
    return text.removeprefix("Error: ")


# --------------------------------------------------------------------------- the rules (pure)


def _meta(key: str) -> Expr:
    return {"meta": {"key": key}}


def _payload(protocol: str, name: str) -> Expr:
    return {"payload": {"protocol": protocol, "field": name}}


def _match(left: Expr, right: Any, op: str = "==") -> Expr:
    return {"match": {"op": op, "left": left, "right": right}}


def _prefix(address: str, length: int) -> dict[str, Any]:
    return {"prefix": {"addr": address, "len": length}}


_ESTABLISHED = _match({"ct": {"key": "state"}}, ["established", "related"], "in")
_ACCEPT: Expr = {"accept": None}
_DROP: Expr = {"drop": None}
_COUNTER: Expr = {"counter": None}


def chain_rules(config: SlotNetworkConfig) -> dict[str, list[list[Expr]]]:
    """Each chain's rules, in order (each a list of JSON expressions)."""
    slot = config.veth_prefix + "*"  # nft's interface-name wildcard: a prefix match
    from_slot = _match(_meta("iifname"), slot)
    to_slot = _match(_meta("oifname"), slot)
    pool = config.pool
    port_key = {"concat": [_meta("iifname"), _meta("l4proto"), _payload("th", "dport")]}
    source_key = {"concat": [_meta("iifname"), _payload("ip", "saddr")]}
    return {
        "input": [
            # Replies to what the host opened into the slot: the agent's probes of its worker.
            [from_slot, _ESTABLISHED, _ACCEPT],
            [from_slot, _match(_meta("nfproto"), "ipv4"), _match(port_key, "@" + HOST_PORTS), _ACCEPT],
            [from_slot, _COUNTER, _DROP],
        ],
        "forward": [
            # First, so that no conntrack state (a slot forging a reply) can ever open this path.
            [from_slot, to_slot, _COUNTER, _DROP],
            [to_slot, _ESTABLISHED, _ACCEPT],
            [to_slot, _COUNTER, _DROP],
            [from_slot, _match(_payload("ip", "daddr"), _prefix(*LINK_LOCAL)), _COUNTER, _DROP],
            # The slot's own address only: a slot cannot send forged sources beyond the host.
            [from_slot, _match(source_key, "@" + EGRESS), _ACCEPT],
            [from_slot, _COUNTER, _DROP],
        ],
        "postrouting": [
            [
                _match(_payload("ip", "saddr"), _prefix(str(pool.network_address), pool.prefixlen)),
                _match(_meta("oifname"), slot, "!="),
                {"masquerade": None},
            ],
        ],
    }


def ruleset_marker(config: SlotNetworkConfig) -> str:
    """A comment on each chain's last rule: which rules (and set types) the table holds."""
    layout = {"rules": chain_rules(config), "sets": SET_TYPES, "chains": CHAINS}
    digest = hashlib.sha256(json.dumps(layout, sort_keys=True).encode()).hexdigest()[:16]
    return f"nodeagent ruleset {digest}"


def _table(config: SlotNetworkConfig) -> dict[str, str]:
    return {"family": FAMILY, "name": config.nft_table}


def _in_table(config: SlotNetworkConfig, **fields: Any) -> dict[str, Any]:
    return {"family": FAMILY, "table": config.nft_table, **fields}


def ensure_commands(config: SlotNetworkConfig, *, rebuild: bool) -> list[Command]:
    """The transaction that makes the table, its sets, chains and rules exactly ours.

    ``rebuild``: the table exists with other set types or chain hooks (an older layout), which no
    ``add`` can change: it is deleted first, in the same transaction, losing the slots' elements
    (those slots are denied everything until they are applied again; never the other way round).
    Otherwise sets and their elements are kept and only the rules are replaced.
    """
    marker = ruleset_marker(config)
    commands: list[Command] = []
    if rebuild:
        commands.append({"delete": {"table": _table(config)}})
    commands.append({"add": {"table": _table(config)}})
    for name, types in SET_TYPES.items():
        commands.append({"add": {"set": _in_table(config, name=name, type=list(types))}})
    for name, (kind, hook, prio) in CHAINS.items():
        spec = _in_table(config, name=name, type=kind, hook=hook, prio=prio, policy="accept")
        commands.append({"add": {"chain": spec}})
        commands.append({"flush": {"chain": _in_table(config, name=name)}})
    for chain, rules in chain_rules(config).items():
        for index, expr in enumerate(rules):
            rule = _in_table(config, chain=chain, expr=expr)
            if index == len(rules) - 1:
                rule["comment"] = marker
            commands.append({"add": {"rule": rule}})
    return commands


@dataclass(frozen=True)
class SlotElements:
    """Set elements: (ifname, protocol, port) in host_ports, (ifname, address) in egress."""

    host_ports: frozenset[tuple[str, str, int]] = frozenset()
    egress: frozenset[tuple[str, str]] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.host_ports or self.egress)

    def __sub__(self, other: SlotElements) -> SlotElements:
        return SlotElements(self.host_ports - other.host_ports, self.egress - other.egress)

    def __or__(self, other: SlotElements) -> SlotElements:
        return SlotElements(self.host_ports | other.host_ports, self.egress | other.egress)

    @staticmethod
    def union(parts: Iterable[SlotElements]) -> SlotElements:
        total = SlotElements()
        for part in parts:
            total = total | part
        return total

    def ifnames(self) -> frozenset[str]:
        return frozenset(e[0] for e in self.host_ports) | frozenset(e[0] for e in self.egress)

    def of(self, ifnames: Iterable[str]) -> SlotElements:
        names = frozenset(ifnames)
        return SlotElements(
            frozenset(e for e in self.host_ports if e[0] in names),
            frozenset(e for e in self.egress if e[0] in names),
        )


def slot_elements(host_ifname: str, slot_address: str, access: SlotAccess) -> SlotElements:
    """The set elements that grant ``access`` to the slot behind ``host_ifname``."""
    return SlotElements(
        frozenset((host_ifname, p.protocol, p.port) for p in access.host_ports),
        frozenset({(host_ifname, slot_address)}) if access.nat else frozenset(),
    )


def element_commands(verb: str, config: SlotNetworkConfig, elements: SlotElements) -> list[Command]:
    """``add`` or ``delete`` commands for ``elements`` (none for an empty set)."""
    commands: list[Command] = []
    for name, members in ((HOST_PORTS, elements.host_ports), (EGRESS, elements.egress)):
        if members:
            elem = [{"concat": list(member)} for member in sorted(members)]
            commands.append({verb: {"element": _in_table(config, name=name, elem=elem)}})
    return commands


@dataclass(frozen=True)
class TableState:
    """What a listing of the agent's table says."""

    exists: bool = False
    #: sets and chains have the types and hooks this version uses
    layout_ok: bool = False
    #: ...and every chain ends with this version's marker
    current: bool = False
    elements: SlotElements = field(default_factory=SlotElements)


def parse_table(
    config: SlotNetworkConfig, listing: Sequence[Mapping[str, Any]], marker: str | None = None
) -> TableState:
    """Read ``list table`` output (the objects of its ``nftables`` array)."""
    if not any("table" in obj for obj in listing):
        return TableState()
    marker = marker or ruleset_marker(config)
    chains: dict[str, tuple[str, str, int]] = {}
    marked: set[str] = set()
    for obj in listing:
        if "chain" in obj:
            body = obj["chain"]
            chains[body["name"]] = (body.get("type", ""), body.get("hook", ""), int(body.get("prio", 0)))
        elif "rule" in obj and obj["rule"].get("comment") == marker:
            marked.add(obj["rule"]["chain"])
    types_ok, elements = parse_sets(listing)
    layout_ok = types_ok and all(chains.get(n) == spec for n, spec in CHAINS.items())
    return TableState(
        exists=True, layout_ok=layout_ok, current=layout_ok and marked == set(CHAINS), elements=elements
    )


def parse_sets(listing: Sequence[Mapping[str, Any]]) -> tuple[bool, SlotElements]:
    """The opt-ins in a listing of the agent's sets, and whether both sets have this version's types."""
    types: dict[str, tuple[str, ...]] = {}
    host_ports: set[tuple[str, str, int]] = set()
    egress: set[tuple[str, str]] = set()
    for obj in listing:
        body = obj.get("set")
        if body is None:
            continue
        kind = body.get("type")
        types[body["name"]] = tuple(kind) if isinstance(kind, list) else (str(kind),)
        for value in _element_values(body.get("elem", ())):
            if body["name"] == HOST_PORTS and len(value) == 3:
                host_ports.add((str(value[0]), _protocol_name(value[1]), int(value[2])))
            elif body["name"] == EGRESS and len(value) == 2:
                egress.add((str(value[0]), str(value[1])))
    types_ok = all(types.get(n) == t for n, t in SET_TYPES.items())
    return types_ok, SlotElements(frozenset(host_ports), frozenset(egress))


def _protocol_name(value: Any) -> str:
    """nft lists protocols by name; by number where it knows no name (or is told to print numbers)."""
    return _PROTOCOL_NUMBERS.get(value, str(value)) if isinstance(value, int) else str(value)


def _element_values(elems: Iterable[Any]) -> Iterator[tuple[Any, ...]]:
    for elem in elems:
        # An element with attributes (a timeout, a counter) is wrapped: {"elem": {"val": ...}}.
        value = elem["elem"].get("val") if isinstance(elem, dict) and "elem" in elem else elem
        if isinstance(value, dict) and "concat" in value:
            yield tuple(value["concat"])


# --------------------------------------------------------------------------- ip_forward


class IpForwarding:
    """``net.ipv4.ip_forward`` held on while anyone needs it, restored when the last one lets go.

    The registry (a directory under /run) holds a file per holder and, when a holder turned
    forwarding on, ``before``: the value to go back to. It is shared by every agent (and test)
    of the host's network namespace, because the sysctl is too: one holder must not turn
    forwarding off under another. Changes happen under an flock of the directory.
    """

    def __init__(self, registry: Path = FORWARDING_REGISTRY, sysctl: Path = IP_FORWARD) -> None:
        self.registry = registry
        self.sysctl = sysctl

    def hold(self, holder: str) -> None:
        # Every setup of a slot with egress gets here; once held and on, nothing needs writing.
        if (self.registry / _holder_file(holder)).exists() and self._read_sysctl() == "1":
            return
        with self._locked():
            current = self._read_sysctl()
            if current != "1":
                before = self.registry / "before"
                if not before.exists():
                    write_atomic(before, current)  # first, so a crash cannot lose it
                self._write_sysctl("1")
            (self.registry / _holder_file(holder)).touch()

    def release(self, holder: str) -> None:
        # Most slots' teardowns get here holding nothing: two stats then, no lock and no writes.
        # (A record appearing right after the check is another holder's, and theirs to release.)
        if not (self.registry / _holder_file(holder)).exists() and not (self.registry / "before").exists():
            return
        with self._locked():
            (self.registry / _holder_file(holder)).unlink(missing_ok=True)
            before = self.registry / "before"
            if not self._holders() and before.exists():
                self._write_sysctl(before.read_text().strip())
                before.unlink()

    def holders(self) -> tuple[str, ...]:
        if not self.registry.is_dir():
            return ()
        return self._holders()

    def value(self) -> str:
        return self._read_sysctl()

    def _holders(self) -> tuple[str, ...]:
        return tuple(sorted(p.name.removeprefix("holder-") for p in self.registry.glob("holder-*")))

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        try:
            self.registry.mkdir(parents=True, exist_ok=True)
            # The directory itself is the lock: no lock file is left behind, and unlinking one
            # would race with a process that is about to lock it.
            fd = os.open(self.registry, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as err:
            raise NetworkError(
                os_error_message(f"open the ip_forward registry {self.registry}", err)
            ) from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        except OSError as err:
            raise NetworkError(
                os_error_message(f"update the ip_forward registry {self.registry}", err)
            ) from err
        finally:
            os.close(fd)

    def _read_sysctl(self) -> str:
        try:
            return self.sysctl.read_text().strip()
        except OSError as err:
            raise NetworkError(os_error_message(f"read {self.sysctl}", err)) from err

    def _write_sysctl(self, value: str) -> None:
        try:
            self.sysctl.write_text(value)
        except OSError as err:
            raise NetworkError(os_error_message(f"write {value} to {self.sysctl}", err)) from err


def _holder_file(holder: str) -> str:
    if not _HOLDER_RE.match(holder):
        raise NetworkError(f"ip_forward holder name {holder!r} is not a safe file name")
    return "holder-" + holder


# --------------------------------------------------------------------------- the firewall


class NftFirewall:
    """:class:`~nodeagent.isolation.network.SlotFirewall` on the agent's nftables table.

    Thread-safe (one lock). ``nft`` defaults to libnftables and ``forwarding`` to the host's
    ip_forward registry; tests hand in fakes or a registry of their own.
    """

    def __init__(
        self,
        config: SlotNetworkConfig | None = None,
        nft: Nft | None = None,
        forwarding: IpForwarding | None = None,
    ) -> None:
        self.config = config or SlotNetworkConfig()
        self.nft: Nft = nft or LibNftables()
        self.forwarding = forwarding or IpForwarding()
        self.holder = f"{FAMILY}-{self.config.nft_table}"
        self._lock = threading.RLock()
        self._problem: tuple[str | None] | None = None
        self._marker = ruleset_marker(self.config)
        #: host veth name -> its opt-ins in the kernel; None: not read yet, or no longer trusted
        self._mirror: dict[str, SlotElements] | None = None

    # -- availability

    def problem(self) -> str | None:
        """Why this host cannot run the firewall (None: it can). Checked once, then remembered.

        The rules go to the kernel in dry-run mode (validated, never committed), under a table name
        nobody uses, so a kernel without nf_tables, conntrack or NAT is found here rather than at a
        slot's setup.
        """
        with self._lock:
            if self._problem is None:
                self._problem = (self._probe(),)
            return self._problem[0]

    def _probe(self) -> str | None:
        try:
            if isinstance(self.nft, LibNftables):
                self.nft.load()
            probe = SlotNetworkConfig(
                cidr=self.config.cidr,
                subnet_prefixlen=self.config.subnet_prefixlen,
                veth_prefix=self.config.veth_prefix,
                nft_table=(self.config.nft_table + "-probe")[:64],
            )
            self.nft.run(ensure_commands(probe, rebuild=False), dry_run=True)
        except Unsupported as err:
            return str(err)
        except NftError as err:
            hint = (
                "run the agent as root (CAP_NET_ADMIN)"
                if "Operation not permitted" in str(err)
                else "the kernel needs nf_tables with conntrack and NAT (masquerade)"
            )
            return f"the kernel refused the slot firewall's rules in a dry run: {err}; {hint}"
        return None

    # -- SlotFirewall

    def ensure(self) -> None:
        with self._lock:
            state = self.read_table()
            if not state.current:
                rebuild = state.exists and not state.layout_ok
                self._run(ensure_commands(self.config, rebuild=rebuild), "set up the slot firewall")
            self._mirror = _by_ifname(state.elements if state.layout_ok else SlotElements())

    def apply(self, plan: SlotNetwork) -> None:
        with self._lock:
            ifname = plan.host_ifname
            want = slot_elements(ifname, str(plan.slot_address), plan.access)
            action = f"set up the firewall of slot {plan.slot_id} ({ifname})"
            try:
                self._run(self._apply_commands(ifname, str(plan.slot_address), want), action)
            except NftError:
                # The table went away (``nft flush ruleset``), or our picture of it is wrong:
                # read the kernel again, rebuild what is missing, and try once more.
                self._mirror = None
                self._run(self._apply_commands(ifname, str(plan.slot_address), want), action)
            self._mirror_of()[ifname] = want
            self._sync_forwarding(f"slot {plan.slot_id} asks for egress")

    def remove(self, host_ifname: str) -> None:
        with self._lock:
            have = self._mirror_of().get(host_ifname, SlotElements())
            if have:
                try:
                    self._run(_discard_commands(self.config, have), f"revoke the opt-ins of {host_ifname}")
                except NftError:
                    self._mirror = None
                    have = self._mirror_of().get(host_ifname, SlotElements())
                    if have:
                        self._run(
                            _discard_commands(self.config, have), f"revoke the opt-ins of {host_ifname}"
                        )
            self._mirror_of().pop(host_ifname, None)
            self._sync_forwarding("slots that remain have egress")

    def list_owned(self) -> tuple[str, ...]:
        with self._lock:
            self._mirror = None  # an orphan search reads the kernel, never a cache
            prefix = self.config.veth_prefix
            return tuple(sorted(n for n, e in self._mirror_of().items() if e and n.startswith(prefix)))

    def remove_owned(self, host_ifnames: Iterable[str]) -> None:
        names = list(host_ifnames)
        with self._lock:
            self._mirror = None
            mirror = self._mirror_of()
            gone = SlotElements.union(mirror.get(n, SlotElements()) for n in names)
            if gone:
                self._run(_discard_commands(self.config, gone), "remove orphaned opt-ins")
            for name in names:
                mirror.pop(name, None)
            self._sync_forwarding("slots that remain have egress")

    def remove_all(self) -> None:
        with self._lock:
            self._mirror = None
            if self.read_table().exists:
                self._run([{"delete": {"table": _table(self.config)}}], "remove the slot firewall")
            self.forwarding.release(self.holder)

    # -- internals

    def _apply_commands(self, ifname: str, address: str, want: SlotElements) -> list[Command]:
        """One transaction: the table if it needs (re)building, then the slot's difference."""
        commands: list[Command] = []
        if self._mirror is None:
            state = self.read_table()
            if not state.current:
                commands = ensure_commands(self.config, rebuild=state.exists and not state.layout_ok)
            # A rebuild deletes the table, elements and all: nothing of the old state survives.
            self._mirror = _by_ifname(state.elements if state.layout_ok else SlotElements())
        have = self._mirror.get(ifname, SlotElements())
        # The egress element is always named (added or discarded): for a slot without opt-ins this
        # is what fails when the table went away, so the table is rebuilt at that slot's setup.
        egress = SlotElements(egress=frozenset({(ifname, address)}))
        commands += _discard_commands(self.config, (have | (egress - want)) - want)
        commands += element_commands("add", self.config, want - have)
        return commands

    def _mirror_of(self) -> dict[str, SlotElements]:
        """Each slot's opt-ins as the kernel holds them: read once, then kept in step with every
        change this firewall makes (a listing costs ~45 ms at 1,000 slots; a change ~0.1 ms)."""
        if self._mirror is None:
            state = self.read_table()
            self._mirror = _by_ifname(state.elements)
        return self._mirror

    def read_table(self) -> TableState:
        """What the kernel's table holds now (a full listing: for checks and orphan searches)."""
        try:
            listing = self.nft.run([{"list": {"table": _table(self.config)}}])
        except NftError as err:
            # A missing table is an answer, not a failure; the library says so only in words, so
            # the list of tables decides (it does not fail for a missing one).
            tables = self._run([{"list": {"tables": {"family": FAMILY}}}], "list the nftables tables")
            if any(t.get("table", {}).get("name") == self.config.nft_table for t in tables):
                raise NftError(f"listing nftables table {FAMILY} {self.config.nft_table}: {err}") from err
            return TableState()
        return parse_table(self.config, listing, self._marker)

    def _run(self, commands: Sequence[Command], action: str) -> list[dict[str, Any]]:
        if not commands:
            return []
        try:
            return self.nft.run(commands)
        except NftError as err:
            raise NftError(
                f"nftables refused to {action} in table {FAMILY} {self.config.nft_table}: {err}"
            ) from err

    def _sync_forwarding(self, why: str) -> None:
        """Hold ip_forward on while any slot of this table has egress; let go when none has."""
        if any(e.egress for e in self._mirror_of().values()):
            try:
                self.forwarding.hold(self.holder)
            except NetworkError as err:
                raise NetworkError(f"{why}, but IPv4 forwarding cannot be turned on: {err}") from err
        else:
            self.forwarding.release(self.holder)


def _by_ifname(elements: SlotElements) -> dict[str, SlotElements]:
    return {name: elements.of([name]) for name in elements.ifnames()}


def _discard_commands(config: SlotNetworkConfig, elements: SlotElements) -> list[Command]:
    """Delete ``elements`` whether or not they exist: each is added first in the same transaction
    (adding an existing element is no error, deleting a missing one is, and would fail the rest)."""
    return element_commands("add", config, elements) + element_commands("delete", config, elements)


__all__ = [
    "CHAINS",
    "EGRESS",
    "HOST_PORTS",
    "LIBRARY",
    "SET_TYPES",
    "IpForwarding",
    "LibNftables",
    "NftError",
    "NftFirewall",
    "SlotElements",
    "TableState",
    "chain_rules",
    "element_commands",
    "ensure_commands",
    "parse_sets",
    "parse_table",
    "ruleset_marker",
    "slot_elements",
]
