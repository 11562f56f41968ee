"""Runs real vLLM (from .venv-vllm) for the connector's end-to-end tests and benchmark.

    python vllm_driver.py build-model DIR [--layers 4] [--hidden 256] [--heads 4] [--kv-heads 2]
    python vllm_driver.py generate --model DIR --prompts P.json --out O.json
        [--target unix:///...sock] [--load 0|1] [--save 0|1] [--multiprocess]
        [--device-path auto|emulate]
    python vllm_driver.py reference --model DIR --prompts P.json --out O.json

`generate` runs every prompt (token ids) one at a time, greedy, with logprobs; writes per
prompt the generated token ids, their logprobs, vLLM's num_cached_tokens and the time it
took (the time to first token with --max-tokens 1). Without --target no connector is
configured (the cold reference). `--device-path emulate`: the connector moves the CPU KV
through its GPU path (CUDA IPC, layer by layer), for a daemon running `gpu.emulate`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "1")

BLOCK_SIZE = 128


def build_model(
    out: Path, layers: int = 4, hidden: int = 256, heads: int = 4, kv_heads: int = 2
) -> None:
    """A tiny Llama with random (seeded) weights and a small BPE tokenizer, offline."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<unk>", "<s>", "</s>", "<pad>"], show_progress=False
    )
    text = [
        "the quick brown fox jumps over the lazy dog",
        "key value caches keep attention state between requests",
        "a daemon moves blocks between memory and disk",
    ] * 20
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    fast.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=fast.vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)


def make_llm(model: str, kv_config: object = None) -> Any:
    from vllm import LLM

    return LLM(
        model=model,
        dtype="bfloat16",
        max_model_len=4096,
        enforce_eager=True,
        enable_prefix_caching=True,
        block_size=BLOCK_SIZE,
        kv_transfer_config=kv_config,
        seed=0,
    )


def run_prompt(llm: Any, ids: list[int], max_tokens: int) -> dict[str, Any]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    began_s = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    elapsed_s = time.perf_counter() - began_s
    completion = out.outputs[0]
    return {
        "token_ids": list(completion.token_ids),
        "logprobs": [
            lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids, strict=True)
        ],
        "num_cached_tokens": out.num_cached_tokens,
        "elapsed_s": elapsed_s,  # the time to first token with --max-tokens 1
    }


def generate(args: argparse.Namespace) -> None:
    from vllm.config import KVTransferConfig

    prompts = json.loads(Path(args.prompts).read_text())
    kv_config = None
    if args.target:
        kv_config = KVTransferConfig(
            kv_connector="KVTierConnector",
            kv_connector_module_path="kvtier.integrations.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",  # a block kvtier cannot give is recomputed
            kv_connector_extra_config={
                "target": args.target,
                "load": args.load,
                "save": args.save,
                "retry_s": 0.5,
                "timeout_s": args.timeout_s,
                "fetch": args.fetch,
                "device_path": args.device_path,
                "prefetch": args.prefetch,
            },
        )
    started_s = time.perf_counter()
    llm = make_llm(args.model, kv_config)
    start_s = time.perf_counter() - started_s
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    warmup(
        llm, args.warmup, max(len(p) for p in prompts) if prompts else 0, vocab, args.multiprocess
    )
    results = []
    for ids in prompts:
        reset_prefix_cache(llm, args.multiprocess)  # a hit must come from kvtier, not vLLM's
        results.append(run_prompt(llm, ids, args.max_tokens))
    Path(args.out).write_text(json.dumps({"engine_start_s": start_s, "results": results}))


def reset_prefix_cache(llm: Any, multiprocess: bool, timeout_s: float = 120.0) -> None:
    """Empty vLLM's prefix cache. It refuses while a finished request's blocks are still
    held (the connector frees them once their saves are stored): an engine in its own
    process steps on by itself until then; one in this process is stepped here."""
    deadline_s = time.monotonic() + timeout_s
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline_s:
            raise RuntimeError(f"vLLM's prefix cache still held blocks after {timeout_s} s")
        if not multiprocess:
            llm.llm_engine.step()
        time.sleep(0.01)


def warmup(llm: Any, prompts: int, max_tokens_in: int, vocab: int, multiprocess: bool) -> None:
    """Prompts of random tokens, up to `max_tokens_in` long, run and thrown away: the
    engine's one-time costs are paid, and the daemon has the prefill timings it needs
    to estimate recompute costs (it uses its own after 8) before anything is measured."""
    if not prompts:
        return
    rng = random.Random(12345)
    for i in range(prompts):
        length = max(BLOCK_SIZE, max_tokens_in * (i % 4 + 1) // 4)
        reset_prefix_cache(llm, multiprocess)
        run_prompt(llm, [rng.randrange(4, vocab) for _ in range(length)], 1)


def reference(args: argparse.Namespace) -> None:
    """vLLM alone, its own prefix cache kept across prompts: the prompts in order
    ("sequence": each reuses what the earlier ones computed), then all again ("repeat":
    each reuses its own). A kvtier-backed engine that computed and stored the same way
    must give these outputs bit for bit; a cold run differs from them in the logprobs'
    last bits (a prefix hit sums attention in another order)."""
    prompts = json.loads(Path(args.prompts).read_text())
    llm = make_llm(args.model)
    llm.reset_prefix_cache()
    out = {
        "sequence": [run_prompt(llm, ids, args.max_tokens) for ids in prompts],
        "repeat": [run_prompt(llm, ids, args.max_tokens) for ids in prompts],
    }
    Path(args.out).write_text(json.dumps(out))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build-model")
    b.add_argument("dir")
    b.add_argument("--layers", type=int, default=4)
    b.add_argument("--hidden", type=int, default=256)
    b.add_argument("--heads", type=int, default=4)
    b.add_argument("--kv-heads", type=int, default=2)
    g = sub.add_parser("generate")
    g.add_argument("--model", required=True)
    g.add_argument("--prompts", required=True)
    g.add_argument("--out", required=True)
    g.add_argument("--target", default="")
    g.add_argument("--load", type=int, default=1)
    g.add_argument("--save", type=int, default=1)
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--multiprocess", action="store_true")
    g.add_argument("--fetch", choices=["plan", "always"], default="plan")
    g.add_argument("--device-path", choices=["auto", "emulate"], default="auto")
    g.add_argument("--prefetch", type=int, default=1, help="announce waiting requests")
    g.add_argument("--warmup", type=int, default=0, help="throwaway prompts run first")
    g.add_argument("--timeout-s", type=float, default=2.0, help="the connector's RPC deadline")
    r = sub.add_parser("reference")
    r.add_argument("--model", required=True)
    r.add_argument("--prompts", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    if args.cmd == "build-model":
        build_model(Path(args.dir), args.layers, args.hidden, args.heads, args.kv_heads)
        return
    multiprocess = getattr(args, "multiprocess", False)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    (generate if args.cmd == "generate" else reference)(args)


if __name__ == "__main__":
    main(sys.argv[1:])
