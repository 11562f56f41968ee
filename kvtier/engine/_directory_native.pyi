from collections.abc import Callable

from kvtier.types import BlockId, Extent

LAYOUT: tuple[int, int, int, int, int, int, int, int, int]

class DirectoryCore:
    """Directory's per-block work in C (kvtier/engine/_directory_native.c)."""

    @property
    def unpublished_full(self) -> int: ...
    def __init__(
        self,
        table: object,
        entries: int,
        key_digest: Callable[[bytes, bytes], tuple[int, int]],
        namespace_of: Callable[[str], bytes],
        align_bytes: int,
    ) -> None: ...
    def publish(
        self,
        block_id: BlockId,
        offset: int,
        size_bytes: int,
        xxh3_64: int,
        generation: int,
        namespace: bytes | None = None,
    ) -> bool: ...
    def unpublish(self, block_id: BlockId) -> None: ...
    def unpublish_extent(self, extent: Extent) -> None: ...
    def release(self) -> None: ...
    def __len__(self) -> int: ...
