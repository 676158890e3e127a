"""Stage 4: split-K sparse paged GQA attention (JAX adapter: binds the shared plans; see qsa_kernels)."""

from __future__ import annotations

from qsa_kernels.attention import DOC, plan_sparse_paged_attention
from qsa_kernels.docs import jax_doc

from . import _launch


def sparse_paged_attention(q, k_cache, v_cache, token_indices, block_table, token_to_req,
                           softmax_scale=None, *, k_scale=None, v_scale=None):
    return _launch.call(plan_sparse_paged_attention, locals())  # every argument, by name


sparse_paged_attention.__doc__ = jax_doc(DOC)
