"""Stage 3: mqa_paged_scores, topk_blocks, expand_block_indices, select_paged_tokens.

Each function is compared with the float64 reference (top-k and expansion
exactly), and the JAX adapter under ``jax.jit`` with torch bitwise.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

import qsa_jax
import qsa_kernels.score as score_plans
import qsa_torch
from qsa_kernels import tuning
from qsa_kernels.launch import kernel_name

from . import reference
from .util import DEVICE, assert_bitwise_equal, f64, host, to_jax, tolerance

LENGTHS = (150, 61, 97)  # tokens per request: not multiples of ratio * page


def scoring_case(seed, *, heads=4, dim=64, page=16, dtype=torch.bfloat16, prefill=False,
                 integer=False):
    """Shuffled pages with a missing and an out-of-range page; rows of every kind.

    Rows: the last token of each request, an early (causal) position, a
    negative position, no request (-1) and an out-of-range request.  Decode:
    the page table has idle requests too (B >= R, one-row score tiles); with
    ``prefill``, 20 consecutive rows of request 0 come first (B < R: row
    tiles of one request and tiles mixing requests both occur).
    """
    g = torch.Generator().manual_seed(seed)
    requests = len(LENGTHS) + (0 if prefill else 5)
    width = 4
    pages = len(LENGTHS) * width + 2
    page_table = torch.full((requests, width), -1, dtype=torch.int32)
    page_table[:len(LENGTHS)] = torch.randperm(pages, generator=g)[:len(LENGTHS) * width].reshape(-1, width)
    page_table[2, 1] = -1
    page_table[0, 1] = pages + 5
    lengths = list(LENGTHS) + [0] * (requests - len(LENGTHS))
    requests_of_rows = [0, 1, 2, 1, 2, -1, requests]
    positions = [LENGTHS[0] - 1, LENGTHS[1] - 1, LENGTHS[2] - 1, 9, -9, 40, 40]
    if prefill:
        requests_of_rows = [0] * 20 + requests_of_rows
        positions = list(range(120, 140)) + positions
    rows = len(positions)
    if integer:  # small integers: exact scores, many ties and relu zeros
        q = torch.randint(-2, 3, (rows, heads, dim), generator=g).float()
        k_cache = torch.randint(-2, 3, (pages, page, 1, dim), generator=g).float()
    else:
        q = torch.randn(rows, heads, dim, generator=g)
        k_cache = torch.randn(pages, page, 1, dim, generator=g)
    return dict(
        q=q.to(dtype).to(DEVICE),
        k_cache=k_cache.to(dtype).to(DEVICE),
        page_table=page_table.to(DEVICE),
        token_to_req=torch.tensor(requests_of_rows, dtype=torch.int32, device=DEVICE),
        query_positions=torch.tensor(positions, dtype=torch.int64, device=DEVICE),
        sequence_lengths=torch.tensor(lengths, dtype=torch.int32, device=DEVICE),
    )


def numpy_args(case):
    return {name: f64(value) if value.is_floating_point() else host(value) for name, value in case.items()}


def jax_args(case):
    return {name: to_jax(value) for name, value in case.items()}


def assert_scores_close(logits, expected, tol, what):
    logits = f64(logits)
    assert logits.shape == expected.shape, what
    assert np.array_equal(np.isneginf(logits), np.isneginf(expected)), f"{what}: -inf columns differ"
    finite = np.isfinite(expected)
    error = np.linalg.norm(logits[finite] - expected[finite]) / max(np.linalg.norm(expected[finite]), 1e-30)
    assert error <= tol, f"{what}: relative error {error:.2e} > {tol:.0e}"


# --------------------------------------------------------------------------
# mqa_paged_scores
# --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, heads, dim, ratio, prefill", [
    (torch.bfloat16, 4, 64, 4, False),
    (torch.bfloat16, 1, 128, 8, True),
    (torch.float32, 4, 128, 4, True),
    (torch.float16, 1, 64, 8, False),
])
def test_scores_match_reference(dtype, heads, dim, ratio, prefill):
    case = scoring_case(1, heads=heads, dim=dim, dtype=dtype, prefill=prefill)
    logits, visible = qsa_torch.mqa_paged_scores(**case, compress_ratio=ratio)
    expected, expected_visible = reference.mqa_paged_scores(**numpy_args(case), compress_ratio=ratio)
    assert logits.dtype == torch.float32 and visible.dtype == torch.int32
    assert np.array_equal(host(visible), expected_visible)
    assert_scores_close(logits, expected, tolerance(dtype), "logits")
    scores = jax.jit(qsa_jax.mqa_paged_scores, static_argnums=6)
    jax_logits, jax_visible = scores(*jax_args(case).values(), ratio)
    assert_bitwise_equal(logits, jax_logits, "logits torch vs jax")
    assert_bitwise_equal(visible, jax_visible, "visible torch vs jax")


def test_scores_options():
    """num_columns below and above the page-table capacity, a custom divisor, mixed dtypes."""
    case = scoring_case(2, prefill=True)
    case["q"] = case["q"].float()  # fp32 queries over a bf16 cache
    for columns, divisor in ((37, 2.5), (80, None)):
        logits, visible = qsa_torch.mqa_paged_scores(**case, compress_ratio=4, num_columns=columns,
                                                     score_divisor=divisor)
        expected, expected_visible = reference.mqa_paged_scores(**numpy_args(case), compress_ratio=4,
                                                                num_columns=columns, score_divisor=divisor)
        assert np.array_equal(host(visible), expected_visible)
        assert_scores_close(logits, expected, 1e-5, f"logits, {columns} columns")
        jax_logits, _ = jax.jit(qsa_jax.mqa_paged_scores, static_argnums=(6, 7, 8))(
            *jax_args(case).values(), 4, columns, divisor)
        assert_bitwise_equal(logits, jax_logits, "logits torch vs jax")


# --------------------------------------------------------------------------
# topk_blocks
# --------------------------------------------------------------------------

def topk_logits(seed, rows, columns, special=False):
    """Scores with many exact ties (relu zeros, a clipped top) and, with
    ``special``, -0.0, -inf and NaN."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, columns, generator=g).clamp(min=0.0, max=1.2)
    if special:
        kind = torch.randint(0, 6, (rows, columns), generator=g)
        logits[kind == 0] = -0.0
        logits[kind == 1] = float("-inf")
        logits[kind == 2] = float("nan")
        logits[kind == 3] = -logits[kind == 3]
    return logits


