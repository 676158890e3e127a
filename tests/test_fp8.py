"""fp8 e4m3 caches: attention and the scorer read them; store_cache_rows and stage 1 write them.

Readers are compared with the float64 references (tests/reference.py) run on
the *dequantised* caches (stored fp8 value x scale), and, with power-of-two
scales, bitwise with the same kernels over a 16-bit cache holding those
dequantised values (which it holds exactly): the scales are then applied
without rounding, so any difference is a bug, not rounding.

Where they run: under Triton's interpreter ``qsa_kernels.interpreter_compat``
makes the e4m3 casts exact and those of sm_90 (to e4m3: nearest even,
saturated at +-448, NaN to a NaN code; from e4m3: NaN codes to NaN), so the
reading and the writing tests run on the CPU too; the GPU runs them again
against the hardware's conversions and the bf16 readers' bit trick, and the
production-shape cases (``gpu`` marker).

NaN and inf (issue 28, item 4): every writer keeps a NaN a NaN code and
saturates +-inf to +-448; every reader widens both NaN codes to NaN; so a
NaN in k, v or a stored row gives the NaN rows a 16-bit cache gives.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import qsa_jax
import qsa_torch
from qsa_kernels import runtime, tuning
from qsa_kernels.fp8 import widen_e4m3
from qsa_kernels.launch import kernel_name

from . import reference as R
from .test_attention import Case, force_splits, make_inputs, planned_splits  # noqa: F401 (fixture)
from qsa_kernels.paging import STATE_FIELDS, CacheGeometry, PagedRequests
from qsa_kernels.step import SCALE_FIELDS

from .test_bad_arguments import CPU_ONLY, FP8_BASES, run_in_both_adapters, step_arguments, step_to_jax
from .test_select import (assert_fused_equals_three_launches, assert_scores_close, jax_args, long_decode_case,
                          numpy_args, scoring_case)
from .test_step import GEOMETRY, Model, clone_state, random_inputs, random_state, rope_table
from .util import DEVICE, assert_bitwise_equal, assert_close, f64, host, to_jax, tolerance

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
pytestmark = pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")


def quantise(x: torch.Tensor, scale: float) -> torch.Tensor:
    """torch's (correct) fp8 cast of ``x / scale``, saturated as the kernels do."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantise_view(view: torch.Tensor, scale: float) -> torch.Tensor:
    """An fp8 cache with ``view``'s strides and offset (a view stays a view)."""
    base = view if view._base is None else view._base
    return quantise(base, scale).as_strided(view.shape, view.stride(), view.storage_offset())


def dequantised(x8: torch.Tensor, scale) -> np.ndarray:
    return f64(x8) * float(scale)


def scale_tensor(value: float, dtype=torch.float32, shape=()):
    return torch.full(shape, value, dtype=dtype, device=DEVICE)


