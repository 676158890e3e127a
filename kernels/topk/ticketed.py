"""Top-k ticketed path: one launch of 2 x S programs a row, roles by ticket.

For fewer than ``TopkTuning.row_min_rows`` rows wider than the row path
takes, up to ``TopkTuning.ticketed_max_columns`` (one row:
``ticketed_single_row_max_columns``).  A slice is held in registers while
the launch's slice programs stay within ``ticketed_stream_warps`` warps;
past it, slices widen and their programs stream them in tiles of the held
width (TILE; GROUP_TILE for the maxima), with the same slots, so the same
bits.
A program's role is its start ticket
(:mod:`..tickets`), so a program waits only for programs that started
before it (docs/design.md, "Numerics and determinism").

1. the first S programs to start each fold one slice (``ticketed_slice``
   columns, in registers) into the row's G >= 2k strided group maxima by
   atomic max, then count themselves done (release);
2. the other S wait for that count (acquire), each derives the same bound
   ``L`` <= the k-th largest key from the maxima (one pass of digits fitted
   to the maxima's span, :func:`_scaled_lower_bound`, or the row path's
   truncated radix where there are fewer than k maxima or
   ``TopkTuning.ticketed_bound`` says so), and compacts its slice's keys
   >= ``L`` (~1.4 x k a row) into its own region of the candidate buffers, in
   column order;
3. the last of those to finish (an acq_rel ticket) gathers the regions in
   slice order (so column order) into registers and selects, or, when the
   candidates overflow its tile, selects from the row (placing directly when
   ``T == L``); then ``-1`` padding, and the row's state back to zero.

What bounds it (the steps one after another: the maxima, the bound's pass,
the compaction, then the last program's gather and its histogram passes over
the ~700 candidates of a 32768-column row, about two fitted ones, each over
the whole candidate tile), from a timeline of one call: docs/performance.md.

The last program's selection fits its digits to the candidates' span
``[L, T]`` (T the largest maximum) from the first pass, as the bound's
are: ``key - L`` in ``radix_bits`` digits below the span's top bit, so no
pass is spent on bits every candidate shares, however the span straddles a
digit boundary (docs/design.md, "Retired tuning values": the selections
this one replaced).

:func:`ticketed_compact_and_select` is also the fused selection's
(``select.select_fused_kernel``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..launch import Buffer, Launch
from ..pdl import dependent, wait_for_previous_kernel
from ..tickets import finish_ticket, publish, start_ticket, wait_for
from ..tuning import TopkTuning
from .common import (chunked_columns, digit_of_kth, exclusive_cumsum_2d, kth_largest_between, load_tile_before,
                     order_key, pad, place, place_tile, row_width, select_and_place, topk_groups)


@triton.jit
def _scaled_lower_bound(keys, k, lo, hi, PASSES: tl.constexpr, BITS: tl.constexpr):
    """A lower bound of the k-th largest of keys lying in ``[lo, hi]`` (at
    least k of them), by digits of ``key - lo`` fitted to the range: each
    pass histograms the BITS bits below the top bit of the range's span and
    narrows the range to the chosen digit's, whose lowest key value is the
    bound.  One pass over keys spanning 24 bits resolves what two 8-bit
    passes from the top bit do (the first holds the bits all keys share)."""
    bound, _remaining = _fitted_select(keys, tl.full((), 0, tl.int32) + k, lo, hi, (lo == hi).to(tl.int32),
                                       PASSES, BITS)
    return bound


@triton.jit
def _fitted_shift(span, BITS: tl.constexpr):
    """The shift that makes ``(key - lo) >> shift`` a BITS-bit digit of keys
    in ``[lo, lo + span]``: the span's bit length less BITS, at least 0.  The
    length is exact (from the float32 exponent of a value below 2**24, which
    converts exactly: the span, or the span >> 8 for wider ones), so each
    pass takes BITS bits off the range and ``ceil(32 / BITS)`` passes
    resolve any span (a rounded-up length would take a bit less from a wide
    span, and 1-bit digits would never narrow it)."""
    wide = span >= (1 << 24)
    exact = tl.where(wide, span >> 8, span)
    length = ((exact.to(tl.float32).to(tl.uint32, bitcast=True) >> 23) - 126).to(tl.int32) + tl.where(wide, 8, 0)
    return tl.maximum(length - BITS, 0).to(tl.uint32)


@triton.jit
def _fitted_range(lo, hi, digit, shift):
    """The range ``[lo', hi']`` of the keys of ``[lo, hi]`` whose digit
    ``(key - lo) >> shift`` is ``digit``."""
    lo = lo + (digit.to(tl.uint32) << shift)  # <= the digit's keys <= hi: no overflow
    # The digit's keys lie below lo + 2**shift (when that fits 32 bits) and at most hi.
    last = lo + ((tl.full((), 1, tl.uint32) << shift) - 1)
    return lo, tl.where(last >= lo, tl.minimum(hi, last), hi)


@triton.jit
def _fitted_select(keys, remaining, lo, hi, done, PASSES: tl.constexpr, BITS: tl.constexpr):
    """(threshold, equal keys to take), as :func:`place_tile` takes them, of
    the ``remaining``-th largest of the keys in ``[lo, hi]`` (at least that
    many; keys outside it are not counted, and every valid key above ``hi``
    is taken too): BITS-bit digits
    of ``key - lo`` fitted to the range, narrowing it a pass at a time until
    it is one value or its keys are exactly those left to take (``done``);
    PASSES passes resolve any span (the plan's count).  The threshold is the
    range's lowest value: keys below it are not taken, keys above it are,
    and of those equal to it the first ``remaining``.

    A runtime loop, not an unrolled one: one pass's code (a histogram is
    ~900 PTX instructions) instead of PASSES copies, in a kernel whose
    text jaxlib copies and hashes on every execution (docs/design.md,
    "JAX call overhead"), and the same pass's instructions re-run hot."""
    p = tl.full((), 0, tl.int32)
    while (done == 0) & (p < PASSES):
        shift = _fitted_shift(hi - lo, BITS)
        match = (keys >= lo) & (keys <= hi)
        digits = ((keys - lo) >> shift).to(tl.int32)
        digit, above, exact = digit_of_kth(tl.histogram(digits, 1 << BITS, mask=match), remaining, BITS)
        lo, hi = _fitted_range(lo, hi, digit, shift)
        remaining -= above
        done = (exact | (lo == hi)).to(tl.int32)
        p += 1
    return lo, remaining


