"""Stage 3 for JAX: block scoring, top-k, expansion and the fused selection."""

from __future__ import annotations

from qsa_kernels.docs import jax_doc
from qsa_kernels.select import (EXPAND_DOC, SCORES_DOC, SELECT_DOC, TOPK_DOC, plan_expand_block_indices,
                                plan_mqa_paged_scores, plan_select_paged_tokens, plan_topk_blocks)

from . import _launch


def mqa_paged_scores(q, k_cache, page_table, token_to_req, query_positions, sequence_lengths,
                     compress_ratio, num_columns=None, score_divisor=None):
    arrays = dict(q=q, k_cache=k_cache, page_table=page_table, token_to_req=token_to_req,
                  query_positions=query_positions, sequence_lengths=sequence_lengths)
    arrays, infos = _launch.metadata("mqa_paged_scores", arrays)
    program = plan_mqa_paged_scores(**infos, compress_ratio=compress_ratio, num_columns=num_columns,
                                    score_divisor=score_divisor)
    return _launch.run(program, arrays)


def topk_blocks(logits, visible_blocks, k):
    arrays = dict(logits=logits, visible_blocks=visible_blocks)
    arrays, infos = _launch.metadata("topk_blocks", arrays)
    program = plan_topk_blocks(**infos, k=k)
    return _launch.run(program, arrays)[0]


def expand_block_indices(block_indices, query_positions, sequence_lengths, token_to_req,
                         compress_ratio, token_topk):
    arrays = dict(block_indices=block_indices, query_positions=query_positions,
                  sequence_lengths=sequence_lengths, token_to_req=token_to_req)
    arrays, infos = _launch.metadata("expand_block_indices", arrays)
    program = plan_expand_block_indices(**infos, compress_ratio=compress_ratio, token_topk=token_topk)
    return _launch.run(program, arrays)[0]


def select_paged_tokens(q, k_cache, page_table, token_to_req, query_positions, sequence_lengths,
                        token_topk, compress_ratio):
    arrays = dict(q=q, k_cache=k_cache, page_table=page_table, token_to_req=token_to_req,
                  query_positions=query_positions, sequence_lengths=sequence_lengths)
    arrays, infos = _launch.metadata("select_paged_tokens", arrays)
    program = plan_select_paged_tokens(**infos, token_topk=token_topk, compress_ratio=compress_ratio)
    return _launch.run(program, arrays)[0]


mqa_paged_scores.__doc__ = jax_doc(SCORES_DOC)
topk_blocks.__doc__ = jax_doc(TOPK_DOC)
expand_block_indices.__doc__ = jax_doc(EXPAND_DOC)
select_paged_tokens.__doc__ = jax_doc(SELECT_DOC)
