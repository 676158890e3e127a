"""Regression tests: one per bug the hostile-input work found (each named in its docstring).

Found by the property tests (tests/test_properties.py, shrunk examples) and by
the bad-argument table.  Bugs still open are marked ``xfail(strict=True)``:
the test starts passing, and so fails as XPASS, the day the bug is fixed;
then drop the mark (and the matching bound in test_properties.py).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import torch

import qsa_jax
import qsa_torch
from qsa_kernels import runtime

from . import reference as R
from .test_properties import RopeCase, check_rope
from .util import DEVICE, assert_bitwise_equal, assert_close, f64, host, to_jax

pytestmark = pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")


def _i64(values):
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


def _i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


# --------------------------------------------------------------------------
# Fixed
# --------------------------------------------------------------------------

def test_rope_with_zero_query_heads():
    """Bug (stage 1, fixed): q with QH = 0 heads passed validation (0 % KH == 0) and
    then the plan divided by zero (ZeroDivisionError in triton.cdiv: the query
    head block was next_power_of_2(0) = 0).  Now k/v are cached and q_out is empty."""
    case = RopeCase(T=2, T_kv=3, QH=0, KH=2, D=8, layout="flash", X=1, P=4, blocks=2, dtype="bfloat16",
                    cos_sin_fp32=False, full_freqs=False, is_neox=True, max_position=8, positions=(1, 5),
                    positions_dtype="int32", offsets=None, slots=(6, 1, 3), slots_dtype="int64", swa=None,
                    swa_dtype="int32", scales=None, scale_shape=(), return_zeros=True, seed=3)
    check_rope(case)


# --------------------------------------------------------------------------
# Open
# --------------------------------------------------------------------------

def test_scores_query_position_int64_max():
    """Bug (stage 3, fixed): ``_visible_blocks`` computes ``query_position + 1``, which
    wraps at INT64_MAX: the row sees 0 blocks instead of sequence_length // ratio.
    Shrunk by hypothesis from test_properties.py::test_mqa_paged_scores."""
    q = torch.ones(1, 1, 16, device=DEVICE)
    k_cache = torch.ones(4, 4, 1, 16, device=DEVICE)
    page_table, token_to_req = _i32([[0, 1]]), _i32([0])
    positions, lengths = _i64([2**63 - 1]), _i32([8])
    _, visible = qsa_torch.mqa_paged_scores(q, k_cache, page_table, token_to_req, positions, lengths, 4)
    _, expected = R.mqa_paged_scores(host(q), host(k_cache), host(page_table), host(token_to_req), host(positions),
                                     host(lengths), 4)
    assert host(visible).tolist() == expected.tolist() == [2]


def test_expand_query_position_int64_max():
    """Bug (stage 3, fixed): as above in ``expand_kernel``: at INT64_MAX no block is expanded."""
    args = (_i64([[0, 1]]), _i64([2**63 - 1]), _i64([200]), _i32([0]))
    out = qsa_torch.expand_block_indices(*args, 4, 8)
    expected = R.expand_block_indices(*(host(a) for a in args), 4, 8)
    assert host(out).tolist() == expected.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, -1, -1, -1]]


def test_expand_block_index_times_ratio_wraps():
    """Bug (stage 3, fixed): an int64 block index far out of range (-2**63, 2**62)
    times compress_ratio wraps to 0, so ``expand_block_indices`` emits the valid
    tokens 0..3 instead of -1 (docs/api.md: out-of-range values are treated like -1)."""
    args = (_i64([[-(2**63), 2**62, 5]]), _i64([100]), _i64([200]), _i32([0]))
    out = qsa_torch.expand_block_indices(*args, 4, 12)
    expected = R.expand_block_indices(*(host(a) for a in args), 4, 12)
    assert expected[0, :8].tolist() == [-1] * 8
    assert host(out).tolist() == expected.tolist()


def test_rope_position_plus_offset_wraps():
    """Bug (stage 1, fixed): ``positions + offsets`` of -2**63 each wraps to 0, a
    valid rotary row: q_out/k_out are finite and the cache is written, where the
    true position (-2**64) is outside cos_sin (NaN rows, no write)."""
    case = RopeCase(T=1, T_kv=1, QH=2, KH=1, D=8, layout="flash", X=1, P=4, blocks=2, dtype="float32",
                    cos_sin_fp32=True, full_freqs=False, is_neox=True, max_position=16, positions=(-(2**63),),
                    positions_dtype="int64", offsets=(-(2**63),), slots=(3,), slots_dtype="int64", swa=None,
                    swa_dtype="int64", scales=None, scale_shape=(), return_zeros=False, seed=0)
    check_rope(case)


def test_zero_size_tensor_with_odd_strides_is_accepted():
    """Bug (kernels/validate.py, fixed): ``last_dim_contiguous`` rejects an empty tensor
    whose strides are not row-major, e.g. ``torch.from_numpy`` of an empty NumPy
    array (NumPy gives empty arrays all-zero strides): "k_cache must have a
    contiguous last dimension (stride 1), got strides (0, 0, 0, 0)".  An empty
    array has no layout to get wrong, and JAX accepts the same call.  Found by
    test_properties.py::test_select_paged_tokens (R = 0) and scripts/sanitize.py."""
    empty_pages = torch.from_numpy(np.zeros((0, 4, 2, 16), np.float32)).to(torch.bfloat16).to(DEVICE)
    assert empty_pages.stride() == (0, 0, 0, 0)
    q = torch.randn(2, 4, 16, device=DEVICE).to(torch.bfloat16)
    args = (q, empty_pages, empty_pages, _i32([[0, 1], [2, -1]]), _i32([[0]]), _i32([0, 0]))
    out = qsa_torch.sparse_paged_attention(*args)  # no page exists: every row is zeros
    assert not host(out).astype(np.float32).any()
    jax_out = jax.jit(qsa_jax.sparse_paged_attention)(*map(to_jax, args))
    assert_bitwise_equal(out, jax_out, "torch vs JAX")


@pytest.mark.skipif(not runtime.INTERPRETED, reason="JAX runs the interpreter from an XLA:CPU host callback only on the CPU")
def test_jax_cpu_host_callback_keeps_subnormals():
    """Bug (qsa_jax CPU path, fixed: the interpreter runs on a thread of its own): XLA:CPU runs ``pure_callback`` with flush-to-zero /
    denormals-are-zero set, so the interpreter inside sees subnormal floats as 0:
    top-k ranks 1e-45 equal to 0.0 under JAX but above it under torch (the
    reference agrees with torch).  Any kernel's float arithmetic is affected;
    torch and JAX are then not bit-identical on the CPU.  Found by
    test_properties.py::test_topk_blocks (large profile)."""
    logits = torch.tensor([[0.0, -1e-45, 1e-45, -0.0, 1e-45, -1e-45]])
    visible = torch.tensor([6], dtype=torch.int32)
    out = qsa_torch.topk_blocks(logits, visible, 3)
    assert host(out).tolist() == R.topk_blocks(host(logits), host(visible), 3).tolist() == [[0, 2, 4]]
    jax_out = jax.jit(qsa_jax.topk_blocks, static_argnums=2)(to_jax(logits), to_jax(visible), 3)
    assert_bitwise_equal(out, jax_out, "torch vs JAX")


def test_failed_step_leaves_the_state_unchanged():
    """Bug (composed step, fixed: the step is one plan): ``qsa_attention_step`` validates only its own
    arguments up front and leaves the rest to each stage, so a call that fails
    in a late stage has already run the early ones: with a compressed-key cache
    of the wrong width, torch raises "store_cache_rows: rows must have one row
    per slot_mapping entry ..." (naming neither the step's argument nor the
    step) *after* writing this step's k/v into the KV cache and its raw index
    keys into the rings.  A caller that catches the error keeps corrupted
    caches.  Planning every stage before the first launch would fix both.
    Found by tests/test_bad_arguments.py (step rows)."""
    from .test_bad_arguments import step_arguments

    arguments = step_arguments()
    state = dataclasses.replace(arguments["state"], compressed_key_cache=torch.zeros(6, 2, 1, 8, device=DEVICE))
    before = {name: getattr(state, name).clone() for name in ("key_cache", "value_cache", "compressor_state_cache")}
    with pytest.raises(ValueError):
        qsa_torch.qsa_attention_step(**{**arguments, "state": state})
    for name, value in before.items():
        assert_bitwise_equal(getattr(state, name), value, f"{name} after a failed step")


# --------------------------------------------------------------------------
# Issue 13: NaN and inf propagate through attention as the float64 softmax says
# --------------------------------------------------------------------------

def _first_valid_token(args, row):
    """(page, offset) of a token ``row`` really attends (mapped, in range)."""
    request = int(args["token_to_req"][row])
    table, cache = host(args["block_table"]), args["k_cache"]
    page_size = cache.shape[1]
    for token in host(args["token_indices"])[row]:
        if token < 0 or token // page_size >= table.shape[1]:
            continue
        page = int(table[request, token // page_size])
        if 0 <= page < cache.shape[0]:
            return page, int(token % page_size)
    raise AssertionError("row attends nothing")


def _poison(kind: str, args):
    """Put one non-finite value where ``kind`` says (q made small: no weight underflows)."""
    args = dict(args, q=(args["q"].float() * 0.1).to(args["q"].dtype), k_cache=args["k_cache"].clone(),
                v_cache=args["v_cache"].clone())
    page, offset = _first_valid_token(args, 0)
    if kind == "nan_q":
        args["q"][0, 1, 3] = float("nan")
    elif kind == "inf_q":
        args["q"][0, 2, 3] = float("inf")
    elif kind == "nan_k":
        args["k_cache"][page, offset, 0, 5] = float("nan")
    elif kind == "inf_k":  # +inf scores for some heads of the group (NaN), -inf for others (weight 0)
        args["k_cache"][page, offset, 0, 5] = float("inf")
        args["q"][0, :2, 5] = args["q"][0, :2, 5].abs() + 0.1
        args["q"][0, 2:4, 5] = -args["q"][0, 2:4, 5].abs() - 0.1
    elif kind == "nan_v":
        args["v_cache"][page, offset, 1, 7] = float("nan")
    elif kind == "inf_v":
        args["v_cache"][page, offset, 1, 7] = float("-inf")
    elif kind == "all_scores_minus_inf":  # every valid score of row 0, head 0 is -inf: NaN, not zeros
        args["k_cache"][:, :, 0, 0] = args["k_cache"][:, :, 0, 0].abs() + 0.5
        args["q"][0, 0] = 0.0
        args["q"][0, 0, 0] = float("-inf")
    return args


def _assert_same_nonfinite_then_close(out, ref, tol, what):
    out = f64(out)
    for name, test in (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
        assert np.array_equal(test(out), test(ref)), (
            f"{what}: {name} at {np.argwhere(test(out) != test(ref))[:5].tolist()} differ from the reference")
    finite = np.isfinite(ref)
    assert_close(out[finite], ref[finite], tol, what)


NONFINITE = ["nan_q", "inf_q", "nan_k", "inf_k", "nan_v", "inf_v", "all_scores_minus_inf"]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy's, on NaN/inf arithmetic (reference and interpreter)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("kind", NONFINITE)
def test_attention_nonfinite_inputs_follow_the_reference(kind, splits):
    """Bug (stage 4, fixed): a NaN/inf in q or in one cell of a selected K row made the
    whole output (of the head, or of the KV group) exactly zero, like "no valid
    token", where the float64 reference gives NaN.  Validity is now counted apart
    from the normaliser (a zero normaliser with valid tokens is NaN), and the merge
    drops weight-0 splits without turning "all -inf" into zeros.  Rows with no
    valid token stay zeros (make_inputs has three such rows)."""
    from qsa_kernels import tuning

    from .test_attention import Case, make_inputs, reference_for, run_jax

    args = _poison(kind, make_inputs(Case(QH=8, KH=2, D=64, W=300, seed=1)))
    ref = reference_for(args)
    assert not np.isfinite(ref).all(), "the case has no non-finite output: it tests nothing"
    assert np.isfinite(ref).any()
    with tuning.override(attention=tuning.AttentionTuning(num_splits=splits)):
        out = qsa_torch.sparse_paged_attention(**args)
        jax_out = run_jax(args)
    _assert_same_nonfinite_then_close(out, ref, 1e-2, f"{kind}, {splits} splits")
    assert not f64(out)[1:4].any(), "rows without a valid token must stay zeros"
    assert_bitwise_equal(jax_out, out, "torch vs JAX")
