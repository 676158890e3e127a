"""Stage 3a: score every compressed block of each row's request (``mqa_paged_scores``).

A program scores a tile of BLOCK_R consecutive
rows against BLOCK_N columns (compressed blocks) of the paged key cache.  When
every row of the tile belongs to one request (a prefill chunk), the tile's
keys are gathered once and every head is one tensor-core dot
``[BLOCK_R, D] x [D, BLOCK_N]``; otherwise (decode, or a tile straddling two
requests) each row is scored alone with its heads padded to a dot of at least
16 rows.  Keys past the tile's visible columns are never loaded.

With fp8 keys and ``SelectTuning.fp8_row_tiles`` > 1 (issue 27's candidates,
not the default), decode rows are scored by :func:`scores_rows_kernel`
instead: a program scores several of a row's tiles in a loop, each as
``score_row_tile`` scores it (the same bits).
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from . import runtime
from .fp8 import bit_trick, in_registers, widen_e4m3
from .launch import ArrayInfo, Buffer, Launch, Program
from .pdl import dependent, wait_for_previous_kernel
from .stage import stage
from .rows import count_visible_blocks, row_request
from .tuning import SelectTuning
from .validate import FINITE_POSITIVE_NUMBER, FLOAT_DTYPES, FP8_DTYPE, NONNEGATIVE_INT, POSITIVE_INT, Checker

#: Options of the scorer's arguments (select_paged_tokens shares them).
SCORING_OPTIONS = dict(compress_ratio=POSITIVE_INT)

SCORES_DOC_ARGS = """\
    q: ``[R, H, D]`` bf16, fp16 or fp32 indexer queries.
    k_cache: ``[num_pages, P, 1, D]`` compressed keys (bf16, fp16 or fp32,
        or fp8 e4m3 with ``k_scale``: see ``store_cache_rows``).
    page_table: ``[B, W]`` int32/int64 physical pages of each request's
        compressed blocks (block ``c`` is page ``c // P``, offset ``c % P``);
        ``-1`` and out-of-range pages are skipped.
    token_to_req: ``[R]`` request of each row; ``-1`` / out of range: none.
    query_positions: ``[R]`` token position of each row.
    sequence_lengths: ``[B]`` tokens of each request."""

SCALE_DOC = """\
    k_scale: for a ``float8_e4m3fn`` k_cache only (required then, else it
        must be None): the cache's one positive per-tensor scale, a 0-d or
        1-element float tensor (keys = stored values * k_scale, as
        ``store_cache_rows(..., scale=)`` wrote them).  The fp8 keys are
        converted exactly to q's dtype for the dot (float32 accumulation; NaN
        codes as NaN) and k_scale is folded into the float32 divisor: ``score_divisor /
        k_scale`` (``relu`` commutes with a positive scale).  The logits
        equal those of a 16-bit cache of the dequantised keys within float32
        rounding, not bitwise (a few last-bit differences on the GPU)."""

SCORES_DOC = f"""\
Score every compressed block of each row's request (QSA indexer).

score = sum over heads of ``relu(q_h . k)`` / ``score_divisor``.  A row sees
``visible_blocks = min((query_position + 1) // compress_ratio,
sequence_length // compress_ratio)`` blocks (0 for a row without a valid
request; negative values count as 0); columns at or past it, and columns
whose page is missing, are ``-inf``.

Args:
{SCORES_DOC_ARGS}
    compress_ratio: tokens per compressed block (positive int).
    num_columns: logits width ``C``; default ``W * P``.
    score_divisor: positive divisor of the scores; default ``sqrt(D)``.
{SCALE_DOC}

Returns:
    ``(logits [R, C] float32, visible_blocks [R] int32)``.
"""


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
                 num_pages, table_width, kc_sb, kc_sp, pt_sr,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr):
    """Keys ``[BLOCK_N, BLOCK_D]`` of a request's columns below ``limit`` (0 elsewhere)."""
    dims = tl.arange(0, BLOCK_D)
    logical_page = cols // PAGE
    in_table = request_ok & (cols < limit) & (logical_page < table_width)
    page = tl.load(page_table_ptr + request * pt_sr + logical_page, mask=in_table, other=-1).to(tl.int64)
    present = in_table & (page >= 0) & (page < num_pages)
    # page * stride overflows int32 for large caches: page is int64.
    keys = tl.load(k_cache_ptr + page[:, None] * kc_sb + (cols % PAGE)[:, None] * kc_sp + dims[None, :],
                   mask=present[:, None] & (dims[None, :] < D), other=0.0)
    return keys, present


