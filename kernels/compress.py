"""Stage 2: mean-pooling of completed key groups, and the row store into caches.

``compress_groups`` pools, for each row that ends a group of ``compress_ratio``
consecutive positions of its request, the mean of the group's raw keys.  The
members at or after the first position of this step's chunk are this step's
rows: a request's rows hold consecutive positions, so the member ``lag``
positions back is simply the row ``lag`` rows back.  Older members come from
the request's compressor-state ring (slot ``position % ring``).

``store_cache_rows`` copies fixed-width rows into ``[pages, P, 1, W]`` caches
(rings, compressed-key caches, position caches), skipping ``-1`` and
out-of-range slots; cache offsets are int64.

Both kernels handle a tile of ``BLOCK_R`` rows per program, so every
metadata load is a vector load and decode-sized calls are one short launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fp8 import quantise
from .launch import ArrayInfo, Buffer, Launch, Program
from .pdl import dependent, wait_for_previous_kernel
from .stage import stage
from .tuning import CompressTuning
from .validate import FLOAT_DTYPES, FP8_DTYPE, INDEX_DTYPES, NONNEGATIVE_INT, POSITIVE_INT, Checker

COMPRESS_GROUPS_DOC = """\
Mean-pool the key groups that end at this step's rows.

A row ``r`` is pooled when ``compressed_slots[r] >= 0``, its request
``token_to_req[r]`` is one of the ``B`` requests and owns the row (per
``query_start_loc``), and its position ``p = logical_positions[r]`` is at least
``compress_ratio - 1``.  It gets the mean of the request's keys at positions
``p - compress_ratio + 1 .. p``: those at or after the first position of this
step's chunk from this step's rows (a request's rows hold consecutive
positions), older ones from the request's compressor-state ring block
``compressor_state_block_table[req, 0]``, slot ``position % ring``.  A missing
(``-1``) or out-of-range ring block contributes zeros.  The kernel pools
whatever window ends at a row: pass ``-1`` slots for rows that end no group.
Call it before this step's raw keys are stored into the ring (a ring only
``compress_ratio`` wide would otherwise lose members still needed).

Args:
    raw_keys: ``[R, 1, D]`` bf16, fp16 or fp32: this step's raw keys.
    raw_positions: ``[R, 1, 3]`` int32 or int64: the 3 stored position values
        of each row.
    compressor_state_cache: ``[blocks, ring, 1, D]`` of raw_keys' dtype, ring
        ``>= compress_ratio``: each request's ring of earlier raw keys.
    compressor_state_block_table: ``[>= B, >= 1]`` int32/int64; column 0 is
        the request's ring block.
    token_to_req: ``[R]`` int32/int64 request of each row.
    query_start_loc: ``[B + 1]`` int32/int64 first row of each request.
    logical_positions: ``[R]`` int32/int64 position of each row.
    compressed_slots: ``[R]`` int32/int64; ``>= 0`` marks a row to pool.
    compress_ratio: group size, a positive int.
    rope_cache: optional ``[blocks, ring, 1, 3]`` of raw_positions' dtype:
        the ring's stored position values.

Returns:
    ``(pooled [R, 1, D], first_positions [R, 3])``: ``pooled`` of raw_keys'
    dtype (zeros for rows not pooled); ``first_positions`` of raw_positions'
    dtype, the window's first position: its 3 stored values (this step's
    ``raw_positions`` row or the ring's ``rope_cache`` entry) when
    ``rope_cache`` is given, else ``[p, p, p]`` for the first position ``p``;
    zeros for rows not pooled.
"""

STORE_CACHE_ROWS_DOC = """\
Store fixed-width rows into a ``[pages, P, 1, W]`` cache.

