"""kvtier as SGLang's HiCache L3 storage (tested against sglang 0.5.23; pin it).

SGLang loads it by module path, no SGLang change:

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
            "module_path": "kvtier.integrations.sglang", "class_name": "KVTierStorage",
            "interface_v1": 1, "target": "unix:///run/kvtier/kvtier.sock"}'

Lifecycle, as SGLang's cache controller drives it: its storage factory makes the object
from the storage config (whose `extra_config` is the JSON above); `register_mem_pool_host`
hands over the host KV pool, whose layout, dtype and page size complete the namespace;
then the controller's prefetch and backup threads call, concurrently:

* `batch_exists(keys)`: how many leading pages kvtier holds (one Lookup);
* `batch_get_v1(keys, host_indices)`: copy those pages from the daemon's shared arena
  straight into the host pool at `host_indices` (zero-copy: the pool's
  `get_page_buffer_meta` gives each page's buffers, filled in place, one memcpy each);
* `batch_set_v1(keys, host_indices)`: store pages from the host pool the same way;
* `get_stats()`: pages and GB/s of those calls since the last time (with
  `--enable-storage-metrics`).

Each page is one kvtier record: the page's buffers back to back (K and V, or every layer's
K and V for a layer-first pool). A page kvtier cannot give (evicted, corrupt: its checksum
is verified on the copy, daemon gone) is False, and SGLang recomputes it; with the daemon
down SGLang runs as without L3 storage (one warning, retried every `retry_s`). With
`interface_v1` 0 SGLang takes its older path, a flat tensor per page (`batch_get`,
`batch_set`); both work, the v1 one without the extra copy.

Keys are SGLang's page hashes (hex SHA-256 chained over the prefix, so a page's key names
the whole prefix up to it) as 32 raw bytes. The namespace has the model, the KV dtype, the
page size, the pool's layout and, for MHA models, the tensor-parallel rank (each rank holds
its own heads); an MLA model's KV is the same on every rank, so its ranks share one
namespace and only SGLang's storage writer ranks write it.

Extra config keys besides SGLang's: `target` (default $KVTIER_TARGET, else the daemon's
default socket), `token` (default $KVTIER_TOKEN), `timeout_s` (2), `retry_s` (5),
`namespace` (to share records between engines that differ only in name).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

import kvtier
from kvtier.errors import AlreadyExists, KVTierError
from kvtier.integrations.daemon import DaemonLink, Outage
from kvtier.integrations.prefix import engine_namespace

logger = logging.getLogger("sglang.kvtier")  # under SGLang's handler and level
_GIB = float(1 << 30)


def page_key(page_hash: str) -> bytes:
    """kvtier's key for an SGLang page hash: the digest's bytes (32 for SHA-256); any other
    string (a backend of SGLang's that names pages otherwise) by its SHA-256."""
    try:
        raw = bytes.fromhex(page_hash)
    except ValueError:
        raw = b""
    return raw if 0 < len(raw) <= 64 else hashlib.sha256(page_hash.encode()).digest()


def storage_namespace(config: HiCacheStorageConfig, pool: Any) -> str:
    """Records are interchangeable only between SGLang processes that agree on all of
    this: model, KV dtype, page size, the host pool's layout, and the shard of the KV the
    process holds (tensor-parallel rank for MHA; pipeline stage and attention context-
    parallel rank when those are split)."""
    mla = bool(config.is_mla_model)
    layout = f"sglang-{'mla' if mla else 'mha'}-{pool.layout}"
    if config.pp_size > 1:
        layout += f"-pp{config.pp_rank}of{config.pp_size}"
    if config.attn_cp_size > 1:
        layout += f"-cp{config.attn_cp_rank}of{config.attn_cp_size}"
    rank, world_size = (0, 1) if mla else (config.tp_rank, config.tp_size)
    dtype = str(pool.dtype).removeprefix("torch.")
    model = config.model_name or "model"
    return engine_namespace(model, dtype, pool.page_size, layout, rank, world_size)


def _host_view(address: int, size_bytes: int) -> memoryview:
    """A writable view of `size_bytes` of the host pool at `address` (its tensor owns the
    memory and outlives every call: SGLang keeps the pool for the process's life)."""
    return memoryview((ctypes.c_ubyte * size_bytes).from_address(address)).cast("B")


@dataclass
class _Transfers:
    """Pages and GB/s per call since SGLang last read them (`get_stats`)."""

    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)


