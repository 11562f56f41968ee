"""The store's side of the remote tier: its I/O threads, its health, the codec decision,
and the order of operations on one block (the moving half; the store decides).

Every operation the store starts on a block's remote value (put, delete) runs after the
previous one on the same block has finished, so a delete acknowledged before an overwrite
cannot land after the new value and remove it, and an old value's put cannot land after a
delete. Fetches are not ordered: any value they find is verified, old or new.

A put is two steps: `encode` copies the block out of DRAM into its value (the caller pins
the block for that copy only), `send` puts the value. So a slow store holds values in
memory, bounded by `remote.max_pending_bytes` (beyond it a block is not put: a cache may
skip), never this node's DRAM.

The codec decision reads the wire's bandwidth (value bytes over the store's round trip),
not the path's (which includes decoding): with the codec on, the path looks slower by
the decode time, and deciding on that would keep it on past its break-even.

Errors never reach a client: a store that cannot be reached is a miss (and, after
`remote.offline_after_errors` in a row, the tier is offline until a probe gets through).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from kvtier.config import RemoteConfig
from kvtier.engine.health import TierHealth
from kvtier.errors import CorruptRecord
from kvtier.index.catalog import BlockId
from kvtier.index.estimators import PathEstimator
from kvtier.index.planner import TierCost
from kvtier.movers.io import IoPool
from kvtier.tiers.remote import Fetched, RemoteTier

logger = logging.getLogger(__name__)
T = TypeVar("T")
_PROBE_NAME = ("kvtier-probe|", b"probe")


class RemoteLink:
    """Create, `await open()`, use from the event loop, `await close()`."""

    def __init__(self, config: RemoteConfig, seed: TierCost) -> None:
        self.config = config
        self.io = IoPool(config.io_threads, name="kvtier-remote")
        self.health = TierHealth("remote", config.offline_after_errors)
        self.tier: RemoteTier | None = None
        self.wire = PathEstimator(seed)  # value bytes over the store's round trip
        self.pending_bytes = 0  # encoded values not yet sent
        self.skipped = 0  # puts not made: max_pending_bytes reached
        self._tails: dict[BlockId, asyncio.Future[Any]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._watcher: asyncio.Task[None] | None = None
        self.failures = 0  # operations that failed (counted whether or not it went offline)

    async def open(self) -> None:
        """Connect (a client library missing or a store refusing us is a ConfigError)."""
        self.tier = await self.io.run(RemoteTier.from_config, self.config)
        self._watcher = asyncio.ensure_future(self._watch_forever())
        logger.info(
            "remote tier: %s at %s (admission %s, codec %s)",
            self.tier.name,
            self.config.url,
            self.config.admission,
            self.config.codec,
        )

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self.io.close()
        if self.tier is not None:
            self.tier.close()

    @property
    def online(self) -> bool:
        return self.tier is not None and self.health.online

    # ---- reads --------------------------------------------------------------------------
    async def probe(self, block_ids: Sequence[BlockId]) -> list[bool]:
        """Which of these blocks the store holds (one round trip); all False if it cannot
        say."""
        if not block_ids:
            return []
        ok, found = await self._store_call("look up blocks", lambda t: t.exists(block_ids))
        return found if ok and found is not None else [False] * len(block_ids)

    async def fetch(self, block_id: BlockId, max_payload_bytes: int) -> Fetched | None:
        """The block's value, header verified; None for a miss (absent, bad, unreachable).
        Raises CorruptRecord for a value that failed verification (the caller counts it)."""
        _, fetched = await self._store_call(
            "fetch a block", lambda t: t.fetch(*block_id, max_payload_bytes)
        )
        if fetched is not None:
            self.wire.observe(len(fetched.value), fetched.fetch_s)
        return fetched

    async def _store_call(
        self, doing: str, call: Callable[[RemoteTier], T]
    ) -> tuple[bool, T | None]:
        """`call` on the tier, on the remote I/O threads: (True, its result), or (False,
        None) when the tier is offline or the store failed (counted toward offline)."""
        tier = self.tier
        if tier is None or not self.health.online:
            return False, None
        try:
            result = await self.io.run(call, tier)
        except OSError as err:
            self._failed(err, doing)
            return False, None
        self.health.succeeded()
        return True, result

    async def fill(self, fetched: Fetched, dest: memoryview) -> float:
        """Decode and verify into `dest` on an I/O thread; seconds it took."""
        assert self.tier is not None
        _, fill_s = await self.io.run_timed(self.tier.fill, fetched, dest)
        return fill_s

    # ---- writes, in order per block -----------------------------------------------------
    async def encode(
        self, block_id: BlockId, generation: int, payload: memoryview, xxh3_64: int
    ) -> bytes | None:
        """The block's value, copied out of `payload` (which the caller keeps valid until
        this returns); None when it is not to be put (offline, or too much pending)."""
        if not self.online:
            return None
        assert self.tier is not None
        if self.pending_bytes + len(payload) > self.config.max_pending_bytes:
            self.skipped += 1
            return None
        encoded = self.tier.use_codec(self.wire.estimate().bandwidth_bytes_per_s)
        self.pending_bytes += len(payload)
        try:
            return await self.io.run(
                self.tier.encode, *block_id, generation, payload, xxh3_64, encoded
            )
        except BaseException:
            self.pending_bytes -= len(payload)
            raise

    def send(self, block_id: BlockId, value: bytes, payload_bytes: int) -> asyncio.Future[bool]:
        """Put a value from `encode` after the block's earlier operations; True once
        stored. Its `payload_bytes` stop counting as pending when it is done."""

        async def put() -> bool:
            try:
                return await self._send(block_id, value)
            finally:
                self.pending_bytes -= payload_bytes

        return self._after(block_id, put)

    def delete(self, block_id: BlockId) -> asyncio.Future[bool]:
        return self._after(block_id, lambda: self._delete(block_id))

    async def _send(self, block_id: BlockId, value: bytes) -> bool:
        ok, _ = await self._store_call("put a block", lambda t: t.send(*block_id, value))
        return ok

    async def _delete(self, block_id: BlockId) -> bool:
        # Offline: a stale value left behind is verified when fetched, never trusted blindly.
        ok, _ = await self._store_call("delete a block", lambda t: t.delete(*block_id))
        return ok

    def _after(
        self, block_id: BlockId, work: Callable[[], Coroutine[Any, Any, bool]]
    ) -> asyncio.Future[bool]:
        previous = self._tails.get(block_id)

        async def chained() -> bool:
            if previous is not None:
                await asyncio.gather(previous, return_exceptions=True)
            return await work()

        task = asyncio.ensure_future(chained())
        self._tails[block_id] = task
        self._tasks.add(task)

        def done(t: asyncio.Future[bool]) -> None:
            self._tasks.discard(task)
            if self._tails.get(block_id) is t:
                del self._tails[block_id]

        task.add_done_callback(done)
        return task

    async def discard_bad(self, block_id: BlockId, err: CorruptRecord) -> None:
        """A value that failed verification is useless to every node: remove it."""
        logger.warning("remote value failed verification (%s); served as a miss and removed", err)
        await self.delete(block_id)

    # ---- health -------------------------------------------------------------------------
    def _failed(self, err: OSError, doing: str) -> None:
        self.failures += 1
        if self.health.online:
            logger.warning("remote tier: could not %s: %s", doing, err)
        self.health.failed(err)

    async def _watch_forever(self) -> None:
        interval_s = self.config.offline_retry_s
        while True:
            await asyncio.sleep(interval_s)
            if self.health.online or self.tier is None:
                continue
            try:
                await self.io.run(self.tier.exists, [_PROBE_NAME])
            except OSError as err:
                logger.info("remote tier still unreachable: %s", err)
                continue
            self.health.recovered()
