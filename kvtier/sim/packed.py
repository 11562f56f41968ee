"""The packed policies (kvtier/index/packed_policy.py) behind the key interface of
kvtier/index/policy.py, so the replay (and tests) can run them where `Policies` is used
and compare decisions: `KeyedPolicies` takes `Policies`' arguments.

Keys get slots in order of first sight and keep them (a bijection for the run), the way
a packed catalog's slots name blocks, each with its `key_digest`. With `packed_counts` the
use counts, reuse estimate, admission and ghosts are the packed ones (keyed by digest);
without, they stay policy.py's and only the tier orders are packed, so any difference
in the figures is the tier orders' alone.

Bookkeeping for comparisons, not for the daemon: the map from keys to slots here is the
per-block dict a packed catalog replaces.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable

from kvtier.index.packed_policies import PackedPolicies
from kvtier.index.packed_policy import (
    NO_SLOT,
    PackedChainArc,
    PackedValue,
    SlotPolicy,
)
from kvtier.index.policy import (
    Admission,
    AdmissionMode,
    BlockInfo,
    Ghosts,
    Key,
    Policies,
    TierPolicy,
    ValueModel,
)
from kvtier.index.slots import key_digest


class SlotMap:
    """key <-> slot, assigned in order of first sight, never reused."""

    def __init__(self) -> None:
        self._slots: dict[Key, int] = {}
        self.keys: list[Key] = []
        self._digests = array("Q")

    def slot(self, key: Key) -> int:
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = len(self.keys)
            self.keys.append(key)
            self._digests.append(key_digest(key))
        return slot

    def find(self, key: object) -> int:
        """The slot of a key seen before, else NO_SLOT."""
        try:
            return self._slots.get(key, NO_SLOT)  # type: ignore[call-overload,unused-ignore]
        except TypeError:  # unhashable: never seen
            return NO_SLOT

    def digest(self, key: Key) -> int:
        slot = self._slots.get(key)
        return key_digest(key) if slot is None else int(self._digests[slot])

    def digest_of(self, slot: int) -> int:
        return int(self._digests[slot])


class KeyedTier(TierPolicy):
    """A SlotPolicy behind TierPolicy's key interface."""

    def __init__(self, policy: SlotPolicy, slots: SlotMap) -> None:
        self.policy = policy
        self._slots = slots

    def insert(self, key: Key, info: BlockInfo) -> None:
        slots = self._slots
        parent = NO_SLOT if info.parent is None else slots.slot(info.parent)
        self.policy.insert(slots.slot(key), info.size_bytes, info.position, parent)

    def hit(self, key: Key) -> None:
        slot = self._slots.find(key)
        if slot != NO_SLOT:
            self.policy.hit(slot)

    def reached(self, key: Key, held: bool) -> None:
        self.policy.reached(self._slots.digest(key), held)

    def remove(self, key: Key) -> None:
        slot = self._slots.find(key)
        if slot != NO_SLOT:
            self.policy.remove(slot)

    def victim(self, evictable: Callable[[Key], bool]) -> Key | None:
        keys = self._slots.keys
        slot = self.policy.victim(lambda s: evictable(keys[s]))
        return None if slot is None else keys[slot]

    def last_resort(self, evictable: Callable[[Key], bool]) -> Key | None:
        keys = self._slots.keys
        slot = self.policy.last_resort(lambda s: evictable(keys[s]))
        return None if slot is None else keys[slot]

    def __contains__(self, key: object) -> bool:
        slot = self._slots.find(key)
        return slot != NO_SLOT and slot in self.policy

    def __len__(self) -> int:
        return len(self.policy)


class _KeyedAdmission(Admission):
    def __init__(self, policies: Policies, packed: PackedPolicies, slots: SlotMap) -> None:
        # policy.py's sketch and estimate only fill the base class: the packed ones decide.
        super().__init__(packed.admission.mode, policies.sketch, policies.reuse)
        self._packed = packed
        self._slots = slots

    def admit_on_evict(self, key: Key, info: BlockInfo) -> bool:
        return self._packed.admission.admit_on_evict(self._slots.digest(key), info.from_end)


class _KeyedGhosts(Ghosts):
    def __init__(self, packed: PackedPolicies, slots: SlotMap) -> None:
        super().__init__(0)
        self._packed = packed
        self._slots = slots

    def add(self, key: Key) -> None:
        self._packed.ghosts.add(self._slots.digest(key))

    def take(self, key: Key) -> bool:
        return self._packed.ghosts.take(self._slots.digest(key))

    def __len__(self) -> int:
        return len(self._packed.ghosts)


class KeyedPolicies(Policies):
    """Policies whose tier orders (and, with `packed_counts`, counts, reuse estimate,
    admission and ghosts) are the packed ones."""

    def __init__(
        self,
        name: str,
        admission: AdmissionMode,
        model: ValueModel,
        ghost_capacity: int,
        min_p_reuse: float = 0.1,
        *,
        packed_counts: bool = False,
    ) -> None:
        super().__init__(name, admission, model, ghost_capacity, min_p_reuse)
        self.slots = SlotMap()
        self.packed = PackedPolicies(
            name, admission, model, ghost_capacity, self.slots.digest_of, min_p_reuse
        )
        self.packed_counts = packed_counts
        if packed_counts:
            self.admission = _KeyedAdmission(self, self.packed, self.slots)
            self.ghosts = _KeyedGhosts(self.packed, self.slots)

    def accessed(self, key: Key, info: BlockInfo) -> None:
        if self.packed_counts:
            self.packed.accessed(self.slots.digest(key), info.from_end)
        else:
            super().accessed(key, info)

    def _old_uses(self, slot: int) -> int:
        return self.sketch.count(self.slots.keys[slot])

    def new_tier(self, tier: str, fallback: str | None, capacity_bytes: int) -> TierPolicy:
        if self.name == "kvtier" and not self.packed_counts:
            # Uses from policy.py's sketch, as ValuePolicy and ChainArcPolicy read them.
            policy: SlotPolicy = (
                PackedChainArc(self._old_uses, self.slots.digest_of)
                if fallback is not None
                else PackedValue(
                    tier,
                    fallback,
                    self.model,
                    self._old_uses,
                    self.slots.digest_of,
                    reach_net=True,
                )
            )
        else:
            policy = self.packed.new_tier(tier, fallback, capacity_bytes)
        return KeyedTier(policy, self.slots)
