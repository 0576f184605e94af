"""A worker's named ports as plain data: what it asks for (its preset's and its own), the spec bound
to host ports ({port:NAME}, probes by name, NODEAGENT_PORT_*), and the refusals."""

from __future__ import annotations

import socket

import pytest

from nodeagent.errors import ConfigError, InvalidRequest
from nodeagent.runtime.ports import PortWant, bind, in_use_on_host, parse_port_range
from nodeagent.runtime.presets import preview_ports, resolve, wanted_ports
from nodeagent.schema.worker import parse_worker_spec


def test_a_spec_declares_ports_and_the_command_env_and_probes_get_their_numbers() -> None:
    spec = parse_worker_spec(
        {
            "command": ["serve", "--http={port:http}", "--both={port:http},{port:grpc}"],
            "env": {"GRPC_PORT": "{port:grpc}", "NODEAGENT_PORT_HTTP": "mine"},
            "ports": {"http": {}, "grpc": {}},
            "readiness": {"http": {"port": "http", "path": "/ready"}},
            "liveness": {"tcp": {"port": "grpc"}},
        }
    )
    bound = resolve(spec, {"http": 20000, "grpc": 20001})
    assert bound.command == ("serve", "--http=20000", "--both=20000,20001")
    assert bound.env["GRPC_PORT"] == "20001"
    assert bound.env["NODEAGENT_PORT_GRPC"] == "20001"
    assert bound.env["NODEAGENT_PORT_HTTP"] == "mine"  # the spec's own env wins
    assert bound.readiness is not None
    assert bound.readiness.port == 20000
    assert bound.readiness.path == "/ready"
    assert bound.liveness is not None
    assert bound.liveness.port == 20001


def test_wanted_ports_merge_the_presets_with_the_specs_own() -> None:
    spec = parse_worker_spec(
        {
            "preset": "triton",
            "model_repository": "/m",
            "port": 9000,
            "ports": {"grpc": {"port": 9001}, "extra": {"protocol": "tcp"}},
        }
    )
    assert wanted_ports(spec) == {
        "http": PortWant("http", "http", 9000),
        "grpc": PortWant("grpc", "grpc", 9001),
        "metrics": PortWant("metrics", "http", None),
        "extra": PortWant("extra", "tcp", None),
    }


def test_a_preset_runs_on_the_ports_the_slot_holds() -> None:
    spec = parse_worker_spec({"preset": "triton", "model_repository": "/m", "model_name": "resnet"})
    bound = resolve(spec, {"http": 21000, "grpc": 21001, "metrics": 21002})
    assert "--http-port=21000" in bound.command
    assert "--grpc-port=21001" in bound.command
    assert "--metrics-port=21002" in bound.command
    assert bound.readiness is not None
    assert (bound.readiness.port, bound.readiness.path) == (21000, "/v2/models/resnet/ready")
    assert bound.port == 21000


def test_the_default_protocol_follows_the_name() -> None:
    spec = parse_worker_spec({"command": ["x"], "ports": {"grpc": {}, "metrics": {}}})
    assert {n: w.protocol for n, w in wanted_ports(spec).items()} == {"grpc": "grpc", "metrics": "http"}


def test_without_a_preset_port_alone_declares_nothing() -> None:
    assert wanted_ports(parse_worker_spec({"command": ["x"], "port": 9000})) == {}


def test_preview_uses_what_is_asked_then_the_servers_default() -> None:
    spec = parse_worker_spec({"preset": "tfserving", "model_repository": "/m", "model_name": "wd", "port": 7})
    assert preview_ports(spec) == {"grpc": 8500, "http": 7}


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        pytest.param(
            {"command": ["serve", "--port={port:htp}"], "ports": {"http": {}}},
            ["command[1]", "{port:htp}", "no port named 'htp'", "http"],
            id="placeholder-typo",
        ),
        pytest.param(
            {"command": ["serve"], "env": {"P": "{port:grpc}"}},
            ["env['P']", "declare it in ports", "none declared"],
            id="env-undeclared",
        ),
        pytest.param(
            {"command": ["serve"], "ports": {"http": {}}, "readiness": {"tcp": {"port": "grpc"}}},
            ["readiness", "'grpc'", "http"],
            id="probe-undeclared",
        ),
    ],
)
def test_references_to_ports_the_worker_lacks_are_refused(raw: dict[str, object], words: list[str]) -> None:
    with pytest.raises(InvalidRequest) as err:
        resolve(parse_worker_spec(raw))
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        pytest.param({"command": ["x"], "ports": {"HTTP": {}}}, ["ports"], id="upper-case-name"),
        pytest.param({"command": ["x"], "ports": {"http": {"port": 0}}}, ["ports.http.port"], id="port-0"),
        pytest.param(
            {"command": ["x"], "ports": {"a": {"port": 9000}, "b": {"port": 9000}}},
            ["9000", "more than one name"],
            id="same-number-twice",
        ),
        pytest.param(
            {"preset": "generic", "command": ["x"], "port": 1, "ports": {"http": {"port": 2}}},
            ["port is 1", "ports.http.port is 2"],
            id="port-and-ports-http-disagree",
        ),
        pytest.param(
            {"command": ["x"], "ports": {"http": {"protocol": "udp"}}}, ["protocol"], id="bad-protocol"
        ),
    ],
)
def test_bad_port_declarations_are_refused_at_the_edge(raw: dict[str, object], words: list[str]) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_worker_spec(raw)
    for word in words:
        assert word in str(err.value)


def test_bind_without_ports_leaves_a_plain_spec_alone() -> None:
    spec = parse_worker_spec({"command": ["x", "{not-a-port}"], "env": {"A": "b"}})
    bound = bind(spec, {})
    assert bound.command == ("x", "{not-a-port}")
    assert bound.env == {"A": "b"}


@pytest.mark.parametrize(
    ("text", "bounds"), [("20000-29999", (20000, 29999)), (" 80 - 80 ", (80, 80)), ("1-65535", (1, 65535))]
)
def test_port_range(text: str, bounds: tuple[int, int]) -> None:
    assert parse_port_range(text) == bounds


@pytest.mark.parametrize("text", ["", "20000", "30000-20000", "0-10", "1-65536", "a-b", "1-2-3"])
def test_bad_port_range(text: str) -> None:
    with pytest.raises(ConfigError, match=r"workers\.port_range"):
        parse_port_range(text)


def test_a_listener_makes_its_port_in_use() -> None:
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        port = int(listener.getsockname()[1])
        # Bound with SO_REUSEADDR but not listening: a server's own bind would still succeed.
        assert not in_use_on_host(port)
        listener.listen()
        assert in_use_on_host(port)
