"""Sandboxed slots in the host's network namespace against the host's own sockets and each other:
nftables rules on the host's output path, matching the slots' uids.

A default slot shares the host's network namespace, so without rules its worker could connect to
every local address like any local process: the agent's ``[api] listen`` address, services on
127.0.0.1, other slots' ports. Each sandboxed slot runs as its own uid from ``[sandbox]
uid_range``, so rules in the output hook matching the socket's owner (``meta skuid``) and a local
destination (``fib daddr type local``: loopback and every address of the host), IPv4 and IPv6,
can tell a slot's packets apart. What no static rule can know is who *listens* on a port: a slot's
own processes talk to each other over loopback on ports nobody assigned (torch.distributed, Ray, a
sidecar), so "drop every new connection to a local address" would break them. The kernel does
know, one packet later: a SYN-ACK leaves through the output hook owned by the listening socket,
so ``meta skuid`` on it is the listener's uid. The table therefore remembers each slot's TCP
SYN to a local address, with the slot's uid, in a short-lived dynamic set, and lets the answer
through only when the listener has the same uid; any other SYN-ACK to a slot's SYN is rewritten
into a RST, so the slot's connect() fails at once with "connection refused" and no byte has
reached the listener's application (it never accepts a connection that did not complete):

    table inet <firewall_table>_host
      set syn4/syn6    { saddr . sport . daddr . dport . uid; dynamic, timeout 2s }
      set slot4/slot6  { saddr . sport . daddr . dport;       dynamic, timeout 2s }
      chain output (filter, output, priority 0, policy accept)
        slot uid, local, tcp dport API                      counter drop (accept: [api] slots_may_connect)
      with [isolation] local_default_deny (the default):
        slot uid, local, PROTO dport PORT                   accept   (each of local_open_ports)
        slot uid, new, local, tcp                           update @synN, update @slotN
        slot uid, new, local, not tcp/icmp                  counter drop
        slot uid, new, daddr in network_cidr                counter reject   (slots with a network)
        reply SYN-ACK, (daddr . dport . saddr . sport . skuid) in @synN   accept  (same uid listens)
        reply SYN-ACK, (daddr . dport . saddr . sport) in @slotN          counter, flags := RST|ACK

The sets expire entries after 2 s (a retransmitted SYN refreshes its entry; on loopback the answer
takes microseconds), so they hold only connections being opened; when one is full, a slot's new
entry is not added and its SYN-ACK is not recognised as its own: the connection fails closed
(refused), never open. A SYN-ACK without a full socket (SYN cookies, under a SYN flood) has no
uid and fails closed the same way. UDP (and every protocol but TCP and ICMP) from a slot to a
local address is dropped outright but on ``local_open_ports`` (53 by default, for a resolver on
127.0.0.53): for a datagram there is no answer to check before the data is delivered.

The rules belong to the agent's configuration, not to slots: no per-slot state, (re)made at every
start in one transaction (after a crash they are simply made again, from the new configuration)
and deleted at a clean stop. The agent's unix socket needs no rule: it is root's, mode 0600.
Abstract unix sockets are Landlock's part (runtime/sandbox/landlock.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from ipaddress import IPv4Network, ip_network
from typing import Any

from nodeagent.isolation.firewall import FAMILY, Command, Nft

CHAIN = "output"
COMMENT = "nodeagent: slots and the host's sockets"
#: how long a slot's SYN is remembered: a retransmitted SYN refreshes it (``update``), and on
#: loopback the SYN-ACK follows in microseconds unless the listener's queue is full
PENDING_TIMEOUT_S = 2
#: entries per set: at 2 s each, a slot would have to open ~130,000 local connections a second
#: to fill it, and a full set fails closed (refused), never open
PENDING_SIZE = 262144


@dataclass(frozen=True)
class LocalDeny:
    """What ``[isolation] local_default_deny`` keeps slots off: every local address but
    ``open_ports`` ((protocol, port) pairs), a listener of another uid, and ``network_cidr`` (the
    addresses of slots with a network of their own)."""

    open_ports: tuple[tuple[str, int], ...] = ()
    network_cidr: str | None = None


def table_name(firewall_table: str) -> str:
    return f"{firewall_table}_host"


def _rule(*matches: Any, verdict: str | None) -> list[Any]:
    if verdict is None:
        return list(matches)
    return [*matches, *([{"counter": None}] if verdict in ("drop", "reject") else []), {verdict: None}]


def _eq(left: Any, right: Any) -> dict[str, Any]:
    return {"match": {"op": "==", "left": left, "right": right}}


def _payload(protocol: str, field: str) -> dict[str, Any]:
    return {"payload": {"protocol": protocol, "field": field}}


SKUID = {"meta": {"key": "skuid"}}
NEW = {"match": {"op": "in", "left": {"ct": {"key": "state"}}, "right": ["new"]}}
LOCAL = _eq({"fib": {"result": "type", "flags": ["daddr"]}}, "local")
TCP = _eq({"meta": {"key": "l4proto"}}, "tcp")
REPLY = _eq({"ct": {"key": "direction"}}, "reply")
SYN_ACK = _eq({"&": [_payload("tcp", "flags"), ["syn", "ack"]]}, ["syn", "ack"])


def _outbound(ip: str) -> list[dict[str, Any]]:
    """The connection as the slot's SYN carries it: (saddr, sport, daddr, dport)."""
    return [_payload(ip, "saddr"), _payload("tcp", "sport"), _payload(ip, "daddr"), _payload("tcp", "dport")]


