"""The composed QSA attention step for torch (the composition is in qsa_kernels.step)."""

from __future__ import annotations

import dataclasses

import torch

from qsa_kernels import step as _step
from qsa_kernels.docs import torch_doc

from . import _launch
from ._attention import sparse_paged_attention
from ._compress import compress_groups, store_cache_rows
from ._rope_cache import rope_reshape_and_cache
from ._select import select_paged_tokens


@dataclasses.dataclass(frozen=True)
class QSAState(_step.StateFields):
    _zeros = staticmethod(lambda shape, dtype, device: torch.zeros(shape, dtype=dtype, device=device))
    _scale = staticmethod(lambda value, device: torch.full((), value, dtype=torch.float32, device=device))


@dataclasses.dataclass(frozen=True)
class StepMetadata(_step.MetadataFields):
    _to_device = staticmethod(lambda array, device: torch.as_tensor(array, device=device))


_BACKEND = _step.Backend(
    rope_reshape_and_cache=rope_reshape_and_cache,
    compress_groups=compress_groups,
    store_cache_rows=store_cache_rows,
    select_paged_tokens=select_paged_tokens,
    sparse_paged_attention=sparse_paged_attention,
    state_type=QSAState,
    metadata_type=StepMetadata,
    check_arrays=_launch.metadata,
    full_like=torch.full_like,
    zeros_like=torch.zeros_like,
    contiguous=torch.Tensor.contiguous,
)


def qsa_attention_step(q, k, v, index_q, index_k, state, metadata, cos_sin, index_cos_sin, *,
                       compress_ratio, token_topk, is_neox=True, softmax_scale=None,
                       return_token_indices=False):
    return _step.attention_step(_BACKEND, q, k, v, index_q, index_k, state, metadata, cos_sin, index_cos_sin,
                                compress_ratio=compress_ratio, token_topk=token_topk, is_neox=is_neox,
                                softmax_scale=softmax_scale, return_token_indices=return_token_indices)


qsa_attention_step.__doc__ = torch_doc(_step.STEP_DOC)
QSAState.__doc__ = torch_doc(_step.STATE_DOC)
StepMetadata.__doc__ = torch_doc(_step.METADATA_DOC)
