"""A vLLM KV connector (v1 API, pinned to vLLM 0.32): the engine's prefix KV in kvtier.

Turn it on with

    --kv-transfer-config '{"kv_connector": "KVTierConnector",
                           "kv_connector_module_path": "kvtier.integrations.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"target": "unix:///run/kvtier/kvtier.sock"}}'

Scheduler side: for a new request it computes the chained keys of the prompt's full
blocks, asks the daemon's planner (`Plan`) which to fetch rather than recompute, and tells
vLLM to load that prefix. Worker side: before the forward pass it copies those blocks from
the shared arena straight into vLLM's KV tensors (one slice per layer, no staging copy);
after it, it stores the prompt blocks the step completed the same way, and reports the
step's prefill time so the daemon's cost model learns this engine. A block that cannot be
loaded (missing, corrupt, daemon gone) is reported to vLLM, which recomputes it; with the
daemon down the engine runs as if there were no connector (logged once, retried every
`retry_s`).

Extra config keys: `target` (default $KVTIER_TARGET, else the daemon's default socket),
`token` (default $KVTIER_TOKEN), `timeout_s` (2), `retry_s` (5), `namespace` (default
from the model, dtype, block size and KV layout), `load` / `save` (true), `fetch`:
"plan" (the daemon's planner decides, default) or "always" (load every cached leading
block, as cache-hit-only connectors do: a baseline to compare with).
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

import kvtier
from kvtier.errors import AlreadyExists, KVTierError
from kvtier.integrations.prefix import (
    RequestState,
    engine_namespace,
    loadable_blocks,
    prefix_load_end,
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
    """One step's work for the worker: (key, engine block id) pairs to load before the
    forward pass and to save after it."""

    loads: list[tuple[bytes, int]] = field(default_factory=list)
    saves: list[tuple[bytes, int]] = field(default_factory=list)
    prefill: PrefillStep | None = None


class _Daemon:
    """The client, with the engine's rule for a daemon that is down: skip kvtier (log once)
    and try again after `retry_s`, never stalling a step on it."""

    def __init__(self, extra: dict[str, Any]) -> None:
        self._target = extra.get("target") or os.environ.get("KVTIER_TARGET")
        self._token = extra.get("token")
        self._timeout_s = float(extra.get("timeout_s", 2.0))
        self._retry_s = float(extra.get("retry_s", 5.0))
        self._client: kvtier.Client | None = None
        self._down_until_s = 0.0
        self._warned = False

    def client(self) -> kvtier.Client | None:
        if time.monotonic() < self._down_until_s:
            return None
        if self._client is None:
            self._client = kvtier.Client(self._target, self._timeout_s, self._token)
        return self._client

    def failed(self, doing: str, err: Exception) -> None:
        self._down_until_s = time.monotonic() + self._retry_s
        if not self._warned:
            logger.warning(
                "kvtier: could not %s (%s); recomputing instead, retrying every %.0f s",
                doing,
                err,
                self._retry_s,
            )
            self._warned = True
        if self._client is not None:
            self._client.close()
            self._client = None

    def succeeded(self) -> None:
        if self._warned:
            logger.warning("kvtier: the daemon answers again")
            self._warned = False

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


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
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(f"{_ATTENTION_ONLY}; this one has {len(groups)}")
        spec = groups[0].kv_cache_spec
        self._block_size: int = spec.block_size
        self._layer_names: list[str] = sorted(groups[0].layer_names, key=_natural)
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
        self._daemon = _Daemon(extra)
        if getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "") == "fail":
            logger.warning(
                "kvtier: kv_load_failure_policy is 'fail': a block kvtier cannot give back "
                "(evicted, corrupt, daemon gone) fails its request; set it to 'recompute'"
            )
        # Scheduler side
        self._requests: dict[str, RequestState] = {}
        # Worker side
        self._kv_layers: list[torch.Tensor] | None = None
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
        engine_blocks = num_computed_tokens // self._block_size
        usable = loadable_blocks(len(prompt), self._block_size)
        if not self._load or usable <= engine_blocks:
            return 0, False
        client = self._daemon.client()
        if client is None:
            return 0, False
        try:
            if self._fetch == "always":  # every cached block, as cache-hit-only connectors do
                end = client.lookup(self.namespace, state.keys[:usable]).prefix_blocks
            else:
                end = prefix_load_end(
                    client.plan(
                        self.namespace,
                        state.keys[:usable],
                        self._block_size,
                        engine_cached_blocks=engine_blocks,
                        prompt_tokens=len(prompt),
                        kv_bytes_per_token=self._block_bytes // self._block_size,
                    )
                )
        except (KVTierError, OSError) as err:
            self._daemon.failed("plan a prefix load", err)
            return 0, False
        self._daemon.succeeded()
        if end <= engine_blocks:
            return 0, False
        state.load_from, state.load_to = engine_blocks, end
        return (end - engine_blocks) * self._block_size, False

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
            if self._save:
                meta.saves.extend(state.saves_after(computed + scheduled.get(req_id, 0)))
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
        return False, None

    # ---- worker side --------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_layers = [_block_major(kv_caches[name], name) for name in self._layer_names]

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        if self._kv_layers is None:
            self._kv_layers = self._layers_of(forward_context)
        if meta.loads:
            self._load_blocks(meta.loads)
        self._forward_started_s = time.perf_counter()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # every layer was loaded in start_load_kv

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # a kvtier block spans every layer: saved once all are done (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        forward_s = time.perf_counter() - self._forward_started_s
        if meta.saves:
            self._save_blocks(meta.saves)
        if meta.prefill is not None and not self._prefilled:
            # The engine's first prefill carries one-time costs (lazy set-up): not reported.
            self._prefilled = True
        elif meta.prefill is not None and (client := self._daemon.client()) is not None:
            try:
                client.report_prefill(
                    self.namespace, meta.prefill.start_token, meta.prefill.end_token, forward_s
                )
            except (KVTierError, OSError) as err:
                self._daemon.failed("report a prefill time", err)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self._daemon.close()

    # ---- moving bytes -------------------------------------------------------------------
    def _parts(self, block_id: int) -> list[torch.Tensor]:
        assert self._kv_layers is not None
        return [layer[block_id] for layer in self._kv_layers]

    def _load_blocks(self, loads: list[tuple[bytes, int]]) -> None:
        client = self._daemon.client()
        got: list[int | None] = [None] * len(loads)
        if client is not None:
            try:
                got = client.get_many(
                    self.namespace,
                    [k for k, _ in loads],
                    [self._parts(b) for _, b in loads],
                    verify=True,
                )
                self._daemon.succeeded()
            except (KVTierError, OSError) as err:
                self._daemon.failed("load blocks", err)
        # A chain is loaded as a prefix: after the first block that failed, none count.
        failed = next((i for i, size in enumerate(got) if size != self._block_bytes), None)
        if failed is not None:
            self._load_errors.update(b for _, b in loads[failed:])
            logger.info(
                "kvtier: %d of %d blocks not loaded; vLLM recomputes them",
                len(loads) - failed,
                len(loads),
            )

    def _save_blocks(self, saves: list[tuple[bytes, int]]) -> None:
        client = self._daemon.client()
        if client is None:
            return
        try:
            client.put_many(self.namespace, [(k, self._parts(b)) for k, b in saves])
            self._daemon.succeeded()
        except AlreadyExists:
            # Recomputed KV may differ from the stored block in its last bits (another
            # split of the prompt): either is right, the stored one stays.
            self._daemon.succeeded()
        except (KVTierError, OSError) as err:
            self._daemon.failed("save blocks", err)

    def _layers_of(self, forward_context: ForwardContext) -> list[torch.Tensor]:
        layers = forward_context.no_compile_layers
        tensors = []
        for name in self._layer_names:
            kv = getattr(layers[name], "kv_cache", None)
            if isinstance(kv, list | tuple):  # one per virtual engine in some versions
                kv = kv[forward_context.virtual_engine]
            if kv is None:
                raise ValueError(f"layer {name} has no KV cache tensor")
            tensors.append(_block_major(kv, name))
        return tensors


def _block_major(kv: torch.Tensor, name: str) -> torch.Tensor:
    """The layer's KV tensor, checked to hold each block as one contiguous slice (the
    CPU backend's [num_blocks, kv_heads, block_size, 2 * head_size])."""
    if kv.device.type != "cpu":
        raise ValueError(
            f"layer {name}: KV on {kv.device}; this connector moves CPU KV (the GPU path "
            "needs kvtier's CUDA movers)"
        )
    if not kv.is_contiguous() or not kv[0].is_contiguous():
        raise ValueError(f"layer {name}: KV blocks are not contiguous slices of the tensor")
    return kv


def _natural(name: str) -> list[object]:
    """model.layers.10 after model.layers.9."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _truthy(value: object) -> bool:
    return str(value).lower() not in ("0", "false", "no", "off")
