"""The slot firewall: its JSON rules and bookkeeping on plain data, then default-deny on the real kernel.

Kernel tests work in throwaway namespaces and veths with this process's own prefixes, pool and
nftables table; every one of them is removed at the end, also when a test fails, and the host's
ip_forward is left as it was found.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import json
import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from nodeagent.errors import InvalidRequest, NetworkError, Unsupported
from nodeagent.isolation.firewall import (
    CHAINS,
    EGRESS,
    HOST_PORTS,
    SET_TYPES,
    IpForwarding,
    LibNftables,
    NftError,
    NftFirewall,
    SlotElements,
    chain_rules,
    element_commands,
    ensure_commands,
    parse_table,
    ruleset_marker,
    slot_elements,
)
from nodeagent.isolation.network import (
    AllowedHostPort,
    NetworkBackend,
    Pyroute2Backend,
    SlotAccess,
    SlotNetwork,
    SlotNetworkConfig,
    plan_slot_network,
)
from nodeagent.isolation.network_ipbatch import IpBatchBackend
from nodeagent.isolation.slot_spec import SlotNetworkSpec
from tests.isolation.netns import HostListener, base36, connect_from, listen_in, python_in, send_udp_from

CONFIG = SlotNetworkConfig(cidr="10.231.0.0/16", veth_prefix="nah", nft_table="nodeagent")
NAT = SlotAccess("nat")
PORTS = SlotAccess(host_ports=(AllowedHostPort(9000), AllowedHostPort(53, "udp")))


# =========================================================================== plain data: requests


def test_access_is_sorted_so_equal_requests_compare_equal() -> None:
    one = SlotAccess("nat", (AllowedHostPort(9000), AllowedHostPort(53, "udp"), AllowedHostPort(53)))
    other = SlotAccess("nat", (AllowedHostPort(53), AllowedHostPort(53, "udp"), AllowedHostPort(9000)))
    assert one == other
    assert [str(p) for p in one.host_ports] == ["53/tcp", "53/udp", "9000/tcp"]
    assert SlotAccess.from_json(one.to_json()) == one


@pytest.mark.parametrize(
    ("build", "message"),
    [
        pytest.param(lambda: AllowedHostPort(0), "not a port number from 1 to 65535", id="port-zero"),
        pytest.param(lambda: AllowedHostPort(65536), "not a port number", id="port-too-big"),
        pytest.param(lambda: AllowedHostPort(True), "not a port number", id="port-bool"),  # type: ignore[arg-type]
        pytest.param(lambda: AllowedHostPort(80, "icmp"), "'icmp' is not one of tcp, udp", id="protocol"),  # type: ignore[arg-type]
        pytest.param(lambda: SlotAccess("open"), "egress 'open' is not one of none, nat", id="egress"),  # type: ignore[arg-type]
        pytest.param(
            lambda: SlotAccess(host_ports=(AllowedHostPort(80), AllowedHostPort(80, "tcp"))),
            "lists 80/tcp more than once",
            id="duplicate-port",
        ),
        pytest.param(
            lambda: SlotNetworkSpec(host_ports=(AllowedHostPort(9000), AllowedHostPort(9000))),
            "lists 9000/tcp more than once",
            id="spec-duplicate-port",
        ),
    ],
)
def test_bad_access_is_refused_with_what_was_wrong(build: Callable[[], object], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        build()


def test_network_record_keeps_its_access_and_reads_records_from_before_the_firewall() -> None:
    plan = plan_slot_network(CONFIG, "a", 0, access=PORTS, filtered=True)
    assert SlotNetwork.from_json(plan.to_json()) == plan
    old = plan.to_json()
    del old["access"], old["filtered"]
    assert SlotNetwork.from_json(old) == replace(plan, access=SlotAccess(), filtered=False)


# =========================================================================== plain data: the rules


def _rule_text(expr: list[dict[str, Any]]) -> str:
    return json.dumps(expr)


def test_every_drop_and_accept_acts_only_on_slot_interfaces() -> None:
    rules = chain_rules(CONFIG)
    assert set(rules) == set(CHAINS)
    for chain in ("input", "forward"):
        for rule in rules[chain]:
            # Each rule names the slot prefix as input or output interface: other traffic is untouched.
            assert '"nah*"' in _rule_text(rule), (chain, rule)
    (masquerade,) = rules["postrouting"]
    assert {"prefix": {"addr": "10.231.0.0", "len": 16}} in [m["match"]["right"] for m in masquerade[:1]]
    assert masquerade[1]["match"] == {"op": "!=", "left": {"meta": {"key": "oifname"}}, "right": "nah*"}
    assert masquerade[-1] == {"masquerade": None}


def test_input_accepts_replies_then_host_ports_then_drops() -> None:
    first, ports, last = chain_rules(CONFIG)["input"]
    assert {
        "match": {"op": "in", "left": {"ct": {"key": "state"}}, "right": ["established", "related"]}
    } in first
    assert first[-1] == {"accept": None}
    assert '"@host_ports"' in _rule_text(ports)
    assert {"match": {"op": "==", "left": {"meta": {"key": "nfproto"}}, "right": "ipv4"}} in ports
    assert last[-1] == {"drop": None}
    assert len(last) == 3  # prefix, counter, drop: every other protocol and family included


def test_forward_drops_slot_to_slot_before_anything_can_accept_it() -> None:
    rules = chain_rules(CONFIG)["forward"]
    slot_to_slot = rules[0]
    assert [e["match"]["left"]["meta"]["key"] for e in slot_to_slot[:2]] == ["iifname", "oifname"]
    assert slot_to_slot[-1] == {"drop": None}
    assert '"@egress"' in _rule_text(rules[-2])
    assert '"169.254.0.0"' in _rule_text(rules[-3])  # link-local is dropped before egress can accept
    assert rules[-1][-1] == {"drop": None}


def test_marker_names_the_rules_it_stands_for() -> None:
    assert ruleset_marker(CONFIG) == ruleset_marker(replace(CONFIG, nft_table="other"))
    assert ruleset_marker(CONFIG) != ruleset_marker(replace(CONFIG, veth_prefix="nax"))
    assert ruleset_marker(CONFIG) != ruleset_marker(replace(CONFIG, cidr="10.232.0.0/16"))


def test_ensure_replaces_rules_but_keeps_sets_unless_the_layout_changed() -> None:
    commands = ensure_commands(CONFIG, rebuild=False)
    verbs = [(next(iter(c)), next(iter(next(iter(c.values()))))) for c in commands]
    assert verbs[0] == ("add", "table")
    assert ("delete", "table") not in verbs
    assert verbs.count(("add", "set")) == 2
    assert verbs.count(("flush", "chain")) == 3
    # Rules only after every chain is flushed: an old rule never survives next to a new one.
    assert verbs.index(("add", "rule")) > max(i for i, v in enumerate(verbs) if v == ("flush", "chain"))
    marked = [
        c["add"]["rule"] for c in commands if "rule" in c.get("add", {}) and "comment" in c["add"]["rule"]
    ]
    assert sorted(r["chain"] for r in marked) == sorted(CHAINS)
    assert ensure_commands(CONFIG, rebuild=True)[0] == {
        "delete": {"table": {"family": "inet", "name": "nodeagent"}}
    }


def test_slot_elements_grant_exactly_the_access_asked_for() -> None:
    both = SlotAccess("nat", PORTS.host_ports)
    assert slot_elements("nahx", "10.231.0.2", SlotAccess()) == SlotElements()
    assert not slot_elements("nahx", "10.231.0.2", SlotAccess())
    elements = slot_elements("nahx", "10.231.0.2", both)
    assert elements.host_ports == {("nahx", "tcp", 9000), ("nahx", "udp", 53)}
    assert elements.egress == {("nahx", "10.231.0.2")}
    (ports, egress) = element_commands("add", CONFIG, elements)
    assert ports["add"]["element"]["name"] == HOST_PORTS
    assert ports["add"]["element"]["elem"] == [
        {"concat": ["nahx", "tcp", 9000]},
        {"concat": ["nahx", "udp", 53]},
    ]
    assert egress["add"]["element"]["elem"] == [{"concat": ["nahx", "10.231.0.2"]}]
    assert element_commands("delete", CONFIG, SlotElements()) == []


def _listing(
    config: SlotNetworkConfig = CONFIG,
    host_ports: Sequence[Any] = (),
    egress: Sequence[Any] = (),
    marked: Sequence[str] = tuple(CHAINS),
    set_types: dict[str, Sequence[str]] | None = None,
) -> list[dict[str, Any]]:
    """What ``list table`` prints for the agent's table (the shape libnftables 1.0.6 gives)."""
    types = {**SET_TYPES, **(set_types or {})}
    objects: list[dict[str, Any]] = [{"table": {"family": "inet", "name": config.nft_table, "handle": 1}}]
    for name, elems in ((HOST_PORTS, host_ports), (EGRESS, egress)):
        body: dict[str, Any] = {
            "family": "inet",
            "name": name,
            "table": config.nft_table,
            "type": list(types[name]),
        }
        if elems:
            body["elem"] = list(elems)
        objects.append({"set": body})
    for name, (kind, hook, prio) in CHAINS.items():
        objects.append(
            {
                "chain": {
                    "family": "inet",
                    "table": config.nft_table,
                    "name": name,
                    "type": kind,
                    "hook": hook,
                    "prio": prio,
                    "policy": "accept",
                }
            }
        )
        rule: dict[str, Any] = {"family": "inet", "table": config.nft_table, "chain": name, "expr": []}
        if name in marked:
            rule["comment"] = ruleset_marker(config)
        objects.append({"rule": rule})
    return objects


