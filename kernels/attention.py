"""Stage 4: split-K sparse paged GQA attention with an exact log-sum-exp merge.

One program attends the GROUP query heads that share one KV head of one row,
over one split of the row's selected tokens, so each gathered K/V row is read
once per KV head and used by the whole group.  Per tile of BLOCK_N selected
tokens it loads the logical positions, maps them to physical pages through
the row's request's block table, gathers K and V as ``[BLOCK_N, D]`` rows
(contiguous D) and runs an online softmax in the log2 domain.

With one split the program writes the output directly.  With several
(decode), each split writes its normalised float32 partial output and
log2-sum-exp, merged exactly in the fixed order 0..S-1 (:func:`_merge_splits`)
by a merge launch, or in the same launch (``AttentionTuning.fused_merge``,
off: slower on the H200; :func:`sparse_attention_fused_merge_kernel`); the
same elementwise code, the same bits.

Numerics (the seed's): q.k in the cache dtype, float32 accumulation and
scores; probabilities rounded to the value dtype for P.V, summed in float32.

fp8 e4m3 caches (``stored = value / scale``): each gathered tile is widened
exactly to q's dtype in registers (:func:`.fp8.widen_e4m3`, NaN kept), so the
dots are the 16-bit dots of 16-bit caches (V after the softmax, reusing K's
shared memory); ``k_scale`` is folded into the float32 score scale and
``v_scale`` multiplies each program's float32 output once: the result of a
16-bit cache holding the dequantised values, up to the rounding of those
scale products.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import runtime
from .fp8 import bit_trick, widen_e4m3
from .launch import ArrayInfo, Buffer, Launch, Program
from .pdl import dependent, wait_for_previous_kernel
from .stage import stage, when
from .tickets import finish_ticket, publish, start_ticket, wait_for
from .tuning import AttentionTuning
from .validate import BOOL, FINITE_NUMBER, FP8_DTYPE, Checker

FUNCTION = "sparse_paged_attention"
DOC = """\
GQA attention of each row over its selected tokens of a paged KV cache.

Row ``r`` attends the tokens listed in ``token_indices[r]``: logical token
positions of its request ``token_to_req[r]``, whose pages are
``block_table[token_to_req[r]]``.  Query head ``h`` reads KV head
``h // (QH // KH)``.  The selection is split across programs and merged with an
exact log-sum-exp (the split count changes only rounding).

Args:
    q: ``[R, QH, D]`` bf16 or fp16; D a multiple of 16 from 16 to 256.
    k_cache, v_cache: ``[num_blocks, P, KH, D]`` (the flash layout of
        ``rope_reshape_and_cache``) of q's dtype, or both ``float8_e4m3fn``
        (then ``k_scale`` and ``v_scale`` are required); ``QH % KH == 0``.
    token_indices: ``[R, W]`` int32/int64 logical token positions.  ``-1``, a
        position past the block table, an unmapped (``-1``) or out-of-range
        page are skipped; a position listed twice is attended twice.
    block_table: ``[B, max_pages]`` int32/int64 physical page of each logical
        page of each request.
    token_to_req: ``[R]`` int32/int64 request of each row; a row whose request
        is ``-1`` or ``>= B`` attends nothing.
    softmax_scale: Python number multiplying q.k; defaults to ``D ** -0.5``.[jax:  A
        compile-time constant under ``jax.jit``.]
    k_scale, v_scale: for fp8 caches only (else they must be None): 0-d or
        1-element float tensors, the scales stage 1 divided by (cache =
        value / scale).  q.k is computed on the fp8 keys converted exactly to
        q's dtype, accumulated in float32 and multiplied by ``softmax_scale *
        k_scale``; P.V likewise on the converted values (probabilities rounded
        to q's dtype, float32 accumulation), and the float32 output of each
        split is multiplied by ``v_scale`` once.  Both NaN codes (0x7f,
        0xff) are read as NaN, as a 16-bit cache's NaN (stage 1 writes a NaN
        of k or v as a NaN code).
    sinks: ``[QH]`` float32 or None: one extra logit per query head in the
        softmax's denominator, with no value, in the units of
        ``softmax_scale * q.k`` (gpt-oss's attention sinks).
    return_lse: also return each row's log-sum-exp.

Returns:
    ``out [R, QH, D]`` of q's dtype; rows with no valid token are zeros.
    NaN and inf propagate as in a float64 softmax: a NaN in q, or in a
    selected K row, or a +inf score, gives NaN heads (all of a KV group's
    heads for a K row); a valid token set whose scores are all -inf gives NaN
    (with a finite sink: zeros).  Very negative finite scores are finite.
    With ``return_lse``, ``(out, lse)``: ``lse [R, QH]`` float32, the natural
    log of the softmax's denominator (the sum over the row's valid tokens of
    ``exp(softmax_scale * q.k)``, fp8 with ``k_scale`` folded in, plus
    ``exp(sink)``); -inf for a row with no valid token and no sink (the sink
    with one), so ``merge_attention_states`` can merge it with another pass.
