"""Stage 3c: expand selected compressed blocks into token indices (``expand_block_indices``).

Follows the seed: each selected block becomes its ``compress_ratio`` tokens,
then the tokens of the still-open group up to the query.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .launch import ArrayInfo, Buffer, Launch, Program
from .pdl import dependent, wait_for_previous_kernel
from .stage import stage
from .rows import count_visible_blocks, row_request
from .validate import NONNEGATIVE_INT, POSITIVE_INT, Checker

#: ``token_topk`` and ``compress_ratio`` (select_paged_tokens shares them).
EXPAND_OPTIONS = dict(compress_ratio=POSITIVE_INT, token_topk=NONNEGATIVE_INT)

EXPAND_DOC = """\
Expand selected compressed blocks into token indices, then the causal tail.

For each row, its first ``min(visible_blocks, token_topk // compress_ratio)``
block indices (as written by ``topk_blocks``) become ``compress_ratio``
tokens each (``block * compress_ratio + i``), followed by the tokens of the
still-open group (positions ``((p + 1) // compress_ratio) * compress_ratio``
.. ``p``).  Tokens that are negative or at/after the request's sequence
length, tokens past int32 (``>= 2**31``, possible with int64 inputs: the
output is int32) and unused slots, are ``-1``.

Args:
    block_indices: ``[R, token_topk // compress_ratio]`` int32/int64.
    query_positions: ``[R]`` token position of each row.
    sequence_lengths: ``[B]`` tokens of each request.
    token_to_req: ``[R]`` request of each row; ``-1`` / out of range: none.
    compress_ratio: tokens per compressed block (positive int).
    token_topk: selected tokens, a multiple of ``compress_ratio``.

Returns:
    ``[R, token_topk + compress_ratio - 1]`` int32 token indices.
"""


@triton.jit
def expand_row_tile(block_row, position, length, out_row, cols,
                    BLOCK_TOPK: tl.constexpr, RATIO: tl.constexpr, WIDTH: tl.constexpr):
    """``out_row[cols]`` of one row from its selected blocks ``block_row``
    (the fused selection expands its rows with this too)."""
    expanded = tl.minimum(count_visible_blocks(position, length, RATIO), BLOCK_TOPK) * RATIO
    # The open group: the tail_count positions up to and including the query.
    # (Written so that nothing wraps, even at INT64_MAX.)
    tail_count = tl.where(position < 0, 0, (position % RATIO + 1) % RATIO)
    in_blocks = cols < expanded
    in_tail = ~in_blocks & (cols - expanded < tail_count)
    block = tl.load(block_row + cols // RATIO, mask=in_blocks, other=-1).to(tl.int64)
    # A block past the sequence is skipped before block * RATIO can wrap.
    block_ok = (block >= 0) & (block <= (length - 1) // RATIO)
    block_token = tl.where(block_ok, block, 0) * RATIO + cols % RATIO
    tail_token = position - tl.where(in_tail, tail_count - 1 - (cols - expanded), 0)
    token = tl.where(in_blocks, block_token, tail_token)
    # The output is int32: a token past it is dropped, never wrapped into a valid-looking one.
    keep = ((in_blocks & block_ok) | in_tail) & (token >= 0) & (token < length) & (token <= 2147483647)
    tl.store(out_row + cols, tl.where(keep, token, -1).to(tl.int32), mask=cols < WIDTH)


@dependent
@triton.jit
def expand_kernel(
    block_indices_ptr,  # [rows of this launch, BLOCK_TOPK] int32/int64 (row stride bi_sr)
    query_positions_ptr,  # [R] int32/int64
    sequence_lengths_ptr,  # [B] int32/int64
    token_to_req_ptr,  # [R] int32/int64
    previous_ptr,  # [R, WIDTH] int32: out of the earlier chunks (the same buffer; unread)
    out_ptr,  # [R, WIDTH] int32 (row stride out_sr)
    row_begin, num_requests, bi_sr, out_sr,
    BLOCK_TOPK: tl.constexpr, RATIO: tl.constexpr, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """Row ``row_begin + program_id(0)``; its block indices are row ``program_id(0)``."""
    wait_for_previous_kernel()
    local = tl.program_id(0).to(tl.int64)
    row = row_begin + local
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    _request, _request_ok, length = row_request(token_to_req_ptr, sequence_lengths_ptr, row, True, num_requests)
    position = tl.load(query_positions_ptr + row).to(tl.int64)
    expand_row_tile(block_indices_ptr + local * bi_sr, position, length, out_ptr + row * out_sr, cols,
                    BLOCK_TOPK, RATIO, WIDTH)


def check_token_topk(check: Checker, token_topk: int, compress_ratio: int) -> None:
    """``token_topk`` (a non-negative int, see EXPAND_OPTIONS) selects whole blocks."""
    if token_topk % compress_ratio:
        check.fail("token_topk", f"must be a multiple of compress_ratio = {compress_ratio}", token_topk)


def expand_tiling(block_topk: int, compress_ratio: int) -> tuple[int, int]:
    """(tokens of a row, tokens a program's tile writes)."""
    width = block_topk * compress_ratio + compress_ratio - 1
    return width, min(1024, triton.next_power_of_2(max(width, 1)))


def expand_launches(block_topk: int, compress_ratio: int, block_stride: int, out_stride: int,
                    requests: int, row_ranges, block_indices: str):
    width, block_w = expand_tiling(block_topk, compress_ratio)
    # With no blocks to expand, any input stands in for the (unread) indices.
    block_indices = block_indices if block_topk else "token_to_req"
    launches = []
    for i, (first, count) in enumerate(row_ranges):
        # Later chunks update `out` in place (aliased in JAX); the first
        # chunk's stand-in is never read.
        previous = "out" if i else block_indices
        launches.append(Launch(
            kernel=expand_kernel,
            grid=(count, triton.cdiv(width, block_w)),
            inputs=(block_indices, "query_positions", "sequence_lengths", "token_to_req", previous),
            outputs=("out",),
            scalars=dict(row_begin=first, num_requests=requests, bi_sr=block_stride, out_sr=out_stride),
            constexprs=dict(BLOCK_TOPK=block_topk, RATIO=compress_ratio, WIDTH=width, BLOCK_W=block_w),
            num_warps=4,
            num_stages=1,
        ))
    return launches


@stage(
    arrays=("block_indices", "query_positions", "sequence_lengths", "token_to_req"),
    options=EXPAND_OPTIONS,
    results=("out",), doc=EXPAND_DOC, returns="Array")
def plan_expand_block_indices(block_indices: ArrayInfo, query_positions: ArrayInfo,
                              sequence_lengths: ArrayInfo, token_to_req: ArrayInfo,
                              compress_ratio: int, token_topk: int) -> Program:
    """Validate ``expand_block_indices`` arguments and describe its launch (see docs/api.md)."""
    check = Checker("expand_block_indices")
    check_token_topk(check, token_topk, compress_ratio)
    block_topk = token_topk // compress_ratio
    check.index_array("block_indices", block_indices, 2, "[R, token_topk // compress_ratio]")
    rows = block_indices.shape[0]
    if block_indices.shape[1] != block_topk:
        check.fail("block_indices", f"must have token_topk // compress_ratio = {block_topk} columns",
                   f"shape {block_indices.shape}")
    check.index_vector("query_positions", query_positions, rows, "R")
    check.index_vector("sequence_lengths", sequence_lengths, None, "B")
    check.index_vector("token_to_req", token_to_req, rows, "R")
    out = Buffer("out", (rows, token_topk + compress_ratio - 1), "int32")
    launches = expand_launches(block_topk, compress_ratio, block_indices.strides[0], out.shape[1],
                               sequence_lengths.shape[0], [(0, rows)], "block_indices")
    return Program("expand_block_indices", (out,), tuple(launches), ("out",))

