"""The demo model in JAX: the forward pass, one ``jax.jit`` function with donated caches."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import qsa_jax
from model import ACT_LIMIT, GRID, ModelConfig, rope_table
from qsa_kernels.paging import CacheGeometry


def quantize(x: jax.Array) -> jax.Array:
    return jnp.clip(jnp.round(x * GRID), -ACT_LIMIT * GRID, ACT_LIMIT * GRID) / GRID


def dot(x, w):
    # Exact either way (see model.py); HIGHEST keeps XLA:GPU from TF32 on principle.
    return jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST)


def forward(params: dict, tokens: jax.Array, states: list, meta: qsa_jax.StepMetadata, *, config: ModelConfig,
            all_reduce=None):
    """-> (logits of each request's last row [B, vocab], greedy tokens [B], states, token indices per layer).

    ``all_reduce`` sums the output projection's partial products over devices
    when the heads are split (``tensor_parallel.py``: a ``psum``); default none.
    """
    c = config
    rows = tokens.shape[0]
    h = params["embed"][tokens]
    new_states, selections = [], []
    for layer, state in zip(params["layers"], states):
        heads = lambda w, n, d: dot(h, w).reshape(rows, n, d).astype(jnp.bfloat16)  # noqa: E731
        out, state, selected = qsa_jax.qsa_attention_step(
            heads(layer["wq"], c.heads, c.head_dim), heads(layer["wk"], c.kv_heads, c.head_dim),
            heads(layer["wv"], c.kv_heads, c.head_dim), heads(layer["wiq"], c.index_heads, c.index_head_dim),
            heads(layer["wik"], 1, c.index_head_dim), state, meta, params["cos_sin"], params["index_cos_sin"],
            compress_ratio=c.compress_ratio, token_topk=c.token_topk, return_token_indices=True)
        attention = quantize(out.astype(jnp.float32).reshape(rows, -1))
        projected = dot(attention, layer["wo"])
        if all_reduce is not None:
            projected = all_reduce(projected)  # exact: partial sums of fixed-point products (model.py)
        h = jnp.clip(h + quantize(projected), -ACT_LIMIT, ACT_LIMIT)
        up = jax.nn.relu(quantize(dot(h, layer["wup"])))
        h = jnp.clip(h + quantize(dot(up, layer["wdown"])), -ACT_LIMIT, ACT_LIMIT)
        new_states.append(state)
        selections.append(selected)
    logits = dot(h[meta.query_start_loc[1:] - 1], params["lm_head"])
    return logits, jnp.argmax(logits, axis=-1), new_states, selections


class JaxModel:
    def __init__(self, config: ModelConfig, weights: dict):
        self.config = config
        self.params = jax.tree_util.tree_map(jnp.asarray, dict(
            weights,
            cos_sin=rope_table(config.head_dim, config.max_position, config.rope_base),
            index_cos_sin=rope_table(config.index_head_dim, config.max_position, config.rope_base)))
        self.traces = 0

        def traced(*args, **kwargs):
            self.traces += 1  # runs once per trace, not per call
            return forward(*args, **kwargs)

        #: The whole step, jitted once per batch shape; the caches are donated (updated in place).
        self.step = jax.jit(functools.partial(traced, config=config), donate_argnums=(2,))

    def new_states(self, geometry: CacheGeometry) -> list[qsa_jax.QSAState]:
        c = self.config
        return [qsa_jax.QSAState.zeros(geometry, kv_heads=c.kv_heads, head_dim=c.head_dim,
                                       index_head_dim=c.index_head_dim, dtype=jnp.bfloat16)
                for _ in range(c.layers)]

    def __call__(self, tokens, states, meta):
        return self.step(self.params, tokens, states, meta)
