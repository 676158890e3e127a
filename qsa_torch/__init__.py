"""QSA kernels for PyTorch: the functional API of docs/api.md over torch tensors.

Caches are updated in place and returned; every call launches on its
tensors' device and current stream, with no host synchronisation.

Every function is also a torch custom op (namespace ``qsa``, generated from
its plan; see ``qsa_torch._launch``): ``torch.compile(..., fullgraph=True)``
(any mode, CUDA graphs included), ``torch.export``, ``FakeTensorMode`` and
meta tensors see an op with declared in-place arguments and a fake
implementation that never launches.  Plain eager calls skip the dispatcher.
"""

from qsa_kernels import runtime as _runtime  # noqa: F401  (chooses compiled/interpreted first)
from qsa_kernels import __version__  # noqa: F401  (one version for the three packages)

from ._attention import sparse_paged_attention
from ._compress import compress_groups, store_cache_rows
from ._rope_cache import rope_reshape_and_cache
from ._select import expand_block_indices, mqa_paged_scores, select_paged_tokens, topk_blocks
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
