"""Stage 4 (sparse_paged_attention): both adapters against the float64 reference,
split and unsplit paths, skipped indices, torch-vs-JAX bitwise parity under
jax.jit, the plan's launch table, validation."""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import numpy as np
import pytest
import torch

import qsa_jax
import qsa_torch
from qsa_kernels import attention, tuning
from qsa_kernels.launch import ArrayInfo

from . import reference as R
from .util import DEVICE, assert_bitwise_equal, assert_close, f64, host, to_jax, tolerance

ARGUMENTS = ("q", "k_cache", "v_cache", "token_indices", "block_table", "token_to_req")


@dataclasses.dataclass
class Case:
    """One configuration; options are spread pairwise over the cases."""

    R: int = 4
    QH: int = 8
    KH: int = 2
    D: int = 64
    P: int = 8
    W: int = 24  # selection width
    requests: int = 2
    pages_per_request: int = 4
    dtype: torch.dtype = torch.bfloat16
    index_dtype: torch.dtype = torch.int32
    splits: int | None = None  # None: the plan's table (small cases: as many as tiles)
    scale: float | None = None
    views: bool = False  # q, caches, indices and table as strided views
    seed: int = 0


def make_inputs(c: Case):
    """Random q/K/V with shuffled physical pages, ragged valid counts per row,
    duplicates, and every kind of skipped index mixed in."""
    g = torch.Generator().manual_seed(c.seed)
    rng = np.random.default_rng(c.seed)
    blocks = c.requests * c.pages_per_request + 3
    width = c.pages_per_request + 1  # the last logical page is unmapped (-1)
    # Views are sliced on the device: moving a view would make it contiguous.
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(device=DEVICE, dtype=c.dtype)  # noqa: E731
    index_tensor = lambda array: torch.from_numpy(array).to(device=DEVICE, dtype=c.index_dtype)  # noqa: E731

    if c.views:
        # q sliced from a packed qkv; caches from a pool with twice the heads;
        # indices and table as column slices of wider arrays.
        qkv = rnd(c.R, c.QH + 2 * c.KH, c.D)
        q = qkv[:, : c.QH]
        k_pool, v_pool = rnd(blocks, c.P, 2 * c.KH, c.D), rnd(blocks, c.P, 2 * c.KH, c.D)
        k_cache, v_cache = k_pool[:, :, c.KH:], v_pool[:, :, : c.KH]
    else:
        q = rnd(c.R, c.QH, c.D)
        k_cache, v_cache = rnd(blocks, c.P, c.KH, c.D), rnd(blocks, c.P, c.KH, c.D)

    table = np.full((c.requests, width), -1, np.int64)
    table[:, : c.pages_per_request] = rng.permutation(blocks)[: c.requests * c.pages_per_request].reshape(
        c.requests, c.pages_per_request)
    table[0, 1] = -1  # an unmapped page inside the context
    table[-1, 0] = blocks + 2  # an out-of-range page
    context = rng.integers(c.P + 1, c.pages_per_request * c.P, size=c.requests)  # not page multiples

    to_req = rng.integers(0, c.requests, size=c.R)
    indices = np.full((c.R, c.W), -1, np.int64)
    skipped = [-1, -7, width * c.P + 3, 10 * width * c.P, (width - 1) * c.P + 1]  # negative, past the table, unmapped
    for row in range(c.R):
        valid = rng.integers(1, c.W + 1)  # ragged; sampled with replacement, so duplicates occur
        tokens = list(rng.integers(0, context[to_req[row]], size=valid))
        tokens += list(rng.choice(skipped, size=c.W - valid))
        if row == 0 and c.W >= 3:
            tokens[-2:] = [tokens[0]] * 2  # a token listed three times
        indices[row] = rng.permutation(tokens)
    if c.R >= 4:
        indices[1] = -1  # nothing selected
        to_req[2] = -1  # no request
        to_req[3] = c.requests  # request past the table

    if c.views:
        wide = np.full((c.R, c.W + 5), 123, np.int64)
        wide[:, 2: 2 + c.W] = indices
        token_indices = index_tensor(wide)[:, 2: 2 + c.W]
        wide_table = np.full((c.requests, width + 3), 0, np.int64)
        wide_table[:, :width] = table
        block_table = index_tensor(wide_table)[:, :width]
    else:
        token_indices, block_table = index_tensor(indices), index_tensor(table)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, token_indices=token_indices,
                block_table=block_table, token_to_req=index_tensor(to_req))


def reference_for(args, scale=None):
    return R.sparse_paged_attention(
        f64(args["q"]), f64(args["k_cache"]), f64(args["v_cache"]), host(args["token_indices"]),
        host(args["block_table"]), host(args["token_to_req"]), softmax_scale=scale)


def run_jax(args, scale=None):
    call = jax.jit(lambda *arrays: qsa_jax.sparse_paged_attention(*arrays, softmax_scale=scale))
    return call(*(to_jax(args[n]) for n in ARGUMENTS))


def with_splits(n: int | None) -> tuning.AttentionTuning:
    """The default launch table with the split count forced to ``n`` (None: the table's)."""
    return tuning.AttentionTuning(num_splits=n)


@pytest.fixture
def force_splits():
    """``force(n)`` makes both public functions plan ``n`` splits until the test ends."""
    with contextlib.ExitStack() as stack:
        def force(n: int | None):
            if n is not None:
                stack.enter_context(tuning.override(attention=with_splits(n)))
        yield force


def plan_with(args, forced: tuning.AttentionTuning):
    """The Program a call with ``args`` runs under ``forced``."""
    with tuning.override(attention=forced):
        return qsa_torch.sparse_paged_attention.plan(**{n: args[n] for n in ARGUMENTS})


def planned_splits(args, num_splits=None) -> int:
    """The split count (the partials' first dimension, merged in the launch or by a merge launch)."""
    return plan_with(args, with_splits(num_splits)).buffer("partial_lse").shape[0]


def check_case(c: Case, force_splits):
    args = make_inputs(c)
    splits = planned_splits(args, c.splits)
    assert c.splits in (None, splits), f"the case asks for {c.splits} splits but plans {splits}"
    force_splits(c.splits)
    out = qsa_torch.sparse_paged_attention(**args, softmax_scale=c.scale)
    ref = reference_for(args, c.scale)
    assert out.dtype == c.dtype and out.shape == (c.R, c.QH, c.D)
    assert_close(out, ref, tolerance(c.dtype), f"torch vs reference ({splits} splits)")
    assert np.abs(ref).sum() > 0, "the case attends nothing: it tests nothing"
    assert_bitwise_equal(run_jax(args, c.scale), out, "torch vs JAX")


