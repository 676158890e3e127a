"""Top-k sliced path: four launches over ``(row, slice)`` programs.

Past ``TopkTuning.ticketed_max_columns`` (one row: past
``ticketed_single_row_max_columns``), so that long rows still spread over
many SMs:

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
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..launch import Buffer, Launch
from ..pdl import dependent, wait_for_previous_kernel
from ..tuning import TopkTuning
from .common import kth_largest_resident, kth_largest_streamed, place, row_width, source, topk_groups


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


@dependent
@triton.jit
def topk_group_max_kernel(
    logits_ptr,  # [rows, C] float32/bf16/fp16 (row stride lg_sr)
    visible_ptr,  # [rows] int32/int64
    maxima_ptr,  # [rows, slices, GROUPS] int32 (order keys as bits)
    num_columns, lg_sr, slices, tiles_per_slice,
    GROUPS: tl.constexpr, TILE: tl.constexpr,
):
    """Phase 1: maxima of the G strided groups over one slice of a row."""
    wait_for_previous_kernel()
    row = tl.program_id(0).to(tl.int64)
    slice_id = tl.program_id(1)
    width = row_width(visible_ptr, row, num_columns)
    logits_row = logits_ptr + row * lg_sr
    # A tile viewed as [TILE // G, G]: column c lands in group c % G.
    offsets = tl.arange(0, TILE // GROUPS)[:, None] * GROUPS + tl.arange(0, GROUPS)[None, :]
    maxima = tl.zeros((GROUPS,), tl.uint32)
    start, end = _slice_range(slice_id, tiles_per_slice, width, TILE)
    while start < end:
        keys, _cols, _valid = source(logits_row, logits_row, start + offsets, end, True)
        maxima = tl.maximum(maxima, tl.max(keys, 0))
        start += TILE
    tl.store(maxima_ptr + (row * slices + slice_id) * GROUPS + tl.arange(0, GROUPS),
             maxima.to(tl.int32, bitcast=True))


@dependent
@triton.jit
def topk_bound_kernel(
    logits_ptr,  # [rows, C] float32/bf16/fp16 (row stride lg_sr)
    visible_ptr,  # [rows] int32/int64
    maxima_ptr,  # [rows, slices, GROUPS] int32
    bound_ptr,  # [rows] int32: the bound L (order key bits)
    counts_ptr,  # [rows, 2, slices] int32: keys > L, keys == L per slice
    num_columns, lg_sr, slices, tiles_per_slice,
    K: tl.constexpr, GROUPS: tl.constexpr, TILE: tl.constexpr, BITS: tl.constexpr,
):
    """Phase 2: L = k-th largest group maximum; this slice's counts of keys > L and == L."""
    wait_for_previous_kernel()
    row = tl.program_id(0).to(tl.int64)
    slice_id = tl.program_id(1)
    width = row_width(visible_ptr, row, num_columns)
    groups = tl.arange(0, GROUPS)
    maxima = tl.zeros((GROUPS,), tl.uint32)
    s = tl.full((), 0, tl.int32)
    while s < slices:
        partial = tl.load(maxima_ptr + (row * slices + s) * GROUPS + groups)
        maxima = tl.maximum(maxima, partial.to(tl.uint32, bitcast=True))
        s += 1
    # Every slice derives the same bound; empty groups (max 0) only lower it.
    bound, _taken = kth_largest_resident(maxima, groups < GROUPS, K, BITS)

    logits_row = logits_ptr + row * lg_sr
    above = tl.full((), 0, tl.int32)
    equal = tl.full((), 0, tl.int32)
    start, end = _slice_range(slice_id, tiles_per_slice, width, TILE)
    while start < end:
        keys, _cols, valid = source(logits_row, logits_row, start + tl.arange(0, TILE), end, True)
        above += tl.sum((valid & (keys > bound)).to(tl.int32), 0)
        equal += tl.sum((valid & (keys == bound)).to(tl.int32), 0)
        start += TILE
    tl.store(counts_ptr + row * (2 * slices) + slice_id, above)
    tl.store(counts_ptr + row * (2 * slices) + slices + slice_id, equal)
    if slice_id == 0:
        tl.store(bound_ptr + row, bound.to(tl.int32, bitcast=True))


@dependent
@triton.jit
def topk_place_kernel(
    logits_ptr,  # [rows, C] float32/bf16/fp16 (row stride lg_sr)
    visible_ptr,  # [rows] int32/int64
    bound_ptr,  # [rows] int32
    counts_ptr,  # [rows, 2, slices] int32
    out_ptr,  # [rows, K] int32: selected columns
    cand_key_ptr,  # [rows, capacity] int32: candidate order keys
    cand_col_ptr,  # [rows, capacity] int32: candidate columns
    num_columns, lg_sr, slices, tiles_per_slice, capacity,
    K: tl.constexpr, TILE: tl.constexpr, MAX_SLICES: tl.constexpr,
):
    """Phase 3: write the selection if T == L, else compact keys > L into the candidates."""
    wait_for_previous_kernel()
    row = tl.program_id(0).to(tl.int64)
    slice_id = tl.program_id(1)
    width = row_width(visible_ptr, row, num_columns)
    bound = tl.load(bound_ptr + row).to(tl.uint32, bitcast=True)
    above, equal, above_before, equal_before = _slice_counts(counts_ptr, row, slice_id, slices, MAX_SLICES)
    logits_row = logits_ptr + row * lg_sr
    start, end = _slice_range(slice_id, tiles_per_slice, width, TILE)
    if above < K:
        # T == L: all keys above L, then the first K - above keys equal to L.
        take_equal = K - above
        place(logits_row, logits_row, start, end, bound, take_equal, equal_before,
               above_before + tl.minimum(equal_before, take_equal),
               out_ptr + row * K, out_ptr, TILE, True, False)
    elif above <= capacity:
        place(logits_row, logits_row, start, end, bound, 0, equal_before, above_before,
               cand_col_ptr + row * capacity, cand_key_ptr + row * capacity, TILE, True, True)