@triton.jit
def score_row_tile(q_ptr, k_cache_ptr, page_table_ptr, token_to_req_ptr, query_positions_ptr,
                   sequence_lengths_ptr, row, col_start, num_pages, num_requests, table_width,
                   q_sr, q_sh, kc_sb, kc_sp, pt_sr, score_divisor,
                   HEADS: tl.constexpr, HEADS_P: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                   PAGE: tl.constexpr, RATIO: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
                   FP8_KEYS: tl.constexpr, BIT_TRICK: tl.constexpr, IN_REGISTERS: tl.constexpr):
    """``(scores [BLOCK_N], cols, visible)`` of one row against the columns
    from ``col_start``: its heads padded to a dot of HEADS_P >= 16 rows.
    (The fused selection scores with this too: the same bits as the scorer.)"""
    request, request_ok, length = row_request(token_to_req_ptr, sequence_lengths_ptr, row, True, num_requests)
    visible = count_visible_blocks(tl.load(query_positions_ptr + row).to(tl.int64), length, RATIO)
    cols = col_start + tl.arange(0, BLOCK_N)
    scores = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    if request_ok & (col_start < visible):
        keys, present = _gather_keys(k_cache_ptr, page_table_ptr, request, request_ok, cols, visible,
                                     num_pages, table_width, kc_sb, kc_sp, pt_sr, D, BLOCK_D, PAGE)
        heads = tl.arange(0, HEADS_P)
        dims = tl.arange(0, BLOCK_D)
        q = tl.load(q_ptr + row * q_sr + heads[:, None] * q_sh + dims[None, :],
                    mask=(heads[:, None] < HEADS) & (dims[None, :] < D), other=0.0)
        if FP8_KEYS:
            keys = widen_e4m3(keys, q.dtype, BIT_TRICK, IN_REGISTERS)  # exact: q's dtype holds every e4m3 value
        # Padded heads are zero rows: relu(0) adds nothing.
        total = tl.sum(tl.maximum(_dot(q, tl.trans(keys), UPCAST), 0.0), axis=0)
        scores = tl.where(present, total / score_divisor, float("-inf"))
    return scores, cols, visible


@triton.jit
def _score_row(q_ptr, k_cache_ptr, page_table_ptr, token_to_req_ptr, query_positions_ptr,
               sequence_lengths_ptr, logits_ptr, local_row, col_start,
               row_begin, num_columns, num_pages, num_requests, table_width,
               q_sr, q_sh, kc_sb, kc_sp, pt_sr, lg_sr, score_divisor,
               HEADS: tl.constexpr, HEADS_P: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
               PAGE: tl.constexpr, RATIO: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
               FP8_KEYS: tl.constexpr, BIT_TRICK: tl.constexpr, IN_REGISTERS: tl.constexpr):
    """One row against a column tile, stored into its logits row."""
    scores, cols, _visible = score_row_tile(
        q_ptr, k_cache_ptr, page_table_ptr, token_to_req_ptr, query_positions_ptr, sequence_lengths_ptr,
        row_begin + local_row.to(tl.int64), col_start, num_pages, num_requests, table_width,
        q_sr, q_sh, kc_sb, kc_sp, pt_sr, score_divisor,
        HEADS, HEADS_P, D, BLOCK_D, PAGE, RATIO, BLOCK_N, UPCAST, FP8_KEYS, BIT_TRICK, IN_REGISTERS)
    tl.store(logits_ptr + local_row.to(tl.int64) * lg_sr + cols, scores, mask=cols < num_columns)


