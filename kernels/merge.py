"""Merging two partial attentions of the same rows (``merge_attention_states``).

Two attentions of the same query rows over disjoint token sets (a sparse
pass and a sliding-window or shared-prefix pass, two ranks of a
context-parallel split...) each give an output normalised over its own
tokens and the log-sum-exp of its scores.  Their exact combination is the
attention over the union:

    lse = logaddexp(lse_a, lse_b)
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

computed stably against ``max(lse_a, lse_b)`` in float32, in one launch:
one program per (row, block of heads, block of the head dim), with no host
synchronisation.  A side whose lse is -inf (no token: ``sparse_paged_attention``'s
empty rows) weighs exactly 0 and its output is not used, even if NaN; the
other side is then returned bit for bit (its weight is ``exp(0) = 1``, the
denominator 1).  Both -inf: out 0, lse -inf.  A NaN lse gives NaN.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .launch import ArrayInfo, Buffer, Launch, Program
from .pdl import dependent, wait_for_previous_kernel
from .stage import stage
from .validate import FLOAT_DTYPES, Checker

FUNCTION = "merge_attention_states"

#: Elements of out a program merges (heads x head-dim lanes): a memory-bound
#: elementwise kernel (a module constant, not yet swept on a GPU).
MERGE_TILE_ELEMENTS = 4096
#: Head-dim lanes of a program at most (wider heads take several programs).
MERGE_MAX_BLOCK_D = 256

DOC = """\
Merge two partial attentions of the same rows over disjoint token sets.

The exact softmax merge: with ``lse = logaddexp(lse_a, lse_b)``,
``out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)``, computed
stably in float32 (against the larger lse).  For instance a sparse pass
(``sparse_paged_attention(..., return_lse=True)``) and a dense pass over a
sliding window of other tokens: the result is the attention over both.

Args:
    out_a: ``[R, H, D]`` bf16, fp16 or fp32: one side's output, normalised
        over its tokens.
    lse_a: ``[R, H]`` float32: the natural log of that side's softmax
        denominator (``-inf``: the side has no token).
    out_b: ``[R, H, D]``, any of those dtypes: the other side's output.
    lse_b: ``[R, H]`` float32: its log-sum-exp.

Returns:
    ``(out, lse)``: ``out [R, H, D]`` of ``out_a``'s dtype, ``lse [R, H]``
    float32.  A side whose lse is -inf contributes nothing (its out is not
    read: NaN there is ignored), and the other side comes back bit for bit;
    both -inf: out 0, lse -inf.  A NaN lse gives NaN.
"""


@dependent
@triton.jit
def merge_attention_states_kernel(
    # inputs
    out_a_ptr,  # [R, H, D] bf16/fp16/fp32
    lse_a_ptr,  # [R, H] float32
    out_b_ptr,  # [R, H, D] bf16/fp16/fp32
    lse_b_ptr,  # [R, H] float32
    # outputs
    out_ptr,  # [R, H, D] out_a's dtype (contiguous)
    lse_ptr,  # [R, H] float32 (contiguous)
    # sizes and strides (last dimensions contiguous)
    heads, a_sr, a_sh, la_sr, b_sr, b_sh, lb_sr,
    # constexprs
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Rows by program id 0, BLOCK_H heads by id 1, BLOCK_D head-dim lanes by id 2."""
    wait_for_previous_kernel()
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d_chunk = tl.program_id(2)
    d = d_chunk * BLOCK_D + tl.arange(0, BLOCK_D)
    head_ok = h < heads
    lanes = head_ok[:, None]
    if D % BLOCK_D != 0:  # padded lanes (a head dim that is no multiple of BLOCK_D)
        lanes = lanes & (d < D)[None, :]
    lse_a = tl.load(lse_a_ptr + row * la_sr + h, mask=head_ok, other=-float("inf"))
    lse_b = tl.load(lse_b_ptr + row * lb_sr + h, mask=head_ok, other=-float("inf"))
    top = tl.maximum(lse_a, lse_b)
    empty = top == -float("inf")  # both sides -inf
    shift = tl.where(empty, 0.0, top)
    weight_a = tl.exp(lse_a - shift)  # the larger side weighs exp(0) = 1
    weight_b = tl.exp(lse_b - shift)
    denominator = weight_a + weight_b
    out_a = tl.load(out_a_ptr + row * a_sr + h[:, None] * a_sh + d[None, :], mask=lanes, other=0.0).to(tl.float32)
    out_b = tl.load(out_b_ptr + row * b_sr + h[:, None] * b_sh + d[None, :], mask=lanes, other=0.0).to(tl.float32)
    # A weight-0 side drops out whatever its out (NaN included); with one side left its
    # part is returned as is (x * 1 / 1: its bits, -0.0 included).
    part_a = tl.where((weight_a == 0.0)[:, None], 0.0, out_a * weight_a[:, None])
    part_b = tl.where((weight_b == 0.0)[:, None], 0.0, out_b * weight_b[:, None])
    merged = tl.where((weight_b == 0.0)[:, None], part_a,
                      tl.where((weight_a == 0.0)[:, None], part_b, part_a + part_b))
    out = merged / tl.where(denominator == 0.0, 1.0, denominator)[:, None]
    at = (row * heads + h[:, None]) * D + d[None, :]
    tl.store(out_ptr + at, out.to(out_ptr.dtype.element_ty), mask=lanes)
    lse = tl.where(empty, -float("inf"), top + tl.log(tl.where(empty, 1.0, denominator)))
    tl.store(lse_ptr + row * heads + h, lse, mask=head_ok & (d_chunk == 0))


