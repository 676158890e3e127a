"""Stage 1: RoPE on q and k, and k/v written into a paged KV cache.

One program handles one token row and either a tile of query heads or all
KV heads of that row, so every byte of q, k and v is read once and the row's
cos/sin once per program.  The cache address of element ``d`` of a KV head
at (page, offset) is, for every layout,

    page * SB + head * SH + (d // DX) * SD1 + (d % DX) * SD2
                          + (offset // PX) * SP1 + (offset % PX) * SP2

with (DX, PX) constexprs, DX a power of two; the plan derives the six strides
and two splits from the cache shapes, so one code path serves the flash,
paged and shuffled-value layouts.

Any even head dim D: a program's rotation pairs are a tile of ``BLOCK_HALF``
lanes, D/2 padded to a power of two (``BLOCK_HALF = D/2`` at a power-of-two
D, where every mask of the padding folds away: the same code as unpadded).
Padded lanes are never loaded nor stored (:func:`in_lanes`, :func:`load_lanes`).
"""

from __future__ import annotations

import dataclasses

import triton
import triton.language as tl

from .fp8 import quantise
from .launch import ArrayInfo, Buffer, Launch, Program
from .pdl import dependent, wait_for_previous_kernel
from .stage import stage, when
from .tuning import RopeCacheTuning
from .validate import BOOL, FLOAT_DTYPES, FP8_DTYPE, INDEX_DTYPES, Checker

FUNCTION = "rope_reshape_and_cache"
DOC = """\
Apply RoPE to q and k and write k and v into a paged KV cache.

Args:
    q: ``[T, QH, D]`` bf16, fp16 or fp32; D any even head dim >= 2.
    k, v: ``[T_kv, KH, D]`` of q's dtype, ``T_kv >= T`` and ``QH % KH == 0``.
        Rows ``t >= T`` are KV-only: written to the cache without RoPE.
    key_cache, value_cache: flash ``[num_blocks, P, KH, D]`` (both), or paged
        ``[num_blocks, KH, D//X, P, X]`` keys (X a power of two dividing D)
        with ``[num_blocks, KH, D, P]`` or shuffled
        ``[num_blocks, KH, P//X, D, X]`` values; of k's dtype or
        ``float8_e4m3fn``.[torch:  Updated in place.][jax:  Returned as new
        arrays aliasing the inputs: donate them (``donate_argnums``) under
        ``jax.jit`` for an in-place update with no copy.]
    slot_mapping: ``[T_kv]`` int32/int64 cache slots (page ``s // P``, offset
        ``s % P``); ``-1`` and out-of-range slots are skipped.
    positions: ``[T]`` int32/int64 rotary positions.
    cos_sin: ``[max_position, 2*F]``, cos then sin, ``F`` = D/2 or D; q's
        dtype or fp32.  A position outside its rows gives NaN ``q_out`` and
        ``k_out`` rows and no cache write.  ``None`` (still positional): q and
        k arrive rotated; no table is read, bit for bit an identity table (cos
        1, sin 0) covering every non-negative position.
    is_neox: NeoX (split halves) if true, GPT-J (interleaved pairs) if false.
    k_scale, v_scale: 0-d / 1-element float scales, as the source takes them.
        ``float8_e4m3fn`` caches need both: k and v are divided by them in
        float32 (correctly rounded) before the cast to fp8, which saturates
        finite values and +-inf at +-448 and keeps NaN a NaN.  Other caches
        take each optionally and store ``x * (1 / scale)`` (float32), which
        no reader undoes.  Valid scales (finite, > 0) are the caller's
        contract: device values are never checked (no host synchronisation).
    offsets: optional ``[T]`` added to ``positions``.
    swa_slot_mapping: optional table: the final slot is
        ``swa_slot_mapping[slot_mapping[t]]``.
    return_zeros: also return a zero array shaped like q.

Returns:
    ``(q_out [T, QH, D], k_out [T_kv, KH, D], key_cache, value_cache)`` and,
    with ``return_zeros``, ``zeros`` last.  ``k_out`` holds rotated k for
    rows ``t < T`` (whatever their slot) and k unchanged for KV-only rows.
"""

@triton.jit
def in_lanes(mask, lanes, N: tl.constexpr, BLOCK_N: tl.constexpr):
    """``mask`` (``[X, 1]`` or ``[X, BLOCK_N]``) restricted to the lanes ``lanes < N`` of a tile
    padded to ``BLOCK_N`` lanes; where nothing is padded (``BLOCK_N == N``) ``mask`` itself: the
    same code as unpadded (as attention's ``_in_head_dim``)."""
    if BLOCK_N != N:
        mask = mask & (lanes < N)[None, :]
    return mask


