"""Stage 3: selection -- score compressed blocks, keep the top k, expand to tokens.

``select_paged_tokens`` composes the three algorithms of this stage, each in
its own module: :mod:`.score` (``mqa_paged_scores``), :mod:`.topk` (the exact
radix ``topk_blocks``) and :mod:`.expand` (``expand_block_indices``).  It is
one program of score -> top-k -> expand launches over row chunks whose logits
fit a fixed workspace.
"""

from __future__ import annotations

import math

from .expand import EXPAND_OPTIONS, check_token_topk, expand_launches
from .launch import ArrayInfo, Buffer, Program
from .memo import cached_plan
from .score import (SCALE_DOC, SCORES_DOC_ARGS, SCORING_OPTIONS, check_key_scale, check_scoring, score_launches,
                    score_tiling)
from .topk import topk_parts
from .tuning import SelectTuning, TopkTuning
from .validate import Checker

SELECT_DOC = f"""\
Score, select the top blocks and expand them to tokens, in one call.

``expand_block_indices(topk_blocks(*mqa_paged_scores(...),
token_topk // compress_ratio), ...)`` with the default score divisor, rows
processed in chunks whose logits fit a fixed workspace (128 MiB; see
``qsa_kernels.tuning.SelectTuning``), with no host
synchronisation.

Args:
{SCORES_DOC_ARGS}
    token_topk: selected tokens, a multiple of ``compress_ratio``.
    compress_ratio: tokens per compressed block (positive int).
{SCALE_DOC}

Returns:
    ``[R, token_topk + compress_ratio - 1]`` int32 token indices.
"""


@cached_plan(options=dict(SCORING_OPTIONS, **EXPAND_OPTIONS))
def plan_select_paged_tokens(q: ArrayInfo, k_cache: ArrayInfo, page_table: ArrayInfo,
                             token_to_req: ArrayInfo, query_positions: ArrayInfo,
                             sequence_lengths: ArrayInfo, token_topk: int, compress_ratio: int, *,
                             tuning: SelectTuning | None = None,
                             topk_tuning: TopkTuning | None = None,
                             k_scale: ArrayInfo | None = None) -> Program:
    """Validate ``select_paged_tokens`` arguments and describe its chunked launches (see docs/api.md).

    Each chunk of rows is scored into one logits workspace, ranked and
    expanded into its rows of ``out``; later chunks reuse every workspace.
    """
    check = Checker("select_paged_tokens")
    check_scoring(check, q, k_cache, page_table, token_to_req, query_positions, sequence_lengths)
    check_token_topk(check, token_topk, compress_ratio)
    fp8_keys = check_key_scale(check, k_cache, k_scale)
    rows = q.shape[0]
    columns = page_table.shape[1] * k_cache.shape[1]
    block_topk = token_topk // compress_ratio
    # Chunks are whole scorer row tiles, so chunking never changes a score.
    tile_rows, _, _ = score_tiling(q, k_cache, page_table, columns, tuning)
    chunk = max(1, tuning.logits_workspace_bytes // (4 * max(columns, 1)) // tile_rows) * tile_rows
    chunk = min(chunk, rows)
    ranges = [(first, min(chunk, rows - first)) for first in range(0, rows, max(chunk, 1))]
    logits = Buffer("logits", (chunk, columns), "float32")
    out = Buffer("out", (rows, token_topk + compress_ratio - 1), "int32")
    stride = logits.info.strides[0]
    score = score_launches(q, k_cache, page_table, compress_ratio, columns, math.sqrt(q.shape[2]),
                           ranges, stride, fp8_keys, tuning)
    topk_buffers, topk = topk_parts(chunk, columns, block_topk, stride, [n for _, n in ranges],
                                    "logits", "visible_blocks", "blocks", topk_tuning)
    expand = expand_launches(block_topk, compress_ratio, max(block_topk, 1), out.shape[1],
                             page_table.shape[0], ranges, "blocks")
    per_chunk = len(topk) // max(len(ranges), 1)
    launches = []
    for i in range(len(ranges)):
        launches += [score[i], *topk[i * per_chunk:(i + 1) * per_chunk], expand[i]]
    buffers = (out, logits, Buffer("visible_blocks", (chunk,), "int32"),
               Buffer("blocks", (chunk, block_topk), "int32")) + topk_buffers
    return Program("select_paged_tokens", buffers, tuple(launches), ("out",))
