"""Drives kvtier's HiCache storage through real SGLang code (from .venv-sglang).

    python sglang_driver.py --target unix:///...sock [--layout page_first]

What is SGLang's here: the package (sglang 0.5.23, imported), its storage factory, which
loads the backend by module path exactly as `--hicache-storage-backend dynamic` does, its
storage config, its page hashes (`get_hash_str`), and the host pool's own methods
(`init_kv_buffer`, `get_size_per_token`, `get_page_buffer_meta`, `get_data_page`, compiled
from the installed `pool_host/mha.py`). The one stand-in is the class around those
methods: importing `sglang.srt.mem_cache.pool_host` pulls in every model config, and one
of them imports torchvision, whose CPU build (matching torch 2.13.0+cpu) the package index
here does not have. `StorageMetrics` is taken the same way when its module cannot be
imported. Prints one JSON object of what it saw; the test decides.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import sys
import time
import types
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

SGLANG_ROOT = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])  # type: ignore[union-attr,index]
HOST_POOL_METHODS = (
    "init_kv_buffer",
    "get_size_per_token",
    "get_page_buffer_meta",
    "get_data_page",
)


def _compile_from(path: Path, pick: Any, namespace: dict[str, Any]) -> dict[str, Any]:
    """Compile the top-level statements `pick` selects from SGLang's source at `path`."""
    tree = ast.parse(path.read_text())
    module = ast.Module(body=pick(tree), type_ignores=[])
    # The file's own `from __future__ import annotations` (the name bound by ours).
    flags = annotations.compiler_flag
    exec(compile(module, str(path), "exec", flags=flags, dont_inherit=True), namespace)
    return namespace


def _alloc_cpu(dims: tuple[int, ...], dtype: torch.dtype, **_: Any) -> torch.Tensor:
    return torch.zeros(dims, dtype=dtype)  # the pool's memory, unpinned (no CUDA here)


def host_pool_class() -> type:
    path = SGLANG_ROOT / "srt" / "mem_cache" / "pool_host" / "mha.py"

    def pick(tree: ast.Module) -> list[ast.stmt]:
        (cls,) = [
            n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MHATokenToKVPoolHost"
        ]
        return [
            n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in HOST_POOL_METHODS
        ]

    ns = _compile_from(
        path, pick, {"torch": torch, "ALLOC_MEMORY_FUNCS": defaultdict(lambda: _alloc_cpu)}
    )

    def __init__(
        self: Any, layout: str, layers: int, heads: int, dim: int, page_size: int, pages: int
    ) -> None:
        # The attributes MHATokenToKVPoolHost.__init__ sets that those methods read.
        self.layout, self.layer_num, self.head_num = layout, layers, heads
        self.head_dim = self.v_head_dim = dim
        self.dtype, self.page_size = torch.bfloat16, page_size
        self.page_num, self.size = pages, pages * page_size
        self.device, self.pin_memory, self.allocator = "cpu", False, None
        self._transfer_device = torch.device("cpu")
        self.kv_buffer = self.init_kv_buffer()

    return type("MHAHostPool", (), {"__init__": __init__, **{m: ns[m] for m in HOST_POOL_METHODS}})


def storage_metrics_class() -> tuple[type, str]:
    try:
        from sglang.srt.observability.metrics_collector import StorageMetrics

        return StorageMetrics, "imported"
    except Exception:  # torchvision, see the docstring
        pass
    path = SGLANG_ROOT / "srt" / "observability" / "metrics_collector.py"

    def pick(tree: ast.Module) -> list[ast.stmt]:
        return [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "StorageMetrics"]

    from dataclasses import dataclass, field

    # Its `List[int]` annotations stay strings (the file's `from __future__` import).
    ns = _compile_from(path, pick, {"dataclass": dataclass, "field": field, "List": list})
    module = types.ModuleType("sglang.srt.observability.metrics_collector")
    module.StorageMetrics = ns["StorageMetrics"]  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    return ns["StorageMetrics"], "compiled from its source"


