"""The packed counterparts of policy.py's shared parts (kvtier/index/policy.py,
`Policies`): the reuse estimate, the ghosts and admission by key digest, and
`PackedPolicies`, which makes each tier's packed order (kvtier/index/packed_policy.py,
kvtier/index/packed_arc.py) for a catalog of slots. Apart from packed_policy.py, whose
orders fill that module."""

from __future__ import annotations

from collections.abc import Callable

from kvtier.index.dense_native import dram_order
from kvtier.index.dense_order import DenseOrder
from kvtier.index.packed_arc import PackedChainArc
from kvtier.index.packed_policy import DigestSketch, PackedLru, PackedS3Fifo, PackedValue
from kvtier.index.policy import POLICIES, AdmissionMode, ValueModel
from kvtier.index.slot_policy import SlotPolicy
from kvtier.index.slots import DigestTable

__all__ = ["PackedAdmission", "PackedGhosts", "PackedPolicies", "PackedReuse"]


def _bucket_code(uses: int, from_end: int) -> int:
    """ReuseEstimator.bucket as one small int: uses 0..3 × from_end -1..3."""
    return min(uses, 3) * 5 + (min(from_end, 3) + 1 if from_end >= 0 else 0)


def _bucket_of(code: int) -> tuple[int, int]:
    return code // 5, code % 5 - 1


class PackedReuse:
    """ReuseEstimator by key digest: the last bucket of up to `remembered_keys` keys (the
    least recently observed forgotten first, which resolves their last placement as not
    reused) in a DigestTable, resolved and reused counts in two lists."""

    def __init__(self, remembered_keys: int = 1 << 20) -> None:
        self._resolved = [0] * 20
        self._reused = [0] * 20
        self._remembered = max(remembered_keys, 1)
        self._last = DigestTable(self._remembered)  # sized for all of them: never rehashed

    @staticmethod
    def bucket(uses: int, from_end: int) -> tuple[int, int]:
        return _bucket_of(_bucket_code(uses, from_end))

    def observe(self, digest: int, uses: int, from_end: int) -> None:
        """Record a placement or use of the block with key digest `digest`."""
        last = self._last
        previous = last.exchange(digest, _bucket_code(uses, from_end))
        if previous >= 0:
            self._reused[previous] += 1
            self._resolved[previous] += 1
        if len(last) > self._remembered:
            self._resolved[last.pop(last.oldest())] += 1

    def probability(self, bucket: tuple[int, int]) -> float:
        code = _bucket_code(*bucket)
        return (self._reused[code] + 1) / (self._resolved[code] + 2)

    def p_reuse(self, digest: int, uses: int, from_end: int) -> float:
        """P(reuse): the block's last bucket if it was seen, else the one it would be in."""
        code = self._last.get(digest)
        if code < 0:
            code = _bucket_code(uses, from_end)
        return (self._reused[code] + 1) / (self._resolved[code] + 2)

    def __len__(self) -> int:
        return len(self._last)


class PackedGhosts:
    """Ghosts by key digest: recently dropped keys (bounded, oldest forgotten first)."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._keys = DigestTable()

    def add(self, digest: int) -> None:
        self._keys.put(digest, to_end=True)
        while len(self._keys) > self._capacity:
            self._keys.pop_oldest()

    def take(self, digest: int) -> bool:
        """True (and forgets it) if the key was dropped recently."""
        return self._keys.pop(digest) >= 0

    def __len__(self) -> int:
        return len(self._keys)


class PackedAdmission:
    """Admission (kvtier/index/policy.py) by key digest and distance from the chain's end."""

    def __init__(
        self,
        mode: AdmissionMode,
        sketch: DigestSketch,
        reuse: PackedReuse,
        min_p_reuse: float = 0.1,
    ) -> None:
        self.mode = mode
        self._sketch = sketch
        self._reuse = reuse
        self.min_p_reuse = min_p_reuse

    def admit_on_evict(self, digest: int, from_end: int) -> bool:
        if self.mode == "selective":
            uses = max(self._sketch.count(digest), 1)
            return self._reuse.p_reuse(digest, uses, from_end) >= self.min_p_reuse
        return self.mode == "write_back"

    @property
    def on_insert(self) -> bool:
        return self.mode == "write_through"


class PackedPolicies:
    """Policies (kvtier/index/policy.py) for a catalog of slots: `digest_of(slot)` is the
    key digest of the block in a slot (the catalog's array), read when a tier needs it."""

    def __init__(
        self,
        name: str,
        admission: AdmissionMode,
        model: ValueModel,
        ghost_capacity: int,
        digest_of: Callable[[int], int],
        min_p_reuse: float = 0.1,
    ) -> None:
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
        self.name = name
        self.model = model
        self.digest_of = digest_of
        self.sketch = DigestSketch()
        self.reuse = PackedReuse(ghost_capacity or 1 << 20)  # Policies says why
        self.admission = PackedAdmission(admission, self.sketch, self.reuse, min_p_reuse)
        self.ghosts = PackedGhosts(ghost_capacity)

    def accessed(self, digest: int, from_end: int) -> None:
        """A block was asked for (hit or miss): count the use, settle its last estimate."""
        self.reuse.observe(digest, self.sketch.add(digest), from_end)

    def uses_of(self, slot: int) -> int:
        return self.sketch.count(self.digest_of(slot))

    def new_tier(
        self,
        tier: str,
        fallback: str | None,
        capacity_bytes: int,
        digest_of: Callable[[int], int] | None = None,
    ) -> SlotPolicy:
        """One tier's order; `digest_of` for a tier whose slots are not the catalog's
        (the GPU path's HBM copies)."""
        uses_of = self.uses_of
        if digest_of is not None:
            own, sketch = digest_of, self.sketch

            def uses_of(slot: int) -> int:
                return sketch.count(own(slot))

        digest_of = digest_of or self.digest_of
        if self.name == "lru":
            return PackedLru()
        if self.name == "s3fifo":
            return PackedS3Fifo(capacity_bytes, digest_of)
        if fallback is not None:
            return PackedChainArc(uses_of, digest_of, self.sketch)  # Policies.new_tier says why
        counted_in = self.sketch if uses_of == self.uses_of else None
        return PackedValue(
            tier, fallback, self.model, uses_of, digest_of, sketch=counted_in, reach_net=True
        )

    def new_dram_tier(self, capacity_bytes: int, digest_of: Callable[[int], int]) -> SlotPolicy:
        """A tenant's DRAM order over some of the catalog's slots (`digest_of`: the
        catalog's), each given a dense local slot (DenseOrder); for the chain ARC its
        native twin where built (kvtier/index/dense_native.py)."""

        def make(own: Callable[[int], int]) -> SlotPolicy:
            return self.new_tier("dram", "nvme", capacity_bytes, own)

        def python_pair() -> SlotPolicy:
            return DenseOrder(make, digest_of)

        if self.name != "kvtier":  # new_tier's other orders for a tier with a fallback
            return python_pair()
        return dram_order(python_pair, digest_of, self.sketch.count, PackedChainArc.STEP)