@triton.jit
def load_lanes(ptrs, lanes, N: tl.constexpr, BLOCK_N: tl.constexpr):
    """``tl.load(ptrs)`` of ``[X, BLOCK_N]`` addresses whose lanes ``lanes >= N`` are padding:
    those are not read (0); unmasked where nothing is padded."""
    if BLOCK_N != N:
        x = tl.load(ptrs, mask=(lanes < N)[None, :], other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _rotate_pair(x_row, i, d_a, d_b, cos_a, sin_a, cos_b, sin_b, D: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Load the rotation pairs (a, b) of rows ``x_row`` and rotate them.

    NeoX pairs element i with i + D/2, GPT-J pairs 2i with 2i + 1; either way
    (a, b) -> (a cos_a - b sin_a, b cos_b + a sin_b).  Returns the loaded pair
    and the rotated pair, all [rows, BLOCK_HALF] float32 (padded lanes: not read).
    """
    a = load_lanes(x_row + d_a[None, :], i, D // 2, BLOCK_HALF).to(tl.float32)
    b = load_lanes(x_row + d_b[None, :], i, D // 2, BLOCK_HALF).to(tl.float32)
    rot_a, rot_b = rotate(a, b, cos_a, sin_a, cos_b, sin_b)
    return a, b, rot_a, rot_b


@triton.jit
def rotate(a, b, cos_a, sin_a, cos_b, sin_b):
    """The rotation of float32 pairs (a, b): (a cos_a - b sin_a, b cos_b + a sin_b).

    The one place of RoPE's arithmetic: stage 1 and the composed step's fused
    compression launch (kernels/fused.py) round identically through it.
    The fused multiply-adds are explicit: left to LLVM's contraction, which
    product gets fused depends on the surrounding code, and the two kernels
    differed in the last bit on the H200 (float32 keys).
    """
    return tl.fma(a, cos_a, -(b * sin_a)), tl.fma(b, cos_b, a * sin_b)


@triton.jit
def rope_pairs(D: tl.constexpr, F: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """``(i, d_a, d_b, freq_a, freq_b)``, each ``[BLOCK_HALF]``: element ``d_a[i]`` rotates with
    ``d_b[i]`` (contiguous halves for NeoX, neighbours for GPT-J), by the table's
    frequency columns ``freq_a[i]`` / ``freq_b[i]`` (``F == D``: one per element).

    ``BLOCK_HALF`` is D/2 padded to a power of two: lanes ``i >= D/2`` are padding,
    addressing nothing of the head dim; mask every access with :func:`in_lanes` /
    :func:`load_lanes` (``i``, ``D // 2``, ``BLOCK_HALF``).
    """
    HALF: tl.constexpr = D // 2
    i = tl.arange(0, BLOCK_HALF)
    if IS_NEOX:
        d_a = i
        d_b = i + HALF
    else:
        d_a = 2 * i
        d_b = 2 * i + 1
    if F == D:  # one frequency per element
        freq_a = d_a
        freq_b = d_b
    else:  # one frequency per pair
        freq_a = i
        freq_b = i
    return i, d_a, d_b, freq_a, freq_b


@triton.jit
def rope_cos_sin(cos_sin_ptr, position, position_ok, read, max_position, cs_sr, freq_a, freq_b,
                  F: tl.constexpr):
    """``(position_ok, cos_a, sin_a, cos_b, sin_b)`` float32 of the table row at ``position``.

    ``position`` is int64, a scalar (cos/sin come out shaped like ``freq_a``)
    or ``[R, 1]`` with ``freq_a`` of ``[1, BLOCK_HALF]`` (``[R, BLOCK_HALF]``);
    ``read`` masks the loads (it excludes :func:`rope_pairs`' padded lanes).
    A position outside the table is never read: its cos/sin are NaN (so are
    its rotated rows) and ``position_ok`` is false.
    """
    position_ok = position_ok & (position >= 0) & (position < max_position)
    table_row = cos_sin_ptr + tl.where(position_ok, position, 0) * cs_sr
    read = read & position_ok
    nan = float("nan")
    cos_a = tl.load(table_row + freq_a, mask=read, other=nan).to(tl.float32)
    sin_a = tl.load(table_row + F + freq_a, mask=read, other=nan).to(tl.float32)
    cos_b = tl.load(table_row + freq_b, mask=read, other=nan).to(tl.float32)
    sin_b = tl.load(table_row + F + freq_b, mask=read, other=nan).to(tl.float32)
    return position_ok, cos_a, sin_a, cos_b, sin_b


@triton.jit
def identity_cos_sin(position, position_ok, read, max_position):
    """:func:`rope_cos_sin` of an identity table (cos 1, sin 0) of ``max_position`` rows, read
    from no table (``cos_sin=None``: q and k arrive rotated).  ``read`` has the cos/sin shape.

    The same values where a table would be read (NaN outside it), so the rotation that
    follows rounds exactly as with an identity table: ``cos_sin=None`` is bitwise such a table.
    """
    position_ok = position_ok & (position >= 0) & (position < max_position)
    read = read & position_ok
    nan = float("nan")
    cos = tl.where(read, 1.0, nan)
    sin = tl.where(read, 0.0, nan)
    return position_ok, cos, sin, cos, sin


@triton.jit
def _cache_offsets(page, offset, heads, d, SB, SH, SD1, SD2, SP1, SP2,
                   DX: tl.constexpr, PX: tl.constexpr):
    row = page * SB + (offset // PX) * SP1 + (offset % PX) * SP2
    return row + heads[:, None] * SH + (d[None, :] // DX) * SD1 + (d[None, :] % DX) * SD2


@triton.jit
def _to_cache(x, scale_ptr, dtype: tl.constexpr, FP8_CACHE: tl.constexpr, SCALED: tl.constexpr):
    """float32 ``x`` as the cache stores it: quantised (fp8 caches); times ``1 / scale``
    (``SCALED``: a 16/32-bit cache given a scale, as the source's ``apply_scale``); or as it is."""
    if FP8_CACHE:
        stored = quantise(x, scale_ptr, dtype)
    elif SCALED:
        # The source's k * (1 / k_scale), both in float32; the reciprocal correctly rounded
        # (div_rn: ``/`` is div.full.f32 on the GPU, see fp8.quantise).
        reciprocal = tl.math.div_rn(tl.full((), 1.0, tl.float32), tl.load(scale_ptr).to(tl.float32))
        stored = (x * reciprocal).to(dtype)
    else:
        stored = x.to(dtype)
    return stored


@dependent
@triton.jit
def rope_cache_kernel(
    # inputs
    q_ptr,  # [T, QH, D] bf16/fp16/fp32
    k_ptr,  # [T_kv, KH, D] q's dtype
    v_ptr,  # [T_kv, KH, D] q's dtype
    key_cache_ptr,  # flash [pages, P, KH, D] or paged [pages, KH, D//X, P, X]; k's dtype or fp8
    value_cache_ptr,  # flash [pages, P, KH, D], paged [pages, KH, D, P] or shuffled [pages, KH, P//X, D, X]
    slot_mapping_ptr,  # [T_kv] int32/int64
    positions_ptr,  # [T] int32/int64
    offsets_ptr,  # [T] int32/int64 (HAS_OFFSETS; else a stand-in, never read)
    cos_sin_ptr,  # [max_position, 2*F] q's dtype or fp32 (ROPE; else a stand-in, never read)
    k_scale_ptr,  # 0-d / [1] float (FP8_CACHE or K_SCALED; else a stand-in)
    v_scale_ptr,  # 0-d / [1] float (FP8_CACHE or V_SCALED; else a stand-in)
    swa_ptr,  # [num_swa_slots] int32/int64 (HAS_SWA; else a stand-in)
    # outputs (the caches are the inputs' aliases)
    q_out_ptr,  # [T, QH, D] q's dtype
    k_out_ptr,  # [T_kv, KH, D] k's dtype
    key_cache_out_ptr,  # key_cache
    value_cache_out_ptr,  # value_cache
    zeros_ptr,  # [T, QH, D] q's dtype (WRITE_ZEROS; else [1], never written)
    # sizes and strides
    T, max_position, num_slots, swa_len,
    q_sr, q_sh, k_sr, k_sh, v_sr, v_sh, cs_sr, qo_sr, qo_sh, ko_sr, ko_sh,
    kc_sb, kc_sh, kc_sd1, kc_sd2, kc_sp1, kc_sp2,
    vc_sb, vc_sh, vc_sd1, vc_sd2, vc_sp1, vc_sp2,
    # constexprs
    D: tl.constexpr, F: tl.constexpr, QH: tl.constexpr, KH: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_KH: tl.constexpr, NUM_Q_TILES: tl.constexpr,
    PAGE: tl.constexpr, IS_NEOX: tl.constexpr, HAS_OFFSETS: tl.constexpr,
    HAS_SWA: tl.constexpr, WRITE_ZEROS: tl.constexpr,
    FP8_CACHE: tl.constexpr,  # fp8 e4m3 caches, k_scale and v_scale given: fp8.quantise
    K_DX: tl.constexpr, K_PX: tl.constexpr, V_DX: tl.constexpr, V_PX: tl.constexpr,
    ROPE: tl.constexpr,  # cos_sin given; else q and k arrive rotated (an identity table, no reads)
    K_SCALED: tl.constexpr, V_SCALED: tl.constexpr,  # a 16/32-bit cache's given scale: x * (1 / scale)
    BLOCK_HALF: tl.constexpr,  # D/2 padded to a power of two (D/2 itself at power-of-two D)
):
    wait_for_previous_kernel()
    rope_cache_program(
        tl.program_id(0).to(tl.int64), tl.program_id(1),
        q_ptr, k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr, positions_ptr, offsets_ptr,
        cos_sin_ptr, k_scale_ptr, v_scale_ptr, swa_ptr, q_out_ptr, k_out_ptr, key_cache_out_ptr,
        value_cache_out_ptr, zeros_ptr, T, max_position, num_slots, swa_len, q_sr, q_sh, k_sr, k_sh, v_sr,
        v_sh, cs_sr, qo_sr, qo_sh, ko_sr, ko_sh, kc_sb, kc_sh, kc_sd1, kc_sd2, kc_sp1, kc_sp2, vc_sb, vc_sh,
        vc_sd1, vc_sd2, vc_sp1, vc_sp2, D, F, QH, KH, BLOCK_H, BLOCK_KH, NUM_Q_TILES, PAGE, IS_NEOX,
        HAS_OFFSETS, HAS_SWA, WRITE_ZEROS, FP8_CACHE, K_DX, K_PX, V_DX, V_PX, ROPE, K_SCALED, V_SCALED, BLOCK_HALF)


@triton.jit
def rope_cache_program(
    t, head_tile,  # the program: row t (int64), its query-head tile (NUM_Q_TILES: its KV heads)
    # rope_cache_kernel's parameters (its signature gives each pointer's shape)
    q_ptr, k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr, positions_ptr, offsets_ptr,
    cos_sin_ptr, k_scale_ptr, v_scale_ptr, swa_ptr, q_out_ptr, k_out_ptr, key_cache_out_ptr,
    value_cache_out_ptr, zeros_ptr, T, max_position, num_slots, swa_len, q_sr, q_sh, k_sr, k_sh, v_sr,
    v_sh, cs_sr, qo_sr, qo_sh, ko_sr, ko_sh, kc_sb, kc_sh, kc_sd1, kc_sd2, kc_sp1, kc_sp2, vc_sb, vc_sh,
    vc_sd1, vc_sd2, vc_sp1, vc_sp2,
    D: tl.constexpr, F: tl.constexpr, QH: tl.constexpr, KH: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_KH: tl.constexpr, NUM_Q_TILES: tl.constexpr, PAGE: tl.constexpr, IS_NEOX: tl.constexpr,
    HAS_OFFSETS: tl.constexpr, HAS_SWA: tl.constexpr, WRITE_ZEROS: tl.constexpr, FP8_CACHE: tl.constexpr,
    K_DX: tl.constexpr, K_PX: tl.constexpr, V_DX: tl.constexpr, V_PX: tl.constexpr,
    ROPE: tl.constexpr, K_SCALED: tl.constexpr, V_SCALED: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """One program of ``rope_cache_kernel`` (also run by ``fused.rope_compress_store_kernel``)."""
    is_query_tile = head_tile < NUM_Q_TILES
    # Query tiles of KV-only rows (t >= T) have nothing to do.
    if (t < T) | (head_tile == NUM_Q_TILES):
        i, d_a, d_b, freq_a, freq_b = rope_pairs(D, F, IS_NEOX, BLOCK_HALF)
        rope_row = t < T
        position = tl.load(positions_ptr + t, mask=rope_row, other=0).to(tl.int64)
        position_ok = True
        if HAS_OFFSETS:
            offset = tl.load(offsets_ptr + t, mask=rope_row, other=0).to(tl.int64)
            total = position + offset
            # An int64 sum that wrapped has the opposite sign of both terms.
            position_ok = ~((position < 0) == (offset < 0)) | ((total < 0) == (position < 0))
            position = total
        # A position outside the table is never read: its rows come out NaN.
        if ROPE:
            position_ok, cos_a, sin_a, cos_b, sin_b = rope_cos_sin(
                cos_sin_ptr, position, position_ok, (i < D // 2) & rope_row, max_position, cs_sr, freq_a, freq_b,
                F)
        else:
            position_ok, cos_a, sin_a, cos_b, sin_b = identity_cos_sin(
                position, position_ok, (i < D // 2) & rope_row, max_position)
        cos_a, sin_a, cos_b, sin_b = cos_a[None, :], sin_a[None, :], cos_b[None, :], sin_b[None, :]

        if is_query_tile:
            rope_query_heads(q_ptr, q_out_ptr, zeros_ptr, t, head_tile, i, d_a, d_b,
                              cos_a, sin_a, cos_b, sin_b, q_sr, q_sh, qo_sr, qo_sh,
                              D, QH, BLOCK_H, WRITE_ZEROS, BLOCK_HALF)
        else:
            # The KV heads: k rotated (KV-only rows t >= T: as it is) into k_out; k and v cached.
            heads = tl.arange(0, BLOCK_KH)
            head_ok = (heads < KH)[:, None]
            head_mask = in_lanes(head_ok, i, D // 2, BLOCK_HALF)
            safe_heads = tl.minimum(heads, KH - 1)
            k_row = k_ptr + t * k_sr + safe_heads[:, None] * k_sh
            k_in_a, k_in_b, k_rot_a, k_rot_b = _rotate_pair(k_row, i, d_a, d_b, cos_a, sin_a, cos_b, sin_b, D,
                                                            BLOCK_HALF)
            k_a = tl.where(rope_row, k_rot_a, k_in_a)
            k_b = tl.where(rope_row, k_rot_b, k_in_b)
            k_out_row = k_out_ptr + t * ko_sr + heads[:, None] * ko_sh
            tl.store(k_out_row + d_a[None, :], k_a.to(k_out_ptr.dtype.element_ty), mask=head_mask)
            tl.store(k_out_row + d_b[None, :], k_b.to(k_out_ptr.dtype.element_ty), mask=head_mask)

            slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
            if HAS_SWA:
                # -1 is skipped before the lookup; values past the table are skipped too.
                in_table = (slot >= 0) & (slot < swa_len)
                slot = tl.load(swa_ptr + tl.where(in_table, slot, 0), mask=in_table, other=-1).to(tl.int64)
            if (slot >= 0) & (slot < num_slots) & (position_ok | (t >= T)):
                page = slot // PAGE
                page_offset = slot % PAGE
                cache_dtype = key_cache_out_ptr.dtype.element_ty
                tl.store(key_cache_out_ptr + _cache_offsets(
                    page, page_offset, heads, d_a, kc_sb, kc_sh, kc_sd1, kc_sd2, kc_sp1, kc_sp2, K_DX, K_PX),
                    _to_cache(k_a, k_scale_ptr, cache_dtype, FP8_CACHE, K_SCALED), mask=head_mask)
                tl.store(key_cache_out_ptr + _cache_offsets(
                    page, page_offset, heads, d_b, kc_sb, kc_sh, kc_sd1, kc_sd2, kc_sp1, kc_sp2, K_DX, K_PX),
                    _to_cache(k_b, k_scale_ptr, cache_dtype, FP8_CACHE, K_SCALED), mask=head_mask)
                d = tl.arange(0, 2 * BLOCK_HALF)  # D padded to a power of two
                v_row = v_ptr + t * v_sr + safe_heads[:, None] * v_sh
                v = load_lanes(v_row + d[None, :], d, D, 2 * BLOCK_HALF).to(tl.float32)
                tl.store(value_cache_out_ptr + _cache_offsets(
                    page, page_offset, heads, d, vc_sb, vc_sh, vc_sd1, vc_sd2, vc_sp1, vc_sp2, V_DX, V_PX),
                    _to_cache(v, v_scale_ptr, cache_dtype, FP8_CACHE, V_SCALED),
                    mask=in_lanes(head_ok, d, D, 2 * BLOCK_HALF))


@triton.jit
def rope_query_heads(q_ptr, q_out_ptr, zeros_ptr, t, head_tile, i, d_a, d_b,
                      cos_a, sin_a, cos_b, sin_b, q_sr, q_sh, qo_sr, qo_sh,
                      D: tl.constexpr, QH: tl.constexpr, BLOCK_H: tl.constexpr, WRITE_ZEROS: tl.constexpr,
                      BLOCK_HALF: tl.constexpr):
    """Rotate query heads ``head_tile * BLOCK_H + [0, BLOCK_H)`` of row ``t`` (:func:`rope_pairs`'
    lanes ``i``, ``d_a``, ``d_b``; cos/sin ``[1, BLOCK_HALF]``) into ``q_out``, and zeros."""
    heads = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = in_lanes((heads < QH)[:, None], i, D // 2, BLOCK_HALF)
    q_row = q_ptr + t * q_sr + tl.minimum(heads, QH - 1)[:, None] * q_sh
    _, _, out_a, out_b = _rotate_pair(q_row, i, d_a, d_b, cos_a, sin_a, cos_b, sin_b, D, BLOCK_HALF)
    out_row = q_out_ptr + t * qo_sr + heads[:, None] * qo_sh
    tl.store(out_row + d_a[None, :], out_a.to(q_out_ptr.dtype.element_ty), mask=head_mask)
    tl.store(out_row + d_b[None, :], out_b.to(q_out_ptr.dtype.element_ty), mask=head_mask)
    if WRITE_ZEROS:
        zeros_row = zeros_ptr + t * qo_sr + heads[:, None] * qo_sh
        zero = tl.zeros(out_a.shape, dtype=zeros_ptr.dtype.element_ty)
        tl.store(zeros_row + d_a[None, :], zero, mask=head_mask)
        tl.store(zeros_row + d_b[None, :], zero, mask=head_mask)


def _cache_geometry(check: Checker, key: ArrayInfo, value: ArrayInfo, kh: int, d: int):
    """Layout name, page size, number of pages and the address terms of both caches.

    Returns ``(layout, page, pages, key_terms, value_terms)`` where each terms
    tuple is ``(SB, SH, SD1, SD2, SP1, SP2, DX, PX)``.  ``DX``: the paged keys' X
    (dividing D), else D's lanes padded to a power of two (no division in the kernel).
    """
    lanes = triton.next_power_of_2(d)
    check.ranks("key_cache", key, (4, 5), "[num_blocks, P, KH, D] (flash) or [num_blocks, KH, D//X, P, X] (paged)")
    if key.ndim == 4:
        check.rank("value_cache", value, 4, f"[num_blocks, P, KH, D] like a flash {check.name('key_cache')}")
        pages, page, cache_kh, cache_d = key.shape
        if value.shape != key.shape:
            check.fail("value_cache", f"must have {check.owner('key_cache')} shape {key.shape} (flash layout)", f"shape {value.shape}")
        k_s, v_s = key.strides, value.strides
        key_terms = (k_s[0], k_s[2], 0, k_s[3], 0, k_s[1], lanes, page)
        value_terms = (v_s[0], v_s[2], 0, v_s[3], 0, v_s[1], lanes, page)
        layout = "flash"
    else:
        pages, cache_kh, dx, page, x = key.shape
        check.power_of_two("key_cache", x, "X (its last dimension)")
        if d % x:
            check.fail("key_cache", f"cannot hold head dim D = {d} in the paged layout [num_blocks, KH, D//X, P, X]: "
                       "X (its last dimension) must divide D", f"X = {x}")
        if dx * x != d:
            check.fail("key_cache", f"must have D//X * X = D = {d} (dimensions 2 and 4)", f"shape {key.shape}")
        cache_d = d
        k_s, v_s = key.strides, value.strides
        key_terms = (k_s[0], k_s[1], k_s[2], k_s[4], 0, k_s[3], x, page)
        if value.ndim == 4:
            expected = (pages, kh, d, page)
            check.shape("value_cache", value, expected, f"[num_blocks, KH, D, P] for a paged {check.name('key_cache')}")
            value_terms = (v_s[0], v_s[1], 0, v_s[2], 0, v_s[3], lanes, page)
            layout = "paged"
        elif value.ndim == 5:
            if page % x:
                check.fail("value_cache", f"needs P divisible by X = {x} for the shuffled layout", f"P = {page}")
            expected = (pages, kh, page // x, d, x)
            check.shape("value_cache", value, expected, f"[num_blocks, KH, P//X, D, X] for a paged {check.name('key_cache')}")
            value_terms = (v_s[0], v_s[1], 0, v_s[3], v_s[2], v_s[4], lanes, x)
            layout = "shuffled"
        else:
            check.fail("value_cache", f"must be [num_blocks, KH, D, P] or [num_blocks, KH, P//X, D, X] for a paged {check.name('key_cache')}", f"shape {value.shape}")
    if cache_kh != kh:
        check.fail("key_cache", f"must have KH = {kh} heads like {check.name('k')}", f"shape {key.shape}")
    if cache_d != d:
        check.fail("key_cache", f"must have D = {d} like {check.name('k')}", f"shape {key.shape}")
    if page < 1:
        check.fail("key_cache", "must have a page size P >= 1", f"shape {key.shape}")
    return layout, page, pages, key_terms, value_terms


def check_head_dim(check: Checker, name: str, d: int) -> None:
    """A rotated array's head dim: even (NeoX halves, GPT-J pairs), at least 2 (one rotation pair)."""
    if d < 2 or d % 2:
        check.fail(name, "must have an even head dim D >= 2 (its rotation pairs)", d)


def check_cos_sin(check: Checker, name: str, cos_sin: ArrayInfo, dtype: str, d: int) -> int:
    """A ``[max_position, 2*F]`` table of ``dtype`` or fp32 for head dim ``d``; returns its width ``2*F``."""
    check.array(name, cos_sin, 2, "[max_position, 2*F]", tuple(dict.fromkeys((dtype, "float32"))))
    width = cos_sin.shape[1]
    if width not in (d, 2 * d):
        check.fail(name, f"must have width 2*F with F = D/2 or D, i.e. {d} or {2 * d}", f"shape {cos_sin.shape}")
    return width


#: ``max_position`` of a call without a table (``cos_sin=None``): no position past it (the
#: composed step bounds positions by its ``index_cos_sin`` instead, :func:`bound_positions`).
NO_TABLE_POSITIONS = 2**63 - 1


def bound_positions(launch: Launch, max_position: int) -> Launch:
    """Stage 1's launch with positions bounded by ``max_position`` rows: a call with
    ``cos_sin=None`` then is one with an identity table of that many rows, bit for bit."""
    if launch.kernel is not rope_cache_kernel or launch.constexprs["ROPE"]:
        raise ValueError(f"bound_positions: a launch of rope_cache_kernel without a table, got {launch.kernel}")
    return dataclasses.replace(launch, scalars={**launch.scalars, "max_position": max_position})


def block_half(d: int) -> int:
    """``BLOCK_HALF``: the rotation pairs' lanes, D/2 padded to a power of two (:func:`rope_pairs`)."""
    return triton.next_power_of_2(d // 2)


def query_tiles(heads: int, d: int, tile_elements: int) -> tuple[int, int]:
    """``(BLOCK_H, tiles)``: query heads a program rotates (tiles of about ``tile_elements``, a
    power of two, over D's padded lanes), and programs a row."""
    block_h = min(triton.next_power_of_2(max(heads, 1)), max(1, tile_elements // (2 * block_half(d))))
    return block_h, triton.cdiv(heads, block_h)  # no heads: no tiles


@stage(
    arrays=("q", "k", "v", "key_cache", "value_cache", "slot_mapping", "positions", "cos_sin",
            "k_scale", "v_scale", "offsets", "swa_slot_mapping"),
    options=dict(is_neox=BOOL, return_zeros=BOOL),
    results=("q_out", "k_out", "key_cache", "value_cache", when("return_zeros", "zeros")),
    doc=DOC, returns="tuple[Array, ...]", tuning=dict(tuning="rope_cache"), nullable=("cos_sin",),
    rows=dict(k_out="k"))
def plan_rope_reshape_and_cache(
    q: ArrayInfo, k: ArrayInfo, v: ArrayInfo,
    key_cache: ArrayInfo, value_cache: ArrayInfo,
    slot_mapping: ArrayInfo, positions: ArrayInfo, cos_sin: ArrayInfo | None,
    *, is_neox: bool,
    k_scale: ArrayInfo | None = None, v_scale: ArrayInfo | None = None,
    offsets: ArrayInfo | None = None, swa_slot_mapping: ArrayInfo | None = None,
    return_zeros: bool = False,
    tuning: RopeCacheTuning | None = None,
) -> Program:
    """Validate stage-1 arguments and describe the launch (see docs/api.md)."""
    check = Checker(FUNCTION)
    check.rank("q", q, 3, "[T, QH, D]")
    check.rank("k", k, 3, "[T_kv, KH, D]")
    check.rank("v", v, 3, "[T_kv, KH, D]")
    check.dtype("q", q, FLOAT_DTYPES)
    check.same_dtype("k", k, "q", q)
    check.same_dtype("v", v, "q", q)
    t, qh, d = q.shape
    t_kv, kh, _ = k.shape
    if k.shape[2] != d:
        check.fail("k", f"must have {check.owner('q')} head dim D = {d}", f"shape {k.shape}")
    if v.shape != k.shape:
        check.fail("v", f"must have {check.owner('k')} shape {k.shape}", f"shape {v.shape}")
    if t_kv < t:
        check.fail("k", f"must have at least T = {t} rows (T_kv >= T)", f"shape {k.shape}")
    check_head_dim(check, "q", d)
    if kh < 1 or qh % kh:
        check.fail("q", f"must have a number of heads QH divisible by {check.owner('k')} KH = {kh}", f"QH = {qh}")
    check.index_vector("slot_mapping", slot_mapping, t_kv, "T_kv")
    check.index_vector("positions", positions, t, "T")
    if offsets is not None:
        check.index_vector("offsets", offsets, t, "T")
    rope = cos_sin is not None  # else q and k arrive rotated: an identity table, never read
    width = check_cos_sin(check, "cos_sin", cos_sin, q.dtype, d) if rope else d
    if swa_slot_mapping is not None:
        check.index_vector("swa_slot_mapping", swa_slot_mapping, None, "num_swa_slots")

    layout, page, pages, key_terms, value_terms = _cache_geometry(check, key_cache, value_cache, kh, d)
    cache_dtypes = (k.dtype, FP8_DTYPE)
    check.dtype("key_cache", key_cache, cache_dtypes)
    check.same_dtype("value_cache", value_cache, "key_cache", key_cache)
    # The source's rule (apply_scale): both scales for fp8 caches; for the others a given
    # scale is applied (x * (1 / scale)), which no reader undoes (docs/api.md, "Scales").
    fp8 = key_cache.dtype == FP8_DTYPE
    check.writer_scales(fp8, dict(k_scale=k_scale, v_scale=v_scale))

    q_out = Buffer("q_out", (t, qh, d), q.dtype)
    k_out = Buffer("k_out", (t_kv, kh, d), k.dtype)
    zeros = Buffer("zeros", (t, qh, d) if return_zeros else (1,), q.dtype)
    block_h, num_q_tiles = query_tiles(qh, d, tuning.tile_elements)
    qo_sr, qo_sh, _ = q_out.info.strides
    ko_sr, ko_sh, _ = k_out.info.strides
    inputs = (
        "q", "k", "v", "key_cache", "value_cache", "slot_mapping", "positions",
        # Absent optional inputs get a stand-in pointer their constexpr never reads.
        "offsets" if offsets is not None else "positions",
        "cos_sin" if rope else "q",
        "k_scale" if k_scale is not None else "q",
        "v_scale" if v_scale is not None else "q",
        "swa_slot_mapping" if swa_slot_mapping is not None else "slot_mapping",
    )
    launch = Launch(
        kernel=rope_cache_kernel,
        grid=(t_kv, num_q_tiles + 1),
        inputs=inputs,
        outputs=("q_out", "k_out", "key_cache", "value_cache", "zeros"),
        scalars=dict(
            T=t, max_position=cos_sin.shape[0] if rope else NO_TABLE_POSITIONS, num_slots=pages * page,
            swa_len=swa_slot_mapping.shape[0] if swa_slot_mapping is not None else 0,
            q_sr=q.strides[0], q_sh=q.strides[1], k_sr=k.strides[0], k_sh=k.strides[1],
            v_sr=v.strides[0], v_sh=v.strides[1], cs_sr=cos_sin.strides[0] if rope else 0,
            qo_sr=qo_sr, qo_sh=qo_sh, ko_sr=ko_sr, ko_sh=ko_sh,
            kc_sb=key_terms[0], kc_sh=key_terms[1], kc_sd1=key_terms[2],
            kc_sd2=key_terms[3], kc_sp1=key_terms[4], kc_sp2=key_terms[5],
            vc_sb=value_terms[0], vc_sh=value_terms[1], vc_sd1=value_terms[2],
            vc_sd2=value_terms[3], vc_sp1=value_terms[4], vc_sp2=value_terms[5],
        ),
        constexprs=dict(
            D=d, F=width // 2, QH=qh, KH=kh, BLOCK_H=block_h,
            BLOCK_KH=triton.next_power_of_2(kh), NUM_Q_TILES=num_q_tiles,
            PAGE=page, IS_NEOX=is_neox, HAS_OFFSETS=offsets is not None,
            HAS_SWA=swa_slot_mapping is not None, WRITE_ZEROS=return_zeros,
            FP8_CACHE=fp8,
            K_DX=key_terms[6], K_PX=key_terms[7], V_DX=value_terms[6], V_PX=value_terms[7],
            ROPE=rope, K_SCALED=not fp8 and k_scale is not None, V_SCALED=not fp8 and v_scale is not None,
            BLOCK_HALF=block_half(d),
        ),
        num_warps=tuning.num_warps,
        num_stages=1,
    )
    results = ("q_out", "k_out", "key_cache", "value_cache") + (("zeros",) if return_zeros else ())
    return Program(FUNCTION, (q_out, k_out, zeros), (launch,), results)



# --------------------------------------------------------------------------
# RoPE alone: the composed step's index queries and pooled index keys
# --------------------------------------------------------------------------

def check_rope_rows(check: Checker, x: ArrayInfo, positions: ArrayInfo, cos_sin: ArrayInfo) -> int:
    """:func:`plan_rope_rows`' checks; returns the table's width ``2*F``."""
    check.rank("x", x, 3, "[R, H, D]")
    check.dtype("x", x, FLOAT_DTYPES)
    rows, _, d = x.shape
    check_head_dim(check, "x", d)
    check.ranks("positions", positions, (1, 2), "[R] or [R, C]")
    check.dtype("positions", positions, INDEX_DTYPES)
    if positions.shape[0] != rows:
        check.fail("positions", f"must have R = {rows} rows like {check.name('x')}", f"shape {positions.shape}")
    return check_cos_sin(check, "cos_sin", cos_sin, x.dtype, d)


@dependent
@triton.jit
def rope_rows_kernel(
    x_ptr,  # [R, H, D] bf16/fp16/fp32
    positions_ptr,  # [R] or [R, C] int32/int64: column 0
    cos_sin_ptr,  # [max_position, 2*F] x's dtype or fp32
    out_ptr,  # [R, H, D] x's dtype
    max_position, x_sr, x_sh, cs_sr, pos_sr, o_sr, o_sh,
    D: tl.constexpr, F: tl.constexpr, H: tl.constexpr, BLOCK_H: tl.constexpr, IS_NEOX: tl.constexpr,
    BLOCK_HALF: tl.constexpr,  # D/2 padded to a power of two
):
    wait_for_previous_kernel()
    # Stage 1's query tiles, without the KV tile: the same helpers, so the same bits.
    t = tl.program_id(0).to(tl.int64)
    head_tile = tl.program_id(1)
    i, d_a, d_b, freq_a, freq_b = rope_pairs(D, F, IS_NEOX, BLOCK_HALF)
    position = tl.load(positions_ptr + t * pos_sr).to(tl.int64)
    _, cos_a, sin_a, cos_b, sin_b = rope_cos_sin(
        cos_sin_ptr, position, True, i < D // 2, max_position, cs_sr, freq_a, freq_b, F)
    rope_query_heads(x_ptr, out_ptr, out_ptr, t, head_tile, i, d_a, d_b,
                      cos_a[None, :], sin_a[None, :], cos_b[None, :], sin_b[None, :],
                      x_sr, x_sh, o_sr, o_sh, D, H, BLOCK_H, False, BLOCK_HALF)


@stage(arrays=("x", "positions", "cos_sin"), options=dict(is_neox=BOOL), results=("out",),
       tuning=dict(tuning="rope_cache"))
def plan_rope_rows(x: ArrayInfo, positions: ArrayInfo, cos_sin: ArrayInfo, *, is_neox: bool,
                   tuning: RopeCacheTuning | None = None) -> Program:
    """RoPE alone: ``out [R, H, D]``, ``x`` rotated at ``positions`` by ``cos_sin`` (no cache).

    ``positions`` is ``[R]``, or ``[R, C]`` of which column 0 is read (the
    composed step's ``first_positions`` of ``compress_groups``).  Stage 1's
    query arithmetic, bit for bit, and its checks (under the caller's names).
    """
    width = check_rope_rows(Checker("rope_rows"), x, positions, cos_sin)
    rows, heads, d = x.shape
    out = Buffer("out", (rows, heads, d), x.dtype)
    block_h, tiles = query_tiles(heads, d, tuning.tile_elements)
    o_sr, o_sh, _ = out.info.strides
    launch = Launch(
        kernel=rope_rows_kernel, grid=(rows, tiles), inputs=("x", "positions", "cos_sin"), outputs=("out",),
        scalars=dict(max_position=cos_sin.shape[0], x_sr=x.strides[0], x_sh=x.strides[1], cs_sr=cos_sin.strides[0],
                     pos_sr=positions.strides[0], o_sr=o_sr, o_sh=o_sh),
        constexprs=dict(D=d, F=width // 2, H=heads, BLOCK_H=block_h, IS_NEOX=is_neox, BLOCK_HALF=block_half(d)),
        num_warps=tuning.num_warps, num_stages=1)
    return Program("rope_rows", (out,), (launch,), ("out",))