def test_parse_table_reads_elements_and_whether_the_rules_are_current() -> None:
    state = parse_table(
        CONFIG,
        _listing(
            host_ports=[
                {"concat": ["naha", "tcp", 9000]},
                {"elem": {"val": {"concat": ["nahb", 17, 53]}, "timeout": 5}},
            ],
            egress=[{"concat": ["naha", "10.231.0.2"]}],
        ),
    )
    assert (state.exists, state.layout_ok, state.current) == (True, True, True)
    assert state.elements.host_ports == {("naha", "tcp", 9000), ("nahb", "udp", 53)}
    assert state.elements.egress == {("naha", "10.231.0.2")}
    assert state.elements.ifnames() == {"naha", "nahb"}
    assert state.elements.of(["nahb"]) == SlotElements(frozenset({("nahb", "udp", 53)}))


@pytest.mark.parametrize(
    ("listing", "layout_ok", "current"),
    [
        pytest.param([], False, False, id="no-table"),
        pytest.param(_listing(marked=("input", "forward")), True, False, id="a-chain-flushed"),
        pytest.param(_listing(config=replace(CONFIG, veth_prefix="nax")), True, False, id="other-rules"),
        pytest.param(_listing(set_types={EGRESS: ["ifname"]}), False, False, id="old-set-type"),
    ],
)
def test_parse_table_tells_what_to_repair(
    listing: list[dict[str, Any]], layout_ok: bool, current: bool
) -> None:
    state = parse_table(CONFIG, listing)
    assert (state.exists, state.layout_ok, state.current) == (bool(listing), layout_ok, current)


