"""Plain float64 references of every stage, written from the seeds and docs/api.md.

NumPy only, loops where they make the semantics obvious; nothing here imports
the kernels.  Inputs are NumPy arrays (callers convert from their framework).
"""

from __future__ import annotations

import numpy as np


# --------------------------------------------------------------------------
# fp8 e4m3fn (the caches' byte format): decoding and the writers' rounding
# --------------------------------------------------------------------------

def e4m3_value(code: int) -> float:
    """The value of one e4m3fn byte ``s eeee mmm`` (bias 7, no infinities): NaN for 0x7f, 0xff."""
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return float("nan")
    if exponent == 0:  # subnormal: 0.mmm x 2**-6
        return sign * mantissa / 8 * 2.0 ** -6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def e4m3_round(x) -> np.ndarray:
    """What an fp8 writer stores for float64 ``x`` (docs/api.md), as a float64 value: NaN stays
    NaN; finite values and +-inf beyond +-448 saturate to +-448; the rest round to the nearest
    e4m3 value, ties to the even mantissa (spacing 2**(e - 3) in [2**e, 2**(e+1)), 2**-9 below
    2**-6); the sign of zero is kept."""
    x = np.asarray(x, np.float64)
    out = np.empty_like(x)
    for i, value in np.ndenumerate(x):
        if np.isnan(value):
            out[i] = np.nan
            continue
        magnitude = min(abs(value), 448.0)
        exponent = max(int(np.floor(np.log2(magnitude))), -6) if magnitude > 0 else -6
        spacing = 2.0 ** (exponent - 3)
        out[i] = np.copysign(min(np.round(magnitude / spacing) * spacing, 448.0), value)  # np.round: ties to even
    return out


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
    """Reference of stage 1.

    Returns ``(q_out, k_out, key_cache, value_cache, written)``; ``written``
    marks the key/value cache cells some valid slot addressed.

    Caches are float64 copies of the inputs, updated where a slot addresses
    them; values are divided by the scales and, for fp8 caches, clipped to
    +-448 (NaN stays NaN; the caller rounds to the cache dtype).  A row
    whose position is outside ``cos_sin`` writes no cell.
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
    written = np.zeros(key_cache.shape, bool), np.zeros(value_cache.shape, bool)
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
            written[0][key_at(dims)] = True
            written[1][value_at(dims)] = True
    return q_out, k_out, key_cache, value_cache, written


def identity_cos_sin(rows: int, d: int) -> np.ndarray:
    """A ``[rows, D]`` float64 RoPE table that rotates by nothing: cos 1, sin 0 (F = D/2)."""
    return np.concatenate([np.ones((rows, d // 2)), np.zeros((rows, d // 2))], axis=1)


def source_scaled(x, scale) -> np.ndarray:
    """What aiter's ``fused_qk_rope_reshape_and_cache`` (``apply_scale=True``) stores for float32
    values ``x`` into a 16/32-bit cache, before the cast to its dtype: ``x * (1 / scale)``, the
    reciprocal and the product each rounded to float32 (nearest even), as float32."""
    reciprocal = np.float32(1.0) / np.float32(scale)
    return (np.asarray(x, np.float32) * reciprocal).astype(np.float32)


# --------------------------------------------------------------------------
# Stage 2: key compression and row store
# --------------------------------------------------------------------------

def compress_groups(raw_keys, raw_positions, compressor_state_cache, compressor_state_block_table,
                    token_to_req, query_start_loc, logical_positions, compressed_slots,
                    compress_ratio, rope_cache=None):
    """Reference of stage 2's pooling: ``(pooled [R, 1, D] float64, first_positions [R, 3] int64)``."""
    raw_keys = np.asarray(raw_keys, np.float64)
    ring = np.asarray(compressor_state_cache, np.float64)
    rows, _, d = raw_keys.shape
    blocks, ring_size = ring.shape[:2]
    num_requests = len(query_start_loc) - 1
    pooled = np.zeros((rows, 1, d))
    first_positions = np.zeros((rows, 3), np.int64)
    for row in range(rows):
        request, end = int(token_to_req[row]), int(logical_positions[row])
        if not 0 <= request < num_requests:
            continue
        start, stop = int(query_start_loc[request]), int(query_start_loc[request + 1])
        if not start <= row < stop or int(compressed_slots[row]) < 0 or end < compress_ratio - 1:
            continue
        chunk_start = end - (row - start)  # a request's rows hold consecutive positions
        block = int(compressor_state_block_table[request, 0])
        block_ok = 0 <= block < blocks

        def key_at(position):
            if position >= chunk_start:
                return raw_keys[start + position - chunk_start, 0]
            return ring[block, position % ring_size, 0] if block_ok else np.zeros(d)

        first = end - compress_ratio + 1
        pooled[row, 0] = np.mean([key_at(p) for p in range(first, end + 1)], axis=0)
        if rope_cache is None:
            first_positions[row] = first
        elif first >= chunk_start:
            first_positions[row] = raw_positions[start + first - chunk_start, 0]
        elif block_ok:
            first_positions[row] = rope_cache[block, first % ring_size, 0]
    return pooled, first_positions


