"""Stage 3: block scoring, top-k, expansion and the fused selection (JAX adapter: binds the shared plans; see qsa_kernels)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the annotations' array types (the same names in both adapters)
    from jax import Array
    from jax.typing import ArrayLike

from qsa_kernels.expand import EXPAND_DOC, plan_expand_block_indices
from qsa_kernels.score import SCORES_DOC, plan_mqa_paged_scores
from qsa_kernels.select import SELECT_DOC, plan_select_paged_tokens
from qsa_kernels.topk import TOPK_DOC, plan_topk_blocks
from qsa_kernels.docs import jax_doc

from . import _launch


def mqa_paged_scores(q: ArrayLike, k_cache: ArrayLike, page_table: ArrayLike, token_to_req: ArrayLike,
                     query_positions: ArrayLike, sequence_lengths: ArrayLike, compress_ratio: int,
                     num_columns: int | None = None,
                     score_divisor: float | None = None) -> tuple[Array, Array]:
    return _launch.call(plan_mqa_paged_scores, locals())  # every argument, by name


def topk_blocks(logits: ArrayLike, visible_blocks: ArrayLike, k: int) -> Array:
    return _launch.call(plan_topk_blocks, locals())  # every argument, by name


def expand_block_indices(block_indices: ArrayLike, query_positions: ArrayLike, sequence_lengths: ArrayLike,
                         token_to_req: ArrayLike, compress_ratio: int, token_topk: int) -> Array:
    return _launch.call(plan_expand_block_indices, locals())  # every argument, by name


def select_paged_tokens(q: ArrayLike, k_cache: ArrayLike, page_table: ArrayLike, token_to_req: ArrayLike,
                        query_positions: ArrayLike, sequence_lengths: ArrayLike, token_topk: int,
                        compress_ratio: int) -> Array:
    return _launch.call(plan_select_paged_tokens, locals())  # every argument, by name


mqa_paged_scores.__doc__ = jax_doc(SCORES_DOC)
topk_blocks.__doc__ = jax_doc(TOPK_DOC)
expand_block_indices.__doc__ = jax_doc(EXPAND_DOC)
select_paged_tokens.__doc__ = jax_doc(SELECT_DOC)
