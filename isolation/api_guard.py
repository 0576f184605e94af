"""Sandboxed slots in the host's network namespace against the host's own sockets: nftables
rules on the host's output path, matching the slots' uids.

A default slot shares the host's network namespace, so its worker can connect to every local
address like any local process: the agent's ``[api] listen`` address, services on 127.0.0.1,
other slots' ports (a slot with a network of its own is already denied every host address by the
slot firewall). Each sandboxed slot runs as its own uid from ``[sandbox] uid_range``, so rules in
the output hook matching the socket's owner (``meta skuid``) and a local destination
(``fib daddr type local``: loopback and every address of the host), IPv4 and IPv6, can refuse
them:

    table inet <firewall_table>_host
      chain output (filter, output, priority 0, policy accept)
        meta skuid FIRST-LAST fib daddr type local tcp dport API  counter drop   (or accept when
                                                                   [api] slots_may_connect)
      with [isolation] local_default_deny:
        meta skuid FIRST-LAST fib daddr type local meta l4proto P th dport N  accept  (each of
                                                                   local_open_ports)
        meta skuid FIRST-LAST ct state new fib daddr type local  counter drop

Only new connections are refused (``ct state new``): a worker's replies to the agent's probes and
to host clients pass. A slot's own processes cannot reach each other over loopback either, except
on ``local_open_ports`` (unix sockets and its abstract sockets still work): this is why the
deny is opt-in. The rules belong to the agent's configuration, not to slots: no per-slot state,
(re)made at every start in one transaction (after a crash they are simply made again, from the
new configuration) and deleted at a clean stop. The agent's unix socket needs no rule: it is
root's, mode 0600.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nodeagent.isolation.firewall import FAMILY, Command, Nft

CHAIN = "output"
COMMENT = "nodeagent: slots and the host's sockets"


def table_name(firewall_table: str) -> str:
    return f"{firewall_table}_host"


def _rule(*matches: Any, verdict: str) -> list[Any]:
    return [*matches, *([{"counter": None}] if verdict == "drop" else []), {verdict: None}]


def _eq(left: Any, right: Any) -> dict[str, Any]:
    return {"match": {"op": "==", "left": left, "right": right}}


def guard_commands(
    table: str,
    uids: tuple[int, int],
    *,
    api_port: int | None,
    api_open: bool = False,
    local_deny: bool = False,
    open_ports: tuple[tuple[str, int], ...] = (),
) -> list[Command]:
    """The transaction that makes ``table`` hold exactly the rules (made first, so the delete that
    clears an older copy cannot fail on a missing table). ``api_port``: the agent's TCP port,
    dropped unless ``api_open``; ``local_deny``: every new connection to a local address dropped
    but to the API (when open) and ``open_ports`` ((protocol, port) pairs)."""
    ident = {"family": FAMILY, "name": table}
    in_table: dict[str, Any] = {"family": FAMILY, "table": table}
    slot = _eq({"meta": {"key": "skuid"}}, {"range": list(uids)})
    local = _eq({"fib": {"result": "type", "flags": ["daddr"]}}, "local")
    new = {"match": {"op": "in", "left": {"ct": {"key": "state"}}, "right": ["new"]}}
    rules: list[list[Any]] = []
    if api_port is not None:
        to_api = _eq({"payload": {"protocol": "tcp", "field": "dport"}}, api_port)
        rules.append(_rule(slot, local, to_api, verdict="accept" if api_open else "drop"))
    if local_deny:
        for protocol, port in open_ports:
            rules.append(
                _rule(
                    slot,
                    local,
                    _eq({"meta": {"key": "l4proto"}}, protocol),
                    _eq({"payload": {"protocol": "th", "field": "dport"}}, port),
                    verdict="accept",
                )
            )
        rules.append(_rule(slot, new, local, verdict="drop"))
    commands: list[Command] = [
        {"add": {"table": ident}},
        {"delete": {"table": ident}},
        {"add": {"table": ident}},
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
    """Installs and removes the rule through ``nft`` (libnftables, as the slot firewall uses)."""

    def __init__(self, nft: Nft, table: str) -> None:
        self.nft = nft
        self.table = table

    def install(
        self,
        uids: tuple[int, int],
        *,
        api_port: int | None,
        api_open: bool = False,
        local_deny: bool = False,
        open_ports: tuple[tuple[str, int], ...] = (),
    ) -> None:
        self.nft.run(
            guard_commands(
                self.table,
                uids,
                api_port=api_port,
                api_open=api_open,
                local_deny=local_deny,
                open_ports=open_ports,
            )
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


__all__ = ["ApiGuard", "guard_commands", "remove_commands", "table_name"]
