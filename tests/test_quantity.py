"""Byte counts for people (nodeagent.bytesize), and what the request schema parses back from them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nodeagent import bytesize
from nodeagent.schema.quantity import parse_quantity

KI, MI, GI = 2**10, 2**20, 2**30


@pytest.mark.parametrize(
    ("nbytes", "exact", "short"),
    [
        pytest.param(0, "0", "0", id="zero"),
        pytest.param(1000, "1000", "1000", id="not-binary"),
        pytest.param(8 * MI, "8Mi", "8Mi", id="mebibytes"),
        pytest.param(3 * 2**29, "1536Mi", "1536Mi", id="one-and-a-half-gibibytes"),
        pytest.param(4 * GI, "4Gi", "4Gi", id="gibibytes"),
        pytest.param(6907624 * KI, "6907624Ki", "6.6Gi", id="long-exact-form-rounded"),
        pytest.param(123456789, "123456789", "117.7Mi", id="odd-count-rounded"),
        pytest.param(2**63 - 1, str(2**63 - 1), "8.0Ei", id="largest"),
    ],
)
def test_formats(nbytes: int, exact: str, short: str) -> None:
    assert (bytesize.format_quantity(nbytes), bytesize.format_quantity_short(nbytes)) == (exact, short)


@given(
    st.one_of(
        st.integers(0, 2**63 - 1),
        st.builds(lambda n, unit: n * unit, st.integers(0, 2**20), st.sampled_from([KI, MI, GI, 2**40])),
    )
)
def test_the_exact_form_parses_back_to_the_same_count(nbytes: int) -> None:
    assert parse_quantity(bytesize.format_quantity(nbytes)) == nbytes
