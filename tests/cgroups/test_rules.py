"""Device rules modelled in memory and the v1 minimal diff."""

from __future__ import annotations

import pytest

from nodeagent.cgroups.rules import ALLOW_ALL, DeviceRule, normalize, parse_devices_list, plan_v1
from nodeagent.errors import InvalidRequest

NULL = DeviceRule("c", 1, 3, "rwm")
ZERO = DeviceRule("c", 1, 5, "rwm")


@pytest.mark.parametrize(
    ("text", "rule"),
    [
        pytest.param("c 1:3 rwm", NULL, id="char"),
        pytest.param("b 7:* r", DeviceRule("b", 7, None, "r"), id="any-minor"),
        pytest.param("a *:* rwm", ALLOW_ALL, id="all"),
        pytest.param("c 1:3 mwr", NULL, id="access-reordered"),
    ],
)
def test_parse_and_format_round_trip(text: str, rule: DeviceRule) -> None:
    assert DeviceRule.parse(text) == rule
    assert DeviceRule.parse(str(rule)) == rule


@pytest.mark.parametrize(
    "text",
    ["x 1:3 r", "c 1:3 q", "c 1 r", "c a:3 r", "c 1:3"],
    ids=["type", "access", "colon", "number", "short"],
)
def test_bad_rules_are_refused(text: str) -> None:
    with pytest.raises(InvalidRequest):
        DeviceRule.parse(text)


def test_normalize_merges_access_for_the_same_device() -> None:
    merged = normalize([DeviceRule("c", 1, 3, "r"), DeviceRule("c", 1, 3, "w"), ZERO])
    assert merged == {DeviceRule("c", 1, 3, "rw"), ZERO}


def test_allow_all_absorbs_everything() -> None:
    assert normalize([NULL, ALLOW_ALL]) == {ALLOW_ALL}


@pytest.mark.parametrize(
    ("current", "wanted", "writes"),
    [
        pytest.param(
            "a *:* rwm\n",
            [NULL],
            [("devices.deny", "a"), ("devices.allow", "c 1:3 rwm")],
            id="default-allow-to-list",
        ),
        pytest.param("c 1:3 rwm\n", [NULL], [], id="unchanged"),
        pytest.param(
            "c 1:3 rwm\nc 1:5 rwm\n",
            [DeviceRule("c", 1, 5, "r")],
            [("devices.deny", "c 1:3 rwm"), ("devices.deny", "c 1:5 rwm"), ("devices.allow", "c 1:5 r")],
            id="narrow-and-drop",
        ),
        pytest.param("", [ZERO], [("devices.allow", "c 1:5 rwm")], id="add-to-empty"),
        pytest.param("c 1:3 rwm\n", [ALLOW_ALL], [("devices.allow", "a")], id="open-up"),
        pytest.param("a *:* rwm\n", [ALLOW_ALL], [], id="already-open"),
    ],
)
def test_v1_plan_is_the_minimal_diff(
    current: str, wanted: list[DeviceRule], writes: list[tuple[str, str]]
) -> None:
    assert plan_v1(parse_devices_list(current), wanted).writes() == writes