@dependent
@triton.jit
def scores_kernel(
    # inputs
    q_ptr,  # [R, H, D] bf16/fp16/fp32
    k_cache_ptr,  # [num_pages, P, 1, D] bf16/fp16/fp32/fp8 e4m3
    page_table_ptr,  # [B, W] int32/int64
    token_to_req_ptr,  # [R] int32/int64
    query_positions_ptr,  # [R] int32/int64
    sequence_lengths_ptr,  # [B] int32/int64
    k_scale_ptr,  # [] or [1] float (read only when FP8_KEYS)
    # outputs (rows local to the launch: row_begin + i is row i)
    logits_ptr,  # [num_rows (or a chunk's rows), C] float32
    visible_ptr,  # [num_rows] int32
    # sizes, strides, options
    row_begin, num_rows, num_columns, num_pages, num_requests, table_width,
    q_sr, q_sh, kc_sb, kc_sp, pt_sr, lg_sr, score_divisor,
    # constexprs
    HEADS: tl.constexpr, HEADS_P: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, RATIO: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, FP8_KEYS: tl.constexpr, BIT_TRICK: tl.constexpr, IN_REGISTERS: tl.constexpr,
):
    """Rows ``row_begin + [0, num_rows)``; their logits and visible rows are local (0-based)."""
    wait_for_previous_kernel()
    if FP8_KEYS:
        # keys = stored * k_scale > 0, and relu(k_scale * x) = k_scale * relu(x).
        score_divisor = score_divisor / tl.load(k_scale_ptr).to(tl.float32)
    first = tl.program_id(0) * BLOCK_R
    local = first + tl.arange(0, BLOCK_R)
    row_ok = local < num_rows
    rows = row_begin + local.to(tl.int64)
    request, request_ok, length = row_request(token_to_req_ptr, sequence_lengths_ptr, rows, row_ok, num_requests)
    position = tl.load(query_positions_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    visible = count_visible_blocks(position, length, RATIO)
    if tl.program_id(1) == 0:
        tl.store(visible_ptr + local, tl.minimum(visible, 2147483647).to(tl.int32), mask=row_ok)
    col_start = tl.program_id(1) * BLOCK_N

    if BLOCK_R == 1:
        _score_row(q_ptr, k_cache_ptr, page_table_ptr, token_to_req_ptr, query_positions_ptr,
                   sequence_lengths_ptr, logits_ptr, first, col_start,
                   row_begin, num_columns, num_pages, num_requests, table_width,
                   q_sr, q_sh, kc_sb, kc_sp, pt_sr, lg_sr, score_divisor,
                   HEADS, HEADS_P, D, BLOCK_D, PAGE, RATIO, BLOCK_N, UPCAST, FP8_KEYS, BIT_TRICK, IN_REGISTERS)
    else:
        # A tile whose valid rows share one request (a prefill chunk) loads
        # the keys once for all its rows; any other tile is scored row by row.
        shared_request = tl.max(tl.where(request_ok, request, -1))
        if tl.min(tl.where(request_ok, request, shared_request)) == shared_request:
            cols = col_start + tl.arange(0, BLOCK_N)
            limit = tl.max(tl.where(request_ok, visible, 0))
            total = tl.zeros((BLOCK_R, BLOCK_N), tl.float32)
            keys, present = _gather_keys(k_cache_ptr, page_table_ptr, shared_request, shared_request >= 0,
                                         cols, limit, num_pages, table_width, kc_sb, kc_sp, pt_sr,
                                         D, BLOCK_D, PAGE)
            if col_start < limit:
                if FP8_KEYS:  # exact, as in _score_row (a new name: keys' type is fixed out here)
                    keys_t = tl.trans(widen_e4m3(keys, q_ptr.dtype.element_ty, BIT_TRICK, IN_REGISTERS))
                else:
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
                               q_sr, q_sh, kc_sb, kc_sp, pt_sr, lg_sr, score_divisor,
                               HEADS, HEADS_P, D, BLOCK_D, PAGE, RATIO, BLOCK_N, UPCAST, FP8_KEYS, BIT_TRICK, IN_REGISTERS)