def test_library_messages_lose_their_location_prefix() -> None:
    from nodeagent.isolation.firewall import _error_text

    raw = b"internal:0:0-0: Error: Could not process rule: No such file or directory\n\n"
    assert _error_text(raw) == "Could not process rule: No such file or directory"


def test_a_kernel_without_nfnetlink_is_unsupported_rather_than_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    # libnftables 1.0.6 would exit() the whole process on such a kernel (as in the cgroup v2 VM).
    import nodeagent.isolation.firewall as firewall_module

    def refuse(*args: object) -> None:
        raise OSError(errno.EPROTONOSUPPORT, "Protocol not supported")

    monkeypatch.setattr(firewall_module.socket, "socket", refuse)
    with pytest.raises(Unsupported, match=r"no netfilter netlink socket .* CONFIG_NETFILTER_NETLINK"):
        LibNftables("libnftables-never-loaded.so.0").load()


def test_a_missing_library_says_what_to_install() -> None:
    with pytest.raises(
        Unsupported, match=r"libnftables-missing\.so\.0 cannot be loaded .* apt-get install nftables"
    ):
        LibNftables("libnftables-missing.so.0").load()


# =========================================================================== plain data: the firewall's steps


@dataclass
class FakeNft:
    """libnftables as far as the firewall sees it: a table (listing) and the commands it was sent."""

    listing: list[dict[str, Any]] | None = None
    sent: list[list[dict[str, Any]]] = field(default_factory=list)
    listed: list[str] = field(default_factory=list)
    fail: str | None = None

    def run(self, commands: Sequence[dict[str, Any]], *, dry_run: bool = False) -> list[dict[str, Any]]:
        if commands and "list" in commands[0]:
            what = commands[0]["list"]
            self.listed.append(next(iter(what)))
            if "tables" in what:
                return [] if self.listing is None else [self.listing[0]]
            if self.listing is None:
                raise NftError("No such file or directory")
            if "set" in what:
                return [o for o in self.listing if o.get("set", {}).get("name") == what["set"]["name"]]
            return self.listing
        if self.fail:
            raise NftError(self.fail)
        creates = any("table" in c.get("add", {}) for c in commands)
        if self.listing is None and not creates:
            raise NftError("Could not process rule: No such file or directory")
        self.sent.append(list(commands))
        if creates:
            self.listing = _listing()
        return []


def _forwarding(tmp_path: Path, value: str = "0") -> IpForwarding:
    sysctl = tmp_path / "ip_forward"
    sysctl.write_text(value + "\n")
    return IpForwarding(tmp_path / "registry", sysctl)


def _verbs(commands: list[dict[str, Any]]) -> list[str]:
    return [f"{verb} {next(iter(body))}" for c in commands for verb, body in c.items()]


def test_first_slot_creates_the_table_and_its_elements_in_one_transaction(tmp_path: Path) -> None:
    nft = FakeNft()
    firewall = NftFirewall(CONFIG, nft, _forwarding(tmp_path))
    plan = plan_slot_network(CONFIG, "a", 0, access=SlotAccess("nat", PORTS.host_ports), filtered=True)
    firewall.apply(plan)
    (transaction,) = nft.sent
    assert _verbs(transaction)[0] == "add table"
    assert _verbs(transaction)[-2:] == ["add element", "add element"]
    assert firewall.forwarding.value() == "1"
    assert firewall.forwarding.holders() == ("inet-nodeagent",)


def _elements(commands: list[dict[str, Any]], verb: str) -> set[tuple[str, tuple[Any, ...]]]:
    return {
        (c[verb]["element"]["name"], tuple(e["concat"]))
        for c in commands
        if verb in c
        for e in c[verb]["element"]["elem"]
    }


