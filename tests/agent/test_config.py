"""AgentConfig from TOML: defaults, every section, strict errors naming key and file, CLI overrides."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from nodeagent.agent.config import (
    _SECTIONS,
    AgentConfig,
    apply_overrides,
    default_state_dir,
    load_config,
    parse_config,
    parse_listen,
)
from nodeagent.errors import ConfigError

FULL = """
[api]
listen = "0.0.0.0:8080"
unix_socket = "/run/nodeagent.sock"
token_file = "/etc/nodeagent/token"

[state]
dir = "/srv/nodeagent"

[placement]
whole_cores = false
reserved_cpus = "0-1"
burstable_overcommit = 1.5
shareable_gpus = ["0", "GPU-abc"]
max_shares_per_gpu = 8
allowed_devices = ["/dev/fuse"]

[isolation]
cgroup_parent = "inference.slice"
allow_unisolated = true
network_cidr = "10.99.0.0/16"
pids_max = 1024

[controller]
url = "https://controller.example:8443/v1/nodes"
interval_seconds = 10
node_id = "rack4-node17"

[gpu]
ignored_xids = [13, 31]

[workers]
tick_seconds = 0.25

[log]
level = "debug"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def test_no_file_at_the_default_path_means_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr("nodeagent.agent.config.DEFAULT_CONFIG_PATH", tmp_path / "absent.toml")
    config = load_config()
    assert config == AgentConfig()
    assert (config.api.host, config.api.port) == ("127.0.0.1", 7070)
    assert config.controller.url == ""
    assert config.token_path == config.state_dir / "token"


def test_every_section_is_read(tmp_path: Path) -> None:
    path = write(tmp_path, FULL)
    config = load_config(path)
    assert config.source == str(path)
    assert (config.api.host, config.api.port) == ("0.0.0.0", 8080)
    assert config.token_path == Path("/etc/nodeagent/token")
    assert config.state_dir == Path("/srv/nodeagent")
    assert config.database_path == Path("/srv/nodeagent/state.db")
    options = config.placement_options()
    assert options.whole_cores is False
    assert options.reserved_cpus == frozenset({0, 1})
    assert options.burstable_overcommit == 1.5
    assert options.shareable_gpus == frozenset({"0", "GPU-abc"})
    assert options.max_shares_per_gpu == 8
    assert config.isolation.cgroup_parent == "inference.slice"
    assert config.isolation.allow_unisolated is True
    assert config.controller.interval_seconds == 10.0
    assert config.controller.resolved_node_id == "rack4-node17"
    assert config.gpu.ignored_xids == (13, 31)
    assert config.workers.tick_seconds == 0.25
    assert config.log.level == "debug"


def test_placement_defaults_match_placement_options() -> None:
    from nodeagent.placement import PlacementOptions

    assert AgentConfig().placement_options() == PlacementOptions()