def _answered(ip: str) -> list[dict[str, Any]]:
    """The same connection as the listener's SYN-ACK carries it (addresses and ports swapped)."""
    return [_payload(ip, "daddr"), _payload("tcp", "dport"), _payload(ip, "saddr"), _payload("tcp", "sport")]


#: per IP version: the suffix of its sets' names, its payload protocol and address type
FAMILIES = (("4", "ip", "ipv4_addr"), ("6", "ip6", "ipv6_addr"))


def _pending_sets(in_table: dict[str, Any]) -> list[Command]:
    common = {**in_table, "size": PENDING_SIZE, "flags": ["timeout"], "timeout": PENDING_TIMEOUT_S}
    commands: list[Command] = []
    for suffix, _, addr in FAMILIES:
        key = [addr, "inet_service", addr, "inet_service"]
        commands.append({"add": {"set": {**common, "name": f"syn{suffix}", "type": [*key, "uid"]}}})
        commands.append({"add": {"set": {**common, "name": f"slot{suffix}", "type": key}}})
    return commands


def _deny_rules(slot: dict[str, Any], deny: LocalDeny) -> list[list[Any]]:
    rules: list[list[Any]] = []
    for protocol, port in deny.open_ports:
        rules.append(
            _rule(
                slot,
                LOCAL,
                _eq({"meta": {"key": "l4proto"}}, protocol),
                _eq(_payload("th", "dport"), port),
                verdict="accept",
            )
        )
    for suffix, ip, _ in FAMILIES:
        remember = [
            {"set": {"op": "update", "elem": {"concat": [*_outbound(ip), SKUID]}, "set": f"@syn{suffix}"}},
            {"set": {"op": "update", "elem": {"concat": _outbound(ip)}, "set": f"@slot{suffix}"}},
        ]
        # The payload match pins the rule to one IP version (nft adds the nfproto dependency).
        rules.append(_rule(slot, NEW, LOCAL, TCP, *remember, verdict=None))
    not_tcp = {
        "match": {
            "op": "!=",
            "left": {"meta": {"key": "l4proto"}},
            "right": {"set": ["tcp", "icmp", "ipv6-icmp"]},
        }
    }
    rules.append(_rule(slot, NEW, LOCAL, not_tcp, verdict="drop"))
    if deny.network_cidr is not None:
        net = ip_network(deny.network_cidr)
        ip = "ip" if isinstance(net, IPv4Network) else "ip6"
        prefix = {"prefix": {"addr": str(net.network_address), "len": net.prefixlen}}
        rules.append(_rule(slot, NEW, _eq(_payload(ip, "daddr"), prefix), verdict="reject"))
    for suffix, ip, _ in FAMILIES:
        own = {"match": {"op": "==", "left": {"concat": [*_answered(ip), SKUID]}, "right": f"@syn{suffix}"}}
        rules.append(_rule(REPLY, SYN_ACK, own, verdict="accept"))
        of_a_slot = {"match": {"op": "==", "left": {"concat": _answered(ip)}, "right": f"@slot{suffix}"}}
        refuse = {"mangle": {"key": _payload("tcp", "flags"), "value": {"|": ["rst", "ack"]}}}
        rules.append(_rule(REPLY, SYN_ACK, of_a_slot, {"counter": None}, refuse, verdict=None))
    return rules