def test_a_current_table_gets_only_the_slots_difference(tmp_path: Path) -> None:
    plan = plan_slot_network(
        CONFIG, "a", 0, access=SlotAccess(host_ports=(AllowedHostPort(9001),)), filtered=True
    )
    ifname, address = plan.host_ifname, str(plan.slot_address)
    nft = FakeNft(
        _listing(host_ports=[{"concat": [ifname, "tcp", 9000]}, {"concat": ["nahother", "tcp", 9000]}])
    )
    firewall = NftFirewall(CONFIG, nft, _forwarding(tmp_path))
    firewall.apply(plan)
    (transaction,) = nft.sent
    assert "add table" not in _verbs(transaction)
    # Deleted whether or not they are there (each added first): the old port, and the egress the
    # slot does not ask for. Then the new port. Nothing of the other slot.
    assert _elements(transaction, "delete") == {
        (HOST_PORTS, (ifname, "tcp", 9000)),
        (EGRESS, (ifname, address)),
    }
    assert _elements(transaction, "add") - _elements(transaction, "delete") == {
        (HOST_PORTS, (ifname, "tcp", 9001))
    }
    nft.sent.clear()
    firewall.apply(plan)  # already right: only the egress element is named again
    (again,) = nft.sent
    assert _elements(again, "delete") == {(EGRESS, (ifname, address))}
    assert nft.listed == ["table"]  # the kernel was read once; after that the firewall knows


def test_a_table_removed_behind_its_back_is_rebuilt_at_the_next_setup(tmp_path: Path) -> None:
    nft = FakeNft(_listing())
    firewall = NftFirewall(CONFIG, nft, _forwarding(tmp_path))
    firewall.apply(plan_slot_network(CONFIG, "a", 0, filtered=True))
    firewall.remove(plan_slot_network(CONFIG, "a", 0).host_ifname)
    assert nft.listed == ["table"]
    nft.listing = None  # nft flush ruleset
    firewall.apply(plan_slot_network(CONFIG, "b", 1, filtered=True))  # a slot without opt-ins, even
    assert nft.listed[1:] == ["table", "tables"]
    assert _verbs(nft.sent[-1])[0] == "add table"


def test_a_flushed_chain_is_restored_without_losing_other_slots(tmp_path: Path) -> None:
    nft = FakeNft(_listing(egress=[{"concat": ["nahother", "10.231.0.6"]}], marked=("input",)))
    firewall = NftFirewall(CONFIG, nft, _forwarding(tmp_path))
    firewall.apply(plan_slot_network(CONFIG, "a", 0, filtered=True))
    (transaction,) = nft.sent
    assert "delete table" not in _verbs(transaction)
    assert _verbs(transaction).count("flush chain") == 3
    # The other slot's egress element survived, so forwarding stays held for it.
    assert firewall.forwarding.holders() == ("inet-nodeagent",)


def test_an_old_layout_is_rebuilt_and_denies_until_slots_are_applied_again(tmp_path: Path) -> None:
    nft = FakeNft(_listing(set_types={EGRESS: ["ifname"]}, egress=[{"concat": ["nahother"]}]))
    firewall = NftFirewall(CONFIG, nft, _forwarding(tmp_path))
    firewall.apply(plan_slot_network(CONFIG, "a", 0, filtered=True))
    assert _verbs(nft.sent[0])[:2] == ["delete table", "add table"]
    assert firewall.forwarding.holders() == ()


def test_remove_revokes_the_slots_elements_and_lets_forwarding_go(tmp_path: Path) -> None:
    nft = FakeNft(
        _listing(
            host_ports=[{"concat": ["naha", "tcp", 9000]}, {"concat": ["nahb", "tcp", 9000]}],
            egress=[{"concat": ["naha", "10.231.0.2"]}],
        )
    )
    forwarding = _forwarding(tmp_path)
    forwarding.hold("inet-nodeagent")
    firewall = NftFirewall(CONFIG, nft, forwarding)
    assert firewall.list_owned() == ("naha", "nahb")
    firewall.remove("naha")
    (transaction,) = nft.sent
    assert _elements(transaction, "delete") == {
        (HOST_PORTS, ("naha", "tcp", 9000)),
        (EGRESS, ("naha", "10.231.0.2")),
    }
    assert (forwarding.holders(), forwarding.value()) == ((), "0")
    firewall.remove("naha")
    assert len(nft.sent) == 1  # known to be gone: nothing sent


def test_remove_of_a_slot_without_elements_sends_nothing(tmp_path: Path) -> None:
    nft = FakeNft(_listing(host_ports=[{"concat": ["nahb", "tcp", 9000]}]))
    NftFirewall(CONFIG, nft, _forwarding(tmp_path)).remove("naha")
    NftFirewall(CONFIG, FakeNft(None), _forwarding(tmp_path)).remove("naha")  # no table at all
    assert nft.sent == []


