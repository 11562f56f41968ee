"""A node's blocks, kept current from its residency events: what a router indexes.

    index = BlockIndex(namespace)
    index.follow(client, stop)          # on a thread: snapshot, then watch, forever
    index.prefix_blocks(namespace, keys)  # how much of a chain this node holds

The protocol it follows (list, then watch): take a snapshot, watch from its (epoch, seq),
apply each event (a block's whole new set of tiers); on a dropped connection, resume from
the last event applied; when the daemon says resync (it restarted, or the events are no
longer kept), start over from a snapshot. The index is never silently stale.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from kvtier.client._results import EventBatch, Snapshot
from kvtier.client.sync import Client
from kvtier.errors import KVTierError

logger = logging.getLogger(__name__)


class BlockIndex:
    """(namespace, key) -> tiers holding it (fastest first), as of event `seq`."""

    def __init__(self, namespace: str = "") -> None:
        self.namespace = namespace
        self.epoch = ""
        self.seq = 0
        self.blocks: dict[tuple[str, bytes], list[str]] = {}
        self.resyncs = 0
        self._lock = threading.Lock()  # follow() writes on its thread, lookups read

    def load(self, snapshot: Snapshot) -> None:
        with self._lock:
            self.blocks = {(b.namespace, b.key): b.tiers for b in snapshot.blocks}
            self.epoch, self.seq = snapshot.epoch, snapshot.seq

    def apply(self, batch: EventBatch) -> bool:
        """Apply a batch of events; False when the daemon asked for a resync (then the
        index is cleared until the next snapshot)."""
        with self._lock:
            if batch.resync or (self.epoch and batch.epoch != self.epoch):
                self.blocks, self.epoch, self.seq = {}, "", 0
                self.resyncs += 1
                return False
            self.epoch = batch.epoch
            for event in batch.events:
                if event.seq <= self.seq:
                    continue  # already reflected (a snapshot taken after it)
                block = (event.namespace, event.key)
                if event.tiers:
                    self.blocks[block] = event.tiers
                else:
                    self.blocks.pop(block, None)
                self.seq = event.seq
            return True

    def sync_once(self, client: Client, *, timeout_s: float | None = None) -> None:
        """Snapshot if needed, then apply events until the stream ends or `timeout_s`."""
        if not self.epoch:
            self.load(client.snapshot(self.namespace))
        for batch in client.watch_events(self.namespace, self.epoch, self.seq, timeout_s=timeout_s):
            if not self.apply(batch):
                return

    def follow(self, client: Client, stop: threading.Event, retry_s: float = 1.0) -> None:
        """Keep the index current until `stop` is set (run it on a thread of its own)."""
        while not stop.is_set():
            try:
                self.sync_once(client, timeout_s=retry_s * 10)
            except KVTierError as err:
                # The watch is cut every 10 * retry_s so that `stop` is seen: then it
                # resumes at once; any other error (the daemon down) after retry_s.
                if not str(err).startswith("deadline exceeded"):
                    logger.info("kvtier events: %s; resuming in %.0f s", err, retry_s)
                    stop.wait(retry_s)

    def tiers(self, namespace: str, key: bytes) -> list[str]:
        with self._lock:
            return list(self.blocks.get((namespace, key), []))

    def chain_tiers(self, namespace: str, keys: Sequence[bytes]) -> list[str | None]:
        """Per key: the fastest tier holding it, or None (`kvtier.index.routing.NodeState`)."""
        with self._lock:
            held = [self.blocks.get((namespace, k)) for k in keys]
            return [tiers[0] if tiers else None for tiers in held]

    def prefix_blocks(self, namespace: str, keys: list[bytes]) -> int:
        """How many leading blocks of a chain the node holds (in any tier)."""
        with self._lock:
            for i, key in enumerate(keys):
                if (namespace, key) not in self.blocks:
                    return i
            return len(keys)
