"""qsa_jax's public functions, built at import from the stages' declarations (``qsa_kernels.api.define``)
and typed, for a type checker, as ``qsa_kernels.functions.PublicFunctions`` of JAX arrays (NumPy's taken
too) and this adapter's containers (docs/design.md, "The public functions")."""

from __future__ import annotations

from jax import Array
from jax.typing import ArrayLike

from qsa_kernels.api import define
from qsa_kernels.functions import PublicFunctions

from ._binding import call, plan_seam
from ._step import QSAState, StepMetadata, step_call

__all__ = ["rope_reshape_and_cache", "compress_groups", "store_cache_rows", "mqa_paged_scores", "topk_blocks",
           "expand_block_indices", "select_paged_tokens", "sparse_paged_attention", "merge_attention_states", "qsa_attention_step"]

_public: PublicFunctions[ArrayLike, Array, QSAState, StepMetadata] = define("jax", __package__, call, step_call, plan_seam)
(rope_reshape_and_cache, compress_groups, store_cache_rows, mqa_paged_scores, topk_blocks, expand_block_indices,
 select_paged_tokens, sparse_paged_attention, merge_attention_states, qsa_attention_step) = _public