def test_refusals_name_the_table_and_the_slot(tmp_path: Path) -> None:
    firewall = NftFirewall(
        CONFIG, FakeNft(fail="Could not process rule: No buffer space available"), _forwarding(tmp_path)
    )
    with pytest.raises(
        NftError, match=r"set up the firewall of slot a \(nah.*\) in table inet nodeagent: Could not"
    ):
        firewall.apply(plan_slot_network(CONFIG, "a", 0, filtered=True))


def test_egress_that_cannot_turn_forwarding_on_is_an_error(tmp_path: Path) -> None:
    forwarding = IpForwarding(tmp_path / "registry", tmp_path / "no" / "ip_forward")
    firewall = NftFirewall(CONFIG, FakeNft(), forwarding)
    with pytest.raises(NetworkError, match="slot a asks for egress, but IPv4 forwarding cannot be turned on"):
        firewall.apply(plan_slot_network(CONFIG, "a", 0, access=NAT, filtered=True))


def test_probe_reports_a_kernel_refusal_with_a_hint(tmp_path: Path) -> None:
    firewall = NftFirewall(
        CONFIG, FakeNft(fail="Could not process rule: Operation not permitted"), _forwarding(tmp_path)
    )
    problem = firewall.problem()
    assert problem is not None
    assert "refused the slot firewall's rules in a dry run" in problem
    assert "run the agent as root" in problem


# =========================================================================== plain data: ip_forward


def test_forwarding_is_restored_when_the_last_holder_lets_go(tmp_path: Path) -> None:
    forwarding = _forwarding(tmp_path, "0")
    forwarding.hold("a")
    forwarding.hold("b")
    assert forwarding.value() == "1"
    forwarding.release("a")
    assert forwarding.value() == "1"
    forwarding.release("b")
    forwarding.release("b")  # idempotent
    assert (forwarding.value(), forwarding.holders()) == ("0", ())
    assert not (tmp_path / "registry" / "before").exists()


def test_forwarding_that_was_on_stays_on(tmp_path: Path) -> None:
    forwarding = _forwarding(tmp_path, "1")
    forwarding.hold("a")
    forwarding.release("a")
    assert forwarding.value() == "1"


def test_a_record_left_by_a_crash_is_honoured_by_the_next_release(tmp_path: Path) -> None:
    forwarding = _forwarding(tmp_path, "0")
    forwarding.hold("a")
    crashed = IpForwarding(forwarding.registry, forwarding.sysctl)  # a new process, same files
    assert crashed.holders() == ("a",)
    crashed.release("a")
    assert forwarding.value() == "0"


def test_forwarding_turned_off_meanwhile_is_turned_on_again_for_a_holder(tmp_path: Path) -> None:
    forwarding = _forwarding(tmp_path, "0")
    forwarding.hold("a")
    forwarding.sysctl.write_text("0\n")
    forwarding.hold("a")
    assert forwarding.value() == "1"
    forwarding.release("a")
    assert forwarding.value() == "0"


def test_holder_names_cannot_leave_the_registry(tmp_path: Path) -> None:
    with pytest.raises(NetworkError, match="not a safe file name"):
        _forwarding(tmp_path).hold("../x")


# =========================================================================== the real kernel

