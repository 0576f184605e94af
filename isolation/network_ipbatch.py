"""The ``ip -batch`` network backend: the same per-slot objects as :class:`Pyroute2Backend`, made
through iproute2 (one ``ip -batch`` on the host, one inside the netns, one ``tc`` per shaped
direction). Chosen by :func:`nodeagent.isolation.network.default_backend` where ``ip`` and ``tc``
exist: it sets a slot up ~2 ms quicker than pyroute2 (bench/network.py). Removal and listing are
netlink calls shared with the pyroute2 backend.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
from dataclasses import dataclass, field

from nodeagent.errors import ConfigError, NetworkError
from nodeagent.isolation.network import (
    NET_CLASS,
    NETNS_RUN_DIR,
    OwnedNetwork,
    Pyroute2Backend,
    SlotAccess,
    SlotFirewall,
    SlotNetwork,
    SlotNetworkConfig,
    TbfParams,
    _firewall_owned,
    _network_error,
    _owned_netns,
    _plan,
    tbf_params,
)
from nodeagent.kernelfs import Sysfs


@dataclass
class IpBatchBackend:
    """The same objects through iproute2: ``ip -batch`` on the host, then inside the netns.

    Two processes per slot (one more per shaped direction), no per-object fork. Removal and listing are
    shared with :class:`Pyroute2Backend`: they are netlink calls in the host netns, no forks.
    """

    config: SlotNetworkConfig = field(default_factory=SlotNetworkConfig)
    firewall: SlotFirewall | None = None
    ip: str = "ip"
    tc: str = "tc"

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
        if self.config.netns_dir != NETNS_RUN_DIR:
            raise ConfigError(f"ip -batch can only place netns in {NETNS_RUN_DIR}; use Pyroute2Backend")
        self._netlink_twin()._prepare(plan)
        try:
            if self.firewall is not None:
                self.firewall.apply(plan)
            self._run([self.ip, "-batch", "-"], ip_host_batch(self.config, plan), plan)
            self._run([self.ip, "-n", plan.netns, "-batch", "-"], ip_inside_batch(plan), plan)
            for args in tc_commands(self.config, plan):
                self._run([self.tc, *args], [], plan)
        except BaseException:
            self.teardown(slot_id)
            raise
        return plan

    def teardown(self, slot_id: str) -> None:
        self._netlink_twin().teardown(slot_id)

    def list_owned(self) -> OwnedNetwork:
        # Without netlink (and without loading pyroute2): links from sysfs, rules from `ip -json`.
        prefix = self.config.veth_prefix
        veths = [name for name in Sysfs().listdir(NET_CLASS) or [] if name.startswith(prefix)]
        done = subprocess.run(
            [self.ip, "-json", "rule", "show", "priority", str(self.config.rule_priority)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise NetworkError(f"ip -json rule show failed listing our rules: {done.stderr.strip()}")
        rules = sorted(
            {r["iif"] for r in json.loads(done.stdout or "[]") if str(r.get("iif", "")).startswith(prefix)}
        )
        return OwnedNetwork(
            netns=_owned_netns(self.config),
            host_veths=tuple(veths),
            rule_ifnames=tuple(rules),
            firewall_ifnames=_firewall_owned(self.firewall),
        )

    def remove_owned(self, owned: OwnedNetwork) -> None:
        self._netlink_twin().remove_owned(owned)

    def _netlink_twin(self) -> Pyroute2Backend:
        """The pyroute2 backend on the same config and firewall: removal and checks are shared."""
        return Pyroute2Backend(self.config, self.firewall)

    def _run(self, argv: list[str], lines: list[str], plan: SlotNetwork) -> None:
        try:
            done = subprocess.run(
                argv, input="\n".join(lines) + "\n", capture_output=True, text=True, check=False
            )
        except OSError as err:
            raise _network_error(f"run {argv[0]} for slot {plan.slot_id}", err) from err
        if done.returncode != 0:
            raise NetworkError(
                f"{' '.join(argv)} failed setting up the network of slot {plan.slot_id}: "
                f"{done.stderr.strip() or 'exit status ' + str(done.returncode)}"
            )


def ip_host_batch(config: SlotNetworkConfig, plan: SlotNetwork) -> list[str]:
    prefix = plan.subnet.prefixlen
    return [
        f"netns add {plan.netns}",
        f"link add {plan.host_ifname} type veth peer name {plan.slot_ifname} netns {plan.netns}",
        f"addr add {plan.host_address}/{prefix} dev {plan.host_ifname}",
        f"link set {plan.host_ifname} up",
        f"rule add iif {plan.host_ifname} to {config.cidr} prohibit priority {config.rule_priority}",
    ]


def ip_inside_batch(plan: SlotNetwork) -> list[str]:
    return [
        "link set lo up",
        f"addr add {plan.slot_address}/{plan.subnet.prefixlen} dev {plan.slot_ifname}",
        f"link set {plan.slot_ifname} up",
        f"route add default via {plan.host_address}",
    ]


def tc_commands(config: SlotNetworkConfig, plan: SlotNetwork) -> list[list[str]]:
    """tc arguments for the shaping a plan asks for (``tc -batch`` takes no per-line netns)."""
    commands = []
    latency = config.shaping_latency_ms
    if plan.egress_mbit is not None:
        p = tbf_params(plan.egress_mbit, latency)
        commands.append(["-n", plan.netns, "qdisc", "add", "dev", plan.slot_ifname, *_tbf_args(p)])
    if plan.ingress_mbit is not None:
        p = tbf_params(plan.ingress_mbit, latency)
        commands.append(["qdisc", "add", "dev", plan.host_ifname, *_tbf_args(p)])
    return commands


def _tbf_args(p: TbfParams) -> list[str]:
    burst, limit = str(p.burst_bytes), str(p.limit_bytes)
    return ["root", "handle", "1:", "tbf", "rate", f"{p.rate_bit}bit", "burst", burst, "limit", limit]


