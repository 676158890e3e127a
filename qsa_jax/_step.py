"""The composed QSA attention step for JAX (the composition is in qsa_kernels.step)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from qsa_kernels import step as _step
from qsa_kernels.docs import jax_doc

from . import _launch


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QSAState(_step.StateFields):
    _zeros = staticmethod(lambda shape, dtype, device: jnp.zeros(shape, dtype, device=device))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepMetadata(_step.MetadataFields):
    # A copy: device_put(may_alias=False) was seen aliasing a NumPy array on the CPU.
    _to_device = staticmethod(lambda array, device: jnp.array(array, copy=True, device=device))


def qsa_attention_step(q, k, v, index_q, index_k, state, metadata, cos_sin, index_cos_sin, *,
                       compress_ratio, token_topk, is_neox=True, softmax_scale=None,
                       return_token_indices=False):
    arguments = _step.state_arguments(locals(), QSAState, StepMetadata)
    results = _launch.call(_step.plan_qsa_attention_step, arguments)
    return _step.step_results(results, state, return_token_indices)


qsa_attention_step.__doc__ = jax_doc(_step.STEP_DOC)
QSAState.__doc__ = jax_doc(_step.STATE_DOC)
StepMetadata.__doc__ = jax_doc(_step.METADATA_DOC)
