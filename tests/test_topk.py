"""topk_blocks by path: the register path (the row in registers), the
one-program-per-row path (its bound, candidate and fallback branches, and
the direct select), the ticketed path (its branches, and its state reused
by later runs), the sliced path, and the shapes where the plan switches
between them.

CPU shapes are small: the tuning is shrunk (``tuning.override``) so that
every path and branch runs at widths of a few hundred columns.  Every case is checked
against the reference exactly, in both adapters (JAX bitwise equal to torch).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import torch

import qsa_jax
import qsa_kernels.select as select_plans
import qsa_kernels.topk as topk_plans
import qsa_torch
from qsa_kernels import tuning
from qsa_kernels.launch import ArrayInfo
from qsa_kernels.tuning import TopkTuning

from . import reference
from .test_select import check_topk, topk_logits
from .util import DEVICE, assert_bitwise_equal, host, to_jax


def plan(rows, columns, k, topk_tuning=None):
    """The plan under ``topk_tuning`` (default: the tuning in force)."""
    return topk_plans.plan_topk_blocks(ArrayInfo.contiguous((rows, columns), "float32"),
                                       ArrayInfo.contiguous((rows,), "int32"), k, tuning=topk_tuning)


def retuned(**fields):
    """``tuning.override`` of some top-k fields, the others as in force."""
    return tuning.override(topk=dataclasses.replace(tuning.current().topk, **fields))


def kernels(program):
    return [launch.kernel.__name__ for launch in program.launches]


SMALL_TILES = dict(row_warps=1, row_keys_per_thread=1, row_group_keys_per_thread=1, min_candidates=8,
                   register_max_columns=1)


@pytest.fixture
def small_tiles():
    """Row-path tiles of 32 columns (one warp, one key a thread) and
    candidate buffers of 4k, so that small rows take every branch (and the
    row path, not the register path, for rows wider than one column)."""
    with retuned(**SMALL_TILES):
        yield


# --------------------------------------------------------------------------
# Which path, from the static shape
# --------------------------------------------------------------------------

def test_path_thresholds():
    narrow = TopkTuning().register_max_columns
    wide = TopkTuning().row_max_columns
    few = TopkTuning().row_min_rows
    for rows in (1, 31, 2048):
        assert kernels(plan(rows, narrow, 512)) == ["topk_register_kernel"]
        assert kernels(plan(rows, narrow + 1, 512)) == ["topk_row_kernel"]
    assert kernels(plan(1, wide, 512)) == ["topk_row_kernel"]
    assert kernels(plan(few - 1, wide + 1, 512)) == ["topk_ticketed_kernel"]
    assert kernels(plan(few, wide + 1, 512)) == ["topk_row_kernel"]
    assert kernels(plan(2048, 2048, 512)) == ["topk_register_kernel"]
    widest, widest_one = TopkTuning().ticketed_max_columns, TopkTuning().ticketed_single_row_max_columns
    assert widest == widest_one == 1 << 18  # a 1M-token context's blocks
    assert kernels(plan(2, widest, 512)) == ["topk_ticketed_kernel"]
    assert kernels(plan(few - 1, widest, 512)) == ["topk_ticketed_kernel"]
    assert kernels(plan(2, widest + 1, 512))[0] == "topk_group_max_kernel"
    assert kernels(plan(1, widest_one + 1, 512))[0] == "topk_group_max_kernel"
    # One row may take the ticketed path further than the others, never less far.
    narrower = TopkTuning(ticketed_max_columns=1 << 17)
    assert kernels(plan(2, (1 << 17) + 1, 512, narrower))[0] == "topk_group_max_kernel"
    assert kernels(plan(1, (1 << 17) + 1, 512, narrower)) == ["topk_ticketed_kernel"]
    assert kernels(plan(1, widest, 512, TopkTuning(ticketed_single_row_max_columns=1024))) == ["topk_ticketed_kernel"]
    # Forced paths, as the benchmark compares them.
    assert len(plan(1, 32768, 512, TopkTuning(path="sliced")).launches) == 4
    assert kernels(plan(1, 1 << 18, 512, TopkTuning(path="row"))) == ["topk_row_kernel"]
    assert kernels(plan(2048, 2048, 512, TopkTuning(path="row"))) == ["topk_row_kernel"]
    assert kernels(plan(1, topk_plans.REGISTER_MAX_TILE, 512, TopkTuning(path="register"))) == ["topk_register_kernel"]
    with tuning.override(topk=TopkTuning(path="sliced")):
        assert len(plan(2048, 2048, 512).launches) == 4
    assert kernels(plan(2048, 2048, 512, TopkTuning(path="ticketed"))) == ["topk_ticketed_kernel"]
    # A raised threshold stops at the widest row registers hold.
    assert kernels(plan(1, 1 << 15, 512, TopkTuning(register_max_columns=1 << 15))) == ["topk_ticketed_kernel"]
    assert kernels(plan(2, 1 << 18, 512, TopkTuning(ticketed_max_columns=1 << 18))) == ["topk_ticketed_kernel"]
    assert kernels(plan(1, 1 << 19, 512, TopkTuning(ticketed_single_row_max_columns=1 << 19))) == [
        "topk_ticketed_kernel"]


def test_register_path_holds_at_most_its_tile():
    with pytest.raises(ValueError) as error:
        plan(1, topk_plans.REGISTER_MAX_TILE + 1, 512, TopkTuning(path="register"))
    assert str(error.value) == (f"TopkTuning: path 'register' holds a row in registers: at most "
                                f"{topk_plans.REGISTER_MAX_TILE} columns, got {topk_plans.REGISTER_MAX_TILE + 1}")


@pytest.mark.parametrize("columns, tile, warps", [
    (1, 16, 1), (100, 128, 1), (2048, 2048, 8), (2049, 4096, 16), (8192, 8192, 32), (16384, 16384, 32)])
def test_register_tiling(columns, tile, warps):
    """TILE covers the row at 8 keys a thread; past 32 warps the keys per thread grow."""
    (launch,) = plan(3, columns, 64, TopkTuning(path="register")).launches
    assert launch.constexprs["TILE"] == tile and launch.num_warps == warps
    assert launch.constexprs["BITS"] == 4 and launch.outputs == ("out",)
    assert plan(3, columns, 64, TopkTuning(path="register")).buffers[1:] == ()  # no workspace
    (launch,) = plan(3, columns, 64, TopkTuning(path="register", register_keys_per_thread=4,
                                                 register_max_warps=8, register_radix_bits=8)).launches
    assert launch.num_warps == max(1, min(8, tile // 128)) and launch.constexprs["BITS"] == 8


@pytest.mark.parametrize("k", [1, 8, 512, 2048])
def test_row_path_bounds_only_wider_rows(k):
    """Rows up to 2k columns (single-column groups) skip the bound; wider rows use it."""
    row = TopkTuning(path="row")
    for columns, bounded in ((2 * k, False), (2 * k + 1, True)):
        (launch,) = plan(4, columns, k, row).launches
        assert launch.constexprs["BOUNDED"] is bounded
        assert launch.constexprs["TILE"] >= (1 if bounded else columns)
    # Every tile fits the 16-bit counts packed by the prefix sums.
    for rows in (64, 2048):
        for columns in (2048, 32768, 1 << 18):
            (launch,) = plan(rows, columns, k, row).launches
            assert launch.constexprs["TILE"] <= 16384 and launch.constexprs["GROUP_TILE"] >= launch.constexprs["GROUPS"]


def test_many_rows_share_sms():
    few, many = TopkTuning().row_many_rows - 1, TopkTuning().row_many_rows
    (a,), (b,) = plan(few, 32768, 512).launches, plan(many, 32768, 512).launches
    assert b.num_warps < a.num_warps and b.constexprs["TILE"] < a.constexprs["TILE"]


# --------------------------------------------------------------------------
# The row path's branches, at small widths
# --------------------------------------------------------------------------

def _order_keys(values: np.ndarray) -> np.ndarray:
    """The kernels' order (NaN lowest, -0.0 == +0.0) as uint32, from float32 bits."""
    values = np.where(values == 0, np.float32(0), values.astype(np.float32))
    bits = values.view(np.uint32)
    keys = np.where(bits >> 31 != 0, ~bits, bits | np.uint32(0x80000000)).astype(np.uint32)
    return np.where(np.isnan(values), np.uint32(0), keys)


