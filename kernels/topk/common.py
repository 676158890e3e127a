"""What the top-k paths share: order keys, radix digits, placement.

Keys are order-preserving uint32 (:func:`order_key`: ``-0.0 == +0.0``, NaN
below ``-inf``); a radix select finds the k-th largest key a digit at a time
(most significant first: a histogram of the digit among the keys matching
the prefix so far, then the digit holding the k-th largest from a prefix sum
taken from the top), and a placement writes the selected columns in column
order, ties to the lower column (prefix sums over column order).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..tuning import TopkTuning


@triton.jit
def order_key(x):
    """float32 -> uint32 whose unsigned order is the ranking (NaN lowest, -0.0 == +0.0)."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.uint32, bitcast=True)
    key = tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    return tl.where(x != x, 0, key)


@triton.jit
def source(key_ptr, col_ptr, idx, n, FROM_LOGITS: tl.constexpr, GATHER: tl.constexpr = False):
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
def digit_histogram(keys, valid, prefix, PASS: tl.constexpr, BITS: tl.constexpr):
    """Histogram of digit PASS (most significant first) of the keys matching ``prefix``'s higher digits."""
    SHIFT: tl.constexpr = 32 - (PASS + 1) * BITS
    match = valid
    if PASS > 0:
        match = match & ((keys >> (SHIFT + BITS)) == (prefix >> (SHIFT + BITS)))
    digits = ((keys >> SHIFT) & ((1 << BITS) - 1)).to(tl.int32)
    return tl.histogram(digits, 1 << BITS, mask=match)


@triton.jit
def choose_digit(histogram, prefix, remaining, PASS: tl.constexpr, BITS: tl.constexpr):
    """Digit of the ``remaining``-th largest key; returns the extended prefix and what remains to take."""
    prefix, remaining, _exact = choose_digit_exact(histogram, prefix, remaining, PASS, BITS)
    return prefix, remaining


@triton.jit
def choose_digit_exact(histogram, prefix, remaining, PASS: tl.constexpr, BITS: tl.constexpr):
    """:func:`choose_digit`, and whether the chosen digit's keys are
    exactly what remains to take (then every key matching the prefix is
    taken: the prefix, with ``remaining`` equal keys, is a final answer)."""
    SHIFT: tl.constexpr = 32 - (PASS + 1) * BITS
    digit, above, exact = digit_of_kth(histogram, remaining, BITS)
    return prefix | (digit.to(tl.uint32) << SHIFT), remaining - above, exact


