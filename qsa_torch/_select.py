"""Stage 3: block scoring, top-k, expansion and the fused selection (torch adapter: binds the shared plans; see qsa_kernels)."""

from __future__ import annotations

from qsa_kernels.select import (EXPAND_DOC, SCORES_DOC, SELECT_DOC, TOPK_DOC, plan_expand_block_indices,
                                plan_mqa_paged_scores, plan_select_paged_tokens, plan_topk_blocks)
from qsa_kernels.docs import torch_doc

from . import _launch


def mqa_paged_scores(q, k_cache, page_table, token_to_req, query_positions, sequence_lengths,
                     compress_ratio, num_columns=None, score_divisor=None):
    return _launch.call(plan_mqa_paged_scores, dict(q=q, k_cache=k_cache, page_table=page_table,
                                                    token_to_req=token_to_req,
                                                    query_positions=query_positions,
                                                    sequence_lengths=sequence_lengths,
                                                    compress_ratio=compress_ratio, num_columns=num_columns,
                                                    score_divisor=score_divisor))


def topk_blocks(logits, visible_blocks, k):
    return _launch.call(plan_topk_blocks, dict(logits=logits, visible_blocks=visible_blocks, k=k))


def expand_block_indices(block_indices, query_positions, sequence_lengths, token_to_req,
                         compress_ratio, token_topk):
    return _launch.call(plan_expand_block_indices, dict(block_indices=block_indices,
                                                        query_positions=query_positions,
                                                        sequence_lengths=sequence_lengths,
                                                        token_to_req=token_to_req,
                                                        compress_ratio=compress_ratio, token_topk=token_topk))


def select_paged_tokens(q, k_cache, page_table, token_to_req, query_positions, sequence_lengths,
                        token_topk, compress_ratio):
    return _launch.call(plan_select_paged_tokens, dict(q=q, k_cache=k_cache, page_table=page_table,
                                                       token_to_req=token_to_req,
                                                       query_positions=query_positions,
                                                       sequence_lengths=sequence_lengths,
                                                       token_topk=token_topk, compress_ratio=compress_ratio))


mqa_paged_scores.__doc__ = torch_doc(SCORES_DOC)
topk_blocks.__doc__ = torch_doc(TOPK_DOC)
expand_block_indices.__doc__ = torch_doc(EXPAND_DOC)
select_paged_tokens.__doc__ = torch_doc(SELECT_DOC)
