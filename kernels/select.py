"""Stage 3: selection -- score compressed blocks, keep the top k, expand to tokens.

``select_paged_tokens`` composes the three algorithms of this stage, each in
its own module: :mod:`.score` (``mqa_paged_scores``), :mod:`.topk` (the exact
radix ``topk_blocks``) and :mod:`.expand` (``expand_block_indices``).  It is
one program of score -> top-k -> expand launches over row chunks whose logits
fit a fixed workspace.

**Fused selection** (``SelectTuning.fused``): where each row is scored alone
(decode) and its top-k takes the ticketed path (a few long rows), the three
are one launch, :func:`select_fused_kernel`, of ``SCORERS + SLICES``
programs a row that take their roles by ticket as the ticketed top-k's do:
the first ``SCORERS`` to start each score one tile of columns (the scorer's
tile and warps: the same bits), store it into the logits workspace and fold
it into the group maxima; the others wait for all of them and go on as the
ticketed top-k's compaction programs; the last to finish selects into the
blocks workspace and expands the row's tokens.  The logits still pass
through the workspace (L2-resident at decode sizes: the compaction and the
fallbacks re-read them), so the chunking and its bound are unchanged.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from .expand import EXPAND_OPTIONS, check_token_topk, expand_launches, expand_row_tile, expand_tiling
from .launch import ArrayInfo, Buffer, Launch, Program
from .pdl import dependent, wait_for_previous_kernel
from .stage import stage
from .rows import count_visible_blocks, row_request
from .score import (SCALE_DOC, SCORES_DOC_ARGS, SCORING_OPTIONS, check_key_scale, check_scoring, exact_dot,
                    score_launches, score_row_tile, score_tiling, scorer_arguments)
from .tickets import publish as ticketed_publish, wait_for
from .topk import (order_key, slice_column_view, ticketed_buffers, ticketed_compact_and_select, ticketed_layout,
                   topk_parts, topk_path)
from .tuning import SelectTuning, TopkTuning
from .validate import Checker

SELECT_DOC = f"""\
Score, select the top blocks and expand them to tokens, in one call.