@triton.jit
def digit_of_kth(histogram, remaining, BITS: tl.constexpr):
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
def kth_largest_resident(keys, valid, k, BITS: tl.constexpr):
    """(k-th largest key, how many keys equal to it are among the top k) of a register tensor."""
    return kth_largest_prefix(keys, valid, k, 32 // BITS, BITS)


@triton.jit
def kth_largest_prefix(keys, valid, k, PASSES: tl.constexpr, BITS: tl.constexpr):
    """The top ``PASSES * BITS`` bits of the k-th largest key of a register
    tensor, low bits zero (a lower bound of it; 0 if there are fewer than k
    keys), and what remains to take of the keys matching them."""
    prefix = tl.full((), 0, tl.uint32)
    remaining = tl.full((), 0, tl.int32) + k
    for p in tl.static_range(PASSES):
        histogram = digit_histogram(keys, valid, prefix, p, BITS)
        prefix, remaining = choose_digit(histogram, prefix, remaining, p, BITS)
    return prefix, remaining


@triton.jit
def kth_largest_between(keys, valid, k, lo, hi, PASSES: tl.constexpr, BITS: tl.constexpr):
    """:func:`kth_largest_prefix` of keys known to lie in ``[lo, hi]``, as
    a (threshold, equal keys to take) pair that :func:`place_tile` accepts
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
            histogram = digit_histogram(keys, valid, prefix, p, BITS)
            prefix, remaining, exact = choose_digit_exact(histogram, prefix, remaining, p, BITS)
            done = exact.to(tl.int32)
    return prefix, remaining


@triton.jit
def _streamed_histogram(key_ptr, col_ptr, n, prefix, shift, FROM_LOGITS: tl.constexpr, TILE: tl.constexpr,
                        BITS: tl.constexpr, GATHER: tl.constexpr):
    """Histogram of the digit at ``shift`` (a scalar: ``32 - BITS`` is the
    first digit) of source entries ``[0, n)`` whose higher digits match
    ``prefix``'s, a tile at a time."""
    # No digits above the first: the comparison is then skipped, its shift kept below 32 (defined).
    high = tl.minimum(shift + BITS, 31)
    first = shift + BITS == 32
    histogram = tl.zeros((1 << BITS,), tl.int32)
    start = tl.full((), 0, tl.int32)
    while start < n:
        keys, _cols, valid = source(key_ptr, col_ptr, start + tl.arange(0, TILE), n, FROM_LOGITS, GATHER)
        match = valid & (first | ((keys >> high) == (prefix >> high)))
        digits = ((keys >> shift) & ((1 << BITS) - 1)).to(tl.int32)
        histogram += tl.histogram(digits, 1 << BITS, mask=match)
        start += TILE
    return histogram


@triton.jit
def kth_largest_streamed(key_ptr, col_ptr, n, k, FROM_LOGITS: tl.constexpr,
                          TILE: tl.constexpr, BITS: tl.constexpr, GATHER: tl.constexpr = False,
                          UNROLLED: tl.constexpr = False):
    """As :func:`kth_largest_resident` over source entries ``[0, n)``, a tile
    at a time.  Its ``32 // BITS`` passes are a runtime loop (the digit's
    shift a runtime value), one copy of a histogram's code where unrolled
    passes would make these fallback paths a large part of the kernels that
    hold them (docs/design.md, "JAX call overhead"); or, with UNROLLED,
    unrolled (the row path: under Triton 3.7 ptxas spills its kernel with
    the loop)."""
    prefix = tl.full((), 0, tl.uint32)
    remaining = tl.full((), 0, tl.int32) + k
    if UNROLLED:
        for p in tl.static_range(32 // BITS):
            histogram = _streamed_histogram(key_ptr, col_ptr, n, prefix, tl.full((), 32 - (p + 1) * BITS, tl.int32),
                                            FROM_LOGITS, TILE, BITS, GATHER)
            prefix, remaining = choose_digit(histogram, prefix, remaining, p, BITS)
    else:
        shift = tl.full((), 32, tl.int32)
        while shift > 0:
            shift -= BITS
            histogram = _streamed_histogram(key_ptr, col_ptr, n, prefix, shift, FROM_LOGITS, TILE, BITS, GATHER)
            digit, above, _exact = digit_of_kth(histogram, remaining, BITS)
            prefix = prefix | (digit.to(tl.uint32) << shift)
            remaining -= above
    return prefix, remaining


@triton.jit
def place(key_ptr, col_ptr, start, end, threshold, take_equal, equal_before, position,
           out_ptr, key_out_ptr, TILE: tl.constexpr, FROM_LOGITS: tl.constexpr,
           WRITE_KEYS: tl.constexpr):
    """Writes, in source order from ``position`` on, the columns of entries in
    ``[start, end)`` with key > threshold, and of those equal to it whose rank
    among equal keys (counting ``equal_before`` earlier ones) is below
    ``take_equal``."""
    while start < end:
        keys, cols, valid = source(key_ptr, col_ptr, start + tl.arange(0, TILE), end, FROM_LOGITS)
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
def exclusive_cumsum_2d(x):
    """(Exclusive prefix sums of a ``[R, W]`` tensor in row-major order, its
    sum): a scan within rows, then one over the R row sums.  Triton's scan
    of one long axis combines the warps' totals once per element a thread
    holds; this combines them once per row sum (on sm_90, ~105 instructions
    a key for the row path's 8192-key tile at 16 warps as one long scan)."""
    row_sums = tl.sum(x, 1)
    rows_before = tl.cumsum(row_sums, 0) - row_sums
    return rows_before[:, None] + tl.cumsum(x, 1) - x, tl.sum(row_sums, 0)


@triton.jit
def chunked_columns(TILE: tl.constexpr, CHUNK: tl.constexpr):
    """Offsets ``0 .. TILE - 1`` viewed as ``[TILE // CHUNK, CHUNK]``
    (consecutive columns along a row of the view): the shape of a
    compaction's tile, whose prefix sums go within chunks, then over their
    counts (:func:`exclusive_cumsum_2d`)."""
    return tl.arange(0, TILE // CHUNK)[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]


@triton.jit
def load_tile_before(logits_row, start, offsets, end, num_columns):
    """Raw logits of columns ``start + offsets`` if the tile starts below
    ``end`` (the caller masks the columns past it), for a loop that loads
    the next tile while it reduces this one.  Masked by the row's columns,
    not by ``end``: a mask that changes only at a multiple of 16 (the
    columns, as torch specialises them or JAX's constant) keeps the loads
    vectorised, where one changing at any column made them scalar (four
    times the load instructions)."""
    cols = start + offsets
    return tl.load(logits_row + cols, mask=(cols < num_columns) & (start < end), other=0.0)


@triton.jit
def place_tile(keys, cols, valid, threshold, take_equal, equal_before, position, out_ptr):
    """:func:`place` of one register tile: writes, from ``position`` on in
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
def select_and_place(logits_row, candidates, n, k, lo, hi, out_ptr, FROM_LOGITS: tl.constexpr,
                      TILE: tl.constexpr, BITS: tl.constexpr, RESIDENT: tl.constexpr,
                      UNROLLED: tl.constexpr = False):
    """Writes the columns of the k largest of source entries ``[0, n)``
    (the logits row, or the candidate columns of it), whose keys lie in
    ``[lo, hi]``, in source order; in registers when they fit one tile (and
    RESIDENT), else streamed a tile at a time (UNROLLED: as
    :func:`kth_largest_streamed`'s)."""
    zero = tl.full((), 0, tl.int32)
    GATHER: tl.constexpr = not FROM_LOGITS
    if RESIDENT and n <= TILE:
        keys, cols, valid = source(logits_row, candidates, tl.arange(0, TILE), n, FROM_LOGITS, GATHER)
        threshold, take_equal = kth_largest_between(keys, valid, k, lo, hi, 32 // BITS, BITS)
        place_tile(keys, cols, valid, threshold, take_equal, zero, zero, out_ptr)
    else:
        threshold, take_equal = kth_largest_streamed(logits_row, candidates, n, k, FROM_LOGITS, TILE, BITS, GATHER,
                                                      UNROLLED)
        position = zero
        equal_before = zero
        start = zero
        while start < n:
            keys, cols, valid = source(logits_row, candidates, start + tl.arange(0, TILE), n, FROM_LOGITS, GATHER)
            position, equal_before = place_tile(keys, cols, valid, threshold, take_equal, equal_before,
                                                 position, out_ptr)
            start += TILE


@triton.jit
def row_width(visible_ptr, row, num_columns):
    return tl.minimum(tl.maximum(tl.load(visible_ptr + row).to(tl.int64), 0), num_columns).to(tl.int32)


@triton.jit
def pad(out_row, selected, K: tl.constexpr, PAD_TILE: tl.constexpr):
    """-1 in ``out_row[selected:K]``."""
    for t in range((K + PAD_TILE - 1) // PAD_TILE):
        cols = t * PAD_TILE + tl.arange(0, PAD_TILE)
        tl.store(out_row + cols, tl.full((PAD_TILE,), -1, tl.int32), mask=(cols >= selected) & (cols < K))


def topk_groups(columns: int, k: int, tuning: TopkTuning) -> int:
    """G >= 2k strided groups keep the candidates (keys at or above the k-th
    largest group maximum) near k; G >= C makes single-column groups."""
    return min(triton.next_power_of_2(2 * k), triton.next_power_of_2(max(columns, 1)), tuning.max_groups)
