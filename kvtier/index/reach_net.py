"""The NVMe order's safety net (ValuePolicy's and PackedValue's `reach_net`; issue 26).

DRAM's net (ValuePolicy's `shadow`) is scored by touches: every request of a block reaches
DRAM as a hit or an insert. NVMe's inserts are demotions, not requests, so this net is
scored by the requests that reach the tier (`reached`: no tier above held the block):
served here and not in the shadow LRU is a point for the value order; asked for, held by
no tier, and in the shadow one for recency, after which the key is marked (most recent,
as an LRU tier's hit would make it) so that an engine's scheduler asking about a waiting
request at every step scores its miss once. The shadow sees the tier's inserts and hits
without scoring them.

Sampled: one key digest in 2**SAMPLE_SHIFT (its top bits, independent of the low bits the
tables index by), a shadow of as many keys as that share of the tier, each sampled event
counting for the rest (a miniature simulation, Waldspurger et al., ATC'17): ~3 B a block
where a whole shadow would be ~26.
"""

from __future__ import annotations

import numpy as np

from kvtier.index.slots import DigestTable

__all__ = ["REACH_STEP", "SAMPLE_SHIFT", "ReachNet", "in_sample"]

SAMPLE_SHIFT = 3
# The weight's move a point: a tenth of DRAM's net's 0.01, since the value order's lead on
# NVMe is long-term (blocks kept for hundreds of requests) and at 0.01 a burst of the
# shared trace took the weight to 0 (BENCHMARKS.md, 2026-12-07); a sampled event counts 8.
REACH_STEP = 0.001 * (1 << SAMPLE_SHIFT)


def in_sample(digest: int) -> bool:
    return digest >> (64 - SAMPLE_SHIFT) == 0


class ReachNet:
    """The sampled shadow, by key digest: 0 for a key, 1 once its miss was scored."""

    def __init__(self) -> None:
        self._shadow = DigestTable()

    def touched(self, digest: int, blocks: int) -> None:
        """The tier inserted or hit the block, holding `blocks` blocks now."""
        if in_sample(digest):
            self._shadow.put(digest, 0, to_end=True)
            self._shadow.trim(max(blocks >> SAMPLE_SHIFT, 1))

    def touched_many(self, digests: np.ndarray, blocks: int) -> None:
        """`touched` of each digest in order, the tier holding `blocks` blocks before the
        first and one more at each (a run of inserts); only the sampled ones reach Python."""
        top_bits = digests.astype(np.uint64) >> np.uint64(64 - SAMPLE_SHIFT)
        for i in np.flatnonzero(top_bits == 0).tolist():
            self.touched(int(digests[i]), blocks + i + 1)

    def reached(self, digest: int, held: bool) -> float:
        """A request reached the tier (TierPolicy.reached); the weight's move."""
        if not in_sample(digest):
            return 0.0
        scored = self._shadow.get(digest)
        if held:
            return REACH_STEP if scored < 0 else 0.0
        if scored != 0:
            return 0.0
        self._shadow.put(digest, 1, to_end=True)
        return -REACH_STEP