def store_cache_rows(cache, slot_mapping, rows):
    """Reference of stage 2's row store: ``(cache with the rows written, written [pages, P])``.

    Keeps the cache's dtype: a store is an exact copy.
    """
    cache = np.array(cache)
    pages, page_size = cache.shape[:2]
    rows = np.asarray(rows).reshape(len(slot_mapping), -1)
    written = np.zeros((pages, page_size), bool)
    for row, slot in enumerate(slot_mapping):
        slot = int(slot)
        if 0 <= slot < pages * page_size:
            page, offset = divmod(slot, page_size)
            cache[page, offset, 0] = rows[row]
            written[page, offset] = True
    return cache, written


def mean_pool_groups(keys, compress_ratio):
    """Mean of every complete group of ``compress_ratio`` consecutive keys: ``[N, D] -> [N // ratio, D]``."""
    keys = np.asarray(keys, np.float64)
    groups = len(keys) // compress_ratio
    return keys[: groups * compress_ratio].reshape(groups, compress_ratio, -1).mean(axis=1)


# --------------------------------------------------------------------------
# Stage 4: sparse paged attention
# --------------------------------------------------------------------------

def _attention_slots(q, k_cache, v_cache, token_indices, block_table, token_to_req, softmax_scale):
    """What both references of stage 4 start from: ``(q, k_cache, v_cache, scale, group, slots)``,
    the arrays float64, ``group`` the query heads of a KV head, and ``slots[row]`` the
    ``(pages, offsets)`` of the row's valid selected tokens (duplicates kept; none for a row
    without a valid request).  ``k_cache``/``v_cache`` are ``[blocks, P, KH, D]``."""
    q = np.asarray(q, np.float64)
    k_cache = np.asarray(k_cache, np.float64)
    v_cache = np.asarray(v_cache, np.float64)
    rows, qh, d = q.shape
    num_blocks, page_size, kh, _ = k_cache.shape
    num_requests, table_width = block_table.shape
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    slots = []
    for row in range(rows):
        request = int(token_to_req[row])
        pages, offsets = [], []
        if 0 <= request < num_requests:
            for token in token_indices[row]:
                token = int(token)
                logical_page, offset = divmod(token, page_size)
                if token < 0 or logical_page >= table_width:
                    continue
                page = int(block_table[request, logical_page])
                if 0 <= page < num_blocks:
                    pages.append(page)
                    offsets.append(offset)
        slots.append((pages, offsets))
    return q, k_cache, v_cache, scale, qh // kh, slots


