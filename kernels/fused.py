"""Launches that do several stages' work, bit for bit the stages' own launches.

``compress_rotate_store_kernel`` is the composed step's stage 2 and its
index-query RoPE in one launch (kernels/step.py uses it for steps of at most
``StepTuning.fused_max_rows`` rows).  It is built from the stages' public
``@triton.jit`` helpers (:mod:`.compress`: windows, pooling, cache rows;
:mod:`.fp8`: the writers' quantisation; :mod:`.rope_cache`: rotation pairs,
cos/sin, rotation, query heads), so each piece of arithmetic lives in one
place and the fused launch rounds exactly as the separate ones do.
``rope_compress_store_kernel`` runs stage 1's programs (``rope_cache_program``)
and those programs in one launch (``StepTuning.fuse_rope``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .compress import cache_rows, check_compress_groups, check_store_cache_rows, in_table, pool, window_start, windows
from .fp8 import quantise
from .launch import ArrayInfo, Buffer, Launch, Program, fused_launch
from .pdl import dependent, wait_for_previous_kernel
from .rope_cache import (block_half, check_rope_rows, in_lanes, query_tiles, rope_cache_kernel, rope_cache_program,
                         rope_cos_sin, rope_pairs, rope_query_heads, rotate)
from .stage import stage
from .tuning import RopeCacheTuning
from .validate import BOOL, NONNEGATIVE_INT, POSITIVE_INT, Checker


@dependent
@triton.jit
def compress_rotate_store_kernel(
    # inputs
    raw_keys_ptr,  # [T, 1, D] bf16/fp16/fp32: this step's raw index keys
    ring_ptr,  # [blocks, RING, 1, D] raw_keys' dtype (compressor_state_cache)
    block_table_ptr,  # [>= B, >= 1] int32/int64: column 0, each request's ring block
    token_to_req_ptr,  # [T] int32/int64
    query_start_loc_ptr,  # [B + 1] int32/int64
    positions_ptr,  # [T] int32/int64 (contiguous)
    compressed_slots_ptr,  # [T] int32/int64
    ring_slots_ptr,  # [T] int32/int64 (compressor_state_slots)
    compressed_ptr,  # [pages, CPAGE, 1, D] raw_keys' dtype or fp8 (read only through its alias)
    cos_sin_ptr,  # [max_position, 2*F] raw_keys' dtype or fp32 (index_cos_sin)
    scale_ptr,  # [] or [1] float (QUANTISE; else a stand-in, never read)
    index_q_ptr,  # [T, IH, D] raw_keys' dtype
    # outputs (the caches are the inputs' aliases)
    ring_out_ptr,  # compressor_state_cache
    compressed_out_ptr,  # compressed key cache
    index_q_out_ptr,  # [T, IH, D] index_q's dtype
    # sizes and strides
    T, num_requests, num_ring_blocks, num_ring_slots, num_compressed_slots, max_position, max_row_position,
    raw_sr, ring_sb, ring_sp, table_sr, ck_sb, ck_sp, cs_sr, q_sr, q_sh, qo_sr, qo_sh,
    # constexprs
    D: tl.constexpr, F: tl.constexpr, BLOCK_R: tl.constexpr, RATIO: tl.constexpr, RING: tl.constexpr,
    CPAGE: tl.constexpr, IS_NEOX: tl.constexpr, QUANTISE: tl.constexpr, WIDE_FIRST_POSITIONS: tl.constexpr,
    IH: tl.constexpr, BLOCK_H: tl.constexpr, NUM_Q_TILES: tl.constexpr,
    BLOCK_HALF: tl.constexpr,  # D/2 padded to a power of two (D/2 itself at power-of-two D)
):
    """The composed step's compression stage in one launch (see plan_compress_rotate_store).

    Program 0 holds every row of the step: it pools, rotates and stores the
    compressed keys, then (after a barrier: every ring read is done) stores
    this step's raw keys into the ring.  Program ``1 + t`` rotates index_q's
    row ``t``.  Each value is what the separate launches give, bit for bit:
    the same helpers, the same roundings in the same order.  A row whose
    position is outside ``[0, max_row_position)`` (past the step's cos_sin)
    stores nothing: no compressed key, no ring slot.
    """
    wait_for_previous_kernel()
    compress_rotate_store_program(
        tl.program_id(0), raw_keys_ptr, ring_ptr, block_table_ptr, token_to_req_ptr, query_start_loc_ptr,
        positions_ptr, compressed_slots_ptr, ring_slots_ptr, compressed_ptr, cos_sin_ptr, scale_ptr, index_q_ptr,
        ring_out_ptr, compressed_out_ptr, index_q_out_ptr,
        T, num_requests, num_ring_blocks, num_ring_slots, num_compressed_slots, max_position, max_row_position,
        raw_sr, ring_sb, ring_sp, table_sr, ck_sb, ck_sp, cs_sr, q_sr, q_sh, qo_sr, qo_sh,
        D, F, BLOCK_R, RATIO, RING, CPAGE, IS_NEOX, QUANTISE, WIDE_FIRST_POSITIONS, IH, BLOCK_H, NUM_Q_TILES,
        BLOCK_HALF)


@triton.jit
def compress_rotate_store_program(
    program,  # 0: every row's pooling and stores; 1 + t: index_q's row t
    # compress_rotate_store_kernel's parameters (its signature gives each pointer's shape)
    raw_keys_ptr, ring_ptr, block_table_ptr, token_to_req_ptr, query_start_loc_ptr, positions_ptr,
    compressed_slots_ptr, ring_slots_ptr, compressed_ptr, cos_sin_ptr, scale_ptr, index_q_ptr,
    ring_out_ptr, compressed_out_ptr, index_q_out_ptr,
    T, num_requests, num_ring_blocks, num_ring_slots, num_compressed_slots, max_position, max_row_position,
    raw_sr, ring_sb, ring_sp, table_sr, ck_sb, ck_sp, cs_sr, q_sr, q_sh, qo_sr, qo_sh,
    D: tl.constexpr, F: tl.constexpr, BLOCK_R: tl.constexpr, RATIO: tl.constexpr, RING: tl.constexpr,
    CPAGE: tl.constexpr, IS_NEOX: tl.constexpr, QUANTISE: tl.constexpr, WIDE_FIRST_POSITIONS: tl.constexpr,
    IH: tl.constexpr, BLOCK_H: tl.constexpr, NUM_Q_TILES: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """One program of ``compress_rotate_store_kernel`` (also run by ``rope_compress_store_kernel``)."""
    i, d_a, d_b, freq_a, freq_b = rope_pairs(D, F, IS_NEOX, BLOCK_HALF)
    if program == 0:
        rows = tl.arange(0, BLOCK_R)
        in_batch = rows < T
        rows = rows.to(tl.int64)
        end, start, block, ring_ok, pooled_row = windows(
            token_to_req_ptr, query_start_loc_ptr, positions_ptr, compressed_slots_ptr, block_table_ptr,
            rows, in_batch, num_requests, num_ring_blocks, table_sr, RATIO)
        # compress_groups' pooled rows (in raw_keys' dtype), in rotation pairs.
        half_ok = i < D // 2
        key_dtype = raw_keys_ptr.dtype.element_ty
        pooled_a = pool(raw_keys_ptr, ring_ptr, rows, d_a, half_ok, end, start, block, ring_ok, pooled_row,
                         raw_sr, ring_sb, ring_sp, RATIO, RING).to(key_dtype).to(tl.float32)
        pooled_b = pool(raw_keys_ptr, ring_ptr, rows, d_b, half_ok, end, start, block, ring_ok, pooled_row,
                         raw_sr, ring_sb, ring_sp, RATIO, RING).to(key_dtype).to(tl.float32)
        # RoPE at the window's first position as compress_groups' first_positions[:, 0]
        # holds it (raw_positions' dtype), as stage 1 rotates a query row.
        first = window_start(end, pooled_row, RATIO)
        if not WIDE_FIRST_POSITIONS:
            first = first.to(tl.int32)
        # (Names differ from the other branch's: Triton types a name across both.)
        _first_ok, cos_a, sin_a, cos_b, sin_b = rope_cos_sin(
            cos_sin_ptr, first.to(tl.int64)[:, None], True, in_batch[:, None] & half_ok[None, :], max_position,
            cs_sr, freq_a[None, :], freq_b[None, :], F)
        rotated_a, rotated_b = rotate(pooled_a, pooled_b, cos_a, sin_a, cos_b, sin_b)
        rotated_a = rotated_a.to(key_dtype)
        rotated_b = rotated_b.to(key_dtype)
        # store_cache_rows into the compressed-key cache (rows past the step's cos_sin: none).
        row_ok = in_table(end, max_row_position)
        write, cache_row = cache_rows(compressed_slots_ptr, rows, in_batch, num_compressed_slots, ck_sb, ck_sp, CPAGE)
        write = write & row_ok
        if QUANTISE:
            rotated_a = quantise(rotated_a, scale_ptr, compressed_out_ptr.dtype.element_ty)
            rotated_b = quantise(rotated_b, scale_ptr, compressed_out_ptr.dtype.element_ty)
        pairs_written = in_lanes(write[:, None], i, D // 2, BLOCK_HALF)
        tl.store(compressed_out_ptr + cache_row[:, None] + d_a[None, :], rotated_a, mask=pairs_written)
        tl.store(compressed_out_ptr + cache_row[:, None] + d_b[None, :], rotated_b, mask=pairs_written)
        # Pool first, then overwrite the ring: no thread stores a ring row before
        # every thread's ring loads are done (the loads' values are used above).
        tl.debug_barrier()
        write, ring_row = cache_rows(ring_slots_ptr, rows, in_batch, num_ring_slots, ring_sb, ring_sp, RING)
        write = write & row_ok
        cols = tl.arange(0, 2 * BLOCK_HALF)  # D padded to a power of two
        written = in_lanes(write[:, None], cols, D, 2 * BLOCK_HALF)
        values = tl.load(raw_keys_ptr + rows[:, None] * raw_sr + cols[None, :], mask=written)
        tl.store(ring_out_ptr + ring_row[:, None] + cols[None, :], values, mask=written)
    else:
        # Stage 1's query path over index_q's row t (its heads in tiles of BLOCK_H).
        t = (program - 1).to(tl.int64)
        position = tl.load(positions_ptr + t).to(tl.int64)
        _position_ok, q_cos_a, q_sin_a, q_cos_b, q_sin_b = rope_cos_sin(
            cos_sin_ptr, position, True, i < D // 2, max_position, cs_sr, freq_a, freq_b, F)
        for head_tile in tl.static_range(NUM_Q_TILES):
            rope_query_heads(index_q_ptr, index_q_out_ptr, index_q_out_ptr, t, head_tile, i, d_a, d_b,
                              q_cos_a[None, :], q_sin_a[None, :], q_cos_b[None, :], q_sin_b[None, :],
                              q_sr, q_sh, qo_sr, qo_sh, D, IH, BLOCK_H, False, BLOCK_HALF)


# --- generated by scripts/generate_fused_kernels.py from the parts' kernels: do not edit ---
@dependent
@triton.jit
def rope_compress_store_kernel(
    # inputs: ``rope_cache_kernel``'s (``r_``), then ``compress_rotate_store_kernel``'s (``c_``);
    # each pointer's shape as that kernel's signature gives it
    r_q_ptr, r_k_ptr, r_v_ptr, r_key_cache_ptr, r_value_cache_ptr, r_slot_mapping_ptr, r_positions_ptr,
    r_offsets_ptr, r_cos_sin_ptr, r_k_scale_ptr, r_v_scale_ptr, r_swa_ptr, c_raw_keys_ptr, c_ring_ptr,
    c_block_table_ptr, c_token_to_req_ptr, c_query_start_loc_ptr, c_positions_ptr, c_compressed_slots_ptr,
    c_ring_slots_ptr, c_compressed_ptr, c_cos_sin_ptr, c_scale_ptr, c_index_q_ptr,
    # outputs, in the same order
    r_q_out_ptr, r_k_out_ptr, r_key_cache_out_ptr, r_value_cache_out_ptr, r_zeros_ptr, c_ring_out_ptr,
    c_compressed_out_ptr, c_index_q_out_ptr,
    # each part's program count and its grid's second extent (launch.fused_launch)
    r_programs, r_grid_1, c_programs, c_grid_1,
    # each part's sizes, strides and options
    r_T, r_max_position, r_num_slots, r_swa_len, r_q_sr, r_q_sh, r_k_sr, r_k_sh, r_v_sr, r_v_sh, r_cs_sr, r_qo_sr,
    r_qo_sh, r_ko_sr, r_ko_sh, r_kc_sb, r_kc_sh, r_kc_sd1, r_kc_sd2, r_kc_sp1, r_kc_sp2, r_vc_sb, r_vc_sh,
    r_vc_sd1, r_vc_sd2, r_vc_sp1, r_vc_sp2, c_T, c_num_requests, c_num_ring_blocks, c_num_ring_slots,
    c_num_compressed_slots, c_max_position, c_max_row_position, c_raw_sr, c_ring_sb, c_ring_sp, c_table_sr,
    c_ck_sb, c_ck_sp, c_cs_sr, c_q_sr, c_q_sh, c_qo_sr, c_qo_sh,
    # each part's constexprs
    r_D: tl.constexpr, r_F: tl.constexpr, r_QH: tl.constexpr, r_KH: tl.constexpr, r_BLOCK_H: tl.constexpr,
    r_BLOCK_KH: tl.constexpr, r_NUM_Q_TILES: tl.constexpr, r_PAGE: tl.constexpr, r_IS_NEOX: tl.constexpr,
    r_HAS_OFFSETS: tl.constexpr, r_HAS_SWA: tl.constexpr, r_WRITE_ZEROS: tl.constexpr, r_FP8_CACHE: tl.constexpr,
    r_K_DX: tl.constexpr, r_K_PX: tl.constexpr, r_V_DX: tl.constexpr, r_V_PX: tl.constexpr, r_ROPE: tl.constexpr,
    r_K_SCALED: tl.constexpr, r_V_SCALED: tl.constexpr, r_BLOCK_HALF: tl.constexpr, c_D: tl.constexpr,
    c_F: tl.constexpr, c_BLOCK_R: tl.constexpr, c_RATIO: tl.constexpr, c_RING: tl.constexpr, c_CPAGE: tl.constexpr,
    c_IS_NEOX: tl.constexpr, c_QUANTISE: tl.constexpr, c_WIDE_FIRST_POSITIONS: tl.constexpr, c_IH: tl.constexpr,
    c_BLOCK_H: tl.constexpr, c_NUM_Q_TILES: tl.constexpr, c_BLOCK_HALF: tl.constexpr,
):
    """The composed step's stages 1 and 2 and its index-query RoPE in one launch (plan_rope_compress_store).

    Its first ``r_programs`` programs are ``rope_cache_kernel``'s (its grid
    flattened), the next ``c_programs`` ``compress_rotate_store_kernel``'s:
    the two touch different arrays (the KV caches and q; the index caches
    and index_q), so no order between them is needed, and each program
    computes what it computes in its own launch, bit for bit.
    """
    wait_for_previous_kernel()
    program = tl.program_id(0)
    if program < r_programs:
        rope_cache_program(
            (program // r_grid_1).to(tl.int64), program % r_grid_1, r_q_ptr, r_k_ptr, r_v_ptr, r_key_cache_ptr,
            r_value_cache_ptr, r_slot_mapping_ptr, r_positions_ptr, r_offsets_ptr, r_cos_sin_ptr, r_k_scale_ptr,
            r_v_scale_ptr, r_swa_ptr, r_q_out_ptr, r_k_out_ptr, r_key_cache_out_ptr, r_value_cache_out_ptr,
            r_zeros_ptr, r_T, r_max_position, r_num_slots, r_swa_len, r_q_sr, r_q_sh, r_k_sr, r_k_sh, r_v_sr,
            r_v_sh, r_cs_sr, r_qo_sr, r_qo_sh, r_ko_sr, r_ko_sh, r_kc_sb, r_kc_sh, r_kc_sd1, r_kc_sd2, r_kc_sp1,
            r_kc_sp2, r_vc_sb, r_vc_sh, r_vc_sd1, r_vc_sd2, r_vc_sp1, r_vc_sp2, r_D, r_F, r_QH, r_KH, r_BLOCK_H,
            r_BLOCK_KH, r_NUM_Q_TILES, r_PAGE, r_IS_NEOX, r_HAS_OFFSETS, r_HAS_SWA, r_WRITE_ZEROS, r_FP8_CACHE,
            r_K_DX, r_K_PX, r_V_DX, r_V_PX, r_ROPE, r_K_SCALED, r_V_SCALED, r_BLOCK_HALF)
    else:
        compress_rotate_store_program(
            program - r_programs, c_raw_keys_ptr, c_ring_ptr, c_block_table_ptr, c_token_to_req_ptr,
            c_query_start_loc_ptr, c_positions_ptr, c_compressed_slots_ptr, c_ring_slots_ptr, c_compressed_ptr,
            c_cos_sin_ptr, c_scale_ptr, c_index_q_ptr, c_ring_out_ptr, c_compressed_out_ptr, c_index_q_out_ptr,
            c_T, c_num_requests, c_num_ring_blocks, c_num_ring_slots, c_num_compressed_slots, c_max_position,
            c_max_row_position, c_raw_sr, c_ring_sb, c_ring_sp, c_table_sr, c_ck_sb, c_ck_sp, c_cs_sr, c_q_sr,
            c_q_sh, c_qo_sr, c_qo_sh, c_D, c_F, c_BLOCK_R, c_RATIO, c_RING, c_CPAGE, c_IS_NEOX, c_QUANTISE,
            c_WIDE_FIRST_POSITIONS, c_IH, c_BLOCK_H, c_NUM_Q_TILES, c_BLOCK_HALF)
# --- end of the generated kernels ---


@stage(
    arrays=("raw_keys", "raw_positions", "compressor_state_cache", "compressor_state_block_table",
            "token_to_req", "query_start_loc", "logical_positions", "compressed_slots",
            "compressor_state_slots", "compressed_key_cache", "cos_sin", "index_q", "scale"),
    options=dict(compress_ratio=POSITIVE_INT, is_neox=BOOL, max_row_position=NONNEGATIVE_INT),
    results=("compressor_state_cache", "compressed_key_cache", "index_q_out"), tuning=dict(tuning="rope_cache"),
    rows=dict(index_q_out="index_q"))
def plan_compress_rotate_store(
    raw_keys: ArrayInfo, raw_positions: ArrayInfo,
    compressor_state_cache: ArrayInfo, compressor_state_block_table: ArrayInfo,
    token_to_req: ArrayInfo, query_start_loc: ArrayInfo, logical_positions: ArrayInfo,
    compressed_slots: ArrayInfo, compressor_state_slots: ArrayInfo, compressed_key_cache: ArrayInfo,
    cos_sin: ArrayInfo, index_q: ArrayInfo, compress_ratio: int, is_neox: bool,
    scale: ArrayInfo | None = None, *, max_row_position: int, tuning: RopeCacheTuning | None = None,
) -> Program:
    """The composed step's stage 2 and its index-query RoPE as one launch (kernels/step.py).

    Gives bit for bit what these launches give in turn: ``compress_groups``
    (no ``rope_cache``); ``store_cache_rows`` of the raw keys into the ring at
    ``compressor_state_slots``; RoPE of the pooled keys at
    ``first_positions[:, 0]`` by ``cos_sin`` (stage 1's query path);
    ``store_cache_rows`` of them into ``compressed_key_cache`` at
    ``compressed_slots`` (quantised with ``scale`` into an fp8 cache); and
    RoPE of ``index_q`` at ``logical_positions``; the stores skip every row whose
    position is outside ``[0, max_row_position)`` (the step passes its
    ``cos_sin``'s rows, as ``compress.plan_store_rows_in_table``).  Results:
    ``compressor_state_cache``, ``compressed_key_cache`` (in place) and the
    rotated ``index_q``.

    Not a public stage; it makes the checks of the launches it stands for
    (under the step's names), so the step's errors are the same either
    way.  One program pools every row, so the ring is read
    before it is written whatever the slots (see ``_fuses_compression`` in
    kernels/step.py for when the step uses it).
    """
    # The checks of the launches it stands for, naming their arguments as its own.
    check = Checker("compress_rotate_store")
    rows, d, blocks, ring_size, _ = check_compress_groups(
        check, raw_keys, raw_positions, compressor_state_cache, compressor_state_block_table, token_to_req,
        query_start_loc, logical_positions, compressed_slots, compress_ratio)
    check_store_cache_rows(check.renamed(cache="compressor_state_cache", slot_mapping="compressor_state_slots",
                                         rows="raw_keys"), compressor_state_cache, compressor_state_slots, raw_keys, None)
    # compress_groups' results: the pooled keys, rotated at column 0 of first_positions.
    pooled = ArrayInfo.contiguous(raw_keys.shape, raw_keys.dtype)
    first_positions = ArrayInfo.contiguous((rows, 3), raw_positions.dtype)
    check_rope_rows(check.renamed(x="raw_keys", positions="raw_positions"), pooled, first_positions, cos_sin)
    check_store_cache_rows(check.renamed(cache="compressed_key_cache", slot_mapping="compressed_slots", rows="raw_keys"),
                           compressed_key_cache, compressed_slots, pooled, scale)
    check_rope_rows(check.renamed(x="index_q", positions="logical_positions"), index_q, logical_positions, cos_sin)
    ring = compressor_state_cache
    blocks, ring_size = ring.shape[:2]
    pages, page = compressed_key_cache.shape[:2]
    heads = index_q.shape[1]
    block_h, num_q_tiles = query_tiles(heads, d, tuning.tile_elements)
    block_r = triton.next_power_of_2(rows)
    index_q_out = Buffer("index_q_out", index_q.shape, index_q.dtype)
    iq_sr, iq_sh, _ = index_q_out.info.strides
    launch = Launch(
        kernel=compress_rotate_store_kernel,
        grid=(1 + rows,),
        inputs=("raw_keys", "compressor_state_cache", "compressor_state_block_table", "token_to_req",
                "query_start_loc", "logical_positions", "compressed_slots", "compressor_state_slots",
                "compressed_key_cache", "cos_sin",
                # Without a scale: a stand-in pointer QUANTISE never reads.
                "scale" if scale is not None else "cos_sin", "index_q"),
        outputs=("compressor_state_cache", "compressed_key_cache", "index_q_out"),
        scalars=dict(
            T=rows, num_requests=query_start_loc.shape[0] - 1, num_ring_blocks=blocks,
            num_ring_slots=blocks * ring_size, num_compressed_slots=pages * page, max_position=cos_sin.shape[0],
            max_row_position=max_row_position,
            raw_sr=raw_keys.strides[0], ring_sb=ring.strides[0], ring_sp=ring.strides[1],
            table_sr=compressor_state_block_table.strides[0], ck_sb=compressed_key_cache.strides[0],
            ck_sp=compressed_key_cache.strides[1], cs_sr=cos_sin.strides[0],
            q_sr=index_q.strides[0], q_sh=index_q.strides[1], qo_sr=iq_sr, qo_sh=iq_sh),
        constexprs=dict(D=d, F=cos_sin.shape[1] // 2, BLOCK_R=block_r, RATIO=compress_ratio, RING=ring_size,
                        CPAGE=page, IS_NEOX=is_neox, QUANTISE=scale is not None,
                        WIDE_FIRST_POSITIONS=raw_positions.dtype == "int64",
                        IH=heads, BLOCK_H=block_h, NUM_Q_TILES=num_q_tiles, BLOCK_HALF=block_half(d)),
        # Program 0's tile is [BLOCK_R, BLOCK_HALF] twice, RATIO member loads of each in flight.
        num_warps=min(8, max(1, block_r * 2 * block_half(d) // 512)),
        num_stages=1,
    )
    return Program("compress_rotate_store", (index_q_out,), (launch,),
                   ("compressor_state_cache", "compressed_key_cache", "index_q_out"))


def rope_compress_store(rope: Launch, compression: Launch) -> Launch:
    """Stage 1's launch (``rope_cache_kernel``) and ``compress_rotate_store``'s as one launch of
    ``rope_compress_store_kernel`` (kernels/step.py: ``StepTuning.fuse_rope``)."""
    if rope.kernel is not rope_cache_kernel or compression.kernel is not compress_rotate_store_kernel:
        raise ValueError(f"rope_compress_store: got launches of {rope.kernel} and {compression.kernel}")
    return fused_launch(rope_compress_store_kernel, (("r_", rope), ("c_", compression)),
                        num_warps=max(rope.num_warps, compression.num_warps))
