"""Stage 3: block scoring, top-k, expansion and the fused selection (torch adapter: binds the shared plans; see qsa_kernels)."""

from __future__ import annotations

from qsa_kernels.expand import EXPAND_DOC, plan_expand_block_indices
from qsa_kernels.score import SCORES_DOC, plan_mqa_paged_scores
from qsa_kernels.select import SELECT_DOC, plan_select_paged_tokens
from qsa_kernels.topk import TOPK_DOC, plan_topk_blocks
from qsa_kernels.docs import torch_doc

from . import _launch


def mqa_paged_scores(q, k_cache, page_table, token_to_req, query_positions, sequence_lengths,
                     compress_ratio, num_columns=None, score_divisor=None, *, k_scale=None):
    return _launch.call(plan_mqa_paged_scores, locals())  # every argument, by name


def topk_blocks(logits, visible_blocks, k):
    return _launch.call(plan_topk_blocks, locals())  # every argument, by name


def expand_block_indices(block_indices, query_positions, sequence_lengths, token_to_req,
                         compress_ratio, token_topk):
    return _launch.call(plan_expand_block_indices, locals())  # every argument, by name


def select_paged_tokens(q, k_cache, page_table, token_to_req, query_positions, sequence_lengths,
                        token_topk, compress_ratio, *, k_scale=None):
    return _launch.call(plan_select_paged_tokens, locals())  # every argument, by name


mqa_paged_scores.__doc__ = torch_doc(SCORES_DOC)
topk_blocks.__doc__ = torch_doc(TOPK_DOC)
expand_block_indices.__doc__ = torch_doc(EXPAND_DOC)
select_paged_tokens.__doc__ = torch_doc(SELECT_DOC)