@triton.jit
def _tile_pages(page_table_ptr, request, request_ok, col_start, num_pages, table_width, pt_sr, kc_sb, kc_sp,
                PAGE: tl.constexpr, SPAN: tl.constexpr):
    """The (at most two) pages of a tile of columns from ``col_start``, as scalars ``(offset 0,
    mapped 0, offset 1, mapped 1)``: the element offset in the cache (int64) of the tile's first
    column in each page (0 where a page is not mapped) and whether it is mapped (in the table,
    present, of a valid request)."""
    logical = col_start // PAGE
    ok0 = request_ok & (logical < table_width)
    page0 = tl.load(page_table_ptr + request * pt_sr + logical, mask=ok0, other=-1).to(tl.int64)
    ok0 = ok0 & (page0 >= 0) & (page0 < num_pages)
    # A page longer than the tile: the tile starts inside it (else at its start).
    off0 = tl.where(ok0, page0 * kc_sb + (col_start % PAGE) * kc_sp, 0)
    if SPAN == 2:
        ok1 = request_ok & (logical + 1 < table_width)
        page1 = tl.load(page_table_ptr + request * pt_sr + logical + 1, mask=ok1, other=-1).to(tl.int64)
        ok1 = ok1 & (page1 >= 0) & (page1 < num_pages)
        off1 = tl.where(ok1, page1 * kc_sb, 0)
    else:
        ok1 = ok0
        off1 = off0
    return off0, ok0, off1, ok1


@triton.jit
def _row_offsets(second, off0, off1):
    """The page offset of each row of a tile (``second``: in its second page), by arithmetic:
    Triton 3.9's contiguity analysis loses the 16-byte loads through a select here."""
    return off0 + second.to(tl.int64) * (off1 - off0)


@triton.jit
def _prefetch_l2(pointers, mask):
    """Hints the 128-byte lines at ``pointers`` into L2 where ``mask`` (``prefetch.global.L2``,
    SASS ``CCTL.E.PF2``: no register waits for it, nothing changes but the cache)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
        "=r,l,r", [pointers, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _score_tile(q, keys, present, logits_row, col_start, lane, num_columns, score_divisor, UPCAST: tl.constexpr,
                FP8_KEYS: tl.constexpr, BIT_TRICK: tl.constexpr, IN_REGISTERS: tl.constexpr):
    """A tile's scores from its loaded keys, as ``score_row_tile`` computes them, stored."""
    if FP8_KEYS:
        keys = widen_e4m3(keys, q.dtype, BIT_TRICK, IN_REGISTERS)  # exact: q's dtype holds every e4m3 value
    # Padded heads are zero rows: relu(0) adds nothing.
    total = tl.sum(tl.maximum(_dot(q, tl.trans(keys), UPCAST), 0.0), axis=0)
    tl.store(logits_row + col_start + lane, tl.where(present, total / score_divisor, float("-inf")),
             mask=lane < num_columns - col_start)


