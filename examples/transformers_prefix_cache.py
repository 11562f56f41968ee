"""HF transformers generating with a prompt prefix whose KV cache comes from kvtier.

    python examples/transformers_prefix_cache.py --model DIR [--target unix:///run/kvtier/kvtier.sock]
        [--device cpu|cuda [--emulate]] [--dtype float32] [--json FILE]

Needs `pip install kvtier torch transformers` and a running daemon. What it does:
1. reference: greedy generation from the whole prompt, computed from scratch;
2. store: prefill the prompt's prefix, cut its `DynamicCache` into blocks of
   `--block-tokens` tokens (every layer's K and V for those tokens: one kvtier block under
   a chained key, written from the layer slices without joining them first);
3. load: look the chain up, copy the blocks kvtier has straight into per-layer tensors,
   build a `DynamicCache` from them, and generate from it, computing only the rest.
Prints both outputs and exits 1 unless the tokens are identical.

`--device cuda`: the model and its cache on the GPU, and the blocks move through CUDA
IPC, never through this process's memory: the cache's blocks are gathered into a
registered GPU buffer (`KVPool`, the same bytes per block as the CPU path's), the daemon
copies them out on its own streams (`put_from_cuda`), and a load is the daemon's copies
into that buffer (`get_into_cuda`), from which the new cache's layers are built on the
GPU. The daemon must serve this GPU (`gpu.device`). With `--emulate` the same path runs
on the CPU against a daemon with `gpu.emulate` (the buffer is then a shared-memory
tensor the daemon maps): how it is tested on machines without a GPU.

It also times the first token both ways (median of 3, after a warm-up): from the cache
kvtier gave (the load included) and recomputing the whole prompt; `--json` writes that
and whether the run passed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, DynamicCache

import kvtier
from kvtier.client.cuda import shared_memory_handle


def layer_kv(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer, each [batch, kv_heads, tokens, head_dim]."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def block_parts(cache: DynamicCache, start: int, end: int) -> list[torch.Tensor]:
    """Tokens [start, end) of every layer's K then V, each part contiguous."""
    parts = []
    for keys, values in layer_kv(cache):
        parts.append(keys[:, :, start:end].contiguous())
        parts.append(values[:, :, start:end].contiguous())
    return parts


def store_prefix(
    client: kvtier.Client,
    namespace: str,
    model: torch.nn.Module,
    prefix: torch.Tensor,
    block_tokens: int,
) -> DynamicCache:
    """Prefill `prefix`, store its whole blocks; returns the cache it computed."""
    with torch.no_grad():
        cache = model(prefix, use_cache=True).past_key_values
    ids = prefix[0].tolist()
    blocks = len(ids) // block_tokens
    keys = kvtier.chain_keys(
        namespace, [ids[i * block_tokens : (i + 1) * block_tokens] for i in range(blocks)]
    )
    items = [
        (keys[i], block_parts(cache, i * block_tokens, (i + 1) * block_tokens))
        for i in range(blocks)
    ]
    client.put_many(namespace, items)
    return cache


def load_prefix(
    client: kvtier.Client,
    namespace: str,
    model: torch.nn.Module,
    ids: list[int],
    block_tokens: int,
) -> tuple[DynamicCache, int]:
    """A DynamicCache of the longest prefix of `ids` kvtier holds (whole blocks, leaving at
    least one token to compute), and how many tokens it covers."""
    config = model.config
    usable = (len(ids) - 1) // block_tokens
    keys = kvtier.chain_keys(
        namespace, [ids[i * block_tokens : (i + 1) * block_tokens] for i in range(usable)]
    )
    found = client.lookup(namespace, keys).prefix_blocks if keys else 0
    cache = DynamicCache(config=config)
    if not found:
        return cache, 0
    kv_heads = config.num_key_value_heads
    head_dim = head_dim_of(config)
    shape = (1, kv_heads, found * block_tokens, head_dim)
    layers = [
        (torch.empty(shape, dtype=model.dtype), torch.empty(shape, dtype=model.dtype))
        for _ in range(config.num_hidden_layers)
    ]
    # Each block lands in its place in the layer tensors: token-major slices would not be
    # contiguous there, so it is read into per-block staging parts and copied once.
    staging = [
        [
            torch.empty((1, kv_heads, block_tokens, head_dim), dtype=model.dtype)
            for _ in range(2 * config.num_hidden_layers)
        ]
        for _ in range(found)
    ]
    got = client.get_many(namespace, keys[:found], staging, verify=True)
    loaded = next((i for i, size in enumerate(got) if size is None), found)
    for b in range(loaded):
        span = slice(b * block_tokens, (b + 1) * block_tokens)
        for layer, (k, v) in enumerate(layers):
            k[:, :, span] = staging[b][2 * layer]
            v[:, :, span] = staging[b][2 * layer + 1]
    tokens = loaded * block_tokens
    for layer, (k, v) in enumerate(layers):
        cache.update(k[:, :, :tokens], v[:, :, :tokens], layer)
    return cache, tokens