class KVTierStorage(HiCacheStorage):
    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None
    ) -> None:
        if storage_config.dcp_size > 1:
            raise ValueError(
                "kvtier's HiCache storage does not support decode context parallelism "
                "(dcp_size > 1): use another L3 backend or turn DCP off"
            )
        self._config = storage_config
        self._extra: dict[str, Any] = dict(storage_config.extra_config or {})
        self.namespace: str = ""
        self._page_bytes = 0
        self._outage = Outage()
        # The prefetch and backup threads call at once: a client (and session) each.
        self._local = threading.local()
        self._links: list[DaemonLink] = []
        self._lock = threading.Lock()
        self._metrics = _Transfers() if storage_config.enable_storage_metrics else None
        self.mem_pool_host: Any = None

    # ---- SGLang's lifecycle ---------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        if getattr(mem_pool_host, "kv_buffer", None) is None:
            # Hybrid models' logical anchor pools (DeepSeek V4, Mamba, SWA) keep their data
            # in side pools that SGLang moves through the v2 interface, not supported here.
            raise ValueError(
                f"kvtier's HiCache storage needs a host KV pool with a KV buffer (MHA or "
                f"MLA models); {type(mem_pool_host).__name__} has none: use another L3 "
                "backend for this model"
            )
        super().register_mem_pool_host(mem_pool_host)
        self.namespace = self._extra.get("namespace") or storage_namespace(
            self._config, mem_pool_host
        )
        self._page_bytes = int(mem_pool_host.get_size_per_token()) * int(mem_pool_host.page_size)
        logger.info(
            "kvtier HiCache storage: namespace %s, %d-byte pages", self.namespace, self._page_bytes
        )

    def close(self) -> None:
        with self._lock:
            links, self._links = self._links, []
        for link in links:
            link.close()

    # ---- the zero-copy interface (interface_v1) --------------------------------------------
    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        if not keys:
            return 0
        link, client = self._client()
        if client is None:
            return 0
        try:
            found: int = client.lookup(self.namespace, [page_key(k) for k in keys]).prefix_blocks
        except (KVTierError, OSError) as err:
            link.failed("look up pages", err)
            return 0
        link.succeeded()
        return found

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        if not keys:
            return []
        link, client = self._client()
        if client is None:
            return [False] * len(keys)
        views = self._page_views(keys, host_indices)
        started_s = time.perf_counter()
        try:
            copied = client.get_many(
                self.namespace, [page_key(k) for k in keys], views, verify=True
            )
        except (KVTierError, OSError) as err:
            link.failed("load pages", err)
            return [False] * len(keys)
        link.succeeded()
        ok = [size == sum(map(len, parts)) for size, parts in zip(copied, views, strict=True)]
        self._record("prefetch", sum(ok), time.perf_counter() - started_s)
        return ok

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        if not keys:
            return []
        if not self._config.is_storage_writer:
            # MLA: every rank holds the same KV; SGLang's writer rank stores it.
            return [True] * len(keys)
        link, client = self._client()
        if client is None:
            return [False] * len(keys)
        views = self._page_views(keys, host_indices)
        started_s = time.perf_counter()
        try:
            client.put_many(
                self.namespace, list(zip([page_key(k) for k in keys], views, strict=True))
            )
        except AlreadyExists:
            # Recomputed KV may differ from the stored page in its last bits (another
            # batch shape): either is right, and the stored one stays.
            pass
        except (KVTierError, OSError) as err:
            link.failed("store pages", err)
            return [False] * len(keys)
        link.succeeded()
        self._record("backup", len(keys), time.perf_counter() - started_s)
        return [True] * len(keys)

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics for the calls since the last read (None without
        --enable-storage-metrics: SGLang then logs an empty one)."""
        if self._metrics is None:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._lock:
            taken, self._metrics = self._metrics, _Transfers()
        out = StorageMetrics()
        out.prefetch_pgs.extend(taken.prefetch_pgs)
        out.backup_pgs.extend(taken.backup_pgs)
        out.prefetch_bandwidth.extend(taken.prefetch_bandwidth)
        out.backup_bandwidth.extend(taken.backup_bandwidth)
        return out

    # ---- the older interface: one flat tensor per page -------------------------------------
    def get(
        self, key: str, target_location: Any | None = None, target_sizes: Any | None = None
    ) -> torch.Tensor | None:
        if target_location is None:
            return None  # SGLang always passes the page to fill
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self,
        keys: list[str],
        target_locations: Sequence[Any] | None = None,
        target_sizes: Any | None = None,
    ) -> list[torch.Tensor | None]:
        if target_locations is None or any(t is None for t in target_locations):
            return [None] * len(keys)
        link, client = self._client()
        if client is None:
            return [None] * len(keys)
        try:
            copied = client.get_many(
                self.namespace, [page_key(k) for k in keys], list(target_locations), verify=True
            )
        except (KVTierError, OSError) as err:
            link.failed("load pages", err)
            return [None] * len(keys)
        link.succeeded()
        return [
            t if size is not None and size == t.numel() * t.element_size() else None
            for t, size in zip(target_locations, copied, strict=True)
        ]

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Sequence[Any] | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        if values is None or any(v is None for v in values):
            return False
        if not self._config.is_storage_writer:
            return True
        link, client = self._client()
        if client is None:
            return False
        items = [(page_key(k), v.contiguous()) for k, v in zip(keys, values, strict=True)]
        try:
            client.put_many(self.namespace, items)
        except AlreadyExists:
            pass
        except (KVTierError, OSError) as err:
            link.failed("store pages", err)
            return False
        link.succeeded()
        return True

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def clear(self) -> bool:
        # The daemon's records are shared with other engines and evicted by its own
        # policy; SGLang's flush empties its own tiers only.
        logger.info("kvtier HiCache storage: clear keeps the daemon's records (shared)")
        return False

    # ---- helpers ----------------------------------------------------------------------
    def _client(self) -> tuple[DaemonLink, kvtier.Client | None]:
        link: DaemonLink | None = getattr(self._local, "link", None)
        if link is None:
            link = DaemonLink(self._extra, self._outage, logger)
            self._local.link = link
            with self._lock:
                self._links.append(link)
        if not self.namespace:
            return link, None  # no host pool registered yet
        return link, link.client()

    def _page_views(self, keys: list[str], host_indices: torch.Tensor) -> list[list[memoryview]]:
        """Each page's buffers in the host pool, in the order the pool lists them."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if ptrs and isinstance(ptrs[0], Sequence):  # already grouped per page
            return [
                [_host_view(p, s) for p, s in zip(pp, ss, strict=True)]
                for pp, ss in zip(ptrs, sizes, strict=True)
            ]
        if len(ptrs) % len(keys):
            raise ValueError(
                f"the host pool lists {len(ptrs)} buffers for {len(keys)} pages: kvtier "
                "needs the same number of buffers per page"
            )
        per_page = len(ptrs) // len(keys)
        return [
            [_host_view(ptrs[j], sizes[j]) for j in range(i * per_page, (i + 1) * per_page)]
            for i in range(len(keys))
        ]

    def _record(self, direction: str, pages: int, elapsed_s: float) -> None:
        if self._metrics is None or pages == 0:
            return
        gib_per_s = pages * self._page_bytes / _GIB / max(elapsed_s, 1e-9)
        with self._lock:
            if direction == "prefetch":
                self._metrics.prefetch_pgs.append(pages)
                self._metrics.prefetch_bandwidth.append(gib_per_s)
            else:
                self._metrics.backup_pgs.append(pages)
                self._metrics.backup_bandwidth.append(gib_per_s)
