"""The composed step's containers for JAX, and its call (the composition is in qsa_kernels.step)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from qsa_kernels import step as _step
from qsa_kernels.docs import jax_doc
from qsa_kernels.stage import Stage

from . import _binding


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QSAState(_step.StateFields):
    _zeros = staticmethod(lambda shape, dtype, device: jnp.zeros(shape, dtype, device=device))
    _scale = staticmethod(lambda value, device: jnp.full((), value, jnp.float32, device=device))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepMetadata(_step.MetadataFields):
    # A copy: device_put(may_alias=False) was seen aliasing a NumPy array on the CPU.
    _to_device = staticmethod(lambda array, device: jnp.array(array, copy=True, device=device))


def step_call(stage: Stage, arguments: Mapping[str, Any]) -> tuple:
    """``qsa_attention_step``: the containers flattened into the plan's arrays, the results rebuilt."""
    flat = _step.state_arguments(dict(arguments), QSAState, StepMetadata)
    return _step.public_results(_binding.call(stage, flat), arguments["state"])


QSAState.__doc__ = jax_doc(_step.STATE_DOC)
StepMetadata.__doc__ = jax_doc(_step.METADATA_DOC)