@triton.jit
def _widen_kernel(x_ptr, bf16_ptr, fp16_ptr, N: tl.constexpr, BIT_TRICK: tl.constexpr,
                  IN_REGISTERS: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    tl.store(bf16_ptr + i, widen_e4m3(x, tl.bfloat16, BIT_TRICK, IN_REGISTERS).to(tl.float32))
    tl.store(fp16_ptr + i, widen_e4m3(x, tl.float16, False, IN_REGISTERS).to(tl.float32))


@pytest.mark.parametrize("bit_trick, in_registers", [
    (False, False),  # Triton's cast: the interpreter's (interpreter_compat's exact table)
    # The in-register widening (inline asm: compiled only): its bit trick (bf16), and the cast.
    pytest.param(True, True, marks=pytest.mark.gpu), pytest.param(False, True, marks=pytest.mark.gpu)])
def test_every_e4m3_code_widens_as_the_reference_says(bit_trick, in_registers):
    """The readers' widening (Triton's cast, or the bf16 bit trick the GPU uses): every code,
    zeros, subnormals and both NaN codes (0x7f, 0xff) included, against tests/reference.py's
    decoding, in a tile of codes repeated in every order of the packing (the bit trick takes 4
    bytes at a time, and flags NaN bytes inside the word: a NaN code beside each other code).
    Bug (issue 28, item 4): the bit trick and the interpreter read the NaN codes as +-480."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    beside_nan = torch.stack([codes, torch.full_like(codes, 0x7F), codes, torch.full_like(codes, 0xFF)], 1).flatten()
    codes = torch.cat([codes, codes.flip(0), codes.roll(1), codes.roll(2), beside_nan, beside_nan.roll(1),
                       beside_nan.roll(2)[:512], beside_nan.roll(3)[:512]])  # 4096: a power of two
    codes = codes.view(FP8).to(DEVICE)
    as_bf16, as_fp16 = (torch.zeros(codes.numel(), device=DEVICE) for _ in range(2))
    with runtime.interpreter_lock if runtime.INTERPRETED else torch.cuda.device(DEVICE):
        _widen_kernel[(1,)](codes, as_bf16, as_fp16, N=codes.numel(), BIT_TRICK=bit_trick,
                            IN_REGISTERS=in_registers)
    expected = np.array([R.e4m3_value(c) for c in host(codes.view(torch.uint8)).tolist()])
    assert np.isnan(expected).sum() == np.count_nonzero(host(codes.view(torch.uint8)) & 0x7F == 0x7F) > 1000
    for name, got in (("bf16", f64(as_bf16)), ("fp16", f64(as_fp16))):
        assert np.array_equal(np.isnan(got), np.isnan(expected)), f"{name}: NaN codes"
        finite = ~np.isnan(expected)
        assert np.array_equal(got[finite], expected[finite]), f"{name}: finite codes"
        assert np.array_equal(np.signbit(got[finite]), np.signbit(expected[finite])), f"{name}: the sign of zero"


# --------------------------------------------------------------------------
# sparse_paged_attention
# --------------------------------------------------------------------------

def fp8_attention_inputs(c: Case, k_scale: float, v_scale: float, v_scale_dtype=torch.float32):
    """test_attention's inputs with the caches quantised; scales as the kernel reads them."""
    args = make_inputs(c)
    v_tensor = scale_tensor(v_scale, v_scale_dtype, (1,))
    k_scale, v_scale = float(k_scale), float(v_tensor.float())  # rounded to the scale's dtype
    args.update(k_cache=quantise_view(args["k_cache"], k_scale), v_cache=quantise_view(args["v_cache"], v_scale))
    return args, dict(k_scale=scale_tensor(k_scale), v_scale=v_tensor), (k_scale, v_scale)


def run_jax_attention(args, scales, softmax_scale=None):
    call = jax.jit(lambda a, s: qsa_jax.sparse_paged_attention(**a, **s, softmax_scale=softmax_scale))
    return call({n: to_jax(x) for n, x in args.items()}, {n: to_jax(x) for n, x in scales.items()})


FP8_ATTENTION_CASES = {
    # case, k_scale, v_scale (not powers of two: rounding of the scale products included)
    "g4_d64_bf16_2splits": (Case(QH=8, KH=2, D=64, W=150, splits=2), 0.37, 1.9),
    "g12_d128_fp16_unsplit_scale": (Case(QH=24, KH=2, D=128, W=100, dtype=torch.float16, splits=1, R=5,
                                         scale=0.07), 0.05, 3.0),
    "g1_d256_bf16_3splits_views_int64": (Case(QH=1, KH=1, D=256, W=100, splits=3, views=True,
                                              index_dtype=torch.int64), 1.0, 0.011),
}


#: AttentionTuning's fp8 variants besides the default, on the GPU only (both
#: addressing modes are compared on the CPU in test_attention.py).
FP8_VARIANTS = [pytest.param({}, id="default")] + [
    pytest.param(variant, id=name, marks=pytest.mark.gpu) for name, variant in (
        ("page_addressing", dict(fp8_row_addressing="page")),)]


@contextlib.contextmanager
def fp8_variant(variant: dict):
    """The attention tuning in force (splits forced or not), with ``variant``'s fields."""
    with tuning.override(attention=dataclasses.replace(tuning.current().attention, **variant)):
        yield


@pytest.mark.parametrize("variant", FP8_VARIANTS)
@pytest.mark.parametrize("name", list(FP8_ATTENTION_CASES))
def test_attention_fp8_matches_dequantised_reference(name, variant, force_splits):  # noqa: F811
    """Tolerance: q's dtype's (1e-2 bf16, 2e-3 fp16), as for 16-bit caches: the fp8
    values are exact in q's dtype, so only the 16-bit kernel's roundings remain."""
    c, k_scale, v_scale = FP8_ATTENTION_CASES[name]
    args, scales, (k_scale, v_scale) = fp8_attention_inputs(c, k_scale, v_scale, torch.bfloat16)
    force_splits(c.splits)
    with fp8_variant(variant):
        out = qsa_torch.sparse_paged_attention(**args, **scales, softmax_scale=c.scale)
        jax_out = run_jax_attention(args, scales, c.scale)
    ref = R.sparse_paged_attention(f64(args["q"]), dequantised(args["k_cache"], k_scale),
                                   dequantised(args["v_cache"], v_scale), host(args["token_indices"]),
                                   host(args["block_table"]), host(args["token_to_req"]), softmax_scale=c.scale)
    assert out.dtype == c.dtype and out.shape == (c.R, c.QH, c.D)
    assert np.abs(ref).sum() > 0, "the case attends nothing: it tests nothing"
    assert_close(out, ref, tolerance(c.dtype), "fp8 attention vs reference on the dequantised caches")
    assert_bitwise_equal(jax_out, out, "torch vs JAX")


@pytest.mark.parametrize("variant", FP8_VARIANTS)
@pytest.mark.parametrize("dtype, splits", [(torch.bfloat16, 1), (torch.float16, 3)])
def test_attention_fp8_equals_16bit_cache_of_its_values(dtype, splits, variant, force_splits):  # noqa: F811
    """Power-of-two scales: exactly the 16-bit kernel on the dequantised caches (scale 4 puts
    about 5% of the values on e4m3 subnormals)."""
    c = Case(QH=12, KH=1, D=128, W=300, R=4, dtype=dtype, splits=splits)
    args, scales, (k_scale, v_scale) = fp8_attention_inputs(c, 0.125, 4.0)
    widened = dict(args, k_cache=(args["k_cache"].to(dtype) * k_scale).to(dtype),
                   v_cache=(args["v_cache"].to(dtype) * v_scale).to(dtype))
    assert planned_splits(widened, splits) == splits  # small shapes: the fp8 table's row is the same
    force_splits(splits)
    with fp8_variant(variant):
        out = qsa_torch.sparse_paged_attention(**args, **scales)
    assert np.array_equal(f64(widened["k_cache"]), dequantised(args["k_cache"], k_scale)), "not exact: a bad case"
    assert_bitwise_equal(out, qsa_torch.sparse_paged_attention(**widened), "fp8 vs 16-bit cache")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_fp8_fused_merge_equals_the_merge_launch(dtype):
    """fp8 caches, 3 splits merged in their launch (AttentionTuning.fused_merge): the merge
    launch's bits, NaN codes included (one K row of a row's selected tokens: that row's KV
    group NaN either way), near the dequantised reference elsewhere."""
    c = Case(QH=8, KH=2, D=64, W=150, R=6, dtype=dtype, seed=2)
    args, scales, (k_scale, v_scale) = fp8_attention_inputs(c, 0.37, 1.9)
    _put_nan_codes(args["k_cache"], [(_selected_slots(args, [0], 1)[0], 1, slice(None))])
    ref = R.sparse_paged_attention(f64(args["q"]), dequantised(args["k_cache"], k_scale),
                                   dequantised(args["v_cache"], v_scale), host(args["token_indices"]),
                                   host(args["block_table"]), host(args["token_to_req"]))
    outputs = {}
    for fused in (True, False):
        with tuning.override(attention=tuning.AttentionTuning(num_splits=3, tile_bytes=16 * 2 * 64, fused_merge=fused)):
            program = qsa_torch.sparse_paged_attention.plan(**args, **scales)
            assert program.buffer("partial_lse").shape[0] == 3
            assert (program.buffer("tickets") is not None) == fused
            outputs[fused] = qsa_torch.sparse_paged_attention(**args, **scales)
            if fused:
                assert_bitwise_equal(run_jax_attention(args, scales), outputs[fused], "torch vs JAX")
    assert_bitwise_equal(outputs[True], outputs[False], "fp8: merged in the launch vs the merge launch")
    out, nan = f64(outputs[True]), np.isnan(ref)
    assert nan[0, 4:].all() and not nan[0, :4].any(), "the NaN K row: KV head 1's query heads of row 0"
    assert np.array_equal(np.isnan(out), nan), "NaN exactly where the float64 reference has it"
    assert_close(out[~nan], ref[~nan], tolerance(dtype), "fp8 fused merge vs the dequantised reference")
    assert np.abs(ref[~nan]).sum() > 0


# --------------------------------------------------------------------------
# mqa_paged_scores, select_paged_tokens
# --------------------------------------------------------------------------

def fp8_scoring_case(seed, scale, **kwargs):
    case = scoring_case(seed, **kwargs)
    case["k_cache"] = quantise(case["k_cache"], scale)
    return case


#: SelectTuning's fp8 scorer variants besides the default (GPU only: the
#: interpreter is slow).
SCORER_VARIANTS = [pytest.param({}, id="default")] + [
    pytest.param(variant, id=name, marks=pytest.mark.gpu) for name, variant in (
        ("256_columns", dict(fp8_row_columns=256)), ("8_warps", dict(fp8_row_warps=8)))]


@pytest.mark.parametrize("variant", SCORER_VARIANTS)
@pytest.mark.parametrize("dtype, heads, dim, ratio, prefill, scale", [
    (torch.bfloat16, 4, 64, 4, False, 0.03),   # decode: one row per tile, 128-column tiles (256: a variant)
    (torch.bfloat16, 1, 128, 8, True, 2.5),    # prefill: tiles of rows sharing one request
    (torch.float16, 4, 64, 4, True, 0.3),
    (torch.float32, 4, 128, 4, False, 0.7),    # fp32 queries: the exact fp32 dot
])
def test_scores_fp8_match_dequantised_reference(dtype, heads, dim, ratio, prefill, scale, variant):
    """Tolerance 1e-5: the products of q and the widened keys are exact, sums are float32."""
    case = fp8_scoring_case(11, scale, heads=heads, dim=dim, dtype=dtype, prefill=prefill)
    k_scale = scale_tensor(scale)
    with tuning.override(select=tuning.SelectTuning(**variant)):
        logits, visible = qsa_torch.mqa_paged_scores(**case, compress_ratio=ratio, k_scale=k_scale)
        # Positional arrays: a dict through jax.jit comes back with its keys sorted.
        scores = jax.jit(lambda s, *arrays: qsa_jax.mqa_paged_scores(*arrays, ratio, k_scale=s))
        jax_logits, jax_visible = scores(to_jax(k_scale), *jax_args(case).values())
    expected, expected_visible = R.mqa_paged_scores(
        **dict(numpy_args(case), k_cache=dequantised(case["k_cache"], float(k_scale))), compress_ratio=ratio)
    assert np.array_equal(host(visible), expected_visible)
    assert np.isfinite(expected).sum() > 10, "no visible column: the case tests nothing"
    assert_scores_close(logits, expected, 1e-5, "fp8 logits vs reference on the dequantised keys")
    assert_bitwise_equal(logits, jax_logits, "logits torch vs jax")
    assert_bitwise_equal(visible, jax_visible, "visible torch vs jax")


# The fp8 scorer's row loop (SelectTuning.fp8_row_tiles > 1: score.scores_rows_kernel, issue 27's
# candidates): the one-tile kernel's bits, on every page span the loop takes.

def fp8_long_decode_case(seed, *, page, columns=1024, dim=128, scale=0.5, nan_codes=False):
    """long_decode_case with an fp8 cache (one long request to the last column, one a third
    as long, a missing and an out-of-range page, rows of every kind); ``nan_codes``: both
    e4m3 NaN codes in keys of each request's visible columns (one element, and a whole key)."""
    case = long_decode_case(seed, columns=columns, page=page, heads=4, dim=dim)
    k8 = quantise(case["k_cache"], scale)
    if nan_codes:
        codes = k8.view(torch.uint8)
        table = case["page_table"].cpu()
        for request, column, element in ((0, 5, 7), (0, 3 * page + 1, slice(None)), (1, page + 2, 0)):
            physical = int(table[request, column // page])
            codes[physical, column % page, 0, element] = 0x7F if request else 0xFF
    case["k_cache"] = k8
    return case


#: The one-tile-a-program scorer (``score.scores_kernel``), the reference of the row loop's bits.
ONE_TILE = dict(fp8_row_tiles=1)


def row_loop_kernels(case, **select):
    with tuning.override(select=tuning.SelectTuning(**select)):
        program = qsa_torch.mqa_paged_scores.plan(**case, compress_ratio=4, k_scale=scale_tensor(0.5))
    return [(kernel_name(launch.kernel), launch.grid, launch.constexprs.get("TILES"), launch.constexprs.get("SPAN"))
            for launch in program.launches]


#: (page size, SelectTuning of the loop): two pages a tile (the production geometry's 64),
#: a page a tile, tiles inside a page; 2, 4 and 8 tiles a program; the loop Triton pipelines
#: (its pages looked up in each iteration: another loop body); 8 warps (GPU: the interpreter
#: ignores warps).
ROW_LOOPS = [
    pytest.param(64, dict(fp8_row_tiles=4), id="page64-4-tiles"),
    pytest.param(128, dict(fp8_row_tiles=2), id="page128-2-tiles"),
    pytest.param(256, dict(fp8_row_tiles=8), id="page256-8-tiles"),
    pytest.param(64, dict(fp8_row_tiles=4, fp8_row_prefetch=False, fp8_row_stages=3), id="page64-stages3"),
    pytest.param(64, dict(fp8_row_tiles=8, fp8_row_warps=8), id="page64-8-warps", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("page, loop", ROW_LOOPS)
@pytest.mark.parametrize("nan_codes", [False, True])
def test_scores_fp8_row_loop_equals_default(page, loop, nan_codes):
    """The row loop's logits are the one-tile kernel's bit for bit (the same operations on each
    tile), NaN codes included (NaN logits where the one-tile kernel's are, as the relu leaves them), and
    match the float64 reference on the dequantised keys; torch = JAX.  Tails: the shorter
    request's last tiles and the -inf tiles past it, a missing and an out-of-range page, rows
    with no request, a negative and an early position."""
    case = fp8_long_decode_case(3, page=page, nan_codes=nan_codes)
    k_scale = scale_tensor(0.5)
    select = dict(loop, fp8_row_min_programs=1)
    (name, grid, tiles, span), = row_loop_kernels(case, **select)
    assert name == "scores_rows_kernel" and tiles == loop["fp8_row_tiles"] and span == (2 if page == 64 else 1)
    assert grid == (6, 1024 // 128 // tiles)
    with tuning.override(select=tuning.SelectTuning(**ONE_TILE)):
        default, default_visible = qsa_torch.mqa_paged_scores(**case, compress_ratio=4, k_scale=k_scale)
    with tuning.override(select=tuning.SelectTuning(**select)):
        logits, visible = qsa_torch.mqa_paged_scores(**case, compress_ratio=4, k_scale=k_scale)
        scores = jax.jit(lambda s, *arrays: qsa_jax.mqa_paged_scores(*arrays, 4, k_scale=s))
        jax_logits, jax_visible = scores(to_jax(k_scale), *jax_args(case).values())
    assert_bitwise_equal(logits, default, "row loop vs the one-tile kernel")
    assert_bitwise_equal(visible, default_visible, "visible blocks")
    assert_bitwise_equal(logits, jax_logits, "logits torch vs jax")
    assert_bitwise_equal(visible, jax_visible, "visible torch vs jax")
    got = f64(logits)
    assert np.isneginf(got).any() and np.isfinite(got).sum() > 500, "the case needs -inf and scored columns"
    expected, expected_visible = R.mqa_paged_scores(
        **dict(numpy_args(case), k_cache=dequantised(case["k_cache"], 0.5)), compress_ratio=4)
    assert np.array_equal(host(visible), expected_visible)
    nan = np.isnan(expected)
    if nan_codes:
        assert np.isnan(f64(case["k_cache"])).sum() == 2 + 128, "NaN codes stored"
        # 4 visible (row, column) pairs hold a NaN key.  The relu drops NaN on the GPU
        # (max.f32) and keeps it under Triton 3.6's interpreter; the one-tile kernel's bits
        # (above) are the promise there.
        assert nan.sum() == 4 and (not np.isnan(got).any() or np.array_equal(np.isnan(got), nan))
    else:
        assert not nan.any() and not np.isnan(got).any()
    assert_scores_close(torch.from_numpy(np.where(nan, 0.0, got)), np.where(nan, 0.0, expected), 1e-5,
                        "row loop vs reference on the dequantised keys")


def test_selection_fp8_row_loop_equals_default():
    """select_paged_tokens scores through the row loop too (unfused: its scorer launches over
    row chunks): the one-tile kernel's tokens bit for bit."""
    case = fp8_long_decode_case(5, page=64)
    k_scale = scale_tensor(0.5)
    select = lambda: qsa_torch.select_paged_tokens(**case, token_topk=64, compress_ratio=4,  # noqa: E731
                                                   k_scale=k_scale)
    with tuning.override(select=tuning.SelectTuning(fused=False, **ONE_TILE)):
        default = select()
    loop = tuning.SelectTuning(fused=False, fp8_row_tiles=4, fp8_row_min_programs=1)
    with tuning.override(select=loop):
        program = qsa_torch.select_paged_tokens.plan(**case, token_topk=64, compress_ratio=4, k_scale=k_scale)
        assert "scores_rows_kernel" in [kernel_name(launch.kernel) for launch in program.launches]
        assert_bitwise_equal(select(), default, "selection through the row loop vs the default")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [8, 64, 256])
def test_scores_fp8_row_loop_production(rows):
    """Production geometry (4 heads x d128, pages of 64, 32K context, random pages of a shared
    pool, NaN codes in two keys): every fp8_row_* candidate of bench_select.py --fp8-sweep
    (the L2 prefetch and Triton's pipelining included: compiled only) gives the one-tile kernel's
    logits bit for bit, and the default matches the float64 reference."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from bench_select import FP8_SWEEP  # noqa: E402

    g = torch.Generator(device=DEVICE).manual_seed(rows)
    columns, page, pool_pages = 8192, 64, 2 * 8192 // 64 * 4
    pool = torch.randn(pool_pages, page, 1, 128, device=DEVICE, generator=g).to(torch.bfloat16)
    k8 = quantise(pool, 0.01)
    k8.view(torch.uint8)[3, 5, 0, 9] = 0x7F
    k8.view(torch.uint8)[7, 0, 0, :] = 0xFF
    width = columns // page
    page_table = torch.stack([torch.randperm(pool_pages, device=DEVICE, generator=g)[:width] for _ in range(rows)])
    lengths = torch.full((rows,), columns * 4, dtype=torch.int32, device=DEVICE)
    lengths[1::3] = columns * 4 // 3 + 7  # shorter requests: the loop's tails
    case = dict(q=torch.randn(rows, 4, 128, device=DEVICE, generator=g).to(torch.bfloat16), k_cache=k8,
                page_table=page_table.int(), token_to_req=torch.arange(rows, dtype=torch.int32, device=DEVICE),
                query_positions=(lengths - 1).int(), sequence_lengths=lengths)
    k_scale = scale_tensor(0.01)
    with tuning.override(select=tuning.SelectTuning(**ONE_TILE)):
        default, visible = qsa_torch.mqa_paged_scores(**case, compress_ratio=4, k_scale=k_scale)
    for name, variant in {"defaults": {}, **FP8_SWEEP}.items():
        with tuning.override(select=tuning.SelectTuning(**variant)):
            logits, loop_visible = qsa_torch.mqa_paged_scores(**case, compress_ratio=4, k_scale=k_scale)
        assert_bitwise_equal(logits, default, f"{name} vs the one-tile kernel")
        assert_bitwise_equal(loop_visible, visible, f"{name}: visible blocks")
    expected, expected_visible = R.mqa_paged_scores(
        **dict(numpy_args(case), k_cache=dequantised(k8, 0.01)), compress_ratio=4)
    assert np.array_equal(host(visible), expected_visible)
    nan = np.isnan(expected)
    assert_scores_close(torch.from_numpy(np.where(nan, 0.0, f64(default))), np.where(nan, 0.0, expected), 1e-5,
                        "default vs reference on the dequantised keys")


def test_scores_fp8_row_loop_plan():
    """Where the row loop applies (fp8 keys, decode rows on tensor cores, a tile within at most
    two pages) and how many tiles a program takes (halved while fewer than fp8_row_min_programs
    programs would cover the rows); elsewhere the one-tile kernel."""
    case = fp8_long_decode_case(4, page=64)
    assert row_loop_kernels(case, **ONE_TILE) == [("scores_kernel", (6, 8), None, None)]
    # The defaults (16 tiles, at least 4096 programs): halved to one tile a program, in the loop kernel.
    assert row_loop_kernels(case) == [("scores_rows_kernel", (6, 8), 1, 2)]
    assert row_loop_kernels(case, fp8_row_tiles=8, fp8_row_min_programs=1) == [("scores_rows_kernel", (6, 1), 8, 2)]
    # 6 rows x 8 tiles: at least 12 programs -> 4 tiles a program (6 x 2), 24 -> 2, 48 -> 1.
    for least, tiles in ((12, 4), (13, 2), (24, 2), (48, 1), (4096, 1)):
        assert row_loop_kernels(case, fp8_row_tiles=8, fp8_row_min_programs=least)[0][2] == tiles, least
    # Four pages a tile (16-column pages): the one-tile kernel.
    small = fp8_long_decode_case(4, page=16, columns=256)
    assert row_loop_kernels(small, fp8_row_tiles=8)[0][0] == "scores_kernel"
    # fp32 queries (the exact fp32 dot) and 16-bit keys: the one-tile kernel.
    assert row_loop_kernels(dict(case, q=case["q"].float()), fp8_row_tiles=8)[0][0] == "scores_kernel"
    with tuning.override(select=tuning.SelectTuning(fp8_row_tiles=8)):
        program = qsa_torch.mqa_paged_scores.plan(**dict(case, k_cache=case["k_cache"].to(torch.bfloat16)),
                                                  compress_ratio=4)
    assert [kernel_name(launch.kernel) for launch in program.launches] == ["scores_kernel"]
    with pytest.raises(ValueError, match="fp8_row_tiles must be a power of two"):
        tuning.SelectTuning(fp8_row_tiles=3)


@pytest.mark.parametrize("prefill", [False, True])
def test_scores_and_selection_fp8_equal_bf16_keys_of_their_values(prefill):
    """Power-of-two scale: logits those of bf16 keys holding the dequantised values within
    float32 rounding (with the default divisor and a custom one; the H200 differs in the last
    bits of ~0.5% of elements, same tiles: not a promise of bitwise), and the selection the
    same (no near-ties at that size; checked on the decode case: the interpreter is slow at
    prefill selections)."""
    case = fp8_scoring_case(12, 0.25, prefill=prefill)
    k_scale = scale_tensor(0.25, shape=(1,))
    widened = dict(case, k_cache=(case["k_cache"].to(torch.bfloat16) * 0.25))
    for divisor in (None, 3.0):
        logits, _ = qsa_torch.mqa_paged_scores(**case, compress_ratio=4, score_divisor=divisor, k_scale=k_scale)
        expected, _ = qsa_torch.mqa_paged_scores(**widened, compress_ratio=4, score_divisor=divisor)
        got, want = f64(logits), f64(expected)
        assert np.array_equal(np.isneginf(got), np.isneginf(want)) and np.isfinite(want).sum() > 10, divisor
        finite = np.isfinite(want)
        # A few float32 ulps of the largest score (sums of relus: cancellation only inside a dot).
        np.testing.assert_allclose(got[finite], want[finite], rtol=1e-6, atol=1e-6 * np.abs(want[finite]).max(),
                                   err_msg=f"fp8 vs bf16 logits (divisor {divisor})")
    if prefill and runtime.INTERPRETED:
        return
    tokens = qsa_torch.select_paged_tokens(**case, token_topk=8, compress_ratio=4, k_scale=k_scale)
    assert_bitwise_equal(tokens, qsa_torch.select_paged_tokens(**widened, token_topk=8, compress_ratio=4),
                         "fp8 vs bf16 selection")
    select = jax.jit(lambda s, *arrays: qsa_jax.select_paged_tokens(*arrays, 8, 4, k_scale=s))
    assert_bitwise_equal(select(to_jax(k_scale), *jax_args(case).values()), tokens, "selection torch vs jax")


# --------------------------------------------------------------------------
# Writers: store_cache_rows(..., scale=), stage 1 -> attention (the
# interpreter's casts made exact by qsa_kernels.interpreter_compat)
# --------------------------------------------------------------------------

@pytest.mark.parametrize("rows_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_store_cache_rows_quantises_like_torch(rows_dtype):
    """Rows / scale, saturated at +-448, rounded to nearest even (torch's cast), bitwise;
    skipped slots leave the cache as it was."""
    g = torch.Generator().manual_seed(5)
    pages, page, width, rows = 6, 4, 96, 9
    cache = torch.randn(pages, page, 1, width, generator=g).to(FP8).to(DEVICE)
    values = torch.randn(rows, width, generator=g) * 3.0
    values[0, :5] = torch.tensor([1e4, -1e4, 500 * 0.3, 0.0, -0.0])  # saturate (at scale 0.3), zeros
    values = values.to(rows_dtype).to(DEVICE)
    slots = torch.tensor([3, -1, 17, 0, pages * page, 22, 9, 5, 11], dtype=torch.int64, device=DEVICE)
    scale = scale_tensor(0.3, shape=(1,))
    expected_cache, written = R.store_cache_rows(host(cache), host(slots), host(quantise(values, float(scale))))
    jax_cache = jax.jit(lambda c, s, r, k: qsa_jax.store_cache_rows(c, s, r, scale=k))(
        to_jax(cache), to_jax(slots), to_jax(values), to_jax(scale))
    out = qsa_torch.store_cache_rows(cache, slots, values, scale=scale)
    assert out is cache and written.sum() == rows - 2
    assert_bitwise_equal(out, expected_cache, "quantising store vs torch's cast")
    assert_bitwise_equal(jax_cache, out, "torch vs JAX")


def fp8_stage1_then_attention(dtype):
    """One request of T tokens through rope_reshape_and_cache into fp8 flash caches
    (shuffled pages), then rows attending random subsets of them."""
    g = torch.Generator().manual_seed(8)
    T, QH, KH, D, P, R_ = 40, 8, 2, 64, 8, 6
    pages = T // P + 2
    table = torch.randperm(pages, generator=g)[: T // P].to(torch.int32)[None]
    tokens = torch.arange(T)
    slots = table[0, tokens // P].long() * P + tokens % P
    angles = torch.rand(64, D // 2, generator=g, dtype=torch.float64) * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1).float()
    q, k, v = (torch.randn(T, h, D, generator=g).to(dtype) for h in (QH, KH, KH))
    key_cache, value_cache = (torch.zeros(pages, P, KH, D).to(FP8) for _ in range(2))
    k_scale, v_scale = scale_tensor(0.02), scale_tensor(0.0125, shape=(1,))
    args = dict(q=q, k=k, v=v, key_cache=key_cache, value_cache=value_cache, slot_mapping=slots,
                positions=tokens, cos_sin=cos_sin)
    args = {n: x.to(DEVICE) for n, x in args.items()}
    indices = torch.stack([torch.randperm(T, generator=g)[:24] for _ in range(R_)]).to(torch.int32)
    attention_q = torch.randn(R_, QH, D, generator=g).to(dtype)
    rest = dict(token_indices=indices.to(DEVICE), block_table=table.to(DEVICE),
                token_to_req=torch.zeros(R_, dtype=torch.int32, device=DEVICE))
    return args, attention_q.to(DEVICE), rest, k_scale, v_scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stage1_writes_fp8_caches_that_attention_reads(dtype):
    """Tight: attention vs the reference on the caches stage 1 wrote (dequantised).
    Loose (fp8's 3-bit mantissa: 3.6e-2 with torch's casts on the CPU): vs the float64
    pipeline that never rounds to fp8; a misapplied scale is off by O(1).
    torch and JAX agree bitwise on the caches and on the output."""
    args, q, rest, k_scale, v_scale = fp8_stage1_then_attention(dtype)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    jax_call = jax.jit(lambda a, s, q, r: (lambda out: (out[2], out[3], qsa_jax.sparse_paged_attention(
        q, out[2], out[3], **r, **s)))(qsa_jax.rope_reshape_and_cache(**a, is_neox=True, **s)))
    jax_caches_out = jax_call({n: to_jax(x) for n, x in args.items()}, {n: to_jax(x) for n, x in scales.items()},
                              to_jax(q), {n: to_jax(x) for n, x in rest.items()})
    _, _, key_cache, value_cache = qsa_torch.rope_reshape_and_cache(**args, is_neox=True, **scales)
    out = qsa_torch.sparse_paged_attention(q, key_cache, value_cache, **rest, **scales)
    tight = R.sparse_paged_attention(f64(q), dequantised(key_cache, float(k_scale)),
                                     dequantised(value_cache, float(v_scale)), *(host(x) for x in rest.values()))
    assert_close(out, tight, tolerance(dtype), "attention vs reference on the written caches")
    _, _, ref_k, ref_v, _ = R.rope_reshape_and_cache(
        *(f64(args[n]) for n in ("q", "k", "v", "key_cache", "value_cache")), host(args["slot_mapping"]),
        host(args["positions"]), f64(args["cos_sin"]), is_neox=True, layout="flash",
        k_scale=float(k_scale), v_scale=float(v_scale), fp8=True)
    exact = R.sparse_paged_attention(f64(q), ref_k * float(k_scale), ref_v * float(v_scale),
                                     *(host(x) for x in rest.values()))
    assert_close(out, exact, 8e-2, "attention vs the float64 pipeline (no fp8 rounding)")
    for i, (a, b) in enumerate(zip(jax_caches_out, (key_cache, value_cache, out))):
        assert_bitwise_equal(a, b, f"torch vs JAX ({('key_cache', 'value_cache', 'out')[i]})")


# --------------------------------------------------------------------------
# NaN and inf through the fp8 writers and readers (issue 28, item 4)
# --------------------------------------------------------------------------

def writer_values(g: torch.Generator, count: int) -> torch.Tensor:
    """float32 values a writer must round as tests/reference.py says: NaN of both signs,
    +-inf, finite values past +-448 (and next to it), every rounding midpoint between
    neighbouring e4m3 values (subnormals included; exact in bf16), zeros of both signs and
    random values over six decades; ``count`` of them (at least 500)."""
    magnitudes = np.array([R.e4m3_value(c) for c in range(0x7F)])
    midpoints = (magnitudes[:-1] + magnitudes[1:]) / 2
    special = np.concatenate([[np.nan, -np.nan, np.inf, -np.inf, 1e30, -1e30, 449.0, 464.0, -464.0, 480.0,
                               0.0, -0.0], midpoints, -midpoints, magnitudes * 0.999, -magnitudes * 1.001])
    others = count - len(special)
    random = torch.randn(others, generator=g).numpy() * 10.0 ** np.resize(np.arange(-4, 2), others)
    return torch.from_numpy(np.concatenate([special, random]).astype(np.float32))


def assert_stored_as_reference(stored: torch.Tensor, values: np.ndarray, scale: float, what: str) -> None:
    """fp8 ``stored`` decodes to ``reference.e4m3_round(values / scale)`` (the division in
    float32, correctly rounded): NaN exactly where it is NaN, the other values and their
    signs bitwise."""
    quotient = (np.asarray(values, np.float32) / np.float32(scale)).astype(np.float64)
    expected = R.e4m3_round(quotient)
    got = f64(stored).reshape(expected.shape)
    assert np.array_equal(np.isnan(got), np.isnan(expected)), f"{what}: NaN codes"
    finite = ~np.isnan(expected)
    wrong = np.count_nonzero(got[finite] != expected[finite])
    assert not wrong, f"{what}: {wrong} values"
    assert np.array_equal(np.signbit(got[finite]), np.signbit(expected[finite])), f"{what}: signs"
    assert np.isnan(expected).any() and (np.abs(expected) == FP8_MAX).any(), "the case has no NaN or saturation"


@pytest.mark.parametrize("rows, width", [(24, 64), pytest.param(256, 128, marks=pytest.mark.gpu, id="decode256-d128")])
@pytest.mark.parametrize("rows_dtype, scale", [(torch.float32, 0.5), (torch.bfloat16, 1.0), (torch.float16, 0.3)])
def test_store_cache_rows_rounds_nan_and_inf_as_the_reference(rows_dtype, scale, rows, width):
    """Bug (issue 28, item 4): a NaN row element was stored as -448 (the saturating clamp ate
    it), so a NaN compressed key read back finite.  Now NaN is a NaN code, +-inf and finite
    values past 448 saturate to +-448, everything else rounds to nearest even.  (GPU: the
    production indexer's rows, 256 x d128, through sm_90's cvt.rn.satfinite.)"""
    g = torch.Generator().manual_seed(31)
    values = writer_values(g, width * rows).reshape(rows, width).to(rows_dtype)
    cache = torch.zeros(rows + 2, 1, 1, width, dtype=FP8, device=DEVICE)
    slots = torch.arange(rows, device=DEVICE)
    scale_t = scale_tensor(scale)
    jax_cache = jax.jit(lambda c, s, r, k: qsa_jax.store_cache_rows(c, s, r, scale=k))(
        to_jax(cache), to_jax(slots), to_jax(values), to_jax(scale_t))
    qsa_torch.store_cache_rows(cache, slots, values.to(DEVICE), scale=scale_t)
    assert_stored_as_reference(cache[:rows], f64(values), float(scale_t), "store_cache_rows")
    assert_bitwise_equal(jax_cache, cache, "torch vs JAX")
    assert not host(cache[rows:]).view(np.uint8).any(), "slots not addressed stay zero"


@pytest.mark.parametrize("T_kv, D, P", [(17, 64, 16),
                                        pytest.param(64, 256, 64, marks=pytest.mark.gpu, id="d256-pages64")])
@pytest.mark.parametrize("layout", ["flash", "shuffled"])
def test_stage1_rounds_nan_and_inf_as_the_reference(layout, T_kv, D, P):
    """Stage 1's k and v (its KV-only rows: cached as given) into fp8 caches: the same
    rounding as store_cache_rows (one quantiser, kernels/fp8.py), NaN kept, +-inf saturated.
    (GPU: the production heads, 2 KV x d256 in pages of 64.)"""
    g = torch.Generator().manual_seed(32)
    T, KH, X = 1, 2, 16
    pages = 4
    k, v = (writer_values(g, T_kv * KH * D).reshape(T_kv, KH, D).roll(shift, 0) for shift in (3, 8))
    q = torch.randn(T, 2, D, generator=g)
    if layout == "flash":
        key_cache, value_cache = (torch.zeros(pages, P, KH, D, dtype=FP8) for _ in range(2))
    else:
        key_cache = torch.zeros(pages, KH, D // X, P, X, dtype=FP8)
        value_cache = torch.zeros(pages, KH, P // X, D, X, dtype=FP8)
    slots = torch.tensor([-1] + list(range(1, T_kv)))  # row 0 is rotated: not cached
    cos_sin = torch.cat([torch.ones(4, D // 2), torch.zeros(4, D // 2)], 1)
    k_scale, v_scale = scale_tensor(0.25), scale_tensor(2.0, shape=(1,))
    args = dict(q=q, k=k, v=v, key_cache=key_cache, value_cache=value_cache, slot_mapping=slots,
                positions=torch.zeros(T, dtype=torch.int64), cos_sin=cos_sin)
    args = {n: x.to(DEVICE) for n, x in args.items()}
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    jax_out = jax.jit(lambda a, s: qsa_jax.rope_reshape_and_cache(**a, **s, is_neox=True))(
        {n: to_jax(x) for n, x in args.items()}, {n: to_jax(x) for n, x in scales.items()})
    _, _, key_cache, value_cache = qsa_torch.rope_reshape_and_cache(**args, **scales, is_neox=True)
    if layout == "flash":
        key_rows, value_rows = key_cache.reshape(-1, KH, D), value_cache.reshape(-1, KH, D)
    else:  # [pages, KH, D//X, P, X] keys and [pages, KH, P//X, D, X] values, back to [slot, KH, D]
        key_rows = key_cache.permute(0, 3, 1, 2, 4).reshape(-1, KH, D)
        value_rows = value_cache.permute(0, 2, 4, 1, 3).reshape(-1, KH, D)
    cached = slots[1:]
    assert_stored_as_reference(key_rows[cached.to(DEVICE)], f64(k[1:]), 0.25, "key_cache")
    assert_stored_as_reference(value_rows[cached.to(DEVICE)], f64(v[1:]), 2.0, "value_cache")
    for name, a, b in (("key_cache", jax_out[2], key_cache), ("value_cache", jax_out[3], value_cache)):
        assert_bitwise_equal(a, b, f"torch vs JAX {name}")


def nan_kv_inputs(dtype):
    """fp8_stage1_then_attention's inputs with NaN in k and v: one element of k (token 5, KV
    head 0), one of v (token 11, head 1), a whole v row (token 20, head 0)."""
    args, q, rest, k_scale, v_scale = fp8_stage1_then_attention(dtype)
    k, v = args["k"].clone(), args["v"].clone()
    k[5, 0, 3] = float("nan")
    v[11, 1, 7] = float("nan")
    v[20, 0] = float("nan")
    return dict(args, k=k, v=v), q, rest, k_scale, v_scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nan_in_k_v_gives_the_nan_rows_of_a_16bit_cache(dtype):
    """Bug (issue 28, item 4): stage 1 stored a NaN of k or v as -448 in an fp8 cache, so
    attention over it was finite where a 16-bit cache gives NaN.  Now: NaN exactly where the
    16-bit cache gives it (a NaN K element: every head of its KV group, for rows attending that
    token; a NaN V element: that column), the rest within fp8's rounding; torch and JAX agree."""
    args, q, rest, k_scale, v_scale = nan_kv_inputs(dtype)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    wide = dict(args, key_cache=torch.zeros_like(args["key_cache"], dtype=dtype),
                value_cache=torch.zeros_like(args["value_cache"], dtype=dtype))
    _, _, key16, value16 = qsa_torch.rope_reshape_and_cache(**wide, is_neox=True)
    expected = f64(qsa_torch.sparse_paged_attention(q, key16, value16, **rest))
    jax_call = jax.jit(lambda a, s, q, r: (lambda out: qsa_jax.sparse_paged_attention(q, out[2], out[3], **r, **s))(
        qsa_jax.rope_reshape_and_cache(**a, is_neox=True, **s)))
    jax_out = jax_call({n: to_jax(x) for n, x in args.items()}, {n: to_jax(x) for n, x in scales.items()},
                       to_jax(q), {n: to_jax(x) for n, x in rest.items()})
    _, _, key_cache, value_cache = qsa_torch.rope_reshape_and_cache(**args, is_neox=True, **scales)
    out = qsa_torch.sparse_paged_attention(q, key_cache, value_cache, **rest, **scales)
    nan = np.isnan(expected)
    assert nan.any() and not nan.all(), "the case must have NaN and finite output elements"
    # (RoPE spreads k's NaN to its rotation pair.)
    assert np.isnan(f64(key_cache)).sum() == 2 and np.isnan(f64(value_cache)).sum() == 1 + 64, "NaN codes stored"
    assert_close(out, expected, 8e-2, "fp8 vs 16-bit cache (NaN places exactly)")
    assert_bitwise_equal(jax_out, out, "torch vs JAX")


def assert_logits_like(logits, expected) -> None:
    """fp8-key logits as those of the same keys widened to bf16: NaN and -inf in the same places, the
    rest to float32 rounding.  (Whether a NaN key gives a NaN logit is the relu's: the GPU's max.f32
    drops NaN, as Triton 3.9's interpreter does, 3.6's keeps it; the same for fp8 and bf16 keys.)"""
    got, want = f64(logits), f64(expected)
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-6, atol=1e-6 * np.abs(want[finite]).max())


def test_nan_in_stored_keys_scores_as_16bit_keys():
    """Bug (issue 28, item 4): store_cache_rows(..., scale=) stored a NaN key element as -448.
    Now the fp8 compressed keys hold NaN codes where the rows had NaN, and the scorer reads them
    as NaN: the logits are those of bf16 keys holding the dequantised values (NaN included), and
    the selections agree; torch and JAX agree."""
    g = torch.Generator().manual_seed(33)
    case = scoring_case(13)
    k_cache = case["k_cache"]
    page_size, dim = k_cache.shape[1], k_cache.shape[3]
    # Request 0's first page, visible to its row: keys with NaN in two of them.
    first_page = int(case["page_table"][0, 0])
    slots = (first_page * page_size + torch.arange(page_size)).to(DEVICE)
    rows = (torch.randn(page_size, dim, generator=g) * 2).to(torch.bfloat16)
    rows[2, 5] = float("nan")
    rows[9] = float("nan")
    scale = scale_tensor(0.25)
    fp8_cache = quantise(k_cache, 0.25)
    qsa_torch.store_cache_rows(fp8_cache, slots, rows.to(DEVICE), scale=scale)
    assert np.isnan(f64(fp8_cache[first_page])).sum() == 1 + dim, "NaN codes stored"
    wide = dict(case, k_cache=(fp8_cache.to(torch.bfloat16) * 0.25))  # exact: a power-of-two scale
    fp8_case = dict(case, k_cache=fp8_cache)
    logits, _ = qsa_torch.mqa_paged_scores(**fp8_case, compress_ratio=4, k_scale=scale)
    expected, _ = qsa_torch.mqa_paged_scores(**wide, compress_ratio=4)
    assert_logits_like(logits, expected)
    scores = jax.jit(lambda s, *arrays: qsa_jax.mqa_paged_scores(*arrays, 4, k_scale=s))
    assert_bitwise_equal(scores(to_jax(scale), *jax_args(fp8_case).values())[0], logits, "logits torch vs JAX")
    tokens = qsa_torch.select_paged_tokens(**fp8_case, token_topk=8, compress_ratio=4, k_scale=scale)
    assert_bitwise_equal(tokens, qsa_torch.select_paged_tokens(**wide, token_topk=8, compress_ratio=4),
                         "fp8 vs bf16 selection")


class Fp8BesideBf16:
    """A random bf16 step state and its fp8 copy (:func:`fp8_state`, below), with what stepping
    them side by side takes: the generator (for the inputs), a pager and the RoPE tables."""

    def __init__(self, model: Model, seed: int, pager_seed: int, geometry: CacheGeometry = GEOMETRY,
                 positions: int = 64):
        self.model = model
        self.g = torch.Generator().manual_seed(seed)
        self.pager = PagedRequests(geometry, seed=pager_seed)
        self.cos_sin, self.index_cos_sin = rope_table(model.D, positions), rope_table(model.DI, positions)
        self.bf16_state = random_state(model, self.g, geometry)
        self.state = fp8_state(clone_state(self.bf16_state))

    def options(self, host_meta) -> dict:
        """The torch step's arguments but the inputs and the state."""
        return dict(metadata=qsa_torch.StepMetadata.from_host(host_meta, DEVICE), cos_sin=self.cos_sin,
                    index_cos_sin=self.index_cos_sin, return_token_indices=True, **self.model.options())

    def jax_step(self, **jit):
        """The JAX step under a fresh ``jax.jit(..., **jit)`` (JAX plans when it traces, under the
        tuning then in force), called as ``(torch inputs, JAX state, host_meta)``: ``(out, state,
        token_indices)``."""
        step = jax.jit(lambda i, s, m, c, ic: qsa_jax.qsa_attention_step(
            **i, state=s, metadata=m, cos_sin=c, index_cos_sin=ic, return_token_indices=True,
            **self.model.options()), **jit)
        return lambda inputs, state, host_meta: step(
            {n: to_jax(a) for n, a in inputs.items()}, state, qsa_jax.StepMetadata.from_host(host_meta),
            to_jax(self.cos_sin), to_jax(self.index_cos_sin))


def jax_state(state: qsa_torch.QSAState) -> qsa_jax.QSAState:
    """The same state for qsa_jax (its None scales kept)."""
    return step_to_jax(dict(state=state))["state"]


def assert_nan_as_bf16(out, state, bf16_out, bf16_state) -> None:
    """NaN out elements (some, not all) and NaN cache places of an fp8 step as of its bf16 twin."""
    nan = np.isnan(f64(bf16_out))
    assert nan.any() and not nan.all()
    assert np.array_equal(np.isnan(f64(out)), nan), "NaN out elements"
    for name in ("key_cache", "value_cache", "compressed_key_cache"):
        assert np.array_equal(np.isnan(f64(getattr(state, name))), np.isnan(f64(getattr(bf16_state, name)))), name


def _nan_step_inputs(model, rows, g):
    """random_inputs with NaN in k (row 2), v (row 5) and index_k (row 3)."""
    inputs = random_inputs(model, rows, g)
    inputs["k"][2, 1, 4] = float("nan")
    inputs["v"][5, 0, 9] = float("nan")
    inputs["index_k"][3, 0, 1] = float("nan")
    return inputs


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_step_nan_with_fp8_caches_as_with_bf16(fuse):
    """The composed step with fp8 K/V and compressed-key caches and NaN in k, v and index_k:
    the same NaN out rows and the same NaN cache places as with bf16 caches (the NaN index
    key's group is stored NaN by the fused or the separate compression launches), torch and
    JAX bitwise.  token_topk covers every group, so the selection does not depend on scores."""
    model = Model(token_topk=48, index_dtype=torch.bfloat16)
    run = Fp8BesideBf16(model, seed=34, pager_seed=2)
    host_meta = run.pager.step({"a": 9, "b": 6})
    inputs = _nan_step_inputs(model, host_meta.num_rows, run.g)
    step = run.options(host_meta)
    with tuning.override(step=tuning.StepTuning(fuse_stages=fuse)):
        jax_out, jax_state_after, _ = run.jax_step()(inputs, jax_state(run.state), host_meta)
        out, state, _ = qsa_torch.qsa_attention_step(**inputs, state=run.state, **step)
        bf16_out, bf16_state, _ = qsa_torch.qsa_attention_step(**inputs, state=run.bf16_state, **step)
    assert_nan_as_bf16(out, state, bf16_out, bf16_state)
    assert np.isnan(f64(state.compressed_key_cache)).any(), "the NaN index key's group is stored NaN"
    assert_bitwise_equal(out, jax_out, "torch vs JAX out")
    for name in STATE_FIELDS:
        assert_bitwise_equal(getattr(state, name), getattr(jax_state_after, name), f"torch vs JAX {name}")


# GPU: the readers' NaN codes at production geometry (the launch table's rows, the bf16 bit
# trick and the fp16 hardware cast), and the step.

def _put_nan_codes(cache8: torch.Tensor, slot_rows: list[tuple[int, int, slice | int]]) -> None:
    """Writes the NaN codes 0x7f and 0xff (alternately) at ``(slot, kv head, dims)`` of a flash fp8 cache."""
    flat = cache8.view(torch.uint8).view(-1, *cache8.shape[2:])
    for i, (slot, head, dims) in enumerate(slot_rows):
        flat[slot, head, dims] = 0x7F if i % 2 == 0 else 0xFF


def _selected_slots(args, rows, count):
    """``count`` distinct cache slots of valid tokens that the given rows select."""
    indices, table, to_req = (host(args[n]) for n in ("token_indices", "block_table", "token_to_req"))
    page, pages = args["k_cache"].shape[1], args["k_cache"].shape[0]
    slots: list[int] = []
    for row in rows:
        request = int(to_req[row])
        for token in indices[row].tolist() if 0 <= request < table.shape[0] else ():
            physical = int(table[request, token // page]) if 0 <= token < table.shape[1] * page else -1
            if 0 <= physical < pages and physical * page + token % page not in slots:
                slots.append(physical * page + token % page)
            if len(slots) == count:
                return slots
    raise AssertionError("too few selected tokens")


@pytest.mark.gpu
@pytest.mark.parametrize("rows, dtype", [(1, torch.bfloat16), (64, torch.bfloat16), (256, torch.bfloat16),
                                         (2048, torch.bfloat16), (64, torch.float16), (256, torch.float16)])
def test_attention_fp8_nan_codes_production(rows, dtype):
    """Production attention (24 Q / 2 KV heads x d256, pages of 64, 2051 selected tokens) at
    each fp8 launch-table row (1, 64, 256 decode rows; the 2048-row prefill), bf16 q (the bit
    trick) and fp16 q (the hardware cast): fp8 caches holding both NaN codes (one K element, a
    whole K row and a whole V row of KV head 0, one V element of head 1, at tokens the first
    rows select) give NaN exactly where
    the 16-bit kernel over the dequantised caches does, the rest within q's dtype's tolerance
    (the fp8 and 16-bit launch tables differ); torch and JAX agree.  Bug (issue 28, item 4):
    the bit trick read the NaN codes as +-480."""
    c = Case(R=rows, QH=24, KH=2, D=256, P=64, W=2051, requests=min(rows, 64), pages_per_request=40, dtype=dtype)
    args, scales, (k_scale, v_scale) = fp8_attention_inputs(c, 0.125, 4.0)
    slots = _selected_slots(args, range(min(rows, 8)), 4)
    # KV head 0: NaN K (all its heads NaN where attended); head 1: one V element (one column).
    _put_nan_codes(args["k_cache"], [(slots[0], 0, 7), (slots[1], 0, slice(None))])
    _put_nan_codes(args["v_cache"], [(slots[2], 1, 100), (slots[3], 0, slice(None))])
    widened = dict(args, k_cache=(args["k_cache"].to(dtype) * k_scale).to(dtype),
                   v_cache=(args["v_cache"].to(dtype) * v_scale).to(dtype))
    out = qsa_torch.sparse_paged_attention(**args, **scales)
    expected = qsa_torch.sparse_paged_attention(**widened)
    nan = np.isnan(f64(expected))
    assert nan.any() and not nan.all()
    assert_close(out, f64(expected), tolerance(dtype), "fp8 vs 16-bit cache of its values (NaN places exactly)")
    if rows <= 256:
        assert_bitwise_equal(run_jax_attention(args, scales), out, "torch vs JAX")


@pytest.mark.gpu
@pytest.mark.parametrize("columns, fused", [(8192, False), (32768, True), (32768, False)])
def test_scorer_fp8_nan_codes_production(columns, fused):
    """The production indexer (4 heads x d128, pages of 64) over fp8 keys holding NaN codes (a
    whole key and one element of another, in the long requests' visible columns): logits those
    of bf16 keys holding the dequantised values, NaN included, within float32 rounding; the
    fused selection equals the three launches bit for bit (torch and JAX), as without NaN."""
    case = long_decode_case(61, columns=columns, heads=4, dim=128)
    case["k_cache"] = quantise(case["k_cache"], 0.0625)
    page_table = host(case["page_table"])
    page = case["k_cache"].shape[1]
    nan_slots = [int(page_table[0, 3]) * page + 5, int(page_table[1, 2]) * page + 17]
    codes = case["k_cache"].view(torch.uint8).view(-1, 128)
    codes[nan_slots[0]] = 0x7F
    codes[nan_slots[1], 64] = 0xFF
    k_scale = scale_tensor(0.0625)
    wide = dict(case, k_cache=case["k_cache"].to(torch.bfloat16) * 0.0625)
    with tuning.override(select=tuning.SelectTuning(fused_max_columns=columns)):
        logits, _ = qsa_torch.mqa_paged_scores(**case, compress_ratio=4, k_scale=k_scale)
        expected, _ = qsa_torch.mqa_paged_scores(**wide, compress_ratio=4)
        assert_logits_like(logits, expected)
        if fused:
            assert_fused_equals_three_launches(case, 2048, max_columns=columns, k_scale=k_scale,
                                               score_columns=tuning.SelectTuning().fused_score_columns)


@pytest.mark.gpu
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_step_fp8_nan_production_heads(fuse):
    """The composed step at the production heads (24 Q / 2 KV x d256; indexer 4 x d128, ratio
    4, pages of 64) with fp8 K/V and compressed-key caches and NaN in k, v and index_k: a
    prefill (separate compression launches: 500 rows) then a decode step (fused compression
    unless ``fuse`` is off): NaN out elements and NaN cache places as with bf16 caches, and the
    selection the same (token_topk covers every group); torch and JAX bitwise."""
    model = Model(QH=24, KH=2, D=256, IH=4, DI=128, ratio=4, token_topk=1024, index_dtype=torch.bfloat16)
    geometry = CacheGeometry(page_size=64, num_pages=24, compress_ratio=4, compressed_page_size=64,
                             num_compressed_pages=8, max_context=1024, max_requests=2)
    run = Fp8BesideBf16(model, seed=35, pager_seed=3, geometry=geometry, positions=1024)
    state, bf16_state, jax_state_now = run.state, run.bf16_state, jax_state(run.state)
    for schedule in ({"a": 300, "b": 200}, {"a": 1, "b": 1}):  # the decode row of a attends the NaN K/V
        host_meta = run.pager.step(schedule)
        inputs = (_nan_step_inputs if host_meta.num_rows > 5 else random_inputs)(model, host_meta.num_rows, run.g)
        step = run.options(host_meta)
        with tuning.override(step=tuning.StepTuning(fuse_stages=fuse)):
            jax_out, jax_state_now, jax_indices = run.jax_step()(inputs, jax_state_now, host_meta)
            out, state, indices = qsa_torch.qsa_attention_step(**inputs, state=state, **step)
            bf16_out, bf16_state, bf16_indices = qsa_torch.qsa_attention_step(**inputs, state=bf16_state, **step)
        assert_bitwise_equal(indices, bf16_indices, "every group selected: the same tokens")
        assert_nan_as_bf16(out, state, bf16_out, bf16_state)
        assert_bitwise_equal(out, jax_out, "torch vs JAX out")
        assert_bitwise_equal(indices, jax_indices, "torch vs JAX token_indices")
        for name in STATE_FIELDS:
            assert_bitwise_equal(getattr(state, name), getattr(jax_state_now, name), f"torch vs JAX {name}")


# --------------------------------------------------------------------------
# The fp8 valid calls of test_bad_arguments' table work in both adapters
# --------------------------------------------------------------------------

@CPU_ONLY
@pytest.mark.parametrize("function", list(FP8_BASES))
def test_fp8_bases_are_valid(function):
    run_in_both_adapters(function, FP8_BASES[function])


# --------------------------------------------------------------------------
# The composed step with fp8 caches (QSAState's scales)
# --------------------------------------------------------------------------

def fp8_state(state, k_scale=0.05, v_scale=0.02, compressed_key_scale=0.03):
    """The K/V and compressed-key caches of ``state`` quantised, with their float32 scales."""
    return dataclasses.replace(
        state, key_cache=quantise(state.key_cache, k_scale), value_cache=quantise(state.value_cache, v_scale),
        compressed_key_cache=quantise(state.compressed_key_cache, compressed_key_scale),
        k_scale=scale_tensor(k_scale), v_scale=scale_tensor(v_scale, shape=(1,)),
        compressed_key_scale=scale_tensor(compressed_key_scale))


def test_step_fp8_caches_torch_jax_bitwise_and_close_to_bf16():
    """Steps over fp8 caches: torch and JAX (jit, donated state) bit-identical (out, indices,
    every cache).  With token_topk covering every group, the selection cannot depend on the
    scores, so it equals the bf16 run's and out is within fp8's rounding of it."""
    model = Model(token_topk=48, index_dtype=torch.bfloat16)
    run = Fp8BesideBf16(model, seed=21, pager_seed=2)
    state, bf16_state, jax_state_now = run.state, run.bf16_state, jax_state(run.state)
    jax_step = run.jax_step(donate_argnums=(1,))
    for schedule in ({"a": 9, "b": 6}, {"a": 1, "b": 1, "c": 5}):  # prefill chunks; decode rows and a join
        host_meta = run.pager.step(schedule)
        inputs = random_inputs(model, host_meta.num_rows, run.g)
        step = run.options(host_meta)
        out, state, indices = qsa_torch.qsa_attention_step(**inputs, state=state, **step)
        bf16_out, bf16_state, bf16_indices = qsa_torch.qsa_attention_step(**inputs, state=bf16_state, **step)
        jax_out, jax_state_now, jax_indices = jax_step(inputs, jax_state_now, host_meta)
        assert state.key_cache.dtype == FP8 and state.compressed_key_cache.dtype == FP8
        assert_bitwise_equal(out, jax_out, "torch vs JAX out")
        assert_bitwise_equal(indices, jax_indices, "torch vs JAX token_indices")
        for name in STATE_FIELDS + SCALE_FIELDS:
            assert_bitwise_equal(getattr(state, name), getattr(jax_state_now, name), f"torch vs JAX {name}")
        assert_bitwise_equal(indices, bf16_indices, "every group selected: the same tokens as bf16")
        assert_close(out, f64(bf16_out), 8e-2, "fp8 step vs bf16 step")


@pytest.mark.gpu
def test_step_fp8_selection_close_to_bf16():
    """A real choice of blocks (top 8 tokens of up to 11 groups): fp8 compressed keys select
    most of bf16's blocks (on random data; measured on the benchmark data: ~0.97)."""
    model = Model(token_topk=8, index_dtype=torch.bfloat16)
    run = Fp8BesideBf16(model, seed=22, pager_seed=4)
    host_meta = run.pager.step({"a": 44, "b": 40, "c": 37})
    inputs = random_inputs(model, host_meta.num_rows, run.g)
    step = run.options(host_meta)
    _, _, indices = qsa_torch.qsa_attention_step(**inputs, state=run.state, **step)
    _, _, bf16_indices = qsa_torch.qsa_attention_step(**inputs, state=run.bf16_state, **step)
    same = [len(set(a[a >= 0]) & set(b[b >= 0])) / max(1, (b >= 0).sum()) for a, b in zip(host(indices), host(bf16_indices))]
    assert np.mean(same) >= 0.8, f"fp8 selection matches bf16's on {np.mean(same):.2f} of the tokens"


def test_step_scale_errors_same_in_both_adapters():
    """Scales exactly for the fp8 caches, checked before any stage writes."""
    base = step_arguments()
    bf16 = base["state"]
    fp8 = dataclasses.replace(bf16, key_cache=bf16.key_cache.to(FP8), value_cache=bf16.value_cache.to(FP8),
                              k_scale=scale_tensor(0.5), v_scale=scale_tensor(0.5))
    cases = [
        (dataclasses.replace(fp8, k_scale=None),
         "qsa_attention_step: state.k_scale must be given (a 0-d or 1-element float array) for a float8_e4m3fn "
         "state.key_cache, got None"),
        (dataclasses.replace(fp8, v_scale=None), "qsa_attention_step: state.v_scale must be given"),
        (dataclasses.replace(bf16, k_scale=scale_tensor(0.5)),
         "qsa_attention_step: state.k_scale must be None for a bfloat16 state.key_cache (scales are for "
         "float8_e4m3fn caches), got an array of shape ()"),
        (dataclasses.replace(bf16, compressed_key_cache=bf16.compressed_key_cache.to(FP8)),
         "qsa_attention_step: state.compressed_key_scale must be given"),
        (dataclasses.replace(bf16, compressed_key_scale=scale_tensor(1.0, shape=(1,))),
         "qsa_attention_step: state.compressed_key_scale must be None for a float32 state.compressed_key_cache"),
    ]
    for state, expected in cases:
        originals = [getattr(state, n).clone() for n in STATE_FIELDS]
        arguments = dict(base, state=state)
        messages = []
        for adapter, args in ((qsa_torch, arguments), (qsa_jax, step_to_jax(arguments))):
            with pytest.raises(ValueError) as info:
                adapter.qsa_attention_step(**args)
            messages.append(str(info.value))
        assert messages[0] == messages[1] and messages[0].startswith(expected), messages
        for name, original in zip(STATE_FIELDS, originals):
            assert_bitwise_equal(getattr(state, name), original, f"{name} written before the error")


def test_state_zeros_with_fp8_caches():
    geometry = GEOMETRY
    for adapter, fp8_dtype, bf16 in ((qsa_torch, FP8, torch.bfloat16), (qsa_jax, jax.numpy.float8_e4m3fn, jax.numpy.bfloat16)):
        state = adapter.QSAState.zeros(geometry, kv_heads=2, head_dim=32, index_head_dim=16, dtype=bf16,
                                       cache_dtype=fp8_dtype, compressed_key_dtype=fp8_dtype, k_scale=0.5,
                                       v_scale=0.25, compressed_key_scale=2.0)
        assert str(state.key_cache.dtype).endswith("float8_e4m3fn") and str(state.compressed_key_cache.dtype).endswith("float8_e4m3fn")
        assert str(state.compressor_state_cache.dtype).endswith("bfloat16")
        assert [float(np.asarray(host(s) if isinstance(s, torch.Tensor) else s)) for s in
                (state.k_scale, state.v_scale, state.compressed_key_scale)] == [0.5, 0.25, 2.0]
        plain = adapter.QSAState.zeros(geometry, kv_heads=2, head_dim=32, index_head_dim=16, dtype=bf16)
        assert plain.k_scale is None and plain.v_scale is None and plain.compressed_key_scale is None
