"""The demo model, framework-free parts: configuration, weights, RoPE tables, the request loop.

A small decoder with random weights: token embeddings, then per layer a QSA
attention block (q/k/v projections and an indexer with its own q/k
projections, then ``qsa_attention_step`` and an output projection) and a
ReLU MLP, each added to the residual stream; an LM head on each request's
last row.  ``model_torch.py`` and ``model_jax.py`` write the same forward
pass in each framework; ``model_reference.py`` is the float64 NumPy one.

Why the dense layers are fixed point.  The demo checks that torch and JAX
produce *identical* logits.  The QSA kernels are the same Triton code in both
frameworks, but the dense math is not: MKL or cuBLAS against XLA, with their
own summation orders, TF32 passes and fused epilogues.  So the dense layers
here are exact by construction: activations are multiples of 1/256 with
|x| <= 4 (``quantize``) and weights are ternary times a power of two
(BitNet-style), so every product and every partial sum of a matmul is an
integer multiple of one power of two below 2**24 -- exact in float32 (and in
TF32 or bf16 inputs) in any order.  What could still differ between the
frameworks is what the kernels compute; the demo shows it does not.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

#: Activations are integer multiples of 1/GRID ...
GRID = 256
#: ... within +-ACT_LIMIT (1024 steps: 11 significant bits, exact in TF32 too).
ACT_LIMIT = 4.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab: int
    hidden: int
    mlp: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    index_heads: int
    index_head_dim: int
    compress_ratio: int
    token_topk: int
    max_position: int
    rope_base: float = 10000.0


#: Small enough for Triton's interpreter on a CPU.
CPU_CONFIG = ModelConfig(vocab=384, hidden=64, mlp=128, layers=2, heads=4, kv_heads=2, head_dim=32,
                         index_heads=2, index_head_dim=32, compress_ratio=4, token_topk=8, max_position=256)

#: The production QSA geometry (attention 24 Q / 2 KV heads x d256, indexer 4 x d128,
#: ratio 4, top 2048 tokens); a narrow residual stream keeps the dense part small.
PRODUCTION_CONFIG = ModelConfig(vocab=8192, hidden=1024, mlp=2048, layers=2, heads=24, kv_heads=2, head_dim=256,
                                index_heads=4, index_head_dim=128, compress_ratio=4, token_topk=2048,
                                max_position=131072 + 1024)


def quantize_numpy(x: np.ndarray) -> np.ndarray:
    """Round to the activation grid (half to even, as torch.round and jnp.round) and saturate."""
    return np.clip(np.round(x * GRID), -ACT_LIMIT * GRID, ACT_LIMIT * GRID) / GRID


def _ternary(rng: np.random.Generator, fan_in: int, fan_out: int) -> np.ndarray:
    """{-1, 0, 1} (a third each) times the power of two closest to keeping the variance."""
    scale = 2.0 ** -round(0.5 * math.log2(fan_in * 2 / 3))
    return (rng.integers(-1, 2, size=(fan_in, fan_out)) * scale).astype(np.float32)


def make_weights(config: ModelConfig, seed: int = 0) -> dict:
    """Random weights (float32 NumPy): ``embed``, ``lm_head`` and per-layer projections."""
    rng = np.random.default_rng(seed)
    c = config
    layers = []
    for _ in range(c.layers):
        layers.append(dict(
            wq=_ternary(rng, c.hidden, c.heads * c.head_dim),
            wk=_ternary(rng, c.hidden, c.kv_heads * c.head_dim),
            wv=_ternary(rng, c.hidden, c.kv_heads * c.head_dim),
            wiq=_ternary(rng, c.hidden, c.index_heads * c.index_head_dim),
            wik=_ternary(rng, c.hidden, c.index_head_dim),
            wo=_ternary(rng, c.heads * c.head_dim, c.hidden),
            wup=_ternary(rng, c.hidden, c.mlp),
            wdown=_ternary(rng, c.mlp, c.hidden),
        ))
    embed = quantize_numpy(rng.normal(size=(c.vocab, c.hidden))).astype(np.float32)
    return dict(embed=embed, lm_head=_ternary(rng, c.hidden, c.vocab), layers=layers)


def rope_table(dim: int, max_position: int, base: float) -> np.ndarray:
    """``[max_position, dim]`` float32 cos then sin (F = dim/2 frequencies, NeoX)."""
    inv_freq = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    angles = np.arange(max_position, dtype=np.float64)[:, None] * inv_freq
    return np.concatenate([np.cos(angles), np.sin(angles)], 1).astype(np.float32)


@dataclasses.dataclass
class Request:
    """One prompt being prefilled in chunks, then decoded greedily."""

    prompt: list[int]
    max_new_tokens: int
    fed: int = 0  # prompt tokens already in the caches
    generated: list[int] = dataclasses.field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.max_new_tokens

    def next_rows(self, chunk: int) -> list[int]:
        """Token ids this request feeds to the next step: a prompt chunk, or its last token."""
        if self.fed < len(self.prompt):
            return self.prompt[self.fed: self.fed + chunk]
        return [self.generated[-1]]

    def advance(self, rows: int, next_token: int) -> None:
        """Account for a step; the token sampled from the last row counts once the prompt is in."""
        self.fed = min(self.fed + rows, len(self.prompt))
        if self.fed == len(self.prompt):
            self.generated.append(next_token)
