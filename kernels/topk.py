"""Stage 3b: exact top-k blocks of each row (``topk_blocks``).

An exact radix select on order-preserving uint32 keys
(``-0.0 == +0.0``; NaN below ``-inf``), by one of four paths that the plan
chooses from the static shape (:func:`topk_path`):

**Register path** (one launch, one program per row, no workspace; rows up
to ``TopkTuning.register_max_columns`` wide, whatever the rows, and at most
``REGISTER_MAX_TILE`` when forced).  The program loads its row once into
registers (16 keys a thread: 4 warps at 2048 columns, 32 at 16384), skips
the radix passes of the leading digits that the row's smallest and largest
keys share, runs the others on the registers (``tl.histogram`` of the
digit among the keys matching the prefix so far, then the digit holding
the k-th largest from a prefix sum taken from the top; passes stop once a
digit's keys are exactly those left to take; or, with
``TopkTuning.register_select = "count"``, 2-bit digits by counting the keys
at or above three thresholds: :func:`_kth_largest_counted`), and writes the
selection with one prefix sum over column order, then ``-1`` padding.  No
global round trip between phases, which is what the row path pays for on
short rows; but every pass costs every key of the row (about 75
instructions a key an 8-bit pass on sm_90), so past ~8192 columns the row
and sliced paths, which select among the keys at or above a bound (~700
for k = 512 on half-normal scores), win.

**Row path** (one launch, one program per row; rows up to
``TopkTuning.row_max_columns`` wide, or any width once there are
``TopkTuning.row_min_rows`` rows to fill the GPU).  The program streams its
row in tiles (L2-resident after the first pass):

1. group maxima of G >= 2k strided groups, kept in registers, and a bound
   ``L`` <= the k-th largest key: the k-th largest group maximum truncated
   to its top ``radix_bits * bound_passes`` bits (still a lower bound, and
   cheaper than the exact maximum);
2. one pass compacts the columns of the keys >= ``L`` (typically ~1.4k of
   them) into a per-row candidate buffer in column order; a block barrier
   makes them visible to the whole program;
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

**Ticketed path** (one launch of 2 x S programs per row, for a few rows
wider than the row path takes, up to ``TopkTuning.ticketed_max_columns``):
a program's role is its start ticket (an atomic add per row), so a program
waits only for programs that started before it (docs/design.md, "Numerics
and determinism").

1. the first S programs to start each fold one slice (``ticketed_slice``
   columns, in registers) into the row's G >= 2k strided group maxima by
   atomic max, then count themselves done (release);
2. the other S wait for that count (acquire), each derives the same bound
   ``L`` <= the k-th largest key from the maxima (one pass of digits fitted
   to the maxima's span, :func:`_scaled_lower_bound`, or the row path's
   truncated radix), and compacts its slice's keys >= ``L`` (~1.4k a row)
   into its own region of the candidate buffers, in column order;
3. the last of those to finish (an acq_rel ticket) gathers the regions in
   slice order (so column order) into registers and selects, or, when the
   candidates overflow its tile, selects from the row (placing directly when
   ``T == L``); then ``-1`` padding, and the row's state back to zero.

Measured on the H200 (1 x 32768, k = 512, 8 warps, phases timed by the
global timer, from the first program's start): roles drawn at 0.4 us,
maxima published at 1.9 (the release waits ~0.9 for their atomics), bound
derived 1.5 us after the wait ends, compaction 1.7 us, and the last
program's selection 7.4 us (four 8-bit histogram passes over ~1.4k
candidates at ~1.5 us each: what bounds the path); 13.8 us in all.

**Sliced path** (four launches over ``(row, slice)`` programs, so that one
long row still spreads over many SMs; past ``ticketed_max_columns``):

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

On every path, selected columns are written in ascending column order with
ties taken by lower column (prefix sums over column order), so the result is
exact, deterministic and the same on every path: integer counts only, no
host synchronisation, and atomics only where their order cannot matter (the
ticketed path's maxima and tickets).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .launch import ArrayInfo, Buffer, Launch, Program
from .stage import stage
from .tuning import TopkTuning
from .validate import FLOAT_DTYPES, NONNEGATIVE_INT, Checker

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


@triton.jit
def order_key(x):
    """float32 -> uint32 whose unsigned order is the ranking (NaN lowest, -0.0 == +0.0)."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.uint32, bitcast=True)
    key = tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    return tl.where(x != x, 0, key)


@triton.jit
def _source(key_ptr, col_ptr, idx, n, FROM_LOGITS: tl.constexpr, GATHER: tl.constexpr = False):
    """(keys, columns, valid) of entries ``idx < n``: a logits row, a
    candidate list of keys and columns, or (GATHER) a list of columns of
    the logits row ``key_ptr``."""
    valid = idx < n
    if FROM_LOGITS:
        # Entries outside the source get key 0, the lowest: they can only
        # lower a group maximum, never raise it.
        keys = tl.where(valid, order_key(tl.load(key_ptr + idx, mask=valid, other=0.0).to(tl.float32)), 0)
        cols = idx
    elif GATHER:
        cols = tl.load(col_ptr + idx, mask=valid, other=0)
        keys = tl.where(valid, order_key(tl.load(key_ptr + cols, mask=valid, other=0.0).to(tl.float32)), 0)
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
    prefix, remaining, _exact = _choose_digit_exact(histogram, prefix, remaining, PASS, BITS)
    return prefix, remaining


@triton.jit
def _choose_digit_exact(histogram, prefix, remaining, PASS: tl.constexpr, BITS: tl.constexpr):
    """:func:`_choose_digit`, and whether the chosen digit's keys are
    exactly what remains to take (then every key matching the prefix is
    taken: the prefix, with ``remaining`` equal keys, is a final answer)."""
    SHIFT: tl.constexpr = 32 - (PASS + 1) * BITS
    digit, above, exact = _digit_of_kth(histogram, remaining, BITS)
    return prefix | (digit.to(tl.uint32) << SHIFT), remaining - above, exact


