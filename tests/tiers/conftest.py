"""NVMe tiers opened and reopened as a restarting daemon would, closed after each test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.tiers.crypto import RecordCipher
from kvtier.tiers.nvme import NvmeTier, RecoveryReport


@pytest.fixture
def tiers() -> Iterator[list[NvmeTier]]:
    """Tiers a test opens (either layout), closed after it unless it closed them itself."""
    opened: list[NvmeTier] = []
    yield opened
    for tier in opened:
        if tier._tombstone_fd is not None:
            tier.close()


@pytest.fixture
def opened() -> Iterator[list[NvmeTier]]:
    tiers: list[NvmeTier] = []
    yield tiers
    for tier in tiers:
        tier.close()


def reopen(
    opened: list[NvmeTier], root: Path, key: bytes | None = None, direct: bool = True
) -> tuple[NvmeTier, RecoveryReport]:
    """A tier over `root` as a (re)started daemon opens it: earlier ones let go first."""
    while opened:
        opened.pop().close()
    cipher = RecordCipher(key) if key is not None else None
    tier = NvmeTier(root, 1 << 30, direct_io=direct, sync_writes=False, cipher=cipher)
    opened.append(tier)
    return tier, tier.open()
