"""A vLLM KV connector (v1 API, pinned to vLLM 0.32): the engine's prefix KV in kvtier.

Turn it on with

    --kv-transfer-config '{"kv_connector": "KVTierConnector",
                           "kv_connector_module_path": "kvtier.integrations.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"target": "unix:///run/kvtier/kvtier.sock"}}'

Scheduler side: for a new request it computes the chained keys of the prompt's full
blocks, asks the daemon's planner (`Plan`) which to fetch rather than recompute, and tells
vLLM to load that prefix. Worker side: the blocks move by the transport the KV tensors'
device calls for (kvtier/integrations/paged_kv.py), through one code path. CPU KV: before
the forward pass the blocks are copied from the shared arena straight into vLLM's KV
tensors (one slice per layer, no staging copy). GPU KV: the KV allocation is registered
with the daemon once (CUDA IPC), every layer's copies start before the forward pass and
each layer is waited for just before its attention runs (`wait_for_layer_load`), so
layer 0 computes while later layers arrive; records are then one per block and layer.
After the forward pass the prompt blocks the step completed go to a saver thread, which
stores them (GPU KV: the daemon's D2H copies into its pinned arena, on its own streams)
while the engine goes on with its next step (a finished request's blocks stay allocated
until they are stored: vLLM's delayed free), and the step's prefill time is reported so
the daemon's cost model learns this engine. A block that cannot be loaded (missing,
corrupt, daemon gone) is reported to vLLM, which recomputes it; with the daemon down the
engine runs as if there were no connector (logged once, retried every `retry_s`).

Extra config keys: `target` (default $KVTIER_TARGET, else the daemon's default socket),
`token` (default $KVTIER_TOKEN), `timeout_s` (2), `retry_s` (5), `namespace` (default
from the model, dtype, block size and KV layout), `load` / `save` (true), `fetch`:
"plan" (the daemon's planner decides, default) or "always" (load every cached leading
block, as cache-hit-only connectors do: a baseline to compare with), `device_path`
(default $KVTIER_VLLM_DEVICE_PATH, else "auto": the KV tensors' device decides) or
"emulate": CPU KV takes the GPU path, CUDA IPC, against a daemon running `gpu.emulate`
(tests and demos on machines without a GPU: the KV tensors move into shared memory),
`prefetch` (true: announce each waiting request's chain, see `_announce`) and
`prefetch_ttl_s` (0: the daemon's limits.prefetch_ttl_s).
"""

from __future__ import annotations

import logging
import os
import queue
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

