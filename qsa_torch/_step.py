"""The composed step's containers for torch, and its call (the composition is in qsa_kernels.step)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch

from qsa_kernels import step as _step
from qsa_kernels.docs import torch_doc
from qsa_kernels.stage import Stage

from . import _binding


@dataclasses.dataclass(frozen=True)
class QSAState(_step.StateFields):
    _zeros = staticmethod(lambda shape, dtype, device: torch.zeros(shape, dtype=dtype, device=device))
    _scale = staticmethod(lambda value, device: torch.full((), value, dtype=torch.float32, device=device))


@dataclasses.dataclass(frozen=True)
class StepMetadata(_step.MetadataFields):
    _to_device = staticmethod(lambda array, device: torch.tensor(array, device=device))  # a copy (see from_host)


def step_call(stage: Stage, arguments: Mapping[str, Any]) -> tuple:
    """``qsa_attention_step``: the containers flattened into the plan's arrays, the results rebuilt."""
    flat = _step.state_arguments(dict(arguments), QSAState, StepMetadata)
    return _step.public_results(_binding.call(stage, flat), arguments["state"])


QSAState.__doc__ = torch_doc(_step.STATE_DOC)
StepMetadata.__doc__ = torch_doc(_step.METADATA_DOC)