def check_topk(logits, visible, k):
    logits, visible = logits.to(DEVICE), visible.to(DEVICE)
    out = qsa_torch.topk_blocks(logits, visible, k)
    assert out.dtype == torch.int32 and tuple(out.shape) == (logits.shape[0], k)
    expected = reference.topk_blocks(f64(logits), host(visible), k)
    assert np.array_equal(host(out), expected), f"top-{k}: {host(out)} vs {expected}"
    # A fresh function: JAX plans when it traces, so a tuning override (tests
    # shrink tiles) reaches it only through a new trace.
    jax_out = jax.jit(lambda x, v: qsa_jax.topk_blocks(x, v, k))(to_jax(logits), to_jax(visible))
    assert_bitwise_equal(out, jax_out, "top-k torch vs jax")


@pytest.mark.parametrize("columns, k, special", [(50, 7, True), (300, 20, False), (40, 64, True)])
def test_topk_matches_reference(columns, k, special):
    """visible_blocks below k, zero, negative, within and beyond the width; k > C."""
    logits = topk_logits(3, 5, columns, special)
    visible = torch.tensor([columns, k - 1, 0, -4, columns + 9], dtype=torch.int32)
    check_topk(logits, visible, k)


def test_topk_special_values_rank():
    """Larger first, -0.0 == +0.0 (ties to the lower column), -inf above NaN."""
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[nan, -inf, 0.0, -0.0, 1.0, -inf, nan, -0.0],
                           [nan, -inf, nan, -inf, -1.0, nan, -inf, nan],
                           [-0.0, 0.0, -0.0, 0.0, -0.0, 0.0, -0.0, 0.0]])
    visible = torch.tensor([8, 8, 8], dtype=torch.int32)
    out = qsa_torch.topk_blocks(logits.to(DEVICE), visible.to(DEVICE), 4)
    assert host(out).tolist() == [[2, 3, 4, 7], [1, 3, 4, 6], [0, 1, 2, 3]]
    check_topk(logits, visible, 4)