import kvtier
from kvtier.errors import InvalidArgument, KVTierError, Unimplemented
from kvtier.integrations.daemon import DaemonLink
from kvtier.integrations.paged_kv import Blocks, Fence, PagedKV, describe, paged_kv
from kvtier.integrations.prefix import (
    RequestState,
    engine_namespace,
    layer_key,
    loadable_blocks,
    request_keys,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.kvtier")  # under vLLM's handler and level
_ATTENTION_ONLY = "kvtier's connector supports models with one KV cache group (full attention)"


@dataclass
class PrefillStep:
    """Prompt tokens [start, end) of one request computed in a step of its own."""

    start_token: int
    end_token: int


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    """One step's work for the worker: blocks to load before the forward pass, and per
    request the blocks to save after it. `drain_saves`: vLLM freed a preempted request's
    blocks this step, so saves still reading blocks must end before the forward pass
    writes into them."""

    loads: Blocks = field(default_factory=list)
    saves: dict[str, Blocks] = field(default_factory=dict)
    drain_saves: bool = False
    prefill: PrefillStep | None = None


class _Saver:
    """Stores blocks on a thread of its own (with its own client), so a step does not wait
    for the daemon. Tracks which requests have saves in flight: a finished request's
    blocks are given back to vLLM (`finished`) only once everything it saved is stored."""

    def __init__(
        self, daemon: DaemonLink, save: Callable[[DaemonLink, Blocks, Fence | None], None]
    ) -> None:
        self._daemon = daemon
        self._save = save
        self._jobs: queue.SimpleQueue[tuple[str, Blocks, Fence | None] | None] = queue.SimpleQueue()
        self._lock = threading.Condition()
        self._pending: Counter[str] = Counter()  # jobs queued or running, per request (> 0)
        self._tracked: set[str] = set()  # requests that saved anything (vLLM delays their free)
        self._finishing: set[str] = set()  # ... and have finished in vLLM
        self._thread = threading.Thread(target=self._run, name="kvtier-saver", daemon=True)
        self._thread.start()

    def submit(self, req_id: str, blocks: Blocks, fence: Fence | None = None) -> None:
        """Store `blocks` once `fence` (what the step that wrote them must finish) passed."""
        with self._lock:
            self._pending[req_id] += 1
            self._tracked.add(req_id)
        self._jobs.put((req_id, blocks, fence))

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until no save is in flight (False if `timeout_s` passed first)."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._pending, timeout_s)

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """Of the requests vLLM has finished, those whose blocks it may free now."""
        with self._lock:
            self._finishing |= finished_req_ids & self._tracked
            done = {r for r in self._finishing if not self._pending[r]}
            self._finishing -= done
            self._tracked -= done
        return done

    def close(self, timeout_s: float) -> None:
        if not self.wait_idle(timeout_s):
            logger.warning("kvtier: saves still in flight after %.0f s; not waiting", timeout_s)
        self._jobs.put(None)
        self._thread.join(timeout_s)
        self._daemon.close()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            req_id, blocks, fence = job
            try:
                self._save(self._daemon, blocks, fence)
            except Exception:  # a bug here must not leave vLLM's blocks held forever
                logger.exception("kvtier: saving %d blocks failed", len(blocks))
            finally:
                with self._lock:
                    self._pending[req_id] -= 1
                    if not self._pending[req_id]:
                        del self._pending[req_id]  # no key left at 0: empty means idle
                    self._lock.notify_all()


class KVTierConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        self._load = _truthy(extra.get("load", True))
        self._save = _truthy(extra.get("save", True))
        self._fetch = str(extra.get("fetch", "plan"))
        if self._fetch not in ("plan", "always"):
            raise ValueError(f"fetch must be 'plan' or 'always', not {self._fetch!r}")
        device_path = str(
            extra.get("device_path") or os.environ.get("KVTIER_VLLM_DEVICE_PATH") or "auto"
        )
        if device_path not in ("auto", "emulate"):
            raise ValueError(f"device_path must be 'auto' or 'emulate', not {device_path!r}")
        self._emulate_ipc = device_path == "emulate"
        # Both sides must agree on the records (one per block, or per block and layer);
        # the scheduler sees no tensor, so it goes by the device vLLM runs on, which is
        # where vLLM allocates the KV.
        device = str(getattr(vllm_config.device_config, "device_type", "cpu"))
        self._per_layer = device == "cuda" or self._emulate_ipc
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(f"{_ATTENTION_ONLY}; this one has {len(groups)}")
        spec = groups[0].kv_cache_spec
        self._block_size: int = spec.block_size
        self._layer_names: list[str] = sorted(groups[0].layer_names, key=_natural)
        self._layer_index = {name: i for i, name in enumerate(self._layer_names)}
        self._num_blocks: int = kv_cache_config.num_blocks
        self._block_bytes = spec.page_size_bytes * len(self._layer_names)
        parallel = vllm_config.parallel_config
        rank = parallel.rank if role == KVConnectorRole.WORKER else 0
        dtype = str(spec.dtype).removeprefix("torch.")
        layout = f"l{len(self._layer_names)}x{spec.page_size_bytes}"
        self.namespace: str = extra.get("namespace") or engine_namespace(
            vllm_config.model_config.model,
            dtype,
            self._block_size,
            layout,
            rank,
            parallel.tensor_parallel_size,
        )
        self._extra = extra
        self._prefetch = _truthy(extra.get("prefetch", True))
        self._prefetch_ttl_s = float(extra.get("prefetch_ttl_s", 0.0))  # 0: the daemon's
        self._daemon = DaemonLink(extra, logger=logger)
        if getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "") == "fail":
            logger.warning(
                "kvtier: kv_load_failure_policy is 'fail': a block kvtier cannot give back "
                "(evicted, corrupt, daemon gone) fails its request; set it to 'recompute'"
            )
        # Scheduler side
        self._requests: dict[str, RequestState] = {}
        self._saved: set[str] = set()  # requests with saves handed to the worker
        # Worker side
        self._saver: _Saver | None = None
        self._kv: PagedKV | None = None
        self._loading: Blocks = []  # this step's load, until end_load
        self._load_client: kvtier.Client | None = None  # what it was started with
        self._load_errors: set[int] = set()
        self._forward_started_s = 0.0
        self._prefilled = False
        logger.info(
            "kvtier connector (%s): namespace %s, %d-byte blocks",
            role.name.lower(),
            self.namespace,
            self._block_bytes,
        )

    # ---- scheduler side -----------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        prompt = list(request.prompt_token_ids or [])
        state = self._requests.get(request.request_id)
        if state is None:
            keys = request_keys(
                self.namespace, prompt, self._block_size, getattr(request, "cache_salt", None)
            )
            state = RequestState(keys, len(prompt), self._block_size)
            self._requests[request.request_id] = state
            self._announce(keys[: loadable_blocks(len(prompt), self._block_size)])
        engine_blocks = num_computed_tokens // self._block_size
        usable = loadable_blocks(len(prompt), self._block_size)
        if not self._load or usable <= engine_blocks:
            return 0, False
        client = self._daemon.client()
        if client is None:
            return 0, False
        keys = self._planned(state.keys[:usable])
        try:
            if self._fetch == "always":  # every cached block, as cache-hit-only connectors do
                end = client.lookup(self.namespace, keys).prefix_blocks
            else:
                # vLLM can load only right after what it holds: the planner optimises
                # within that family, so its run is the load (no re-derivation here).
                planned = client.plan(
                    self.namespace,
                    keys,
                    self._block_size,
                    engine_cached_blocks=engine_blocks,
                    prompt_tokens=len(prompt),
                    kv_bytes_per_token=self._block_bytes // self._block_size,
                    family="prefix",
                )
                # A daemon that predates `family` plans freely: a run that does not start
                # at the engine's blocks cannot be loaded, so load nothing.
                fetched = planned.fetch_start == planned.engine_blocks
                end = planned.fetch_end if fetched else engine_blocks
        except (KVTierError, OSError) as err:
            self._daemon.failed("plan a prefix load", err)
            return 0, False
        self._daemon.succeeded()
        if end <= engine_blocks:
            return 0, False
        state.load_from, state.load_to = engine_blocks, end
        return (end - engine_blocks) * self._block_size, False

    def _announce(self, keys: list[bytes]) -> None:
        """Queue prefetch: vLLM asks about a waiting request before it schedules it, and
        may ask again steps later (no KV room, no token budget yet). Announce its chain
        once, at the first ask: the daemon promotes its NVMe blocks into DRAM meanwhile and
        keeps them there until they are loaded. One fast unary call, never a wait for a
        move; off with extra config `prefetch: false`, or by itself against a daemon that
        has no Prefetch RPC."""
        if not self._prefetch or not keys or not self._load:
            return
        client = self._daemon.client()
        if client is None:
            return
        if self._per_layer:  # a record per block and layer: the block's front layer first
            layers = range(len(self._layer_names))
            keys = [layer_key(k, layer) for k in keys for layer in layers]
        try:
            client.prefetch(self.namespace, [keys], ttl_s=self._prefetch_ttl_s)
        except Unimplemented:
            self._prefetch = False
            logger.info("kvtier: this daemon has no queue prefetch; not announcing requests")
        except (KVTierError, OSError) as err:
            self._daemon.failed("announce a waiting request", err)

    def _planned(self, keys: list[bytes]) -> list[bytes]:
        """The keys to plan a chain of blocks by: the blocks' own, or with a record per
        layer, their last layer's (a block is loadable if that one is; a block missing an
        earlier layer fails its load and is recomputed)."""
        if not self._per_layer:
            return keys
        last = len(self._layer_names) - 1
        return [layer_key(k, last) for k in keys]

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        state = self._requests.get(request.request_id)
        if state is not None and num_external_tokens == 0:
            state.load_from = state.load_to = 0  # vLLM did not take the load

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVTierMetadata:
        meta = KVTierMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        steps: list[tuple[str, int]] = []  # (request, tokens computed before this step)
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            steps.append((new.req_id, new.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            computed = cached.num_computed_tokens[i]
            # Fewer computed tokens than stored blocks: vLLM drops back to recompute after
            # a failed load (or a preemption); what it recomputes is saved again.
            state.stored_upto = min(state.stored_upto, computed // self._block_size)
            steps.append((req_id, computed))
        for req_id, computed in steps:
            state = self._requests[req_id]
            if state.load_to > state.load_from:
                meta.loads.extend(state.take_load())
            if self._save and (saves := state.saves_after(computed + scheduled.get(req_id, 0))):
                meta.saves[req_id] = saves
                self._saved.add(req_id)
        meta.drain_saves = bool(getattr(scheduler_output, "preempted_req_ids", None))
        if len(steps) == 1 and len(scheduled) == 1:
            req_id, computed = steps[0]
            end = min(computed + scheduled[req_id], self._requests[req_id].prompt_tokens)
            if end > computed:
                meta.prefill = PrefillStep(computed, end)
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        if request.request_id in self._saved:
            self._saved.discard(request.request_id)
            return True, None  # freed when the worker has stored its blocks (get_finished)
        return False, None

    # ---- worker side --------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv = self._paged([kv_caches[name] for name in self._layer_names])

    def _paged(self, layers: list[torch.Tensor]) -> PagedKV:
        """The transport for these tensors (see kvtier/integrations/paged_kv.py)."""
        on_gpu = bool(layers) and layers[0].device.type == "cuda"
        if self._per_layer != (on_gpu or self._emulate_ipc):
            raise ValueError(
                f"KV on {layers[0].device if layers else 'no device'}, not on vLLM's device: "
                "kvtier's scheduler and worker sides would name different records"
            )
        kv = paged_kv(
            self.namespace, self._layer_names, layers, self._num_blocks, self._emulate_ipc
        )
        logger.info("kvtier: %s", describe(kv))
        return kv

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # Called before the forward pass; start_load_kv is not when a step loads nothing
        # (vLLM then calls it after the forward, to keep asynchronous loads off the path).
        super().bind_connector_metadata(connector_metadata)
        meta = connector_metadata
        if isinstance(meta, KVTierMetadata) and meta.drain_saves and self._saver is not None:
            # No timeout: a save still copying a block this step overwrites would store
            # wrong bytes under its key. Each save is bounded by the client's deadline.
            self._saver.wait_idle()
        self._forward_started_s = time.perf_counter()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        if self._kv is None:
            self._kv = self._paged(self._layers_of(forward_context))
        if meta.loads:  # a step with loads has them before its forward pass
            self._loading = meta.loads
            self._load_client = self._daemon.client()
            self._kv.start_load(self._load_client, meta.loads)
            self._forward_started_s = time.perf_counter()

    def wait_for_layer_load(self, layer_name: str) -> None:
        # CPU KV: a no-op (the load was done in start_load_kv); GPU KV: this layer's copies.
        layer = self._layer_index.get(layer_name)
        if self._kv is not None and layer is not None:
            self._kv.wait_layer(layer)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # a kvtier block spans every layer: saved once all are done (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        load_wait_s = self._end_load()
        # The engine's compute: not the time it was held up waiting for a layer's load.
        forward_s = time.perf_counter() - self._forward_started_s - load_wait_s
        if meta.saves and self._saver is None:
            self._saver = _Saver(
                DaemonLink(self._extra, self._daemon.outage, logger), self._save_blocks
            )
        fence = self._kv.save_fence() if meta.saves and self._kv is not None else None
        for req_id, blocks in meta.saves.items():
            assert self._saver is not None
            self._saver.submit(req_id, blocks, fence)
        if meta.prefill is not None and not self._prefilled:
            # The engine's first prefill carries one-time costs (lazy set-up): not reported.
            self._prefilled = True
        elif (
            meta.prefill is not None
            and forward_s > 0  # a step spent waiting on its loads measured nothing to report
            and (client := self._daemon.client()) is not None
        ):
            try:
                client.report_prefill(
                    self.namespace, meta.prefill.start_token, meta.prefill.end_token, forward_s
                )
            except InvalidArgument as err:
                # The daemon refused this figure, not the connection: keep loading from it.
                logger.debug("kvtier: prefill time not taken (%s)", err)
            except (KVTierError, OSError) as err:
                self._daemon.failed("report a prefill time", err)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, None]:
        if self._saver is None:
            return None, None
        return self._saver.finished(finished_req_ids) or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._end_load()  # vLLM asks before wait_for_save when it defers that (drafts)
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._saver is not None:
            self._saver.close(timeout_s=60.0)
        self._daemon.close()

    # ---- moving bytes -------------------------------------------------------------------
    def _end_load(self) -> float:
        """Finish the step's load (GPU KV: every layer's copies are in, or known missing)
        and hand what did not arrive to vLLM; the time the engine was held up by it."""
        if not self._loading or self._kv is None:
            return 0.0
        loads, self._loading = self._loading, []
        loaded = self._kv.end_load()
        if loaded.error is not None:
            self._daemon.failed("load blocks", loaded.error)
        elif self._load_client is not None:
            self._daemon.succeeded()
        self._load_client = None
        if loaded.blocks < len(loads):
            self._load_errors.update(b for _, b in loads[loaded.blocks :])
            logger.info(
                "kvtier: %d of %d blocks not loaded; vLLM recomputes them",
                len(loads) - loaded.blocks,
                len(loads),
            )
        return self._kv.wait_s

    def _save_blocks(self, daemon: DaemonLink, saves: Blocks, fence: Fence | None) -> None:
        """On the saver thread: a save that fails is a block not cached, nothing more."""
        client = daemon.client()
        if client is None or self._kv is None:
            return
        try:
            self._kv.save(client, saves, fence)
            daemon.succeeded()
        except (KVTierError, OSError) as err:
            daemon.failed("save blocks", err)

    def _layers_of(self, forward_context: ForwardContext) -> list[torch.Tensor]:
        layers = forward_context.no_compile_layers
        tensors = []
        for name in self._layer_names:
            kv = getattr(layers[name], "kv_cache", None)
            if isinstance(kv, list | tuple):  # one per virtual engine in some versions
                kv = kv[forward_context.virtual_engine]
            if kv is None:
                raise ValueError(f"layer {name} has no KV cache tensor")
            tensors.append(kv)
        return tensors


def _natural(name: str) -> list[object]:
    """model.layers.10 after model.layers.9."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _truthy(value: object) -> bool:
    return str(value).lower() not in ("0", "false", "no", "off")
