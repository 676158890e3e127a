"""benchmarks/bench_prefill.py's synthetic selections (issue 55): the neighbour overlap is the stated
parameter, every row's blocks are distinct and visible at its position.  No kernels, no timings."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_prefill  # noqa: E402

RATIO, TOPK = 4, 64


def check_causal_distinct(blocks, positions):
    visible = (np.asarray(positions) + 1) // RATIO
    assert blocks.shape == (len(positions), TOPK)
    assert (np.diff(blocks, axis=1) > 0).all()  # ascending, so no block twice in a row
    assert (blocks >= 0).all() and (blocks < visible[:, None]).all()


@pytest.mark.parametrize("overlap", [0.5, 0.8, 0.95, 1.0])
def test_overlap_is_the_stated_parameter(overlap):
    positions = np.arange(4096 - 64, 4096)
    blocks = bench_prefill.overlapping_blocks(np.random.default_rng(0), positions, RATIO, TOPK, overlap)
    check_causal_distinct(blocks, positions)
    assert bench_prefill.neighbour_overlap(blocks) == pytest.approx(round(overlap * TOPK) / TOPK)
    assert abs(bench_prefill.neighbour_overlap(blocks) - overlap) <= 0.5 / TOPK


def test_independent_selections_overlap_by_chance():
    positions = np.arange(4096 - 256, 4096)
    blocks = bench_prefill.overlapping_blocks(np.random.default_rng(1), positions, RATIO, TOPK, 0.0)
    check_causal_distinct(blocks, positions)
    chance = np.mean(TOPK / ((positions[1:] + 1) // RATIO))
    assert abs(bench_prefill.neighbour_overlap(blocks) - chance) < 0.02


def test_few_visible_blocks_stay_causal_and_distinct():
    # Rows see topk + 1 .. topk + 8 blocks: too few unselected ones to draw all fresh blocks from.
    positions = np.arange((TOPK + 1) * RATIO, (TOPK + 9) * RATIO)
    for overlap in (0.0, 0.5, 0.9):
        blocks = bench_prefill.overlapping_blocks(np.random.default_rng(2), positions, RATIO, TOPK, overlap)
        check_causal_distinct(blocks, positions)
        assert bench_prefill.neighbour_overlap(blocks) >= overlap - 0.5 / TOPK
    with pytest.raises(ValueError):
        bench_prefill.overlapping_blocks(np.random.default_rng(2), [TOPK * RATIO - 2], RATIO, TOPK, 0.5)


def test_tokens_expand_the_blocks_with_the_causal_tail():
    positions = torch.arange(1024 - 16, 1024)
    tokens, blocks = bench_prefill.overlapping_tokens(torch, positions, RATIO, TOPK, 0.8, seed=3)
    assert tokens.shape == (16, TOPK * RATIO + RATIO - 1) and tokens.dtype == torch.int32
    expected = torch.from_numpy(blocks)[:, :, None] * RATIO + torch.arange(RATIO)
    assert torch.equal(tokens[:, :TOPK * RATIO].long(), expected.flatten(1))
    assert torch.equal(tokens[:, TOPK * RATIO:].long(), positions[:, None] - torch.arange(RATIO - 2, -1, -1))
    assert (tokens >= 0).all() and (tokens <= positions[:, None]).all()


def test_neighbour_overlap_skips_padding():
    blocks = np.array([[1, 2, 3, -1], [2, 3, 5, 7], [-1, -1, -1, -1], [2, 9, -1, -1]])
    # row 1: 2 of 4 in row 0; row 2: no block (skipped); row 3: none of row 2's (there are none)
    assert bench_prefill.neighbour_overlap(blocks) == pytest.approx((0.5 + 0.0) / 2)