@pytest.mark.parametrize(
    ("text", "named"),
    [
        pytest.param("[apii]\nlisten='x'\n", "apii", id="unknown-section"),
        pytest.param("[api]\nlisten_on = '1.2.3.4:1'\n", "api.listen_on", id="unknown-key"),
        pytest.param("[api]\nlisten = 7070\n", "api.listen", id="wrong-type"),
        pytest.param("[api]\nmax_connections = 0\n", "api.max_connections", id="no-connections"),
        pytest.param(
            "[isolation]\nlocal_open_ports = ['53/icmp']\n",
            "isolation.local_open_ports",
            id="open-port-protocol",
        ),
        pytest.param(
            "[api]\nmax_connections_per_peer = -1\n", "api.max_connections_per_peer", id="peer-limit"
        ),
        pytest.param("[api]\nheader_timeout_s = 0\n", "api.header_timeout_s", id="header-timeout"),
        pytest.param("[api]\nlisten = 'localhost'\n", "api.listen", id="listen-without-port"),
        pytest.param("[api]\nlisten = '127.0.0.1:99999'\n", "api.listen", id="port-out-of-range"),
        pytest.param("[state]\ndir = 'relative/dir'\n", "state.dir", id="relative-state-dir"),
        pytest.param("[placement]\nwhole_cores = 'yes'\n", "placement.whole_cores", id="bool-as-string"),
        pytest.param("[placement]\nburstable_overcommit = -1\n", "burstable_overcommit", id="bad-ratio"),
        pytest.param("[placement]\nreserved_cpus = '0-x'\n", "placement", id="bad-cpulist"),
        pytest.param("[isolation]\nnetwork_cidr = '10.0.0.0/33'\n", "isolation", id="bad-cidr"),
        pytest.param("[controller]\nurl = 'ftp://x'\n", "controller.url", id="bad-url"),
        pytest.param(
            "[controller]\ninterval_seconds = 0\n", "controller.interval_seconds", id="zero-interval"
        ),
        pytest.param("[gpu]\nignored_xids = [13, 'x']\n", "gpu.ignored_xids", id="mixed-list"),
        pytest.param("[log]\nlevel = 'loud'\n", "log.level", id="bad-level"),
        pytest.param(
            "[isolation]\nhost_partitioning = 'on'\n", "isolation.host_partitioning", id="bad-host-mode"
        ),
        pytest.param(
            "[isolation]\nhost_partitioning_parts = ['irq']\n",
            "isolation.host_partitioning_parts",
            id="unknown-host-part",
        ),
        pytest.param(
            "[isolation]\nhost_sweep_seconds = 0\n", "isolation.host_sweep_seconds", id="zero-sweep"
        ),
        pytest.param("api = 3\n", "api", id="section-not-a-table"),
    ],
)
def test_bad_config_names_the_key_and_the_file(tmp_path: Path, text: str, named: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert named in str(info.value)
    assert str(path) in str(info.value)


def test_invalid_toml_and_missing_explicit_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[api\n"))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_command_line_overrides_win(tmp_path: Path) -> None:
    config = apply_overrides(load_config(write(tmp_path, FULL)), listen="[::1]:9000", state_dir=tmp_path)
    assert (config.api.host, config.api.port) == ("::1", 9000)
    assert config.state_dir == tmp_path
    assert config.api.token_file == "/etc/nodeagent/token"  # untouched
    with pytest.raises(ConfigError, match="--listen"):
        apply_overrides(config, listen="nonsense")


@pytest.mark.parametrize(
    ("env", "euid", "expected"),
    [
        pytest.param({}, 0, "/var/lib/nodeagent", id="root"),
        pytest.param(
            {"XDG_STATE_HOME": "/home/u/.st", "HOME": "/home/u"}, 1000, "/home/u/.st/nodeagent", id="xdg"
        ),
        pytest.param({"HOME": "/home/u"}, 1000, "/home/u/.local/state/nodeagent", id="home"),
        pytest.param(
            {"XDG_STATE_HOME": "rel", "HOME": "/home/u"},
            1000,
            "/home/u/.local/state/nodeagent",
            id="relative-xdg-ignored",
        ),
    ],
)
def test_default_state_dir(env: dict[str, str], euid: int, expected: str) -> None:
    assert default_state_dir(env, euid) == Path(expected)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param("127.0.0.1:7070", ("127.0.0.1", 7070), id="v4"),
        pytest.param("[::]:7070", ("::", 7070), id="v6"),
        pytest.param("node.example:80", ("node.example", 80), id="name"),
    ],
)
def test_parse_listen(value: str, expected: tuple[str, int]) -> None:
    assert parse_listen(value) == expected


def test_unix_socket_alone_is_enough() -> None:
    config = parse_config({"api": {"listen": "", "unix_socket": "/run/na.sock"}})
    assert config.api.unix_socket == "/run/na.sock"
    with pytest.raises(ConfigError, match="nothing to serve on"):
        parse_config({"api": {"listen": ""}})


def test_example_config_in_docs_loads() -> None:
    example = Path(__file__).resolve().parents[2] / "docs" / "config.example.toml"
    config = load_config(example)
    assert config.api.listen == "127.0.0.1:7070"
    assert config.workers.port_bounds == (20000, 29999)


def test_a_bad_port_range_is_refused_with_its_key() -> None:
    with pytest.raises(ConfigError, match=r"workers\.port_range is '9-1'; expected FIRST-LAST"):
        parse_config({"workers": {"port_range": "9-1"}})


def test_every_qos_key_is_documented_with_its_default() -> None:
    import dataclasses

    from nodeagent.agent.config import QosConfig

    docs = Path(__file__).resolve().parents[2] / "docs"
    table = (docs / "configuration.md").read_text().split("## [qos]")[1].split("\n## ")[0]
    example = load_config(docs / "config.example.toml")
    assert example.qos == QosConfig()  # the example shows the defaults
    for f in dataclasses.fields(QosConfig):
        default = getattr(QosConfig(), f.name)
        shown = (
            str(default).lower()
            if isinstance(default, bool)
            else (f'"{default}"' if isinstance(default, str) else str(default))
        )
        assert f"| `{f.name}` | `{shown}` |" in table, f"[qos] {f.name} missing from docs/configuration.md"


