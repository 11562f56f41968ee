"""The failpoint spec: parsed strictly, fired with the given probability and count."""

from __future__ import annotations

import errno

import pytest

from kvtier import failpoints
from kvtier.errors import ConfigError


@pytest.fixture(autouse=True)
def _disarm() -> object:
    yield
    failpoints.configure("")


def test_errors_fire_as_the_errno_they_name_and_stop_after_their_count() -> None:
    failpoints.configure("nvme.read=eio*2,nvme.write=enospc,nvme.pwrite=short", seed=1)
    assert failpoints.ACTIVE
    for _ in range(2):
        with pytest.raises(OSError) as info:
            failpoints.fire("nvme.read")
        assert info.value.errno == errno.EIO
    assert failpoints.fire("nvme.read") is None  # its two are spent
    with pytest.raises(OSError) as info:
        failpoints.fire("nvme.write")
    assert info.value.errno == errno.ENOSPC
    assert failpoints.fire("nvme.pwrite") == "short"
    assert failpoints.fire("nvme.remove") is None  # not armed


def test_probability_is_honoured_and_seeded() -> None:
    def draws() -> list[bool]:
        failpoints.configure("nvme.pwrite=short@0.25", seed=7)
        return [failpoints.fire("nvme.pwrite") == "short" for _ in range(4000)]

    first = draws()
    assert first == draws()
    assert 0.2 < sum(first) / len(first) < 0.3


@pytest.mark.parametrize(
    "spec",
    ["nope.point=eio", "nvme.read", "nvme.read=explode", "nvme.read=eio@1.5", "nvme.read=eio*x"],
)
def test_a_bad_spec_is_refused_with_what_is_wrong(spec: str) -> None:
    with pytest.raises(ConfigError, match="KVTIER_FAILPOINTS"):
        failpoints.configure(spec)


def test_disarmed_by_default() -> None:
    failpoints.configure("")
    assert not failpoints.ACTIVE
    assert failpoints.fire("nvme.read") is None