class KVPool:
    """Blocks in the model's device memory, [blocks, layers, 2 (K, V), kv_heads,
    block_tokens, head_dim]: `memory[b]` holds block b's record, the bytes the CPU path
    writes from the layer slices. Registered with the daemon once, for CUDA IPC (emulated:
    a CPU tensor moved into shared memory, whose file the daemon maps)."""

    def __init__(
        self,
        client: kvtier.Client,
        model: torch.nn.Module,
        blocks: int,
        block_tokens: int,
        emulated: bool,
    ) -> None:
        config = model.config
        self.kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.block_tokens = block_tokens
        self.on_gpu = not emulated
        shape = (blocks, config.num_hidden_layers, 2, self.kv_heads, block_tokens, self.head_dim)
        self.memory = torch.empty(shape, dtype=model.dtype, device=model.device)
        if emulated:
            self.buffer_id = client.register_cuda_handle(*shared_memory_handle(self.memory))
        else:
            self.buffer_id = client.register_cuda(self.memory)
        self.block_bytes = self.memory[0].numel() * self.memory.element_size()

    def slices(self, count: int) -> list[tuple[int, int]]:
        """(offset, size) in the registered buffer of blocks 0..count-1."""
        return [(b * self.block_bytes, self.block_bytes) for b in range(count)]

    def settle(self) -> None:
        """Before the daemon touches the buffer: this process's queued GPU work on it is
        done (the daemon's streams are not ordered after this process's)."""
        if self.on_gpu:
            torch.cuda.synchronize()


def head_dim_of(config: Any) -> int:
    return int(
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )


def chain(namespace: str, ids: list[int], blocks: int, block_tokens: int) -> list[bytes]:
    return kvtier.chain_keys(
        namespace, [ids[i * block_tokens : (i + 1) * block_tokens] for i in range(blocks)]
    )


def store_prefix_ipc(
    client: kvtier.Client,
    pool: KVPool,
    namespace: str,
    model: torch.nn.Module,
    prefix: torch.Tensor,
) -> DynamicCache:
    """`store_prefix` on the model's device: the cache's whole blocks gathered into the
    pool (device to device), then copied out by the daemon; returns the computed cache."""
    with torch.no_grad():
        cache = model(prefix.to(model.device), use_cache=True).past_key_values
    ids = prefix[0].tolist()
    bt, heads, dim = pool.block_tokens, pool.kv_heads, pool.head_dim
    blocks = len(ids) // bt
    for layer, (keys, values) in enumerate(layer_kv(cache)):
        for kv, tensor in ((0, keys), (1, values)):
            tokens = tensor[0, :, : blocks * bt].reshape(heads, blocks, bt, dim)
            pool.memory[:blocks, layer, kv].copy_(tokens.transpose(0, 1))
    pool.settle()
    keys = chain(namespace, ids, blocks, bt)
    client.put_from_cuda(namespace, keys, pool.buffer_id, pool.slices(blocks))
    return cache