@triton.jit
def _ticketed_group_maxima(logits_row, maxima, slice_id, width, num_columns,
                           SLICE: tl.constexpr, GROUP_TILE: tl.constexpr, GROUPS: tl.constexpr):
    """Folds the slice's keys into the row's G strided group maxima (column
    ``c`` in group ``c % G``; invisible columns key 0), GROUP_TILE columns
    at a time (the next tile loaded while this one is reduced): atomic
    maxima, so the result is every slice's, whatever their order."""
    SPAN: tl.constexpr = min(GROUP_TILE, GROUPS)  # groups one tile row covers
    # A tile viewed as [GROUP_TILE // SPAN, SPAN]: a column of the view is one group
    # (of every tile: a slice of several tiles has tiles of a multiple of G columns).
    first = slice_id * SLICE
    span = tl.arange(0, SPAN)
    offsets = tl.arange(0, GROUP_TILE // SPAN)[:, None] * SPAN + span[None, :]
    raw = tl.load(logits_row + first + offsets, mask=first + offsets < num_columns, other=0.0)
    if GROUP_TILE == SLICE:  # held: no loop (a loop of one step costs Triton 3.9 registers)
        slice_maxima = tl.max(tl.where(first + offsets < width, order_key(raw.to(tl.float32)), 0), 0)
    else:
        end = tl.minimum(first + SLICE, width)
        slice_maxima = tl.zeros((SPAN,), tl.uint32)
        for t in range(SLICE // GROUP_TILE):
            cols = first + t * GROUP_TILE + offsets
            keys = tl.where(cols < width, order_key(raw.to(tl.float32)), 0)
            raw = load_tile_before(logits_row, first + (t + 1) * GROUP_TILE, offsets, end, num_columns)
            slice_maxima = tl.maximum(slice_maxima, tl.max(keys, 0))
    tl.atomic_max(maxima + (first + span) % GROUPS, slice_maxima, sem="relaxed", scope="gpu")


@triton.jit
def _candidate_sources(counts_row, CAND_TILE: tl.constexpr, SLICES: tl.constexpr, REGION: tl.constexpr,
                       UNROLL: tl.constexpr):
    """(Where entry i of the slices' candidates concatenated lies in the
    candidate buffers, how many candidates there are in all): entry i lies
    in the region of the slice whose candidates it reaches, so the unused
    rest of every region before it is skipped.  The counts are read as
    scalars, UNROLL a step (their loads do not wait for one another: a
    round of loads a step); steps past the last slice move only entries >=
    the total."""
    idx = tl.arange(0, CAND_TILE)
    src = idx
    total = tl.full((), 0, tl.int32)
    for base in range(0, SLICES, UNROLL):
        for j in tl.static_range(UNROLL):
            # (.cg: written by other programs of this launch.)
            count = tl.load(counts_row + base + j, mask=base + j < SLICES, other=0, cache_modifier=".cg")
            total += count
            src = tl.where(idx >= total, src + (REGION - count), src)
    return src, total


@triton.jit
def _ticketed_finish(logits_row, counts_row, cand_keys, cand_cols, out_row, width, bound, top,
                     K: tl.constexpr, SLICES: tl.constexpr, SLICE: tl.constexpr, REGION: tl.constexpr,
                     CAND_TILE: tl.constexpr, COUNTS_TILE: tl.constexpr, BITS: tl.constexpr):
    """The selection from every slice's candidates (keys >= bound, each
    slice's in its REGION of the buffers, in column order), held in
    registers, by passes of BITS-bit digits fitted to ``[bound, top]`` from
    the first; or, when they do not fit CAND_TILE, from the row itself."""
    s = tl.arange(0, COUNTS_TILE)
    zero = tl.full((), 0, tl.int32)
    # The sources before the branch: their loads give the total too (one round of loads, not
    # two, for up to ticketed_max_slices = 16 slices).
    src, total = _candidate_sources(counts_row, CAND_TILE, SLICES, REGION, 16)
    if total <= CAND_TILE:  # then no slice overflowed its region (REGION >= min(SLICE, CAND_TILE))
        idx = tl.arange(0, CAND_TILE)
        threshold = tl.full((), 0, tl.uint32)
        take_equal = zero + K
        # Unused entries: key 0xFFFFFFFF (above every key: order_key gives NaN 0, +inf
        # 0xFF800000), which no fitted range holds, and column -1.
        keys = tl.load(cand_keys + src, mask=idx < total, other=-1, cache_modifier=".cg").to(tl.uint32,
                                                                                               bitcast=True)
        cols = tl.load(cand_cols + src, mask=idx < total, other=-1, cache_modifier=".cg")
        if total > K:
            # ceil(32 / BITS) fitted passes resolve any span (_fitted_shift's exact lengths).
            threshold, take_equal = _fitted_select(keys, zero + K, bound, top, (bound == top).to(tl.int32),
                                                   32 // BITS, BITS)
        place_tile(keys, cols, cols >= 0, threshold, take_equal, zero, zero, out_row)
    else:
        # The row in tiles of at most 1024 keys: a rare path, whose code (a
        # histogram's grows with the keys a thread holds) is in the kernel's
        # registers and in the text jaxlib hashes on every execution
        # (docs/design.md, "JAX call overhead"); at 2048 its four unrolled
        # passes were a third of the kernel's instructions.
        ROW_TILE: tl.constexpr = min(SLICE, 1024)
        # (.cg: written by other programs of this launch.)
        above = tl.sum(tl.load(counts_row + SLICES + s, mask=s < SLICES, other=0, cache_modifier=".cg"), 0)
        if above < K:
            # Too many keys equal the bound, and it is the k-th largest: all keys
            # above it, then the first K - above equal to it.
            place(logits_row, logits_row, zero, width, bound, K - above, zero, zero,
                   out_row, out_row, ROW_TILE, True, False)
        else:
            select_and_place(logits_row, logits_row, width, K, tl.full((), 0, tl.uint32),
                              tl.full((), 0xFFFFFFFF, tl.uint32), out_row, True, ROW_TILE, BITS, False)


@triton.jit
def _compact_tile(raw, cols, width, bound, key_region, col_region, count, above, REGION: tl.constexpr):
    """Writes the tile's keys >= bound and their columns (``raw`` at
    ``cols``, :func:`slice_column_view`'s shape) to the slice's regions of
    the candidate keys and columns from slot ``count`` on, in column order,
    the first REGION of them; returns the counts of keys >= and > bound
    with the tile's added."""
    valid = cols < width
    keys = tl.where(valid, order_key(raw.to(tl.float32)), 0)
    at_least = (valid & (keys >= bound)).to(tl.int32)
    # Keys >= and > the bound counted together, in the 16-bit halves (TILE <= 16384).
    before, totals = exclusive_cumsum_2d(at_least + ((valid & (keys > bound)).to(tl.int32) << 16))
    slot = count + (before & 0xFFFF)
    keep = (at_least != 0) & (slot < REGION)
    tl.store(key_region + slot, keys.to(tl.int32, bitcast=True), mask=keep)
    tl.store(col_region + slot, cols, mask=keep)
    return count + (totals & 0xFFFF), above + (totals >> 16)


@triton.jit
def slice_column_view(slice_id, SLICE: tl.constexpr, TILE: tl.constexpr, CHUNK: tl.constexpr):
    """The columns of the first TILE of slice ``slice_id``, viewed as
    ``[TILE // CHUNK, CHUNK]`` (:func:`.common.chunked_columns`), as the
    compaction of :func:`ticketed_compact_and_select` takes them."""
    return slice_id * SLICE + chunked_columns(TILE, CHUNK)


@triton.jit
def ticketed_compact_and_select(logits_row, raw, cols, tickets, maxima, counts_row, cand_keys, cand_cols, out_row,
                                width, num_columns, slice_id,
                                K: tl.constexpr, SLICES: tl.constexpr, SLICE: tl.constexpr, TILE: tl.constexpr,
                                GROUPS: tl.constexpr,
                                REGION: tl.constexpr, CAND_TILE: tl.constexpr, COUNTS_TILE: tl.constexpr,
                                BITS: tl.constexpr, BOUND_PASSES: tl.constexpr, SCALED: tl.constexpr,
                                PAD_TILE: tl.constexpr):
    """Steps 2 and 3 of the ticketed path for slice ``slice_id``, once the
    group maxima are all folded.  ``cols`` is :func:`slice_column_view`,
    its first TILE columns, ``raw`` their logits; a slice of several tiles
    loads the others itself (a held slice, TILE = SLICE, loads none).
    Returns whether this program was the row's last: it selected into
    ``out_row``, padded it, and put the row's state back to zero.  The
    row's state (``tickets``): 4 tickets, then the GROUPS maxima (``maxima``)."""
    # Every such program derives the same bound L <= the k-th largest key
    # (k groups have a maximum >= L); empty groups (0) only lower it.
    groups = tl.arange(0, GROUPS)
    group_maxima = tl.load(maxima + groups, cache_modifier=".cg")
    top = tl.max(group_maxima, 0)
    if SCALED:
        # (Empty groups, 0, widen the span: a looser bound, never a wrong one.)
        bound = _scaled_lower_bound(group_maxima, K, tl.min(group_maxima, 0), top, BOUND_PASSES, BITS)
    else:
        bound, _remaining = kth_largest_between(group_maxima, groups < GROUPS, K, tl.min(group_maxima, 0),
                                                 top, BOUND_PASSES, BITS)
    # The slice's keys >= L, in column order, into its region, a TILE at a
    # time (the next one loaded while this one is compacted).
    key_region = cand_keys + slice_id * REGION
    col_region = cand_cols + slice_id * REGION
    zero = tl.full((), 0, tl.int32)
    if TILE == SLICE:  # held: no loop (a loop of one step costs Triton 3.9 registers)
        count, above = _compact_tile(raw, cols, width, bound, key_region, col_region, zero, zero, REGION)
    else:
        count, above = zero, zero
        end = tl.minimum((slice_id + 1) * SLICE, width)
        offsets = cols - slice_id * SLICE
        for step in range(SLICE // TILE):
            tile_raw = raw
            raw = load_tile_before(logits_row, slice_id * SLICE + (step + 1) * TILE, offsets, end, num_columns)
            count, above = _compact_tile(tile_raw, cols, width, bound, key_region, col_region, count, above,
                                         REGION)
            cols += TILE
    tl.store(counts_row + slice_id, count)
    tl.store(counts_row + SLICES + slice_id, above)
    # Every thread's stores before the ticket; the last slice to draw sees them all.
    tl.debug_barrier()
    last = finish_ticket(tickets + 2) == SLICES - 1
    if last:
        _ticketed_finish(logits_row, counts_row, cand_keys, cand_cols, out_row, width, bound, top,
                         K, SLICES, SLICE, REGION, CAND_TILE, COUNTS_TILE, BITS)
        pad(out_row, tl.minimum(width, K), K, PAD_TILE)
        # Every program of the row has started and is past its waits:
        # the state is free again (select_paged_tokens' chunks reuse it).
        tl.store(tickets + tl.arange(0, 4), tl.zeros((4,), tl.int32))
        tl.store(maxima + groups, tl.zeros((GROUPS,), tl.uint32))
    return last


@dependent
@triton.jit
def topk_ticketed_kernel(
    logits_ptr,  # [rows, C] float32/bf16/fp16 (row stride lg_sr)
    visible_ptr,  # [rows] int32/int64
    state_in_ptr,  # [rows, STATE] int32 zeros: state_ptr's memory (JAX aliases them; read through state_ptr)
    out_ptr,  # [rows, K] int32: selected columns, then -1
    counts_ptr,  # [rows, 2, SLICES] int32: each slice's keys >= L, then its keys > L
    cand_key_ptr,  # [rows, SLICES, REGION] int32: candidate order keys, a region per slice
    cand_col_ptr,  # [rows, SLICES, REGION] int32: their columns
    state_ptr,  # [rows, STATE] int32: tickets (programs started, maxima folded, slices compacted, unused),
                # then the group maxima (order keys);
                # zero again when the row is done
    num_columns, lg_sr,
    K: tl.constexpr, SLICES: tl.constexpr, SLICE: tl.constexpr, TILE: tl.constexpr, GROUPS: tl.constexpr,
    REGION: tl.constexpr, CAND_TILE: tl.constexpr, COUNTS_TILE: tl.constexpr,
    BITS: tl.constexpr, BOUND_PASSES: tl.constexpr, SCALED: tl.constexpr, PAD_TILE: tl.constexpr,
    STATE: tl.constexpr, CHUNK: tl.constexpr,
    GROUP_TILE: tl.constexpr,
):
    """The whole top-k of one row by its 2 x SLICES programs (module
    docstring, ticketed path).  A program holds TILE columns of its slice
    at a time (GROUP_TILE while it folds maxima); a slice of one tile is
    loaded once.

    A program's role is its start ticket, not its program id: the first
    SLICES to start fold their slice into the group maxima; the others wait
    for those, derive the bound and compact their slice's candidates; the
    last of them to finish selects.  A program only waits for programs that
    started before it, which therefore run: no deadlock however the GPU
    schedules them, and Triton's interpreter (programs one after another)
    finds every wait already met.
    """
    wait_for_previous_kernel()
    row = tl.program_id(0).to(tl.int64)
    tickets = state_ptr + row * STATE
    maxima = (tickets + 4).to(tl.pointer_type(tl.uint32))
    role = start_ticket(tickets)
    width = row_width(visible_ptr, row, num_columns)
    logits_row = logits_ptr + row * lg_sr
    if role < SLICES:
        _ticketed_group_maxima(logits_row, maxima, role, width, num_columns, SLICE, GROUP_TILE, GROUPS)
        publish(tickets + 1)
    else:
        slice_id = role - SLICES
        cols = slice_column_view(slice_id, SLICE, TILE, CHUNK)
        # Loaded before the wait: the row does not depend on the other programs.
        raw = tl.load(logits_row + cols, mask=cols < num_columns, other=0.0)
        wait_for(tickets + 1, SLICES)
        ticketed_compact_and_select(logits_row, raw, cols, tickets, maxima, counts_ptr + row * (2 * SLICES),
                                    cand_key_ptr + row * (SLICES * REGION), cand_col_ptr + row * (SLICES * REGION),
                                    out_ptr + row * K, width, num_columns, slice_id, K, SLICES, SLICE, TILE,
                                    GROUPS, REGION,
                                    CAND_TILE, COUNTS_TILE, BITS, BOUND_PASSES, SCALED, PAD_TILE)


def ticketed_layout(columns: int, k: int, tuning: TopkTuning, widest_slice: int = 4096,
                    rows: int | None = None) -> tuple[dict, int]:
    """(constexprs, warps) of the ticketed path's selection of a row of
    ``columns`` (the fused selection's too, with slices to ``widest_slice``
    columns, held; its warps are its own: those its registers need at
    least).  Given ``rows``, slices widen past ``ticketed_stream_warps``
    warps of slice programs in all, streamed in tiles of the held width."""
    width = max(columns, 1)
    # Wider slices (to widest_slice columns) past ticketed_max_slices a row.
    slice_columns = max(tuning.ticketed_slice,
                        min(widest_slice, triton.next_power_of_2(triton.cdiv(width, tuning.ticketed_max_slices))))
    slice_columns = min(slice_columns, max(16, triton.next_power_of_2(width)))
    groups = topk_groups(columns, k, tuning)
    tile = slice_columns
    # About 1.4 x k keys of a long row reach the bound (G = 2k groups: each
    # has a maximum >= L with probability 1/2, so a key with 1 - 2**(-G/C),
    # C (1 - 2**(-G/C)) <= G ln 2 in all), give or take a few times their
    # square root: from k = 256, 2k hold them by 6 or more of those (k 512:
    # ~710 of 1024; each fitted pass, the gather and the placement cost per
    # key of the tile), 4k below; at most 4096 (16 warps, 8 keys a thread:
    # registers).
    cand_tile = min(4096, max(16, triton.next_power_of_2(2 * k if k >= 256 else 4 * k)))
    # 16 keys a thread in tiles of 2048 (4 warps), 8 in wider ones (registers).
    widest = max(tile, cand_tile, groups)
    warps = max(1, widest // (32 * (16 if widest <= 2048 else 8)))
    if rows is not None:
        warps = max(warps, tuning.ticketed_warps)
        if rows * triton.cdiv(width, slice_columns) * warps > tuning.ticketed_stream_warps:
            # Fewer, wider slices: a program's fixed costs (its G atomic maxima,
            # its bound, its tickets) over more columns, and about as many
            # programs of a role as an H100's SMs hold at once.
            per_row = max(1, tuning.ticketed_stream_warps // (rows * warps))
            slice_columns = max(slice_columns, triton.next_power_of_2(triton.cdiv(width, per_row)))
    slices = triton.cdiv(width, slice_columns)
    # A slice with more candidates than fit the tile sends the row to the fallback anyway.
    region = min(slice_columns, cand_tile)
    # The scaled bound needs k maxima (fewer: the fixed radix's bound is 0, as it must be).
    scaled = tuning.ticketed_bound == "scaled" and groups >= k
    constexprs = dict(K=k, SLICES=slices, SLICE=slice_columns, TILE=tile, GROUPS=groups, REGION=region,
                      CAND_TILE=cand_tile,
                      COUNTS_TILE=triton.next_power_of_2(slices), BITS=tuning.radix_bits,
                      BOUND_PASSES=tuning.ticketed_bound_passes if scaled else tuning.bound_passes, SCALED=scaled,
                      PAD_TILE=min(1024, triton.next_power_of_2(k)),
                      STATE=4 + groups, CHUNK=min(tile, tuning.ticketed_chunk))
    return constexprs, warps


def ticketed_buffers(rows: int, layout: dict) -> tuple[Buffer, ...]:
    """The ticketed path's state (zeros, left at zero) and workspaces for ``rows`` rows."""
    slices, region = layout["SLICES"], layout["REGION"]
    return (Buffer("topk_state", (rows, layout["STATE"]), "int32", fill=0, refilled=True),
            Buffer("topk_counts", (rows, 2, slices), "int32"),
            Buffer("topk_cand_key", (rows, slices, region), "int32"),
            Buffer("topk_cand_col", (rows, slices, region), "int32"))


def ticketed_parts(rows, columns, k, logits_stride, row_counts, logits, visible, out, tuning: TopkTuning):
    """The ticketed path: one launch of 2 x slices programs per row."""
    layout, warps = ticketed_layout(columns, k, tuning, rows=rows)
    buffers = ticketed_buffers(rows, layout)
    state, workspaces = buffers[0].name, tuple(buffer.name for buffer in buffers[1:])
    # The maxima's tile: a load and a max, so at least G columns (one group a
    # column of the view), as wide as the compaction's otherwise.
    group_tile = min(layout["SLICE"], max(layout["TILE"], layout["GROUPS"]))
    launches = tuple(
        Launch(topk_ticketed_kernel, (count, 2 * layout["SLICES"]), (logits, visible, state),
               (out, *workspaces, state), dict(num_columns=columns, lg_sr=logits_stride),
               dict(layout, GROUP_TILE=group_tile),
               num_warps=warps, num_stages=1)
        for count in row_counts)
    return buffers, launches