Args:
    cache: ``[pages, P, 1, W]`` (bf16, fp16, fp32, fp8 e4m3, int32 or
        int64).[torch:  Updated in place and returned.][jax:  Returned as a
        new array aliasing the input: donate it (``donate_argnums``) under
        ``jax.jit`` for an in-place update with no copy.]
    slot_mapping: ``[R]`` int32/int64; slot ``s`` writes page ``s // P``,
        offset ``s % P``.  ``-1`` and out-of-range slots are skipped; offsets
        are computed in int64.
    rows: ``[R, W]`` or ``[R, 1, W]`` of cache's dtype (copied exactly), or,
        with ``scale``, bf16/fp16/fp32 rows quantised into an fp8 cache.
    scale: for a ``float8_e4m3fn`` cache only: a 0-d or 1-element float
        tensor, the cache's one per-tensor scale.  Each row is converted to
        float32, divided by it (correctly rounded), saturated to +-448
        (finite values and +-inf; NaN stays NaN, an e4m3 NaN code) and
        rounded to nearest even e4m3 (stored = value / scale, as
        ``rope_reshape_and_cache`` writes fp8 KV caches); readers multiply by
        it (``mqa_paged_scores(..., k_scale=)``).  One scale per cache, not
        per row: on the benchmark's data per-row scales raised the selection
        agreement with bf16 by at most 0.3 points (see
        benchmarks/fp8_selection_agreement.py), and the cache keeps its
        ``[pages, P, 1, W]`` layout.

Returns:
    ``cache``.
"""

STORE_DTYPES = FLOAT_DTYPES + (FP8_DTYPE,) + INDEX_DTYPES


def _row_tile(rows: int, width: int, tuning: CompressTuning) -> tuple[int, int, int, int]:
    """``(BLOCK_R, BLOCK_W, programs, num_warps)`` for ``rows`` rows of ``width`` elements
    (tiles of about ``tuning.tile_elements``)."""
    block_w = triton.next_power_of_2(max(width, 1))
    block_r = min(triton.next_power_of_2(max(rows, 1)), max(1, tuning.tile_elements // block_w))
    num_warps = min(4, max(1, block_r * block_w // 256))
    return block_r, block_w, triton.cdiv(rows, block_r), num_warps


@triton.jit
def windows(token_to_req_ptr, query_start_loc_ptr, logical_positions_ptr, compressed_slots_ptr, block_table_ptr,
             rows, in_batch, num_requests, num_ring_blocks, table_sr, RATIO: tl.constexpr):
    """``(end, start, block, ring_ok, pooled_row)`` of int64 ``rows [R]``: each row's
    position, its request's first row and ring block (and whether that block
    exists), and whether the row is pooled (see COMPRESS_GROUPS_DOC)."""
    request = tl.load(token_to_req_ptr + rows, mask=in_batch, other=-1)
    end = tl.load(logical_positions_ptr + rows, mask=in_batch, other=0).to(tl.int64)
    slot = tl.load(compressed_slots_ptr + rows, mask=in_batch, other=-1)
    known = in_batch & (request >= 0) & (request < num_requests)
    request = tl.where(known, request, 0).to(tl.int64)
    start = tl.load(query_start_loc_ptr + request, mask=known, other=0).to(tl.int64)
    stop = tl.load(query_start_loc_ptr + request + 1, mask=known, other=0).to(tl.int64)
    block = tl.load(block_table_ptr + request * table_sr, mask=known, other=-1).to(tl.int64)
    ring_ok = (block >= 0) & (block < num_ring_blocks)
    pooled_row = known & (rows >= start) & (rows < stop) & (slot >= 0) & (end >= RATIO - 1)
    return end, start, block, ring_ok, pooled_row


@triton.jit
def pool(raw_keys_ptr, ring_ptr, rows, dims, dim_ok, end, start, block, ring_ok, pooled_row,
          raw_sr, ring_sb, ring_sp, RATIO: tl.constexpr, RING: tl.constexpr):
    """float32 ``[R, len(dims)]``: the mean of each pooled row's window at columns ``dims``
    (zeros for rows not pooled): members in this chunk from ``raw_keys``, older
    ones from the ring.  Members are summed in window order whatever ``dims``
    is, so any split of the columns pools the same bits."""
    # Unrolled so the RATIO member loads of a row are in flight together.
    total = tl.zeros((rows.shape[0], dims.shape[0]), dtype=tl.float32)
    for member in tl.static_range(RATIO):
        lag = RATIO - 1 - member
        member_row = rows - lag
        from_chunk = (member_row >= start) & (member_row >= 0)
        chunk_mask = (pooled_row & from_chunk)[:, None] & dim_ok[None, :]
        ring_mask = (pooled_row & ~from_chunk & ring_ok)[:, None] & dim_ok[None, :]
        fresh = tl.load(raw_keys_ptr + member_row[:, None] * raw_sr + dims[None, :],
                        mask=chunk_mask, other=0.0).to(tl.float32)
        ring_row = block * ring_sb + ((end - lag) % RING) * ring_sp
        old = tl.load(ring_ptr + ring_row[:, None] + dims[None, :],
                      mask=ring_mask, other=0.0).to(tl.float32)
        total += tl.where(from_chunk[:, None], fresh, old)
    return total / RATIO


@triton.jit
def window_start(end, pooled_row, RATIO: tl.constexpr):
    """The first position of each pooled row's window (0 for rows not pooled), int64."""
    return tl.where(pooled_row, end - (RATIO - 1), 0)


