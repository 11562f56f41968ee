"""The write area's staging range on the client: one put holds it at a time, and a put
interrupted while the client was taking it for that put lets it go."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from kvtier.client import _core
from kvtier.client.write_area import WriteArea


@pytest.fixture
def area() -> Iterator[WriteArea]:
    made = WriteArea(os.memfd_create("kvtier-test-write-area"))
    yield made
    made.close()


def test_a_put_interrupted_as_the_range_was_taken_for_it_lets_it_go(area: WriteArea) -> None:
    assert area.hold_staging()  # another put holds it
    waiting = _core._hold(area)
    step = next(waiting)
    assert isinstance(step, _core.HoldStaging)
    area.drop_staging()  # the other put ends...
    assert area.hold_staging(holder=step)  # ...and the client takes it for this one
    with pytest.raises(KeyboardInterrupt):
        waiting.throw(KeyboardInterrupt())  # Ctrl-C before the put heard it had it
    assert area.hold_staging(), "the range stayed held by an interrupted put"
    area.drop_staging()


def test_an_interrupted_wait_leaves_anothers_range_alone(area: WriteArea) -> None:
    assert area.hold_staging(holder="another put")
    waiting = _core._hold(area)
    next(waiting)
    with pytest.raises(KeyboardInterrupt):
        waiting.throw(KeyboardInterrupt())  # interrupted while still waiting
    assert not area.hold_staging()  # still the other put's
    area.drop_staging()
    assert area.hold_staging()


def test_the_range_waits_up_to_its_timeout(area: WriteArea) -> None:
    assert area.hold_staging()
    assert not area.hold_staging(0.05)
    area.drop_staging()
    assert area.hold_staging(0.05)