"""

LOG2_E = 1.4426950408889634

#: The largest head dim (a multiple of 16; other dims pad the tile to the next power of two).
MAX_HEAD_DIM = 256

# Launch configuration, decided from static shapes only (programs = R x KH,
# selection width W, head dim D) by the measured table of
# qsa_kernels.tuning.AttentionTuning.  Grid (rows, splits, KV heads): rows vary
# fastest, so programs running together are neighbouring rows of one KV head,
# whose overlapping selections L2 serves once.

#: Score of a skipped token and the running max before the first finite
#: score: -inf, so that no finite score, however negative, falls below it (a
#: finite sentinel such as -1e20 turned rows whose scores all lie below it into
#: 0 / 0).  While the running max is -inf the softmax subtracts 0 instead
#: (``exp2(-inf - -inf)`` is NaN): see ``_attend_split``.
MASKED_SCORE = tl.constexpr(-float("inf"))
_LOG2_E = tl.constexpr(LOG2_E)
_LN_2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _in_head_dim(mask, d, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """``mask`` (``[X, 1]``) restricted to the head dim's lanes ``d < D`` of a tile padded to
    BLOCK_D lanes; at a power-of-two D (BLOCK_D == D) ``mask`` itself: the same code as unpadded."""
    if BLOCK_D != D:
        mask = mask & (d < D)[None, :]
    return mask


@triton.jit
def _dot(a, b, acc, INTERPRET: tl.constexpr):
    """``a @ b + acc`` with float32 accumulation.

    The interpreter's bf16 dot is wrong, so only there the operands (exact in
    float32) are upcast; compiled code keeps the 16-bit tensor-core dot.
    """
    if INTERPRET:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc)


@triton.jit
def _attend_split(
    q_ptr, k_cache_ptr, v_cache_ptr, token_indices_ptr, block_table_ptr, token_to_req_ptr, k_scale_ptr, v_scale_ptr,
    sinks_ptr, o_ptr, lse_ptr,  # as sparse_attention_partial_kernel's
    row, split, kv_head,  # int64 row, int32 split, the KV head
    num_blocks, num_requests, table_width, scale_log2,
    q_sr, q_sh, k_sb, k_sp, k_sh, v_sb, v_sp, v_sh, ti_sr, bt_sr,
    o_ss, o_sr, o_sh, lse_ss, lse_sr,
    GROUP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, WIDTH: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILES_PER_SPLIT: tl.constexpr,
    INTERPRET: tl.constexpr, FP8_CACHE: tl.constexpr, BIT_TRICK: tl.constexpr,
    SLOT_ROWS: tl.constexpr, SAME_ROW_STRIDE: tl.constexpr,
    BLOCK_D: tl.constexpr, SINKS: tl.constexpr, NATURAL_LSE: tl.constexpr,
):
    """Split ``split`` of row ``row``'s tokens for KV head ``kv_head``'s query heads:
    its normalised output and log2-sum-exp (the whole of sparse_attention_partial_kernel,
    which the fused merge kernel runs for the split its start ticket names)."""
    # The group's query heads, padded to BLOCK_M >= 16 rows for tl.dot.
    group_offsets = tl.arange(0, BLOCK_M)
    head_ok = group_offsets < GROUP
    heads = kv_head * GROUP + group_offsets
    # The head dim padded to BLOCK_D lanes (a power of two): the padding loads as 0 (q, K and V
    # alike), so it adds nothing to q.k and its output lanes are never stored.
    d = tl.arange(0, BLOCK_D)
    head_lanes = _in_head_dim(head_ok[:, None], d, D, BLOCK_D)
    q = tl.load(q_ptr + row * q_sr + heads[:, None] * q_sh + d[None, :], mask=head_lanes, other=0.0)

    request = tl.load(token_to_req_ptr + row)
    request_ok = (request >= 0) & (request < num_requests)
    table_row = block_table_ptr + tl.where(request_ok, request, 0).to(tl.int64) * bt_sr
    index_row = token_indices_ptr + row * ti_sr
    k_head = k_cache_ptr + kv_head * k_sh
    v_head = v_cache_ptr + kv_head * v_sh

    if FP8_CACHE:
        # fp8 stores value / scale: k_scale joins the float32 score scale.
        scale_log2 = scale_log2 * tl.load(k_scale_ptr).to(tl.float32)

    running_max = tl.full((BLOCK_M,), MASKED_SCORE, tl.float32)
    normaliser = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    # Validity is counted apart from the normaliser: a NaN normaliser (NaN or
    # +inf scores) or a zero one (every valid score -inf) must give NaN like
    # the float64 softmax, and only "no valid token" gives zeros.  Counted per
    # column (no reduction inside the loop), summed once after it.
    valid_tokens = tl.zeros((BLOCK_N,), tl.int32)
    # int32 (WIDTH < 2**31): int64 columns cost 64-bit compares per tile.
    first_column = split * (TILES_PER_SPLIT * BLOCK_N)
    for tile in range(TILES_PER_SPLIT):
        columns = first_column + tile * BLOCK_N + tl.arange(0, BLOCK_N)
        token = tl.load(index_row + columns, mask=columns < WIDTH, other=-1)
        logical_page = token // PAGE
        valid = request_ok & (token >= 0) & (logical_page < table_width)
        page = tl.load(table_row + tl.where(valid, logical_page, 0), mask=valid, other=-1)
        valid = valid & (page >= 0) & (page < num_blocks)
        if SLOT_ROWS:
            # Pages are runs of rows (block stride = PAGE x row stride) and the cache
            # has < 2**31 rows: the int32 row index of the token's slot, times the row
            # stride in one 32 x 32 -> 64-bit multiply (the other path takes ~25 integer
            # ops per row and thread), shared by K and V when their row strides agree.
            slot = page.to(tl.int32) * PAGE + (token - logical_page * PAGE).to(tl.int32)
            slot = tl.where(valid, slot, 0).to(tl.int64)
            k_rows = k_head + slot * k_sp
            v_rows = v_head + (slot * k_sp if SAME_ROW_STRIDE else slot * v_sp)
        else:
            # page * block stride overflows int32 in large caches.
            page = tl.where(valid, page, 0).to(tl.int64)
            offset = tl.where(valid, token % PAGE, 0)
            k_rows = k_head + page * k_sb + offset * k_sp
            v_rows = v_head + page * v_sb + offset * v_sp
        token_lanes = _in_head_dim(valid[:, None], d, D, BLOCK_D)
        keys = tl.load(k_rows[:, None] + d[None, :], mask=token_lanes, other=0.0)
        values = tl.load(v_rows[:, None] + d[None, :], mask=token_lanes, other=0.0)
        if FP8_CACHE:  # widened to q's dtype (exact) for the 16-bit dots; in registers when compiled
            keys = widen_e4m3(keys, q.dtype, BIT_TRICK, not INTERPRET)

        scores = _dot(q, tl.trans(keys), None, INTERPRET) * scale_log2
        scores = tl.where(valid[None, :], scores, MASKED_SCORE)
        # max.f32 drops NaN on the GPU (NumPy's keeps it): either way a NaN
        # score reaches the normaliser and acc through exp2(NaN - max) below.
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        # The running max is -inf until a finite score comes (or for good, when every valid
        # score is -inf): then 0 is subtracted, every weight so far is exp2(-inf) = 0, and
        # no -inf - -inf appears.  Otherwise the shift is the max: the same bits as ever.
        shift = tl.where(new_max == -float("inf"), 0.0, new_max)
        rescale = tl.math.exp2(running_max - shift)
        probabilities = tl.where(valid[None, :], tl.math.exp2(scores - shift[:, None]), 0.0)
        if FP8_CACHE:
            # Widened only now: the in-register widening keeps its place in the loop
            # (not pure), so V's 16-bit tile is not live across q.K and the softmax
            # (its shared memory is K's).
            values = widen_e4m3(values, q.dtype, BIT_TRICK, not INTERPRET)
        weights = probabilities.to(values.dtype)
        acc = _dot(weights, values, acc * rescale[:, None], INTERPRET)
        normaliser = normaliser * rescale + tl.sum(probabilities, axis=1)
        running_max = new_max
        valid_tokens += valid.to(tl.int32)

    # With valid tokens a finite normaliser is >= 1; a NaN one gives NaN; a zero one 0 / 0 = NaN and
    # lse -inf.  (The 1.0 stand-ins only keep the interpreter's NumPy quiet: no valid token, acc = 0.)
    has_tokens = tl.sum(valid_tokens, axis=0) > 0
    if SINKS:
        # The head's sink joins the denominator once, in split 0 (the merge adds the splits'
        # denominators): one more logit with no value, in log2 units like the scores.
        sink = tl.load(sinks_ptr + heads, mask=head_ok & (split == 0), other=-float("inf")).to(tl.float32)
        sink = sink * _LOG2_E
        top = tl.maximum(running_max, sink)
        top_shift = tl.where(top == -float("inf"), 0.0, top)
        kept = tl.math.exp2(running_max - top_shift)
        normaliser = normaliser * kept + tl.math.exp2(sink - top_shift)
        acc = acc * kept[:, None]
        running_max = top
    zero_mass = normaliser == 0.0
    out = acc / tl.where(has_tokens, normaliser, 1.0)[:, None]
    if FP8_CACHE:
        # v_scale scales the float32 output once, not every value.
        out = out * tl.load(v_scale_ptr).to(tl.float32)
    # (A zero normaliser is a split with no valid token, or whose scores are all -inf, and
    # no sink: its lse is -inf.)
    lse = tl.where(~zero_mass, running_max + tl.math.log2(tl.where(zero_mass, 1.0, normaliser)), -float("inf"))
    if NATURAL_LSE:  # the row's own lse, returned (one split): natural log
        lse = lse * _LN_2
    at_split = split.to(tl.int64)
    tl.store(o_ptr + at_split * o_ss + row * o_sr + heads[:, None] * o_sh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=head_lanes)
    tl.store(lse_ptr + at_split * lse_ss + row * lse_sr + heads, lse, mask=head_ok)


@dependent
@triton.jit
def sparse_attention_partial_kernel(
    # inputs
    q_ptr,  # [R, QH, D] bf16/fp16
    k_cache_ptr,  # [num_blocks, P, KH, D] q's dtype or fp8 e4m3
    v_cache_ptr,  # [num_blocks, P, KH, D] k_cache's dtype
    token_indices_ptr,  # [R, W] int32/int64
    block_table_ptr,  # [B, max_pages] int32/int64
    token_to_req_ptr,  # [R] int32/int64
    k_scale_ptr, v_scale_ptr,  # [] or [1] each (read only when FP8_CACHE)
    sinks_ptr,  # [QH] float32 (read only when SINKS)
    # outputs: `out` itself (one split) or float32 partial outputs; log2-sum-exp
    o_ptr,  # [R, QH, D] q's dtype, or [S, R, QH, D] float32
    lse_ptr,  # [S, R, QH] float32 (one split, NATURAL_LSE: the returned lse [R, QH], natural log)
    # sizes, strides, scale
    num_blocks, num_requests, table_width, scale_log2,
    q_sr, q_sh, k_sb, k_sp, k_sh, v_sb, v_sp, v_sh, ti_sr, bt_sr,
    o_ss, o_sr, o_sh, lse_ss, lse_sr,
    # constexprs
    GROUP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, WIDTH: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILES_PER_SPLIT: tl.constexpr,
    INTERPRET: tl.constexpr,  # Triton's interpreter: fp32 dots (see _dot), fp8 widened by Triton's cast
    FP8_CACHE: tl.constexpr,  # fp8 e4m3 caches (widened to q's dtype, scales applied)
    BIT_TRICK: tl.constexpr,  # fp8 caches, bf16 q, compiled: fp8.widen_e4m3's integer widening
    SLOT_ROWS: tl.constexpr,  # rows addressed by slot, not by page (AttentionTuning.row_addressing)
    SAME_ROW_STRIDE: tl.constexpr,  # K and V rows share a stride: one slot offset for both
    BLOCK_D: tl.constexpr,  # D padded to a power of two (D itself at power-of-two dims)
    SINKS: tl.constexpr,  # a sink logit per query head joins split 0's denominator
    NATURAL_LSE: tl.constexpr,  # one split and the lse returned: stored as a natural log
):
    """One (row, split, KV head) per program: the split's output (one split) or partial."""
    wait_for_previous_kernel()
    _attend_split(
        q_ptr, k_cache_ptr, v_cache_ptr, token_indices_ptr, block_table_ptr, token_to_req_ptr, k_scale_ptr,
        v_scale_ptr, sinks_ptr, o_ptr, lse_ptr, tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2),
        num_blocks, num_requests, table_width, scale_log2,
        q_sr, q_sh, k_sb, k_sp, k_sh, v_sb, v_sp, v_sh, ti_sr, bt_sr,
        o_ss, o_sr, o_sh, lse_ss, lse_sr,
        GROUP, D, PAGE, WIDTH, BLOCK_M, BLOCK_N, TILES_PER_SPLIT, INTERPRET, FP8_CACHE, BIT_TRICK, SLOT_ROWS,
        SAME_ROW_STRIDE, BLOCK_D, SINKS, NATURAL_LSE)


