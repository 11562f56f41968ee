from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.sizes import format_size, human_size, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MiB", 512 << 20),
        ("2GiB", 2 << 30),
        ("1.5GiB", 3 << 29),
        ("4096", 4096),
        (" 8 KiB ", 8 << 10),
        ("1TiB", 1 << 40),
        ("4GB", 4 * 10**9),
        ("64m", 64 << 20),
        (123, 123),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "lots", "12 parsecs", "-1GiB", "1e9", -5, True])
def test_parse_size_refuses_with_a_hint(bad: str | int) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(bad)


@given(st.integers(min_value=0, max_value=1 << 50))
def test_format_size_round_trips(n: int) -> None:
    assert parse_size(format_size(n)) == n


def test_human_size() -> None:
    assert human_size(1536) == "1.5 KiB"
    assert human_size(3 << 30) == "3.0 GiB"
    assert human_size(12) == "12 B"