@triton.jit
def _digit_of_kth(histogram, remaining, BITS: tl.constexpr):
    """(The digit holding the ``remaining``-th largest key, how many keys
    have larger digits, whether the digit's keys are exactly what remains
    to take) from a histogram of the digits."""
    at_or_above = tl.cumsum(histogram, 0, reverse=True)
    # at_or_above never increases with the digit: the chosen digit is the
    # last one with at_or_above >= remaining, and the keys above it are
    # those of the digits after it.  Fewer than ``remaining`` keys in all:
    # digit 0 (the key ends up 0 and every key equal to it is taken).  The
    # chosen digit's at_or_above equals remaining iff some digit's does.
    # All three counts come from one reduction (16 + 16 + 32 bits).
    reaching = at_or_above >= remaining
    exact = at_or_above == remaining
    beyond = tl.where((at_or_above < remaining) & (tl.arange(0, 1 << BITS) > 0), histogram, 0)
    packed = tl.sum(reaching.to(tl.int64) + (exact.to(tl.int64) << 16) + (beyond.to(tl.int64) << 32), 0)
    digit = tl.maximum((packed & 0xFFFF).to(tl.int32) - 1, 0)
    return digit, (packed >> 32).to(tl.int32), ((packed >> 16) & 0xFFFF) != 0