def row_branch(values: np.ndarray, k: int, launch) -> str:
    """Which branch of the row kernel a row takes (its bound recomputed here
    from the definition: the k-th largest group maximum, truncated)."""
    c = launch.constexprs
    groups, capacity = c["GROUPS"], launch.scalars["capacity"]
    keys = _order_keys(values)
    maxima = np.zeros(groups, np.uint32)
    np.maximum.at(maxima, np.arange(len(keys)) % groups, keys)
    kth = np.sort(maxima)[::-1][k - 1] if k <= groups else 0
    bits = c["BITS"] * c["BOUND_PASSES"]
    bound = (int(kth) >> (32 - bits)) << (32 - bits)
    count, above = int(np.sum(keys >= bound)), int(np.sum(keys > bound))
    if count <= capacity:
        return "candidates in registers" if count <= c["CAND_TILE"] else "candidates streamed"
    return "ties at the bound" if above < k else "whole row"


def branch_case(kind, columns=200):
    g = torch.Generator().manual_seed(21)
    if kind == "sorted":  # the top keys are the group maxima: few candidates
        return torch.arange(columns, dtype=torch.float32).repeat(3, 1)
    if kind == "random":
        return torch.randn(3, columns, generator=g)
    if kind == "periodic":  # the large keys share one group: the bound is low
        logits = torch.rand(3, columns, generator=g)
        logits[:, ::16] += 2 + torch.rand(3, len(range(0, columns, 16)), generator=g)
        return logits
    if kind == "clustered":  # the large keys fill 4 of 16 groups: many keys reach a low bound
        logits = torch.rand(3, columns, generator=g)
        logits[:, torch.arange(columns) % 16 < 4] += 2.0
        return logits
    if kind == "narrow":  # every key shares the bound's top 16 bits
        return 1.0 + torch.randint(0, 1000, (3, columns), generator=g).float() * 1e-6
    if kind == "ties":  # zeros, two larger keys: T is the bound and overflows
        logits = torch.zeros(3, columns)
        logits[:, [7, 150]] = torch.tensor([3.0, 2.0])
        logits[1, ::3] = -0.0
        return logits
    raise ValueError(kind)


@pytest.mark.parametrize("kind, k, branch", [
    ("sorted", 5, "candidates in registers"),
    ("random", 5, "candidates in registers"),
    ("periodic", 5, "candidates streamed"),
    ("narrow", 5, "whole row"),
    ("ties", 5, "ties at the bound"),
])
@pytest.mark.parametrize("chunk", [4, 16, 32])
def test_row_path_branches(small_tiles, kind, k, branch, chunk):
    """Each branch of the bounded row select; the compaction's prefix sums
    over chunks of 4 or 16 columns of a 32-column tile, or over the whole
    tile (one chunk)."""
    logits = branch_case(kind)
    with retuned(row_chunk=chunk):
        (launch,) = plan(3, logits.shape[1], k).launches
        assert launch.kernel.__name__ == "topk_row_kernel" and launch.constexprs["BOUNDED"]
        assert launch.constexprs["TILE"] == 32 < logits.shape[1]  # several tiles a pass
        assert launch.constexprs["CHUNK"] == chunk
        assert row_branch(host(logits[0]), k, launch) == branch
        visible = torch.tensor([200, 150, 77], dtype=torch.int32)
        check_topk(logits, visible, k)


@pytest.fixture(params=["row", "register"])
def one_program_a_row(request):
    """Each path with one program a row: the row path with small_tiles' tiles,
    or the register path forced."""
    if request.param == "row":
        with retuned(**SMALL_TILES):
            yield
    else:
        with retuned(path="register"):
            yield