def guard_commands(
    table: str,
    uids: tuple[int, int],
    *,
    api_port: int | None,
    api_open: bool = False,
    local_deny: LocalDeny | None = None,
) -> list[Command]:
    """The transaction that makes ``table`` hold exactly the rules (made first, so the delete that
    clears an older copy cannot fail on a missing table). ``api_port``: the agent's TCP port,
    dropped unless ``api_open``; ``local_deny``: the default-deny above, None for none."""
    ident = {"family": FAMILY, "name": table}
    in_table: dict[str, Any] = {"family": FAMILY, "table": table}
    slot = _eq(SKUID, {"range": list(uids)})
    rules: list[list[Any]] = []
    if api_port is not None:
        to_api = _eq(_payload("tcp", "dport"), api_port)
        rules.append(_rule(slot, LOCAL, to_api, verdict="accept" if api_open else "drop"))
    if local_deny is not None:
        rules.extend(_deny_rules(slot, local_deny))
    commands: list[Command] = [
        {"add": {"table": ident}},
        {"delete": {"table": ident}},
        {"add": {"table": ident}},
        *(_pending_sets(in_table) if local_deny is not None else []),
        {
            "add": {
                "chain": {
                    **in_table,
                    "name": CHAIN,
                    "type": "filter",
                    "hook": "output",
                    "prio": 0,
                    "policy": "accept",
                }
            }
        },
    ]
    for expr in rules:
        commands.append({"add": {"rule": {**in_table, "chain": CHAIN, "expr": expr, "comment": COMMENT}}})
    return commands


def remove_commands(table: str) -> list[Command]:
    ident = {"family": FAMILY, "name": table}
    return [{"add": {"table": ident}}, {"delete": {"table": ident}}]


class ApiGuard:
    """Installs and removes the rules through ``nft`` (libnftables, as the slot firewall uses)."""

    def __init__(self, nft: Nft, table: str) -> None:
        self.nft = nft
        self.table = table

    def install(
        self,
        uids: tuple[int, int],
        *,
        api_port: int | None,
        api_open: bool = False,
        local_deny: LocalDeny | None = None,
    ) -> None:
        self.nft.run(
            guard_commands(self.table, uids, api_port=api_port, api_open=api_open, local_deny=local_deny)
        )

    def remove(self) -> None:
        self.nft.run(remove_commands(self.table))

    def installed(self) -> Sequence[dict[str, Any]]:
        """The table's rules as libnftables lists them (empty when the table is absent)."""
        try:
            listing = self.nft.run([{"list": {"table": {"family": FAMILY, "name": self.table}}}])
        except Exception:  # noqa: BLE001 - a missing table is an error to libnftables
            return []
        return [obj["rule"] for obj in listing if "rule" in obj]


__all__ = ["ApiGuard", "LocalDeny", "guard_commands", "remove_commands", "table_name"]
