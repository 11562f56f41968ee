"""Per-tenant call caps (kvtier.server.admission): refused at once past a cap, naming it;
a refusal takes nothing; a slot is given back once however often it is released; tenants
never share a cap; reloads apply to the calls admitted afterwards."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.config import Config
from kvtier.errors import ResourceExhausted
from kvtier.keys import hash_token
from kvtier.server.admission import CallCaps, CallSlots, Slot, node_cap_warning, tenants_of

CAPS = CallCaps(calls_per_tenant=4, watchers_per_tenant=2, node_calls=6)


def test_a_tenant_at_its_call_cap_is_refused_naming_the_limit() -> None:
    slots = CallSlots(CAPS)
    held = [slots.enter("bob") for _ in range(4)]
    with pytest.raises(ResourceExhausted) as caught:
        slots.enter("bob")
    assert "limits.max_calls_per_tenant (4) calls in flight for tenant bob" in str(caught.value)
    assert slots.calls("bob") == 4  # the refusal took nothing
    held[0].release()
    slots.enter("bob")  # a released slot is usable again


def test_watchers_have_their_own_cap_and_count_as_calls() -> None:
    slots = CallSlots(CAPS)
    slots.enter("bob", watcher=True)
    slots.enter("bob", watcher=True)
    with pytest.raises(ResourceExhausted) as caught:
        slots.enter("bob", watcher=True)
    assert "limits.max_watchers_per_tenant (2) WatchEvents streams open for tenant bob" in str(
        caught.value
    )
    assert (slots.calls("bob"), slots.watchers("bob")) == (2, 2)
    slots.enter("bob")  # other calls still fit under max_calls_per_tenant
    slots.enter("bob")
    with pytest.raises(ResourceExhausted, match=r"limits\.max_calls_per_tenant"):
        slots.enter("bob")


def test_one_tenant_at_its_cap_leaves_the_others_their_own() -> None:
    slots = CallSlots(CallCaps(calls_per_tenant=4, watchers_per_tenant=2, node_calls=100))
    for _ in range(4):
        slots.enter("mallory")
    with pytest.raises(ResourceExhausted):
        slots.enter("mallory")
    for _ in range(4):
        slots.enter("alice")
    assert (slots.calls("alice"), slots.calls("mallory"), slots.total) == (4, 4, 8)


def test_the_node_cap_refuses_once_all_tenants_together_reach_it() -> None:
    slots = CallSlots(CAPS)
    for tenant in ("a", "a", "a", "b", "b", "b"):
        slots.enter(tenant)
    with pytest.raises(ResourceExhausted) as caught:
        slots.enter("c")
    assert "server.max_concurrent_rpcs (6) calls in flight on this node" in str(caught.value)
    assert slots.calls("c") == 0 and slots.total == 6


def test_a_slot_is_given_back_once_however_often_it_is_released() -> None:
    slots = CallSlots(CAPS)
    slot = slots.enter("bob", watcher=True)
    other = slots.enter("bob", watcher=True)
    for _ in range(3):  # e.g. the handler's finally and gRPC's done callback both release
        slot.release()
    assert (slots.calls("bob"), slots.watchers("bob"), slots.total) == (1, 1, 1)
    other.release()
    assert (slots.calls("bob"), slots.watchers("bob"), slots.total) == (0, 0, 0)
    assert not slots._calls and not slots._watchers  # idle tenants leave no entries


def test_a_reload_applies_to_calls_admitted_afterwards() -> None:
    slots = CallSlots(CAPS)
    held = [slots.enter("bob") for _ in range(4)]
    slots.reconfigure(CallCaps(calls_per_tenant=2, watchers_per_tenant=2, node_calls=6))
    assert slots.calls("bob") == 4  # calls in flight keep their slots
    for slot in held[:2]:
        slot.release()
    with pytest.raises(ResourceExhausted, match=r"max_calls_per_tenant \(2\)"):
        slots.enter("bob")  # 2 in flight: at the lowered cap
    held[2].release()
    slots.enter("bob")
    slots.reconfigure(CallCaps(calls_per_tenant=8, watchers_per_tenant=2, node_calls=6))
    slots.enter("bob")  # a raised cap admits at once


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["enter", "watch", "release"]), st.sampled_from("abc")),
        max_size=80,
    ),
    data=st.data(),
)
def test_counts_match_what_is_held_and_never_pass_a_cap(
    ops: list[tuple[str, str]], data: st.DataObject
) -> None:
    slots = CallSlots(CAPS)
    held: list[Slot] = []
    for op, tenant in ops:
        if op == "release":
            if held:
                held.pop(data.draw(st.integers(0, len(held) - 1))).release()
            continue
        watcher = op == "watch"
        fits = (
            sum(s.tenant == tenant for s in held) < CAPS.calls_per_tenant
            and len(held) < CAPS.node_calls
            and (not watcher or sum(s.tenant == tenant and s.watcher for s in held) < 2)
        )
        if fits:
            held.append(slots.enter(tenant, watcher))
        else:
            with pytest.raises(ResourceExhausted):
                slots.enter(tenant, watcher)
        assert slots.total == len(held) <= CAPS.node_calls
        for t in "abc":
            assert slots.calls(t) == sum(s.tenant == t for s in held) <= CAPS.calls_per_tenant
            assert slots.watchers(t) == sum(s.tenant == t and s.watcher for s in held) <= 2


def _config(tenants: list[str], node_calls: int, per_tenant: int) -> Config:
    return Config.model_validate(
        {
            "server": {"max_concurrent_rpcs": node_calls},
            "limits": {"max_calls_per_tenant": per_tenant},
            "auth": {"tokens": {hash_token(f"token-{t}"): t for t in tenants}},
            "tenants": {t: {"dram_capacity_bytes": "1MiB"} for t in tenants},
        }
    )


def test_caps_come_from_the_configuration() -> None:
    caps = CallCaps.of(_config(["alice"], node_calls=300, per_tenant=7))
    assert caps == CallCaps(calls_per_tenant=7, watchers_per_tenant=8, node_calls=300)


@pytest.mark.parametrize(
    ("tenants", "node_calls", "per_tenant", "warned"),
    [
        ([], 256, 64, False),  # no tokens: 'default' alone
        (["a", "b", "c", "d"], 256, 64, False),
        (["a", "b", "c", "d", "e"], 256, 64, True),
        (["a", "b"], 100, 64, True),
    ],
)
def test_a_node_cap_below_the_tenants_caps_is_warned_about(
    tenants: list[str], node_calls: int, per_tenant: int, warned: bool
) -> None:
    config = _config(tenants, node_calls, per_tenant)
    assert tenants_of(config) == (set(tenants) or {"default"})
    warning = node_cap_warning(config)
    assert (warning is not None) == warned
    if warning is not None:
        assert f"raise server.max_concurrent_rpcs to {len(tenants) * per_tenant}" in warning
