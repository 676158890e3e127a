"""Stage 4: split-K sparse paged GQA attention (torch adapter: binds the shared plans; see qsa_kernels)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the annotations' array types (the same names in both adapters)
    from torch import Tensor as Array, Tensor as ArrayLike

from qsa_kernels.attention import DOC, plan_sparse_paged_attention
from qsa_kernels.docs import torch_doc

from . import _launch


def sparse_paged_attention(q: ArrayLike, k_cache: ArrayLike, v_cache: ArrayLike, token_indices: ArrayLike,
                           block_table: ArrayLike, token_to_req: ArrayLike,
                           softmax_scale: float | None = None) -> Array:
    return _launch.call(plan_sparse_paged_attention, dict(q=q, k_cache=k_cache, v_cache=v_cache,
                                                          token_indices=token_indices,
                                                          block_table=block_table, token_to_req=token_to_req,
                                                          softmax_scale=softmax_scale))


sparse_paged_attention.__doc__ = torch_doc(DOC)
