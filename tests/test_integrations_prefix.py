"""The engine-side prefix logic every connector shares (kvtier.integrations.prefix)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvtier import PlanResult
from kvtier.integrations.prefix import (
    RequestState,
    engine_namespace,
    loadable_blocks,
    prefix_load_end,
    request_keys,
)
from kvtier.keys import check_namespace

TOKENS = st.lists(st.integers(0, 50_000), max_size=600)


@given(st.text(max_size=200), st.sampled_from(["bfloat16", "float16", "fp8 e4m3"]))
def test_a_namespace_is_valid_for_any_model_name(model: str, dtype: str) -> None:
    ns = engine_namespace(model, dtype, 128, "l32x65536", 1, 2)
    assert check_namespace(ns, 256) == ns
    assert ns.endswith("-b128-l32x65536-tp1of2")


def test_namespaces_differ_with_anything_that_changes_the_bytes() -> None:
    base = engine_namespace("meta/llama-3-8b", "bfloat16", 16, "l32x4096")
    assert engine_namespace("other/llama-3-8b", "bfloat16", 16, "l32x4096") != base
    assert engine_namespace("meta/llama-3-8b", "float16", 16, "l32x4096") != base
    assert engine_namespace("meta/llama-3-8b", "bfloat16", 32, "l32x4096") != base
    assert engine_namespace("meta/llama-3-8b", "bfloat16", 16, "l32x8192") != base
    assert engine_namespace("meta/llama-3-8b", "bfloat16", 16, "l32x4096", 1, 2) != base


@given(TOKENS, TOKENS, st.integers(1, 64))
def test_keys_name_prefixes(a: list[int], b: list[int], block: int) -> None:
    ka, kb = request_keys("m/x", a, block, None), request_keys("m/x", b, block, None)
    assert len(ka) == len(a) // block
    for i in range(min(len(ka), len(kb))):
        same_prefix = a[: (i + 1) * block] == b[: (i + 1) * block]
        assert (ka[i] == kb[i]) == same_prefix
    if ka:
        assert request_keys("m/x", a, block, "tenant-salt")[0] != ka[0]


@given(st.integers(0, 100_000), st.integers(1, 1024))
def test_loadable_blocks_leave_the_last_token_to_compute(prompt: int, block: int) -> None:
    n = loadable_blocks(prompt, block)
    assert n * block < max(prompt, 1)  # at least one token computed
    assert (n + 1) * block >= prompt  # and no whole block more could load


@st.composite
def plans(draw: st.DrawFn) -> PlanResult:
    n = draw(st.integers(0, 12))
    engine = draw(st.integers(0, n))
    cached_end = draw(st.integers(engine, n))
    tiers = [None] * engine + ["dram"] * (cached_end - engine) + [None] * (n - cached_end)
    start = draw(st.integers(engine, cached_end))
    end = draw(st.integers(start, cached_end))
    cost = st.floats(0.0, 1.0, allow_nan=False)
    return PlanResult(
        total_s=0.0,
        recompute_all_s=0.0,
        fetch_all_s=0.0,
        engine_blocks=engine,
        fetch_start=start,
        fetch_end=end,
        reason="",
        tiers=tiers,  # type: ignore[arg-type]
        fetch_s=[draw(cost) for _ in range(n)],
        recompute_s=[draw(cost) for _ in range(n)],
    )


@given(plans())
def test_a_load_is_a_prefix_the_plan_allows(plan: PlanResult) -> None:
    end = prefix_load_end(plan)
    e = plan.engine_blocks
    assert e <= end <= len(plan.tiers)
    assert all(t is not None for t in plan.tiers[e:end])  # only cached blocks load
    if plan.fetch_start == e:
        assert end == plan.fetch_end  # the planner's own prefix run is taken as it is
        return

    def saving(k: int) -> float:
        return sum(plan.recompute_s[i] - plan.fetch_s[i] for i in range(e, k))

    cached = next((i for i in range(e, len(plan.tiers)) if plan.tiers[i] is None), len(plan.tiers))
    best = max(saving(k) for k in range(e, cached + 1))
    assert abs(saving(end) - best) < 1e-9  # no prefix saves more
    assert end == e or saving(end) > 0


@given(
    st.integers(1, 2000),
    st.sampled_from([16, 32, 128]),
    st.integers(0, 40),
    st.lists(st.integers(1, 700), min_size=1, max_size=40),
)
def test_each_complete_prompt_block_is_saved_once_and_only_once_computed(
    prompt: int, block: int, loaded_blocks: int, chunks: list[int]
) -> None:
    tokens = list(range(prompt))
    keys = request_keys("m/x", tokens, block, None)
    state = RequestState(keys, prompt, block, block_ids=list(range(100, 100 + len(keys) + 1)))
    loaded_blocks = min(loaded_blocks, loadable_blocks(prompt, block))
    state.load_from, state.load_to = 0, loaded_blocks
    loaded = state.take_load()
    assert [k for k, _ in loaded] == keys[:loaded_blocks]
    assert state.take_load() == []  # taken once
    saved: list[bytes] = []
    computed = loaded_blocks * block
    for chunk in chunks:
        computed += chunk
        for key, block_id in state.saves_after(computed):
            index = keys.index(key)
            assert block_id == 100 + index
            assert (index + 1) * block <= min(computed, prompt)  # complete when saved
            saved.append(key)
    assert len(saved) == len(set(saved))
    assert not set(saved) & {k for k, _ in loaded}  # what was loaded is not saved back
    complete = min(computed, prompt) // block
    assert sorted(saved) == sorted(keys[loaded_blocks:complete])
