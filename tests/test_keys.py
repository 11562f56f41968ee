from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.errors import InvalidArgument
from kvtier.keys import chain_keys, check_key, check_keys, check_namespace, namespace_id


@pytest.mark.parametrize(
    "ns", ["m/l", "meta-llama/Llama-3-8B/bf16-b16-tp0of2", "x", "a:b@c+d=e_f.g"]
)
def test_valid_namespaces(ns: str) -> None:
    assert check_namespace(ns, 256) == ns


@pytest.mark.parametrize("ns", ["", "a b", "a//b", "/a", "a/", "../x", "a/./b", "a\x00b", "é/x"])
def test_invalid_namespaces(ns: str) -> None:
    with pytest.raises(InvalidArgument):
        check_namespace(ns, 256)


def test_key_limits() -> None:
    assert check_key(b"k", 4) == b"k"
    with pytest.raises(InvalidArgument, match="empty"):
        check_key(b"", 4)
    with pytest.raises(InvalidArgument, match="limit is 4"):
        check_key(b"12345", 4)


def test_namespace_ids_do_not_collide_across_tenants() -> None:
    assert namespace_id("a", "b/c") != namespace_id("a/b", "c")


@given(st.lists(st.lists(st.integers(0, 2**31), min_size=1, max_size=8), min_size=1, max_size=6))
def test_chain_keys_are_prefix_chained(blocks: list[list[int]]) -> None:
    keys = chain_keys("m/l", blocks)
    assert len(keys) == len(blocks) and all(len(k) == 32 for k in keys)
    # A prefix of the tokens gives a prefix of the keys; changing block 0 changes every key.
    assert chain_keys("m/l", blocks[:1]) == keys[:1]
    changed = [[blocks[0][0] + 1, *blocks[0][1:]], *blocks[1:]]
    assert not set(chain_keys("m/l", changed)) & set(keys)
    assert not set(chain_keys("other/ns", blocks)) & set(keys)
    assert chain_keys("m/l", blocks, extra=b"salt") != keys


def test_chain_keys_field_boundaries_matter() -> None:
    assert chain_keys("m/l", [[1, 2]]) != chain_keys("m/l", [[1], [2]])[-1:]
    assert len(chain_keys("m/l", [[1]], digest_bytes=16)[0]) == 16


@given(
    st.lists(st.binary(min_size=0, max_size=6), max_size=40),
    st.integers(min_value=1, max_value=5),
)
def test_check_keys_agrees_with_check_key_on_every_key(keys: list[bytes], limit: int) -> None:
    """The chain check (shortest and longest only) refuses exactly what the per-key check
    refuses, with the per-key check's message for the first bad key."""
    first_bad = next((k for k in keys if not 1 <= len(k) <= limit), None)
    if first_bad is None:
        assert check_keys(keys, limit) == keys
        return
    with pytest.raises(InvalidArgument) as chain_err:
        check_keys(keys, limit)
    with pytest.raises(InvalidArgument) as key_err:
        check_key(first_bad, limit)
    assert str(chain_err.value) == str(key_err.value)
