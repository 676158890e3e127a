"""Stage 4: split-K sparse paged GQA attention (JAX adapter: binds the shared plans; see qsa_kernels)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the annotations' array types (the same names in both adapters)
    from jax import Array
    from jax.typing import ArrayLike

from qsa_kernels.attention import DOC, plan_sparse_paged_attention
from qsa_kernels.docs import jax_doc

from . import _launch


def sparse_paged_attention(q: ArrayLike, k_cache: ArrayLike, v_cache: ArrayLike, token_indices: ArrayLike,
                           block_table: ArrayLike, token_to_req: ArrayLike,
                           softmax_scale: float | None = None) -> Array:
    return _launch.call(plan_sparse_paged_attention, locals())  # every argument, by name


sparse_paged_attention.__doc__ = jax_doc(DOC)
