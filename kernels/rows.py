"""What a query row sees, shared by the scorer and the expansion kernels.

A row belongs to request ``token_to_req[row]`` (``-1`` or out of range: none)
and sees the complete compressed blocks before and including its query
position that lie within its request's sequence length.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def count_visible_blocks(query_position, sequence_length, RATIO: tl.constexpr):
    """Complete blocks a query sees: causal and within its sequence (>= 0)."""
    by_position = groups_through(query_position, RATIO)
    by_length = tl.maximum(sequence_length, 0) // RATIO
    return tl.minimum(by_position, by_length)


@triton.jit
def groups_through(position, RATIO: tl.constexpr):
    """``(position + 1) // RATIO`` for position >= 0, else 0, without forming
    ``position + 1`` (it wraps at INT64_MAX)."""
    return tl.where(position < 0, 0, position // RATIO + ((position % RATIO) == RATIO - 1))


@triton.jit
def row_request(token_to_req_ptr, sequence_lengths_ptr, rows, row_ok, num_requests):
    """(request, request is valid, its sequence length or 0)."""
    request = tl.load(token_to_req_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
    request_ok = row_ok & (request >= 0) & (request < num_requests)
    request = tl.where(request_ok, request, 0)
    length = tl.load(sequence_lengths_ptr + request, mask=request_ok, other=0).to(tl.int64)
    return request, request_ok, length