@triton.jit
def _merge_split(split, lse_at, partial_at, lse_max, no_weight, denominator, merged, head_ok, lanes, lse_ss, o_ss):
    """Fold split ``split`` of the heads ``lse_at`` / ``partial_at`` point at into ``(denominator, merged)``."""
    lse = tl.load(lse_at + split * lse_ss, mask=head_ok, other=-float("inf"), cache_modifier=".cg")
    mass = tl.math.exp2(lse - lse_max)
    # No split has weight: the partials' plain sum (see _merge_splits).
    weight = tl.where(no_weight, 1.0, mass)
    partial = tl.load(partial_at + split * o_ss, mask=lanes, other=0.0, cache_modifier=".cg")
    # A weight-0 split drops out even when its partial is NaN (0 / 0).
    merged += tl.where(weight == 0.0, 0.0, partial * weight)
    return denominator + mass, merged


@triton.jit
def _merge_splits(
    partial_out_ptr,  # [S, R, QH, D] float32
    partial_lse_ptr,  # [S, R, QH] float32: log2-sum-exps
    out_ptr,  # [R, QH, D] bf16/fp16
    lse_out_ptr,  # [R, QH] float32: the rows' lse, natural log (written only when RETURN_LSE)
    row, heads, head_ok,  # the row, its BLOCK_H heads to merge and which of them exist
    o_ss, o_sr, o_sh, lse_ss, lse_sr,  # out's row/head strides are the partials', lse_out's the partial lse's
    BLOCK_H: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
    CHUNKED_SPLITS: tl.constexpr,  # NUM_SPLITS rounded down to a multiple of SPLIT_CHUNK
    BLOCK_D: tl.constexpr, RETURN_LSE: tl.constexpr,
):
    """``out[row, heads]``: the partials weighted by ``2 ** (lse - max lse)``, an exact softmax merge.

    Splits are folded one at a time in the order 0..S-1, element by element
    (no reduction: the max is exact in any order), so the merge gives the
    same bits whatever the chunk of splits.  SPLIT_CHUNK splits are unrolled
    per step, so their loads are in flight together.  Per-head values are
    ``[BLOCK_H, 1]`` columns that Triton lays out like the ``[BLOCK_H, D]``
    tiles they scale, as long as none comes out of a loop (the max pass is
    unrolled): else every split would convert them through shared memory,
    two barriers each.  Loads bypass L1 (``.cg``): each partial is read once.
    """
    d = tl.arange(0, BLOCK_D)
    head_ok = head_ok[:, None]
    lanes = _in_head_dim(head_ok, d, D, BLOCK_D)
    lse_at = partial_lse_ptr + row * lse_sr + heads[:, None]
    lse_max = tl.full((BLOCK_H, 1), -float("inf"), tl.float32)
    for split in tl.static_range(NUM_SPLITS):
        lse_max = tl.maximum(lse_max, tl.load(lse_at + split * lse_ss, mask=head_ok, other=-float("inf"),
                                              cache_modifier=".cg"))
    # No split has weight (lse -inf everywhere): each partial is 0 or NaN; their plain sum is the row.
    # (max.f32 drops a NaN lse on the GPU; its weight is NaN either way.)
    no_weight = lse_max == -float("inf")
    lse_max = tl.where(no_weight, 0.0, lse_max)

    at = row * o_sr + heads[:, None] * o_sh + d[None, :]
    denominator = tl.zeros((BLOCK_H, 1), tl.float32)
    merged = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    for first in range(0, CHUNKED_SPLITS, SPLIT_CHUNK):
        for j in tl.static_range(SPLIT_CHUNK):
            denominator, merged = _merge_split(first + j, lse_at, partial_out_ptr + at, lse_max, no_weight,
                                               denominator, merged, head_ok, lanes, lse_ss, o_ss)
    for split in tl.static_range(CHUNKED_SPLITS, NUM_SPLITS):
        denominator, merged = _merge_split(split, lse_at, partial_out_ptr + at, lse_max, no_weight, denominator,
                                           merged, head_ok, lanes, lse_ss, o_ss)
    if RETURN_LSE:
        # The row's lse: -inf where no split has weight (no valid token and no sink, or
        # every valid score -inf), NaN where a split's is NaN.
        lse = tl.where(no_weight, -float("inf"), lse_max + tl.math.log2(tl.where(no_weight, 1.0, denominator)))
        tl.store(lse_out_ptr + row * lse_sr + heads[:, None], lse * _LN_2, mask=head_ok)
    # The largest split weighs 1, so the denominator is >= 1 unless it is NaN.
    denominator = tl.where(no_weight, 1.0, denominator)
    tl.store(out_ptr + at, (merged / denominator).to(out_ptr.dtype.element_ty), mask=lanes)