@triton.jit
def cache_rows(slot_mapping_ptr, rows, in_batch, num_slots, cache_sb, cache_sp, PAGE: tl.constexpr):
    """``(write, cache_row)`` of int64 ``rows``: whether each row is stored (its slot is
    not -1 nor out of range) and the int64 offset of its cache row."""
    slot = tl.load(slot_mapping_ptr + rows, mask=in_batch, other=-1).to(tl.int64)
    write = in_batch & (slot >= 0) & (slot < num_slots)
    return write, (slot // PAGE) * cache_sb + (slot % PAGE) * cache_sp


@dependent
@triton.jit
def compress_groups_kernel(
    # inputs
    raw_keys_ptr,  # [R, 1, D] bf16/fp16/fp32
    raw_positions_ptr,  # [R, 1, 3] int32/int64
    ring_ptr,  # [blocks, RING, 1, D] raw_keys' dtype (compressor_state_cache: a ring per block)
    rope_cache_ptr,  # [blocks, RING, 1, 3] raw_positions' dtype (HAS_ROPE_CACHE; else a stand-in)
    block_table_ptr,  # [>= B, >= 1] int32/int64: column 0, each request's ring block
    token_to_req_ptr,  # [R] int32/int64
    query_start_loc_ptr,  # [B + 1] int32/int64
    logical_positions_ptr,  # [R] int32/int64
    compressed_slots_ptr,  # [R] int32/int64
    # outputs
    pooled_ptr,  # [R, 1, D] raw_keys' dtype
    first_positions_ptr,  # [R, 3] raw_positions' dtype
    # sizes and strides
    R, num_requests, num_ring_blocks,
    raw_sr, pos_sr, ring_sb, ring_sp, rope_sb, rope_sp, table_sr,
    # constexprs
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
    RATIO: tl.constexpr, RING: tl.constexpr, HAS_ROPE_CACHE: tl.constexpr,
):
    wait_for_previous_kernel()
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_batch = rows < R
    rows = rows.to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < D

    end, start, block, ring_ok, pooled_row = windows(
        token_to_req_ptr, query_start_loc_ptr, logical_positions_ptr, compressed_slots_ptr, block_table_ptr,
        rows, in_batch, num_requests, num_ring_blocks, table_sr, RATIO)
    mean = pool(raw_keys_ptr, ring_ptr, rows, dims, dim_ok, end, start, block, ring_ok, pooled_row,
                 raw_sr, ring_sb, ring_sp, RATIO, RING)
    tl.store(pooled_ptr + rows[:, None] * D + dims[None, :], mean.to(pooled_ptr.dtype.element_ty),
             mask=in_batch[:, None] & dim_ok[None, :])

    cols = tl.arange(0, 4)
    col_ok = cols < 3
    first = end - (RATIO - 1)
    if HAS_ROPE_CACHE:
        first_row = rows - (RATIO - 1)
        from_chunk = (first_row >= start) & (first_row >= 0)
        fresh = tl.load(raw_positions_ptr + first_row[:, None] * pos_sr + cols[None, :],
                        mask=(pooled_row & from_chunk)[:, None] & col_ok[None, :], other=0)
        rope_row = block * rope_sb + (first % RING) * rope_sp
        old = tl.load(rope_cache_ptr + rope_row[:, None] + cols[None, :],
                      mask=(pooled_row & ~from_chunk & ring_ok)[:, None] & col_ok[None, :], other=0)
        values = tl.where(from_chunk[:, None], fresh, old)
    else:
        values = tl.broadcast_to(window_start(end, pooled_row, RATIO)[:, None], (BLOCK_R, 4))
    tl.store(first_positions_ptr + rows[:, None] * 3 + cols[None, :],
             values.to(first_positions_ptr.dtype.element_ty),
             mask=in_batch[:, None] & col_ok[None, :])


@triton.jit
def in_table(position, max_position):
    """Whether each int64 ``position`` has a row of a RoPE table of ``max_position`` rows.

    The composed step's rule for a row outside its ``cos_sin`` table: it writes nothing
    anywhere (no K/V: stage 1; no ring slot and no compressed key: here and in
    kernels/fused.py), so the group it would complete keeps its compressed slot as it was.
    """
    return (position >= 0) & (position < max_position)


@dependent
@triton.jit
def store_cache_rows_kernel(
    # inputs
    cache_ptr,  # [pages, P, 1, W] any STORE_DTYPES (read only through its alias)
    slot_mapping_ptr,  # [R] int32/int64
    rows_ptr,  # [R, W] or [R, 1, W] cache's dtype (QUANTISE: bf16/fp16/fp32)
    scale_ptr,  # [] or [1] float (read only when QUANTISE)
    positions_ptr,  # [R] int32/int64 (HAS_POSITIONS; else a stand-in, never read)
    # outputs (the cache is the input's alias)
    cache_out_ptr,  # cache
    # sizes and strides
    R, num_slots, max_position, cache_sb, cache_sp, rows_sr,
    # constexprs
    W: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_R: tl.constexpr, PAGE: tl.constexpr,
    QUANTISE: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,  # rows whose position is outside [0, max_position) are skipped (the step)
):
    wait_for_previous_kernel()
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_batch = rows < R
    rows = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_W)
    write, cache_row = cache_rows(slot_mapping_ptr, rows, in_batch, num_slots, cache_sb, cache_sp, PAGE)
    if HAS_POSITIONS:
        write = write & in_table(tl.load(positions_ptr + rows, mask=in_batch, other=-1).to(tl.int64), max_position)
    mask = write[:, None] & (cols < W)[None, :]
    values = tl.load(rows_ptr + rows[:, None] * rows_sr + cols[None, :], mask=mask)
    if QUANTISE:  # as stage 1 writes fp8
        values = quantise(values, scale_ptr, cache_out_ptr.dtype.element_ty)
    tl.store(cache_out_ptr + cache_row[:, None] + cols[None, :], values, mask=mask)


