"""merge_attention_states: the exact merge of two partial attentions against the float64
reference, two halves of a row's tokens merged into the attention over the whole (on every
attention path), an empty side returning the other bit for bit, torch = JAX bitwise."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

import qsa_jax
import qsa_torch
from qsa_kernels import api, merge, tuning
from qsa_kernels.launch import ArrayInfo

from . import reference as R
from .test_attention import LSE_CASE, PATHS, assert_lse_close, lse_reference, make_inputs, sinks_for
from .util import DEVICE, assert_bitwise_equal, assert_close, f64, to_jax, tolerance

merge_torch, merge_jax = qsa_torch.merge_attention_states, qsa_jax.merge_attention_states


def run_jax(*arrays):
    return jax.jit(merge_jax)(*(to_jax(a) for a in arrays))


def random_states(rows, heads, d, dtype=torch.bfloat16, b_dtype=None, seed=0):
    """Two random partial states (never zeros): outs around 0, lses around 2 with spread."""
    g = torch.Generator().manual_seed(seed)
    out_a = (torch.randn(rows, heads, d, generator=g) + 0.01).to(DEVICE, dtype)
    out_b = (torch.randn(rows, heads, d, generator=g) - 0.01).to(DEVICE, b_dtype or dtype)
    lse_a = (torch.randn(rows, heads, generator=g) * 3 + 2).to(DEVICE)
    lse_b = (torch.randn(rows, heads, generator=g) * 3 + 2).to(DEVICE)
    return out_a, lse_a, out_b, lse_b


def check_merge(out_a, lse_a, out_b, lse_b, tol=None):
    out, lse = merge_torch(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = R.merge_attention_states(f64(out_a), f64(lse_a), f64(out_b), f64(lse_b))
    assert out.dtype == out_a.dtype and out.shape == out_a.shape
    assert lse.dtype == torch.float32 and lse.shape == lse_a.shape
    assert_close(out, ref_out, tol or tolerance(out_a.dtype), "out vs reference")
    assert_lse_close(lse, ref_lse, 1e-6, "lse vs reference")
    jax_out, jax_lse = run_jax(out_a, lse_a, out_b, lse_b)
    assert_bitwise_equal(jax_out, out, "JAX vs torch: out")
    assert_bitwise_equal(jax_lse, lse, "JAX vs torch: lse")
    return out, lse


@pytest.mark.parametrize("dtypes, d", [((torch.bfloat16, None), 64), ((torch.float16, torch.float32), 80),
                                       ((torch.float32, torch.bfloat16), 512), ((torch.bfloat16, None), 24)])
def test_against_reference(dtypes, d):
    """Random states of every dtype pair, head dims that are powers of two, padded (80, 24) and
    wider than one program's lanes (512); out in out_a's dtype."""
    states = random_states(5, 6, d, *dtypes, seed=d)
    program = merge_torch.plan(*states)
    block_h, block_d = merge.merge_tiling(6, d)
    assert program.launches[0].grid == (5, 1, -(-d // block_d)) and block_h == 8
    check_merge(*states)


def test_empty_sides():
    """A side with lse -inf contributes nothing, its out unread (NaN there is ignored): the other
    side comes back bit for bit (-0.0 included); both -inf: out 0, lse -inf."""
    out_a, lse_a, out_b, lse_b = random_states(4, 3, 64, seed=1)
    out_a[0, 0, :4] = torch.tensor([-0.0, 1e-30, -3.5, 65504.0])
    lse_b[0] = -float("inf")  # row 0: b empty
    out_b[0] = float("nan")
    lse_a[1] = -float("inf")  # row 1: a empty
    out_a[1] = float("nan")
    lse_a[2] = lse_b[2] = -float("inf")  # row 2: both empty
    out_a[2, 0], out_b[2, 1] = float("nan"), float("nan")
    out, lse = check_merge(out_a, lse_a, out_b, lse_b)
    assert_bitwise_equal(out[0], out_a[0], "b empty: out_a")
    assert_bitwise_equal(lse[0], lse_a[0], "b empty: lse_a")
    assert_bitwise_equal(out[1], out_b[1], "a empty: out_b")
    assert_bitwise_equal(lse[1], lse_b[1], "a empty: lse_b")
    assert not f64(out[2]).any() and np.isneginf(f64(lse[2])).all()
    assert np.isfinite(f64(out[3])).all()


def test_extreme_and_nan_lses():
    """Lses far apart (one side's weight underflows), very negative finite ones (finite result),
    a NaN lse (NaN out and lse)."""
    out_a, lse_a, out_b, lse_b = random_states(4, 2, 32, torch.float32, seed=2)
    lse_a[0], lse_b[0] = 100.0, -100.0
    lse_a[1], lse_b[1] = -1e30, -1e30 - 1.0
    lse_a[2] = float("nan")
    out, lse = merge_torch(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = R.merge_attention_states(f64(out_a), f64(lse_a), f64(out_b), f64(lse_b))
    assert np.isnan(f64(out[2])).all() and np.isnan(f64(lse[2])).all()
    keep = [0, 1, 3]
    assert_close(out[keep], ref_out[keep], 1e-5, "out")
    assert np.abs(f64(lse[keep]) / ref_lse[keep] - 1).max() < 1e-6
    assert np.isfinite(f64(out[1])).all()


@pytest.mark.parametrize("path", list(PATHS))
def test_two_halves_of_the_tokens_merge_into_the_whole(path):
    """Each row's selection cut into two disjoint halves (by columns), each attended with
    return_lse and merged: the attention over the whole selection (the float64 reference, and the
    kernel's own whole pass within rounding), with sinks given to one half only; rows with no
    valid token in a half, or in both."""
    args = make_inputs(LSE_CASE)
    indices = args["token_indices"]
    half = indices.shape[1] // 2
    first, second = indices.clone(), indices.clone()
    first[:, half:] = -1
    second[:, :half] = -1
    second[0] = -1  # row 0: all in the first half
    first[4] = -1  # row 4: all in the second half
    whole = indices.clone()
    whole[0, half:] = -1
    whole[4, :half] = -1
    sinks = sinks_for(LSE_CASE.QH)
    with tuning.override(attention=tuning.AttentionTuning(**PATHS[path])):
        out_1, lse_1 = qsa_torch.sparse_paged_attention(**dict(args, token_indices=first), sinks=sinks,
                                                        return_lse=True)
        out_2, lse_2 = qsa_torch.sparse_paged_attention(**dict(args, token_indices=second), return_lse=True)
        out_whole, lse_whole = qsa_torch.sparse_paged_attention(**dict(args, token_indices=whole), sinks=sinks,
                                                                return_lse=True)
    out, lse = check_merge(out_1, lse_1, out_2, lse_2)
    ref_out, ref_lse = lse_reference(dict(args, token_indices=whole), sinks=sinks)
    assert_close(out, ref_out, tolerance(LSE_CASE.dtype), "merged halves vs the whole's reference")
    assert_lse_close(lse, ref_lse, what="merged lse vs the whole's reference")
    assert_close(out, f64(out_whole), tolerance(LSE_CASE.dtype) / 2, "merged halves vs the whole pass")
    assert_lse_close(lse, f64(lse_whole), 1e-5, "merged lse vs the whole pass")


def test_an_empty_pass_returns_the_other_bit_for_bit():
    """A sparse pass merged with a pass that selects nothing (lse -inf everywhere, out 0): the
    sparse pass's out and lse, bit for bit, in either order."""
    args = make_inputs(LSE_CASE)
    out, lse = qsa_torch.sparse_paged_attention(**args, return_lse=True)
    nothing = dict(args, token_indices=torch.full_like(args["token_indices"], -1))
    out_0, lse_0 = qsa_torch.sparse_paged_attention(**nothing, return_lse=True)
    assert np.isneginf(f64(lse_0)).all()
    for pair in ((out, lse, out_0, lse_0), (out_0, lse_0, out, lse)):
        merged, merged_lse = merge_torch(*pair)
        assert_bitwise_equal(merged, out, "out")
        assert_bitwise_equal(merged_lse, lse, "lse")


def test_no_rows_and_strided_views():
    out_a, lse_a, out_b, lse_b = random_states(3, 4, 32, seed=3)
    empty = merge_torch(out_a[:0], lse_a[:0], out_b[:0], lse_b[:0])
    assert empty[0].shape == (0, 4, 32) and empty[1].shape == (0, 4)
    # Heads sliced out of wider arrays (row and head strides of their own).
    wide_a = torch.randn(3, 6, 32, device=DEVICE).to(torch.bfloat16) + 0.01
    wide_lse = torch.randn(3, 9, device=DEVICE)
    check_merge(wide_a[:, 1:5], wide_lse[:, 2:6], out_b, lse_b)


def test_bad_arguments():
    out_a, lse_a, out_b, lse_b = random_states(2, 4, 16, seed=4)
    cases = [
        (dict(out_b=out_b[:, :3]), r"out_b must have out_a's shape"),
        (dict(lse_a=lse_a.to(torch.bfloat16)), r"lse_a must have dtype float32"),
        (dict(lse_b=lse_b[:, :2]), r"lse_b must be \[R, H\] = \(2, 4\)"),
        (dict(out_a=out_a[0]), r"out_a must be \[R, H, D\]"),
        (dict(out_a=out_a.to(torch.int32)), r"out_a must have dtype"),
    ]
    arguments = dict(out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b)
    for change, message in cases:
        with pytest.raises(ValueError, match="merge_attention_states: " + message):
            merge_torch(**dict(arguments, **change))
    a = ArrayInfo.contiguous
    with pytest.raises(ValueError, match="merge_attention_states: out_a must have a head dim D >= 1"):
        api.plan_merge_attention_states(a((2, 4, 0), "float32"), a((2, 4), "float32"), a((2, 4, 0), "float32"),
                                        a((2, 4), "float32"))