def make_backend(target: str, pool: Any, **config: Any) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    fields: dict[str, Any] = {
        "tp_rank": 0,
        "tp_size": 1,
        "pp_rank": 0,
        "pp_size": 1,
        "attn_cp_rank": 0,
        "attn_cp_size": 1,
        "is_mla_model": False,
        "enable_storage_metrics": True,
        "is_page_first_layout": pool.layout != "layer_first",
        "model_name": "Qwen/Qwen3-0.6B",
    }
    fields.update(config)
    # What `--hicache-storage-backend-extra-config` carries.
    fields["extra_config"] = {
        "backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang",
        "class_name": "KVTierStorage",
        "interface_v1": 1,
        "target": target,
        "timeout_s": 5,
        **fields.get("extra_config", {}),
    }
    storage = StorageBackendFactory.create_backend("dynamic", HiCacheStorageConfig(**fields), pool)
    storage.register_mem_pool_host(pool)  # what the cache controller does next
    return storage


def pages(pool: Any, first_page: int, count: int) -> torch.Tensor:
    """Host indices of `count` pages from `first_page`, as the controller passes them."""
    return torch.arange(
        first_page * pool.page_size, (first_page + count) * pool.page_size, dtype=torch.int64
    )


def page_bytes(pool: Any, host_indices: torch.Tensor) -> list[bytes]:
    return [
        pool.get_data_page(int(host_indices[i]), flat=True)
        .contiguous()
        .view(torch.uint8)
        .numpy()
        .tobytes()
        for i in range(0, len(host_indices), pool.page_size)
    ]


def chain(n: int, page_size: int, salt: int) -> list[str]:
    from sglang.srt.mem_cache.utils import get_hash_str

    keys: list[str] = []
    for i in range(n):
        tokens = [salt * 100_000 + i * page_size + t for t in range(page_size)]
        keys.append(get_hash_str(tokens, keys[-1] if keys else None))
    return keys