def check_compress_groups(check: Checker, raw_keys: ArrayInfo, raw_positions: ArrayInfo,
                          compressor_state_cache: ArrayInfo, compressor_state_block_table: ArrayInfo,
                          token_to_req: ArrayInfo, query_start_loc: ArrayInfo, logical_positions: ArrayInfo,
                          compressed_slots: ArrayInfo, compress_ratio: int,
                          rope_cache: ArrayInfo | None = None) -> tuple[int, int, int, int, int]:
    """``compress_groups``' checks; returns ``(R, D, ring blocks, ring size, B)``."""
    check.array("raw_keys", raw_keys, 3, "[R, 1, D]", FLOAT_DTYPES)
    r, _, d = raw_keys.shape
    check.dim("raw_keys", raw_keys, 1, 1, "heads")
    if d < 1:
        check.fail("raw_keys", "must have head dim D >= 1", f"shape {raw_keys.shape}")
    check.shape("raw_positions", raw_positions, (r, 1, 3), "[R, 1, 3]")
    check.dtype("raw_positions", raw_positions, INDEX_DTYPES)
    for name, info in (("token_to_req", token_to_req), ("logical_positions", logical_positions),
                       ("compressed_slots", compressed_slots)):
        check.index_vector(name, info, r, "R")

    cache = compressor_state_cache
    check.rank("compressor_state_cache", cache, 4, "[blocks, ring, 1, D]")
    blocks, ring, _, cache_d = cache.shape
    check.dim("compressor_state_cache", cache, 2, 1, "heads")
    if ring < compress_ratio:
        check.fail("compressor_state_cache", f"must have a ring of at least compress_ratio = {compress_ratio} slots (dimension 1)", f"shape {cache.shape}")
    if cache_d != d:
        check.fail("compressor_state_cache", f"must have {check.owner('raw_keys')} head dim D = {d}", f"shape {cache.shape}")
    check.same_dtype("compressor_state_cache", cache, "raw_keys", raw_keys)
    if r and not blocks:
        check.fail("compressor_state_cache", "must have at least one block when there are rows", f"shape {cache.shape}")

    check.index_vector("query_start_loc", query_start_loc, None, "B + 1")
    if query_start_loc.shape[0] < 2:
        check.fail("query_start_loc", "must have B + 1 >= 2 entries", f"shape {query_start_loc.shape}")
    num_requests = query_start_loc.shape[0] - 1
    table = compressor_state_block_table
    check.index_array("compressor_state_block_table", table, 2, "[>= B, >= 1]")
    if table.shape[0] < num_requests or table.shape[1] < 1:
        check.fail("compressor_state_block_table", f"must have at least B = {num_requests} rows and one column", f"shape {table.shape}")

    if rope_cache is not None:
        check.shape("rope_cache", rope_cache, (blocks, ring, 1, 3), f"[blocks, ring, 1, 3] like {check.name('compressor_state_cache')}")
        check.same_dtype("rope_cache", rope_cache, "raw_positions", raw_positions)
    return r, d, blocks, ring, num_requests