def merge_tiling(heads: int, d: int) -> tuple[int, int]:
    """``(BLOCK_H, BLOCK_D)``: the head dim padded to a power of two (at most
    MERGE_MAX_BLOCK_D lanes), heads to fill MERGE_TILE_ELEMENTS."""
    block_d = min(triton.next_power_of_2(d), MERGE_MAX_BLOCK_D)
    block_h = min(triton.next_power_of_2(max(heads, 1)), max(1, MERGE_TILE_ELEMENTS // block_d))
    return block_h, block_d


@stage(arrays=("out_a", "lse_a", "out_b", "lse_b"), options={}, results=("out", "lse"), doc=DOC,
       returns="tuple[Array, Array]")
def plan_merge_attention_states(out_a: ArrayInfo, lse_a: ArrayInfo, out_b: ArrayInfo, lse_b: ArrayInfo) -> Program:
    """Validate ``merge_attention_states`` arguments and describe its launch (see docs/api.md)."""
    check = Checker(FUNCTION)
    check.array("out_a", out_a, 3, "[R, H, D]", FLOAT_DTYPES)
    rows, heads, d = out_a.shape
    if d < 1:
        check.fail("out_a", "must have a head dim D >= 1", f"shape {out_a.shape}")
    check.array("out_b", out_b, 3, "[R, H, D]", FLOAT_DTYPES)
    if out_b.shape != out_a.shape:
        check.fail("out_b", f"must have {check.owner('out_a')} shape {out_a.shape}", f"shape {out_b.shape}")
    for name, info in (("lse_a", lse_a), ("lse_b", lse_b)):
        check.array(name, info, 2, "[R, H]", ("float32",))
        if info.shape != (rows, heads):
            check.fail(name, f"must be [R, H] = {(rows, heads)} like {check.name('out_a')}", f"shape {info.shape}")
    out = Buffer("out", (rows, heads, d), out_a.dtype)
    lse = Buffer("lse", (rows, heads), "float32")
    block_h, block_d = merge_tiling(heads, d)
    launch = Launch(
        kernel=merge_attention_states_kernel,
        grid=(rows, triton.cdiv(heads, block_h), triton.cdiv(d, block_d)),
        inputs=("out_a", "lse_a", "out_b", "lse_b"), outputs=("out", "lse"),
        scalars=dict(heads=heads, a_sr=out_a.strides[0], a_sh=out_a.strides[1], la_sr=lse_a.strides[0],
                     b_sr=out_b.strides[0], b_sh=out_b.strides[1], lb_sr=lse_b.strides[0]),
        constexprs=dict(D=d, BLOCK_H=block_h, BLOCK_D=block_d),
        num_warps=4, num_stages=1)
    return Program(FUNCTION, (out, lse), (launch,), ("out", "lse"))