@dependent
@triton.jit
def merge_splits_kernel(
    # inputs
    partial_out_ptr,  # [S, R, QH, D] float32
    partial_lse_ptr,  # [S, R, QH] float32: log2-sum-exps
    # outputs (lse_out_ptr the last input, a stand-in, unless RETURN_LSE)
    lse_out_ptr,  # [R, QH] float32: the rows' lse, natural log (written only when RETURN_LSE)
    out_ptr,  # [R, QH, D] bf16/fp16
    # strides (out's row/head strides are the partials')
    o_ss, o_sr, o_sh, lse_ss, lse_sr,
    # constexprs
    D: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_CHUNK: tl.constexpr, CHUNKED_SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr, RETURN_LSE: tl.constexpr,
):
    """The split-K merge, a launch of its own: one program per (row, head)."""
    wait_for_previous_kernel()
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) + tl.arange(0, 1)
    _merge_splits(partial_out_ptr, partial_lse_ptr, out_ptr, lse_out_ptr, row, heads, heads >= 0,
                  o_ss, o_sr, o_sh, lse_ss, lse_sr, 1, D, NUM_SPLITS, SPLIT_CHUNK, CHUNKED_SPLITS, BLOCK_D,
                  RETURN_LSE)


@dependent
@triton.jit
def sparse_attention_fused_merge_kernel(
    # inputs
    q_ptr, k_cache_ptr, v_cache_ptr, token_indices_ptr, block_table_ptr, token_to_req_ptr,
    k_scale_ptr, v_scale_ptr, sinks_ptr,  # as sparse_attention_partial_kernel's
    tickets_in_ptr,  # [R, KH, 2] int32 zeros: tickets_ptr's memory (JAX aliases them; read through tickets_ptr)
    # outputs (lse_out_ptr the last input, a stand-in, unless RETURN_LSE)
    lse_out_ptr,  # [R, QH] float32: the rows' lse, natural log (written only when RETURN_LSE)
    partial_out_ptr,  # [S, R, QH, D] float32 workspace
    partial_lse_ptr,  # [S, R, QH] float32 workspace
    out_ptr,  # [R, QH, D] q's dtype
    tickets_ptr,  # [R, KH, 2] int32: start tickets, then splits published + heads merged; zero again at the end
    # sizes, strides, scale (the partial kernel's, then the tickets' row stride)
    num_blocks, num_requests, table_width, scale_log2,
    q_sr, q_sh, k_sb, k_sp, k_sh, v_sb, v_sp, v_sh, ti_sr, bt_sr,
    o_ss, o_sr, o_sh, lse_ss, lse_sr, tk_sr,
    # constexprs: the partial kernel's, then the merge's
    GROUP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, WIDTH: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILES_PER_SPLIT: tl.constexpr,
    INTERPRET: tl.constexpr, FP8_CACHE: tl.constexpr, BIT_TRICK: tl.constexpr,
    SLOT_ROWS: tl.constexpr, SAME_ROW_STRIDE: tl.constexpr,
    BLOCK_D: tl.constexpr, SINKS: tl.constexpr, NATURAL_LSE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, MERGE_HEADS: tl.constexpr, MERGERS: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr, CHUNKED_SPLITS: tl.constexpr, RETURN_LSE: tl.constexpr,
):
    """Split-K and its merge in one launch: NUM_SPLITS + MERGERS programs per (row, KV head).

    Roles by start ticket (:mod:`.tickets`), not by program id: the first
    NUM_SPLITS programs of a (row, KV head) to start each attend the split
    their ticket names and publish its partial (release); the MERGERS that
    start after them wait (acquire) until every split is published, which
    only waits for programs that started before them, and each merges
    MERGE_HEADS of the group's query heads with the merge launch's code, in
    the fixed order 0..S-1: the merge launch's bits, whatever the schedule.
    The last merger to finish puts both counters back to zero.
    """
    wait_for_previous_kernel()
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    tickets = tickets_ptr + row * tk_sr + kv_head * 2
    role = start_ticket(tickets)
    if role < NUM_SPLITS:
        _attend_split(
            q_ptr, k_cache_ptr, v_cache_ptr, token_indices_ptr, block_table_ptr, token_to_req_ptr, k_scale_ptr,
            v_scale_ptr, sinks_ptr, partial_out_ptr, partial_lse_ptr, row, role, kv_head,
            num_blocks, num_requests, table_width, scale_log2,
            q_sr, q_sh, k_sb, k_sp, k_sh, v_sb, v_sp, v_sh, ti_sr, bt_sr,
            o_ss, o_sr, o_sh, lse_ss, lse_sr,
            GROUP, D, PAGE, WIDTH, BLOCK_M, BLOCK_N, TILES_PER_SPLIT, INTERPRET, FP8_CACHE, BIT_TRICK, SLOT_ROWS,
            SAME_ROW_STRIDE, BLOCK_D, SINKS, NATURAL_LSE)
        publish(tickets + 1)
    else:
        wait_for(tickets + 1, NUM_SPLITS)
        offsets = (role - NUM_SPLITS) * MERGE_HEADS + tl.arange(0, MERGE_HEADS)
        # (_merge_splits reads the partials with .cg: other programs of this launch wrote them.)
        _merge_splits(partial_out_ptr, partial_lse_ptr, out_ptr, lse_out_ptr, row, kv_head * GROUP + offsets,
                      offsets < GROUP, o_ss, o_sr, o_sh, lse_ss, lse_sr, MERGE_HEADS, D, NUM_SPLITS, SPLIT_CHUNK,
                      CHUNKED_SPLITS, BLOCK_D, RETURN_LSE)
        # Every split has published and every merger has drawn its ticket and waited: the
        # last merger to count itself done frees both counters for the next call.
        if finish_ticket(tickets + 1) == NUM_SPLITS + MERGERS - 1:
            tl.store(tickets, 0)
            tl.store(tickets + 1, 0)


