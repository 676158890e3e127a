"""QSA kernels for JAX: the functional API of docs/api.md over JAX arrays.

Pure functions that work under ``jax.jit``; caches come back as arrays aliasing
the inputs (donate them for an in-place update).  On a CUDA device kernels
run through ``jax_triton.triton_call``; without one, through Triton's
interpreter from a host callback.
"""

from qsa_kernels import runtime as _runtime  # noqa: F401  (chooses compiled/interpreted first)
from qsa_kernels import __version__  # noqa: F401  (one version for the three packages)

from qsa_kernels import api as _api

from ._launch import public as _public, run_program  # noqa: F401  (the benchmarking seam: docs/api.md)

# The public functions, generated from their stages' declarations (qsa_kernels.api).
rope_reshape_and_cache = _public(_api.plan_rope_reshape_and_cache)
compress_groups = _public(_api.plan_compress_groups)
store_cache_rows = _public(_api.plan_store_cache_rows)
mqa_paged_scores = _public(_api.plan_mqa_paged_scores)
topk_blocks = _public(_api.plan_topk_blocks)
expand_block_indices = _public(_api.plan_expand_block_indices)
select_paged_tokens = _public(_api.plan_select_paged_tokens)
sparse_paged_attention = _public(_api.plan_sparse_paged_attention)
from ._step import QSAState, StepMetadata, qsa_attention_step
from ._triton_call import CUSTOM_CALL_TARGETS, triton_lowering, triton_lowering_available, use_triton_lowering

__all__ = [
    "rope_reshape_and_cache",
    "compress_groups",
    "store_cache_rows",
    "mqa_paged_scores",
    "topk_blocks",
    "expand_block_indices",
    "select_paged_tokens",
    "sparse_paged_attention",
    "qsa_attention_step",
    "QSAState",
    "StepMetadata",
    # JAX only: how launches reach XLA (docs/api.md, "Calling from jax.jit")
    "CUSTOM_CALL_TARGETS",
    "triton_lowering",
    "triton_lowering_available",
    "use_triton_lowering",
]