@dependent
@triton.jit
def scores_rows_kernel(
    # inputs (scores_kernel's)
    q_ptr, k_cache_ptr, page_table_ptr, token_to_req_ptr, query_positions_ptr, sequence_lengths_ptr, k_scale_ptr,
    # outputs (rows local to the launch: row_begin + i is row i)
    logits_ptr, visible_ptr,
    # sizes, strides, options
    row_begin, num_columns, num_pages, num_requests, table_width,
    q_sr, q_sh, kc_sb, kc_sp, pt_sr, lg_sr, score_divisor,
    # constexprs
    HEADS: tl.constexpr, HEADS_P: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, RATIO: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr,
    UPCAST: tl.constexpr, FP8_KEYS: tl.constexpr, BIT_TRICK: tl.constexpr, IN_REGISTERS: tl.constexpr,
    SPAN: tl.constexpr, PREFETCH: tl.constexpr, PIPELINED: tl.constexpr,
):
    """A row a program (decode rows), ``TILES`` consecutive tiles of BLOCK_N columns in a loop
    (program ``(i, j)``: row i, tiles ``j * TILES ...``), each scored as ``score_row_tile``
    scores it (the same operations on the same values: the same bits).

    The row's request, visible count and q are read once per program, not once per tile.  A
    tile lies in at most SPAN (1 or 2) pages (PAGE divides BLOCK_N, or BLOCK_N divides PAGE),
    so its keys are at most two contiguous spans addressed from two scalar page lookups,
    without a per-column page gather.  ``PREFETCH``: while a tile is widened and scored, its
    successor's keys are hinted into L2 (one ``prefetch.global.L2`` a thread and tile), so
    that the DRAM reads of the next tile overlap this tile's work.
    """
    wait_for_previous_kernel()
    if FP8_KEYS:
        # keys = stored * k_scale > 0, and relu(k_scale * x) = k_scale * relu(x).
        score_divisor = score_divisor / tl.load(k_scale_ptr).to(tl.float32)
    local = tl.program_id(0)
    row = row_begin + local.to(tl.int64)
    request, request_ok, length = row_request(token_to_req_ptr, sequence_lengths_ptr, row, True, num_requests)
    # Columns are int32 (< num_columns): compared with the visible count clamped to int32.
    visible = tl.minimum(count_visible_blocks(tl.load(query_positions_ptr + row).to(tl.int64), length, RATIO),
                         2147483647).to(tl.int32)
    if tl.program_id(1) == 0:
        tl.store(visible_ptr + local, visible)
    first = tl.program_id(1) * (BLOCK_N * TILES)
    # Tiles holding a column both visible and stored are scored; the others are -inf.
    limit = tl.where(request_ok, tl.minimum(visible, num_columns), 0)
    live = tl.minimum(tl.maximum(tl.cdiv(limit - first, BLOCK_N), 0), TILES)
    heads = tl.arange(0, HEADS_P)
    dims = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + row * q_sr + heads[:, None] * q_sh + dims[None, :],
                mask=(heads[:, None] < HEADS) & (dims[None, :] < D), other=0.0)
    logits_row = logits_ptr + local.to(tl.int64) * lg_sr
    lane = tl.arange(0, BLOCK_N)
    second = (lane % (SPAN * PAGE)) >= PAGE  # in the tile's second page (never when SPAN == 1)
    # Within a page (int32: the plan checks PAGE * kc_sp + D fits).
    in_page = (lane % PAGE) * kc_sp
    offsets = in_page[:, None] + dims[None, :]
    dims_ok = dims[None, :] < D
    if PIPELINED:
        # Triton's software pipelining (the launch's num_stages): each tile's pages looked up in
        # its iteration, so that the pipeliner can issue its loads (cp.async) stages ahead.
        for t in range(live):
            col_start = first + t * BLOCK_N
            off0, ok0, off1, ok1 = _tile_pages(page_table_ptr, request, request_ok, col_start, num_pages,
                                               table_width, pt_sr, kc_sb, kc_sp, PAGE, SPAN)
            present = tl.where(second, ok1, ok0) & (lane < visible - col_start)
            keys = tl.load(k_cache_ptr + _row_offsets(second, off0, off1)[:, None] + offsets,
                           mask=present[:, None] & dims_ok, other=0.0)
            _score_tile(q, keys, present, logits_row, col_start, lane, num_columns, score_divisor,
                         UPCAST, FP8_KEYS, BIT_TRICK, IN_REGISTERS)
    else:
        # The pages of tiles t (off0...) and t + 1 (next0...), looked up an iteration ahead of
        # their use (the prefetch's address needs them), and tile t + 1's keys hinted into L2.
        off0, ok0, off1, ok1 = _tile_pages(page_table_ptr, request, request_ok, first, num_pages, table_width,
                                           pt_sr, kc_sb, kc_sp, PAGE, SPAN)
        next0, next_ok0, next1, next_ok1 = _tile_pages(page_table_ptr, request, request_ok & (live > 1),
                                                       first + BLOCK_N, num_pages, table_width, pt_sr, kc_sb,
                                                       kc_sp, PAGE, SPAN)
        for t in range(live):
            col_start = first + t * BLOCK_N
            # Scalars against the lanes (not columns against scalars: 32-bit compares).
            present = tl.where(second, ok1, ok0) & (lane < visible - col_start)
            keys = tl.load(k_cache_ptr + _row_offsets(second, off0, off1)[:, None] + offsets,
                           mask=present[:, None] & dims_ok, other=0.0)
            if PREFETCH:  # the next tile's keys into L2 while this one is scored
                _prefetch_l2(k_cache_ptr + _row_offsets(second, next0, next1) + in_page,
                             tl.where(second, next_ok1, next_ok0))
            off0, ok0, off1, ok1 = next0, next_ok0, next1, next_ok1
            next0, next_ok0, next1, next_ok1 = _tile_pages(
                page_table_ptr, request, request_ok & (t + 2 < live), col_start + 2 * BLOCK_N, num_pages,
                table_width, pt_sr, kc_sb, kc_sp, PAGE, SPAN)
            _score_tile(q, keys, present, logits_row, col_start, lane, num_columns, score_divisor,
                         UPCAST, FP8_KEYS, BIT_TRICK, IN_REGISTERS)
    for t in range(live, TILES):
        col_start = first + t * BLOCK_N
        tl.store(logits_row + col_start + lane, tl.full((BLOCK_N,), float("-inf"), tl.float32),
                 mask=lane < num_columns - col_start)


