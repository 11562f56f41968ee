"""HF transformers generating with a prompt prefix whose KV cache comes from kvtier.

    python examples/transformers_prefix_cache.py --model DIR [--target unix:///run/kvtier/kvtier.sock]

Needs `pip install kvtier torch transformers` and a running daemon. What it does:
1. reference: greedy generation from the whole prompt, computed from scratch;
2. store: prefill the prompt's prefix, cut its `DynamicCache` into blocks of
   `--block-tokens` tokens (every layer's K and V for those tokens: one kvtier block under
   a chained key, written from the layer slices without joining them first);
3. load: look the chain up, copy the blocks kvtier has straight into per-layer tensors,
   build a `DynamicCache` from them, and generate from it, computing only the rest.
Prints both outputs and exits 1 unless the tokens are identical.
"""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import AutoModelForCausalLM, DynamicCache

import kvtier


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
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
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


def generate(
    model: torch.nn.Module, ids: list[int], new_tokens: int, cache: DynamicCache | None = None
) -> list[int]:
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            prompt,
            past_key_values=cache,
            max_new_tokens=new_tokens,
            do_sample=False,
            attention_mask=torch.ones_like(prompt),
        )
    return list(out[0, len(ids) :].tolist())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a local HF causal LM directory")
    parser.add_argument("--target", default=None, help="the daemon (default: its socket)")
    parser.add_argument("--namespace", default=None)
    parser.add_argument("--block-tokens", type=int, default=64)
    parser.add_argument("--prefix-tokens", type=int, default=512)
    parser.add_argument("--suffix-tokens", type=int, default=40)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, vocab, (args.prefix_tokens + args.suffix_tokens,), generator=g).tolist()
    namespace = args.namespace or f"hf-example/{model.config.model_type}-fp32-b{args.block_tokens}"

    reference = generate(model, ids, args.new_tokens)
    with kvtier.Client(args.target) as client:
        computed = store_prefix(
            client, namespace, model, torch.tensor([ids[: args.prefix_tokens]]), args.block_tokens
        )
        cache, cached = load_prefix(client, namespace, model, ids, args.block_tokens)
    exact = all(
        torch.equal(k[:, :, :cached], lk) and torch.equal(v[:, :, :cached], lv)
        for (k, v), (lk, lv) in zip(layer_kv(computed), layer_kv(cache), strict=True)
    )
    from_kvtier = generate(model, ids, args.new_tokens, cache)
    print(f"prompt {len(ids)} tokens; {cached} of them from kvtier")
    print(f"KV from kvtier equal to the computed KV, bit for bit: {'yes' if exact else 'NO'}")
    print(f"recomputed: {reference}")
    print(f"via kvtier: {from_kvtier}")
    if cached == 0:
        print("nothing was loaded from kvtier")
        return 1
    if not exact or from_kvtier != reference:
        print("MISMATCH")
        return 1
    print("identical")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