def _check_cache_dtypes(check: Checker, q, k_cache, v_cache, k_scale, v_scale) -> bool:
    """Both caches of q's dtype and no scales, or both fp8 e4m3 with both scales: whether fp8."""
    if k_cache.dtype not in (q.dtype, FP8_DTYPE):
        check.fail("k_cache", f"must have {check.owner('q')} dtype {q.dtype} or be {FP8_DTYPE}", k_cache.dtype)
    fp8 = k_cache.dtype == FP8_DTYPE
    if v_cache.dtype != k_cache.dtype:
        like = (f"be {FP8_DTYPE} like {check.name('k_cache')}" if fp8
                else f"have {check.owner('q')} dtype {q.dtype} like {check.name('k_cache')}")
        check.fail("v_cache", f"must {like}", v_cache.dtype)
    check.cache_scales(fp8, k_cache.dtype, dict(k_scale=k_scale, v_scale=v_scale))
    return fp8


def merges_in_launch(rows: int, kv_heads: int, splits: int, tuning: AttentionTuning) -> bool:
    """Whether several splits are merged in their own launch (:func:`sparse_attention_fused_merge_kernel`)
    rather than by a merge launch: ``tuning.fused_merge`` if set, else for at most
    ``tuning.fused_merge_max_programs`` programs (rows x KV heads: decode batches).
    The split count is decided first, so either way the bits are the same."""
    if splits < 2:
        return False
    if tuning.fused_merge is not None:
        return tuning.fused_merge
    return rows * kv_heads <= tuning.fused_merge_max_programs


