"""The hint table against a plain reference model, over random sequences of operations."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.index.hints import HintTable

KEYS = st.integers(0, 11)


@dataclass
class _RefHint:
    hint_id: int
    expires_s: float
    keys: list[int]
    pending: set[int] = field(default_factory=set)


class _Reference:
    """The same contract written the slow, obvious way."""

    def __init__(self, max_hints: int, max_keys: int) -> None:
        self.max_hints, self.max_keys = max_hints, max_keys
        self.hints: list[_RefHint] = []
        self.next_id = 1

    def held(self) -> set[int]:
        return {k for h in self.hints for k in h.pending}

    def expire(self, now_s: float) -> set[int]:
        before = self.held()
        self.hints = [h for h in self.hints if h.expires_s > now_s]
        return before - self.held()

    def add(self, keys: list[int], now_s: float, ttl_s: float) -> tuple[int, set[int]]:
        before = self.held()
        self.expire(now_s)
        chain = list(dict.fromkeys(keys))[: self.max_keys]
        if not chain or ttl_s <= 0:
            return 0, before - self.held()
        while self.hints and (
            len(self.hints) >= self.max_hints
            or sum(len(h.pending) for h in self.hints) + len(chain) > self.max_keys
        ):
            self.hints.pop(0)
        self.hints.append(_RefHint(self.next_id, now_s + ttl_s, chain, set(chain)))
        self.next_id += 1
        return len(chain), before - self.held()

    def protected(self, key: int, now_s: float) -> bool:
        return any(key in h.pending and h.expires_s > now_s for h in self.hints)

    def use(self, key: int) -> bool:
        holders = [h for h in self.hints if key in h.pending]
        if not holders:
            return False
        first = min(holders, key=lambda h: (h.expires_s, h.hint_id))
        first.pending.discard(key)
        if not first.pending:
            self.hints.remove(first)
        return key not in self.held()

    def to_promote(self, now_s: float, wanted: set[int], most: int) -> list[int]:
        out: list[int] = []
        for h in sorted(self.hints, key=lambda h: (h.expires_s, h.hint_id)):
            if h.expires_s <= now_s:
                continue
            for key in h.keys:
                if key in h.pending and key in wanted and key not in out:
                    out.append(key)
        return out[:most]


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.lists(KEYS, max_size=8), st.integers(0, 5)),
        st.tuples(st.just("use"), KEYS),
        st.tuples(st.just("tick"), st.integers(0, 3)),
        st.tuples(st.just("promote"), st.frozensets(KEYS), st.integers(1, 6)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, max_hints=st.integers(1, 4), max_keys=st.integers(1, 10))
def test_matches_the_reference(
    ops: list[tuple[object, ...]], max_hints: int, max_keys: int
) -> None:
    table: HintTable[int] = HintTable(max_hints, max_keys)
    ref = _Reference(max_hints, max_keys)
    now_s = 0.0
    for op in ops:
        match op:
            case ("add", keys, ttl):
                assert isinstance(keys, list) and isinstance(ttl, int)
                added = table.add(keys, now_s, float(ttl))
                accepted, released = ref.add(keys, now_s, float(ttl))
                assert added.accepted == accepted
                assert (added.hint_id != 0) == (accepted > 0)
                assert set(added.released) == released
            case ("use", key):
                assert isinstance(key, int)
                assert table.use(key) == ref.use(key)
            case ("tick", dt):
                assert isinstance(dt, int)
                now_s += dt
                assert set(table.expire(now_s)) == ref.expire(now_s)
            case ("promote", wanted, most):
                assert isinstance(wanted, frozenset) and isinstance(most, int)
                got = table.to_promote(now_s, wanted.__contains__, most)
                assert got == ref.to_promote(now_s, set(wanted), most)
        # The bounds hold after every operation, and protection is exactly the model's.
        assert len(table) <= max_hints
        assert table.keys_held <= max_keys
        for key in range(12):
            assert table.protected(key, now_s) == ref.protected(key, now_s), key


@given(keys=st.lists(KEYS, min_size=1, max_size=8, unique=True))
def test_a_key_shared_by_two_waiting_requests_stays_protected_after_one_load(
    keys: list[int],
) -> None:
    table: HintTable[int] = HintTable(8, 64)
    table.add(keys, 0.0, 10.0)
    table.add(keys, 1.0, 10.0)
    for key in keys:
        assert table.use(key) is False  # the second request still waits for it
        assert table.protected(key, 2.0)
    for key in keys:
        assert table.use(key) is True
        assert not table.protected(key, 2.0)
    assert len(table) == 0 and table.keys_held == 0


def test_expiry_releases_and_nearest_deadline_comes_first() -> None:
    table: HintTable[str] = HintTable(8, 64)
    table.add(["late"], 0.0, 9.0)
    table.add(["soon", "soon2"], 0.0, 2.0)
    assert table.to_promote(0.0, lambda k: True, 10) == ["soon", "soon2", "late"]
    assert table.protected("soon", 1.9)
    assert not table.protected("soon", 2.0)  # expired at its deadline, before expire()
    assert sorted(table.expire(2.0)) == ["soon", "soon2"]
    assert table.to_promote(2.0, lambda k: True, 10) == ["late"]


def test_a_client_cannot_grow_the_table_past_its_bounds() -> None:
    table: HintTable[int] = HintTable(4, 10)
    for i in range(1000):
        table.add(range(i, i + 7), float(i), 1e9)
    assert len(table) <= 4 and table.keys_held <= 10
    assert table.protected(999, 999.0)  # the newest survives, cut to the table's size
    assert not table.protected(0, 999.0)


def test_a_load_ends_the_claim_of_the_request_served_first() -> None:
    # Two waiting requests share block 5; the first (nearest deadline) is served and loads
    # it: the second's claim must outlive the first's deadline.
    table: HintTable[int] = HintTable(8, 64)
    table.add([5, 6], 0.0, 2.0)
    table.add([5, 7], 0.0, 9.0)
    assert table.use(5) is False
    assert table.expire(2.0) == [6]
    assert table.protected(5, 3.0)
    assert table.to_promote(3.0, lambda k: True, 10) == [5, 7]