PID = os.getpid()
TAG = base36(PID)
WAN_NET = 18 + PID % 2  # 198.18.0.0/15 is for benchmark networks: nothing real lives there
WAN_SUB = (PID // 2) % 256


def _kernel_config(number: int = 0) -> SlotNetworkConfig:
    tag = f"naf{TAG}{number}"
    return SlotNetworkConfig(
        cidr=f"100.{64 + PID % 64}.0.0/16",
        netns_prefix=f"natest-{tag}-",
        veth_prefix=tag,
        rule_priority=3234,
        nft_table=f"natest-fw-{TAG}-{number}",
    )


def _tables() -> list[str]:
    """The host's nftables tables, read with nft (not through the code under test)."""
    out = subprocess.run(["nft", "-j", "list", "tables"], capture_output=True, text=True, check=True).stdout
    return [o["table"]["name"] for o in json.loads(out)["nftables"] if "table" in o]


def _table_text(config: SlotNetworkConfig) -> str:
    done = subprocess.run(
        ["nft", "list", "table", "inet", config.nft_table], capture_output=True, text=True, check=False
    )
    return done.stdout


def _forwarding_untouched(before: str) -> bool:
    forwarding = IpForwarding()
    # Another process (a concurrent test run, an agent) may hold forwarding on meanwhile: then the
    # value is theirs to decide, and only our own holder must be gone.
    return bool(forwarding.holders()) or forwarding.value() == before


@dataclass
class Kit:
    backend: NetworkBackend
    firewall: NftFirewall
    config: SlotNetworkConfig

    def drop_policy_rules(self, *nets: SlotNetwork) -> None:
        """Delete the slots' policy-routing rules, so only the firewall stands in the way."""
        for net in nets:
            subprocess.run(
                ["ip", "rule", "del", "iif", net.host_ifname, "priority", str(self.config.rule_priority)],
                check=True,
            )


@contextlib.contextmanager
def kit_for(backend_type: Callable[..., NetworkBackend], number: int = 0) -> Iterator[Kit]:
    """A backend with a firewall on this process's own table; everything removed on the way out."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    config = _kernel_config(number)
    firewall = NftFirewall(config)
    problem = firewall.problem()
    if problem is not None:
        pytest.skip(f"no nftables here: {problem}")
    before = IpForwarding().value()
    backend = backend_type(config, firewall)
    try:
        yield Kit(backend, firewall, config)
    finally:
        backend.remove_owned(backend.list_owned())
        firewall.remove_all()
        assert backend.list_owned().empty
        assert config.nft_table not in _tables()
        assert firewall.holder not in IpForwarding().holders()
        assert _forwarding_untouched(before)


BACKENDS = [Pyroute2Backend, IpBatchBackend]


@pytest.fixture(params=BACKENDS, ids=lambda b: b.__name__)
def each_kit(request: pytest.FixtureRequest) -> Iterator[Kit]:
    with kit_for(request.param) as kit:
        yield kit


@pytest.fixture
def kit() -> Iterator[Kit]:
    with kit_for(IpBatchBackend) as kit:
        yield kit


def _host_addresses(config: SlotNetworkConfig) -> list[str]:
    """The host's own global IPv4 addresses outside the slot pool (eth0's, say)."""
    out = subprocess.run(
        ["ip", "-j", "-4", "addr", "show", "scope", "global"], capture_output=True, text=True, check=True
    )
    found = [a["local"] for link in json.loads(out.stdout) for a in link.get("addr_info", ())]
    return [a for a in found if ipaddress.IPv4Address(a) not in config.pool]


def _received(listener: HostListener, count: int, timeout: float = 2.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if len(listener.received) >= count:
            return True
        time.sleep(0.02)
    return False


@pytest.mark.root
def test_usable_on_this_host() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    assert NftFirewall(_kernel_config()).problem() is None


@pytest.mark.root
def test_slot_reaches_no_host_address(each_kit: Kit) -> None:
    a = each_kit.backend.setup("a", 0)
    b = each_kit.backend.setup("b", 1)
    assert a.filtered
    each_kit.drop_policy_rules(a, b)
    with HostListener() as listener:  # 0.0.0.0: every address of the host
        targets = [a.host_address, b.host_address, *_host_addresses(each_kit.config)]
        for target in targets:
            assert connect_from(a, target, listener.port, timeout=0.7).startswith("failed"), target
        assert listener.received == []
        # Control: without the table the same connections get through, so the drops were its.
        each_kit.firewall.remove_all()
        assert connect_from(a, a.host_address, listener.port) == "connected"


@pytest.mark.root
def test_loopback_through_the_gateway_is_dropped(kit: Kit) -> None:
    # A host with route_localnet=1 (kube-proxy sets it) accepts 127.0.0.0/8 from other interfaces;
    # the slot here routes 127.0.0.2 to its gateway. Both changes die with the slot's netns and veth.
    a = kit.backend.setup("lo", 0)
    ns = a.netns
    for args in (
        ["rule", "add", "pref", "100", "lookup", "local"],
        ["rule", "del", "pref", "0"],
        ["rule", "add", "pref", "10", "to", "127.0.0.2", "lookup", "100"],
        ["route", "add", "127.0.0.2/32", "via", str(a.host_address), "dev", a.slot_ifname, "table", "100"],
    ):
        subprocess.run(["ip", "-n", ns, *args], check=True)
    python_in(a, f"open('/proc/sys/net/ipv4/conf/{a.slot_ifname}/route_localnet', 'w').write('1')")
    Path(f"/proc/sys/net/ipv4/conf/{a.host_ifname}/route_localnet").write_text("1")
    with HostListener("127.0.0.2") as listener:
        assert connect_from(a, "127.0.0.2", listener.port, timeout=0.7).startswith("failed")
        kit.firewall.remove_all()
        assert connect_from(a, "127.0.0.2", listener.port) == "connected"  # control: the path exists


def _link_local(ifname: str) -> str:
    """The interface's IPv6 link-local address, once duplicate address detection let it be used."""
    for _ in range(100):
        out = subprocess.run(
            ["ip", "-j", "-6", "addr", "show", "dev", ifname], capture_output=True, text=True, check=True
        )
        found = [
            a
            for link in json.loads(out.stdout)
            for a in link.get("addr_info", ())
            if a.get("scope") == "link"
        ]
        if found and not found[0].get("tentative"):
            return str(found[0]["local"])
        time.sleep(0.05)
    pytest.skip(f"no usable IPv6 link-local address on {ifname} (IPv6 disabled here?)")


