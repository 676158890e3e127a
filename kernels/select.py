"""Stage 3: selection -- score compressed blocks, keep the top k, expand to tokens.

Scoring (``mqa_paged_scores``): a program scores a tile of BLOCK_R consecutive
rows against BLOCK_N columns (compressed blocks) of the paged key cache.  When
every row of the tile belongs to one request (a prefill chunk), the tile's
keys are gathered once and every head is one tensor-core dot
``[BLOCK_R, D] x [D, BLOCK_N]``; otherwise (decode, or a tile straddling two
requests) each row is scored alone with its heads padded to a dot of at least
16 rows.  Keys past the tile's visible columns are never loaded.

Top-k (``topk_blocks``): an exact radix select on order-preserving uint32 keys
(``-0.0 == +0.0``; NaN below ``-inf``), in four phases, each a launch over
``(row, slice)`` programs so that one long row still spreads over many SMs:

1. group maxima: every slice reduces its columns to the maxima of G strided
   groups (column ``c`` is in group ``c % G``);
2. bound: the k-th largest group maximum ``L`` is a lower bound of the k-th
   largest key ``T`` (k groups have a maximum >= L), found by a 4-pass
   radix select over the G maxima; each slice counts its keys ``> L`` and
   ``== L``;
3. place: if fewer than k keys exceed ``L`` then ``T == L`` and every slice
   writes its selected columns straight to the output; otherwise each slice
   compacts its keys ``> L`` (typically ~k of them) into a candidate buffer;
4. finish: a radix select over the candidates (or, if they overflowed the
   buffer, over the whole row) finds ``T`` and writes the selection; then
   ``-1`` padding.

Selected columns are written in ascending column order with ties taken by
lower column (prefix sums over column order), so the result is exact and
deterministic: integer counts only, no atomics, no host synchronisation.

Expansion (``expand_block_indices``) follows the seed.  ``select_paged_tokens``
is one program of score -> top-k -> expand launches over row chunks whose
logits fit a fixed workspace.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from . import runtime
from .launch import ArrayInfo, Buffer, Launch, Program, cached_plan
from .validate import FLOAT_DTYPES, INDEX_DTYPES, Checker

# Logits of one select_paged_tokens chunk stay under this many bytes (rows
# are processed in chunks).  Read when a plan is made, so tests can shrink it.
LOGITS_WORKSPACE_BYTES = 128 * 1024 * 1024
# Columns a top-k program handles per step (raised to G where needed).
TOPK_TILE = 4096
# Top-k candidate buffer per row: at least this many, or 4k.
TOPK_MIN_CANDIDATES = 4096
# Enough (row, slice) programs to fill an H200 (132 SMs) about twice.
TOPK_TARGET_PROGRAMS = 256
TOPK_MAX_SLICES = 64
TOPK_MAX_GROUPS = 4096
RADIX_BITS = 8

_SCORES_DOC_ARGS = """\
    q: ``[R, H, D]`` bf16, fp16 or fp32 indexer queries.
    k_cache: ``[num_pages, P, 1, D]`` compressed keys (bf16, fp16 or fp32).
    page_table: ``[B, W]`` int32/int64 physical pages of each request's
        compressed blocks (block ``c`` is page ``c // P``, offset ``c % P``);
        ``-1`` and out-of-range pages are skipped.
    token_to_req: ``[R]`` request of each row; ``-1`` / out of range: none.
    query_positions: ``[R]`` token position of each row.
    sequence_lengths: ``[B]`` tokens of each request."""

SCORES_DOC = f"""\
Score every compressed block of each row's request (QSA indexer).

score = sum over heads of ``relu(q_h . k)`` / ``score_divisor``.  A row sees
``visible_blocks = min((query_position + 1) // compress_ratio,
sequence_length // compress_ratio)`` blocks (0 for a row without a valid
request; negative values count as 0); columns at or past it, and columns
whose page is missing, are ``-inf``.

Args:
{_SCORES_DOC_ARGS}
    compress_ratio: tokens per compressed block (positive int).
    num_columns: logits width ``C``; default ``W * P``.
    score_divisor: positive divisor of the scores; default ``sqrt(D)``.

Returns:
    ``(logits [R, C] float32, visible_blocks [R] int32)``.
"""

TOPK_DOC = """\
Exact top-k blocks of each row, in ascending column order.

Row ``r`` considers its first ``V = min(max(visible_blocks[r], 0), C)``
columns and holds the ``min(k, V)`` highest-scoring ones in ascending column
order, then ``-1`` padding (``k > C`` is allowed).  Ranking: larger values
first, ``-0.0 == +0.0``, ``-inf`` below every finite value, NaN below
``-inf``; equal values go to the lower column.  Deterministic and bitwise
identical in torch and JAX, with no host synchronisation.

Args:
    logits: ``[R, C]`` scores (float32; bf16/fp16 also accepted).
    visible_blocks: ``[R]`` int32/int64 visible columns per row.
    k: blocks to keep (non-negative int).

Returns:
    ``[R, k]`` int32 column indices.
"""

EXPAND_DOC = """\
Expand selected compressed blocks into token indices, then the causal tail.

For each row, its first ``min(visible_blocks, token_topk // compress_ratio)``
block indices (as written by ``topk_blocks``) become ``compress_ratio``
tokens each (``block * compress_ratio + i``), followed by the tokens of the
still-open group (positions ``((p + 1) // compress_ratio) * compress_ratio``
.. ``p``).  Tokens that are negative or at/after the request's sequence
length, and unused slots, are ``-1``.

Args:
    block_indices: ``[R, token_topk // compress_ratio]`` int32/int64.
    query_positions: ``[R]`` token position of each row.
    sequence_lengths: ``[B]`` tokens of each request.
    token_to_req: ``[R]`` request of each row; ``-1`` / out of range: none.
    compress_ratio: tokens per compressed block (positive int).
    token_topk: selected tokens, a multiple of ``compress_ratio``.

Returns:
    ``[R, token_topk + compress_ratio - 1]`` int32 token indices.
"""

SELECT_DOC = f"""\
Score, select the top blocks and expand them to tokens, in one call.

``expand_block_indices(topk_blocks(*mqa_paged_scores(...),
token_topk // compress_ratio), ...)`` with the default score divisor, rows
processed in chunks whose logits fit a fixed workspace (128 MiB), with no host
synchronisation.

Args:
{_SCORES_DOC_ARGS}
    token_topk: selected tokens, a multiple of ``compress_ratio``.
    compress_ratio: tokens per compressed block (positive int).

Returns:
    ``[R, token_topk + compress_ratio - 1]`` int32 token indices.
"""


# --------------------------------------------------------------------------
# Kernels shared by several launches
# --------------------------------------------------------------------------

@triton.jit
def _visible_blocks(query_position, sequence_length, RATIO: tl.constexpr):
    """Complete blocks a query sees: causal and within its sequence (>= 0)."""
    by_position = _groups_through(query_position, RATIO)
    by_length = tl.maximum(sequence_length, 0) // RATIO
    return tl.minimum(by_position, by_length)


@triton.jit
def _groups_through(position, RATIO: tl.constexpr):
    """``(position + 1) // RATIO`` for position >= 0, else 0, without forming
    ``position + 1`` (it wraps at INT64_MAX)."""
    return tl.where(position < 0, 0, position // RATIO + ((position % RATIO) == RATIO - 1))


@triton.jit
def _row_request(token_to_req_ptr, sequence_lengths_ptr, rows, row_ok, num_requests):
    """(request, request is valid, its sequence length or 0)."""
    request = tl.load(token_to_req_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
    request_ok = row_ok & (request >= 0) & (request < num_requests)
    request = tl.where(request_ok, request, 0)
    length = tl.load(sequence_lengths_ptr + request, mask=request_ok, other=0).to(tl.int64)
    return request, request_ok, length


# --------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------

@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    # fp32 operands (and every dot under the interpreter, where bf16 dots are
    # wrong) are multiplied exactly; 16-bit operands use tensor cores.
    # (One return: the compiler also visits statements after a constexpr-if return.)
    if UPCAST:
        product = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        product = tl.dot(a, b)
    return product


@triton.jit
def _gather_keys(k_cache_ptr, page_table_ptr, request, request_ok, cols, limit,
                 num_pages, table_width, kc_sb, kc_st, pt_sr,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr):
    """Keys ``[BLOCK_N, BLOCK_D]`` of a request's columns below ``limit`` (0 elsewhere)."""
    dims = tl.arange(0, BLOCK_D)
    logical_page = cols // PAGE
    in_table = request_ok & (cols < limit) & (logical_page < table_width)
    page = tl.load(page_table_ptr + request * pt_sr + logical_page, mask=in_table, other=-1).to(tl.int64)
    present = in_table & (page >= 0) & (page < num_pages)
    # page * stride overflows int32 for large caches: page is int64.
    keys = tl.load(k_cache_ptr + page[:, None] * kc_sb + (cols % PAGE)[:, None] * kc_st + dims[None, :],
                   mask=present[:, None] & (dims[None, :] < D), other=0.0)
    return keys, present


@triton.jit
def _score_row(q_ptr, k_cache_ptr, page_table_ptr, token_to_req_ptr, query_positions_ptr,
               sequence_lengths_ptr, logits_ptr, local_row, col_start,
               row_begin, num_columns, num_pages, num_requests, table_width,
               q_sr, q_sh, kc_sb, kc_st, pt_sr, lg_sr, score_divisor,
               HEADS: tl.constexpr, HEADS_P: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
               PAGE: tl.constexpr, RATIO: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
    """One row against a column tile: its heads padded to a dot of HEADS_P >= 16 rows."""
    row = row_begin + local_row.to(tl.int64)
    request, request_ok, length = _row_request(token_to_req_ptr, sequence_lengths_ptr, row, True, num_requests)
    visible = _visible_blocks(tl.load(query_positions_ptr + row).to(tl.int64), length, RATIO)
    cols = col_start + tl.arange(0, BLOCK_N)
    scores = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    if request_ok & (col_start < visible):
        keys, present = _gather_keys(k_cache_ptr, page_table_ptr, request, request_ok, cols, visible,
                                     num_pages, table_width, kc_sb, kc_st, pt_sr, D, BLOCK_D, PAGE)
        heads = tl.arange(0, HEADS_P)
        dims = tl.arange(0, BLOCK_D)
        q = tl.load(q_ptr + row * q_sr + heads[:, None] * q_sh + dims[None, :],
                    mask=(heads[:, None] < HEADS) & (dims[None, :] < D), other=0.0)
        # Padded heads are zero rows: relu(0) adds nothing.
        total = tl.sum(tl.maximum(_dot(q, tl.trans(keys), UPCAST), 0.0), axis=0)
        scores = tl.where(present, total / score_divisor, float("-inf"))
    tl.store(logits_ptr + local_row.to(tl.int64) * lg_sr + cols, scores, mask=cols < num_columns)


@triton.jit
def scores_kernel(
    # inputs
    q_ptr, k_cache_ptr, page_table_ptr, token_to_req_ptr, query_positions_ptr, sequence_lengths_ptr,
    # outputs
    logits_ptr, visible_ptr,
    # sizes, strides, options
    row_begin, num_rows, num_columns, num_pages, num_requests, table_width,
    q_sr, q_sh, kc_sb, kc_st, pt_sr, lg_sr, score_divisor,
    # constexprs
    HEADS: tl.constexpr, HEADS_P: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, RATIO: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Rows ``row_begin + [0, num_rows)``; their logits and visible rows are local (0-based)."""
    first = tl.program_id(0) * BLOCK_R
    local = first + tl.arange(0, BLOCK_R)
    row_ok = local < num_rows
    rows = row_begin + local.to(tl.int64)
    request, request_ok, length = _row_request(token_to_req_ptr, sequence_lengths_ptr, rows, row_ok, num_requests)
    position = tl.load(query_positions_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    visible = _visible_blocks(position, length, RATIO)
    if tl.program_id(1) == 0:
        tl.store(visible_ptr + local, tl.minimum(visible, 2147483647).to(tl.int32), mask=row_ok)
    col_start = tl.program_id(1) * BLOCK_N

    if BLOCK_R == 1:
        _score_row(q_ptr, k_cache_ptr, page_table_ptr, token_to_req_ptr, query_positions_ptr,
                   sequence_lengths_ptr, logits_ptr, first, col_start,
                   row_begin, num_columns, num_pages, num_requests, table_width,
                   q_sr, q_sh, kc_sb, kc_st, pt_sr, lg_sr, score_divisor,
                   HEADS, HEADS_P, D, BLOCK_D, PAGE, RATIO, BLOCK_N, UPCAST)
    else:
        # A tile whose valid rows share one request (a prefill chunk) loads
        # the keys once for all its rows; any other tile is scored row by row.
        shared_request = tl.max(tl.where(request_ok, request, -1))
        if tl.min(tl.where(request_ok, request, shared_request)) == shared_request:
            cols = col_start + tl.arange(0, BLOCK_N)
            limit = tl.max(tl.where(request_ok, visible, 0))
            total = tl.zeros((BLOCK_R, BLOCK_N), tl.float32)
            keys, present = _gather_keys(k_cache_ptr, page_table_ptr, shared_request, shared_request >= 0,
                                         cols, limit, num_pages, table_width, kc_sb, kc_st, pt_sr,
                                         D, BLOCK_D, PAGE)
            if col_start < limit:
                keys_t = tl.trans(keys)
                dims = tl.arange(0, BLOCK_D)
                q_rows = q_ptr + rows[:, None] * q_sr + dims[None, :]
                q_mask = row_ok[:, None] & (dims[None, :] < D)
                for h in tl.static_range(HEADS):
                    q = tl.load(q_rows + h * q_sh, mask=q_mask, other=0.0)
                    total += tl.maximum(_dot(q, keys_t, UPCAST), 0.0)
            valid = request_ok[:, None] & present[None, :] & (cols[None, :] < visible[:, None])
            tl.store(logits_ptr + local[:, None].to(tl.int64) * lg_sr + cols[None, :],
                     tl.where(valid, total / score_divisor, float("-inf")),
                     mask=row_ok[:, None] & (cols[None, :] < num_columns))
        else:
            for i in range(BLOCK_R):
                if first + i < num_rows:
                    _score_row(q_ptr, k_cache_ptr, page_table_ptr, token_to_req_ptr, query_positions_ptr,
                               sequence_lengths_ptr, logits_ptr, first + i, col_start,
                               row_begin, num_columns, num_pages, num_requests, table_width,
                               q_sr, q_sh, kc_sb, kc_st, pt_sr, lg_sr, score_divisor,
                               HEADS, HEADS_P, D, BLOCK_D, PAGE, RATIO, BLOCK_N, UPCAST)


# --------------------------------------------------------------------------
# Top-k: radix select on order-preserving keys
# --------------------------------------------------------------------------

@triton.jit
def _order_key(x):
    """float32 -> uint32 whose unsigned order is the ranking (NaN lowest, -0.0 == +0.0)."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.uint32, bitcast=True)
    key = tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    return tl.where(x != x, 0, key)


@triton.jit
def _source(key_ptr, col_ptr, idx, n, FROM_LOGITS: tl.constexpr):
    """(keys, columns, valid) of entries ``idx < n``: a logits row or a candidate list."""
    valid = idx < n
    if FROM_LOGITS:
        # Entries outside the source get key 0, the lowest: they can only
        # lower a group maximum, never raise it.
        keys = tl.where(valid, _order_key(tl.load(key_ptr + idx, mask=valid, other=0.0).to(tl.float32)), 0)
        cols = idx
    else:
        keys = tl.load(key_ptr + idx, mask=valid, other=0).to(tl.uint32, bitcast=True)
        cols = tl.load(col_ptr + idx, mask=valid, other=-1)
    return keys, cols, valid


@triton.jit
def _digit_histogram(keys, valid, prefix, PASS: tl.constexpr, BITS: tl.constexpr):
    """Histogram of digit PASS (most significant first) of the keys matching ``prefix``'s higher digits."""
    SHIFT: tl.constexpr = 32 - (PASS + 1) * BITS
    match = valid
    if PASS > 0:
        match = match & ((keys >> (SHIFT + BITS)) == (prefix >> (SHIFT + BITS)))
    digits = ((keys >> SHIFT) & ((1 << BITS) - 1)).to(tl.int32)
    return tl.histogram(digits, 1 << BITS, mask=match)


@triton.jit
def _choose_digit(histogram, prefix, remaining, PASS: tl.constexpr, BITS: tl.constexpr):
    """Digit of the ``remaining``-th largest key; returns the extended prefix and what remains to take."""
    SHIFT: tl.constexpr = 32 - (PASS + 1) * BITS
    at_or_above = tl.sum(histogram, 0) - tl.cumsum(histogram, 0) + histogram
    # Fewer than ``remaining`` keys in all: digit 0 (the key ends up 0 and
    # every key equal to it is taken).
    digit = tl.maximum(tl.sum((at_or_above >= remaining).to(tl.int32), 0) - 1, 0)
    above = tl.sum(tl.where(tl.arange(0, 1 << BITS) > digit, histogram, 0), 0)
    return prefix | (digit.to(tl.uint32) << SHIFT), remaining - above


@triton.jit
def _kth_largest_resident(keys, valid, k, BITS: tl.constexpr):
    """(k-th largest key, how many keys equal to it are among the top k) of a register tensor."""
    prefix = tl.full((), 0, tl.uint32)
    remaining = tl.full((), 0, tl.int32) + k
    for p in tl.static_range(32 // BITS):
        histogram = _digit_histogram(keys, valid, prefix, p, BITS)
        prefix, remaining = _choose_digit(histogram, prefix, remaining, p, BITS)
    return prefix, remaining


@triton.jit
def _kth_largest_streamed(key_ptr, col_ptr, n, k, FROM_LOGITS: tl.constexpr,
                          TILE: tl.constexpr, BITS: tl.constexpr):
    """As :func:`_kth_largest_resident` over source entries ``[0, n)``, a tile at a time."""
    prefix = tl.full((), 0, tl.uint32)
    remaining = tl.full((), 0, tl.int32) + k
    for p in tl.static_range(32 // BITS):
        histogram = tl.zeros((1 << BITS,), tl.int32)
        start = tl.full((), 0, tl.int32)
        while start < n:
            keys, _cols, valid = _source(key_ptr, col_ptr, start + tl.arange(0, TILE), n, FROM_LOGITS)
            histogram += _digit_histogram(keys, valid, prefix, p, BITS)
            start += TILE
        prefix, remaining = _choose_digit(histogram, prefix, remaining, p, BITS)
    return prefix, remaining


@triton.jit
def _place(key_ptr, col_ptr, start, end, threshold, take_equal, equal_before, position,
           out_ptr, key_out_ptr, TILE: tl.constexpr, FROM_LOGITS: tl.constexpr,
           WRITE_KEYS: tl.constexpr):
    """Writes, in source order from ``position`` on, the columns of entries in
    ``[start, end)`` with key > threshold, and of those equal to it whose rank
    among equal keys (counting ``equal_before`` earlier ones) is below
    ``take_equal``."""
    while start < end:
        keys, cols, valid = _source(key_ptr, col_ptr, start + tl.arange(0, TILE), end, FROM_LOGITS)
        equal = (valid & (keys == threshold)).to(tl.int32)
        equal_rank = equal_before + tl.cumsum(equal, 0) - equal
        take = ((valid & (keys > threshold)) | ((equal != 0) & (equal_rank < take_equal))).to(tl.int32)
        slot = position + tl.cumsum(take, 0) - take
        tl.store(out_ptr + slot, cols, mask=take != 0)
        if WRITE_KEYS:
            tl.store(key_out_ptr + slot, keys.to(tl.int32, bitcast=True), mask=take != 0)
        position += tl.sum(take, 0)
        equal_before += tl.sum(equal, 0)
        start += TILE


@triton.jit
def _row_width(visible_ptr, row, num_columns):
    return tl.minimum(tl.maximum(tl.load(visible_ptr + row).to(tl.int64), 0), num_columns).to(tl.int32)


@triton.jit
def _slice_range(slice_id, tiles_per_slice, width, TILE: tl.constexpr):
    """Columns [start, end) of a row's slice that are visible."""
    start = slice_id * tiles_per_slice * TILE
    return start, tl.minimum(start + tiles_per_slice * TILE, width)


@triton.jit
def _slice_counts(counts_ptr, row, slice_id, slices, MAX_SLICES: tl.constexpr):
    """(keys > L in all slices, == L in all slices, > L before this slice, == L before this slice)."""
    s = tl.arange(0, MAX_SLICES)
    base = counts_ptr + row * (2 * slices)
    above = tl.load(base + s, mask=s < slices, other=0)
    equal = tl.load(base + slices + s, mask=s < slices, other=0)
    before = s < slice_id
    return (tl.sum(above, 0), tl.sum(equal, 0),
            tl.sum(tl.where(before, above, 0), 0), tl.sum(tl.where(before, equal, 0), 0))


@triton.jit
def topk_group_max_kernel(
    logits_ptr, visible_ptr,
    maxima_ptr,
    num_columns, lg_sr, slices, tiles_per_slice,
    GROUPS: tl.constexpr, TILE: tl.constexpr,
):
    """Phase 1: maxima of the G strided groups over one slice of a row."""
    row = tl.program_id(0).to(tl.int64)
    slice_id = tl.program_id(1)
    width = _row_width(visible_ptr, row, num_columns)
    logits_row = logits_ptr + row * lg_sr
    # A tile viewed as [TILE // G, G]: column c lands in group c % G.
    offsets = tl.arange(0, TILE // GROUPS)[:, None] * GROUPS + tl.arange(0, GROUPS)[None, :]
    maxima = tl.zeros((GROUPS,), tl.uint32)
    start, end = _slice_range(slice_id, tiles_per_slice, width, TILE)
    while start < end:
        keys, _cols, _valid = _source(logits_row, logits_row, start + offsets, end, True)
        maxima = tl.maximum(maxima, tl.max(keys, 0))
        start += TILE
    tl.store(maxima_ptr + (row * slices + slice_id) * GROUPS + tl.arange(0, GROUPS),
             maxima.to(tl.int32, bitcast=True))


@triton.jit
def topk_bound_kernel(
    logits_ptr, visible_ptr, maxima_ptr,
    bound_ptr, counts_ptr,
    num_columns, lg_sr, slices, tiles_per_slice,
    K: tl.constexpr, GROUPS: tl.constexpr, TILE: tl.constexpr, BITS: tl.constexpr,
):
    """Phase 2: L = k-th largest group maximum; this slice's counts of keys > L and == L."""
    row = tl.program_id(0).to(tl.int64)
    slice_id = tl.program_id(1)
    width = _row_width(visible_ptr, row, num_columns)
    groups = tl.arange(0, GROUPS)
    maxima = tl.zeros((GROUPS,), tl.uint32)
    s = tl.full((), 0, tl.int32)
    while s < slices:
        partial = tl.load(maxima_ptr + (row * slices + s) * GROUPS + groups)
        maxima = tl.maximum(maxima, partial.to(tl.uint32, bitcast=True))
        s += 1
    # Every slice derives the same bound; empty groups (max 0) only lower it.
    bound, _taken = _kth_largest_resident(maxima, groups < GROUPS, K, BITS)

    logits_row = logits_ptr + row * lg_sr
    above = tl.full((), 0, tl.int32)
    equal = tl.full((), 0, tl.int32)
    start, end = _slice_range(slice_id, tiles_per_slice, width, TILE)
    while start < end:
        keys, _cols, valid = _source(logits_row, logits_row, start + tl.arange(0, TILE), end, True)
        above += tl.sum((valid & (keys > bound)).to(tl.int32), 0)
        equal += tl.sum((valid & (keys == bound)).to(tl.int32), 0)
        start += TILE
    tl.store(counts_ptr + row * (2 * slices) + slice_id, above)
    tl.store(counts_ptr + row * (2 * slices) + slices + slice_id, equal)
    if slice_id == 0:
        tl.store(bound_ptr + row, bound.to(tl.int32, bitcast=True))


@triton.jit
def topk_place_kernel(
    logits_ptr, visible_ptr, bound_ptr, counts_ptr,
    out_ptr, cand_key_ptr, cand_col_ptr,
    num_columns, lg_sr, slices, tiles_per_slice, capacity,
    K: tl.constexpr, TILE: tl.constexpr, MAX_SLICES: tl.constexpr,
):
    """Phase 3: write the selection if T == L, else compact keys > L into the candidates."""
    row = tl.program_id(0).to(tl.int64)
    slice_id = tl.program_id(1)
    width = _row_width(visible_ptr, row, num_columns)
    bound = tl.load(bound_ptr + row).to(tl.uint32, bitcast=True)
    above, equal, above_before, equal_before = _slice_counts(counts_ptr, row, slice_id, slices, MAX_SLICES)
    logits_row = logits_ptr + row * lg_sr
    start, end = _slice_range(slice_id, tiles_per_slice, width, TILE)
    if above < K:
        # T == L: all keys above L, then the first K - above keys equal to L.
        take_equal = K - above
        _place(logits_row, logits_row, start, end, bound, take_equal, equal_before,
               above_before + tl.minimum(equal_before, take_equal),
               out_ptr + row * K, out_ptr, TILE, True, False)
    elif above <= capacity:
        _place(logits_row, logits_row, start, end, bound, 0, equal_before, above_before,
               cand_col_ptr + row * capacity, cand_key_ptr + row * capacity, TILE, True, True)


@triton.jit
def topk_finish_kernel(
    logits_ptr, visible_ptr, counts_ptr, cand_key_ptr, cand_col_ptr, previous_ptr,
    out_ptr,
    num_columns, lg_sr, slices, capacity,
    K: tl.constexpr, TILE: tl.constexpr, CAND_TILE: tl.constexpr, MAX_SLICES: tl.constexpr,
    BITS: tl.constexpr, PAD_TILE: tl.constexpr,
):
    """Phase 4: when T > L, select among the candidates (or the whole row if
    they overflowed); then pad with -1."""
    row = tl.program_id(0).to(tl.int64)
    width = _row_width(visible_ptr, row, num_columns)
    above, _equal, _above_before, _equal_before = _slice_counts(counts_ptr, row, 0, slices, MAX_SLICES)
    out_row = out_ptr + row * K
    zero = tl.full((), 0, tl.int32)
    if above >= K:
        if above <= capacity:
            keys_row = cand_key_ptr + row * capacity
            cols_row = cand_col_ptr + row * capacity
            threshold, take_equal = _kth_largest_streamed(keys_row, cols_row, above, K, False, CAND_TILE, BITS)
            _place(keys_row, cols_row, zero, above, threshold, take_equal, zero, zero,
                   out_row, out_row, CAND_TILE, False, False)
        else:
            logits_row = logits_ptr + row * lg_sr
            threshold, take_equal = _kth_largest_streamed(logits_row, logits_row, width, K, True, TILE, BITS)
            _place(logits_row, logits_row, zero, width, threshold, take_equal, zero, zero,
                   out_row, out_row, TILE, True, False)
    selected = tl.minimum(width, K)
    for t in range((K + PAD_TILE - 1) // PAD_TILE):
        cols = t * PAD_TILE + tl.arange(0, PAD_TILE)
        tl.store(out_row + cols, tl.full((PAD_TILE,), -1, tl.int32), mask=(cols >= selected) & (cols < K))


# --------------------------------------------------------------------------
# Expansion
# --------------------------------------------------------------------------

@triton.jit
def expand_kernel(
    block_indices_ptr, query_positions_ptr, sequence_lengths_ptr, token_to_req_ptr, previous_ptr,
    out_ptr,
    row_begin, num_requests, bi_sr, out_sr,
    BLOCK_TOPK: tl.constexpr, RATIO: tl.constexpr, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """Row ``row_begin + program_id(0)``; its block indices are row ``program_id(0)``."""
    local = tl.program_id(0).to(tl.int64)
    row = row_begin + local
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    _request, _request_ok, length = _row_request(token_to_req_ptr, sequence_lengths_ptr, row, True, num_requests)
    position = tl.load(query_positions_ptr + row).to(tl.int64)
    expanded = tl.minimum(_visible_blocks(position, length, RATIO), BLOCK_TOPK) * RATIO
    # The open group: the tail_count positions up to and including the query.
    # (Written so that nothing wraps, even at INT64_MAX.)
    tail_count = tl.where(position < 0, 0, (position % RATIO + 1) % RATIO)
    in_blocks = cols < expanded
    in_tail = ~in_blocks & (cols - expanded < tail_count)
    block = tl.load(block_indices_ptr + local * bi_sr + cols // RATIO, mask=in_blocks, other=-1).to(tl.int64)
    # A block past the sequence is skipped before block * RATIO can wrap.
    block_ok = (block >= 0) & (block <= (length - 1) // RATIO)
    block_token = tl.where(block_ok, block, 0) * RATIO + cols % RATIO
    tail_token = position - tl.where(in_tail, tail_count - 1 - (cols - expanded), 0)
    token = tl.where(in_blocks, block_token, tail_token)
    keep = ((in_blocks & block_ok) | in_tail) & (token >= 0) & (token < length)
    tl.store(out_ptr + row * out_sr + cols, tl.where(keep, token, -1).to(tl.int32), mask=cols < WIDTH)


# --------------------------------------------------------------------------
# Plans
# --------------------------------------------------------------------------

def _check_positive_int(check: Checker, name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        check.fail(name, "must be a positive int", repr(value))


def _check_vector(check: Checker, name: str, info: ArrayInfo, length: int, what: str) -> None:
    check.rank(name, info, 1, f"[{what}]")
    check.dtype(name, info, INDEX_DTYPES)
    if info.shape[0] != length:
        check.fail(name, f"must have {what} = {length} entries", f"shape {info.shape}")


def _check_token_topk(check: Checker, token_topk, compress_ratio: int) -> None:
    check.nonnegative_int("token_topk", token_topk)
    if token_topk % compress_ratio:
        check.fail("token_topk", f"must be a multiple of compress_ratio = {compress_ratio}", token_topk)


def _check_scoring(check: Checker, q, k_cache, page_table, token_to_req, query_positions,
                   sequence_lengths, compress_ratio) -> None:
    check.rank("q", q, 3, "[R, H, D]")
    check.dtype("q", q, FLOAT_DTYPES)
    rows, heads, dim = q.shape
    if heads < 1 or dim < 1:
        check.fail("q", "must have at least one head and a head dim D >= 1", f"shape {q.shape}")
    check.rank("k_cache", k_cache, 4, "[num_pages, P, 1, D]")
    check.dtype("k_cache", k_cache, FLOAT_DTYPES)
    if k_cache.shape[2] != 1:
        check.fail("k_cache", "must have one key head (dimension 2 of size 1)", f"shape {k_cache.shape}")
    if k_cache.shape[3] != dim:
        check.fail("k_cache", f"must have q's head dim D = {dim}", f"shape {k_cache.shape}")
    if k_cache.shape[1] < 1:
        check.fail("k_cache", "must have a page size P >= 1", f"shape {k_cache.shape}")
    check.rank("page_table", page_table, 2, "[B, W]")
    check.dtype("page_table", page_table, INDEX_DTYPES)
    _check_vector(check, "token_to_req", token_to_req, rows, "R")
    _check_vector(check, "query_positions", query_positions, rows, "R")
    _check_vector(check, "sequence_lengths", sequence_lengths, page_table.shape[0], "B")
    _check_positive_int(check, "compress_ratio", compress_ratio)
    for name, info in (("q", q), ("k_cache", k_cache), ("page_table", page_table),
                       ("token_to_req", token_to_req), ("query_positions", query_positions),
                       ("sequence_lengths", sequence_lengths)):
        check.last_dim_contiguous(name, info)


def _score_tiling(q: ArrayInfo, k_cache: ArrayInfo, page_table: ArrayInfo, num_columns: int):
    """(rows per tile, columns per tile, upcast operands) of the scorer.

    Rows outnumber requests only when some request has several rows (a
    prefill chunk): then tiles of 16-64 rows share key loads.  fp32 or mixed
    operands take an exact fp32 dot (no tensor cores): scored row by row.
    Register use of these tiles was checked offline for sm_90 (no spills).
    """
    rows, dim = q.shape[0], q.shape[2]
    exact = q.dtype != k_cache.dtype or q.dtype == "float32"
    if exact or rows <= page_table.shape[0]:
        block_r = 1
    else:
        block_r = 64 if rows >= 1024 else 16
    block_n = 32 if exact else (128 if block_r == 1 else 64)
    block_d = max(16, triton.next_power_of_2(dim))
    block_n = max(16, min(block_n, 16384 // block_d, triton.next_power_of_2(max(num_columns, 1))))
    # The interpreter's bf16 dots are wrong: it always multiplies in fp32.
    return block_r, block_n, exact or runtime.INTERPRETED


def _score_launches(q, k_cache, page_table, compress_ratio, num_columns, score_divisor,
                    row_ranges, logits_stride):
    """Scorer launches over ``row_ranges`` [(first row, rows)], writing local logits/visible rows."""
    heads, dim = q.shape[1], q.shape[2]
    pages, page = k_cache.shape[0], k_cache.shape[1]
    requests, table_width = page_table.shape
    block_r, block_n, upcast = _score_tiling(q, k_cache, page_table, num_columns)
    return [Launch(
        kernel=scores_kernel,
        grid=(triton.cdiv(count, block_r), max(1, triton.cdiv(num_columns, block_n))),
        inputs=("q", "k_cache", "page_table", "token_to_req", "query_positions", "sequence_lengths"),
        outputs=("logits", "visible_blocks"),
        scalars=dict(row_begin=first, num_rows=count, num_columns=num_columns, num_pages=pages,
                     num_requests=requests, table_width=table_width,
                     q_sr=q.strides[0], q_sh=q.strides[1], kc_sb=k_cache.strides[0],
                     kc_st=k_cache.strides[1], pt_sr=page_table.strides[0], lg_sr=logits_stride,
                     score_divisor=float(score_divisor)),
        constexprs=dict(HEADS=heads, HEADS_P=max(16, triton.next_power_of_2(heads)), D=dim,
                        BLOCK_D=max(16, triton.next_power_of_2(dim)), PAGE=page, RATIO=compress_ratio,
                        BLOCK_R=block_r, BLOCK_N=block_n, UPCAST=upcast),
        num_warps=8,
        num_stages=1,
    ) for first, count in row_ranges]


def _topk_parts(rows: int, columns: int, k: int, logits_stride: int, row_counts,
                logits: str, visible: str, out: str):
    """Workspaces and launches of an exact top-k over ``logits`` ``[rows, columns]``.

    The tiling is chosen for ``rows``; ``row_counts`` are the rows of each
    run of the four launches (several runs reuse the workspaces).
    """
    if rows == 0 or k == 0:
        return (), ()
    width = max(columns, 1)
    # G >= 2k strided groups keep the candidates (keys above the k-th
    # largest group maximum) near k; G >= C makes single-column groups.
    groups = min(triton.next_power_of_2(2 * k), triton.next_power_of_2(width), TOPK_MAX_GROUPS)
    tile = max(groups, min(TOPK_TILE, max(16, triton.next_power_of_2(width))))
    row_tiles = triton.cdiv(width, tile)
    # Split rows into slices until there are enough programs for the GPU.
    slices = max(1, min(row_tiles, TOPK_MAX_SLICES, triton.cdiv(TOPK_TARGET_PROGRAMS, rows)))
    tiles_per_slice = triton.cdiv(row_tiles, slices)
    slices = triton.cdiv(row_tiles, tiles_per_slice)
    capacity = min(row_tiles * tile, max(TOPK_MIN_CANDIDATES, 4 * k))
    # Typically about 1-3k keys exceed the bound: stream them in tiles of ~2k.
    cand_tile = min(tile, max(16, triton.next_power_of_2(2 * k)))
    maxima, bound, counts, cand_key, cand_col = (
        "topk_maxima", "topk_bound", "topk_counts", "topk_cand_key", "topk_cand_col")
    buffers = (
        Buffer(maxima, (rows, slices, groups), "int32"),
        Buffer(bound, (rows,), "int32"),
        Buffer(counts, (rows, 2, slices), "int32"),
        Buffer(cand_key, (rows, capacity), "int32"),
        Buffer(cand_col, (rows, capacity), "int32"),
    )
    # Trip counts are runtime scalars: torch compiles one kernel set per (k, tile).
    sizes = dict(num_columns=columns, lg_sr=logits_stride, slices=slices)
    per_slice = dict(sizes, tiles_per_slice=tiles_per_slice)
    max_slices = triton.next_power_of_2(TOPK_MAX_SLICES)
    options = dict(num_warps=8 if tile >= 2048 else 4, num_stages=1)
    launches = []
    for count in row_counts:
        launches += [
            Launch(topk_group_max_kernel, (count, slices), (logits, visible), (maxima,), per_slice,
                   dict(GROUPS=groups, TILE=tile), **options),
            Launch(topk_bound_kernel, (count, slices), (logits, visible, maxima), (bound, counts), per_slice,
                   dict(K=k, GROUPS=groups, TILE=tile, BITS=RADIX_BITS), **options),
            Launch(topk_place_kernel, (count, slices), (logits, visible, bound, counts),
                   (out, cand_key, cand_col), dict(per_slice, capacity=capacity),
                   dict(K=k, TILE=tile, MAX_SLICES=max_slices), **options),
            # `out` is updated in place: phase 3 wrote the rows where T == L.
            Launch(topk_finish_kernel, (count,), (logits, visible, counts, cand_key, cand_col, out), (out,),
                   dict(sizes, capacity=capacity),
                   dict(K=k, TILE=tile, CAND_TILE=cand_tile, MAX_SLICES=max_slices, BITS=RADIX_BITS,
                        PAD_TILE=min(1024, triton.next_power_of_2(k))),
                   **options),
        ]
    return buffers, tuple(launches)


def _expand_launches(block_topk: int, compress_ratio: int, block_stride: int, out_stride: int,
                     requests: int, row_ranges, block_indices: str):
    width = block_topk * compress_ratio + compress_ratio - 1
    block_w = min(1024, triton.next_power_of_2(max(width, 1)))
    # With no blocks to expand, any input stands in for the (unread) indices.
    block_indices = block_indices if block_topk else "token_to_req"
    launches = []
    for i, (first, count) in enumerate(row_ranges):
        # Later chunks update `out` in place (aliased in JAX); the first
        # chunk's stand-in is never read.
        previous = "out" if i else block_indices
        launches.append(Launch(
            kernel=expand_kernel,
            grid=(count, triton.cdiv(width, block_w)),
            inputs=(block_indices, "query_positions", "sequence_lengths", "token_to_req", previous),
            outputs=("out",),
            scalars=dict(row_begin=first, num_requests=requests, bi_sr=block_stride, out_sr=out_stride),
            constexprs=dict(BLOCK_TOPK=block_topk, RATIO=compress_ratio, WIDTH=width, BLOCK_W=block_w),
            num_warps=4,
            num_stages=1,
        ))
    return launches


@cached_plan
def plan_mqa_paged_scores(q: ArrayInfo, k_cache: ArrayInfo, page_table: ArrayInfo,
                          token_to_req: ArrayInfo, query_positions: ArrayInfo,
                          sequence_lengths: ArrayInfo, compress_ratio, num_columns=None,
                          score_divisor=None) -> Program:
    """Validate ``mqa_paged_scores`` arguments and describe its launch (see docs/api.md)."""
    check = Checker("mqa_paged_scores")
    _check_scoring(check, q, k_cache, page_table, token_to_req, query_positions, sequence_lengths,
                   compress_ratio)
    if num_columns is None:
        num_columns = page_table.shape[1] * k_cache.shape[1]
    check.nonnegative_int("num_columns", num_columns)
    if score_divisor is None:
        score_divisor = math.sqrt(q.shape[2])
    check.positive("score_divisor", score_divisor, "a positive number")
    rows = q.shape[0]
    logits = Buffer("logits", (rows, num_columns), "float32")
    visible = Buffer("visible_blocks", (rows,), "int32")
    launches = _score_launches(q, k_cache, page_table, compress_ratio, num_columns, score_divisor,
                               [(0, rows)], logits.info.strides[0])
    return Program("mqa_paged_scores", (logits, visible), tuple(launches), ("logits", "visible_blocks"))


@cached_plan
def plan_topk_blocks(logits: ArrayInfo, visible_blocks: ArrayInfo, k) -> Program:
    """Validate ``topk_blocks`` arguments and describe its launches (see docs/api.md)."""
    check = Checker("topk_blocks")
    check.rank("logits", logits, 2, "[R, C]")
    check.dtype("logits", logits, FLOAT_DTYPES)
    rows, columns = logits.shape
    _check_vector(check, "visible_blocks", visible_blocks, rows, "R")
    check.nonnegative_int("k", k)
    check.last_dim_contiguous("logits", logits)
    check.last_dim_contiguous("visible_blocks", visible_blocks)
    out = Buffer("out", (rows, k), "int32")
    buffers, launches = _topk_parts(rows, columns, k, logits.strides[0], [rows],
                                    "logits", "visible_blocks", "out")
    return Program("topk_blocks", (out,) + buffers, launches, ("out",))


@cached_plan
def plan_expand_block_indices(block_indices: ArrayInfo, query_positions: ArrayInfo,
                              sequence_lengths: ArrayInfo, token_to_req: ArrayInfo,
                              compress_ratio, token_topk) -> Program:
    """Validate ``expand_block_indices`` arguments and describe its launch (see docs/api.md)."""
    check = Checker("expand_block_indices")
    _check_positive_int(check, "compress_ratio", compress_ratio)
    _check_token_topk(check, token_topk, compress_ratio)
    block_topk = token_topk // compress_ratio
    check.rank("block_indices", block_indices, 2, "[R, token_topk // compress_ratio]")
    check.dtype("block_indices", block_indices, INDEX_DTYPES)
    rows = block_indices.shape[0]
    if block_indices.shape[1] != block_topk:
        check.fail("block_indices", f"must have token_topk // compress_ratio = {block_topk} columns",
                   f"shape {block_indices.shape}")
    _check_vector(check, "query_positions", query_positions, rows, "R")
    check.rank("sequence_lengths", sequence_lengths, 1, "[B]")
    check.dtype("sequence_lengths", sequence_lengths, INDEX_DTYPES)
    _check_vector(check, "token_to_req", token_to_req, rows, "R")
    for name, info in (("block_indices", block_indices), ("query_positions", query_positions),
                       ("sequence_lengths", sequence_lengths), ("token_to_req", token_to_req)):
        check.last_dim_contiguous(name, info)
    out = Buffer("out", (rows, token_topk + compress_ratio - 1), "int32")
    launches = _expand_launches(block_topk, compress_ratio, block_indices.strides[0], out.shape[1],
                                sequence_lengths.shape[0], [(0, rows)], "block_indices")
    return Program("expand_block_indices", (out,), tuple(launches), ("out",))


@cached_plan
def plan_select_paged_tokens(q: ArrayInfo, k_cache: ArrayInfo, page_table: ArrayInfo,
                             token_to_req: ArrayInfo, query_positions: ArrayInfo,
                             sequence_lengths: ArrayInfo, token_topk, compress_ratio) -> Program:
    """Validate ``select_paged_tokens`` arguments and describe its chunked launches (see docs/api.md).

    Each chunk of rows is scored into one logits workspace, ranked and
    expanded into its rows of ``out``; later chunks reuse every workspace.
    """
    check = Checker("select_paged_tokens")
    _check_scoring(check, q, k_cache, page_table, token_to_req, query_positions, sequence_lengths,
                   compress_ratio)
    _check_token_topk(check, token_topk, compress_ratio)
    rows = q.shape[0]
    columns = page_table.shape[1] * k_cache.shape[1]
    block_topk = token_topk // compress_ratio
    # Chunks are whole scorer row tiles, so chunking never changes a score.
    tile_rows, _, _ = _score_tiling(q, k_cache, page_table, columns)
    chunk = max(1, LOGITS_WORKSPACE_BYTES // (4 * max(columns, 1)) // tile_rows) * tile_rows
    chunk = min(chunk, rows)
    ranges = [(first, min(chunk, rows - first)) for first in range(0, rows, max(chunk, 1))]
    logits = Buffer("logits", (chunk, columns), "float32")
    out = Buffer("out", (rows, token_topk + compress_ratio - 1), "int32")
    stride = logits.info.strides[0]
    score = _score_launches(q, k_cache, page_table, compress_ratio, columns, math.sqrt(q.shape[2]),
                            ranges, stride)
    topk_buffers, topk = _topk_parts(chunk, columns, block_topk, stride, [n for _, n in ranges],
                                     "logits", "visible_blocks", "blocks")
    expand = _expand_launches(block_topk, compress_ratio, max(block_topk, 1), out.shape[1],
                              page_table.shape[0], ranges, "blocks")
    per_chunk = len(topk) // max(len(ranges), 1)
    launches = []
    for i in range(len(ranges)):
        launches += [score[i], *topk[i * per_chunk:(i + 1) * per_chunk], expand[i]]
    buffers = (out, logits, Buffer("visible_blocks", (chunk,), "int32"),
               Buffer("blocks", (chunk, block_topk), "int32")) + topk_buffers
    return Program("select_paged_tokens", buffers, tuple(launches), ("out",))