def load_prefix_ipc(
    client: kvtier.Client, pool: KVPool, namespace: str, model: torch.nn.Module, ids: list[int]
) -> tuple[DynamicCache, int]:
    """`load_prefix` on the model's device: the daemon copies the blocks it has into the
    pool, and each layer's K and V are built from the pool (one copy on the device)."""
    bt, heads, dim = pool.block_tokens, pool.kv_heads, pool.head_dim
    keys = chain(namespace, ids, min((len(ids) - 1) // bt, pool.memory.shape[0]), bt)
    found = client.lookup(namespace, keys).prefix_blocks if keys else 0
    cache = DynamicCache(config=model.config)
    if not found:
        return cache, 0
    pool.settle()  # the last cache built from the pool may still be being copied
    got = client.get_into_cuda(namespace, keys[:found], pool.buffer_id, pool.slices(found))
    loaded = next((i for i, ok in enumerate(got) if not ok), found)
    tokens = loaded * bt
    for layer in range(model.config.num_hidden_layers):
        kv = []
        for part in (0, 1):
            out = torch.empty((1, heads, loaded, bt, dim), dtype=model.dtype, device=model.device)
            out[0].copy_(pool.memory[:loaded, layer, part].transpose(0, 1))
            kv.append(out.view(1, heads, tokens, dim))
        cache.update(kv[0], kv[1], layer)
    return cache, tokens


def generate(
    model: torch.nn.Module, ids: list[int], new_tokens: int, cache: DynamicCache | None = None
) -> list[int]:
    prompt = torch.tensor([ids], device=model.device)
    with torch.no_grad():
        out = model.generate(
            prompt,
            past_key_values=cache,
            max_new_tokens=new_tokens,
            do_sample=False,
            attention_mask=torch.ones_like(prompt),
        )
    return list(out[0, len(ids) :].tolist())


def ttft_s(first_token: Callable[[], object], on_gpu: bool, repeats: int = 3) -> float:
    """The median time of `first_token()` after a warm-up (first-use costs are not the
    time to first token)."""
    first_token()
    times = []
    for _ in range(repeats):
        started_s = time.perf_counter()
        first_token()
        if on_gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started_s)
    return statistics.median(times)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a local HF causal LM directory")
    parser.add_argument("--target", default=None, help="the daemon (default: its socket)")
    parser.add_argument("--namespace", default=None)
    parser.add_argument("--block-tokens", type=int, default=64)
    parser.add_argument("--prefix-tokens", type=int, default=512)
    parser.add_argument("--suffix-tokens", type=int, default=40)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--emulate",
        action="store_true",
        help="with --device cuda: the CUDA IPC path on the CPU, for a daemon with gpu.emulate",
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--json", type=Path, help="write the outcome and the TTFTs here")
    args = parser.parse_args(argv)
    ipc = args.device == "cuda"
    on_gpu = ipc and not args.emulate
    if on_gpu and not torch.cuda.is_available():
        parser.error("--device cuda needs a GPU (or --emulate, against a gpu.emulate daemon)")

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    model.to("cuda" if on_gpu else "cpu").eval()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, vocab, (args.prefix_tokens + args.suffix_tokens,), generator=g).tolist()
    # Where the KV was computed is part of its bytes (another device rounds differently).
    namespace = args.namespace or (
        f"hf-example/{model.config.model_type}-{args.dtype}-b{args.block_tokens}-"
        f"{'cuda' if on_gpu else 'cpu'}"
    )
    prefix = torch.tensor([ids[: args.prefix_tokens]])

    reference = generate(model, ids, args.new_tokens)
    with kvtier.Client(args.target) as client:
        if ipc:
            blocks = args.prefix_tokens // args.block_tokens
            pool = KVPool(client, model, blocks, args.block_tokens, args.emulate)
            computed = store_prefix_ipc(client, pool, namespace, model, prefix)

            def load() -> tuple[DynamicCache, int]:
                return load_prefix_ipc(client, pool, namespace, model, ids)
        else:
            computed = store_prefix(client, namespace, model, prefix, args.block_tokens)

            def load() -> tuple[DynamicCache, int]:
                return load_prefix(client, namespace, model, ids, args.block_tokens)

        cache, cached = load()
        ttft = {
            "kvtier": ttft_s(lambda: generate(model, ids, 1, load()[0]), on_gpu),
            "recompute": ttft_s(lambda: generate(model, ids, 1), on_gpu),
        }
    exact = all(
        torch.equal(k[:, :, :cached], lk) and torch.equal(v[:, :, :cached], lv)
        for (k, v), (lk, lv) in zip(layer_kv(computed), layer_kv(cache), strict=True)
    )
    from_kvtier = generate(model, ids, args.new_tokens, cache)
    print(f"prompt {len(ids)} tokens; {cached} of them from kvtier")
    print(f"KV from kvtier equal to the computed KV, bit for bit: {'yes' if exact else 'NO'}")
    print(f"recomputed: {reference}")
    print(f"via kvtier: {from_kvtier}")
    print(
        f"time to first token: {ttft['kvtier'] * 1e3:.1f} ms from kvtier's cache, "
        f"{ttft['recompute'] * 1e3:.1f} ms recomputing ({ttft['kvtier'] / ttft['recompute']:.2f}x)"
    )
    passed = cached > 0 and exact and from_kvtier == reference
    if args.json:
        outcome = {
            "engine": "transformers",
            "device": torch.cuda.get_device_name() if on_gpu else "cpu",
            "transport": ("cuda-ipc-emulated" if args.emulate else "cuda-ipc") if ipc else "arena",
            "passed": passed,
            "cached_tokens": cached,
            "prompt_tokens": len(ids),
            "ttft_s": ttft,
            # < 1: the first token comes sooner from kvtier's cache than recomputing
            "ttft_ratio": ttft["kvtier"] / ttft["recompute"],
        }
        args.json.write_text(json.dumps(outcome, indent=2) + "\n")
    if cached == 0:
        print("nothing was loaded from kvtier")
        return 1
    if not passed:
        print("MISMATCH")
        return 1
    print("identical")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
