"""Page-aligned memory: what O_DIRECT I/O and the arena's record writes need. Core, so the
tiers (which format records into such buffers) and the movers (which time copies between
them) share it without importing each other."""

from __future__ import annotations

import mmap

PAGE_BYTES = mmap.PAGESIZE


def aligned_buffer(size_bytes: int) -> mmap.mmap:
    """A zero-filled, page-aligned buffer (what O_DIRECT needs), of at least one page."""
    return mmap.mmap(-1, max(size_bytes, PAGE_BYTES))
