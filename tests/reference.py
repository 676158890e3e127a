"""Plain float64 references of every stage, written from the seeds and API.md.

NumPy only, loops where they make the semantics obvious; nothing here imports
the kernels.  Inputs are NumPy arrays (callers convert from their framework).
"""

from __future__ import annotations

import numpy as np


# --------------------------------------------------------------------------
# Stage 1: RoPE + paged KV-cache write
# --------------------------------------------------------------------------

def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, is_neox: bool) -> np.ndarray:
    """Rotate one row ``x [H, D]`` with per-dimension ``cos``/``sin`` ``[D]``."""
    d = x.shape[-1]
    if is_neox:
        first, second = x[..., : d // 2], x[..., d // 2:]
        rotated = np.concatenate([-second, first], axis=-1)
    else:
        rotated = np.empty_like(x)
        rotated[..., 0::2] = -x[..., 1::2]
        rotated[..., 1::2] = x[..., 0::2]
    return x * cos + rotated * sin


def cos_sin_row(cos_sin: np.ndarray, position: int, d: int, is_neox: bool):
    """Per-dimension cos and sin ``[D]`` at ``position`` (F = D/2 or D)."""
    f = cos_sin.shape[1] // 2
    cos, sin = cos_sin[position, :f], cos_sin[position, f:]
    if f == d:
        return cos, sin
    if is_neox:  # frequencies reused for both halves
        return np.concatenate([cos, cos]), np.concatenate([sin, sin])
    return np.repeat(cos, 2), np.repeat(sin, 2)  # one frequency per pair


def cache_index(layout: str, page: int, offset: int, head: int, x: int):
    """Index tuples (key, value) of one token's head in a cache layout, D-vectorised.

    Returns functions of ``d`` so callers can address element ``d``.
    """
    if layout == "flash":
        return (lambda d: (page, offset, head, d)), (lambda d: (page, offset, head, d))
    key = lambda d: (page, head, d // x, offset, d % x)  # noqa: E731
    if layout == "paged":
        return key, (lambda d: (page, head, d, offset))
    return key, (lambda d: (page, head, offset // x, d, offset % x))


def rope_reshape_and_cache(q, k, v, key_cache, value_cache, slot_mapping, positions, cos_sin, *,
                           is_neox, layout, x=None, k_scale=None, v_scale=None, offsets=None,
                           swa_slot_mapping=None, fp8=False):
    """Reference of stage 1.  Returns ``(q_out, k_out, key_cache, value_cache)``.

    Caches are float64 copies of the inputs, updated where a slot addresses
    them; values are divided by the scales and, for fp8 caches, clipped to
    +-448 (the caller rounds to the cache dtype).
    """
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    v = np.asarray(v, np.float64)
    key_cache = np.array(key_cache, np.float64)
    value_cache = np.array(value_cache, np.float64)
    cos_sin = np.asarray(cos_sin, np.float64)
    t, qh, d = q.shape
    t_kv, kh, _ = k.shape
    page_size = key_cache.shape[1] if layout == "flash" else key_cache.shape[3]
    num_slots = key_cache.shape[0] * page_size
    q_out = np.full_like(q, np.nan)
    k_out = k.copy()
    for row in range(t_kv):
        position_ok = True
        if row < t:
            position = int(positions[row]) + (int(offsets[row]) if offsets is not None else 0)
            position_ok = 0 <= position < cos_sin.shape[0]
            if position_ok:
                cos, sin = cos_sin_row(cos_sin, position, d, is_neox)
                q_out[row] = rope(q[row], cos, sin, is_neox)
                k_out[row] = rope(k[row], cos, sin, is_neox)
            else:
                k_out[row] = np.nan
        slot = int(slot_mapping[row])
        if slot < 0:
            continue
        if swa_slot_mapping is not None:
            if slot >= len(swa_slot_mapping):
                continue
            slot = int(swa_slot_mapping[slot])
        if not (0 <= slot < num_slots) or not position_ok:
            continue
        page, offset = divmod(slot, page_size)
        for head in range(kh):
            key_at, value_at = cache_index(layout, page, offset, head, x)
            kv = k_out[row, head] / (float(k_scale) if k_scale is not None else 1.0)
            vv = v[row, head] / (float(v_scale) if v_scale is not None else 1.0)
            if fp8:
                kv, vv = np.clip(kv, -448, 448), np.clip(vv, -448, 448)
            dims = np.arange(d)
            key_cache[key_at(dims)] = kv
            value_cache[value_at(dims)] = vv
    return q_out, k_out, key_cache, value_cache
