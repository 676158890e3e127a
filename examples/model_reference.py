"""The demo model in float64 NumPy: no bf16 anywhere, plain softmax attention.

Selection is discrete (a top-k), so the reference attends the tokens the
kernels selected at each step and layer; everything else -- projections,
RoPE, the K/V history, attention, the fixed-point rounding of activations --
it computes itself, in float64, from each request's whole history (no pages).
"""

from __future__ import annotations

import numpy as np

from model import ACT_LIMIT, ModelConfig, quantize_numpy, rope_table


def rope(x: np.ndarray, positions: np.ndarray, table: np.ndarray) -> np.ndarray:
    """NeoX RoPE of ``x [N, H, D]`` at ``positions [N]`` (``table`` cos then sin, D/2 each)."""
    half = x.shape[-1] // 2
    cos, sin = table[positions, :half][:, None], table[positions, half:][:, None]
    first, second = x[..., :half], x[..., half:]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


class ReferenceModel:
    def __init__(self, config: ModelConfig, weights: dict):
        self.config = config
        f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
        self.embed, self.lm_head = f64(weights["embed"]), f64(weights["lm_head"])
        self.layers = [{name: f64(w) for name, w in layer.items()} for layer in weights["layers"]]
        # The kernels' float32 table, widened: both rotate by the same angles.
        self.cos_sin = f64(rope_table(config.head_dim, config.max_position, config.rope_base))
        self.history: dict = {}  # request -> per layer (keys [L, KH, D], values [L, KH, D]), before RoPE

    def release(self, request) -> None:
        del self.history[request]

    def step(self, tokens, requests: list, host_meta, selections: list) -> np.ndarray:
        """One step over ``tokens [T]`` (rows as ``host_meta`` says); ``selections[layer]`` ``[T, W]``
        are the kernels' token indices.  Returns the logits of each request's last row ``[B, vocab]``."""
        c = self.config
        rows = len(tokens)
        row_requests = [requests[b] for b in host_meta.token_to_req]
        positions = host_meta.positions.astype(np.int64)
        h = self.embed[np.asarray(tokens)]
        for index, layer in enumerate(self.layers):
            q = (h @ layer["wq"]).reshape(rows, c.heads, c.head_dim)
            k = (h @ layer["wk"]).reshape(rows, c.kv_heads, c.head_dim)
            v = (h @ layer["wv"]).reshape(rows, c.kv_heads, c.head_dim)
            for b, request in enumerate(requests):
                mine = slice(host_meta.query_start_loc[b], host_meta.query_start_loc[b + 1])
                layers = self.history.setdefault(request, [None] * c.layers)
                old = layers[index]
                layers[index] = (k[mine], v[mine]) if old is None else (
                    np.concatenate([old[0], k[mine]]), np.concatenate([old[1], v[mine]]))
            out = np.zeros_like(q)
            queries = rope(q, positions, self.cos_sin)
            group = c.heads // c.kv_heads
            for row in range(rows):
                selected = selections[index][row]
                selected = selected[selected >= 0].astype(np.int64)
                keys, values = self.history[row_requests[row]][index]
                keys = rope(keys[selected], selected, self.cos_sin)
                for head in range(c.heads):
                    scores = keys[:, head // group] @ queries[row, head] / np.sqrt(c.head_dim)
                    weights = np.exp(scores - scores.max())
                    out[row, head] = weights @ values[selected, head // group] / weights.sum()
            attention = quantize_numpy(out.reshape(rows, -1))
            h = np.clip(h + quantize_numpy(attention @ layer["wo"]), -ACT_LIMIT, ACT_LIMIT)
            up = np.maximum(quantize_numpy(h @ layer["wup"]), 0)
            h = np.clip(h + quantize_numpy(up @ layer["wdown"]), -ACT_LIMIT, ACT_LIMIT)
        return h[host_meta.query_start_loc[1:] - 1] @ self.lm_head