``expand_block_indices(topk_blocks(*mqa_paged_scores(...),
token_topk // compress_ratio), ...)`` with the default score divisor, rows
processed in chunks whose logits fit a fixed workspace (128 MiB; see
``qsa_kernels.tuning.SelectTuning``), with no host
synchronisation.  A decode batch of a few long rows runs as one launch
(``SelectTuning.fused``), bit for bit the three stages' result.

Args:
{SCORES_DOC_ARGS}
    token_topk: selected tokens, a multiple of ``compress_ratio``.
    compress_ratio: tokens per compressed block (positive int).
{SCALE_DOC}

Returns:
    ``[R, token_topk + compress_ratio - 1]`` int32 token indices.
"""


@triton.jit
def _visible_width(token_to_req_ptr, query_positions_ptr, sequence_lengths_ptr, row, num_columns, num_requests,
                   RATIO: tl.constexpr):
    """The columns of the row's top-k: its visible blocks, at most num_columns."""
    _request, _request_ok, length = row_request(token_to_req_ptr, sequence_lengths_ptr, row, True, num_requests)
    position = tl.load(query_positions_ptr + row).to(tl.int64)
    return tl.minimum(count_visible_blocks(position, length, RATIO), num_columns).to(tl.int32)


@dependent
@triton.jit
def select_fused_kernel(
    # inputs
    q_ptr,  # [R, H, D] bf16/fp16/fp32 indexer queries
    k_cache_ptr,  # [num_pages, P, 1, D] compressed keys (bf16/fp16/fp32/fp8 e4m3)
    page_table_ptr,  # [B, W] int32/int64
    token_to_req_ptr,  # [R] int32/int64
    query_positions_ptr,  # [R] int32/int64
    sequence_lengths_ptr,  # [B] int32/int64
    k_scale_ptr,  # [] or [1] float (read only when FP8_KEYS)
    state_in_ptr,  # [rows, STATE] int32 zeros: state_ptr's memory (JAX aliases them; read through state_ptr)
    previous_ptr,  # [R, WIDTH] int32: out of the earlier chunks (the same buffer; unread)
    # outputs (all but out local to the launch: row_begin + i is row i)
    out_ptr,  # [R, WIDTH] int32 token indices (row stride out_sr)
    logits_ptr,  # [rows, C] float32 workspace (row stride lg_sr)
    blocks_ptr,  # [rows, K] int32 workspace: the selected blocks, then -1
    counts_ptr,  # [rows, 2, SLICES] int32: as topk_ticketed_kernel's
    cand_key_ptr,  # [rows, SLICES, REGION] int32: candidate order keys
    cand_col_ptr,  # [rows, SLICES, REGION] int32: their columns
    state_ptr,  # [rows, STATE] int32: tickets, the group maxima; zero again when the row is done
    # sizes, strides, options
    row_begin, num_columns, num_pages, num_requests, table_width,
    q_sr, q_sh, kc_sb, kc_sp, pt_sr, lg_sr, out_sr, score_divisor,
    # the scorer's constexprs, the ticketed top-k's, the expansion's
    HEADS: tl.constexpr, HEADS_P: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, RATIO: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
    FP8_KEYS: tl.constexpr, BIT_TRICK: tl.constexpr, IN_REGISTERS: tl.constexpr, SCORERS: tl.constexpr,
    K: tl.constexpr, SLICES: tl.constexpr, SLICE: tl.constexpr, TILE: tl.constexpr, GROUPS: tl.constexpr,
    REGION: tl.constexpr, CAND_TILE: tl.constexpr, COUNTS_TILE: tl.constexpr,
    BITS: tl.constexpr, BOUND_PASSES: tl.constexpr, SCALED: tl.constexpr, PAD_TILE: tl.constexpr,
    STATE: tl.constexpr, CHUNK: tl.constexpr,
    WIDTH: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """Score, select and expand row ``row_begin + program_id(0)`` by its
    SCORERS + SLICES programs (module docstring, fused selection).

    Roles by start ticket, as in ``topk_ticketed_kernel``: a program waits
    only for programs that started before it, so no schedule deadlocks.
    """
    wait_for_previous_kernel()
    local = tl.program_id(0).to(tl.int64)
    row = row_begin + local
    tickets = state_ptr + local * STATE
    maxima = (tickets + 4).to(tl.pointer_type(tl.uint32))
    role = tl.atomic_add(tickets, 1, sem="relaxed", scope="gpu")
    logits_row = logits_ptr + local * lg_sr
    if FP8_KEYS:
        # keys = stored * k_scale > 0, and relu(k_scale * x) = k_scale * relu(x).  (Not inside
        # the roles' branch: JAX passes score_divisor as a constant, which a branch cannot retype.)
        score_divisor = score_divisor / tl.load(k_scale_ptr).to(tl.float32)
    if role < SCORERS:
        scores, tile_cols, visible = score_row_tile(
            q_ptr, k_cache_ptr, page_table_ptr, token_to_req_ptr, query_positions_ptr, sequence_lengths_ptr,
            row, role * BLOCK_N, num_pages, num_requests, table_width, q_sr, q_sh, kc_sb, kc_sp, pt_sr,
            score_divisor, HEADS, HEADS_P, D, BLOCK_D, PAGE, RATIO, BLOCK_N, UPCAST, FP8_KEYS, BIT_TRICK,
            IN_REGISTERS)
        in_row = tile_cols < num_columns
        tl.store(logits_row + tile_cols, scores, mask=in_row)
        # Group maxima as the ticketed top-k folds them (invisible columns key 0).
        keys = tl.where(tile_cols < tl.minimum(visible, num_columns), order_key(scores), 0)
        tl.atomic_max(maxima + tile_cols % GROUPS, keys, mask=in_row, sem="relaxed", scope="gpu")
        ticketed_publish(tickets + 1)
    else:
        width = _visible_width(token_to_req_ptr, query_positions_ptr, sequence_lengths_ptr, row, num_columns,
                               num_requests, RATIO)
        slice_id = role - SCORERS
        cols = slice_column_view(slice_id, SLICE, TILE, CHUNK)  # TILE = SLICE: held
        wait_for(tickets + 1, SCORERS)
        # (.cg: written by the scorer programs of this launch.)
        raw = tl.load(logits_row + cols, mask=cols < num_columns, other=0.0, cache_modifier=".cg")
        blocks_row = blocks_ptr + local * K
        if ticketed_compact_and_select(logits_row, raw, cols, tickets, maxima, counts_ptr + local * (2 * SLICES),
                                       cand_key_ptr + local * (SLICES * REGION),
                                       cand_col_ptr + local * (SLICES * REGION), blocks_row, width,
                                       num_columns, slice_id, K, SLICES, SLICE, TILE, GROUPS, REGION, CAND_TILE,
                                       COUNTS_TILE, BITS,
                                       BOUND_PASSES, SCALED, PAD_TILE):
            tl.debug_barrier()  # the blocks every thread wrote, visible to every thread
            # (Loaded again here: not held in registers through the selection.)
            _request, _request_ok, length = row_request(token_to_req_ptr, sequence_lengths_ptr, row, True,
                                                        num_requests)
            position = tl.load(query_positions_ptr + row).to(tl.int64)
            for t in tl.static_range((WIDTH + BLOCK_W - 1) // BLOCK_W):
                expand_row_tile(blocks_row, position, length, out_ptr + row * out_sr,
                                t * BLOCK_W + tl.arange(0, BLOCK_W), K, RATIO, WIDTH)



@stage(
    arrays=("q", "k_cache", "page_table", "token_to_req", "query_positions", "sequence_lengths",
            "k_scale"),
    options=dict(SCORING_OPTIONS, **EXPAND_OPTIONS),
    results=("out",), doc=SELECT_DOC, returns="Array", tuning=dict(tuning="select", topk_tuning="topk"))
def plan_select_paged_tokens(q: ArrayInfo, k_cache: ArrayInfo, page_table: ArrayInfo,
                             token_to_req: ArrayInfo, query_positions: ArrayInfo,
                             sequence_lengths: ArrayInfo, token_topk: int, compress_ratio: int, *,
                             tuning: SelectTuning | None = None,
                             topk_tuning: TopkTuning | None = None,
                             k_scale: ArrayInfo | None = None) -> Program:
    """Validate ``select_paged_tokens`` arguments and describe its chunked launches (see docs/api.md).

    Each chunk of rows is scored into one logits workspace, ranked and
    expanded into its rows of ``out``; later chunks reuse every workspace.
    """
    check = Checker("select_paged_tokens")
    check_scoring(check, q, k_cache, page_table, token_to_req, query_positions, sequence_lengths)
    check_token_topk(check, token_topk, compress_ratio)
    fp8_keys = check_key_scale(check, k_cache, k_scale)
    rows = q.shape[0]
    columns = page_table.shape[1] * k_cache.shape[1]
    block_topk = token_topk // compress_ratio
    # Chunks are whole scorer row tiles, so chunking never changes a score.
    tile_rows, _, _ = score_tiling(q, k_cache, page_table, columns, tuning)
    chunk = max(1, tuning.logits_workspace_bytes // (4 * max(columns, 1)) // tile_rows) * tile_rows
    chunk = min(chunk, rows)
    ranges = [(first, min(chunk, rows - first)) for first in range(0, rows, max(chunk, 1))]
    logits = Buffer("logits", (chunk, columns), "float32")
    out = Buffer("out", (rows, token_topk + compress_ratio - 1), "int32")
    stride = logits.info.strides[0]
    divisor = math.sqrt(q.shape[2])
    if _fuses_selection(q, k_cache, page_table, chunk, columns, block_topk, tuning, topk_tuning):
        return _fused_program(q, k_cache, page_table, compress_ratio, columns, block_topk, divisor, ranges,
                              out, logits, fp8_keys, tuning, topk_tuning)
    score = score_launches(q, k_cache, page_table, compress_ratio, columns, divisor, ranges, stride, fp8_keys,
                           tuning)
    topk_buffers, topk = topk_parts(chunk, columns, block_topk, stride, [n for _, n in ranges],
                                    "logits", "visible_blocks", "blocks", topk_tuning)
    expand = expand_launches(block_topk, compress_ratio, max(block_topk, 1), out.shape[1],
                             page_table.shape[0], ranges, "blocks")
    per_chunk = len(topk) // max(len(ranges), 1)
    launches = []
    for i in range(len(ranges)):
        launches += [score[i], *topk[i * per_chunk:(i + 1) * per_chunk], expand[i]]
    buffers = (out, logits, Buffer("visible_blocks", (chunk,), "int32"),
               Buffer("blocks", (chunk, block_topk), "int32")) + topk_buffers
    return Program("select_paged_tokens", buffers, tuple(launches), ("out",))



#: The fused launch's slices stay at most 2048 columns wide (more of them
#: past 32768 columns): 16 keys a thread at 4 warps (the ticketed top-k
#: widens them to 4096 on 16 warps).
FUSED_WIDEST_SLICE = 2048


def _fuses_selection(q, k_cache, page_table, chunk, columns, block_topk, tuning: SelectTuning,
                     topk_tuning: TopkTuning) -> bool:
    """Whether :func:`select_fused_kernel` does a chunk's three launches.

    Up to ``tuning.fused_max_rows`` rows of at most ``fused_max_columns``
    (where it was measured faster), scored alone (decode), whose top-k takes
    the ticketed path, with tensor-core scores of at most 16 heads: a row's
    heads are then the 16 rows of one MMA tile, which no warp count or tile
    width splits, so the fused launch's scores (at ``tuning.fused_warps``)
    have the scorer's bits (at its own warps); the exact fp32 dot's layout,
    or more heads', may split them.
    """
    if not tuning.fused or block_topk == 0 or columns == 0 or columns > tuning.fused_max_columns \
            or chunk > tuning.fused_max_rows:
        return False
    tile_rows, _, _ = score_tiling(q, k_cache, page_table, columns, tuning)
    if exact_dot(q, k_cache) or q.shape[1] > 16 or tile_rows != 1:
        return False
    if topk_path(chunk, columns, block_topk, topk_tuning) != "ticketed":
        return False
    return ticketed_layout(columns, block_topk, topk_tuning, FUSED_WIDEST_SLICE)[1] <= tuning.fused_warps


def _fused_program(q, k_cache, page_table, compress_ratio, columns, block_topk, divisor, ranges, out, logits,
                   fp8_keys, tuning: SelectTuning, topk_tuning: TopkTuning) -> Program:
    """select_paged_tokens as one fused launch a chunk (:func:`select_fused_kernel`)."""
    _, block_n, scalars, score_constexprs, _ = scorer_arguments(
        q, k_cache, page_table, compress_ratio, columns, divisor, fp8_keys, tuning)
    layout, _ = ticketed_layout(columns, block_topk, topk_tuning, FUSED_WIDEST_SLICE)
    chunk = logits.shape[0]
    width, block_w = expand_tiling(block_topk, compress_ratio)
    blocks = Buffer("blocks", (chunk, block_topk), "int32")
    topk_buffers = ticketed_buffers(chunk, layout)
    state, workspaces = topk_buffers[0].name, tuple(buffer.name for buffer in topk_buffers[1:])
    # Tiles at least the scorer's, wider where tuned: the same bits (_fuses_selection, docs/design.md).
    block_n = max(block_n, min(tuning.fused_score_columns, triton.next_power_of_2(columns)))
    scorers = triton.cdiv(columns, block_n)
    launches = tuple(Launch(
        kernel=select_fused_kernel,
        grid=(count, scorers + layout["SLICES"]),
        # Stand-ins FP8_KEYS and the first chunk never read: q.
        inputs=("q", "k_cache", "page_table", "token_to_req", "query_positions", "sequence_lengths",
                "k_scale" if fp8_keys else "q", state, "out" if i else "q"),
        outputs=("out", "logits", "blocks", *workspaces, state),
        scalars=dict(scalars, row_begin=first, lg_sr=logits.info.strides[0], out_sr=out.info.strides[0]),
        constexprs=dict(score_constexprs, BLOCK_N=block_n, SCORERS=scorers, **layout, WIDTH=width,
                        BLOCK_W=block_w),
        num_warps=tuning.fused_warps,
        num_stages=1,
    ) for i, (first, count) in enumerate(ranges))
    buffers = (out, logits, blocks) + topk_buffers
    return Program("select_paged_tokens", buffers, launches, ("out",))