def scenario(target: str, layout: str) -> dict[str, Any]:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    out: dict[str, Any] = {"layout": layout}
    pool_cls = host_pool_class()
    metrics_cls, out["storage_metrics"] = storage_metrics_class()
    writer = pool_cls(layout, layers=3, heads=2, dim=16, page_size=4, pages=32)
    reader = pool_cls(layout, layers=3, heads=2, dim=16, page_size=4, pages=32)
    torch.manual_seed(0)
    writer.kv_buffer.copy_(
        torch.randn(writer.kv_buffer.shape, dtype=torch.float32).to(torch.bfloat16)
    )
    storage = make_backend(target, writer)
    out["is_hicache_storage"] = isinstance(storage, HiCacheStorage)
    out["class"] = type(storage).__module__ + "." + type(storage).__qualname__
    out["namespace"] = storage.namespace
    out["page_bytes"] = writer.get_size_per_token() * writer.page_size

    keys = chain(6, writer.page_size, salt=1)
    stored_at = pages(writer, 3, 6)  # pages 3..8 of the writer's pool
    out["exists_before"] = storage.batch_exists(keys)
    started = time.perf_counter()
    out["set"] = storage.batch_set_v1(keys, stored_at)
    out["set_s"] = time.perf_counter() - started
    out["exists_after"] = storage.batch_exists(keys)
    out["exists_with_unknown_tail"] = storage.batch_exists(keys + chain(2, 4, salt=9))
    out["exists_one"] = storage.exists(keys[0])

    # Another process's pool (a fresh backend, its own client), other pages: bit for bit.
    load = make_backend(target, reader)
    loaded_at = pages(reader, 20, 6)
    out["get"] = load.batch_get_v1(keys, loaded_at)
    out["same_bytes"] = page_bytes(reader, loaded_at) == page_bytes(writer, stored_at)
    elsewhere = torch.cat([pages(reader, 0, 20), pages(reader, 26, 6)])
    out["untouched_elsewhere"] = not any(any(b) for b in page_bytes(reader, elsewhere))

    # A hole in the chain: the page after it is still copied, the hole is a miss.
    mixed = [keys[0], chain(1, 4, salt=7)[0], keys[2]]
    out["get_with_hole"] = load.batch_get_v1(mixed, pages(reader, 10, 3))

    # The older interface: a flat tensor per page.
    flat_keys = chain(2, writer.page_size, salt=2)
    flat = [writer.get_data_page(int(i), flat=True).contiguous() for i in pages(writer, 0, 2)[::4]]
    out["flat_set"] = storage.batch_set(flat_keys, flat)
    dummies = [torch.zeros_like(t) for t in flat]
    got = load.batch_get(flat_keys, dummies)
    out["flat_get_same"] = [
        g is not None and torch.equal(g, t) for g, t in zip(got, flat, strict=True)
    ]
    out["flat_get_miss"] = load.get(chain(1, 4, salt=8)[0], torch.zeros_like(flat[0])) is None

    stats = storage.get_stats()
    out["stats_type_ok"] = isinstance(stats, metrics_cls)
    out["stats_backup_pgs"] = list(stats.backup_pgs)
    out["stats_backup_gib_s"] = list(stats.backup_bandwidth)
    out["stats_prefetch_pgs"] = list(load.get_stats().prefetch_pgs)
    out["stats_after_read"] = list(storage.get_stats().backup_pgs)

    # Shards: another TP rank's pages live apart; MLA ranks share one namespace and only
    # SGLang's writer rank stores.
    out["tp1_namespace"] = make_backend(target, reader, tp_rank=1, tp_size=2).namespace
    out["tp0_of_2_namespace"] = make_backend(target, reader, tp_rank=0, tp_size=2).namespace
    mla_writer = make_backend(target, writer, tp_rank=0, tp_size=2, is_mla_model=True)
    mla_other = make_backend(target, writer, tp_rank=1, tp_size=2, is_mla_model=True)
    out["mla_namespaces_equal"] = mla_writer.namespace == mla_other.namespace
    mla_keys = chain(2, writer.page_size, salt=3)
    out["mla_other_set"] = mla_other.batch_set_v1(mla_keys, pages(writer, 0, 2))
    out["mla_after_other"] = mla_writer.batch_exists(mla_keys)
    out["mla_writer_set"] = mla_writer.batch_set_v1(mla_keys, pages(writer, 0, 2))
    out["mla_after_writer"] = mla_other.batch_exists(mla_keys)
    # A hybrid model's anchor pool (no KV buffer of its own) is refused, with why.
    anchor = pool_cls(layout, layers=1, heads=1, dim=8, page_size=4, pages=2)
    anchor.kv_buffer = None
    try:
        make_backend(target, anchor)
        out["anchor_refused"] = ""
    except ValueError as err:
        out["anchor_refused"] = str(err)
    for backend in (storage, load, mla_writer, mla_other):
        backend.close()
    return out


def daemon_down(target: str) -> dict[str, Any]:
    pool = host_pool_class()("page_first", layers=1, heads=1, dim=8, page_size=4, pages=4)
    storage = make_backend(target, pool, extra_config={"timeout_s": 1, "retry_s": 60})
    keys = chain(2, 4, salt=5)
    started = time.perf_counter()
    out = {
        "exists": storage.batch_exists(keys),
        "set": storage.batch_set_v1(keys, pages(pool, 0, 2)),
        "get": storage.batch_get_v1(keys, pages(pool, 2, 2)),
    }
    out["elapsed_s"] = time.perf_counter() - started
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--layout", default="page_first")
    parser.add_argument("--down", action="store_true", help="the target has no daemon")
    args = parser.parse_args()
    import sglang

    result = daemon_down(args.target) if args.down else scenario(args.target, args.layout)
    result["sglang_version"] = sglang.__version__
    result["torch_version"] = torch.__version__
    print(json.dumps(result))


if __name__ == "__main__":
    main()
