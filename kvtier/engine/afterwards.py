"""Work a reply need not wait for, done right after the reply is sent.

A zero-copy put's reply says only whether its bytes were accepted, which is known once
they are copied, hashed and checked; cataloguing the block (the catalog, the policy's
orders) took ~50 µs more on the loop before the reply left. The session socket runs that
work after it writes the reply, in the same callback: the client's next copy and the
daemon's bookkeeping then overlap on two CPUs.

Safe because nothing else runs on the loop between the reply and the work: every other
request, on any session or gRPC, sees the block catalogued. (What a client reads without
asking the loop, the directory, is published before the reply.) So work is deferred only
while the transport is `armed`: it sets that while it runs a handler inline, in the read
callback, and calls `run()` as soon as the handler returns (after writing its reply) or
first waits (before anything else can run). Anywhere else `later` is not called: the
work is done at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvtier.types import BlockId

logger = logging.getLogger(__name__)


class Afterwards:
    """Work deferred until the current reply is sent: `later(block, work)`, then
    `run()`. A request that touches a block with work due runs it all first
    (`block in afterwards`), so each block's changes keep their order."""

    def __init__(self) -> None:
        self.armed = False  # set by the transport: a reply, then `run()`, follow at once
        self._due: list[Callable[[], None]] = []
        self._blocks: set[BlockId] = set()

    def __bool__(self) -> bool:
        return bool(self._due)

    def __contains__(self, block_id: BlockId) -> bool:
        return block_id in self._blocks

    def later(self, block_id: BlockId, work: Callable[[], None]) -> None:
        """Defer `work`, which changes `block_id` (only while armed)."""
        self._due.append(work)
        self._blocks.add(block_id)

    def run(self) -> None:
        """Do what is due, in the order it was deferred. A failure is logged: the reply
        that went out cannot be taken back, and the rest still runs."""
        if not self._due:
            return
        due, self._due = self._due, []
        self._blocks.clear()
        for work in due:
            try:
                work()
            except Exception:
                logger.exception("work deferred past a reply failed")
