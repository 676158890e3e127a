"""QSA kernels for PyTorch: the functional API of docs/api.md over torch tensors.

Caches are updated in place and returned; every call launches on its
tensors' device and current stream, with no host synchronisation.

Every function is also a torch custom op (namespace ``qsa``, one per variant
of its declaration, all registered by this import under the names docs/api.md
lists; see ``qsa_torch._launch``): ``torch.compile(..., fullgraph=True)``
(any mode, CUDA graphs included), ``torch.export`` (programs saved in one
process load in another), ``FakeTensorMode`` and meta tensors see an op with
declared in-place arguments and a fake implementation that never launches.
Plain eager calls skip the dispatcher.  The kernels are not differentiable: a
call with an input that requires grad, in grad mode, raises.
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
]