def check_scoring(check: Checker, q, k_cache, page_table, token_to_req, query_positions,
                  sequence_lengths) -> None:
    """The scorer's arrays (``compress_ratio`` is an option: see SCORING_OPTIONS)."""
    check.array("q", q, 3, "[R, H, D]", FLOAT_DTYPES)
    rows, heads, dim = q.shape
    if heads < 1 or dim < 1:
        check.fail("q", "must have at least one head and a head dim D >= 1", f"shape {q.shape}")
    check.array("k_cache", k_cache, 4, "[num_pages, P, 1, D]", FLOAT_DTYPES + (FP8_DTYPE,))
    if k_cache.shape[2] != 1:
        check.fail("k_cache", "must have one key head (dimension 2 of size 1)", f"shape {k_cache.shape}")
    if k_cache.shape[3] != dim:
        check.fail("k_cache", f"must have {check.owner('q')} head dim D = {dim}", f"shape {k_cache.shape}")
    if k_cache.shape[1] < 1:
        check.fail("k_cache", "must have a page size P >= 1", f"shape {k_cache.shape}")
    check.index_array("page_table", page_table, 2, "[B, W]")
    check.index_vector("token_to_req", token_to_req, rows, "R")
    check.index_vector("query_positions", query_positions, rows, "R")
    check.index_vector("sequence_lengths", sequence_lengths, page_table.shape[0], "B")


def check_key_scale(check: Checker, k_cache: ArrayInfo, k_scale: ArrayInfo | None) -> bool:
    """``k_scale`` given exactly when ``k_cache`` is fp8, as a scalar array: whether it is."""
    fp8 = k_cache.dtype == FP8_DTYPE
    if fp8 and k_scale is None:
        check.fail("k_scale", f"must be given (a 0-d or 1-element float tensor) for a {FP8_DTYPE} {check.name('k_cache')}", None)
    if not fp8 and k_scale is not None:
        check.fail("k_scale", f"must be None for a {k_cache.dtype} {check.name('k_cache')} (a scale is for {FP8_DTYPE} keys)",
                   f"an array of shape {k_scale.shape}")
    if k_scale is not None:
        check.scalar_array("k_scale", k_scale)
    return fp8


def exact_dot(q: ArrayInfo, k_cache: ArrayInfo) -> bool:
    """Whether the scorer takes the exact fp32 dot (fp32 or mixed operands), not tensor cores."""
    # fp8 keys are widened exactly to q's dtype: not a mixed-precision dot.
    return (q.dtype != k_cache.dtype and k_cache.dtype != FP8_DTYPE) or q.dtype == "float32"