@pytest.mark.parametrize("kind", ["random", "sorted", "periodic", "special"])
def test_topk_split_rows(kind):
    """Small tiles force rows split over slices, and the three finishing paths:
    T equal to the group bound (sorted), candidates (random), candidates
    overflowing the buffer (periodic: the large keys share one group)."""
    rows, columns, k = 3, 200, 5
    if kind == "sorted":
        logits = torch.arange(rows * columns, dtype=torch.float32).reshape(rows, columns)
    elif kind == "periodic":
        logits = torch.zeros(rows, columns)
        logits[:, ::8] = torch.arange(columns // 8, dtype=torch.float32)
        logits[1, ::8] = 1.0  # ties among the large keys
    else:
        logits = topk_logits(4, rows, columns, special=kind == "special")
    visible = torch.tensor([columns, 150, 77], dtype=torch.int32)
    with tuning.override(topk=tuning.TopkTuning(path="sliced", tile=16, min_candidates=8)):
        program = qsa_torch.topk_blocks.plan(logits.to(DEVICE), visible.to(DEVICE), k)
        assert program.launches[0].scalars["slices"] > 1
        check_topk(logits, visible, k)


def test_topk_bf16_strided_and_empty():
    logits = topk_logits(5, 4, 96)
    packed = torch.cat([logits, torch.zeros(4, 5)], dim=1)[:, :96]  # row stride 101
    visible = torch.tensor([96, 50, 3, 96], dtype=torch.int64)
    check_topk(packed, visible, 9)
    check_topk(logits.to(torch.bfloat16), visible, 9)
    check_topk(logits, visible, 0)
    check_topk(torch.zeros(0, 8), torch.zeros(0, dtype=torch.int32), 3)
    check_topk(torch.zeros(2, 0), torch.tensor([5, 0], dtype=torch.int32), 3)


# --------------------------------------------------------------------------
# expand_block_indices
# --------------------------------------------------------------------------

@pytest.mark.parametrize("ratio, token_topk", [(4, 16), (8, 24)])
def test_expand_matches_reference(ratio, token_topk):
    g = torch.Generator().manual_seed(6)
    block_topk = token_topk // ratio
    rows = 9
    blocks = torch.randint(-1, 30, (rows, block_topk), generator=g, dtype=torch.int32)
    positions = torch.tensor([0, 3, 7, 60, 96, 149, -1, -5, 33], dtype=torch.int64)
    requests = torch.tensor([0, 0, 1, 1, 2, 0, 0, -1, 5], dtype=torch.int32)
    lengths = torch.tensor(LENGTHS, dtype=torch.int32)
    args = [t.to(DEVICE) for t in (blocks, positions, lengths, requests)]
    out = qsa_torch.expand_block_indices(*args, ratio, token_topk)
    expected = reference.expand_block_indices(*(host(t) for t in args), ratio, token_topk)
    assert out.dtype == torch.int32
    assert np.array_equal(host(out), expected)
    jax_out = jax.jit(qsa_jax.expand_block_indices, static_argnums=(4, 5))(*map(to_jax, args), ratio, token_topk)
    assert_bitwise_equal(out, jax_out, "expand torch vs jax")


# --------------------------------------------------------------------------
# select_paged_tokens
# --------------------------------------------------------------------------

@pytest.mark.parametrize("ratio, token_topk, prefill", [(4, 16, True), (8, 32, False)])
def test_select_matches_reference(ratio, token_topk, prefill):
    """Integer inputs make scores exact, so the float64 pipeline ranks identically (ties included)."""
    case = scoring_case(7, prefill=prefill, integer=True)
    out = qsa_torch.select_paged_tokens(**case, token_topk=token_topk, compress_ratio=ratio)
    expected = reference.select_paged_tokens(**numpy_args(case), token_topk=token_topk,
                                             compress_ratio=ratio)
    assert np.array_equal(host(out), expected)
    # The same as composing the public stages.
    logits, visible = qsa_torch.mqa_paged_scores(**case, compress_ratio=ratio)
    blocks = qsa_torch.topk_blocks(logits, visible, token_topk // ratio)
    composed = qsa_torch.expand_block_indices(blocks, case["query_positions"], case["sequence_lengths"],
                                              case["token_to_req"], ratio, token_topk)
    assert_bitwise_equal(out, composed, "select vs composed stages")
    jax_out = jax.jit(qsa_jax.select_paged_tokens, static_argnums=(6, 7))(
        *jax_args(case).values(), token_topk, ratio)
    assert_bitwise_equal(out, jax_out, "select torch vs jax")


@pytest.mark.parametrize("prefill", [False, True])
def test_select_chunked_matches_unchunked(prefill):
    case = scoring_case(8, prefill=prefill)
    assert (case["q"].shape[0] > case["page_table"].shape[0]) == prefill  # one-row or 16-row tiles
    whole = qsa_torch.select_paged_tokens(**case, token_topk=12, compress_ratio=4)
    columns = case["page_table"].shape[1] * case["k_cache"].shape[1]
    # Three rows' (decode) or one 16-row tile's (prefill) logits per chunk.
    with tuning.override(select=tuning.SelectTuning(logits_workspace_bytes=3 * 4 * columns)):
        program = qsa_torch.select_paged_tokens.plan(**case, token_topk=12, compress_ratio=4)
        chunks = sum(launch.kernel is score_plans.scores_kernel for launch in program.launches)
        assert chunks == (2 if prefill else 3)
        chunked = qsa_torch.select_paged_tokens(**case, token_topk=12, compress_ratio=4)
        # A fresh function, so that the trace (and plan) is made with the small workspace.
        jax_out = jax.jit(lambda *arrays: qsa_jax.select_paged_tokens(*arrays, 12, 4))(*jax_args(case).values())
    assert_bitwise_equal(whole, chunked, "chunked vs whole")
    assert_bitwise_equal(whole, jax_out, "chunked jax vs torch")
    # Outside the block the default (unchunked) plan is back, with no cache to clear.
    program = qsa_torch.select_paged_tokens.plan(**case, token_topk=12, compress_ratio=4)
    assert sum(launch.kernel is score_plans.scores_kernel for launch in program.launches) == 1


def test_select_without_blocks_keeps_the_tail():
    case = scoring_case(9)
    out = qsa_torch.select_paged_tokens(**case, token_topk=0, compress_ratio=4)
    expected = reference.select_paged_tokens(**numpy_args(case), token_topk=0, compress_ratio=4)
    assert np.array_equal(host(out), expected)
    jax_out = jax.jit(qsa_jax.select_paged_tokens, static_argnums=(6, 7))(*jax_args(case).values(), 0, 4)
    assert_bitwise_equal(out, jax_out, "select torch vs jax")


# --------------------------------------------------------------------------
# The fused selection (select_fused_kernel): one launch for decode rows
# whose top-k takes the ticketed path
# --------------------------------------------------------------------------

def long_decode_case(seed, *, columns, page=64, heads=2, dim=16, dtype=torch.bfloat16, integer=False):
    """Decode rows over ``columns``-wide compressed contexts (ratio 4): two long requests (one
    to the last column, one a third as long) and idle ones, a missing and an out-of-range page,
    and rows of every kind (an early position, a negative one, no request, an out-of-range
    request)."""
    g = torch.Generator().manual_seed(seed)
    width = columns // page
    pages = 2 * width + 1
    # Idle requests too: as many requests as rows, so rows are scored alone (decode).
    requests = 6
    page_table = torch.full((requests, width), -1, dtype=torch.int32)
    page_table[:2] = torch.randperm(pages, generator=g)[:2 * width].reshape(2, width).int()
    page_table[0, 1] = -1
    page_table[1, 0] = pages + 3
    lengths = [columns * 4, columns * 4 // 3 + 5] + [0] * (requests - 2)
    requests_of_rows = [0, 1, 0, 0, -1, requests]
    positions = [lengths[0] - 1, lengths[1] - 1, 97, -9, 40, 40]
    assert len(positions) == requests
    shape_q, shape_k = (len(positions), heads, dim), (pages, page, 1, dim)
    if integer:  # exact scores: many ties, relu zeros; the float64 reference ranks the same
        q, k_cache = torch.randint(-2, 3, shape_q, generator=g).float(), torch.randint(-2, 3, shape_k, generator=g).float()
    else:
        q, k_cache = torch.randn(shape_q, generator=g), torch.randn(shape_k, generator=g)
    return dict(q=q.to(dtype).to(DEVICE), k_cache=k_cache.to(dtype).to(DEVICE), page_table=page_table.to(DEVICE),
                token_to_req=torch.tensor(requests_of_rows, dtype=torch.int32, device=DEVICE),
                query_positions=torch.tensor(positions, dtype=torch.int64, device=DEVICE),
                sequence_lengths=torch.tensor(lengths, dtype=torch.int32, device=DEVICE))


FUSED = "select_fused_kernel"


def select_kernels(case, token_topk, ratio, **options):
    program = qsa_torch.select_paged_tokens.plan(**case, token_topk=token_topk, compress_ratio=ratio, **options)
    return [kernel_name(launch.kernel) for launch in program.launches]


def assert_fused_equals_three_launches(case, token_topk, ratio=4, chunks=1, topk=None, workspace=None,
                                       reference_too=False, score_columns=128, max_columns=None, **options):
    """The fused launch (one a chunk; scoring programs of ``score_columns``; ``max_columns``:
    fused past the default's bound) against the scorer,
    top-k and expansion launches: the same bits, in torch and JAX; with exact (integer) scores,
    against the float64 reference too."""
    selected = {}
    for fused in (True, False):
        select = tuning.SelectTuning(fused=fused, fused_score_columns=score_columns,
                                     **({} if workspace is None else dict(logits_workspace_bytes=workspace)),
                                     **({} if max_columns is None else dict(fused_max_columns=max_columns)))
        with tuning.override(select=select, **({} if topk is None else dict(topk=topk))):
            kernels = select_kernels(case, token_topk, ratio, **options)
            if fused:
                assert kernels == [FUSED] * chunks, kernels
            else:
                assert FUSED not in kernels and len(kernels) >= 3 * chunks
            selected[fused] = qsa_torch.select_paged_tokens(**case, token_topk=token_topk, compress_ratio=ratio,
                                                            **options)
            # A fresh function, so that JAX plans under this tuning.
            arrays = {name: to_jax(value) for name, value in options.items()}
            jax_out = jax.jit(lambda *a, o: qsa_jax.select_paged_tokens(*a, token_topk, ratio, **o))(
                *jax_args(case).values(), o=arrays)
        assert_bitwise_equal(selected[fused], jax_out, f"fused={fused}: torch vs jax")
    assert_bitwise_equal(selected[True], selected[False], "fused vs three launches")
    if reference_too:
        expected = reference.select_paged_tokens(**numpy_args(case), token_topk=token_topk, compress_ratio=ratio)
        assert np.array_equal(host(selected[True]), expected)
    tokens = host(selected[True])
    assert (tokens >= 0).sum() > token_topk, "too few selected tokens: the case tests little"
    return tokens


@pytest.mark.parametrize("integer, token_topk", [(False, 1152), (True, 256)])
def test_fused_selection_default_tuning(integer, token_topk):
    """4480 compressed columns (3 slices of 2048): past the row top-k's
    4096, so the default plan fuses; k = 288 blocks (rows of 1155 tokens: expanded in three
    tiles) and 64, and k past a short row's visible blocks."""
    case = long_decode_case(20 + integer, columns=4480, integer=integer)
    columns = tuning.SelectTuning().fused_score_columns  # the default's 9 scoring programs
    assert_fused_equals_three_launches(case, token_topk=token_topk, reference_too=integer, score_columns=columns)


@pytest.mark.parametrize("name, topk, token_topk", [
    # 8 slices of 64 columns, 4 scorer tiles of 128; candidates in registers, ties at the bound.
    ("slices", tuning.TopkTuning(path="ticketed", ticketed_slice=64), 64),
    # k = 1, and the fixed radix's bound.
    ("k1_fixed_bound", tuning.TopkTuning(path="ticketed", ticketed_slice=128, ticketed_bound="fixed"), 4),
    # Fewer group maxima than k (the fixed bound, 0), so candidates overflow: the whole-row fallback.
    ("few_groups", tuning.TopkTuning(path="ticketed", ticketed_slice=32, max_groups=16), 160),
    # The last program's fitted passes of 4-bit digits (more of them).
    ("4_bit_digits", tuning.TopkTuning(path="ticketed", ticketed_slice=32, radix_bits=4), 160),
])
@pytest.mark.parametrize("integer", [False, True])
def test_fused_selection_branches(name, topk, token_topk, integer):
    case = long_decode_case(30 + integer, columns=512, integer=integer)
    assert_fused_equals_three_launches(case, token_topk, topk=topk, reference_too=integer)


def test_fused_selection_chunks_reuse_the_state():
    """Two rows a chunk (three chunks): each chunk's launch finds the tickets and maxima the last
    left at zero, and writes its rows of out in place."""
    case = long_decode_case(40, columns=512)
    assert_fused_equals_three_launches(case, 64, chunks=3, workspace=2 * 4 * 512,
                                       topk=tuning.TopkTuning(path="ticketed", ticketed_slice=64))


def test_ticketed_chunks_reuse_the_state_every_row_long():
    """Six long rows, two a chunk (three chunks), exact scores: each chunk's launch, the fused
    one and the three launches' top-k, finds the tickets and maxima that the last left at zero:
    stale maxima would move the bound, and the reference would tell."""
    case = long_decode_case(43, columns=512, integer=True)
    lengths = host(case["sequence_lengths"])
    case["token_to_req"] = torch.tensor([0, 1, 1, 0, 0, 1], dtype=torch.int32, device=DEVICE)
    case["query_positions"] = torch.tensor([lengths[0] - 1, lengths[1] - 1, lengths[1] - 9, lengths[0] - 300,
                                            lengths[0] - 1, 700], dtype=torch.int64, device=DEVICE)
    assert_fused_equals_three_launches(case, 64, chunks=3, workspace=2 * 4 * 512, reference_too=True,
                                       topk=tuning.TopkTuning(path="ticketed", ticketed_slice=64))


def test_fused_selection_fp8_keys():
    """fp8 keys (k_scale): the scorer's fp8 tiles and warps in the fused launch."""
    case = long_decode_case(41, columns=512, dim=32)
    scale = 0.05
    case["k_cache"] = (case["k_cache"].float() / scale).to(torch.float8_e4m3fn)
    assert_fused_equals_three_launches(case, 64, topk=tuning.TopkTuning(path="ticketed", ticketed_slice=64),
                                       k_scale=torch.tensor(scale, dtype=torch.float32, device=DEVICE))


def test_fused_selection_not_where_it_does_not_apply():
    """Prefill tiles (several rows of one request), no blocks to keep, the row top-k's widths,
    the exact fp32 dot and more than 16 heads (score bits that may depend on the warps) keep
    the three launches."""
    case = long_decode_case(42, columns=512)
    assert FUSED not in select_kernels(case, 64, 4)  # 512 columns: the register top-k
    with tuning.override(topk=tuning.TopkTuning(path="ticketed")):
        assert select_kernels(case, 64, 4) == [FUSED]
        assert select_kernels(dict(case, q=case["q"].to(torch.float16), k_cache=case["k_cache"].to(torch.float16)),
                              64, 4) == [FUSED]
        assert select_kernels(case, 0, 4) == ["scores_kernel", "expand_kernel"]
        assert FUSED not in select_kernels(scoring_case(8, prefill=True), 12, 4)
        assert FUSED not in select_kernels(dict(case, q=case["q"].float()), 64, 4)
        assert FUSED not in select_kernels(dict(case, q=case["q"].float(), k_cache=case["k_cache"].float()), 64, 4)
        assert FUSED not in select_kernels(dict(case, q=case["q"].repeat(1, 9, 1)), 64, 4)  # 18 heads
    # Past the rows and columns where it was measured faster (6 rows of 512 columns here).
    for bounds in (dict(fused_max_rows=5), dict(fused_max_columns=511)):
        with tuning.override(topk=tuning.TopkTuning(path="ticketed"), select=tuning.SelectTuning(**bounds)):
            assert FUSED not in select_kernels(case, 64, 4), bounds


@pytest.mark.gpu
@pytest.mark.parametrize("columns, fp8, integer", [(32768, False, False), (32768, False, True),
                                                   (131072, False, False), (32768, True, False)])
def test_fused_selection_production(columns, fp8, integer):
    """Production indexer geometry (4 heads x d128, pages of 64, top-512 blocks) at 128K and
    512K contexts (64 slices a row; fused past SelectTuning's default bound), bf16 or fp8
    keys: the fused launch equals the three launches bit for bit, in torch and JAX, and gives
    the same bits over repeated runs."""
    case = long_decode_case(50 + integer, columns=columns, heads=4, dim=128, integer=integer)
    options = {}
    if fp8:
        case["k_cache"] = (case["k_cache"].float() / 0.05).to(torch.float8_e4m3fn)
        options["k_scale"] = torch.tensor(0.05, dtype=torch.float32, device=DEVICE)
    select = tuning.SelectTuning(fused_max_columns=columns)
    tokens = assert_fused_equals_three_launches(case, 2048, reference_too=integer, max_columns=columns,
                                                score_columns=select.fused_score_columns, **options)
    for _ in range(4):
        with tuning.override(select=select):
            again = qsa_torch.select_paged_tokens(**case, token_topk=2048, compress_ratio=4, **options)
        assert np.array_equal(host(again), tokens), "the fused selection differs between runs"


# --------------------------------------------------------------------------
# GPU only: production-sized shapes
# --------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("rows, columns, k", [(1, 32768, 512), (3, 262144, 2048), (64, 8192, 100)])
def test_topk_large(rows, columns, k):
    logits = topk_logits(11, rows, columns)
    visible = torch.full((rows,), columns, dtype=torch.int32)
    visible[-1] = columns // 3
    check_topk(logits, visible, k)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, requests", [(64, 64), (300, 1)])
def test_select_production_geometry(rows, requests):
    """4 heads x d128 bf16, ratio 4, pages of 64, 8K-token contexts, top-512 blocks."""
    g = torch.Generator().manual_seed(12)
    context, ratio, page, heads, dim = 8192, 4, 64, 4, 128
    width = context // ratio // page
    page_table = torch.randperm(requests * width, generator=g).reshape(requests, width).int()
    case = dict(
        q=torch.randint(-2, 3, (rows, heads, dim), generator=g).to(torch.bfloat16),
        k_cache=torch.randint(-2, 3, (requests * width, page, 1, dim), generator=g).to(torch.bfloat16),
        page_table=page_table,
        token_to_req=torch.arange(rows, dtype=torch.int32) % requests,
        query_positions=(context - 1 - torch.arange(rows, dtype=torch.int32).flip(0) * (requests == 1)),
        sequence_lengths=torch.full((requests,), context, dtype=torch.int32),
    )
    case = {name: value.to(DEVICE) for name, value in case.items()}
    out = qsa_torch.select_paged_tokens(**case, token_topk=2048, compress_ratio=ratio)
    expected = reference.select_paged_tokens(**numpy_args(case), token_topk=2048, compress_ratio=ratio)
    assert np.array_equal(host(out), expected)
    jax_out = jax.jit(qsa_jax.select_paged_tokens, static_argnums=(6, 7))(*jax_args(case).values(), 2048, ratio)
    assert_bitwise_equal(out, jax_out, "select torch vs jax")