# Group sizes 1/4/12/16 x head dims 64/128/256, every pair once; dtype, split
# count, scale, index dtype and strided views spread over them.  Widths span
# several BLOCK_N tiles (BLOCK_N = 128 / 64 / 32 for D = 64 / 128 / 256).
CASES = {
    "g1_d64_bf16_table": Case(QH=2, KH=2, D=64, W=300),
    "g1_d128_fp16_unsplit_scale": Case(QH=2, KH=2, D=128, W=150, dtype=torch.float16, splits=1, scale=0.2),
    "g1_d256_bf16_3splits_views": Case(QH=1, KH=1, D=256, W=180, splits=3, views=True),
    "g4_d64_fp16_2splits_int64": Case(QH=8, KH=2, D=64, W=300, dtype=torch.float16, splits=2, index_dtype=torch.int64),
    "g4_d128_bf16_table_scale": Case(QH=4, KH=1, D=128, W=150, scale=0.05, P=16),
    "g4_d256_fp16_unsplit": Case(QH=8, KH=2, D=256, W=70, dtype=torch.float16, splits=1),
    "g12_d64_bf16_unsplit_int64_views": Case(QH=12, KH=1, D=64, W=200, splits=1, index_dtype=torch.int64, views=True),
    "g12_d128_fp16_table": Case(QH=24, KH=2, D=128, W=150, dtype=torch.float16, R=5),
    "g12_d256_bf16_production_table": Case(QH=24, KH=2, D=256, W=75, P=16),
    "g16_d64_fp16_table_scale": Case(QH=16, KH=1, D=64, W=260, dtype=torch.float16, scale=1.5),
    "g16_d128_bf16_3splits_views": Case(QH=32, KH=2, D=128, W=600, splits=3, views=True),
    "g16_d256_fp16_unsplit_int64": Case(QH=16, KH=1, D=256, W=40, dtype=torch.float16, splits=1, index_dtype=torch.int64),
}