@stage(
    arrays=("raw_keys", "raw_positions", "compressor_state_cache", "compressor_state_block_table",
            "token_to_req", "query_start_loc", "logical_positions", "compressed_slots", "rope_cache"),
    options=dict(compress_ratio=POSITIVE_INT),
    results=("pooled", "first_positions"), doc=COMPRESS_GROUPS_DOC, returns="tuple[Array, Array]",
    tuning=dict(tuning="compress"))
def plan_compress_groups(
    raw_keys: ArrayInfo, raw_positions: ArrayInfo,
    compressor_state_cache: ArrayInfo, compressor_state_block_table: ArrayInfo,
    token_to_req: ArrayInfo, query_start_loc: ArrayInfo,
    logical_positions: ArrayInfo, compressed_slots: ArrayInfo,
    compress_ratio: int, rope_cache: ArrayInfo | None = None,
    *, tuning: CompressTuning | None = None,
) -> Program:
    """Validate ``compress_groups`` arguments and describe its launch (see docs/api.md)."""
    r, d, blocks, ring, num_requests = check_compress_groups(
        Checker("compress_groups"), raw_keys, raw_positions, compressor_state_cache, compressor_state_block_table,
        token_to_req, query_start_loc, logical_positions, compressed_slots, compress_ratio, rope_cache)
    cache, table = compressor_state_cache, compressor_state_block_table

    pooled = Buffer("pooled", (r, 1, d), raw_keys.dtype)
    first_positions = Buffer("first_positions", (r, 3), raw_positions.dtype)
    block_r, block_d, programs, num_warps = _row_tile(r, d, tuning)
    rope = rope_cache if rope_cache is not None else raw_positions
    launch = Launch(
        kernel=compress_groups_kernel,
        grid=(programs,),
        inputs=(
            "raw_keys", "raw_positions", "compressor_state_cache",
            # Absent rope_cache: a stand-in pointer HAS_ROPE_CACHE never reads.
            "rope_cache" if rope_cache is not None else "raw_positions",
            "compressor_state_block_table", "token_to_req", "query_start_loc",
            "logical_positions", "compressed_slots",
        ),
        outputs=("pooled", "first_positions"),
        scalars=dict(
            R=r, num_requests=num_requests, num_ring_blocks=blocks,
            raw_sr=raw_keys.strides[0], pos_sr=raw_positions.strides[0],
            ring_sb=cache.strides[0], ring_sp=cache.strides[1],
            rope_sb=rope.strides[0], rope_sp=rope.strides[1], table_sr=table.strides[0],
        ),
        constexprs=dict(D=d, BLOCK_D=block_d, BLOCK_R=block_r, RATIO=compress_ratio,
                        RING=ring, HAS_ROPE_CACHE=rope_cache is not None),
        num_warps=num_warps,
        num_stages=1,
    )
    return Program("compress_groups", (pooled, first_positions), (launch,), ("pooled", "first_positions"))



