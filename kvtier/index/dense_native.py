"""A tenant's DRAM order in C where it was built (kvtier/index/_arc_native.c), else the
Python pair it stands for: DenseOrder over PackedChainArc.

The native order makes the same decisions for the same calls (tests/index/
test_dense_native.py replays random call sequences against the Python pair); what it saves
is the daemon loop's time, ~20-30 µs a streamed block of ~130-160 (BENCHMARKS.md). The
extension is optional at build time: without a C compiler `pip install` goes on without
it and `dram_order` returns the Python pair. `KVTIER_NATIVE=0` asks for the Python pair
where the extension exists (A/B measurements; the tests run both).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvtier.env import ENV_NATIVE, python_twins_asked_for
from kvtier.index.slot_policy import SlotPolicy

__all__ = ["NATIVE", "dram_order", "implementation", "native_order_type"]


def native_order_type() -> type[SlotPolicy] | None:
    """The native order as a SlotPolicy (so it inherits insert_many and insert_run), or
    None where the extension was not built."""
    try:
        from kvtier.index._arc_native import DenseChainArc
    except ImportError:
        return None

    class NativeDenseChainArc(DenseChainArc, SlotPolicy):
        """DenseOrder over PackedChainArc, native (kvtier/index/_arc_native.c)."""

    return NativeDenseChainArc


NATIVE = native_order_type()


def dram_order(
    python_pair: Callable[[], SlotPolicy],
    digest_of: Callable[[int], int],
    count: Callable[[int], int],
    step: float,
) -> SlotPolicy:
    """The native order over catalog slots (`digest_of(slot)`: its key digest; `count`:
    the sketch's uses by digest; `step`: ChainArcPolicy.STEP), or `python_pair()` where
    the extension is missing or KVTIER_NATIVE=0."""
    if NATIVE is None or python_twins_asked_for():
        return python_pair()
    return NATIVE(digest_of, count, step)  # type: ignore[call-arg]


def implementation(orders: Iterable[SlotPolicy]) -> str:
    """Where DRAM's orders run, for the daemon's start-up log: in C, or in Python and why."""
    orders = list(orders)
    if orders and NATIVE is not None and all(isinstance(o, NATIVE) for o in orders):
        return "in C (kvtier/index/_arc_native.c)"
    if NATIVE is None:
        why = "the C extension was not built"
    elif python_twins_asked_for():
        why = f"{ENV_NATIVE}=0"
    else:
        why = "this policy has no C order"
    return f"in Python ({why})"