@pytest.mark.parametrize("columns, k", [(16, 8), (17, 8), (64, 1), (300, 20)])
@pytest.mark.parametrize("special", [False, True])
def test_one_program_a_row_matches_reference(one_program_a_row, columns, k, special):
    """Widths at the row path's direct/bounded switch (2k) and at a register
    tile's edge, k = 1, visible widths below k, zero, negative and past the
    row; ties, -0.0, -inf and NaN."""
    logits = topk_logits(22 + columns, 6, columns, special)
    visible = torch.tensor([columns, k - 1, 0, -5, columns + 3, max(columns // 2, 1)], dtype=torch.int32)
    check_topk(logits, visible, k)


@pytest.mark.parametrize("value", [0.5, -0.0, float("-inf"), float("nan")])
def test_row_path_all_ties(small_tiles, value):
    """A row of one value: the lowest columns win, on the bounded select
    (candidates overflowing, and fitting: every radix pass skipped) and on
    the direct one."""
    logits = torch.full((2, 100), value)
    logits[1, ::2] = -value if value == value else value  # +0.0 among -0.0, +inf among -inf
    visible = torch.tensor([100, 60], dtype=torch.int32)
    check_topk(logits, visible, 7)
    (launch,) = plan(2, 20, 5).launches
    assert launch.constexprs["BOUNDED"] and launch.scalars["capacity"] >= 20
    check_topk(logits[:, :20].contiguous(), visible.clamp(max=20), 5)
    check_topk(logits[:, :12].contiguous(), visible.clamp(max=12), 7)


def test_k_past_visible_and_k_past_columns(one_program_a_row):
    logits = topk_logits(23, 3, 40, special=True)
    check_topk(logits, torch.tensor([40, 3, 0], dtype=torch.int32), 64)
    check_topk(logits, torch.tensor([40, 39, 1], dtype=torch.int32), 40)


def test_path_switch_shapes(small_tiles):
    """Just below and above the row-width and ticketed-width thresholds, and
    at the row count that takes wide rows back to the row path; the same
    result on every path."""
    logits = topk_logits(24, 4, 97, special=True)
    visible = torch.tensor([97, 96, 50, 2], dtype=torch.int32)
    with retuned(row_max_columns=80, row_min_rows=4, ticketed_max_columns=96, ticketed_slice=16):
        for rows, columns, path in ((3, 80, "row"), (3, 81, "ticketed"), (3, 96, "ticketed"), (3, 97, "sliced"),
                                    (4, 97, "row")):
            assert topk_plans.topk_path(rows, columns, 6, tuning.current().topk) == path
            assert (kernels(plan(rows, columns, 6)) == ["topk_row_kernel"]) is (path == "row")
            check_topk(logits[:rows, :columns].contiguous(), visible[:rows].clamp(max=columns), 6)


def test_many_rows_switch(small_tiles):
    logits = topk_logits(25, 4, 300)
    visible = torch.tensor([300, 299, 128, 7], dtype=torch.int32)
    with retuned(row_warps=2, row_keys_per_thread=2, row_many_rows=4):
        assert plan(4, 300, 9).launches[0].constexprs["TILE"] < plan(3, 300, 9).launches[0].constexprs["TILE"]
        check_topk(logits[:3], visible[:3], 9)
        check_topk(logits, visible, 9)


# --------------------------------------------------------------------------
# The ticketed path (one launch, several programs a row), at small widths
# --------------------------------------------------------------------------

def ticketed_bound(values: np.ndarray, k: int, launch) -> tuple[np.ndarray, int]:
    """(The row's order keys, the ticketed kernel's bound), the bound
    recomputed here from the definition: the k-th largest of the G strided
    group maxima, truncated."""
    c = launch.constexprs
    keys = _order_keys(values)
    maxima = np.zeros(c["GROUPS"], np.uint32)
    np.maximum.at(maxima, np.arange(len(keys)) % c["GROUPS"], keys)
    kth = int(np.sort(maxima)[::-1][k - 1]) if k <= c["GROUPS"] else 0
    if c["SCALED"]:
        bound = scaled_bound(maxima, k, kth, c["BOUND_PASSES"], c["BITS"])
    else:
        bits = c["BITS"] * c["BOUND_PASSES"]
        bound = (kth >> (32 - bits)) << (32 - bits)
    return keys, bound


def ticketed_branch(values: np.ndarray, k: int, launch) -> str:
    """Which branch of the ticketed kernel's selection a row takes."""
    c = launch.constexprs
    keys, bound = ticketed_bound(values, k, launch)
    if np.sum(keys >= bound) <= c["CAND_TILE"]:
        return "candidates in registers"
    return "ties at the bound" if np.sum(keys > bound) < k else "whole row"


def scaled_bound(maxima: np.ndarray, k: int, kth: int, passes: int, bits: int) -> int:
    """The lower end of the range that ``passes`` scaled digits (of ``key -
    lo``, the span's top ``bits`` bits; the span's bit length read from its
    float32 exponent) narrow to around the k-th largest group maximum,
    stopping early when a range holds exactly the maxima left to take."""
    lo, hi, remaining = int(maxima.min()), int(maxima.max()), k
    for _ in range(passes):
        if lo == hi:
            break
        length = int(np.frexp(np.float32(hi - lo))[1])  # 2**(length - 1) <= float32(span) < 2**length
        shift = max(length - bits, 0)
        new_lo = lo + (((kth - lo) >> shift) << shift)
        new_hi = min(hi, new_lo + (1 << shift) - 1)
        remaining -= int(np.sum((maxima > new_hi) & (maxima <= hi)))
        in_range = int(np.sum((maxima >= new_lo) & (maxima <= new_hi)))
        lo, hi = new_lo, new_hi
        if in_range == remaining:
            break
    return lo


@pytest.fixture
def ticketed():
    """The ticketed path forced, with slices of 16 columns: 13 slices (26
    programs) a row of 200."""
    with retuned(path="ticketed", ticketed_slice=16):
        yield


@pytest.mark.parametrize("columns, k, tile", [(32768, 512, 1024), (8192, 512, 1024), (131072, 512, 1024),
                                             (65536, 2048, 4096), (32768, 256, 512), (32768, 128, 512)])
def test_ticketed_candidate_tile_holds_the_candidates(columns, k, tile):
    """The ticketed path's candidate tile (2k from k = 256, 4k below) holds
    the candidates of every one of 40 random rows of |N(0, 1)| logits and of
    40 of bf16-rounded ones (ties), by the NumPy model of the bound: no row
    of such data takes the row fallback."""
    (launch,) = plan(1, columns, k).launches
    assert launch.kernel.__name__ == "topk_ticketed_kernel" and launch.constexprs["CAND_TILE"] == tile
    rng = np.random.default_rng(columns + k)
    for bf16 in (False, True):
        for _ in range(40):
            values = np.abs(rng.standard_normal(columns)).astype(np.float32)
            if bf16:
                values = torch.from_numpy(values).to(torch.bfloat16).float().numpy()
            assert ticketed_branch(values, k, launch) == "candidates in registers"


@pytest.mark.parametrize("kind, k, branch", [
    ("sorted", 5, "candidates in registers"),   # the top keys all in the last slice
    ("random", 5, "candidates in registers"),
    ("periodic", 5, "candidates in registers"),  # the large keys share one group
    ("narrow", 5, "candidates in registers"),    # the scaled bound: as tight as the keys
    ("clustered", 5, "whole row"),
    ("ties", 5, "ties at the bound"),
])
@pytest.mark.parametrize("chunk", [4, 16])
def test_ticketed_path_branches(ticketed, kind, k, branch, chunk):
    """Each branch of the ticketed selection; the compaction's prefix sums
    over chunks of 4 columns of a 16-column slice, or over the whole slice."""
    logits = branch_case(kind)
    with retuned(ticketed_chunk=chunk):
        (launch,) = plan(3, logits.shape[1], k).launches
        assert launch.kernel.__name__ == "topk_ticketed_kernel" and launch.grid == (3, 2 * 13)
        assert launch.constexprs["CAND_TILE"] == 32 and launch.constexprs["REGION"] == 16
        assert launch.constexprs["CHUNK"] == chunk
        assert ticketed_branch(host(logits[0]), k, launch) == branch
        check_topk(logits, torch.tensor([200, 150, 77], dtype=torch.int32), k)


@pytest.mark.parametrize("kind", ["random", "sorted", "ties"])
def test_ticketed_counts_read_in_several_steps(kind):
    """More slices than the last program reads counts a step (16): 40 slices of 16 columns, so
    the candidates' offsets come from three steps of loads, the last step partly past the row's
    slices; against the reference."""
    logits = branch_case(kind, 640)
    with retuned(path="ticketed", ticketed_slice=16, ticketed_max_slices=64):
        (launch,) = plan(3, logits.shape[1], 24).launches
        assert launch.kernel.__name__ == "topk_ticketed_kernel" and launch.constexprs["SLICES"] == 40
        check_topk(logits, torch.tensor([640, 333, 77], dtype=torch.int32), 24)


@pytest.mark.parametrize("kind, k, branch", [
    ("sorted", 5, "candidates in registers"),
    ("sorted", 24, "candidates in registers"),  # 24-48 candidates, all in the last slice
    ("random", 24, "candidates in registers"),
    ("periodic", 5, "candidates in registers"),
    ("clustered", 5, "whole row"),
    ("ties", 5, "ties at the bound"),
])
def test_ticketed_streamed_slices(kind, k, branch):
    """Past ``ticketed_stream_warps`` (48 here: 6 slices of 8 warps) a
    launch, slices widen to 128 columns, each streamed by its programs in 16-column tiles
    (8 compaction tiles, with the candidates' slots carried from tile to
    tile; 8 maxima tiles at G = 16, 2 of 64 columns at G = 64); rows cut
    inside a slice and inside a tile; every branch of the selection."""
    logits = branch_case(kind)
    with retuned(path="ticketed", ticketed_slice=16, ticketed_warps=8, ticketed_stream_warps=48):
        (launch,) = plan(3, logits.shape[1], k).launches
        c = launch.constexprs
        assert launch.grid == (3, 2 * 2) and (c["SLICES"], c["SLICE"], c["TILE"]) == (2, 128, 16)
        # A region a streamed slice holds every candidate the tile does.
        assert c["REGION"] == c["CAND_TILE"] == (32 if k == 5 else 128)
        assert c["GROUP_TILE"] == max(16, c["GROUPS"]) and c["GROUPS"] == (16 if k == 5 else 64)
        assert ticketed_branch(host(logits[0]), k, launch) == branch
        check_topk(logits, torch.tensor([200, 150, 77], dtype=torch.int32), k)


@pytest.mark.parametrize("columns, k", [(300, 20), (300, 64)])
def test_ticketed_streamed_slices_match_reference(columns, k):
    """Streamed slices (2 of 256 columns a row, in the 32-column tiles held
    past 16 slices a row) on ties, -0.0, -inf and NaN; visible widths below
    k, zero, negative and past the row; k past the candidate tile."""
    logits = topk_logits(30 + columns, 6, columns, special=True)
    visible = torch.tensor([columns, k - 1, 0, -5, columns + 3, columns // 2], dtype=torch.int32)
    with retuned(path="ticketed", ticketed_slice=16, ticketed_warps=8, ticketed_stream_warps=96):
        (launch,) = plan(6, columns, k).launches
        assert (launch.constexprs["SLICES"], launch.constexprs["SLICE"], launch.constexprs["TILE"]) == (2, 256, 32)
        check_topk(logits, visible, k)


@pytest.mark.parametrize("rows, columns, slices, width, tile, warps", [
    (1, 32768, 16, 2048, 2048, 8),     # 128 warps: held
    (16, 32768, 16, 2048, 2048, 8),    # 2048 warps: held
    (64, 32768, 4, 8192, 2048, 8),     # 256 slices of 8 warps
    (48, 32768, 4, 8192, 2048, 8),     # 2048 // 384 = 5 a row: 4 of a power of two
    (1, 262144, 64, 4096, 4096, 16),   # 1024 warps: held
    (8, 131072, 16, 8192, 4096, 16),   # 128 slices of 16 warps
    (64, 262144, 2, 131072, 4096, 16),
])
def test_ticketed_slices_widen_with_rows(rows, columns, slices, width, tile, warps):
    """The default plan: slices held while the launch's slice programs stay
    within ``ticketed_stream_warps`` (2048) warps, else widened to about that
    many, streamed in tiles of the held width (the maxima's too: G = 1024)."""
    with retuned(path="ticketed"):
        (launch,) = plan(rows, columns, 512).launches
    c = launch.constexprs
    assert (c["SLICES"], c["SLICE"], c["TILE"], c["GROUP_TILE"], launch.num_warps) == (
        slices, width, tile, tile, warps)
    assert launch.grid == (rows, 2 * slices)
    assert TopkTuning().ticketed_stream_warps == 2048


@pytest.mark.parametrize("kind, branch", [("narrow", "whole row"), ("clustered", "whole row"),
                                          ("random", "candidates in registers")])
def test_ticketed_fixed_bound(kind, branch):
    """The ticketed path with the row path's bound (two fixed radix passes, truncated)."""
    with retuned(path="ticketed", ticketed_slice=16, ticketed_bound="fixed"):
        logits = branch_case(kind)
        (launch,) = plan(3, logits.shape[1], 5).launches
        assert not launch.constexprs["SCALED"] and launch.constexprs["BOUND_PASSES"] == 2
        assert ticketed_branch(host(logits[0]), 5, launch) == branch
        check_topk(logits, torch.tensor([200, 150, 77], dtype=torch.int32), 5)


@pytest.mark.parametrize("columns, k", [(17, 8), (64, 1), (300, 20), (300, 64)])
@pytest.mark.parametrize("special", [False, True])
def test_ticketed_path_matches_reference(ticketed, columns, k, special):
    """One slice and many, k = 1, k past a slice and past the candidate
    tile; visible widths below k, zero, negative and past the row; ties,
    -0.0, -inf and NaN."""
    logits = topk_logits(30 + columns, 6, columns, special)
    visible = torch.tensor([columns, k - 1, 0, -5, columns + 3, max(columns // 2, 1)], dtype=torch.int32)
    check_topk(logits, visible, k)


def test_ticketed_path_with_fewer_groups_than_k():
    """``max_groups`` below k: fewer group maxima than k, so no bound (0)
    but the fixed radix's; exact still (distinct keys: the 4 maxima are
    among the row's top 8, so any bound above 0 would lose keys)."""
    with retuned(path="ticketed", ticketed_slice=16, max_groups=4):
        (launch,) = plan(3, 300, 8).launches
        assert launch.constexprs["GROUPS"] == 4 and not launch.constexprs["SCALED"]
        logits = torch.stack([torch.randperm(300, generator=torch.Generator().manual_seed(row)).float()
                              for row in range(3)])
        check_topk(logits, torch.tensor([300, 299, 7], dtype=torch.int32), 8)


@pytest.mark.parametrize("value", [0.5, -0.0, float("-inf"), float("nan")])
def test_ticketed_path_all_ties(ticketed, value):
    logits = torch.full((2, 100), value)
    logits[1, ::2] = -value if value == value else value  # +0.0 among -0.0, +inf among -inf
    check_topk(logits, torch.tensor([100, 60], dtype=torch.int32), 7)


def test_ticketed_state_is_reused_by_later_runs():
    """select_paged_tokens' chunks run the top-k launch again on the same
    state: each run must leave its tickets and maxima at zero (a stale
    ticket would give the next run's programs the wrong roles)."""
    from .test_select import jax_args, scoring_case

    case = scoring_case(31)
    expected = qsa_torch.select_paged_tokens(**case, token_topk=12, compress_ratio=4)
    columns = case["page_table"].shape[1] * case["k_cache"].shape[1]
    # Three rows' logits per chunk: three runs of the top-k launch, 4 slices a row.
    # (Not the fused selection, which runs the ticketed top-k's steps in its own launch.)
    with retuned(path="ticketed", ticketed_slice=16), \
            tuning.override(select=tuning.SelectTuning(logits_workspace_bytes=3 * 4 * columns, fused=False)):
        program = qsa_torch.select_paged_tokens.plan(**case, token_topk=12, compress_ratio=4)
        runs = [launch for launch in program.launches if launch.kernel is topk_plans.topk_ticketed_kernel]
        assert len(runs) == 3 and runs[0].grid[1] == 2 * 4
        chunked = qsa_torch.select_paged_tokens(**case, token_topk=12, compress_ratio=4)
        jax_out = jax.jit(lambda *arrays: qsa_jax.select_paged_tokens(*arrays, 12, 4))(*jax_args(case).values())
    assert_bitwise_equal(expected, chunked, "chunked ticketed vs default")
    assert_bitwise_equal(expected, jax_out, "chunked ticketed jax vs torch")


# --------------------------------------------------------------------------
# The ticketed path's selection: radix passes of digits fitted to [bound, top]
# --------------------------------------------------------------------------

def _fitted_shift(span: int, bits: int) -> int:
    """The kernels' shift for ``bits``-bit digits of a span: its exact bit length less ``bits``."""
    return max(int(span).bit_length() - bits, 0)


def fitted_passes(values: np.ndarray, k: int, launch) -> int | None:
    """How many fitted radix passes the last program runs over the row's
    candidates, recomputed from the definition (digits of ``key - lo``
    fitted to the range, from ``[bound, top]``; stop once the range is one
    value or holds exactly the keys left to take); None where it runs none
    (the candidates overflow the tile, or there are at most k of them)."""
    c = launch.constexprs
    keys, bound = ticketed_bound(values, k, launch)
    candidates = np.sort(keys[keys >= bound].astype(np.int64))[::-1]
    if len(candidates) > c["CAND_TILE"] or len(candidates) <= k:
        return None
    kth = int(candidates[k - 1])
    lo, hi, remaining, passes = int(bound), int(keys.max()), k, 0
    while lo != hi:
        shift = _fitted_shift(hi - lo, c["BITS"])
        new_lo = lo + (((kth - lo) >> shift) << shift)
        new_hi = min(hi, new_lo + (1 << shift) - 1)
        remaining -= int(np.sum((candidates > new_hi) & (candidates <= hi)))
        in_range = int(np.sum((candidates >= new_lo) & (candidates <= new_hi)))
        lo, hi, passes = new_lo, new_hi, passes + 1
        if in_range == remaining:
            break
    assert passes <= -(-32 // c["BITS"])  # the kernel's bound on its passes
    return passes


def adjacent_case(columns=200, rows=3, k=60):
    """Keys over a wide span (1e-30 to 1e31), with the k-th largest among
    2k neighbouring float32 values (six of them, so ties too): the ranges
    resolve only at the last bits."""
    g = np.random.default_rng(22)
    logits = (10.0 ** g.uniform(-30, 0, (rows, columns))).astype(np.float32)
    near = np.float32(1.5) + (g.integers(0, 6, (rows, 2 * k)) * np.float32(2.0 ** -23)).astype(np.float32)
    logits[:, 40:40 + 2 * k] = near
    logits[:, 40:45] = np.float32(1e31)
    return torch.from_numpy(logits)


@pytest.mark.parametrize("kind, k, radix_bits, passes", [
    ("sorted", 5, 8, None),      # at most k candidates: all taken, no pass
    ("random", 5, 8, 1),         # the first digit's keys are exactly those left to take
    ("random", 5, 4, 1),
    ("periodic", 5, 8, 1),
    ("narrow", 70, 8, 2),        # every key shares the top 16 bits
    ("narrow", 80, 8, 3),
    ("ties", 37, 8, 4),          # ties at the threshold (zeros): every pass, to one value
    ("ties", 37, 4, 8),
    ("adjacent", 60, 8, 4),      # neighbouring floats over a 2**32 span: every pass
    ("ties", 5, 8, None),        # T is the bound and overflows: placed from the row
    ("clustered", 5, 8, None),   # the candidates overflow: the whole-row fallback
])
def test_ticketed_fitted_selection_branches(kind, k, radix_bits, passes):
    """Each branch of the last program's selection (how many fitted passes
    it runs, or none: the fallbacks), against the reference."""
    logits = adjacent_case() if kind == "adjacent" else branch_case(kind)
    with retuned(path="ticketed", ticketed_slice=16, radix_bits=radix_bits):
        (launch,) = plan(3, logits.shape[1], k).launches
        c = launch.constexprs
        assert c["STATE"] == 4 + c["GROUPS"] and launch.grid == (3, 2 * 13)
        assert fitted_passes(host(logits[0]), k, launch) == passes
        check_topk(logits, torch.tensor([200, 150, 77], dtype=torch.int32), k)


@pytest.mark.parametrize("radix_bits", [1, 2, 4])
def test_fitted_passes_resolve_any_span_with_small_digits(radix_bits):
    """Digits of 1, 2 and 4 bits over keys spanning 2**32 (1e-30 to 1e31, the k-th largest among
    neighbouring floats): every fitted pass takes radix_bits bits off the range, so the kernel's
    ceil(32 / radix_bits) passes resolve it (a rounded-up span length would take a bit less from
    a wide span: 1-bit digits would never narrow it, and the unresolved range would place more
    than k columns).  Against the reference."""
    logits = adjacent_case()
    visible = torch.tensor([200, 150, 77], dtype=torch.int32)
    with retuned(path="ticketed", ticketed_slice=16, radix_bits=radix_bits, bound_passes=1,
                 ticketed_bound_passes=1):
        (launch,) = plan(3, logits.shape[1], 60).launches
        assert fitted_passes(host(logits[0]), 60, launch) <= -(-32 // radix_bits)
        check_topk(logits, visible, 60)


# --------------------------------------------------------------------------
# The register path, at small widths
# --------------------------------------------------------------------------

@pytest.fixture
def register_path():
    """The register path forced."""
    with retuned(path="register"):
        yield


@pytest.mark.parametrize("value", [0.5, -0.0, float("-inf"), float("nan")])
def test_register_path_all_ties(register_path, value):
    """A row of one value (every radix pass skipped): the lowest columns win."""
    logits = torch.full((2, 100), value)
    logits[1, ::2] = -value if value == value else value  # +0.0 among -0.0, +inf among -inf
    check_topk(logits, torch.tensor([100, 60], dtype=torch.int32), 7)


@pytest.mark.parametrize("kind", ["sorted", "periodic", "narrow", "ties"])
def test_register_path_data(register_path, kind):
    """Sorted rows, outliers, keys sharing their top 16 bits (leading passes
    skipped) and ties at the k-th key; 8-bit digits on the same rows."""
    logits = branch_case(kind)
    visible = torch.tensor([200, 150, 77], dtype=torch.int32)
    check_topk(logits, visible, 5)
    with retuned(register_radix_bits=8, register_keys_per_thread=2, register_max_warps=2):
        (launch,) = plan(3, 200, 5).launches
        assert launch.constexprs["BITS"] == 8 and launch.num_warps == 2
        check_topk(logits, visible, 5)


def test_register_path_equals_the_other_paths(small_tiles):
    """Forced register, row, ticketed and sliced paths: bitwise the same
    columns, the reference's."""
    logits = topk_logits(42, 4, 150, special=True).to(DEVICE)
    visible = torch.tensor([150, 149, 30, 1], dtype=torch.int32, device=DEVICE)
    outs = {}
    for path in ("register", "row", "ticketed", "sliced"):
        with retuned(path=path, tile=64, ticketed_slice=32):
            assert topk_plans.topk_path(4, 150, 9, tuning.current().topk) == path
            outs[path] = host(qsa_torch.topk_blocks(logits, visible, 9))
    expected = reference.topk_blocks(host(logits).astype(np.float64), host(visible), 9)
    for path, out in outs.items():
        assert np.array_equal(out, expected), path


def test_register_switch_shapes():
    """Just below and above the register-width threshold: the register path,
    then the row path; exact on both."""
    logits = topk_logits(43, 3, 97, special=True).to(DEVICE)
    visible = torch.tensor([97, 96, 50], dtype=torch.int32, device=DEVICE)
    with retuned(register_max_columns=96, row_warps=1, row_keys_per_thread=1, row_group_keys_per_thread=1):
        for columns, kernel in ((96, "topk_register_kernel"), (97, "topk_row_kernel")):
            assert kernels(plan(3, columns, 6)) == [kernel]
            check_topk(logits[:, :columns].contiguous(), visible.clamp(max=columns), 6)


def test_row_max_tile_caps_the_row_tile():
    """TopkTuning.row_max_tile caps the row path's other-pass tile (a newer Triton's
    spill-free default, tuning.NEWER_TRITON) and nothing else; exact either way."""
    assert tuning.defaults("3.6").topk.row_max_tile == 16384 and tuning.defaults("3.9").topk.row_max_tile == 4096
    # 16 warps x 16 keys: above the cap (the defaults' 8 keys make 4096-column tiles).
    (uncapped,) = plan(128, 16384, 64, TopkTuning(row_keys_per_thread=16, row_max_tile=16384)).launches
    (capped,) = plan(128, 16384, 64, TopkTuning(row_keys_per_thread=16, row_max_tile=4096)).launches
    assert uncapped.constexprs["TILE"] == 8192 and capped.constexprs["TILE"] == 4096
    assert {k: v for k, v in capped.constexprs.items() if k != "TILE"} == \
        {k: v for k, v in uncapped.constexprs.items() if k != "TILE"}
    assert capped.num_warps == uncapped.num_warps == 16
    (many,) = plan(300, 16384, 64, TopkTuning(row_max_tile=4096)).launches  # 8 warps x 8 keys: below the cap
    assert many.constexprs["TILE"] == 2048
    logits = topk_logits(17, 3, 300, special=True)
    visible = torch.tensor([300, 299, 150], dtype=torch.int32)
    with retuned(**dict(SMALL_TILES, row_keys_per_thread=4, row_max_tile=32)):
        (launch,) = plan(3, 300, 9).launches
        assert launch.kernel.__name__ == "topk_row_kernel" and launch.constexprs["TILE"] == 32  # 128 uncapped
        check_topk(logits, visible, 9)


def test_tuning_reaches_the_row_plan():
    """Every row-path and ticketed-path field is read from the tuning passed
    (or in force), and plans under different tunings are memoised apart
    (the row path at 128 rows: from ``row_min_rows``)."""
    default = plan(128, 16384, 64)
    timed = tuning.defaults(tuning.TIMED_TRITON).topk  # the values timed on Triton 3.6
    (launch,) = plan(128, 16384, 64, timed).launches
    assert launch.num_warps == 16 and launch.constexprs["BOUND_PASSES"] == 2 and launch.constexprs["BITS"] == 8
    assert launch.constexprs["TILE"] == 16 * 32 * 8 and launch.constexprs["GROUP_TILE"] == 16384
    (launch,) = plan(128, 16384, 64, TopkTuning(row_warps=4, row_keys_per_thread=2, row_group_keys_per_thread=4,
                                               bound_passes=3, radix_bits=4, min_candidates=300)).launches
    assert launch.num_warps == 4 and launch.constexprs["TILE"] == 2 * 32 * 4
    assert launch.constexprs["GROUP_TILE"] == 4 * 32 * 4 and launch.constexprs["BOUND_PASSES"] == 3
    assert launch.constexprs["BITS"] == 4 and launch.scalars["capacity"] == 300
    (launch,) = plan(300, 16384, 64, TopkTuning(row_many_rows=300)).launches
    assert launch.num_warps == 8 and launch.constexprs["TILE"] == 8 * 32 * 8  # warps halved, keys not
    # Few rows: the ticketed path past row_max_columns.
    assert kernels(plan(4, 16384, 64)) == ["topk_ticketed_kernel"]
    assert kernels(plan(4, 16384, 64, TopkTuning(row_max_columns=16384))) == ["topk_row_kernel"]
    assert kernels(plan(4, 16384, 64, TopkTuning(row_min_rows=4))) == ["topk_row_kernel"]
    (launch,) = plan(4, 16384, 64).launches
    assert launch.grid == (4, 2 * 8) and launch.num_warps == 8 and launch.constexprs["SLICE"] == 2048
    assert plan(4, 16384, 64, timed).launches[0].constexprs["CHUNK"] == 16
    assert tuning.defaults("3.9").topk.ticketed_chunk == 2048  # NEWER_TRITON: 16 spills there
    (launch,) = plan(4, 16384, 64, TopkTuning(ticketed_slice=1024, ticketed_warps=4, ticketed_bound_passes=2,
                                              ticketed_chunk=64)).launches
    assert launch.grid == (4, 2 * 16) and launch.num_warps == 4 and launch.constexprs["BOUND_PASSES"] == 2
    assert launch.constexprs["CHUNK"] == 64
    assert launch.constexprs["SCALED"]
    (launch,) = plan(4, 16384, 64, TopkTuning(ticketed_bound="fixed", bound_passes=3)).launches
    assert not launch.constexprs["SCALED"] and launch.constexprs["BOUND_PASSES"] == 3
    # Past ticketed_max_slices a row, slices widen (to 4096 columns).
    (launch,) = plan(4, 16384, 64, TopkTuning(ticketed_max_slices=2)).launches
    assert launch.constexprs["SLICE"] == 4096 and launch.grid == (4, 2 * 4)
    # The state: 4 tickets, then the group maxima.
    (launch,) = plan(4, 16384, 64).launches
    assert launch.constexprs["STATE"] == 4 + launch.constexprs["GROUPS"]
    with tuning.override(topk=TopkTuning(path="sliced")):
        assert kernels(plan(128, 16384, 64))[0] == "topk_group_max_kernel"
    assert plan(128, 16384, 64) is default


def test_select_topk_tuning_reaches_the_row_path():
    """select_paged_tokens' top-k takes its path and row-path tiles from its ``topk_tuning``."""
    import qsa_kernels.select as select_plans

    a = ArrayInfo.contiguous
    infos = dict(q=a((3, 2, 16), "float32"), k_cache=a((40, 4, 1, 16), "float32"), page_table=a((2, 16), "int32"),
                 token_to_req=a((3,), "int32"), query_positions=a((3,), "int32"), sequence_lengths=a((2,), "int32"))
    options = dict(token_topk=16, compress_ratio=2)

    def topk_launches(program):
        return [launch for launch in program.launches if launch.kernel.__name__.startswith("topk_")]

    (default,) = topk_launches(select_plans.plan_select_paged_tokens(**infos, **options))
    assert default.kernel.__name__ == "topk_register_kernel"
    small = TopkTuning(register_max_columns=1, row_warps=1, row_keys_per_thread=1, row_group_keys_per_thread=1)
    (launch,) = topk_launches(select_plans.plan_select_paged_tokens(**infos, **options, topk_tuning=small))
    assert launch.num_warps == 1 and launch.constexprs["TILE"] == 32 and launch.constexprs["GROUP_TILE"] == 32
    with tuning.override(topk=small):
        (launch,) = topk_launches(select_plans.plan_select_paged_tokens(**infos, **options))
        assert launch.constexprs["TILE"] == 32
    sliced = topk_launches(select_plans.plan_select_paged_tokens(**infos, **options,
                                                                 topk_tuning=TopkTuning(path="sliced")))
    assert [launch.kernel.__name__ for launch in sliced][0] == "topk_group_max_kernel" and len(sliced) == 4


def test_topk_tuning_is_checked():
    paths = "'auto', 'register', 'row', 'ticketed', 'sliced'"
    for fields, message in ((dict(path="rows"), f"TopkTuning: path must be one of {paths}, got 'rows'"),
                            (dict(path=None), f"TopkTuning: path must be one of {paths}, got None"),
                            (dict(register_keys_per_thread=12),
                             "TopkTuning: register_keys_per_thread must be a power of two, got 12"),
                            (dict(register_max_warps=64), "TopkTuning: register_max_warps must be at most 32, got 64"),
                            (dict(register_radix_bits=3), "TopkTuning: register_radix_bits must divide 32, got 3"),
                            (dict(register_radix_bits=16), "TopkTuning: register_radix_bits must be at most 8"),
                            (dict(register_max_columns=0), "TopkTuning: register_max_columns must be a positive int"),
                            (dict(row_warps=12), "TopkTuning: row_warps must be a power of two, got 12"),
                            (dict(row_warps=64), "TopkTuning: row_warps must be at most 32, got 64"),
                            (dict(row_keys_per_thread=3), "TopkTuning: row_keys_per_thread must be a power of two"),
                            (dict(row_chunk=12), "TopkTuning: row_chunk must be a power of two, got 12"),
                            (dict(ticketed_chunk=24), "TopkTuning: ticketed_chunk must be a power of two, got 24"),
                            (dict(row_min_rows=0), "TopkTuning: row_min_rows must be a positive int, got 0"),
                            (dict(row_max_tile=3000), "TopkTuning: row_max_tile must be a power of two, got 3000"),
                            (dict(row_max_tile=32768), "TopkTuning: row_max_tile must be at most 16384, got 32768"),
                            (dict(row_max_columns=2.0), "TopkTuning: row_max_columns must be a positive int"),
                            (dict(bound_passes=5), "TopkTuning: bound_passes must be at most 32 // radix_bits = 4"),
                            (dict(radix_bits=16), "TopkTuning: radix_bits must be at most 8, got 16"),
                            (dict(ticketed_slice=3000), "TopkTuning: ticketed_slice must be a power of two"),
                            (dict(ticketed_slice=8192), "TopkTuning: ticketed_slice must be from 16 to 4096, got 8192"),
                            (dict(ticketed_slice=8), "TopkTuning: ticketed_slice must be from 16 to 4096, got 8"),
                            (dict(ticketed_warps=64), "TopkTuning: ticketed_warps must be at most 32, got 64"),
                            (dict(ticketed_bound="float"), "TopkTuning: ticketed_bound must be one of "
                                                           "'scaled', 'fixed', got 'float'"),
                            (dict(ticketed_bound_passes=0), "TopkTuning: ticketed_bound_passes must be a positive"),
                            (dict(ticketed_bound_passes=5), "TopkTuning: ticketed_bound_passes must be at most 32 "
                                                            "// radix_bits = 4, got 5")):
        with pytest.raises(ValueError) as error:
            TopkTuning(**fields)
        assert str(error.value).startswith(message), error.value


# --------------------------------------------------------------------------
# GPU only: production shapes of each path, against a vectorised reference
# --------------------------------------------------------------------------

def sorted_reference(logits: np.ndarray, visible: np.ndarray, k: int) -> np.ndarray:
    """``reference.topk_blocks`` by one stable sort a row (fast enough for
    production shapes): NaN last, then larger first (-0.0 == +0.0), then
    lower column."""
    rows, columns = logits.shape
    out = np.full((rows, k), -1, np.int64)
    for row in range(rows):
        width = min(max(int(visible[row]), 0), columns)
        values = logits[row, :width].astype(np.float64)
        order = np.lexsort((np.arange(width), -np.nan_to_num(values, nan=0.0), np.isnan(values)))
        chosen = np.sort(order[:k])
        out[row, :len(chosen)] = chosen
    return out


def test_sorted_reference_is_the_reference():
    logits = topk_logits(26, 4, 90, special=True)
    visible = np.array([90, 30, 0, -1])
    for k in (1, 7, 100):
        assert np.array_equal(sorted_reference(host(logits), visible, k),
                              reference.topk_blocks(host(logits).astype(np.float64), visible, k))


@pytest.mark.gpu
@pytest.mark.parametrize("rows, columns, k", [
    (1, 2048, 512),       # register path at its width threshold, 4 warps
    (1, 8192, 512),       # row path (the register path: rows up to 2048 columns)
    (31, 8192, 2048),     # row path, k = 2048
    (2048, 2048, 512),    # register path, prefill chunk
    (1, 8193, 512),       # row path, bounded
    (1, 32768, 512),      # row path, bounded, 16 warps
    (1, 65536, 2048),     # ticketed path, k = 2048 (16 warps)
    (8, 131072, 512),     # ticketed path (few long rows)
    (1, 1 << 18, 512),    # ticketed path, one row at TopkTuning.ticketed_single_row_max_columns
    (2, 1 << 18, 512),    # ticketed path, at TopkTuning.ticketed_max_columns
    (2, 1 << 19, 512),    # sliced path past it
    (32, 32768, 512),     # ticketed path, slices streamed (TopkTuning.ticketed_stream_warps)
    (64, 262144, 512),    # ticketed path, 4 slices of 65536 columns a row, streamed
    (128, 131072, 512),   # row path for long rows once rows fill the GPU
    (300, 16384, 2048),   # many rows, k = 2048
])
def test_topk_paths_production(rows, columns, k):
    logits = topk_logits(27, rows, columns, special=True).to(DEVICE)
    visible = torch.full((rows,), columns, dtype=torch.int32)
    visible[-1] = columns // 3
    visible = visible.to(DEVICE)
    out = qsa_torch.topk_blocks(logits, visible, k)
    assert np.array_equal(host(out), sorted_reference(host(logits), host(visible), k))
    for _ in range(3):
        assert torch.equal(qsa_torch.topk_blocks(logits, visible, k), out)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, columns, k", [(1, 2048, 512), (2048, 2048, 512), (16, 4096, 2048),
                                              (300, 8192, 2048), (2, 16384, 512), (8, 100, 128)])
def test_register_path_equals_row_path_production(rows, columns, k):
    """The register path forced where it fits, bitwise equal to the row and
    sliced paths (and the reference), with ties, -0.0, -inf and NaN."""
    logits = topk_logits(29, rows, columns, special=True).to(DEVICE)
    visible = torch.full((rows,), columns, dtype=torch.int32)
    visible[-1] = columns // 3
    visible = visible.to(DEVICE)
    expected = sorted_reference(host(logits), host(visible), k)
    for fields in (dict(path="register"), dict(path="register", register_radix_bits=8), dict(path="row"), dict(path="ticketed"),
                   dict(path="sliced")):
        with tuning.override(topk=TopkTuning(**fields)):
            assert np.array_equal(host(qsa_torch.topk_blocks(logits, visible, k)), expected), fields


@pytest.mark.gpu
@pytest.mark.parametrize("rows, columns, k", [(1, 8192, 512), (1, 32768, 512), (2048, 8192, 512),
                                              (4, 262144, 2048)])
def test_topk_paths_production_parity(rows, columns, k):
    """JAX bitwise equal to torch on each path (and both to the reference)."""
    logits = topk_logits(28, rows, columns).to(DEVICE)
    visible = torch.full((rows,), columns, dtype=torch.int32).to(DEVICE)
    out = qsa_torch.topk_blocks(logits, visible, k)
    assert np.array_equal(host(out), sorted_reference(host(logits), host(visible), k))
    jax_out = jax.jit(qsa_jax.topk_blocks, static_argnums=2)(to_jax(logits), to_jax(visible), k)
    assert_bitwise_equal(out, jax_out, "top-k torch vs jax")


@pytest.mark.gpu
@pytest.mark.parametrize("rows, columns, k, kind", [
    (1, 32768, 512, "increasing"),   # the top keys all in the last slices
    (2, 32768, 512, "decreasing"),
    (1, 32768, 2048, "ties"),        # one value: ties at the bound, placed from the row
    (3, 8193, 512, "narrow"),        # every key shares the bound's top bits: the whole-row fallback
    (8, 262144, 2048, "special"),
    (5, 20000, 64, "special"),       # a partial last slice, k = 64
])
def test_ticketed_path_production(rows, columns, k, kind):
    """The ticketed path forced on every branch at production widths, with
    the programs of a row running concurrently: exact, and the same bits
    run after run (whichever program finishes last)."""
    _check_ticketed_production(_production_logits(kind, rows, columns, seed=32), k, runs=5)


def _production_logits(kind: str, rows: int, columns: int, seed: int = 35) -> torch.Tensor:
    """``kind``'s logits; the random kinds draw from ``seed`` (special), ``seed + 1``
    (narrow) and ``seed - 1`` (half-normal)."""
    if kind == "half-normal":  # the benchmarks' scores
        return torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed - 1)).abs_()
    if kind == "special":
        return topk_logits(seed, rows, columns, special=True)
    if kind == "ties":
        return torch.full((rows, columns), 0.25)
    if kind == "narrow":
        return 1.0 + torch.randint(0, 1000, (rows, columns), generator=torch.Generator().manual_seed(seed + 1)) * 1e-6
    if kind == "wide":  # 1e-30..1e30 with neighbouring floats near the threshold
        return adjacent_case(columns, rows, 512)
    logits = torch.arange(columns, dtype=torch.float32).repeat(rows, 1) / columns
    return logits.flip(1) if kind == "decreasing" else logits


def _check_ticketed_production(logits: torch.Tensor, k: int, runs: int) -> None:
    """The ticketed path forced on ``logits`` (the last row's visible width cut by a third):
    the reference's columns, the same bits over ``runs`` more runs, and torch = JAX."""
    rows, columns = logits.shape
    visible = torch.full((rows,), columns, dtype=torch.int32)
    visible[-1] = columns - columns // 3
    logits, visible = logits.to(DEVICE), visible.to(DEVICE)
    expected = sorted_reference(host(logits), host(visible), k)
    with tuning.override(topk=TopkTuning(path="ticketed")):
        out = qsa_torch.topk_blocks(logits, visible, k)
        assert np.array_equal(host(out), expected)
        for _ in range(runs):
            assert torch.equal(qsa_torch.topk_blocks(logits, visible, k), out)
        # A fresh function: JAX plans when it traces, under the tuning then in force.
        jax_out = jax.jit(lambda x, v: qsa_jax.topk_blocks(x, v, k))(to_jax(logits), to_jax(visible))
    assert_bitwise_equal(out, jax_out, "ticketed top-k torch vs jax")


@pytest.mark.gpu
@pytest.mark.parametrize("rows, columns, k, kind", [
    (1, 32768, 512, "half-normal"),   # the benchmarks' scores, at the decode shape of issue 26
    (8, 32768, 512, "half-normal"),
    (64, 32768, 512, "half-normal"),  # forced: the plan takes the row path from row_min_rows rows
    (8, 131072, 512, "special"),
    (1, 65536, 2048, "special"),      # k = 2048: 16 warps
    (4, 32768, 512, "wide"),          # fitted passes down to the last bit
])
def test_ticketed_selection_production(rows, columns, k, kind):
    """The ticketed path forced at production widths, the programs of a
    row running concurrently: exact, the same bits over 20 runs
    (whichever programs finish first), and torch = JAX."""
    _check_ticketed_production(_production_logits(kind, rows, columns), k, runs=20)


@pytest.mark.gpu
def test_ticketed_selection_two_streams():
    """Two streams running the ticketed path on different rows at once
    (each call its own state): each the result it has alone."""
    rows, columns, k = 8, 32768, 512
    inputs = [(_production_logits(kind, rows, columns).to(DEVICE),
               torch.full((rows,), columns, dtype=torch.int32, device=DEVICE)) for kind in ("half-normal", "special")]
    with tuning.override(topk=TopkTuning(path="ticketed")):
        alone = [qsa_torch.topk_blocks(logits, visible, k) for logits, visible in inputs]
        streams = [torch.cuda.Stream() for _ in inputs]
        torch.cuda.synchronize()
        for _ in range(10):
            outs = []
            for stream, (logits, visible) in zip(streams, inputs):
                with torch.cuda.stream(stream):
                    outs.append(qsa_torch.topk_blocks(logits, visible, k))
            torch.cuda.synchronize()
            for out, expected in zip(outs, alone):
                assert torch.equal(out, expected)
    for (logits, visible), out in zip(inputs, alone):
        assert np.array_equal(host(out), sorted_reference(host(logits), host(visible), k))