@pytest.mark.parametrize("name", list(CASES))
def test_against_reference_and_jax(name, force_splits):
    check_case(CASES[name], force_splits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_split_and_unsplit_agree(dtype):
    """Splits change the results only through rounding: each split rounds its
    probabilities to the value dtype against its own running max, and the
    output is rounded once more (measured: ~1.5e-3 bf16, ~1.6e-4 fp16)."""
    c = Case(QH=12, KH=1, D=128, W=500, R=3, dtype=dtype)  # 4 tiles of 128
    args = make_inputs(c)
    outputs = {}
    for n in (1, 2, 4):
        assert planned_splits(args, n) == n
        with tuning.override(attention=with_splits(n)):
            outputs[n] = f64(qsa_torch.sparse_paged_attention(**args))
    ref = reference_for(args)
    for n, out in outputs.items():
        assert_close(out, ref, tolerance(dtype), f"{n} splits vs reference")
        assert_close(out, outputs[1], tolerance(dtype) / 4, f"{n} splits vs 1 split")


def check_against_reference(args, ref, dtype):
    out = qsa_torch.sparse_paged_attention(**args)
    assert_close(out, ref, tolerance(dtype), "torch vs reference")
    assert_bitwise_equal(run_jax(args), out, "torch vs JAX")
    return out


def test_rows_without_valid_tokens_are_zero(force_splits):
    c = Case(R=7, QH=4, KH=2, D=64, W=130)  # two tiles of 128
    args = make_inputs(c)
    indices, to_req = args["token_indices"], args["token_to_req"]
    table_width = args["block_table"].shape[1]
    indices[4] = table_width * c.P + 5  # every position past the block table
    indices[5] = (table_width - 1) * c.P  # every position on the unmapped last page
    to_req[5] = 0
    indices[6, ::2] = 1 * c.P + 1  # request 0's unmapped page 1, and -1
    indices[6, 1::2] = -1
    to_req[6] = 0
    ref = reference_for(args)
    for splits in (1, 2):
        assert planned_splits(args, splits) == splits
        force_splits(splits)
        out = f64(check_against_reference(args, ref, c.dtype))
        assert not out[1:].any(), f"rows with no valid token must be exactly zero ({splits} splits)"
        assert out[0].any()


def test_duplicates_count_twice():
    c = Case(R=1, QH=4, KH=1, D=64, W=3, requests=1, P=4)
    args = make_inputs(c)
    table, blocks = host(args["block_table"]), args["k_cache"].shape[0]
    mapped = [t for t in range(c.P * 4) if 0 <= table[0, t // c.P] < blocks][:2]
    args["token_to_req"][0] = 0
    args["token_indices"][0] = torch.tensor([mapped[0], mapped[1], mapped[0]])
    out = f64(qsa_torch.sparse_paged_attention(**args))
    assert_close(out, reference_for(args), tolerance(c.dtype), "duplicates kept")
    deduplicated = dict(args, token_indices=args["token_indices"][:, :2].contiguous())
    assert np.abs(out - reference_for(deduplicated)).max() > 0.05, "a duplicate must weigh twice"


def test_default_scale_is_inverse_sqrt_d():
    args = make_inputs(Case(R=2, D=128, W=64))
    default = qsa_torch.sparse_paged_attention(**args)
    explicit = qsa_torch.sparse_paged_attention(**args, softmax_scale=128 ** -0.5)
    other = qsa_torch.sparse_paged_attention(**args, softmax_scale=0.3)
    assert_bitwise_equal(default, explicit, "default vs D ** -0.5")
    assert (f64(default) != f64(other)).any()


def test_empty_selection_and_no_rows():
    args = make_inputs(Case(R=4, W=8))
    no_width = dict(args, token_indices=args["token_indices"][:, :0])
    out = qsa_torch.sparse_paged_attention(**no_width)
    assert out.shape == (4, 8, 64) and not f64(out).any()
    assert_bitwise_equal(run_jax(no_width), out, "torch vs JAX, W = 0")
    no_rows = {n: (a[:0] if n in ("q", "token_indices", "token_to_req") else a) for n, a in args.items()}
    assert qsa_torch.sparse_paged_attention(**no_rows).shape == (0, 8, 64)
    assert run_jax(no_rows).shape == (0, 8, 64)


def _production_plan(rows, width=2051, d=256, qh=24, kh=2, series=tuning.TIMED_TRITON, fp8=False, **tuned):
    """stage 4 planned for the production geometry (24 Q / 2 KV heads, d256) under the
    defaults of Triton ``series`` (those timed on the H200: 3.6), fields ``tuned`` replaced."""
    a = ArrayInfo.contiguous
    cache = "float8_e4m3fn" if fp8 else "bfloat16"
    scales = dict(k_scale=a((), "float32"), v_scale=a((1,), "float32")) if fp8 else {}
    return attention.plan_sparse_paged_attention(
        a((rows, qh, d), "bfloat16"), a((4096, 64, kh, d), cache), a((4096, 64, kh, d), cache),
        a((rows, width), "int32"), a((8, 2048), "int32"), a((rows,), "int32"),
        tuning=dataclasses.replace(tuning.defaults(series).attention, **tuned), **scales)


def test_launch_table():
    """The plan's choices for the production geometry (24 Q / 2 KV heads, d256): the tables timed on the H200."""
    plan = _production_plan

    # With the merge in the launch (AttentionTuning.fused_merge, off by default): 33 splits, then 12
    # merging programs.
    (fused,) = plan(1, fused_merge=True).launches
    assert fused.kernel is attention.sparse_attention_fused_merge_kernel and fused.grid == (1, 2, 33 + 12)
    assert fused.constexprs["NUM_SPLITS"] == 33 and fused.constexprs["MERGERS"] == 12
    assert fused.constexprs["MERGE_HEADS"] == 1 and fused.constexprs["SPLIT_CHUNK"] == 16  # 4096 elements // D
    assert fused.constexprs["BLOCK_N"] == 64 and fused.constexprs["TILES_PER_SPLIT"] == 1  # one tile per split
    assert (fused.num_warps, fused.num_stages) == (8, 3)
    assert plan(1, fused_merge=True).buffer("tickets").fill == 0
    partial, merge = plan(1).launches  # the default: split-K, then the merge launch
    assert partial.kernel is attention.sparse_attention_partial_kernel and merge.kernel is attention.merge_splits_kernel
    assert partial.grid == (1, 33, 2) and merge.grid == (1, 24)
    assert partial.constexprs["BLOCK_N"] == 64 and partial.constexprs["TILES_PER_SPLIT"] == 1
    assert (partial.num_warps, partial.num_stages) == (8, 3)
    assert merge.constexprs["NUM_SPLITS"] == 33 and merge.constexprs["SPLIT_CHUNK"] == 16
    assert {k: fused.constexprs[k] for k in partial.constexprs} == partial.constexprs
    (fused,) = plan(1, fused_merge=True, fused_merge_heads=4).launches
    assert fused.grid == (1, 2, 33 + 3) and fused.constexprs["MERGE_HEADS"] == 4
    # 8 / 16 / 32 / 64 rows (16 / 32 / 64 / 128 programs): the table's rows (tiles, warps, stages,
    # and splits toward 512 programs, 264 at 16 and 32 rows; 65 tiles of 32 tokens: 22 splits of 3);
    # by a merge launch; with fused_merge=None merged in the launch up to fused_merge_max_programs = 16
    # programs, by a merge launch past it.
    for rows, splits, block_n, warps, stages in ((8, 22, 32, 4, 3), (16, 7, 64, 8, 3), (32, 4, 64, 8, 3),
                                                 (64, 4, 32, 2, 3)):
        launches = plan(rows).launches
        if rows == 8:
            (fused,) = plan(rows, fused_merge=None).launches
            assert fused.kernel is attention.sparse_attention_fused_merge_kernel
            assert fused.grid == (rows, 2, splits + 12)
            assert fused.constexprs["BLOCK_N"] == block_n and (fused.num_warps, fused.num_stages) == (warps, stages)
        else:
            assert len(plan(rows, fused_merge=None).launches) == 2
            (forced,) = plan(rows, fused_merge=True).launches
            assert forced.kernel is attention.sparse_attention_fused_merge_kernel
        partial, merge = launches
        assert partial.grid == (rows, splits, 2) and merge.kernel is attention.merge_splits_kernel
        assert partial.constexprs["BLOCK_N"] == block_n and (partial.num_warps, partial.num_stages) == (warps, stages)
    decode_256 = plan(256)
    assert [launch.grid for launch in decode_256.launches] == [(256, 1, 2)]  # no split, no merge
    assert decode_256.launches[0].kernel is attention.sparse_attention_partial_kernel
    assert decode_256.buffer("partial_out") is None
    decode_256 = decode_256.launches
    assert decode_256[0].constexprs["BLOCK_N"] == 32 and (decode_256[0].num_warps, decode_256[0].num_stages) == (2, 3)
    prefill = plan(2048)
    assert prefill.buffer("partial_out") is None
    assert prefill.launches[0].constexprs["BLOCK_N"] == 64 and (prefill.launches[0].num_warps, prefill.launches[0].num_stages) == (2, 2)
    assert plan(4, d=64, qh=8).launches[0].constexprs["BLOCK_N"] == 128
    assert plan(4, width=10).launches[0].constexprs["BLOCK_N"] == 16  # capped by the width


@pytest.mark.parametrize("series", sorted(tuning.NEWER_TRITON))
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_newer_triton_tables_keep_the_work_per_program(series, fp8):
    """A newer Triton's replaced rows (tuning.NEWER_TRITON: spill-free there) change only
    warps and stages: the tiles, splits and grids, hence the order of the online softmax and
    of the split merge, are the timed table's at every row count.  (Warps can still change
    the order within one tile's normaliser sum, a block reduction: docs/design.md.)"""
    timed = tuning.defaults(tuning.TIMED_TRITON).attention
    newer = tuning.defaults(series).attention
    for table in ("launch_table", "fp8_launch_table"):  # bound, tile bytes, target programs: the timed ones
        kept = [[row[:2] + row[4:] for row in getattr(value, table)] for value in (timed, newer)]
        assert kept[0] == kept[1], table
    for rows in (1, 2, 8, 9, 32, 33, 64, 66, 256, 2047, 2048, 4096):
        a, b = (_production_plan(rows, series=s, fp8=fp8) for s in (tuning.TIMED_TRITON, series))
        assert [(la.kernel, la.grid, la.constexprs) for la in a.launches] == \
            [(lb.kernel, lb.grid, lb.constexprs) for lb in b.launches]
        assert [buffer.info for buffer in a.buffers] == [buffer.info for buffer in b.buffers]


def test_defaults_follow_the_triton_series():
    """The defaults are this Triton series' (tuning.TRITON_SERIES); 3.6 and 3.7 take the timed tables."""
    assert tuning.defaults() == tuning.DEFAULT == tuning.Tuning()
    assert tuning.defaults("3.7") == tuning.defaults("3.6")
    assert tuning.defaults("3.9").attention.launch_table[5] == (None, 32 * 1024, 4, 2, 264)
    assert tuning.defaults("3.6").attention.launch_table[5] == (None, 32 * 1024, 2, 2, 264)
    with pytest.raises(ValueError, match="does not replace a row of the timed table with the same bound"):
        tuning.NEWER_TRITON["3.10"] = {"AttentionTuning.launch_table": {5: (4096, 32 * 1024, 4, 2, 264)}}
        try:
            tuning.defaults("3.10")
        finally:
            del tuning.NEWER_TRITON["3.10"]


ADDRESSING_CASES = {
    "bf16_2splits": Case(splits=2),
    "fp16_views_int64_unsplit": Case(dtype=torch.float16, views=True, index_dtype=torch.int64, splits=1, P=16),
}


@pytest.mark.parametrize("name", list(ADDRESSING_CASES))
def test_row_addressing_modes_give_the_same_output(name):
    """AttentionTuning.row_addressing: by slot or by page, the same rows are gathered."""
    c = ADDRESSING_CASES[name]
    args = make_inputs(c)
    outs = {}
    for mode in tuning.ROW_ADDRESSING_MODES:
        program = plan_with(args, tuning.AttentionTuning(num_splits=c.splits, row_addressing=mode))
        assert program.launches[0].constexprs["SLOT_ROWS"] == (mode == "slot")
        (outs[mode],) = qsa_torch.run_program(program, args)
    assert np.abs(f64(outs["page"])).sum() > 0, "the case attends nothing: it tests nothing"
    assert_bitwise_equal(outs["slot"], outs["page"], "slot vs page addressing")


def test_slot_addressing_only_where_pages_are_runs_of_rows():
    """A cache whose pages are not runs of rows (a view of half of each page), or one of 2**31
    rows or more, is addressed by page."""
    a = ArrayInfo.contiguous
    slot = tuning.AttentionTuning(row_addressing="slot")

    def slot_rows(cache):
        return attention.plan_sparse_paged_attention(
            a((4, 8, 64), "bfloat16"), cache, cache, a((4, 24), "int32"), a((2, 8), "int32"), a((4,), "int32"),
            tuning=slot).launches[0].constexprs["SLOT_ROWS"]

    assert slot_rows(a((16, 32, 2, 64), "bfloat16"))
    half_pages = ArrayInfo((16, 32, 2, 64), "bfloat16", (64 * 2 * 64, 2 * 64, 64, 1))
    assert not slot_rows(half_pages)
    assert not slot_rows(a((2 ** 25, 64, 2, 64), "bfloat16"))


# --------------------------------------------------------------------------
# Split-K merged by the merge launch, in chunks of splits
# --------------------------------------------------------------------------

#: 5 tiles of 16 tokens per row (MERGE_TILE_BYTES at D = 64): 2 or 5 splits.
MERGE_CASE = Case(R=5, QH=8, KH=2, D=64, W=80, seed=3)
MERGE_TILE_BYTES = 16 * 2 * 64


def merge_inputs():
    """make_inputs' rows (1-3 select nothing valid), with row 0's tokens in its first 2 tiles
    only (later splits hold no valid token) and row 4's in its last tile only."""
    args = make_inputs(MERGE_CASE)
    indices = args["token_indices"]
    indices[0, 32:] = -1
    indices[4, 64:] = indices[4, :16].clone()
    indices[4, :64] = -1
    ref = reference_for(args)
    assert np.abs(ref[[0, 4]]).min(axis=(1, 2)).all() and not ref[1:4].any(), "rows 0 and 4 must attend something"
    return args, ref


@pytest.mark.parametrize("splits", [2, 5])
def test_merge_chunks_give_the_same_bits(splits):
    """The merge launch folds the splits in order 0..S-1 whatever its chunk of splits (2 per
    step: 5 splits end with a tail): the same bits, run to run, near the float64 reference,
    with splits that hold no valid token and rows that hold none."""
    args, ref = merge_inputs()
    outputs = {}
    for small_chunks in (False, True):
        tuned = tuning.AttentionTuning(num_splits=splits, tile_bytes=MERGE_TILE_BYTES, fused_merge=False,
                                       **(dict(merge_chunk_elements=2 * 64) if small_chunks else {}))
        program = plan_with(args, tuned)
        assert len(program.launches) == 2 and program.launches[0].grid[1] == splits
        chunk = program.launches[-1].constexprs["SPLIT_CHUNK"]
        assert chunk == (min(2, splits) if small_chunks else splits), chunk
        with tuning.override(attention=tuned):
            first = qsa_torch.sparse_paged_attention(**args)
            if not small_chunks:
                assert_bitwise_equal(qsa_torch.sparse_paged_attention(**args), first, "run to run")
        what = f"{splits} splits, chunk {chunk}"
        assert_close(first, ref, tolerance(MERGE_CASE.dtype), f"{what} vs reference")
        assert not f64(first)[1:4].any(), f"{what}: rows without a valid token must be zeros"
        outputs[small_chunks] = first
    assert_bitwise_equal(outputs[True], outputs[False], "chunks of 2 splits vs all splits at once")
    if splits == 5:
        with tuning.override(attention=tuning.AttentionTuning(num_splits=splits, tile_bytes=MERGE_TILE_BYTES,
                                                              fused_merge=False)):
            assert_bitwise_equal(run_jax(args), outputs[False], "JAX vs torch")


# --------------------------------------------------------------------------
# Split-K merged in its launch (AttentionTuning.fused_merge: merging programs by ticket)
# --------------------------------------------------------------------------

#: 19 tiles of 16 tokens per row (MERGE_TILE_BYTES at D = 64): up to 19 splits.
MANY_SPLITS_CASE = Case(R=3, QH=4, KH=1, D=64, W=300, seed=5)


def fused_and_merge_launch(args, arrays=ARGUMENTS, **fields):
    """``{fused: (out, program)}``: the call planned with the split-K merged in its launch and
    with the merge launch, ``fields`` of AttentionTuning otherwise the same."""
    results = {}
    for fused in (True, False):
        program = plan_with(args, tuning.AttentionTuning(fused_merge=fused, **fields))
        kernels = [launch.kernel for launch in program.launches]
        assert kernels == ([attention.sparse_attention_fused_merge_kernel] if fused else
                           [attention.sparse_attention_partial_kernel, attention.merge_splits_kernel]), kernels
        (out,) = qsa_torch.run_program(program, {n: args[n] for n in arrays})
        results[fused] = out, program
    return results


@pytest.mark.parametrize("splits, heads, chunk", [(2, 1, None), (5, 1, 2), (5, 4, None), (5, 2, 2)])
def test_fused_merge_equals_the_merge_launch(splits, heads, chunk):
    """The splits merged in their launch, by merging programs of ``heads`` query heads each
    (group 4): the merge launch's bits (outputs poisoned), near the float64 reference, with
    splits that hold no valid token and rows that hold none; torch = JAX."""
    args, ref = merge_inputs()
    fields = dict(num_splits=splits, tile_bytes=MERGE_TILE_BYTES, fused_merge_heads=heads,
                  **(dict(merge_chunk_elements=chunk * 64) if chunk else {}))
    results = fused_and_merge_launch(args, **fields)
    (out, program), (expected, _) = results[True], results[False]
    launch = program.launches[0]
    assert launch.grid == (MERGE_CASE.R, MERGE_CASE.KH, splits + 4 // heads), launch.grid
    assert launch.constexprs["SPLIT_CHUNK"] == (chunk or splits)
    assert_bitwise_equal(out, expected, f"{splits} splits merged in the launch vs the merge launch")
    assert_close(out, ref, tolerance(MERGE_CASE.dtype), "fused merge vs reference")
    assert not f64(out)[1:4].any(), "rows without a valid token must be zeros"
    with tuning.override(attention=tuning.AttentionTuning(fused_merge=True, **fields)):
        assert_bitwise_equal(run_jax(args), out, "JAX vs torch")


def test_fused_merge_many_splits():
    """19 splits, merged 8 at a time (two chunks and a tail of 3), group of 4 merged one head a
    program: the merge launch's bits, near the reference."""
    args = make_inputs(MANY_SPLITS_CASE)
    ref = reference_for(args)
    results = fused_and_merge_launch(args, tile_bytes=MERGE_TILE_BYTES, num_splits=64,
                                     merge_chunk_elements=8 * 64)
    (out, program), (expected, _) = results[True], results[False]
    assert program.launches[0].grid == (3, 1, 19 + 4) and program.launches[0].constexprs["CHUNKED_SPLITS"] == 16
    assert_bitwise_equal(out, expected, "19 splits merged in the launch vs the merge launch")
    assert_close(out, ref, tolerance(MANY_SPLITS_CASE.dtype), "fused merge vs reference")
    assert np.abs(ref).sum() > 0


def test_fused_merge_leaves_its_tickets_at_zero_for_the_next_call():
    """The counters the merging programs wait on: the same tensor through two calls in a row (the
    program's tickets buffer made an argument) is zero after each, and both calls give the bits."""
    args, _ = merge_inputs()
    program = plan_with(args, tuning.AttentionTuning(num_splits=5, tile_bytes=MERGE_TILE_BYTES, fused_merge=True))
    tickets = program.buffer("tickets")
    assert tickets.fill == 0 and tickets.name in program.filled_buffers
    # The tickets as an argument the caller holds (updated in place, not a fresh buffer each call).
    held = dataclasses.replace(program, buffers=tuple(b for b in program.buffers if b.name != "tickets"))
    counters = torch.zeros(tickets.shape, dtype=torch.int32, device=DEVICE)
    arrays = dict({n: args[n] for n in ARGUMENTS}, tickets=counters)
    outputs = []
    for call in range(2):
        (out,) = qsa_torch.run_program(held, arrays)
        assert not host(counters).any(), f"call {call}: tickets left at {host(counters).tolist()}"
        outputs.append(out)
    assert_bitwise_equal(outputs[1], outputs[0], "second call vs first")
    (fresh,) = qsa_torch.run_program(program, {n: args[n] for n in ARGUMENTS})
    assert_bitwise_equal(outputs[0], fresh, "held tickets vs the program's own")


# --------------------------------------------------------------------------
# Log-sum-exp out, attention sinks, very negative scores, head dims that are
# not powers of two (issue 50; issue 52 item 4).
# --------------------------------------------------------------------------

#: The three ways a row's splits reach out / lse: one split, the merge launch, merged in the launch
#: (tiles of 16 tokens: tile_bytes 2 KB at D <= 64, and BLOCK_N's floor of 16 above).
PATHS = {"unsplit": dict(num_splits=1), "merge_launch": dict(num_splits=2, fused_merge=False),
         "fused_merge": dict(num_splits=3, fused_merge=True)}
PATHS = {path: dict(fields, tile_bytes=16 * 2 * 64) for path, fields in PATHS.items()}


def lse_reference(args, scale=None, sinks=None):
    return R.sparse_paged_attention_lse(
        f64(args["q"]), f64(args["k_cache"]), f64(args["v_cache"]), host(args["token_indices"]),
        host(args["block_table"]), host(args["token_to_req"]), softmax_scale=scale,
        sinks=None if sinks is None else host(sinks))


def assert_lse_close(lse, ref, tol=1e-4, what=""):
    """-inf and NaN exactly where the reference has them; elsewhere |lse - ref| <= tol (1 + |ref|)."""
    lse = f64(lse)
    assert lse.dtype == np.float64 and lse.shape == ref.shape, (lse.shape, ref.shape)
    for special, name in ((np.isneginf, "-inf"), (np.isnan, "NaN")):
        assert np.array_equal(special(lse), special(ref)), f"{what}: {name} at {np.argwhere(special(lse) != special(ref))}"
    finite = np.isfinite(ref)
    error = np.abs(lse[finite] - ref[finite]) / (1 + np.abs(ref[finite]))
    assert error.max(initial=0) <= tol, f"{what}: lse error {error.max():.2e}"


def run_jax_with(args, **options):
    """The call under jax.jit (array options such as ``sinks`` converted; None stays None)."""
    arrays = {n: to_jax(a) for n, a in args.items()}
    arrays.update({n: to_jax(a) for n, a in options.items() if isinstance(a, torch.Tensor)})
    options = {n: a for n, a in options.items() if not isinstance(a, torch.Tensor)}
    return jax.jit(lambda arrays: qsa_jax.sparse_paged_attention(**arrays, **options))(arrays)


def attention_paths(args, **options):
    """``{path: result}`` of the call under each of PATHS (the planned launches checked), JAX =
    torch bitwise on each."""
    results = {}
    for path, fields in PATHS.items():
        with tuning.override(attention=tuning.AttentionTuning(**fields)):
            program = qsa_torch.sparse_paged_attention.plan(**args, **options)
            kernels = [launch.kernel for launch in program.launches]
            assert kernels == {"unsplit": [attention.sparse_attention_partial_kernel],
                               "merge_launch": [attention.sparse_attention_partial_kernel,
                                                attention.merge_splits_kernel],
                               "fused_merge": [attention.sparse_attention_fused_merge_kernel]}[path], (path, kernels)
            result = qsa_torch.sparse_paged_attention(**args, **options)
            jax_result = run_jax_with(args, **options)
        for got, expected in zip(jax_result if isinstance(result, tuple) else (jax_result,),
                                 result if isinstance(result, tuple) else (result,)):
            assert_bitwise_equal(got, expected, f"{path}: JAX vs torch")
        results[path] = result
    return results


def sinks_for(qh, seed=7):
    """Random sinks around the scores' scale (never zero)."""
    return torch.from_numpy(np.random.default_rng(seed).normal(1.0, 1.5, qh).astype(np.float32)).to(DEVICE)


#: Rows 1-3 select nothing valid; 3 tiles of 16 tokens a row.
LSE_CASE = Case(R=5, QH=8, KH=2, D=64, W=48, seed=11)


@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
def test_lse_and_sinks_on_every_path(with_sinks):
    """``return_lse``: lse = log of the softmax's denominator (+ exp(sink)), -inf for rows with no
    valid token and no sink (the sink with one; out 0 either way), on the unsplit path, the merge
    launch and the merge in the launch; ``out`` the same bits with and without ``return_lse``;
    near the float64 reference; JAX = torch bitwise."""
    args = make_inputs(LSE_CASE)
    sinks = sinks_for(LSE_CASE.QH) if with_sinks else None
    ref_out, ref_lse = lse_reference(args, sinks=sinks)
    assert np.isneginf(ref_lse[1:4]).all() != with_sinks and np.isfinite(ref_lse[[0, 4]]).all()
    with_lse = attention_paths(args, sinks=sinks, return_lse=True)
    for path, (out, lse) in with_lse.items():
        assert lse.dtype == torch.float32 and lse.shape == (LSE_CASE.R, LSE_CASE.QH)
        assert_close(out, ref_out, tolerance(LSE_CASE.dtype), f"{path}: out vs reference")
        assert_lse_close(lse, ref_lse, what=f"{path}: lse vs reference")
        assert not f64(out)[1:4].any(), f"{path}: rows without a valid token are zeros"
        if with_sinks:
            assert_lse_close(lse[1:4], np.broadcast_to(f64(sinks), (3, LSE_CASE.QH)), 1e-6, f"{path}: lse = sink")
        with tuning.override(attention=tuning.AttentionTuning(**PATHS[path])):
            plain = qsa_torch.sparse_paged_attention(**args, sinks=sinks)
        assert_bitwise_equal(plain, out, f"{path}: out with and without return_lse")


def test_sinks_change_the_softmax_as_a_float64_softmax_does():
    """A sink far above the scores takes nearly all the mass (out -> 0); one far below none (out ->
    the sink-free attention); each against the reference."""
    args = make_inputs(Case(R=2, QH=4, KH=1, D=64, W=20, requests=1, seed=4))
    plain = f64(qsa_torch.sparse_paged_attention(**args))
    for level in (-30.0, 0.5, 30.0):
        sinks = sinks_for(4) * 0.1 + level
        out, lse = qsa_torch.sparse_paged_attention(**args, sinks=sinks, return_lse=True)
        ref_out, ref_lse = lse_reference(args, sinks=sinks)
        assert_close(out, ref_out, tolerance(torch.bfloat16), f"sink {level}: out")
        assert_lse_close(lse, ref_lse, what=f"sink {level}: lse")
        if level < 0:
            assert_close(out, plain, tolerance(torch.bfloat16), "a very low sink changes nothing")
        if level > 20:
            assert np.abs(f64(out)).max() < 1e-6


def test_scores_all_minus_inf():
    """Valid tokens whose scores are all -inf: without a sink NaN heads and lse -inf (as today);
    with a finite sink out 0 and lse = the sink; rows without a valid token 0 either way; on
    every path, JAX = torch."""
    args = make_inputs(LSE_CASE)
    args["k_cache"][..., 0] = -float("inf")  # q[..., 0] > 0: every score -inf
    args["q"][..., 0] = args["q"][..., 0].abs() + 0.25
    sinks = sinks_for(LSE_CASE.QH)
    for options in (dict(), dict(sinks=sinks)):
        ref_out, ref_lse = lse_reference(args, **options)
        for path, (out, lse) in attention_paths(args, return_lse=True, **options).items():
            what = f"{path}, {'sinks' if options else 'no sink'}"
            assert_close(out, ref_out, 0, what)
            assert_lse_close(lse, ref_lse, 1e-6, what)
            assert np.isnan(f64(out)[[0, 4]]).all() != bool(options), what
            assert not f64(out)[1:4].any()


@pytest.mark.parametrize("path", list(PATHS))
def test_very_negative_finite_scores_are_finite(path):
    """Every valid score far below -1e20 (softmax_scale 1e20, q.k < 0): finite rows, the float64
    softmax's, and a finite lse (the old -1e20 starting max made them 0 / 0 = NaN)."""
    args = make_inputs(Case(R=4, QH=4, KH=2, D=64, W=24, seed=2))
    args["q"] = args["q"].abs() + 0.5
    args["k_cache"] = -(args["k_cache"].abs() + 0.5)
    scale = 1e20
    ref_out, ref_lse = lse_reference(args, scale)
    assert (ref_lse[np.isfinite(ref_lse)] < -1e21).all()
    with tuning.override(attention=tuning.AttentionTuning(**PATHS[path])):
        out, lse = qsa_torch.sparse_paged_attention(**args, softmax_scale=scale, return_lse=True)
        plain = qsa_torch.sparse_paged_attention(**args, softmax_scale=scale)
        jax_out, jax_lse = run_jax_with(args, softmax_scale=scale, return_lse=True)
    assert np.isfinite(f64(out)).all() and np.isfinite(f64(plain)).all()
    assert_close(out, ref_out, tolerance(torch.bfloat16), "out vs reference")
    assert_bitwise_equal(plain, out, "with and without return_lse")
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(f64(lse)), finite)
    assert np.abs(f64(lse)[finite] / ref_lse[finite] - 1).max() < 1e-6
    assert_bitwise_equal(jax_out, out, "JAX vs torch: out")
    assert_bitwise_equal(jax_lse, lse, "JAX vs torch: lse")


#: Head dims that are multiples of 16 but not powers of two (the tile padded to 128 / 128 / 256).
HEAD_DIM_CASES = {
    "d80_g4_table": Case(QH=8, KH=2, D=80, W=70),
    "d96_g1_fp16_2splits_views": Case(QH=2, KH=2, D=96, W=90, dtype=torch.float16, splits=2, views=True),
    "d192_g12_unsplit": Case(QH=12, KH=1, D=192, W=40, splits=1),
    "d80_g4_3splits_int64": Case(R=3, QH=4, KH=1, D=80, W=300, splits=3, index_dtype=torch.int64),
}


@pytest.mark.parametrize("name", list(HEAD_DIM_CASES))
def test_head_dims_that_are_not_powers_of_two(name, force_splits):
    """Any multiple of 16 up to 256: padded lanes, the float64 reference, JAX = torch bitwise."""
    c = HEAD_DIM_CASES[name]
    program = qsa_torch.sparse_paged_attention.plan(**make_inputs(c))
    assert program.launches[0].constexprs["BLOCK_D"] == {80: 128, 96: 128, 192: 256}[c.D]
    check_case(c, force_splits)


@pytest.mark.parametrize("d", [80, 192])
def test_head_dims_with_lse_and_sinks_on_every_path(d):
    args = make_inputs(Case(R=5, QH=4, KH=2, D=d, W=40, seed=d))
    sinks = sinks_for(4)
    ref_out, ref_lse = lse_reference(args, sinks=sinks)
    for path, (out, lse) in attention_paths(args, sinks=sinks, return_lse=True).items():
        assert_close(out, ref_out, tolerance(torch.bfloat16), f"d{d} {path}: out")
        assert_lse_close(lse, ref_lse, what=f"d{d} {path}: lse")


def test_power_of_two_head_dims_plan_as_before():
    """BLOCK_D == D at powers of two (the kernels' padding code is not emitted there), and the
    default options add no constexpr that changes the code (no sinks, no lse)."""
    for d in (16, 32, 64, 128, 256):
        program = qsa_torch.sparse_paged_attention.plan(**make_inputs(Case(R=2, D=d, W=8)))
        constexprs = program.launches[0].constexprs
        assert constexprs["BLOCK_D"] == d and not constexprs["SINKS"] and not constexprs["NATURAL_LSE"]


def test_bad_sinks_and_head_dims():
    args = make_inputs(Case(R=2, QH=8, W=8))
    with pytest.raises(ValueError, match=r"sparse_paged_attention: sinks must have QH = 8 entries"):
        qsa_torch.sparse_paged_attention(**args, sinks=torch.zeros(4, device=DEVICE))
    with pytest.raises(ValueError, match=r"sparse_paged_attention: sinks"):
        qsa_torch.sparse_paged_attention(**args, sinks=torch.zeros(8, device=DEVICE, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"sparse_paged_attention: sinks"):
        qsa_torch.sparse_paged_attention(**args, sinks=torch.zeros(1, 8, device=DEVICE))
    with pytest.raises(ValueError, match=r"sparse_paged_attention: return_lse"):
        qsa_torch.sparse_paged_attention(**args, return_lse=1)
    a = ArrayInfo.contiguous
    for d in (8, 72, 272):
        with pytest.raises(ValueError, match=r"sparse_paged_attention: q must have head dim D a multiple of 16 "
                                             r"from 16 to 256"):
            attention.plan_sparse_paged_attention(
                a((2, 8, d), "bfloat16"), a((4, 8, 2, d), "bfloat16"), a((4, 8, 2, d), "bfloat16"),
                a((2, 8), "int32"), a((1, 4), "int32"), a((2,), "int32"))


# --------------------------------------------------------------------------
# GPU-only: production geometry, large caches.
# --------------------------------------------------------------------------

@pytest.mark.gpu
def test_production_decode_shape():
    c = Case(R=64, QH=24, KH=2, D=256, P=64, W=2051, requests=64, pages_per_request=40)
    args = make_inputs(c)
    ref = reference_for(args)
    for splits in (None, 1):
        (out,) = qsa_torch.run_program(plan_with(args, with_splits(splits)), args)
        assert_close(out, ref, tolerance(c.dtype), f"splits={splits}")
    assert_bitwise_equal(run_jax(args), qsa_torch.sparse_paged_attention(**args), "torch vs JAX")


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
@pytest.mark.parametrize("rows", [1, 8])
def test_production_fused_merge(rows, cache):
    """Production decode (24 Q / 2 KV heads x d256, pages of 64, 128K-token requests, top 512
    blocks + tail = 2051 selected tokens) at 1 and 8 rows, where the plan merges the splits in
    their launch (33 and 22 splits, 12 merging programs per KV head): 20 repeats bitwise, the
    merge launch's bits, near the float64 reference, torch = JAX."""
    c = Case(R=rows, QH=24, KH=2, D=256, P=64, W=2051, requests=min(rows, 2), pages_per_request=2048)
    args = make_inputs(c)
    arrays, scales = {n: args[n] for n in ARGUMENTS}, {}
    k_ref, v_ref = f64(args["k_cache"]), f64(args["v_cache"])
    if cache == "fp8":
        k8, v8 = (args[n].to(torch.float8_e4m3fn) for n in ("k_cache", "v_cache"))
        scales = dict(k_scale=torch.tensor(1.0, device=DEVICE), v_scale=torch.tensor([1.0], device=DEVICE))
        arrays.update(k_cache=k8, v_cache=v8, **scales)
        k_ref, v_ref = f64(k8), f64(v8)
    ref = R.sparse_paged_attention(f64(args["q"]), k_ref, v_ref, host(args["token_indices"]),
                                   host(args["block_table"]), host(args["token_to_req"]))
    programs = {}
    for fused_merge in (None, False):
        with tuning.override(attention=tuning.AttentionTuning(fused_merge=fused_merge)):
            programs[fused_merge] = qsa_torch.sparse_paged_attention.plan(**arrays)
    (fused,) = programs[None].launches
    assert fused.kernel is attention.sparse_attention_fused_merge_kernel
    (first,) = qsa_torch.run_program(programs[None], arrays)
    for repeat in range(20):
        (again,) = qsa_torch.run_program(programs[None], arrays)
        assert_bitwise_equal(again, first, f"repeat {repeat}")
    (merge_launch,) = qsa_torch.run_program(programs[False], arrays)
    assert_bitwise_equal(first, merge_launch, "merged in the launch vs the merge launch")
    assert_close(first, ref, tolerance(c.dtype), "fused merge vs reference")
    call = jax.jit(lambda a: qsa_jax.sparse_paged_attention(**a))
    assert_bitwise_equal(call({n: to_jax(x) for n, x in arrays.items()}), first, "torch vs JAX")


@pytest.mark.gpu
@pytest.mark.parametrize("addressing", tuning.ROW_ADDRESSING_MODES)
def test_page_offsets_past_int32(addressing):
    """page * block stride exceeds 2**31 elements: offsets must be int64 (by page, or by slot)."""
    d, kh, page = 256, 2, 64
    blocks = 2 ** 31 // (page * kh * d) + 8
    k_cache = torch.empty(blocks, page, kh, d, device=DEVICE, dtype=torch.bfloat16)
    v_cache = torch.empty_like(k_cache)
    pages = torch.tensor([3, blocks - 1, blocks - 5], device=DEVICE)
    k_cache[pages] = torch.randn(3, page, kh, d, device=DEVICE, dtype=torch.bfloat16)
    v_cache[pages] = torch.randn(3, page, kh, d, device=DEVICE, dtype=torch.bfloat16)
    q = torch.randn(2, 24, d, device=DEVICE, dtype=torch.bfloat16)
    block_table = pages.to(torch.int32)[None]
    indices = torch.randint(0, 3 * page, (2, 100), device=DEVICE, dtype=torch.int32)
    token_to_req = torch.zeros(2, device=DEVICE, dtype=torch.int32)
    with tuning.override(attention=tuning.AttentionTuning(row_addressing=addressing)):
        out = qsa_torch.sparse_paged_attention(q, k_cache, v_cache, indices, block_table, token_to_req)
    # The reference sees only the three pages used.
    ref = R.sparse_paged_attention(f64(q), f64(k_cache[pages]), f64(v_cache[pages]), host(indices),
                                   np.arange(3)[None], host(token_to_req))
    assert_close(out, ref, tolerance(torch.bfloat16), "large cache")


# --------------------------------------------------------------------------
# Wrong array types (every bad-argument case is a row of tests/test_bad_arguments.py).
# --------------------------------------------------------------------------

def test_wrong_array_type():
    args = make_inputs(Case(W=8))
    with pytest.raises(TypeError, match="sparse_paged_attention: block_table must be a torch.Tensor"):
        qsa_torch.sparse_paged_attention(**{**args, "block_table": host(args["block_table"])})
    jax_args = {n: to_jax(a) for n, a in args.items()}
    with pytest.raises(TypeError, match="sparse_paged_attention: q must be a JAX array"):
        qsa_jax.sparse_paged_attention(**{**jax_args, "q": args["q"]})


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_very_negative_finite_scores_at_production_shapes(cache):
    """Issue 52, item 4, on the GPU: 64 decode rows, 24 Q / 2 KV heads x d256, 2051 selected tokens a
    row, every valid score below -1e20 (bf16: softmax_scale 1e20; fp8: a k_scale of 2**70 folded into
    the scores): finite rows within their values, the float64 lse, JAX = torch bitwise."""
    args = make_inputs(Case(R=64, QH=24, KH=2, D=256, P=64, W=2051, requests=64, pages_per_request=40, seed=7))
    args["q"] = args["q"].abs() + 0.5
    args["k_cache"] = -(args["k_cache"].abs() + 0.5)
    options, reference_args, scale = {}, dict(args), 1e20
    if cache == "fp8":
        fp8 = torch.float8_e4m3fn
        k_scale, v_scale = torch.full((), 2.0 ** 70, device=DEVICE), torch.full((), 0.5, device=DEVICE)
        k8, v8 = args["k_cache"].to(fp8), (args["v_cache"].float() / 0.5).to(fp8)
        args.update(k_cache=k8, v_cache=v8)
        options = dict(k_scale=k_scale, v_scale=v_scale)
        reference_args.update(k_cache=k8.to(torch.float64) * 2.0 ** 70, v_cache=v8.to(torch.float64) * 0.5)
        scale = 1.0
    _, ref_lse = lse_reference(reference_args, scale)
    finite = np.isfinite(ref_lse)
    assert finite.any() and (ref_lse[finite] < -1e20).all()
    out, lse = qsa_torch.sparse_paged_attention(**args, softmax_scale=scale, return_lse=True, **options)
    # At scores of -1e21 the weights hang on float32's last bits of q.k (a 1e-7 relative difference
    # is a factor e**-1e14), so out is compared by what every such softmax satisfies: finite, and a
    # convex combination of the row's values (|out| <= the largest |v|); the lse to float32's precision.
    out64 = f64(out)
    assert np.isfinite(out64).all(), "a row with finite valid scores came out NaN"
    largest = np.abs(f64(reference_args["v_cache"])).max()
    assert (np.abs(out64) <= largest * (1 + 1e-2)).all(), f"{cache}: out outside its values' hull"
    assert np.array_equal(np.isfinite(f64(lse)), finite)
    assert np.abs(f64(lse)[finite] / ref_lse[finite] - 1).max() < 1e-5
    jax_out, jax_lse = run_jax_with(args, softmax_scale=scale, return_lse=True, **options)
    assert_bitwise_equal(jax_out, out, "JAX vs torch: out")
    assert_bitwise_equal(jax_lse, lse, "JAX vs torch: lse")
