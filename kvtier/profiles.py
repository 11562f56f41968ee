"""Model profiles: KV bytes per token and a default prefill cost, until engines report theirs.

Prefill cost per token at position p is a + c*p. Derived for bf16 at 40 % of an H100's
989 TFLOP/s dense peak (395.6 TFLOP/s achieved): a = 2 * params / F (the matmuls),
c = 4 * layers * d_model / F (attention over earlier positions); a `-tpN` profile spreads
the compute over N GPUs while the node still fetches every GPU's share of the KV.
These are starting points: the issue's worked figures imply c ~ 1.0e-9 for Llama-3-8B
(these formulas give 1.3e-9); measured prefill timings should replace them.
"""

from __future__ import annotations

from dataclasses import dataclass

ACHIEVED_FLOPS = 0.4 * 989e12


@dataclass(frozen=True, slots=True)
class ModelProfile:
    kv_bytes_per_token: int
    a_s_per_token: float
    c_s_per_token2: float
    layers: int


def _profile(
    params: float, layers: int, d_model: int, kv_heads: int, head_dim: int, tp: int = 1
) -> ModelProfile:
    kv_bytes = 2 * layers * kv_heads * head_dim * 2  # K and V, bf16, whole model (the node)
    return ModelProfile(
        kv_bytes_per_token=kv_bytes,
        a_s_per_token=2 * params / tp / ACHIEVED_FLOPS,
        c_s_per_token2=4 * layers * d_model / tp / ACHIEVED_FLOPS,
        layers=layers,
    )


MODELS: dict[str, ModelProfile] = {
    "llama3-8b": _profile(8.03e9, 32, 4096, 8, 128),
    "llama3-70b": _profile(70.6e9, 80, 8192, 8, 128),
    "llama3-70b-tp8": _profile(70.6e9, 80, 8192, 8, 128, tp=8),
    "mistral-7b": _profile(7.24e9, 32, 4096, 8, 128),
    "qwen2.5-7b": _profile(7.6e9, 28, 3584, 4, 128),
}