@dependent
@triton.jit
def topk_finish_kernel(
    logits_ptr,  # [rows, C] float32/bf16/fp16 (row stride lg_sr)
    visible_ptr,  # [rows] int32/int64
    counts_ptr,  # [rows, 2, slices] int32
    cand_key_ptr,  # [rows, capacity] int32
    cand_col_ptr,  # [rows, capacity] int32
    previous_ptr,  # [rows, K] int32: out as phase 3 left it (the same buffer)
    out_ptr,  # [rows, K] int32
    num_columns, lg_sr, slices, capacity,
    K: tl.constexpr, TILE: tl.constexpr, CAND_TILE: tl.constexpr, MAX_SLICES: tl.constexpr,
    BITS: tl.constexpr, PAD_TILE: tl.constexpr,
):
    """Phase 4: when T > L, select among the candidates (or the whole row if
    they overflowed); then pad with -1."""
    wait_for_previous_kernel()
    row = tl.program_id(0).to(tl.int64)
    width = row_width(visible_ptr, row, num_columns)
    above, _equal, _above_before, _equal_before = _slice_counts(counts_ptr, row, 0, slices, MAX_SLICES)
    out_row = out_ptr + row * K
    zero = tl.full((), 0, tl.int32)
    if above >= K:
        if above <= capacity:
            keys_row = cand_key_ptr + row * capacity
            cols_row = cand_col_ptr + row * capacity
            threshold, take_equal = kth_largest_streamed(keys_row, cols_row, above, K, False, CAND_TILE, BITS)
            place(keys_row, cols_row, zero, above, threshold, take_equal, zero, zero,
                   out_row, out_row, CAND_TILE, False, False)
        else:
            logits_row = logits_ptr + row * lg_sr
            threshold, take_equal = kth_largest_streamed(logits_row, logits_row, width, K, True, TILE, BITS)
            place(logits_row, logits_row, zero, width, threshold, take_equal, zero, zero,
                   out_row, out_row, TILE, True, False)
    selected = tl.minimum(width, K)
    for t in range((K + PAD_TILE - 1) // PAD_TILE):
        cols = t * PAD_TILE + tl.arange(0, PAD_TILE)
        tl.store(out_row + cols, tl.full((PAD_TILE,), -1, tl.int32), mask=(cols >= selected) & (cols < K))


def sliced_parts(rows, columns, k, logits_stride, row_counts, logits, visible, out, tuning: TopkTuning):
    """The sliced path: four launches over (row, slice) programs."""
    width = max(columns, 1)
    groups = topk_groups(columns, k, tuning)
    tile = max(groups, min(tuning.tile, max(16, triton.next_power_of_2(width))))
    row_tiles = triton.cdiv(width, tile)
    # Split rows into slices until there are enough programs for the GPU.
    slices = max(1, min(row_tiles, tuning.max_slices, triton.cdiv(tuning.target_programs, rows)))
    tiles_per_slice = triton.cdiv(row_tiles, slices)
    slices = triton.cdiv(row_tiles, tiles_per_slice)
    capacity = min(row_tiles * tile, max(tuning.min_candidates, 4 * k))
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
    max_slices = triton.next_power_of_2(tuning.max_slices)
    options = dict(num_warps=8 if tile >= 2048 else 4, num_stages=1)
    launches = []
    for count in row_counts:
        launches += [
            Launch(topk_group_max_kernel, (count, slices), (logits, visible), (maxima,), per_slice,
                   dict(GROUPS=groups, TILE=tile), **options),
            Launch(topk_bound_kernel, (count, slices), (logits, visible, maxima), (bound, counts), per_slice,
                   dict(K=k, GROUPS=groups, TILE=tile, BITS=tuning.radix_bits), **options),
            Launch(topk_place_kernel, (count, slices), (logits, visible, bound, counts),
                   (out, cand_key, cand_col), dict(per_slice, capacity=capacity),
                   dict(K=k, TILE=tile, MAX_SLICES=max_slices), **options),
            # `out` is updated in place: phase 3 wrote the rows where T == L.
            Launch(topk_finish_kernel, (count,), (logits, visible, counts, cand_key, cand_col, out), (out,),
                   dict(sizes, capacity=capacity),
                   dict(K=k, TILE=tile, CAND_TILE=cand_tile, MAX_SLICES=max_slices, BITS=tuning.radix_bits,
                        PAD_TILE=min(1024, triton.next_power_of_2(k))),
                   **options),
        ]
    return buffers, tuple(launches)
