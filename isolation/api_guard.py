"""Keep sandboxed workers off the agent's TCP API: one nftables rule on the host's output path.

A default slot shares the host's network namespace, so its worker can connect to the agent's
``[api] listen`` address like any local process (a slot with a network of its own is already
denied every host address by the slot firewall). The token guards the calls, but not the
connections: a slot could hold thousands of them. Each sandboxed slot runs as its own uid from
``[sandbox] uid_range``, so one rule in the output hook, matching the socket's owner
(``meta skuid``), drops their packets to the API's port on any local address, IPv4 and IPv6:

    table inet <firewall_table>_api
      chain output (filter, output, priority 0, policy accept)
        meta skuid FIRST-LAST  fib daddr type local  tcp dport PORT  counter drop

It lives in a table of its own (``<firewall_table>_api``), not in the slot firewall's, because it
belongs to the agent's configuration rather than to slots: it is (re)made at every start in one
transaction (after a crash it is simply made again, with the port of the new configuration) and
deleted at a clean stop. The agent's unix socket needs no rule: it is root's, mode 0600.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nodeagent.isolation.firewall import FAMILY, Command, Nft

CHAIN = "output"


def table_name(firewall_table: str) -> str:
    return f"{firewall_table}_api"


def guard_commands(table: str, uids: tuple[int, int], port: int) -> list[Command]:
    """The transaction that makes ``table`` hold exactly the rule (made first, so the delete that
    clears an older copy cannot fail on a missing table)."""
    ident = {"family": FAMILY, "name": table}
    in_table: dict[str, Any] = {"family": FAMILY, "table": table}
    rule = [
        {"match": {"op": "==", "left": {"meta": {"key": "skuid"}}, "right": {"range": list(uids)}}},
        {"match": {"op": "==", "left": {"fib": {"result": "type", "flags": ["daddr"]}}, "right": "local"}},
        {"match": {"op": "==", "left": {"payload": {"protocol": "tcp", "field": "dport"}}, "right": port}},
        {"counter": None},
        {"drop": None},
    ]
    return [
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
        {
            "add": {
                "rule": {**in_table, "chain": CHAIN, "expr": rule, "comment": "nodeagent: slots off the API"}
            }
        },
    ]


def remove_commands(table: str) -> list[Command]:
    ident = {"family": FAMILY, "name": table}
    return [{"add": {"table": ident}}, {"delete": {"table": ident}}]


class ApiGuard:
    """Installs and removes the rule through ``nft`` (libnftables, as the slot firewall uses)."""

    def __init__(self, nft: Nft, table: str) -> None:
        self.nft = nft
        self.table = table

    def install(self, uids: tuple[int, int], port: int) -> None:
        self.nft.run(guard_commands(self.table, uids, port))

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
