"""Top-k register path: one launch, one program per row, the row in registers.

For rows up to ``TopkTuning.register_max_columns`` wide, whatever the rows,
and at most :data:`REGISTER_MAX_TILE` when forced; no workspace.  The
program loads its row once into registers (8 keys a thread: 8 warps at 2048
columns, 32 from 8192, 16 keys a thread at 16384), skips the radix passes of
the leading digits that the row's smallest and largest keys share, runs the
others on the registers (4-bit digits by default: 16-bin histograms, whose
block-wide reductions cost far less than 256 bins', though the passes are
twice as many; passes stop once a digit's keys are exactly those left to
take), and writes the selection with one prefix sum over column order, then
``-1`` padding.  No global round trip between phases, which is what the row
path pays for on short rows; but every pass costs every key of the row, so
past ~8192 columns the row and sliced paths, which select among the keys at
or above a bound (~700 for k = 512 on half-normal scores), win.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..launch import Launch
from ..pdl import dependent, wait_for_previous_kernel
from ..tuning import TopkTuning
from .common import kth_largest_between, order_key, pad, place_tile, row_width


#: The widest row the register path holds: 16 keys a thread at 32 warps
#: (64 registers, no spills on sm_90); 32768 spills (32 keys a thread at 32
#: warps, or 64 at 16) and would lose to the sliced path anyway.
REGISTER_MAX_TILE = 16384


@dependent
@triton.jit
def topk_register_kernel(
    logits_ptr,  # [rows, C] float32/bf16/fp16 (row stride lg_sr)
    visible_ptr,  # [rows] int32/int64
    out_ptr,  # [rows, K] int32: selected columns, then -1
    num_columns, lg_sr,
    K: tl.constexpr, TILE: tl.constexpr, BITS: tl.constexpr, PAD_TILE: tl.constexpr,
):
    """The whole top-k of one row held in registers (module docstring,
    register path): one load, a radix select over the registers (BITS-bit
    histograms), one placement; no workspace.  TILE >= C (the plan makes sure)."""
    wait_for_previous_kernel()
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * lg_sr
    cols = tl.arange(0, TILE)
    # Masked by the row's columns, not its visible width, so that the load
    # need not wait for visible_blocks.
    raw = tl.load(logits_row + cols, mask=cols < num_columns, other=0.0)
    width = row_width(visible_ptr, row, num_columns)
    out_row = out_ptr + row * K
    valid = cols < width
    keys = tl.where(valid, order_key(raw.to(tl.float32)), 0)
    # Every key lies in [lowest, highest]: the radix passes of the digits
    # they share are skipped.  A row of at most K keys takes them all.
    zero = tl.full((), 0, tl.int32)
    threshold = tl.full((), 0, tl.uint32)
    take_equal = zero + K
    if width > K:
        highest = tl.max(keys, 0)
        lowest = tl.min(tl.where(valid, keys, tl.full((), 0xFFFFFFFF, tl.uint32)), 0)
        threshold, take_equal = kth_largest_between(keys, valid, K, lowest, highest, 32 // BITS, BITS)
    # TILE <= 16384: the two prefix counts fit the 16-bit halves of an int32.
    place_tile(keys, cols, valid, threshold, take_equal, zero, zero, out_row)
    pad(out_row, tl.minimum(width, K), K, PAD_TILE)


def register_tiling(columns: int, tuning: TopkTuning) -> tuple[int, int]:
    """(TILE, warps) of the register path: TILE covers the row, with
    ``register_keys_per_thread`` keys a thread (more past 32 warps)."""
    tile = max(16, triton.next_power_of_2(max(columns, 1)))
    assert tile <= REGISTER_MAX_TILE, "the register path holds the whole row"
    warps = max(1, min(tuning.register_max_warps, tile // (32 * tuning.register_keys_per_thread)))
    return tile, warps


def register_parts(rows, columns, k, logits_stride, row_counts, logits, visible, out, tuning: TopkTuning):
    """The register path: one launch of one program per row, no workspace."""
    tile, warps = register_tiling(columns, tuning)
    launches = tuple(
        Launch(topk_register_kernel, (count,), (logits, visible), (out,),
               dict(num_columns=columns, lg_sr=logits_stride),
               dict(K=k, TILE=tile, BITS=tuning.register_radix_bits, PAD_TILE=min(1024, triton.next_power_of_2(k))),
               num_warps=warps, num_stages=1)
        for count in row_counts)
    return (), launches