def _connect6_from(net: SlotNetwork, address: str, port: int, timeout: float) -> str:
    code = (
        "import errno, socket, time\n"
        "for _ in range(100):\n"
        f"    s = socket.socket(socket.AF_INET6); s.settimeout({timeout})\n"
        "    try:\n"
        f"        s.connect(({address!r}, {port}, 0, socket.if_nametoindex({net.slot_ifname!r})))\n"
        "        print('connected'); break\n"
        "    except OSError as err:\n"
        "        if err.errno == errno.EADDRNOTAVAIL:  # the slot's own address is still tentative\n"
        "            time.sleep(0.05); continue\n"
        "        print('failed', err); break\n"
    )
    return python_in(net, code)


@pytest.mark.root
def test_ipv6_link_local_reaches_nothing_on_the_host(kit: Kit) -> None:
    # Every veth gets an IPv6 link-local address, through which a slot would reach host services
    # listening on [::]; the opt-ins are IPv4 only, so even an allowed port stays closed over IPv6.
    server = socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True)
    try:
        port = server.getsockname()[1]
        a = kit.backend.setup("six", 0, access=SlotAccess(host_ports=(AllowedHostPort(port),)))
        address = _link_local(a.host_ifname)
        assert _connect6_from(a, address, port, timeout=0.7).startswith("failed")
        assert connect_from(a, a.host_address, port) == "connected"  # the same port over IPv4
        kit.firewall.remove_all()
        assert _connect6_from(a, address, port, timeout=1.5) == "connected"  # control: the path exists
    finally:
        server.close()


@pytest.fixture
def host_forwards() -> Iterator[None]:
    """ip_forward on for the test, through the shared registry so it is restored afterwards (also
    when the test fails) and never turned off under another holder."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    forwarding = IpForwarding()
    holder = f"test-{PID}"
    before = forwarding.value()
    forwarding.hold(holder)
    try:
        yield
    finally:
        forwarding.release(holder)
        assert _forwarding_untouched(before)


@pytest.mark.root
def test_slot_to_slot_is_dropped_even_when_the_host_forwards(
    kit: Kit, host_forwards: None, processes: list[subprocess.Popen[str]]
) -> None:
    a = kit.backend.setup("a", 0)
    b = kit.backend.setup("b", 1, access=NAT)  # egress opens the way out, never to another slot
    kit.drop_policy_rules(a, b)
    port, _ = listen_in(a, processes)
    assert Path("/proc/sys/net/ipv4/ip_forward").read_text().strip() == "1"
    assert connect_from(b, a.slot_address, port, timeout=0.7).startswith("failed")
    kit.firewall.remove_all()
    assert connect_from(b, a.slot_address, port) == "connected"  # control: forwarding alone lets it


@pytest.mark.root
def test_allowed_host_ports_and_nothing_else(kit: Kit) -> None:
    with HostListener() as tcp, HostListener(kind=socket.SOCK_DGRAM) as udp, HostListener() as other:
        access = SlotAccess(host_ports=(AllowedHostPort(tcp.port), AllowedHostPort(udp.port, "udp")))
        a = kit.backend.setup("a", 0, access=access)
        b = kit.backend.setup("b", 1)
        assert connect_from(a, a.host_address, tcp.port) == "connected"
        assert connect_from(a, a.host_address, other.port, timeout=0.7).startswith("failed")
        send_udp_from(a, a.host_address, udp.port, "from a")
        assert _received(udp, 1)
        # The opt-in belongs to slot a: slot b reaches neither port.
        assert connect_from(b, b.host_address, tcp.port, timeout=0.7).startswith("failed")
        send_udp_from(b, b.host_address, udp.port, "from b")
        assert not _received(udp, 2, timeout=1.0)
        assert udp.received == [b"from a"]


@pytest.mark.root
def test_agent_probe_reaches_a_worker_in_a_slot_that_may_reach_nothing(
    kit: Kit, processes: list[subprocess.Popen[str]]
) -> None:
    a = kit.backend.setup("probe", 0)
    port, _ = listen_in(a, processes)
    with socket.create_connection((str(a.slot_address), port), timeout=3) as conn:
        assert conn.recv(2) == b"ok"  # data both ways: the slot's replies pass as established


@pytest.fixture
def internet(processes: list[subprocess.Popen[str]]) -> Iterator[tuple[str, int, subprocess.Popen[str]]]:
    """A namespace beyond the host, routed through it: a far address with a TCP server, and no route
    back to the slot pool (only masqueraded traffic can get an answer)."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    netns, host_if, far_if = f"natest-wan-{TAG}", f"nw{TAG}h", f"nw{TAG}f"
    link = f"198.{WAN_NET}.{WAN_SUB}"
    far = f"198.{WAN_NET}.{WAN_SUB}.130"
    path = f"/run/netns/{netns}"
    try:
        for argv in (
            ["ip", "netns", "add", netns],
            ["ip", "link", "add", host_if, "type", "veth", "peer", "name", far_if, "netns", netns],
            ["ip", "addr", "add", f"{link}.1/30", "dev", host_if],
            ["ip", "link", "set", host_if, "up"],
            ["ip", "route", "add", f"{far}/32", "via", f"{link}.2", "dev", host_if],
            ["ip", "-n", netns, "addr", "add", f"{link}.2/30", "dev", far_if],
            ["ip", "-n", netns, "addr", "add", f"{far}/32", "dev", "lo"],
            ["ip", "-n", netns, "link", "set", far_if, "up"],
            ["ip", "-n", netns, "link", "set", "lo", "up"],
        ):
            subprocess.run(argv, check=True, capture_output=True)
        port, server = listen_in(path, processes, far)
        yield far, port, server
    finally:
        # The route goes with the veth, the veth with the netns.
        subprocess.run(["ip", "link", "del", host_if], check=False, capture_output=True)
        subprocess.run(["ip", "netns", "del", netns], check=False, capture_output=True)