def sparse_paged_attention(q, k_cache, v_cache, token_indices, block_table, token_to_req,
                           softmax_scale=None):
    """Reference of stage 4: ``out [R, QH, D]`` float64.

    Each row gathers the K/V rows of its valid selected tokens (duplicates
    kept) and runs plain softmax attention per query head; a row with no
    valid token is zeros.  ``k_cache``/``v_cache`` are ``[blocks, P, KH, D]``.
    """
    q, k_cache, v_cache, scale, group, slots = _attention_slots(
        q, k_cache, v_cache, token_indices, block_table, token_to_req, softmax_scale)
    out = np.zeros_like(q)
    for row, (pages, offsets) in enumerate(slots):
        if not pages:
            continue
        for head in range(q.shape[1]):
            keys = k_cache[pages, offsets, head // group]
            values = v_cache[pages, offsets, head // group]
            scores = keys @ q[row, head] * scale
            weights = np.exp(scores - scores.max())
            out[row, head] = weights @ values / weights.sum()
    return out


# --------------------------------------------------------------------------
# Stage 3: selection (scores, top-k, expansion)
# --------------------------------------------------------------------------

def _select_visible_blocks(position: int, length: int, compress_ratio: int) -> int:
    return min(max(position + 1, 0) // compress_ratio, max(length, 0) // compress_ratio)


def _select_request_length(request: int, sequence_lengths) -> int:
    """A row's sequence length, 0 for a row without a valid request."""
    return int(sequence_lengths[request]) if 0 <= request < len(sequence_lengths) else 0


def mqa_paged_scores(q, k_cache, page_table, token_to_req, query_positions, sequence_lengths,
                     compress_ratio, num_columns=None, score_divisor=None):
    """Reference of ``mqa_paged_scores``: ``(logits [R, C], visible_blocks [R])``."""
    q = np.asarray(q, np.float64)
    k_cache = np.asarray(k_cache, np.float64)
    pages, page_size = k_cache.shape[:2]
    width = page_table.shape[1]
    columns = width * page_size if num_columns is None else num_columns
    divisor = np.sqrt(q.shape[2]) if score_divisor is None else score_divisor
    logits = np.full((q.shape[0], columns), -np.inf)
    visible = np.zeros(q.shape[0], np.int64)
    for row in range(q.shape[0]):
        request = int(token_to_req[row])
        length = _select_request_length(request, sequence_lengths)
        visible[row] = _select_visible_blocks(int(query_positions[row]), length, compress_ratio)
        if length == 0:
            continue
        cols = np.arange(min(columns, visible[row]))
        cols = cols[cols // page_size < width]  # past the page table: -inf
        logical, offset = np.divmod(cols, page_size)
        page = page_table[request, logical].astype(np.int64)
        present = (page >= 0) & (page < pages)
        keys = k_cache[page[present], offset[present], 0]  # [columns, D]
        logits[row, cols[present]] = np.maximum(keys @ q[row].T, 0).sum(axis=1) / divisor
    return logits, visible


def _select_rank_key(value: float):
    """Sort key, largest first: NaN lowest, -0.0 == +0.0 (so ties fall to column order)."""
    if np.isnan(value):
        return (1, 0.0)
    return (0, -float(value) + 0.0)


def topk_blocks(logits, visible_blocks, k):
    """Reference of ``topk_blocks``: ``[R, k]`` columns in ascending order, -1 padded."""
    logits = np.asarray(logits, np.float64)
    rows, columns = logits.shape
    out = np.full((rows, k), -1, np.int64)
    for row in range(rows):
        width = min(max(int(visible_blocks[row]), 0), columns)
        order = sorted(range(width), key=lambda c: (_select_rank_key(logits[row, c]), c))
        chosen = sorted(order[:k])
        out[row, :len(chosen)] = chosen
    return out


def expand_block_indices(block_indices, query_positions, sequence_lengths, token_to_req,
                         compress_ratio, token_topk):
    """Reference of ``expand_block_indices`` (the seed's expansion)."""
    block_topk = token_topk // compress_ratio
    rows = len(query_positions)
    out = np.full((rows, token_topk + compress_ratio - 1), -1, np.int64)
    for row in range(rows):
        position = int(query_positions[row])
        length = _select_request_length(int(token_to_req[row]), sequence_lengths)
        complete = min(_select_visible_blocks(position, length, compress_ratio), block_topk)
        tokens = [int(block_indices[row, i // compress_ratio]) * compress_ratio + i % compress_ratio
                  for i in range(complete * compress_ratio)]
        tail_start = (max(position + 1, 0) // compress_ratio) * compress_ratio
        tokens += list(range(tail_start, max(position + 1, 0)))
        for column, token in enumerate(tokens):
            if 0 <= token < length and token < 2**31:  # the output is int32: never wrapped
                out[row, column] = token
    return out


def select_paged_tokens(q, k_cache, page_table, token_to_req, query_positions, sequence_lengths,
                        token_topk, compress_ratio):
    """Reference of ``select_paged_tokens``: score, top-k, expand."""
    logits, visible = mqa_paged_scores(q, k_cache, page_table, token_to_req, query_positions,
                                       sequence_lengths, compress_ratio)
    blocks = topk_blocks(logits, visible, token_topk // compress_ratio)
    return expand_block_indices(blocks, query_positions, sequence_lengths, token_to_req,
                                compress_ratio, token_topk)


# --------------------------------------------------------------------------
# The composed step (qsa_attention_step), dense: no pages, no ring
# --------------------------------------------------------------------------

def qsa_attention_step(q, index_q, requests, positions, keys, values, index_keys, cos_sin, index_cos_sin, *,
                       compress_ratio, token_topk, is_neox=True, softmax_scale=None, token_indices=None):
    """Float64 reference of one composed step, from each request's whole history.

    Row ``r`` is request ``requests[r]`` at position ``positions[r]``.
    ``keys[req]``, ``values[req]`` ``[L, KH, D]`` and ``index_keys[req]``
    ``[L, DI]`` hold every token of the request up to the end of this step
    (``L`` its length after the step), raw: before RoPE.  Nothing is paged:
    the compressed keys are the means of the complete groups, rotated at their
    first position; a row selects the ``token_topk // compress_ratio`` best of
    its visible groups (score: sum over heads of relu(q . k) / sqrt(DI); ties
    to the lower group), expands them in ascending order and appends the
    causal tail of its open group.  ``token_indices`` given: attend those
    instead (the kernels' selection, ``-1`` skipped).

    Returns ``(out [T, QH, D], token_indices [T, token_topk + compress_ratio - 1])``.
    """
    q = np.asarray(q, np.float64)
    index_q = np.asarray(index_q, np.float64)
    rows, qh, d = q.shape
    width = token_topk + compress_ratio - 1
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    out = np.zeros_like(q)
    selected = np.full((rows, width), -1, np.int64)

    def rotate(x, position, table):  # x [H, D] at one position
        cos, sin = cos_sin_row(np.asarray(table, np.float64), position, x.shape[-1], is_neox)
        return rope(x, cos, sin, is_neox)

    for row in range(rows):
        request, position = requests[row], int(positions[row])
        key_rows = np.asarray(keys[request], np.float64)
        length = len(key_rows)
        if token_indices is None:
            raw = np.asarray(index_keys[request], np.float64)
            visible = min((position + 1) // compress_ratio, length // compress_ratio)
            compressed = [rotate(raw[g * compress_ratio:(g + 1) * compress_ratio].mean(0)[None], g * compress_ratio,
                                 index_cos_sin)[0] for g in range(visible)]
            queries = rotate(index_q[row], position, index_cos_sin)
            scores = [np.maximum(queries @ key, 0).sum() / np.sqrt(index_q.shape[-1]) for key in compressed]
            best = sorted(np.argsort(-np.asarray(scores), kind="stable")[: token_topk // compress_ratio])
            tail_start = (position + 1) // compress_ratio * compress_ratio
            tokens = [g * compress_ratio + o for g in best for o in range(compress_ratio)]
            tokens += list(range(tail_start, position + 1))
        else:
            tokens = [int(t) for t in token_indices[row] if t >= 0]
        selected[row, : len(tokens)] = tokens
        if not tokens:
            continue
        query = rotate(q[row], position, cos_sin)
        k_sel = np.stack([rotate(key_rows[t], t, cos_sin) for t in tokens])  # [N, KH, D]
        v_sel = np.asarray(values[request], np.float64)[tokens]
        group = qh // k_sel.shape[1]
        for head in range(qh):
            s = k_sel[:, head // group] @ query[head] * scale
            w = np.exp(s - s.max())
            out[row, head] = w @ v_sel[:, head // group] / w.sum()
    return out, selected


def sparse_paged_attention_lse(q, k_cache, v_cache, token_indices, block_table, token_to_req,
                               softmax_scale=None, sinks=None):
    """Stage 4 with its log-sum-exp and optional sinks: ``(out [R, QH, D], lse [R, QH])`` float64.

    Per row and head, over the row's valid selected tokens (duplicates kept)
    with scores ``s = softmax_scale * q.k``: ``lse = log(sum exp(s) [+ exp(sink)])``
    (a stable log-add-exp) and ``out = sum exp(s - lse) v``.  A row with no
    valid token and no sink: out 0, lse -inf; with a sink: out 0, lse = sink.
    Scores all -inf without a sink: lse -inf and out NaN (exp(-inf - -inf)).
    """
    q, k_cache, v_cache, scale, group, slots = _attention_slots(
        q, k_cache, v_cache, token_indices, block_table, token_to_req, softmax_scale)
    out = np.zeros_like(q)
    lse = np.full(q.shape[:2], -np.inf)
    for row, (pages, offsets) in enumerate(slots):
        for head in range(q.shape[1]):
            keys = k_cache[pages, offsets, head // group]
            values = v_cache[pages, offsets, head // group]
            with np.errstate(invalid="ignore", over="ignore"):
                scores = keys @ q[row, head] * scale
            logits = list(scores) + ([float(sinks[head])] if sinks is not None else [])
            if not logits:
                continue
            with np.errstate(invalid="ignore"):
                total = np.logaddexp.reduce(np.asarray(logits, np.float64))
                lse[row, head] = total
                if pages:
                    out[row, head] = np.exp(scores - total) @ values
    return out, lse


def merge_attention_states(out_a, lse_a, out_b, lse_b):
    """Exact merge of two partial attentions over disjoint tokens, float64: ``(out, lse)``.

    ``lse = logaddexp(lse_a, lse_b)``; ``out = (out_a e^(lse_a - lse) + out_b e^(lse_b - lse))``;
    a side whose lse is -inf contributes nothing (its out is not read); both
    -inf: out 0, lse -inf.
    """
    out_a, out_b = np.asarray(out_a, np.float64), np.asarray(out_b, np.float64)
    lse_a, lse_b = np.asarray(lse_a, np.float64), np.asarray(lse_b, np.float64)
    lse = np.logaddexp(lse_a, lse_b)
    out = np.zeros(np.broadcast_shapes(out_a.shape, out_b.shape))
    for index in np.ndindex(*lse.shape):
        if lse[index] == -np.inf:
            continue
        # Weights against the larger lse (lse - logaddexp would lose log 2 next to -1e30).
        top = max(lse_a[index], lse_b[index])
        total, weights = 0.0, 0.0
        for o, l in ((out_a, lse_a), (out_b, lse_b)):
            if l[index] != -np.inf:
                total = total + o[index] * np.exp(l[index] - top)
                weights += np.exp(l[index] - top)
        out[index] = total / weights
    return out, lse
