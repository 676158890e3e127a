"""Top-k row path: one launch, one program per row, the row streamed.

For rows up to ``TopkTuning.row_max_columns`` wide, or any width once there
are ``TopkTuning.row_min_rows`` rows to fill the GPU.  The program streams
its row in tiles (L2-resident after the first pass):

1. group maxima of G >= 2k strided groups, kept in registers, and a bound
   ``L`` <= the k-th largest key: the k-th largest group maximum truncated
   to its top ``radix_bits * bound_passes`` bits (still a lower bound, and
   cheaper than the exact maximum);
2. one pass compacts the columns of the keys >= ``L`` (typically ~1.4k of
   them) into a per-row candidate buffer in column order (their slots from
   prefix sums within chunks of ``TopkTuning.row_chunk`` columns, then over
   the chunks' counts); a block barrier makes them visible to the whole
   program;
3. a radix select over the candidates (keys re-read from the row, held in
   registers when they fit one tile) finds the k-th largest key ``T`` and
   writes the selection, then ``-1`` padding.  Every candidate lies between
   ``L`` and the row's maximum, so the leading digits those two share are
   known: their passes are skipped (the bound's radix does the same with
   the extreme group maxima).

If the candidates overflow the buffer (many keys equal to ``L``), the row
itself is selected from (one more placement pass when ``T == L``, else a
radix select streamed over the row).  Rows so narrow that the groups would
be single columns skip the bound: the radix select runs on the row directly.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..launch import Buffer, Launch
from ..pdl import dependent, wait_for_previous_kernel
from ..tuning import TopkTuning
from .common import (chunked_columns, exclusive_cumsum_2d, kth_largest_between, load_tile_before, order_key, pad,
                     place, place_tile, row_width, select_and_place, topk_groups)


@triton.jit
def _group_max_bound(logits_row, width, num_columns, k, GROUPS: tl.constexpr, TILE: tl.constexpr,
                     PASSES: tl.constexpr, BITS: tl.constexpr):
    """(A lower bound of the row's k-th largest key (0 if fewer than k
    keys), the row's largest key).  The bound is the k-th largest of G
    strided group maxima (k groups have a maximum at or above it), truncated
    to its top ``PASSES * BITS`` bits."""
    # A tile viewed as [TILE // G, G]: column c lands in group c % G.
    offsets = tl.arange(0, TILE // GROUPS)[:, None] * GROUPS + tl.arange(0, GROUPS)[None, :]
    maxima = tl.zeros((GROUPS,), tl.uint32)
    start = tl.full((), 0, tl.int32)
    # The first load is masked by the row's columns, not its visible width,
    # so that it need not wait for visible_blocks to arrive.
    raw = tl.load(logits_row + offsets, mask=offsets < num_columns, other=0.0)
    while start < width:
        # Two tiles in flight: the next one is loaded before this one is reduced.
        idx = start + offsets
        keys = tl.where(idx < width, order_key(raw.to(tl.float32)), 0)
        raw = load_tile_before(logits_row, start + TILE, offsets, width, num_columns)
        maxima = tl.maximum(maxima, tl.max(keys, 0))
        start += TILE
    groups = tl.arange(0, GROUPS)
    top = tl.max(maxima, 0)
    # Empty groups (maximum 0, the lowest key) can only lower the bound.
    bound, _remaining = kth_largest_between(maxima, groups < GROUPS, k, tl.min(maxima, 0), top, PASSES, BITS)
    return bound, top


@triton.jit
def _compact_at_least(logits_row, width, num_columns, bound, cand_ptr, capacity, TILE: tl.constexpr,
                      CHUNK: tl.constexpr):
    """Writes the columns of the keys >= bound, in column order, to the
    candidates (the first ``capacity`` of them; their keys are loaded again
    from the row, which is cheaper in registers than storing them).
    Returns (keys >= bound, keys > bound)."""
    count = tl.full((), 0, tl.int32)
    above = tl.full((), 0, tl.int32)
    start = tl.full((), 0, tl.int32)
    offsets = chunked_columns(TILE, CHUNK)
    # The next tile is loaded while this one is counted (its latency hides
    # behind the prefix sum): the loop carries the raw values.
    raw = load_tile_before(logits_row, start, offsets, width, num_columns)
    while start < width:
        cols = start + offsets
        valid = cols < width
        keys = tl.where(valid, order_key(raw.to(tl.float32)), 0)
        raw = load_tile_before(logits_row, start + TILE, offsets, width, num_columns)
        at_least = (valid & (keys >= bound)).to(tl.int32)
        # Keys >= and > the bound counted together, in the 16-bit halves (TILE <= 16384).
        packed = at_least + ((valid & (keys > bound)).to(tl.int32) << 16)
        before, totals = exclusive_cumsum_2d(packed)
        slot = count + (before & 0xFFFF)
        tl.store(cand_ptr + slot, cols, mask=(at_least != 0) & (slot < capacity))
        count += totals & 0xFFFF
        above += totals >> 16
        start += TILE
    return count, above


@dependent
@triton.jit
def topk_row_kernel(
    logits_ptr,  # [rows, C] float32/bf16/fp16 (row stride lg_sr)
    visible_ptr,  # [rows] int32/int64
    out_ptr,  # [rows, K] int32: selected columns, then -1
    cand_ptr,  # [rows, capacity] int32: candidate columns (workspace)
    num_columns, lg_sr, capacity,
    K: tl.constexpr, GROUPS: tl.constexpr, GROUP_TILE: tl.constexpr, TILE: tl.constexpr,
    CAND_TILE: tl.constexpr, BITS: tl.constexpr, BOUND_PASSES: tl.constexpr, BOUNDED: tl.constexpr,
    PAD_TILE: tl.constexpr, CHUNK: tl.constexpr,
):
    """The whole top-k of one row (module docstring, row path).

    Tiles: GROUP_TILE columns per step of the group maxima (a load and a
    max: wide), TILE per step of the other passes over the row (prefix sums
    and scattered stores: narrower, for registers), CAND_TILE candidates
    held in registers.  Without BOUNDED, TILE covers the row (the plan
    makes sure: C <= G <= TILE).
    """
    wait_for_previous_kernel()
    row = tl.program_id(0).to(tl.int64)
    width = row_width(visible_ptr, row, num_columns)
    logits_row = logits_ptr + row * lg_sr
    out_row = out_ptr + row * K
    lowest = tl.full((), 0, tl.uint32)  # keys lie in [lowest, highest]
    highest = tl.full((), 0xFFFFFFFF, tl.uint32)
    if BOUNDED:
        bound, top = _group_max_bound(logits_row, width, num_columns, K, GROUPS, GROUP_TILE, BOUND_PASSES, BITS)
        candidates = cand_ptr + row * capacity
        count, above = _compact_at_least(logits_row, width, num_columns, bound, candidates, capacity, TILE, CHUNK)
        # Every thread reads candidates that others wrote.
        tl.debug_barrier()
        if count <= capacity:
            select_and_place(logits_row, candidates, count, K, bound, top, out_row, False, CAND_TILE, BITS, True, True)
        elif above < K:
            # Too many keys equal the bound, and it is the k-th largest: all
            # keys above it, then the first K - above equal to it.
            zero = tl.full((), 0, tl.int32)
            place(logits_row, logits_row, zero, width, bound, K - above, zero, zero,
                   out_row, out_row, TILE, True, False)
        else:
            select_and_place(logits_row, logits_row, width, K, lowest, highest, out_row, True, TILE, BITS, False, True)
    else:
        # TILE covers the row: one load, masked by the row's columns so that
        # it need not wait for visible_blocks.
        cols = tl.arange(0, TILE)
        raw = tl.load(logits_row + cols, mask=cols < num_columns, other=0.0)
        valid = cols < width
        keys = tl.where(valid, order_key(raw.to(tl.float32)), 0)
        threshold, take_equal = kth_largest_between(keys, valid, K, lowest, highest, 32 // BITS, BITS)
        zero = tl.full((), 0, tl.int32)
        place_tile(keys, cols, valid, threshold, take_equal, zero, zero, out_row)
    pad(out_row, tl.minimum(width, K), K, PAD_TILE)


def row_parts(rows, columns, k, logits_stride, row_counts, logits, visible, out, tuning: TopkTuning):
    """The row path: one launch of one program per row."""
    width = max(columns, 1)
    row_width = max(16, triton.next_power_of_2(width))
    groups = topk_groups(columns, k, tuning)
    share = 1 if rows < tuning.row_many_rows else 2
    warps = max(1, tuning.row_warps // share)
    keys_per_thread = tuning.row_keys_per_thread
    # Single-column groups: the bound would be the answer itself, so the
    # radix select runs on the row (TILE covers it: width <= G <= 4096).
    bounded = groups < triton.next_power_of_2(width)
    if bounded:
        # G maxima and G // 2 candidates stay in registers: 8 a thread at most.
        # The other passes' tile: keys x threads, at most row_max_tile (registers).
        warps = max(warps, min(32, groups // 256))
        tile = min(row_width, keys_per_thread * 32 * warps, tuning.row_max_tile)
    else:
        # The row stays in registers through the radix passes: 8 keys a thread.
        tile = row_width
        warps = max(4, min(16, tile // (32 * min(keys_per_thread, 8))))
    threads = 32 * warps
    group_tile = max(groups, min(row_width, tuning.row_group_keys_per_thread * threads))
    assert tile <= 16384, "row-path prefix sums pack two 16-bit counts"
    assert bounded or tile >= columns, "the direct select holds the whole row"
    capacity = min(triton.cdiv(width, tile) * tile, max(tuning.min_candidates, 4 * k)) if bounded else 1
    # Typically about 1.4k keys reach the bound: one register tile of 2k.
    cand_tile = min(tile, max(16, triton.next_power_of_2(2 * k)))
    candidates = "topk_candidates"
    buffers = (Buffer(candidates, (rows, capacity), "int32"),)
    launches = tuple(
        Launch(topk_row_kernel, (count,), (logits, visible), (out, candidates),
               dict(num_columns=columns, lg_sr=logits_stride, capacity=capacity),
               dict(K=k, GROUPS=groups, GROUP_TILE=group_tile, TILE=tile, CAND_TILE=cand_tile,
                    BITS=tuning.radix_bits, BOUND_PASSES=tuning.bound_passes, BOUNDED=bounded,
                    PAD_TILE=min(1024, triton.next_power_of_2(k)), CHUNK=min(tile, tuning.row_chunk)),
               num_warps=warps, num_stages=1)
        for count in row_counts)
    return buffers, launches
