"""Validation that does not depend on history, and the tuning that plans are keyed by.

Regression tests of issue 13, items 2, 4, 7, 8, 9 and 10 (the systematic
cases are rows of tests/test_bad_arguments.py, whose valid bases these tests
reuse), and of ``qsa_kernels.tuning`` (issue 10, "tuning knobs are mutable
module globals").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import qsa_jax
import qsa_torch
from qsa_kernels import compress, topk, tuning
from qsa_kernels.launch import ArrayInfo
from qsa_kernels.select import plan_select_paged_tokens

from . import reference as R
from .test_bad_arguments import BASES, OPTIONAL_ARRAYS, _jax_inputs, floats, ints
from .util import DEVICE, assert_bitwise_equal, host, to_jax

pytestmark = pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")


def _raised(call) -> BaseException:
    with pytest.raises(Exception) as info:
        call()
    return info.value


def _both(function: str, arrays: dict, options: dict):
    """(torch error, JAX error) of one call in each adapter (JAX with x64: int64 stays int64)."""
    torch_error = _raised(lambda: getattr(qsa_torch, function)(**arrays, **options))
    with jax.enable_x64(True):
        jax_arrays, jax_options = _jax_inputs(arrays, options)
        jax_error = _raised(lambda: getattr(qsa_jax, function)(**jax_arrays, **jax_options))
    return torch_error, jax_error


# --------------------------------------------------------------------------
# Issue 13 item 7: acceptance never depends on an earlier call
# --------------------------------------------------------------------------

@pytest.mark.parametrize("function, valid, invalid", [
    ("topk_blocks", dict(k=3), dict(k=3.0)),
    ("topk_blocks", dict(k=1), dict(k=True)),
    ("compress_groups", dict(compress_ratio=2), dict(compress_ratio=2.0)),
    ("compress_groups", dict(compress_ratio=1), dict(compress_ratio=True)),
    ("expand_block_indices", dict(token_topk=4), dict(token_topk=4.0)),
    ("rope_reshape_and_cache", dict(is_neox=True), dict(is_neox=1)),
])
def test_an_earlier_valid_call_does_not_make_an_equal_invalid_value_valid(function, valid, invalid):
    """Plans were memoised by argument equality (3 == 3.0, True == 1): after one valid
    call, the equal but invalid value reused its plan.  Now it is rejected every time."""
    arrays, options = BASES[function]()
    getattr(qsa_torch, function)(**arrays, **{**options, **valid})
    with jax.enable_x64(True):
        jax_arrays, jax_options = _jax_inputs(arrays, options)
        getattr(qsa_jax, function)(**jax_arrays, **{**jax_options, **valid})
    torch_error, jax_error = _both(function, arrays, {**options, **invalid})
    (name, value), = invalid.items()
    assert type(torch_error) is ValueError and str(torch_error).startswith(f"{function}: {name} must be "), torch_error
    assert str(torch_error).endswith(f", got {value!r}"), torch_error
    assert type(jax_error) is ValueError and str(jax_error) == str(torch_error)


def test_numpy_scalars_are_canonical_and_share_the_plan():
    """np.int32(3) means 3: the same plan (one memo entry) and the same result."""
    arrays, _ = BASES["topk_blocks"]()
    first = qsa_torch.topk_blocks.plan(**arrays, k=3)
    for k in (np.int32(3), np.int64(3), np.uint8(3)):
        assert qsa_torch.topk_blocks.plan(**arrays, k=k) is first
    out = qsa_torch.topk_blocks(**arrays, k=3)
    assert_bitwise_equal(qsa_torch.topk_blocks(**arrays, k=np.int64(3)), out, "np.int64 k")
    assert_bitwise_equal(qsa_jax.topk_blocks(**_jax_inputs(arrays, {})[0], k=np.int32(3)), out, "np.int32 k in JAX")


def test_float_options_take_ints_and_numpy_floats_alike():
    """score_divisor and softmax_scale accept the same number types (issue 13 item 8:
    softmax_scale took np.float32, score_divisor did not)."""
    arrays, options = BASES["mqa_paged_scores"]()
    expected = qsa_torch.mqa_paged_scores(**arrays, **options, score_divisor=2.0)
    for divisor in (2, np.float32(2.0), np.float64(2.0), np.int16(2)):
        for got, want in zip(qsa_torch.mqa_paged_scores(**arrays, **options, score_divisor=divisor), expected):
            assert_bitwise_equal(got, want, f"score_divisor={divisor!r}")
    arrays, _ = BASES["sparse_paged_attention"]()
    expected = qsa_torch.sparse_paged_attention(**arrays, softmax_scale=0.5)
    for scale in (np.float32(0.5), np.float64(0.5)):
        assert_bitwise_equal(qsa_torch.sparse_paged_attention(**arrays, softmax_scale=scale), expected, repr(scale))
    assert_bitwise_equal(qsa_torch.sparse_paged_attention(**arrays, softmax_scale=1),
                         qsa_torch.sparse_paged_attention(**arrays, softmax_scale=1.0), "int scale")


# --------------------------------------------------------------------------
# Issue 13 item 8: unhashable, traced and array options; booleans; inf
# --------------------------------------------------------------------------

HINT = "options are static Python values, not arrays: under jax.jit, mark them static or close over them"


@pytest.mark.parametrize("function, name", [("topk_blocks", "k"), ("compress_groups", "compress_ratio"),
                                            ("sparse_paged_attention", "softmax_scale"),
                                            ("rope_reshape_and_cache", "is_neox"),
                                            ("mqa_paged_scores", "score_divisor")])
def test_traced_option_under_jit_names_the_option(function, name):
    """A jit argument that is an option arrives as a tracer: a clear message, not
    ``TypeError: unhashable type``."""
    arrays, options = BASES[function]()
    with jax.enable_x64(True):
        jax_arrays, jax_options = _jax_inputs(arrays, options)
        value = jax_options.get(name)
        value = 0.5 if value is None else value
        call = jax.jit(lambda xs, option: getattr(qsa_jax, function)(**xs, **{**jax_options, name: option}))
        error = _raised(lambda: call(jax_arrays, value))
    assert type(error) is ValueError, error
    assert str(error).startswith(f"{function}: {name} must be "), error
    assert "Tracer of shape ()" in str(error) and HINT in str(error), error


def test_array_options_are_rejected_in_both_adapters():
    arrays, _ = BASES["topk_blocks"]()
    error = _raised(lambda: qsa_torch.topk_blocks(**arrays, k=torch.tensor(3)))
    assert type(error) is ValueError and str(error) == f"topk_blocks: k must be a non-negative int, got Tensor of shape () ({HINT})"
    error = _raised(lambda: qsa_jax.topk_blocks(**_jax_inputs(arrays, {})[0], k=jnp.int32(3)))
    assert type(error) is ValueError and str(error) == f"topk_blocks: k must be a non-negative int, got ArrayImpl of shape () ({HINT})"
    error = _raised(lambda: qsa_torch.topk_blocks(**arrays, k=np.array([3])))
    assert type(error) is ValueError and "got ndarray of shape (1,)" in str(error)


@pytest.mark.parametrize("option, value", [("is_neox", "false"), ("is_neox", None), ("is_neox", [True]),
                                           ("is_neox", 0), ("return_zeros", "no")])
def test_booleans_are_booleans(option, value):
    arrays, options = BASES["rope_reshape_and_cache"]()
    torch_error, jax_error = _both("rope_reshape_and_cache", arrays, {**options, option: value})
    assert type(torch_error) is ValueError and str(torch_error) == (
        f"rope_reshape_and_cache: {option} must be a bool, got {value!r}")
    assert type(jax_error) is ValueError and str(jax_error) == str(torch_error)


def test_numpy_bool_is_a_bool():
    arrays, options = BASES["rope_reshape_and_cache"]()
    expected = qsa_torch.rope_reshape_and_cache(**{n: a.clone() for n, a in arrays.items()}, is_neox=False)
    got = qsa_torch.rope_reshape_and_cache(**{n: a.clone() for n, a in arrays.items()}, is_neox=np.bool_(False))
    for a, b in zip(got, expected):
        assert_bitwise_equal(a, b, "np.bool_ is_neox")


@pytest.mark.parametrize("value", [float("inf"), -float("inf"), np.float32("inf")])
def test_score_divisor_must_be_finite(value):
    arrays, options = BASES["mqa_paged_scores"]()
    torch_error, jax_error = _both("mqa_paged_scores", arrays, {**options, "score_divisor": value})
    assert type(torch_error) is ValueError and str(torch_error) == (
        f"mqa_paged_scores: score_divisor must be a finite positive Python number or None, got {value!r}")
    assert str(jax_error) == str(torch_error)


# --------------------------------------------------------------------------
# Issue 13 item 4: None for a required array
# --------------------------------------------------------------------------

REQUIRED = [(function, name) for function, base in BASES.items() for name in base()[0]
            if name not in OPTIONAL_ARRAYS.get(function, ())]


@pytest.mark.parametrize("function, name", REQUIRED, ids=[f"{f}-{n}" for f, n in REQUIRED])
def test_none_for_a_required_array_names_function_and_argument(function, name):
    """Was ``AttributeError: 'NoneType' object has no attribute 'ndim'``."""
    arrays, options = BASES[function]()
    torch_error, jax_error = _both(function, {**arrays, name: None}, options)
    expected = f"{function}: {name} must be an array (it is required), got None"
    assert type(torch_error) is TypeError and str(torch_error) == expected, repr(torch_error)
    assert type(jax_error) is TypeError and str(jax_error) == expected, repr(jax_error)


def test_none_for_an_optional_array_is_its_default():
    arrays, options = BASES["compress_groups"]()
    pooled, first = qsa_torch.compress_groups(**{**arrays, "rope_cache": None}, **options)
    without = dict(arrays)
    del without["rope_cache"]
    pooled_default, first_default = qsa_torch.compress_groups(**without, **options)
    assert_bitwise_equal(pooled, pooled_default, "pooled")
    assert_bitwise_equal(first, first_default, "first positions")


# --------------------------------------------------------------------------
# Issue 13 item 9: one index dtype rule for every stage; int32 outputs never wrap
# --------------------------------------------------------------------------

def test_compress_groups_takes_int64_metadata_like_the_other_stages():
    """token_to_req, query_start_loc and compressor_state_block_table were int32 only;
    int64 now gives the same bits as int32, in both adapters."""
    arrays, options = BASES["compress_groups"]()
    expected = qsa_torch.compress_groups(**arrays, **options)
    roles = ("token_to_req", "query_start_loc", "compressor_state_block_table")
    wide = {**arrays, **{n: arrays[n].long() for n in roles}}
    pooled, first = qsa_torch.compress_groups(**wide, **options)
    assert np.abs(host(expected[0]).astype(np.float32)).sum() > 0, "nothing pooled: the case tests nothing"
    assert_bitwise_equal(pooled, expected[0], "pooled, int64 metadata")
    assert_bitwise_equal(first, expected[1], "first positions, int64 metadata")
    with jax.enable_x64(True):
        jax_arrays, _ = _jax_inputs(wide, {})
        assert jax_arrays["query_start_loc"].dtype == jnp.int64
        jax_pooled, jax_first = qsa_jax.compress_groups(**jax_arrays, **options)
    assert_bitwise_equal(jax_pooled, expected[0], "JAX pooled, int64 metadata")
    assert_bitwise_equal(jax_first, expected[1], "JAX first positions, int64 metadata")


#: int32 arrays whose dtype is tied to another argument's (not an index role of their own).
TIED_DTYPES = {"compress_groups": {"raw_positions", "rope_cache"}}


def test_every_index_role_of_every_stage_takes_int64():
    """Wherever an int32 index array is valid, the same values in int64 are too."""
    for function, base in BASES.items():
        arrays, options = base()
        for name, value in arrays.items():
            if value.dtype != torch.int32 or name in TIED_DTYPES.get(function, ()):
                continue
            changed = {n: a.clone() for n, a in arrays.items()}
            changed[name] = value.long()
            getattr(qsa_torch, function)(**changed, **options)  # raises if int64 were refused


def test_expanded_tokens_past_int32_are_minus_one_not_wrapped():
    """With int64 inputs, a token >= 2**31 (a block's or the open group's) cannot be
    written to the int32 output: it is -1, not a small valid-looking index."""
    ratio, token_topk = 4, 8
    big = 2**31  # a multiple of the ratio: block big // ratio starts at token 2**31
    block_indices = ints([[big // ratio - 1, big // ratio], [3, -1], [2**40, 0]], torch.int64)
    query_positions = ints([big + 5, 17, 2**33 + 2], torch.int64)
    sequence_lengths = ints([2**40, 2**41], torch.int64)
    token_to_req = ints([0, 0, 1], torch.int64)
    arrays = dict(block_indices=block_indices, query_positions=query_positions,
                  sequence_lengths=sequence_lengths, token_to_req=token_to_req)
    out = qsa_torch.expand_block_indices(**arrays, compress_ratio=ratio, token_topk=token_topk)
    expected = R.expand_block_indices(*(host(a) for a in arrays.values()), compress_ratio=ratio, token_topk=token_topk)
    # Row 0: block big//ratio - 1 ends at token 2**31 - 1 (kept), block big//ratio is past int32.
    assert host(out)[0].tolist() == [big - 4, big - 3, big - 2, big - 1] + [-1] * 7
    assert host(out)[1].tolist() == [12, 13, 14, 15, -1, -1, -1, -1, 16, 17, -1]
    # Row 2: block 2**40 is past its sequence, block 0 is kept, the open group is past int32.
    assert host(out)[2].tolist() == [-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1]
    np.testing.assert_array_equal(host(out), expected)
    with jax.enable_x64(True):
        jax_out = qsa_jax.expand_block_indices(**_jax_inputs(arrays, {})[0], compress_ratio=ratio, token_topk=token_topk)
    assert_bitwise_equal(jax_out, out, "JAX vs torch")


# --------------------------------------------------------------------------
# Issue 13 item 10: expanded (stride-0) caches are not written
# --------------------------------------------------------------------------

@pytest.mark.parametrize("function, name", [("store_cache_rows", "cache"), ("rope_reshape_and_cache", "key_cache"),
                                            ("rope_reshape_and_cache", "value_cache")])
def test_expanded_cache_is_rejected_and_left_alone(function, name):
    arrays, options = BASES[function]()
    storage = arrays[name][:1].clone()
    expanded = storage.expand(arrays[name].shape)
    assert 0 in expanded.stride()
    before = storage.clone()
    error = _raised(lambda: getattr(qsa_torch, function)(**{**arrays, name: expanded}, **options))
    assert type(error) is ValueError and str(error).startswith(
        f"{function}: {name} must not be an expanded view (a stride-0 dimension of size > 1): it is updated in place, got strides ")
    assert_bitwise_equal(storage, before, "the expanded cache's storage")


def test_stride_zero_is_fine_where_nothing_is_written_or_the_dimension_has_one_element():
    arrays, options = BASES["store_cache_rows"]()
    # rows are read only: an expanded rows argument (one row repeated) is valid.
    rows = arrays["rows"][:1].expand(arrays["rows"].shape)
    cache = qsa_torch.store_cache_rows(arrays["cache"].clone(), arrays["slot_mapping"], rows)
    expected = qsa_torch.store_cache_rows(arrays["cache"].clone(), arrays["slot_mapping"], rows.contiguous())
    assert_bitwise_equal(cache, expected, "expanded rows")
    # A size-1 dimension may have any stride.
    one_page = torch.zeros(1, 2, 1, 5, dtype=arrays["cache"].dtype, device=DEVICE).as_strided((1, 2, 1, 5), (0, 5, 5, 1))
    qsa_torch.store_cache_rows(one_page, ints([1, -1, 0]), arrays["rows"])


# --------------------------------------------------------------------------
# Issue 13 item 2: qsa_jax without x64 never wraps host int64 indices
# --------------------------------------------------------------------------

def _store_inputs():
    cache = np.arange(4 * 2 * 5, dtype=np.float32).reshape(4, 2, 1, 5)
    rows = np.full((2, 5), -7.0, np.float32)
    return cache, rows


@pytest.mark.parametrize("jit", [False, True])
def test_jax_without_x64_rejects_host_int64_slots_past_int32(jit):
    """Slot 2**32 + 1 narrowed to int32 is slot 1: a live row would be overwritten."""
    cache, rows = _store_inputs()
    slots = np.array([2**32 + 1, -1], np.int64)
    with jax.enable_x64(False):
        jax_cache = jnp.asarray(cache)
        call = lambda c, r: qsa_jax.store_cache_rows(c, slots, r)  # noqa: E731  (slots: a host constant)
        error = _raised(lambda: (jax.jit(call) if jit else call)(jax_cache, jnp.asarray(rows)))
        assert type(error) is ValueError and str(error) == (
            "store_cache_rows: slot_mapping must hold int32 values when JAX runs without x64 (it narrows int64 "
            "to int32, which would wrap them; enable jax_enable_x64 to pass them), got int64 values in [-1, 4294967297]")
        np.testing.assert_array_equal(np.asarray(jax_cache), cache)
        # In range, int64 host indices narrow exactly and write what torch writes.
        slots = np.array([1, -1], np.int64)
        out = (jax.jit(call) if jit else call)(jax_cache, jnp.asarray(rows))
    expected = qsa_torch.store_cache_rows(*(torch.from_numpy(a.copy()).to(DEVICE) for a in (cache, slots, rows)))
    assert_bitwise_equal(out, expected, "in-range int64 slots")


def test_jax_without_x64_rejects_host_int64_positions_of_stage_1():
    arrays, options = BASES["rope_reshape_and_cache"]()
    with jax.enable_x64(False):
        jax_arrays = {n: to_jax(a) for n, a in arrays.items()}
        slots = host(arrays["slot_mapping"]).astype(np.int64)
        slots[1] = 2**33 + 5
        error = _raised(lambda: qsa_jax.rope_reshape_and_cache(**{**jax_arrays, "slot_mapping": slots}, **options))
    assert type(error) is ValueError and str(error).startswith(
        "rope_reshape_and_cache: slot_mapping must hold int32 values when JAX runs without x64"), error


# --------------------------------------------------------------------------
# Tuning: a frozen value in the plan's memo key, overridden by a context
# --------------------------------------------------------------------------

def _select_infos():
    """fp32 scoring (one row per scorer tile, so any workspace of whole rows chunks)."""
    a = ArrayInfo.contiguous
    infos = dict(q=a((3, 2, 16), "float32"), k_cache=a((5, 4, 1, 16), "float32"), page_table=a((2, 2), "int32"),
                 token_to_req=a((3,), "int32"), query_positions=a((3,), "int32"), sequence_lengths=a((2,), "int32"))
    return infos, dict(token_topk=4, compress_ratio=2)


def test_override_is_part_of_the_plan_key_and_ends_with_its_block():
    infos, options = _select_infos()
    default = plan_select_paged_tokens(**infos, **options)
    columns = infos["page_table"].shape[1] * infos["k_cache"].shape[1]
    small = tuning.SelectTuning(logits_workspace_bytes=4 * columns)  # one row per chunk
    with tuning.override(select=small) as current:
        assert current.select is small and current.topk == tuning.TopkTuning()
        chunked = plan_select_paged_tokens(**infos, **options)
        # Nests: select stays small (the row path: the register path has no candidate buffer).
        with tuning.override(topk=tuning.TopkTuning(path="row", min_candidates=8)):
            assert tuning.current().select is small
            nested = plan_select_paged_tokens(**infos, **options)
            assert nested.buffer("logits").shape == (1, columns) and nested.buffer("topk_candidates").shape == (1, 8)
    assert chunked.buffer("logits").shape == (1, columns) and default.buffer("logits").shape == (3, columns)
    # The register path, planned at 8 columns: no top-k workspace in any chunk.
    assert not [buffer.name for buffer in chunked.buffers if buffer.name.startswith("topk_")]
    # Back to the defaults, and to the memoised default plan: no cache to clear.
    assert tuning.current() == tuning.Tuning()
    assert plan_select_paged_tokens(**infos, **options) is default
    # An explicit tuning wins over the context.
    assert plan_select_paged_tokens(**infos, **options, tuning=small).buffer("logits").shape == (1, columns)


def test_override_restores_on_error():
    with pytest.raises(RuntimeError):
        with tuning.override(compress=tuning.CompressTuning(tile_elements=16)):
            raise RuntimeError("inside")
    assert tuning.current() == tuning.Tuning()


def test_override_and_tuning_values_are_checked():
    with pytest.raises(TypeError, match="tuning.override: unknown stage 'atention'"):
        with tuning.override(atention=tuning.AttentionTuning()):
            pass
    with pytest.raises(TypeError, match="tuning.override: topk must be a TopkTuning, got SelectTuning"):
        with tuning.override(topk=tuning.SelectTuning()):
            pass
    for make, message in ((lambda: tuning.AttentionTuning(num_splits=0), "AttentionTuning: num_splits must be a positive int or None, got 0"),
                          (lambda: tuning.AttentionTuning(tile_bytes=True), "AttentionTuning: tile_bytes must be a positive int or None, got True"),
                          (lambda: tuning.AttentionTuning(merge_chunk_elements=0), "AttentionTuning: merge_chunk_elements must be a positive int, got 0"),
                          (lambda: tuning.AttentionTuning(fused_merge=1), "AttentionTuning: fused_merge must be a bool or None, got 1"),
                          (lambda: tuning.AttentionTuning(fused_merge_max_programs=0), "AttentionTuning: fused_merge_max_programs must be a positive int, got 0"),
                          (lambda: tuning.AttentionTuning(fused_merge_heads=3), "AttentionTuning: fused_merge_heads must be a power of two, got 3"),
                          (lambda: tuning.TopkTuning(radix_bits=5), "TopkTuning: radix_bits must divide 32, got 5"),
                          (lambda: tuning.RopeCacheTuning(num_warps=2.0), "RopeCacheTuning: num_warps must be a positive int, got 2.0"),
                          (lambda: tuning.AttentionTuning(launch_table=((8, 1024, 4, 2, 264),)), "AttentionTuning: launch_table must end with a row whose bound is None"),
                          (lambda: tuning.AttentionTuning(fp8_launch_table=((None, 1024, 4, 2),)), "AttentionTuning: fp8_launch_table rows must be (most programs or None, tile bytes, warps, stages, target programs)"),
                          (lambda: tuning.SelectTuning(fused="yes"), "SelectTuning: fused must be a bool, got 'yes'"),
                          (lambda: tuning.StepTuning(fuse_stages=1), "StepTuning: fuse_stages must be a bool, got 1"),
                          (lambda: tuning.StepTuning(fuse_rope="no"), "StepTuning: fuse_rope must be a bool, got 'no'"),
                          (lambda: tuning.SelectTuning(fused_max_rows=0), "SelectTuning: fused_max_rows must be a positive int, got 0"),
                          (lambda: tuning.SelectTuning(fused_score_columns=384), "SelectTuning: fused_score_columns must be a power of two >= 128, got 384"),
                          (lambda: tuning.SelectTuning(fp8_row_columns=64), "SelectTuning: fp8_row_columns must be a power of two >= 128, got 64")):
        with pytest.raises(ValueError) as error:
            make()
        assert str(error.value).startswith(message), error.value
    with pytest.raises(Exception):  # frozen
        tuning.Tuning().attention.tile_bytes = 1


def test_compress_tuning_reaches_both_stage_2_plans():
    arrays, options = BASES["compress_groups"]()
    default = qsa_torch.compress_groups.plan(**arrays, **options).launches[0].constexprs["BLOCK_R"]
    with tuning.override(compress=tuning.CompressTuning(tile_elements=8)):
        assert qsa_torch.compress_groups.plan(**arrays, **options).launches[0].constexprs["BLOCK_R"] == 1 < default
        store = BASES["store_cache_rows"]()[0]
        assert qsa_torch.store_cache_rows.plan(**store).launches[0].constexprs["BLOCK_R"] == 1


def test_plans_reject_undeclared_options():
    """Every parameter of a plan is declared an array, an option (with its kind) or tuning."""
    from qsa_kernels.stage import stage

    with pytest.raises(TypeError, match=r"parameters \['k'\] of plan_example are declared neither"):
        @stage(arrays=("logits",), options={}, results=("out",))
        def plan_example(logits: ArrayInfo, k):
            return None
    with pytest.raises(TypeError, match=r"\['visible'\] in the declaration"):
        @stage(arrays=("logits", "visible"), options={}, results=("out",))
        def plan_other(logits: ArrayInfo):
            return None


@pytest.mark.parametrize("function, call", [
    ("topk_blocks", lambda adapter, a: adapter.topk_blocks(a["logits"], a["visible_blocks"], 3.0)),
    ("mqa_paged_scores", lambda adapter, a: adapter.mqa_paged_scores(*a.values(), 2, None, float("inf"))),
    ("expand_block_indices", lambda adapter, a: adapter.expand_block_indices(*a.values(), True, 4)),
    ("select_paged_tokens", lambda adapter, a: adapter.select_paged_tokens(*a.values(), 4, "2")),
])
def test_options_passed_by_position_are_checked_the_same_way(function, call):
    arrays, _ = BASES[function]()
    torch_error = _raised(lambda: call(qsa_torch, arrays))
    with jax.enable_x64(True):
        jax_error = _raised(lambda: call(qsa_jax, _jax_inputs(arrays, {})[0]))
    assert type(torch_error) is ValueError and str(torch_error).startswith(f"{function}: "), torch_error
    assert " must be " in str(torch_error) and str(jax_error) == str(torch_error)


def test_an_empty_override_keeps_the_default_tuning():
    with tuning.override() as current:
        assert current is tuning.DEFAULT
