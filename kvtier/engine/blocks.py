"""The two handles a transfer of one block holds while it runs: a `PutWriter` filling a
reserved DRAM extent, a `BlockReader` over a pinned block's bytes."""

from __future__ import annotations

import functools
import mmap
from collections.abc import Callable, Iterator

import xxhash

from kvtier.errors import InvalidArgument
from kvtier.index.catalog import Entry
from kvtier.tiers.allocator import round_up
from kvtier.tiers.record import ALIGN_BYTES, RecordHeader, header_size_for
from kvtier.types import BlockId, Extent, TierName

COPY_PIECE_BYTES = 256 << 10


def record_header(entry: Entry) -> RecordHeader:
    """The NVMe record header of a block's current value."""
    ns_id, key = entry.block_id
    return RecordHeader(
        ns_id=ns_id,
        key=key,
        generation=entry.generation,
        payload_bytes=entry.size_bytes,
        xxh3_64=entry.xxh3_64,
        header_bytes=_header_bytes(ns_id, len(key)),
    )


@functools.lru_cache(maxsize=1024)
def _header_bytes(ns_id: str, key_bytes: int) -> int:
    # A demotion builds a header a record: the namespace is encoded once a (namespace,
    # key length), not once a record.
    return header_size_for(ns_id, bytes(key_bytes))


def record_location(entry: Entry) -> int:
    """Where a block's NVMe record lies, for the tier to find it by (the segment layout's
    location; 0 for the file layout, which finds records by name)."""
    return entry.nvme_location


def payload_of(extent_view: memoryview, entry: Entry) -> memoryview:
    """The part of a block's DRAM extent its NVMe record holds: the payload rounded up
    to 4 KiB (an empty block still has a 4 KiB extent, but no payload on disk)."""
    return extent_view[: round_up(entry.size_bytes, ALIGN_BYTES)]


def intact(view: memoryview, entry: Entry) -> bool:
    """Whether a DRAM copy still holds the bytes committed for `entry` (its xxh3-64)."""
    return bool(xxhash.xxh3_64_intdigest(view[: entry.size_bytes]) == entry.xxh3_64)


class PutWriter:
    """Bytes of one block arriving into its reserved DRAM extent."""

    def __init__(
        self, block_id: BlockId, size_bytes: int, overwrite: bool, extent: Extent, view: memoryview
    ) -> None:
        self.block_id = block_id
        self.size_bytes = size_bytes
        self.overwrite = overwrite
        self.extent = extent
        self._view = view
        self._hasher = xxhash.xxh3_64()
        self.received_bytes = 0
        self.done = False

    def write(self, chunk: bytes | bytearray | memoryview) -> None:
        end = self.received_bytes + len(chunk)
        if end > self.size_bytes:
            raise InvalidArgument(
                f"put stream carries more than the {self.size_bytes} bytes its header declared"
            )
        self._view[self.received_bytes : end] = chunk
        self._hasher.update(chunk)
        self.received_bytes = end

    def digest(self) -> int:
        return int(self._hasher.intdigest())

    def written_in_place(self) -> None:
        """The whole slot was written in place, by the daemon itself (the GPU path's
        device-to-host copy): hash what the extent holds."""
        self._hasher = xxhash.xxh3_64(self._view[: self.size_bytes])
        self.received_bytes = self.size_bytes

    def copy_in(self, source: memoryview) -> None:
        """Copy the block from a client's write area into the extent (zero-copy put),
        hashing the copy, not the source: the client can still change the source while
        this runs, never the bytes hashed. In cache-sized pieces, so each is hashed while
        it is still in cache."""
        hasher = xxhash.xxh3_64()
        view = self._view
        for start in range(0, self.size_bytes, COPY_PIECE_BYTES):
            end = min(start + COPY_PIECE_BYTES, self.size_bytes)
            view[start:end] = source[start:end]
            hasher.update(view[start:end])
        self._hasher = hasher
        self.received_bytes = self.size_bytes

    def copy_in_piece(self, source: memoryview) -> None:
        """`copy_in` a piece at a time, in order (a streamed one-exchange put copies
        each piece as soon as the client has written it): the copy is hashed, not the
        source, as there."""
        end = self.received_bytes + source.nbytes
        if end > self.size_bytes:
            raise InvalidArgument(f"more than the block's {self.size_bytes} bytes")
        place = self._view[self.received_bytes : end]
        place[:] = source
        self._hasher.update(place)
        self.received_bytes = end

    def release(self) -> None:
        self._view.release()


class BlockReader:
    """A pinned block's bytes, valid until `close()`."""

    def __init__(
        self,
        entry: Entry,
        tier: TierName,
        data: memoryview,
        unpin: Callable[[Entry], None],
        backing: mmap.mmap | None = None,
    ) -> None:
        self._unpin = unpin
        self._entry = entry
        self.tier = tier
        self.size_bytes = entry.size_bytes
        self.xxh3_64 = entry.xxh3_64
        self._data = data
        self._backing = backing
        self._closed = False

    def chunks(self, chunk_bytes: int) -> Iterator[memoryview]:
        """Views of the block's bytes; valid until `close()` (the block stays pinned)."""
        for start in range(0, self.size_bytes, chunk_bytes):
            yield self._data[start : start + chunk_bytes]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Chunk views may outlive this call inside gRPC's buffers, so the NVMe read buffer
        # is left to the garbage collector rather than closed here.
        del self._data, self._backing
        self._unpin(self._entry)