@triton.jit
def _kth_largest_resident(keys, valid, k, BITS: tl.constexpr):
    """(k-th largest key, how many keys equal to it are among the top k) of a register tensor."""
    return _kth_largest_prefix(keys, valid, k, 32 // BITS, BITS)


@triton.jit
def _kth_largest_prefix(keys, valid, k, PASSES: tl.constexpr, BITS: tl.constexpr):
    """The top ``PASSES * BITS`` bits of the k-th largest key of a register
    tensor, low bits zero (a lower bound of it; 0 if there are fewer than k
    keys), and what remains to take of the keys matching them."""
    prefix = tl.full((), 0, tl.uint32)
    remaining = tl.full((), 0, tl.int32) + k
    for p in tl.static_range(PASSES):
        histogram = _digit_histogram(keys, valid, prefix, p, BITS)
        prefix, remaining = _choose_digit(histogram, prefix, remaining, p, BITS)
    return prefix, remaining


@triton.jit
def _kth_largest_between(keys, valid, k, lo, hi, PASSES: tl.constexpr, BITS: tl.constexpr):
    """:func:`_kth_largest_prefix` of keys known to lie in ``[lo, hi]``, as
    a (threshold, equal keys to take) pair that :func:`_place_tile` accepts
    (the threshold is the k-th largest key, or a prefix of it that every
    key it matches shares).  The leading digits that ``lo`` and ``hi``
    share are every key's, so their passes are skipped (typically the first
    one or two), and so are the passes after an exact digit."""
    prefix = tl.full((), 0, tl.uint32)
    remaining = tl.full((), 0, tl.int32) + k
    shared = lo ^ hi
    done = tl.full((), 0, tl.int32)
    for p in tl.static_range(PASSES):
        # Digits 0..p of lo and hi are equal: so are every key's.
        if (shared >> (32 - (p + 1) * BITS)) == 0:
            prefix = (hi >> (32 - (p + 1) * BITS)) << (32 - (p + 1) * BITS)
        elif done == 0:
            # Once the chosen digit's keys are exactly those remaining, the
            # prefix (low digits zero) is final: every key matching it is
            # above it or equal to it, and all of them are taken.
            histogram = _digit_histogram(keys, valid, prefix, p, BITS)
            prefix, remaining, exact = _choose_digit_exact(histogram, prefix, remaining, p, BITS)
            done = exact.to(tl.int32)
    return prefix, remaining


@triton.jit
def _kth_largest_streamed(key_ptr, col_ptr, n, k, FROM_LOGITS: tl.constexpr,
                          TILE: tl.constexpr, BITS: tl.constexpr, GATHER: tl.constexpr = False):
    """As :func:`_kth_largest_resident` over source entries ``[0, n)``, a tile at a time."""
    prefix = tl.full((), 0, tl.uint32)
    remaining = tl.full((), 0, tl.int32) + k
    for p in tl.static_range(32 // BITS):
        histogram = tl.zeros((1 << BITS,), tl.int32)
        start = tl.full((), 0, tl.int32)
        while start < n:
            keys, _cols, valid = _source(key_ptr, col_ptr, start + tl.arange(0, TILE), n, FROM_LOGITS, GATHER)
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
    logits_ptr,  # [rows, C] float32/bf16/fp16 (row stride lg_sr)
    visible_ptr,  # [rows] int32/int64
    maxima_ptr,  # [rows, slices, GROUPS] int32 (order keys as bits)
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
    logits_ptr,  # [rows, C] float32/bf16/fp16 (row stride lg_sr)
    visible_ptr,  # [rows] int32/int64
    maxima_ptr,  # [rows, slices, GROUPS] int32
    bound_ptr,  # [rows] int32: the bound L (order key bits)
    counts_ptr,  # [rows, 2, slices] int32: keys > L, keys == L per slice
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
# Row path: one program per row, one launch.
# --------------------------------------------------------------------------

@triton.jit
def _place_tile(keys, cols, valid, threshold, take_equal, equal_before, position, out_ptr):
    """:func:`_place` of one register tile: writes, from ``position`` on in
    tile order, the columns with key > threshold and those equal to it whose
    rank among equal keys (``equal_before`` earlier) is below ``take_equal``.
    Returns the next position and equal count.  One prefix sum: the counts
    above and equal (each < 2**16 in a tile) are packed in one int32."""
    above = (valid & (keys > threshold)).to(tl.int32)
    equal = (valid & (keys == threshold)).to(tl.int32)
    packed = above + (equal << 16)
    before = tl.cumsum(packed, 0) - packed
    above_before = before & 0xFFFF
    equal_rank = equal_before + (before >> 16)
    # Equal keys taken before this one: those of rank below take_equal.
    taken_equal = tl.minimum(equal_rank, take_equal) - tl.minimum(equal_before, take_equal)
    take = (above != 0) | ((equal != 0) & (equal_rank < take_equal))
    tl.store(out_ptr + position + above_before + taken_equal, cols, mask=take)
    totals = tl.sum(packed, 0)
    equal_total = totals >> 16
    taken = (totals & 0xFFFF) + tl.minimum(equal_before + equal_total, take_equal) - tl.minimum(equal_before, take_equal)
    return position + taken, equal_before + equal_total


@triton.jit
def _select_and_place(logits_row, candidates, n, k, lo, hi, out_ptr, FROM_LOGITS: tl.constexpr,
                      TILE: tl.constexpr, BITS: tl.constexpr, RESIDENT: tl.constexpr):
    """Writes the columns of the k largest of source entries ``[0, n)``
    (the logits row, or the candidate columns of it), whose keys lie in
    ``[lo, hi]``, in source order; in registers when they fit one tile (and
    RESIDENT), else streamed a tile at a time."""
    zero = tl.full((), 0, tl.int32)
    GATHER: tl.constexpr = not FROM_LOGITS
    if RESIDENT and n <= TILE:
        keys, cols, valid = _source(logits_row, candidates, tl.arange(0, TILE), n, FROM_LOGITS, GATHER)
        threshold, take_equal = _kth_largest_between(keys, valid, k, lo, hi, 32 // BITS, BITS)
        _place_tile(keys, cols, valid, threshold, take_equal, zero, zero, out_ptr)
    else:
        threshold, take_equal = _kth_largest_streamed(logits_row, candidates, n, k, FROM_LOGITS, TILE, BITS, GATHER)
        position = zero
        equal_before = zero
        start = zero
        while start < n:
            keys, cols, valid = _source(logits_row, candidates, start + tl.arange(0, TILE), n, FROM_LOGITS, GATHER)
            position, equal_before = _place_tile(keys, cols, valid, threshold, take_equal, equal_before,
                                                 position, out_ptr)
            start += TILE


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
        raw = tl.load(logits_row + TILE + idx, mask=TILE + idx < width, other=0.0)
        maxima = tl.maximum(maxima, tl.max(keys, 0))
        start += TILE
    groups = tl.arange(0, GROUPS)
    top = tl.max(maxima, 0)
    # Empty groups (maximum 0, the lowest key) can only lower the bound.
    bound, _remaining = _kth_largest_between(maxima, groups < GROUPS, k, tl.min(maxima, 0), top, PASSES, BITS)
    return bound, top


@triton.jit
def _prefetch(logits_row, start, width, TILE: tl.constexpr):
    """Raw logits of columns ``[start, start + TILE)`` below ``width``."""
    cols = start + tl.arange(0, TILE)
    return tl.load(logits_row + cols, mask=cols < width, other=0.0)


@triton.jit
def _compact_at_least(logits_row, width, bound, cand_ptr, capacity, TILE: tl.constexpr):
    """Writes the columns of the keys >= bound, in column order, to the
    candidates (the first ``capacity`` of them; their keys are loaded again
    from the row, which is cheaper in registers than storing them).
    Returns (keys >= bound, keys > bound)."""
    count = tl.full((), 0, tl.int32)
    above = tl.full((), 0, tl.int32)
    start = tl.full((), 0, tl.int32)
    # The next tile is loaded while this one is counted (its latency hides
    # behind the prefix sum): the loop carries the raw values.
    raw = _prefetch(logits_row, start, width, TILE)
    while start < width:
        cols = start + tl.arange(0, TILE)
        valid = cols < width
        keys = tl.where(valid, order_key(raw.to(tl.float32)), 0)
        raw = _prefetch(logits_row, start + TILE, width, TILE)
        at_least = (valid & (keys >= bound)).to(tl.int32)
        beyond = (valid & (keys > bound)).to(tl.int32)
        slot = count + tl.cumsum(at_least, 0) - at_least
        keep = (at_least != 0) & (slot < capacity)
        tl.store(cand_ptr + slot, cols, mask=keep)
        totals = tl.sum(at_least + (beyond << 16), 0)
        count += totals & 0xFFFF
        above += totals >> 16
        start += TILE
    return count, above


@triton.jit
def _pad(out_row, selected, K: tl.constexpr, PAD_TILE: tl.constexpr):
    """-1 in ``out_row[selected:K]``."""
    for t in range((K + PAD_TILE - 1) // PAD_TILE):
        cols = t * PAD_TILE + tl.arange(0, PAD_TILE)
        tl.store(out_row + cols, tl.full((PAD_TILE,), -1, tl.int32), mask=(cols >= selected) & (cols < K))


@triton.jit
def topk_row_kernel(
    logits_ptr,  # [rows, C] float32/bf16/fp16 (row stride lg_sr)
    visible_ptr,  # [rows] int32/int64
    out_ptr,  # [rows, K] int32: selected columns, then -1
    cand_ptr,  # [rows, capacity] int32: candidate columns (workspace)
    num_columns, lg_sr, capacity,
    K: tl.constexpr, GROUPS: tl.constexpr, GROUP_TILE: tl.constexpr, TILE: tl.constexpr,
    CAND_TILE: tl.constexpr, BITS: tl.constexpr, BOUND_PASSES: tl.constexpr, BOUNDED: tl.constexpr,
    PAD_TILE: tl.constexpr,
):
    """The whole top-k of one row (module docstring, row path).

    Tiles: GROUP_TILE columns per step of the group maxima (a load and a
    max: wide), TILE per step of the other passes over the row (prefix sums
    and scattered stores: narrower, for registers), CAND_TILE candidates
    held in registers.  Without BOUNDED, TILE covers the row (the plan
    makes sure: C <= G <= TILE).
    """
    row = tl.program_id(0).to(tl.int64)
    width = _row_width(visible_ptr, row, num_columns)
    logits_row = logits_ptr + row * lg_sr
    out_row = out_ptr + row * K
    lowest = tl.full((), 0, tl.uint32)  # keys lie in [lowest, highest]
    highest = tl.full((), 0xFFFFFFFF, tl.uint32)
    if BOUNDED:
        bound, top = _group_max_bound(logits_row, width, num_columns, K, GROUPS, GROUP_TILE, BOUND_PASSES, BITS)
        candidates = cand_ptr + row * capacity
        count, above = _compact_at_least(logits_row, width, bound, candidates, capacity, TILE)
        # Every thread reads candidates that others wrote.
        tl.debug_barrier()
        if count <= capacity:
            _select_and_place(logits_row, candidates, count, K, bound, top, out_row, False, CAND_TILE, BITS, True)
        elif above < K:
            # Too many keys equal the bound, and it is the k-th largest: all
            # keys above it, then the first K - above equal to it.
            zero = tl.full((), 0, tl.int32)
            _place(logits_row, logits_row, zero, width, bound, K - above, zero, zero,
                   out_row, out_row, TILE, True, False)
        else:
            _select_and_place(logits_row, logits_row, width, K, lowest, highest, out_row, True, TILE, BITS, False)
    else:
        # TILE covers the row: one load, masked by the row's columns so that
        # it need not wait for visible_blocks.
        cols = tl.arange(0, TILE)
        raw = tl.load(logits_row + cols, mask=cols < num_columns, other=0.0)
        valid = cols < width
        keys = tl.where(valid, order_key(raw.to(tl.float32)), 0)
        threshold, take_equal = _kth_largest_between(keys, valid, K, lowest, highest, 32 // BITS, BITS)
        zero = tl.full((), 0, tl.int32)
        _place_tile(keys, cols, valid, threshold, take_equal, zero, zero, out_row)
    _pad(out_row, tl.minimum(width, K), K, PAD_TILE)


# --------------------------------------------------------------------------
# Register path: one program per row, the whole row in registers.
# --------------------------------------------------------------------------

#: The widest row the register path holds: 16 keys a thread at 32 warps
#: (64 registers, no spills on sm_90); 32768 spills (32 keys a thread at 32
#: warps, or 64 at 16) and would lose to the sliced path anyway.
REGISTER_MAX_TILE = 16384


@triton.jit
def _counted_digit(keys, prefix, k, SHIFT: tl.constexpr):
    """One pass of :func:`_kth_largest_counted`: the prefix extended by the
    digit at SHIFT, and whether exactly k keys are at or above it."""
    # The prefix's digits from this one down are 0: adding d * step sets this one.
    step = tl.full((), 1 << SHIFT, tl.uint32)
    # Counts below 2**15 (TILE <= 16384): two share an int32.
    # (A key at or above the second threshold is at or above the first.)
    low_two = tl.where(keys >= prefix + 2 * step, 0x8001, tl.where(keys >= prefix + step, 1, 0))
    top = tl.where(keys >= prefix + 3 * step, 1, 0)
    packed = tl.sum(low_two, 0)
    at_least_3 = tl.sum(top, 0)
    at_least_1 = packed & 0x7FFF
    at_least_2 = packed >> 15
    digit = (at_least_1 >= k).to(tl.int32) + (at_least_2 >= k).to(tl.int32) + (at_least_3 >= k).to(tl.int32)
    reached = tl.where(digit == 3, at_least_3, tl.where(digit == 2, at_least_2, at_least_1))
    return prefix + digit.to(tl.uint32) * step, ((digit > 0) & (reached == k)).to(tl.int32)


@triton.jit
def _kth_largest_counted(keys, k, lo, hi):
    """:func:`_kth_largest_between` by counting instead of histograms: the
    k-th largest of a register tensor of more than k valid keys (invalid
    ones 0) whose valid keys lie in ``[lo, hi]``, as a (threshold, equal
    keys to take) pair for :func:`_place_tile`.

    Two bits a pass: the keys >= ``prefix + d * 2**shift`` are counted for
    d = 1, 2, 3 (three compares a key, no prefix mask: a key above the
    prefix counts for every d, one below for none; the invalid keys, 0, for
    none), and the digit is how many of those counts reach k.  A pass costs
    ~10 instructions a key on sm_90, against ~75 for an 8-bit
    ``tl.histogram`` (4x the bits): about half the instructions, for 4x the
    passes (each two block-wide sums).  Passes of the
    digits ``lo`` and ``hi`` share are skipped, and so are those after a
    count of exactly k (every key at or above that threshold is taken)."""
    prefix = tl.full((), 0, tl.uint32)
    shared = lo ^ hi
    done = tl.full((), 0, tl.int32)
    for p in tl.static_range(16):
        if (shared >> (30 - 2 * p)) == 0:
            prefix = (hi >> (30 - 2 * p)) << (30 - 2 * p)
        elif done == 0:
            prefix, done = _counted_digit(keys, prefix, k, 30 - 2 * p)
    above = tl.sum((keys > prefix).to(tl.int32), 0)
    return prefix, k - above


@triton.jit
def topk_register_kernel(
    logits_ptr,  # [rows, C] float32/bf16/fp16 (row stride lg_sr)
    visible_ptr,  # [rows] int32/int64
    out_ptr,  # [rows, K] int32: selected columns, then -1
    num_columns, lg_sr,
    K: tl.constexpr, TILE: tl.constexpr, BITS: tl.constexpr, COUNTED: tl.constexpr, PAD_TILE: tl.constexpr,
):
    """The whole top-k of one row held in registers (module docstring,
    register path): one load, a radix select over the registers (BITS-bit
    histograms, or COUNTED: 2-bit digits by counting), one placement; no
    workspace.  TILE >= C (the plan makes sure)."""
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * lg_sr
    cols = tl.arange(0, TILE)
    # Masked by the row's columns, not its visible width, so that the load
    # need not wait for visible_blocks.
    raw = tl.load(logits_row + cols, mask=cols < num_columns, other=0.0)
    width = _row_width(visible_ptr, row, num_columns)
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
        if COUNTED:
            threshold, take_equal = _kth_largest_counted(keys, K, lowest, highest)
        else:
            threshold, take_equal = _kth_largest_between(keys, valid, K, lowest, highest, 32 // BITS, BITS)
    # TILE <= 16384: the two prefix counts fit the 16-bit halves of an int32.
    _place_tile(keys, cols, valid, threshold, take_equal, zero, zero, out_row)
    _pad(out_row, tl.minimum(width, K), K, PAD_TILE)


# --------------------------------------------------------------------------
# Ticketed path: one launch, several programs per row, roles by ticket.
# --------------------------------------------------------------------------

@triton.jit
def _scaled_lower_bound(keys, k, lo, hi, PASSES: tl.constexpr, BITS: tl.constexpr):
    """A lower bound of the k-th largest of keys lying in ``[lo, hi]`` (at
    least k of them), by digits of ``key - lo`` fitted to the range: each
    pass histograms the BITS bits below the top bit of the range's span and
    narrows the range to the chosen digit's, whose lowest key value is the
    bound.  One pass over keys spanning 24 bits resolves what two 8-bit
    passes from the top bit do (the first holds the bits all keys share)."""
    remaining = tl.full((), 0, tl.int32) + k
    done = (lo == hi).to(tl.int32)
    for p in tl.static_range(PASSES):
        if done == 0:
            # Bit length of the span from its float32 exponent (rounded up at
            # worst: a digit a bit coarser, never wrong).
            span = hi - lo
            length = ((span.to(tl.float32).to(tl.uint32, bitcast=True) >> 23) - 126).to(tl.int32)
            shift = tl.maximum(length - BITS, 0).to(tl.uint32)
            match = (keys >= lo) & (keys <= hi)
            digits = ((keys - lo) >> shift).to(tl.int32)
            digit, above, exact = _digit_of_kth(tl.histogram(digits, 1 << BITS, mask=match), remaining, BITS)
            lo = lo + (digit.to(tl.uint32) << shift)  # <= the digit's keys <= hi: no overflow
            # The digit's keys lie below lo + 2**shift (when that fits 32 bits) and at most hi.
            last = lo + ((tl.full((), 1, tl.uint32) << shift) - 1)
            hi = tl.where(last >= lo, tl.minimum(hi, last), hi)
            remaining -= above
            # Exact: the k-th largest is the digit's lowest key, lo or above.
            done = (exact | (lo == hi)).to(tl.int32)
    return lo


@triton.jit
def _ticketed_group_maxima(logits_row, maxima, slice_id, width, num_columns,
                           SLICE: tl.constexpr, GROUPS: tl.constexpr):
    """Folds the slice's keys into the row's G strided group maxima (column
    ``c`` in group ``c % G``; invisible columns key 0): atomic maxima, so
    the result is every slice's, whatever their order."""
    SPAN: tl.constexpr = min(SLICE, GROUPS)  # groups one slice row covers
    # The slice viewed as [SLICE // SPAN, SPAN]: a column of the view is one group.
    first = slice_id * SLICE
    span = tl.arange(0, SPAN)
    offsets = first + tl.arange(0, SLICE // SPAN)[:, None] * SPAN + span[None, :]
    raw = tl.load(logits_row + offsets, mask=offsets < num_columns, other=0.0)
    keys = tl.where(offsets < width, order_key(raw.to(tl.float32)), 0)
    tl.atomic_max(maxima + (first + span) % GROUPS, tl.max(keys, 0), sem="relaxed", scope="gpu")


@triton.jit
def wait_for(counter, target):
    """Spins until ``*counter >= target`` (acquire: what was published before
    each increment is visible after)."""
    arrived = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    while arrived < target:
        arrived = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")


@triton.jit
def _ticketed_finish(logits_row, counts_row, cand_keys, cand_cols, out_row, width, bound, top,
                     K: tl.constexpr, SLICES: tl.constexpr, SLICE: tl.constexpr, REGION: tl.constexpr,
                     CAND_TILE: tl.constexpr, COUNTS_TILE: tl.constexpr, BITS: tl.constexpr):
    """The selection from every slice's candidates (keys >= bound, each
    slice's in its REGION of the buffers, in column order), held in
    registers; or, when they do not fit CAND_TILE, from the row itself."""
    s = tl.arange(0, COUNTS_TILE)
    # (.cg: written by other programs of this launch.)
    at_least = tl.load(counts_row + s, mask=s < SLICES, other=0, cache_modifier=".cg")
    above = tl.load(counts_row + SLICES + s, mask=s < SLICES, other=0, cache_modifier=".cg")
    total = tl.sum(at_least, 0)
    zero = tl.full((), 0, tl.int32)
    UNROLL: tl.constexpr = 8
    if total <= CAND_TILE:  # then no slice overflowed its region (REGION >= min(SLICE, CAND_TILE))
        # Entry i of the concatenation lies in the region of the slice whose
        # candidates it reaches: skip the unused rest of every region before.
        # (UNROLL slices a step, unrolled: their loads do not wait for one another.
        # Steps past the last slice move only entries >= total, never loaded.)
        idx = tl.arange(0, CAND_TILE)
        src = idx
        first = zero
        for base in range(0, SLICES, UNROLL):
            for j in tl.static_range(UNROLL):
                count = tl.load(counts_row + base + j, mask=base + j < SLICES, other=0, cache_modifier=".cg")
                first += count
                src = tl.where(idx >= first, src + (REGION - count), src)
        valid = idx < total
        keys = tl.load(cand_keys + src, mask=valid, other=0, cache_modifier=".cg").to(tl.uint32, bitcast=True)
        cols = tl.load(cand_cols + src, mask=valid, other=-1, cache_modifier=".cg")
        threshold = tl.full((), 0, tl.uint32)
        take_equal = zero + K
        if total > K:
            threshold, take_equal = _kth_largest_between(keys, valid, K, bound, top, 32 // BITS, BITS)
        _place_tile(keys, cols, valid, threshold, take_equal, zero, zero, out_row)
    elif tl.sum(above, 0) < K:
        # Too many keys equal the bound, and it is the k-th largest: all keys
        # above it, then the first K - above equal to it.
        _place(logits_row, logits_row, zero, width, bound, K - tl.sum(above, 0), zero, zero,
               out_row, out_row, SLICE, True, False)
    else:
        _select_and_place(logits_row, logits_row, width, K, tl.full((), 0, tl.uint32),
                          tl.full((), 0xFFFFFFFF, tl.uint32), out_row, True, SLICE, BITS, False)


@triton.jit
def ticketed_publish(counter):
    """Counts this program done (release): every thread's stores before the
    count (one thread adds) are visible to a program that acquires it."""
    tl.debug_barrier()
    tl.atomic_add(counter, 1, sem="release", scope="gpu")


@triton.jit
def ticketed_compact_and_select(logits_row, raw, cols, tickets, maxima, counts_row, cand_keys, cand_cols, out_row,
                                width, slice_id,
                                K: tl.constexpr, SLICES: tl.constexpr, SLICE: tl.constexpr, GROUPS: tl.constexpr,
                                REGION: tl.constexpr, CAND_TILE: tl.constexpr, COUNTS_TILE: tl.constexpr,
                                BITS: tl.constexpr, BOUND_PASSES: tl.constexpr, SCALED: tl.constexpr,
                                PAD_TILE: tl.constexpr):
    """Steps 2 and 3 of the ticketed path for slice ``slice_id`` (its keys
    ``raw`` at columns ``cols``), once the group maxima are all folded.
    Returns whether this program was the row's last: it selected into
    ``out_row``, padded it, and put the row's state back to zero."""
    # Every such program derives the same bound L <= the k-th largest key
    # (k groups have a maximum >= L); empty groups (0) only lower it.
    groups = tl.arange(0, GROUPS)
    group_maxima = tl.load(maxima + groups, cache_modifier=".cg")
    top = tl.max(group_maxima, 0)
    if SCALED:
        # (Empty groups, 0, widen the span: a looser bound, never a wrong one.)
        bound = _scaled_lower_bound(group_maxima, K, tl.min(group_maxima, 0), top, BOUND_PASSES, BITS)
    else:
        bound, _remaining = _kth_largest_between(group_maxima, groups < GROUPS, K, tl.min(group_maxima, 0),
                                                 top, BOUND_PASSES, BITS)
    # The slice's keys >= L, in column order, into its region.
    valid = cols < width
    keys = tl.where(valid, order_key(raw.to(tl.float32)), 0)
    at_least = (valid & (keys >= bound)).to(tl.int32)
    slot = tl.cumsum(at_least, 0) - at_least
    keep = (at_least != 0) & (slot < REGION)
    region = slice_id * REGION
    tl.store(cand_keys + region + slot, keys.to(tl.int32, bitcast=True), mask=keep)
    tl.store(cand_cols + region + slot, cols, mask=keep)
    # SLICE <= 16384: both counts fit the 16-bit halves of one sum.
    totals = tl.sum(at_least + ((valid & (keys > bound)).to(tl.int32) << 16), 0)
    tl.store(counts_row + slice_id, totals & 0xFFFF)
    tl.store(counts_row + SLICES + slice_id, totals >> 16)
    # Every thread's stores before the ticket; the last slice to draw sees them all.
    tl.debug_barrier()
    last = tl.atomic_add(tickets + 2, 1, sem="acq_rel", scope="gpu") == SLICES - 1
    if last:
        _ticketed_finish(logits_row, counts_row, cand_keys, cand_cols, out_row, width, bound, top,
                         K, SLICES, SLICE, REGION, CAND_TILE, COUNTS_TILE, BITS)
        _pad(out_row, tl.minimum(width, K), K, PAD_TILE)
        # Every program of the row has started and is past its waits:
        # the state is free again (select_paged_tokens' chunks reuse it).
        tl.store(tickets + tl.arange(0, 4), tl.zeros((4,), tl.int32))
        tl.store(maxima + groups, tl.zeros((GROUPS,), tl.uint32))
    return last


@triton.jit
def topk_ticketed_kernel(
    logits_ptr,  # [rows, C] float32/bf16/fp16 (row stride lg_sr)
    visible_ptr,  # [rows] int32/int64
    state_in_ptr,  # [rows, 4 + GROUPS] int32 zeros: state_ptr's memory (JAX aliases them; read through state_ptr)
    out_ptr,  # [rows, K] int32: selected columns, then -1
    counts_ptr,  # [rows, 2, SLICES] int32: each slice's keys >= L, then its keys > L
    cand_key_ptr,  # [rows, SLICES, REGION] int32: candidate order keys, a region per slice
    cand_col_ptr,  # [rows, SLICES, REGION] int32: their columns
    state_ptr,  # [rows, 4 + GROUPS] int32: tickets (programs started, maxima folded, slices compacted, unused),
                # then the group maxima (order keys); zero again when the row is done
    num_columns, lg_sr,
    K: tl.constexpr, SLICES: tl.constexpr, SLICE: tl.constexpr, GROUPS: tl.constexpr,
    REGION: tl.constexpr, CAND_TILE: tl.constexpr, COUNTS_TILE: tl.constexpr,
    BITS: tl.constexpr, BOUND_PASSES: tl.constexpr, SCALED: tl.constexpr, PAD_TILE: tl.constexpr,
):
    """The whole top-k of one row by its 2 x SLICES programs (module
    docstring, ticketed path).

    A program's role is its start ticket, not its program id: the first
    SLICES to start fold their slice into the group maxima; the others wait
    for those, derive the bound and compact their slice's candidates; the
    last of them to finish selects.  A program only waits for programs that
    started before it, which therefore run: no deadlock however the GPU
    schedules them, and Triton's interpreter (programs one after another)
    finds every wait already met.
    """
    row = tl.program_id(0).to(tl.int64)
    tickets = state_ptr + row * (4 + GROUPS)
    maxima = (tickets + 4).to(tl.pointer_type(tl.uint32))
    role = tl.atomic_add(tickets, 1, sem="relaxed", scope="gpu")
    width = _row_width(visible_ptr, row, num_columns)
    logits_row = logits_ptr + row * lg_sr
    if role < SLICES:
        _ticketed_group_maxima(logits_row, maxima, role, width, num_columns, SLICE, GROUPS)
        ticketed_publish(tickets + 1)
    else:
        slice_id = role - SLICES
        cols = slice_id * SLICE + tl.arange(0, SLICE)
        # Loaded before the wait: the row does not depend on the other programs.
        raw = tl.load(logits_row + cols, mask=cols < num_columns, other=0.0)
        wait_for(tickets + 1, SLICES)
        ticketed_compact_and_select(logits_row, raw, cols, tickets, maxima, counts_ptr + row * (2 * SLICES),
                                    cand_key_ptr + row * (SLICES * REGION), cand_col_ptr + row * (SLICES * REGION),
                                    out_ptr + row * K, width, slice_id, K, SLICES, SLICE, GROUPS, REGION,
                                    CAND_TILE, COUNTS_TILE, BITS, BOUND_PASSES, SCALED, PAD_TILE)


def topk_path(rows: int, columns: int, k: int, tuning: TopkTuning) -> str:
    """``"register"`` (one program per row, the row in registers), ``"row"``
    (one program per row, streamed), ``"ticketed"`` (rows split over the
    programs of one launch) or ``"sliced"`` (rows split over the programs of
    four launches), from the static shape unless ``tuning.path`` forces one."""
    if tuning.path != "auto":
        if tuning.path == "register" and columns > REGISTER_MAX_TILE:
            raise ValueError(f"TopkTuning: path 'register' holds a row in registers: at most "
                             f"{REGISTER_MAX_TILE} columns, got {columns}")
        return tuning.path
    if columns <= min(tuning.register_max_columns, REGISTER_MAX_TILE):
        return "register"
    if columns <= tuning.row_max_columns or rows >= tuning.row_min_rows:
        return "row"
    return "ticketed" if columns <= tuning.ticketed_max_columns else "sliced"


def topk_groups(columns: int, k: int, tuning: TopkTuning) -> int:
    """G >= 2k strided groups keep the candidates (keys at or above the k-th
    largest group maximum) near k; G >= C makes single-column groups."""
    return min(triton.next_power_of_2(2 * k), triton.next_power_of_2(max(columns, 1)), tuning.max_groups)


def topk_parts(rows: int, columns: int, k: int, logits_stride: int, row_counts,
               logits: str, visible: str, out: str, tuning: TopkTuning):
    """Workspaces and launches of an exact top-k over ``logits`` ``[rows, columns]``.

    The path and tiling are chosen for ``rows``; ``row_counts`` are the rows
    of each run of the launches (several runs reuse the workspaces).
    """
    if rows == 0 or k == 0:
        return (), ()
    parts = dict(register=_register_parts, row=_row_parts, ticketed=_ticketed_parts,
                 sliced=_sliced_parts)[topk_path(rows, columns, k, tuning)]
    return parts(rows, columns, k, logits_stride, row_counts, logits, visible, out, tuning)


def register_tiling(columns: int, tuning: TopkTuning) -> tuple[int, int]:
    """(TILE, warps) of the register path: TILE covers the row, with
    ``register_keys_per_thread`` keys a thread (more past 32 warps)."""
    tile = max(16, triton.next_power_of_2(max(columns, 1)))
    assert tile <= REGISTER_MAX_TILE, "the register path holds the whole row"
    warps = max(1, min(tuning.register_max_warps, tile // (32 * tuning.register_keys_per_thread)))
    return tile, warps


def _register_parts(rows, columns, k, logits_stride, row_counts, logits, visible, out, tuning: TopkTuning):
    """The register path: one launch of one program per row, no workspace."""
    tile, warps = register_tiling(columns, tuning)
    launches = tuple(
        Launch(topk_register_kernel, (count,), (logits, visible), (out,),
               dict(num_columns=columns, lg_sr=logits_stride),
               dict(K=k, TILE=tile, BITS=tuning.register_radix_bits, COUNTED=tuning.register_select == "count",
                    PAD_TILE=min(1024, triton.next_power_of_2(k))),
               num_warps=warps, num_stages=1)
        for count in row_counts)
    return (), launches


def _row_parts(rows, columns, k, logits_stride, row_counts, logits, visible, out, tuning: TopkTuning):
    """The row path: one launch of one program per row."""
    width = max(columns, 1)
    row_width = max(16, triton.next_power_of_2(width))
    groups = topk_groups(columns, k, tuning)
    share = 1 if rows < tuning.row_many_rows else 2
    warps = max(1, tuning.row_warps // share)
    keys_per_thread = max(1, tuning.row_keys_per_thread // share)
    # Single-column groups: the bound would be the answer itself, so the
    # radix select runs on the row (TILE covers it: width <= G <= 4096).
    bounded = groups < triton.next_power_of_2(width)
    if bounded:
        # G maxima and G // 2 candidates stay in registers: 8 a thread at most.
        warps = max(warps, min(32, groups // 256))
        tile = min(row_width, keys_per_thread * 32 * warps)
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
                    PAD_TILE=min(1024, triton.next_power_of_2(k))),
               num_warps=warps, num_stages=1)
        for count in row_counts)
    return buffers, launches


def ticketed_layout(columns: int, k: int, tuning: TopkTuning, widest_slice: int = 4096) -> tuple[dict, int]:
    """(constexprs, least warps its registers need) of the ticketed path's
    selection of a row of ``columns`` (the fused selection's too, with
    slices to ``widest_slice`` columns)."""
    width = max(columns, 1)
    # Wider slices (to widest_slice columns) past ticketed_max_slices a row.
    slice_columns = max(tuning.ticketed_slice,
                        min(widest_slice, triton.next_power_of_2(triton.cdiv(width, tuning.ticketed_max_slices))))
    slice_columns = min(slice_columns, max(16, triton.next_power_of_2(width)))
    slices = triton.cdiv(width, slice_columns)
    groups = topk_groups(columns, k, tuning)
    # About 1.4k keys of a long row reach the bound (G = 2k groups: each
    # has a maximum >= L with probability 1/2, so a key with 1 - 2**(-G/C)):
    # 4k fit, or 4096 (16 warps, 8 keys a thread: registers) for k > 512.
    cand_tile = min(4096, max(16, triton.next_power_of_2(4 * k)))
    # A slice with more candidates than fit the tile sends the row to the fallback anyway.
    region = min(slice_columns, cand_tile)
    # 16 keys a thread in tiles of 2048 (4 warps), 8 in wider ones (registers).
    widest = max(slice_columns, cand_tile, groups)
    least_warps = max(1, widest // (32 * (16 if widest <= 2048 else 8)))
    # The scaled bound needs k maxima (fewer: the fixed radix's bound is 0, as it must be).
    scaled = tuning.ticketed_bound == "scaled" and groups >= k
    constexprs = dict(K=k, SLICES=slices, SLICE=slice_columns, GROUPS=groups, REGION=region, CAND_TILE=cand_tile,
                      COUNTS_TILE=triton.next_power_of_2(slices), BITS=tuning.radix_bits,
                      BOUND_PASSES=tuning.ticketed_bound_passes if scaled else tuning.bound_passes, SCALED=scaled,
                      PAD_TILE=min(1024, triton.next_power_of_2(k)))
    return constexprs, least_warps


def ticketed_buffers(rows: int, layout: dict) -> tuple[Buffer, ...]:
    """The ticketed path's state (zeros, left at zero) and workspaces for ``rows`` rows."""
    slices, region = layout["SLICES"], layout["REGION"]
    return (Buffer("topk_state", (rows, 4 + layout["GROUPS"]), "int32", fill=0),
            Buffer("topk_counts", (rows, 2, slices), "int32"),
            Buffer("topk_cand_key", (rows, slices, region), "int32"),
            Buffer("topk_cand_col", (rows, slices, region), "int32"))


def _ticketed_parts(rows, columns, k, logits_stride, row_counts, logits, visible, out, tuning: TopkTuning):
    """The ticketed path: one launch of 2 x slices programs per row."""
    layout, least_warps = ticketed_layout(columns, k, tuning)
    buffers = ticketed_buffers(rows, layout)
    state, workspaces = buffers[0].name, tuple(buffer.name for buffer in buffers[1:])
    launches = tuple(
        Launch(topk_ticketed_kernel, (count, 2 * layout["SLICES"]), (logits, visible, state),
               (out, *workspaces, state), dict(num_columns=columns, lg_sr=logits_stride), layout,
               num_warps=max(tuning.ticketed_warps, least_warps), num_stages=1)
        for count in row_counts)
    return buffers, launches


def _sliced_parts(rows, columns, k, logits_stride, row_counts, logits, visible, out, tuning: TopkTuning):
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


@stage(
    arrays=("logits", "visible_blocks"),
    options=dict(k=NONNEGATIVE_INT),
    doc=TOPK_DOC, returns="Array", tuning=dict(tuning="topk"))
def plan_topk_blocks(logits: ArrayInfo, visible_blocks: ArrayInfo, k: int, *,
                     tuning: TopkTuning | None = None) -> Program:
    """Validate ``topk_blocks`` arguments and describe its launches (see docs/api.md)."""
    check = Checker("topk_blocks")
    check.array("logits", logits, 2, "[R, C]", FLOAT_DTYPES)
    rows, columns = logits.shape
    check.index_vector("visible_blocks", visible_blocks, rows, "R")
    out = Buffer("out", (rows, k), "int32")
    buffers, launches = topk_parts(rows, columns, k, logits.strides[0], [rows],
                                   "logits", "visible_blocks", "out", tuning)
    return Program("topk_blocks", (out,) + buffers, launches, ("out",))

