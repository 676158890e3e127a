"""Stage 3: block scoring, top-k, expansion and the fused selection (torch adapter: binds the shared plans; see qsa_kernels)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the annotations' array types (the same names in both adapters)
    from torch import Tensor as Array, Tensor as ArrayLike

from qsa_kernels.expand import EXPAND_DOC, plan_expand_block_indices
from qsa_kernels.score import SCORES_DOC, plan_mqa_paged_scores
from qsa_kernels.select import SELECT_DOC, plan_select_paged_tokens
from qsa_kernels.topk import TOPK_DOC, plan_topk_blocks
from qsa_kernels.docs import torch_doc

from . import _launch


def mqa_paged_scores(q: ArrayLike, k_cache: ArrayLike, page_table: ArrayLike, token_to_req: ArrayLike,
                     query_positions: ArrayLike, sequence_lengths: ArrayLike, compress_ratio: int,
                     num_columns: int | None = None,
                     score_divisor: float | None = None) -> tuple[Array, Array]:
    return _launch.call(plan_mqa_paged_scores, dict(q=q, k_cache=k_cache, page_table=page_table,
                                                    token_to_req=token_to_req,
                                                    query_positions=query_positions,
                                                    sequence_lengths=sequence_lengths,
                                                    compress_ratio=compress_ratio, num_columns=num_columns,
                                                    score_divisor=score_divisor))


def topk_blocks(logits: ArrayLike, visible_blocks: ArrayLike, k: int) -> Array:
    return _launch.call(plan_topk_blocks, dict(logits=logits, visible_blocks=visible_blocks, k=k))


def expand_block_indices(block_indices: ArrayLike, query_positions: ArrayLike, sequence_lengths: ArrayLike,
                         token_to_req: ArrayLike, compress_ratio: int, token_topk: int) -> Array:
    return _launch.call(plan_expand_block_indices, dict(block_indices=block_indices,
                                                        query_positions=query_positions,
                                                        sequence_lengths=sequence_lengths,
                                                        token_to_req=token_to_req,
                                                        compress_ratio=compress_ratio, token_topk=token_topk))


def select_paged_tokens(q: ArrayLike, k_cache: ArrayLike, page_table: ArrayLike, token_to_req: ArrayLike,
                        query_positions: ArrayLike, sequence_lengths: ArrayLike, token_topk: int,
                        compress_ratio: int) -> Array:
    return _launch.call(plan_select_paged_tokens, dict(q=q, k_cache=k_cache, page_table=page_table,
                                                       token_to_req=token_to_req,
                                                       query_positions=query_positions,
                                                       sequence_lengths=sequence_lengths,
                                                       token_topk=token_topk, compress_ratio=compress_ratio))


mqa_paged_scores.__doc__ = torch_doc(SCORES_DOC)
topk_blocks.__doc__ = torch_doc(TOPK_DOC)
expand_block_indices.__doc__ = torch_doc(EXPAND_DOC)
select_paged_tokens.__doc__ = torch_doc(SELECT_DOC)