def check_store_cache_rows(check: Checker, cache: ArrayInfo, slot_mapping: ArrayInfo, rows: ArrayInfo,
                           scale: ArrayInfo | None) -> None:
    """``store_cache_rows``' checks (a composed plan passes a :meth:`~.validate.Checker.renamed` checker)."""
    check.rank("cache", cache, 4, "[pages, P, 1, W]")
    pages, page, _, width = cache.shape
    check.dim("cache", cache, 2, 1, "heads")
    if not all(cache.shape):
        check.fail("cache", "must have nonzero dimensions", f"shape {cache.shape}")
    check.dtype("cache", cache, STORE_DTYPES)
    check.index_vector("slot_mapping", slot_mapping, None, "R")
    r = slot_mapping.shape[0]
    check.ranks("rows", rows, (2, 3), "[R, W] or [R, 1, W]")
    if rows.ndim == 3:
        check.dim("rows", rows, 1, 1, "heads")
    if rows.shape[0] != r or rows.shape[-1] != width:
        check.fail("rows", f"must have one row per {check.name('slot_mapping')} entry (R = {r}) of {check.owner('cache')} width W = {width}", f"shape {rows.shape}")
    if scale is not None:
        if cache.dtype != FP8_DTYPE:
            check.fail("scale", f"must be None for a {cache.dtype} {check.name('cache')} (a scale quantises {check.name('rows')} "
                       f"into a {FP8_DTYPE} {check.name('cache')})",
                       f"an array of shape {scale.shape}")
        check.scalar_array("scale", scale)
        check.dtype("rows", rows, FLOAT_DTYPES)
    else:
        if cache.dtype == FP8_DTYPE and rows.dtype in FLOAT_DTYPES:
            check.fail("scale", f"must be given to store {rows.dtype} {check.name('rows')} into a {FP8_DTYPE} {check.name('cache')}", None)
        check.same_dtype("rows", rows, "cache", cache)


@stage(
    arrays=("cache", "slot_mapping", "rows", "scale"),
    options={},
    results=("cache",), doc=STORE_CACHE_ROWS_DOC, returns="Array", tuning=dict(tuning="compress"))
def plan_store_cache_rows(cache: ArrayInfo, slot_mapping: ArrayInfo, rows: ArrayInfo, *,
                          tuning: CompressTuning | None = None, scale: ArrayInfo | None = None) -> Program:
    """Validate ``store_cache_rows`` arguments and describe its launch (see docs/api.md)."""
    check_store_cache_rows(Checker("store_cache_rows"), cache, slot_mapping, rows, scale)
    return Program("store_cache_rows", (), (_store_launch(cache, slot_mapping, rows, scale, None, 0, tuning),),
                   ("cache",))


def _store_launch(cache: ArrayInfo, slot_mapping: ArrayInfo, rows: ArrayInfo, scale: ArrayInfo | None,
                  positions: ArrayInfo | None, max_position: int, tuning: CompressTuning) -> Launch:
    pages, page, _, width = cache.shape
    r = slot_mapping.shape[0]
    block_r, block_w, programs, num_warps = _row_tile(r, width, tuning)
    return Launch(
        kernel=store_cache_rows_kernel,
        grid=(programs,),
        # Without a scale or positions: stand-in pointers QUANTISE and HAS_POSITIONS never read.
        inputs=("cache", "slot_mapping", "rows", "scale" if scale is not None else "slot_mapping",
                "positions" if positions is not None else "slot_mapping"),
        outputs=("cache",),
        scalars=dict(R=r, num_slots=pages * page, max_position=max_position, cache_sb=cache.strides[0],
                     cache_sp=cache.strides[1], rows_sr=rows.strides[0]),
        constexprs=dict(W=width, BLOCK_W=block_w, BLOCK_R=block_r, PAGE=page, QUANTISE=scale is not None,
                        HAS_POSITIONS=positions is not None),
        num_warps=num_warps,
        num_stages=1,
    )


@stage(arrays=("cache", "slot_mapping", "rows", "positions", "scale"), options=dict(max_position=NONNEGATIVE_INT),
       results=("cache",), tuning=dict(tuning="compress"))
def plan_store_rows_in_table(cache: ArrayInfo, slot_mapping: ArrayInfo, rows: ArrayInfo, positions: ArrayInfo, *,
                             max_position: int, scale: ArrayInfo | None = None,
                             tuning: CompressTuning | None = None) -> Program:
    """``store_cache_rows`` that also skips each row whose ``positions[r]`` is outside
    ``[0, max_position)`` (the composed step's ring and compressed-key stores: a row past
    its ``cos_sin`` table writes nothing).  Not a public stage: its checks are
    ``store_cache_rows``' and ``positions`` ``[R]`` (under the caller's names)."""
    check = Checker("store_rows_in_table")
    check_store_cache_rows(check, cache, slot_mapping, rows, scale)
    check.index_vector("positions", positions, slot_mapping.shape[0], "R")
    return Program("store_rows_in_table", (),
                   (_store_launch(cache, slot_mapping, rows, scale, positions, max_position, tuning),), ("cache",))
