"""The composed QSA attention step for torch (the composition is in qsa_kernels.step)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, overload

if TYPE_CHECKING:  # the annotations' array types (the same names in both adapters)
    from torch import Tensor as Array, Tensor as ArrayLike

import dataclasses

import torch

from qsa_kernels import step as _step
from qsa_kernels.docs import torch_doc

from . import _launch


@dataclasses.dataclass(frozen=True)
class QSAState(_step.StateFields):
    _zeros = staticmethod(lambda shape, dtype, device: torch.zeros(shape, dtype=dtype, device=device))
    _scale = staticmethod(lambda value, device: torch.full((), value, dtype=torch.float32, device=device))


@dataclasses.dataclass(frozen=True)
class StepMetadata(_step.MetadataFields):
    _to_device = staticmethod(lambda array, device: torch.tensor(array, device=device))  # a copy (see from_host)


# The result's length follows return_token_indices: one overload per value, so
# that `out, state = qsa_attention_step(...)` type-checks (docs/api.md, "Types").
@overload
def qsa_attention_step(q: ArrayLike, k: ArrayLike, v: ArrayLike, index_q: ArrayLike, index_k: ArrayLike,
                       state: QSAState, metadata: StepMetadata, cos_sin: ArrayLike,
                       index_cos_sin: ArrayLike, *, compress_ratio: int, token_topk: int,
                       is_neox: bool = ..., softmax_scale: float | None = ...,
                       return_token_indices: Literal[False] = ...) -> tuple[Array, QSAState]: ...
@overload
def qsa_attention_step(q: ArrayLike, k: ArrayLike, v: ArrayLike, index_q: ArrayLike, index_k: ArrayLike,
                       state: QSAState, metadata: StepMetadata, cos_sin: ArrayLike,
                       index_cos_sin: ArrayLike, *, compress_ratio: int, token_topk: int,
                       is_neox: bool = ..., softmax_scale: float | None = ...,
                       return_token_indices: Literal[True]) -> tuple[Array, QSAState, Array]: ...
@overload
def qsa_attention_step(q: ArrayLike, k: ArrayLike, v: ArrayLike, index_q: ArrayLike, index_k: ArrayLike,
                       state: QSAState, metadata: StepMetadata, cos_sin: ArrayLike,
                       index_cos_sin: ArrayLike, *, compress_ratio: int, token_topk: int,
                       is_neox: bool = ..., softmax_scale: float | None = ...,
                       return_token_indices: bool) -> tuple[Array, QSAState] | tuple[Array, QSAState, Array]: ...
def qsa_attention_step(q: ArrayLike, k: ArrayLike, v: ArrayLike, index_q: ArrayLike, index_k: ArrayLike,
                       state: QSAState, metadata: StepMetadata, cos_sin: ArrayLike,
                       index_cos_sin: ArrayLike, *, compress_ratio: int, token_topk: int,
                       is_neox: bool = True, softmax_scale: float | None = None,
                       return_token_indices: bool = False) -> tuple[Array, QSAState] | tuple[Array, QSAState, Array]:
    arguments = _step.state_arguments(dict(  # by name (no locals(): dynamo cannot trace it)
        q=q, k=k, v=v, index_q=index_q, index_k=index_k, state=state, metadata=metadata, cos_sin=cos_sin,
        index_cos_sin=index_cos_sin, compress_ratio=compress_ratio, token_topk=token_topk, is_neox=is_neox,
        softmax_scale=softmax_scale, return_token_indices=return_token_indices), QSAState, StepMetadata)
    results = _launch.call(_step.plan_qsa_attention_step, arguments)
    return _step.step_results(results, state, return_token_indices)


qsa_attention_step.__doc__ = torch_doc(_step.STEP_DOC)
QSAState.__doc__ = torch_doc(_step.STATE_DOC)
StepMetadata.__doc__ = torch_doc(_step.METADATA_DOC)