def _launch_config(rows: int, kv_heads: int, width: int, d: int, tuning: AttentionTuning, fp8: bool = False):
    """``(BLOCK_N, tiles per split, splits, warps, stages)`` from the tuning's table."""
    programs = rows * kv_heads
    for most, tile_bytes, num_warps, num_stages, target_programs in (
            tuning.fp8_launch_table if fp8 else tuning.launch_table):
        if most is None or programs <= most:
            break
    if tuning.tile_bytes is not None:
        tile_bytes = tuning.tile_bytes
    block_n = max(16, min(128, tile_bytes // (2 * d)))
    block_n = min(block_n, max(16, triton.next_power_of_2(width)))
    tiles = max(1, triton.cdiv(width, block_n))
    num_splits = tuning.num_splits
    if num_splits is None:
        wanted = max(1, target_programs // max(1, programs))
        num_splits = 1 << (wanted.bit_length() - 1)
    tiles_per_split = triton.cdiv(tiles, min(num_splits, tiles))
    # Re-derive the count so that no split is empty.
    return block_n, tiles_per_split, triton.cdiv(tiles, tiles_per_split), num_warps, num_stages


@stage(
    arrays=("q", "k_cache", "v_cache", "token_indices", "block_table", "token_to_req", "k_scale",
            "v_scale", "sinks"),
    options=dict(softmax_scale=FINITE_NUMBER.or_none(), return_lse=BOOL),
    results=("out", when("return_lse", "lse")), doc=DOC, returns="Array", tuning=dict(tuning="attention"))
def plan_sparse_paged_attention(
    q: ArrayInfo, k_cache: ArrayInfo, v_cache: ArrayInfo, token_indices: ArrayInfo,
    block_table: ArrayInfo, token_to_req: ArrayInfo, softmax_scale: float | None = None,
    *, tuning: AttentionTuning | None = None,
    k_scale: ArrayInfo | None = None, v_scale: ArrayInfo | None = None,
    sinks: ArrayInfo | None = None, return_lse: bool = False,
) -> Program:
    """Validate stage-4 arguments and describe the launches (see docs/api.md).

    ``tuning`` (default: the current :class:`~qsa_kernels.tuning.AttentionTuning`)
    holds the launch table; its ``num_splits`` forces the split count (tests),
    and ``fused_merge`` / ``fused_merge_max_programs`` decide whether several
    splits are merged in their launch or by a second one (:func:`merges_in_launch`).
    """
    check = Checker(FUNCTION)
    check.rank("q", q, 3, "[R, QH, D]")
    check.rank("k_cache", k_cache, 4, "[num_blocks, P, KH, D] (flash layout)")
    check.rank("v_cache", v_cache, 4, "[num_blocks, P, KH, D] (flash layout)")
    check.dtype("q", q, ("bfloat16", "float16"))
    fp8 = _check_cache_dtypes(check, q, k_cache, v_cache, k_scale, v_scale)
    rows, qh, d = q.shape
    num_blocks, page, kh, cache_d = k_cache.shape
    if d % 16 or not 16 <= d <= MAX_HEAD_DIM:
        check.fail("q", f"must have head dim D a multiple of 16 from 16 to {MAX_HEAD_DIM}", d)
    if cache_d != d:
        check.fail("k_cache", f"must have {check.owner('q')} head dim D = {d}", f"shape {k_cache.shape}")
    if v_cache.shape != k_cache.shape:
        check.fail("v_cache", f"must have {check.owner('k_cache')} shape {k_cache.shape}", f"shape {v_cache.shape}")
    if kh < 1 or qh % kh:
        check.fail("q", f"must have a number of heads QH divisible by {check.owner('k_cache')} KH = {kh}", f"QH = {qh}")
    if page < 1:
        check.fail("k_cache", "must have a page size P >= 1", f"shape {k_cache.shape}")
    check.index_array("token_indices", token_indices, 2, "[R, W]")
    if token_indices.shape[0] != rows:
        check.fail("token_indices", f"must have R = {rows} rows like {check.name('q')}", f"shape {token_indices.shape}")
    check.index_array("block_table", block_table, 2, "[B, max_pages]")
    check.index_vector("token_to_req", token_to_req, rows, "R", like="q")
    if sinks is not None:
        check.array("sinks", sinks, 1, "[QH]", ("float32",))
        if sinks.shape[0] != qh:
            check.fail("sinks", f"must have QH = {qh} entries like {check.name('q')}", f"shape {sinks.shape}")
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    arrays = dict(q=q, k_cache=k_cache, v_cache=v_cache, token_indices=token_indices,
                  block_table=block_table, token_to_req=token_to_req)

    width = token_indices.shape[1]
    group = qh // kh
    block_m = max(16, triton.next_power_of_2(group))
    # Tiles sized by the padded head dim (the lanes the kernel holds): d itself at powers of two.
    block_d = triton.next_power_of_2(d)
    block_n, tiles_per_split, splits, num_warps, num_stages = _launch_config(rows, kh, width, block_d, tuning, fp8)

    # Row addressing by slot (see the kernel) where the caches allow it.
    addressing = tuning.fp8_row_addressing if fp8 else tuning.row_addressing
    slot_rows = (addressing == "slot" and num_blocks * page < 2 ** 31
                 and all(cache.strides[0] == page * cache.strides[1] for cache in (k_cache, v_cache)))

    out = Buffer("out", (rows, qh, d), q.dtype)
    # The log2-sum-exps of one split are the rows' own: returned, as natural
    # logs (NATURAL_LSE), when asked for; several splits' are merged into it.
    lse = Buffer("lse", (rows, qh), "float32")
    natural_lse = return_lse and splits == 1
    partial_lse = lse if natural_lse else Buffer("partial_lse", (splits, rows, qh), "float32")
    if splits == 1:
        partial_out = out  # written directly, no merge
        buffers = (out, partial_lse)
    else:
        partial_out = Buffer("partial_out", (splits, rows, qh, d), "float32")
        buffers = (out, partial_out, partial_lse) + ((lse,) if return_lse else ())
    # Both candidates are contiguous [..., R, QH, D]: only the split stride differs.
    o_sr, o_sh, _ = out.info.strides
    o_ss = rows * qh * d if splits > 1 else 0
    lse_ss, lse_sr = (0, qh) if natural_lse else partial_lse.info.strides[:2]
    results = ("out", "lse") if return_lse else ("out",)

    # Without fp8 caches the scale pointers are stand-ins FP8_CACHE never reads; likewise sinks.
    inputs = tuple(arrays) + (("k_scale", "v_scale") if fp8 else ("q", "q")) + ("sinks" if sinks is not None else "q",)
    # The merges' lse output: the last input (a stand-in never written) unless it is returned.
    lse_out = () if return_lse else ("q",)
    lse_result = (lse.name,) if return_lse else ()
    scalars = dict(
        num_blocks=num_blocks, num_requests=block_table.shape[0], table_width=block_table.shape[1],
        scale_log2=scale * LOG2_E,
        q_sr=q.strides[0], q_sh=q.strides[1],
        k_sb=k_cache.strides[0], k_sp=k_cache.strides[1], k_sh=k_cache.strides[2],
        v_sb=v_cache.strides[0], v_sp=v_cache.strides[1], v_sh=v_cache.strides[2],
        ti_sr=token_indices.strides[0], bt_sr=block_table.strides[0],
        o_ss=o_ss, o_sr=o_sr, o_sh=o_sh, lse_ss=lse_ss, lse_sr=lse_sr,
    )
    constexprs = dict(
        GROUP=group, D=d, PAGE=page, WIDTH=width, BLOCK_M=block_m, BLOCK_N=block_n,
        TILES_PER_SPLIT=tiles_per_split, INTERPRET=runtime.INTERPRETED, FP8_CACHE=fp8,
        BIT_TRICK=bit_trick(fp8, q.dtype), SLOT_ROWS=slot_rows,
        SAME_ROW_STRIDE=k_cache.strides[1] == v_cache.strides[1],
        BLOCK_D=block_d, SINKS=sinks is not None, NATURAL_LSE=natural_lse,
    )
    chunk = min(splits, max(1, tuning.merge_chunk_elements // d))
    merge_constexprs = dict(NUM_SPLITS=splits, SPLIT_CHUNK=chunk, CHUNKED_SPLITS=splits // chunk * chunk,
                            RETURN_LSE=return_lse)
    if merges_in_launch(rows, kh, splits, tuning):
        # One launch: NUM_SPLITS partial programs, then MERGERS merging programs, per
        # (row, KV head), by start ticket.  The tickets start at zero (Buffer.fill, as the
        # ticketed top-k's) and the last merger leaves them at zero.  Splits vary slowest,
        # so that the mergers (the highest program ids) are the last to be scheduled.
        merge_heads = min(tuning.fused_merge_heads, triton.next_power_of_2(group))
        mergers = triton.cdiv(group, merge_heads)
        tickets = Buffer("tickets", (rows, kh, 2), "int32", fill=0, refilled=True)
        launches = (Launch(
            kernel=sparse_attention_fused_merge_kernel, grid=(rows, kh, splits + mergers),
            inputs=inputs + (tickets.name,) + lse_out,
            outputs=lse_result + (partial_out.name, partial_lse.name, out.name, tickets.name),
            scalars=dict(scalars, tk_sr=tickets.info.strides[0]),
            constexprs=dict(constexprs, **merge_constexprs, MERGE_HEADS=merge_heads, MERGERS=mergers),
            num_warps=num_warps, num_stages=num_stages),)
        return Program(FUNCTION, buffers + (tickets,), launches, results)
    # Rows vary fastest (see the table).
    launches = (Launch(
        kernel=sparse_attention_partial_kernel, grid=(rows, splits, kh), inputs=inputs,
        outputs=(partial_out.name, partial_lse.name), scalars=scalars, constexprs=constexprs,
        num_warps=num_warps, num_stages=num_stages),)
    if splits > 1:
        launches += (Launch(
            kernel=merge_splits_kernel,
            grid=(rows, qh),
            inputs=(partial_out.name, partial_lse.name) + lse_out,
            outputs=lse_result + (out.name,),
            scalars=dict(o_ss=o_ss, o_sr=o_sr, o_sh=o_sh, lse_ss=lse_ss, lse_sr=lse_sr),
            constexprs=dict(D=d, BLOCK_D=block_d, **merge_constexprs),
            num_warps=4,
            num_stages=1,
        ),)
    return Program(FUNCTION, buffers, launches, results)