def test_qos_settings_reach_the_loop() -> None:
    config = parse_config({"qos": {"cpu_margin": 0.25, "suppressed_cpus": 0.05, "period_seconds": 0.5}})
    colocation = config.colocation()
    assert colocation.cpu_margin == 0.25
    assert colocation.min_cpus == 0.05
    assert colocation.period_seconds == 0.5


def test_controller_settings_reach_the_reporter(tmp_path: Path) -> None:
    from nodeagent.agent.daemon import _reporter, controller_token
    from nodeagent.agent.metrics import Metrics
    from tests.agent.fake_service import FakeSlotService as FakeService

    token = tmp_path / "controller-token"
    token.write_text("s3cret\n")
    config = apply_overrides(
        parse_config(
            {
                "controller": {
                    "url": "http://127.0.0.1:9/v1/nodes",
                    "token_file": str(token),
                    "backoff_initial_seconds": 2.0,
                    "backoff_max_seconds": 30.0,
                    "coalesce_seconds": 0.1,
                }
            }
        ),
        state_dir=tmp_path,
    )
    reporter = _reporter(config, FakeService(), Metrics(), controller_token(config))
    assert reporter is not None
    assert reporter.config.token == "s3cret"
    assert (reporter.config.backoff_initial, reporter.config.backoff_max) == (2.0, 30.0)
    assert reporter.config.coalesce_seconds == 0.1

    token.write_text("")
    with pytest.raises(ConfigError, match=r"token_file .* is empty"):
        controller_token(config)
    token.unlink()
    with pytest.raises(ConfigError, match="token_file"):
        controller_token(config)


def test_no_controller_url_means_no_reporter(tmp_path: Path) -> None:
    from nodeagent.agent.daemon import _reporter
    from nodeagent.agent.metrics import Metrics
    from tests.agent.fake_service import FakeSlotService as FakeService

    config = apply_overrides(parse_config({}), state_dir=tmp_path)
    assert _reporter(config, FakeService(), Metrics(), None) is None


@pytest.mark.parametrize(
    ("section", "key"),
    [(name, f.name) for name, cls in _SECTIONS.items() for f in dataclasses.fields(cls)],
)
def test_every_key_is_documented_and_in_the_example(section: str, key: str) -> None:
    docs = Path(__file__).resolve().parents[2] / "docs"
    documented = (docs / "configuration.md").read_text()
    assert f"| `{key}` |" in documented, f"configuration.md lacks [{section}] {key}"
    example = (docs / "config.example.toml").read_text()
    header = re.search(rf"^\[{section}\][^\n]*\n", example, re.MULTILINE)  # may carry a comment
    assert header is not None, f"config.example.toml has no [{section}] table"
    table = example[header.end() :].split("\n[", 1)[0]
    # A key may be shown commented out (one whose default is computed, such as reserved_cpus).
    assert re.search(rf"^#? ?{key} =", table, re.MULTILINE), f"config.example.toml lacks [{section}] {key}"


def test_the_examples_container_sections_are_the_defaults() -> None:
    import tomllib

    docs = Path(__file__).resolve().parents[2] / "docs"
    example = tomllib.loads((docs / "config.example.toml").read_text())
    assert parse_config({"cdi": example["cdi"], "containers": example["containers"]}) == parse_config({})


def test_the_state_reserve_is_a_quantity_within_bounds() -> None:
    assert parse_config({}).state.reserve_bytes == 64 << 20
    assert parse_config({"state": {"reserve": "1Gi"}}).state.reserve_bytes == 1 << 30
    for bad, message in (("lots", "state.reserve"), ("1Mi", "expected from 16Mi"), ("2Ti", "to 1Ti")):
        with pytest.raises(ConfigError, match=message):
            parse_config({"state": {"reserve": bad}})


def test_the_pods_cgroups_are_left_alone_only_while_nri_places_their_containers() -> None:
    assert parse_config({}).kubernetes.partitioning_left_alone() == ()
    on = parse_config({"kubernetes": {"nri": True, "pods_cgroups": ["/kube/kubepods/", "kubepods.slice"]}})
    assert on.kubernetes.partitioning_left_alone() == ("kube/kubepods", "kubepods.slice")
    # The kubelet's best-effort QoS cgroups there, as each cgroup driver names them.
    assert on.kubernetes.best_effort_cgroups() == (
        "kube/kubepods/besteffort",
        "kubepods.slice/kubepods-besteffort.slice",
    )
    assert parse_config({}).kubernetes.best_effort_cgroups() == ()
    for bad in ("/", "", "kube/../etc"):
        with pytest.raises(
            ConfigError, match=r"kubernetes.pods_cgroups has .*expected a cgroup path below the root"
        ):
            parse_config({"kubernetes": {"nri": True, "pods_cgroups": [bad]}})