def score_tiling(q: ArrayInfo, k_cache: ArrayInfo, page_table: ArrayInfo, num_columns: int,
                 tuning: SelectTuning | None = None):
    """(rows per tile, columns per tile, upcast operands) of the scorer.

    Rows outnumber requests only when some request has several rows (a
    prefill chunk): then tiles of 16-64 rows share key loads.  fp32 or mixed
    operands take an exact fp32 dot (no tensor cores): scored row by row.
    Register use of these tiles was checked offline for sm_90 (no spills).
    fp8 keys scored row by row take ``tuning.fp8_row_columns`` columns (and
    ``fp8_row_warps`` warps: see score_launches).
    """
    tuning = tuning or SelectTuning()
    rows, dim = q.shape[0], q.shape[2]
    exact = exact_dot(q, k_cache)
    if exact or rows <= page_table.shape[0]:
        block_r = 1
    else:
        block_r = 64 if rows >= 1024 else 16
    fp8_rows = k_cache.dtype == FP8_DTYPE and block_r == 1 and not exact
    wide = max(1, tuning.fp8_row_columns // 128) if fp8_rows else 1
    block_n = wide * (32 if exact else (128 if block_r == 1 else 64))
    block_d = max(16, triton.next_power_of_2(dim))
    block_n = max(16, min(block_n, wide * 16384 // block_d, triton.next_power_of_2(max(num_columns, 1))))
    # The interpreter's bf16 dots are wrong: it always multiplies in fp32.
    return block_r, block_n, exact or runtime.INTERPRETED


def scorer_arguments(q, k_cache, page_table, compress_ratio, num_columns, score_divisor, fp8_keys=False,
                     tuning: SelectTuning | None = None):
    """``(block_r, block_n, scalars, constexprs, warps)`` of the scorer's launches
    (the fused selection's scoring too): scalars but the rows' and logits stride."""
    tuning = tuning or SelectTuning()
    heads, dim = q.shape[1], q.shape[2]
    block_r, block_n, upcast = score_tiling(q, k_cache, page_table, num_columns, tuning)
    scalars = dict(num_columns=num_columns, num_pages=k_cache.shape[0], num_requests=page_table.shape[0],
                   table_width=page_table.shape[1], q_sr=q.strides[0], q_sh=q.strides[1],
                   kc_sb=k_cache.strides[0], kc_sp=k_cache.strides[1], pt_sr=page_table.strides[0],
                   score_divisor=float(score_divisor))
    constexprs = dict(HEADS=heads, HEADS_P=max(16, triton.next_power_of_2(heads)), D=dim,
                      BLOCK_D=max(16, triton.next_power_of_2(dim)), PAGE=k_cache.shape[1], RATIO=compress_ratio,
                      BLOCK_N=block_n, UPCAST=upcast, FP8_KEYS=fp8_keys,
                      # fp8 keys: fp8.widen_e4m3's widening (in registers when compiled, by its bit trick for bf16 q)
                      BIT_TRICK=bit_trick(fp8_keys, q.dtype), IN_REGISTERS=in_registers(fp8_keys))
    upcast_exact = q.dtype == "float32"  # fp32 queries: the exact fp32 dot (8 warps)
    warps = tuning.fp8_row_warps if fp8_keys and block_r == 1 and not upcast_exact else 8
    return block_r, block_n, scalars, constexprs, warps


def row_loop(q: ArrayInfo, k_cache: ArrayInfo, block_r: int, block_n: int, num_columns: int, fp8_keys: bool,
             tuning: SelectTuning):
    """``(SPAN, most tiles a program)`` where the scorer takes ``scores_rows_kernel`` (fp8 keys
    scored a row a program on tensor cores, ``tuning.fp8_row_tiles`` > 1, a tile within at most
    two pages, in-page offsets within int32), else None (``scores_kernel``)."""
    page, pitch, dim = k_cache.shape[1], k_cache.strides[1], q.shape[2]
    if not (fp8_keys and block_r == 1 and not exact_dot(q, k_cache) and tuning.fp8_row_tiles > 1):
        return None
    if block_n % page == 0 and block_n // page <= 2:
        span = block_n // page
    elif page % block_n == 0:
        span = 1
    else:
        return None
    if (page - 1) * pitch + dim >= 2 ** 31:
        return None
    return span, min(tuning.fp8_row_tiles, triton.cdiv(max(num_columns, 1), block_n))


def row_loop_tiles(rows: int, row_tiles: int, most: int, tuning: SelectTuning) -> int:
    """Tiles a ``scores_rows_kernel`` program scores: at most ``most`` (a power of two), halved
    while fewer than ``tuning.fp8_row_min_programs`` programs would cover ``rows`` rows of
    ``row_tiles`` tiles (so that a small batch still fills the GPU)."""
    tiles = 1 << (max(most, 1).bit_length() - 1)
    while tiles > 1 and rows * triton.cdiv(row_tiles, tiles) < tuning.fp8_row_min_programs:
        tiles //= 2
    return tiles


def score_launches(q, k_cache, page_table, compress_ratio, num_columns, score_divisor,
                   row_ranges, logits_stride, fp8_keys=False, tuning: SelectTuning | None = None):
    """Scorer launches over ``row_ranges`` [(first row, rows)], writing local logits/visible rows."""
    tuning = tuning or SelectTuning()
    block_r, block_n, scalars, constexprs, warps = scorer_arguments(
        q, k_cache, page_table, compress_ratio, num_columns, score_divisor, fp8_keys, tuning)
    loop = row_loop(q, k_cache, block_r, block_n, num_columns, fp8_keys, tuning)
    if loop is not None:
        span, most_tiles = loop
        launches = []
        for first, count in row_ranges:
            tiles = row_loop_tiles(count, triton.cdiv(num_columns, block_n), most_tiles, tuning)
            launches.append(Launch(
                kernel=scores_rows_kernel,
                grid=(count, max(1, triton.cdiv(num_columns, block_n * tiles))),
                inputs=("q", "k_cache", "page_table", "token_to_req", "query_positions", "sequence_lengths",
                        "k_scale"),
                outputs=("logits", "visible_blocks"),
                scalars=dict(row_begin=first, **scalars, lg_sr=logits_stride),
                constexprs=dict(constexprs, TILES=tiles, SPAN=span,
                                # A hint by inline asm: compiled only.
                                PREFETCH=tuning.fp8_row_prefetch and not runtime.INTERPRETED,
                                PIPELINED=tuning.fp8_row_stages > 1),
                num_warps=warps,
                num_stages=tuning.fp8_row_stages,
            ))
        return launches
    return [Launch(
        kernel=scores_kernel,
        grid=(triton.cdiv(count, block_r), max(1, triton.cdiv(num_columns, block_n))),
        inputs=("q", "k_cache", "page_table", "token_to_req", "query_positions", "sequence_lengths",
                # Without fp8 keys: a stand-in pointer FP8_KEYS never reads.
                "k_scale" if fp8_keys else "q"),
        outputs=("logits", "visible_blocks"),
        scalars=dict(row_begin=first, num_rows=count, **scalars, lg_sr=logits_stride),
        constexprs=dict(constexprs, BLOCK_R=block_r),
        num_warps=warps,
        num_stages=1,
    ) for first, count in row_ranges]


@stage(
    arrays=("q", "k_cache", "page_table", "token_to_req", "query_positions", "sequence_lengths",
            "k_scale"),
    options=dict(SCORING_OPTIONS, num_columns=NONNEGATIVE_INT.or_none(),
                          score_divisor=FINITE_POSITIVE_NUMBER.or_none()),
    results=("logits", "visible_blocks"), doc=SCORES_DOC, returns="tuple[Array, Array]",
    tuning=dict(tuning="select"))
def plan_mqa_paged_scores(q: ArrayInfo, k_cache: ArrayInfo, page_table: ArrayInfo,
                          token_to_req: ArrayInfo, query_positions: ArrayInfo,
                          sequence_lengths: ArrayInfo, compress_ratio: int, num_columns: int | None = None,
                          score_divisor: float | None = None, *, k_scale: ArrayInfo | None = None,
                          tuning: SelectTuning | None = None) -> Program:
    """Validate ``mqa_paged_scores`` arguments and describe its launch (see docs/api.md).

    ``tuning`` (default: the current :class:`~qsa_kernels.tuning.SelectTuning`)
    holds the fp8 scorer's variants."""
    check = Checker("mqa_paged_scores")
    check_scoring(check, q, k_cache, page_table, token_to_req, query_positions, sequence_lengths)
    fp8_keys = check_key_scale(check, k_cache, k_scale)
    if num_columns is None:
        num_columns = page_table.shape[1] * k_cache.shape[1]
    if score_divisor is None:
        score_divisor = math.sqrt(q.shape[2])
    rows = q.shape[0]
    logits = Buffer("logits", (rows, num_columns), "float32")
    visible = Buffer("visible_blocks", (rows,), "int32")
    launches = score_launches(q, k_cache, page_table, compress_ratio, num_columns, score_divisor,
                              [(0, rows)], logits.info.strides[0], fp8_keys, tuning)
    return Program("mqa_paged_scores", (logits, visible), tuple(launches), ("logits", "visible_blocks"))