@pytest.mark.root
def test_egress_nat_reaches_beyond_the_host_and_no_other_slot(
    kit: Kit, internet: tuple[str, int, subprocess.Popen[str]], processes: list[subprocess.Popen[str]]
) -> None:
    far, port, server = internet
    out = kit.backend.setup("out", 0, access=NAT)
    shut = kit.backend.setup("shut", 1)
    kit.drop_policy_rules(out, shut)
    assert IpForwarding().value() == "1"
    assert kit.firewall.holder in IpForwarding().holders()
    assert connect_from(out, far, port) == "connected"
    assert server.stdout is not None
    # The far side saw the host's address: the slot's own would have no route back.
    assert server.stdout.readline().strip() == f"198.{WAN_NET}.{WAN_SUB}.1"
    assert connect_from(shut, far, port, timeout=0.7).startswith("failed")
    shut_port, _ = listen_in(shut, processes)
    assert connect_from(out, shut.slot_address, shut_port, timeout=0.7).startswith("failed")
    kit.backend.teardown("out")
    # The last egress slot is gone: this table no longer holds forwarding on.
    assert kit.firewall.holder not in IpForwarding().holders()


@pytest.mark.root
def test_teardown_leaves_no_element(each_kit: Kit) -> None:
    both = SlotAccess("nat", (AllowedHostPort(9000), AllowedHostPort(53, "udp")))
    kept = each_kit.backend.setup("kept", 0, access=PORTS)
    gone = each_kit.backend.setup("gone", 1, access=both)
    assert each_kit.firewall.list_owned() == tuple(sorted((kept.host_ifname, gone.host_ifname)))
    assert gone.host_ifname in _table_text(each_kit.config)
    each_kit.backend.teardown("gone")
    each_kit.backend.teardown("gone")
    assert gone.host_ifname not in _table_text(each_kit.config)
    assert each_kit.firewall.list_owned() == (kept.host_ifname,)
    assert each_kit.firewall.holder not in IpForwarding().holders()


@pytest.mark.root
@pytest.mark.parametrize("backend_type", BACKENDS, ids=lambda b: b.__name__)
def test_failed_setup_leaves_no_firewall_state(backend_type: Callable[..., NetworkBackend]) -> None:
    with kit_for(backend_type, number=1) as kit:
        # "lo" already exists in every netns, so creating the slot's veth under that name fails
        # after the firewall's elements were added: they must go with the rest.
        broken = replace(kit.config, slot_ifname="lo")
        backend = backend_type(broken, kit.firewall)
        with pytest.raises(NetworkError, match="exists"):
            backend.setup("broken", 0, access=SlotAccess("nat", (AllowedHostPort(9000),)))
        assert kit.firewall.list_owned() == ()
        assert kit.firewall.holder not in IpForwarding().holders()


@pytest.mark.root
def test_orphans_after_a_crash_are_found_and_removed(kit: Kit) -> None:
    a = kit.backend.setup("a", 0, access=SlotAccess("nat", (AllowedHostPort(9000),)))
    b = kit.backend.setup("b", 1, access=PORTS)
    # A new agent process: nothing remembered, everything read back from the kernel.
    firewall = NftFirewall(kit.config)
    backend = IpBatchBackend(kit.config, firewall)
    owned = backend.list_owned()
    assert owned.firewall_ifnames == tuple(sorted((a.host_ifname, b.host_ifname)))
    backend.remove_owned(owned)
    assert backend.list_owned().empty
    assert a.host_ifname not in _table_text(kit.config)
    assert firewall.holder not in IpForwarding().holders()


@pytest.mark.root
def test_a_removed_table_comes_back_with_the_next_slot(
    kit: Kit, processes: list[subprocess.Popen[str]]
) -> None:
    a = kit.backend.setup("a", 0)
    # What `nft flush ruleset` would do to it, behind the firewall's back (the table is the test's).
    subprocess.run(["nft", "delete", "table", "inet", kit.config.nft_table], check=True)
    kit.backend.setup("b", 1)
    assert ruleset_marker(kit.config) in _table_text(kit.config)
    with HostListener() as listener:
        assert connect_from(a, a.host_address, listener.port, timeout=0.7).startswith("failed")
