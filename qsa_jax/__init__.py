"""QSA kernels for JAX: the functional API of docs/api.md over JAX arrays.

Pure functions that work under ``jax.jit``; caches come back as arrays aliasing
the inputs (donate them for an in-place update).  On a CUDA device kernels
run through ``jax_triton.triton_call``; without one, through Triton's
interpreter from a host callback.
"""

from qsa_kernels import runtime as _runtime  # noqa: F401  (chooses compiled/interpreted first)
from qsa_kernels import __version__  # noqa: F401  (one version for the three packages)

from ._attention import sparse_paged_attention
from ._compress import compress_groups, store_cache_rows
from ._rope_cache import rope_reshape_and_cache
from ._select import expand_block_indices, mqa_paged_scores, select_paged_tokens, topk_blocks
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
