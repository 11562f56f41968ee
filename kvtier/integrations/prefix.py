"""Engine-side prefix bookkeeping shared by the engine connectors (no engine imported).

An engine pages its KV cache in blocks of `block_size` tokens; kvtier stores one record
per engine block (every layer's slice of it, back to back) under a chained key, so a key
names the whole prefix up to the end of its block (an engine that loads layer by layer
stores one record per layer of a block instead: `layer_key`). This module decides, for
one request: which of its blocks may be loaded (a prefix only: an engine cannot load
block i without holding blocks < i), which to save after a step computed them, and the
namespace the records live in (everything that changes their bytes: model, dtype, block
size, layout).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.client import PlanResult
from kvtier.keys import chain_keys

_UNSAFE = re.compile(r"[^A-Za-z0-9_.:@+=-]+")


def engine_namespace(
    model: str,
    dtype: str,
    block_size: int,
    layout: str,
    rank: int = 0,
    world_size: int = 1,
) -> str:
    """A namespace for one engine configuration: records are interchangeable only between
    engines that agree on every part of it. The model's name is kept readable (its last
    path part) and made unique by a short hash of the whole name."""
    tail = _UNSAFE.sub("_", model.rstrip("/").rsplit("/", 1)[-1])[:48] or "model"
    digest = hashlib.sha256(model.encode()).hexdigest()[:8]
    return (
        f"{tail}-{digest}/{_UNSAFE.sub('_', dtype)}-b{block_size}-{layout}-tp{rank}of{world_size}"
    )


def request_keys(
    namespace: str, token_ids: Sequence[int], block_size: int, salt: str | None
) -> list[bytes]:
    """Chained keys of the request's full blocks (a partial last block has none)."""
    full = len(token_ids) // block_size
    blocks = [token_ids[i * block_size : (i + 1) * block_size] for i in range(full)]
    return chain_keys(namespace, blocks, extra=(salt or "").encode())


def layer_key(block_key: bytes, layer: int) -> bytes:
    """The key of one layer's record of an engine block, for engines that store a block as
    one record per layer (loaded layer by layer): the block's chained key and the layer,
    so it names the same prefix and no two layers (or blocks) share a key."""
    return block_key + b"/L" + layer.to_bytes(2, "big")


def loadable_blocks(prompt_tokens: int, block_size: int) -> int:
    """Blocks an engine may load for a prompt: the last prompt token is always computed
    (its logits start generation), so a block holding it cannot be loaded."""
    return max(prompt_tokens - 1, 0) // block_size


def prefix_load_end(plan: PlanResult) -> int:
    """The end of the blocks to load, as a prefix after the engine's own: the planner's
    run when it starts there, else the cheapest prefix by the plan's per-block costs
    (fetch one, recompute the rest); `plan.engine_blocks` when loading does not pay."""
    e = plan.engine_blocks
    if plan.fetch_start == e:
        return plan.fetch_end
    best_end, best_saving_s, saving_s = e, 0.0, 0.0
    for i in range(e, len(plan.tiers)):
        if plan.tiers[i] is None:
            break
        saving_s += plan.recompute_s[i] - plan.fetch_s[i]
        if saving_s > best_saving_s:
            best_end, best_saving_s = i + 1, saving_s
    return best_end


@dataclass
class RequestState:
    """What the scheduler side knows of one request between steps."""

    keys: list[bytes]  # of the prompt's full blocks
    prompt_tokens: int
    block_size: int
    block_ids: list[int] = field(default_factory=list)  # the engine's, block 0 first
    stored_upto: int = 0  # blocks [0, stored_upto) are in kvtier (loaded or saved)
    load_from: int = 0  # a pending load: blocks [load_from, load_to)
    load_to: int = 0

    def saves_after(self, computed_tokens: int) -> list[tuple[bytes, int]]:
        """(key, engine block id) of the prompt blocks complete once `computed_tokens`
        are, not yet stored; they count as stored from now on."""
        complete = min(computed_tokens, self.prompt_tokens) // self.block_size
        end = min(complete, len(self.keys), len(self.block_ids))
        out = [(self.keys[i], self.block_ids[i]) for i in range(self.stored_upto, end)]
        self.stored_upto = max(self.stored_upto, end)
        return out

    def take_load(self) -> list[tuple[bytes, int]]:
        """(key, engine block id) of the pending load, which is then no longer pending."""
        end = min(self.load_to, len(self.block_ids))
        out = [(self.keys[i], self.block_ids[i]) for i in range(self.load_from, end)]
        self.stored_upto = max(self.stored_upto, end)
        self.load_from = self.load_to = 0
        return out
