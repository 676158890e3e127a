"""Stage 1: RoPE + paged KV-cache write (torch adapter: binds the shared plans; see qsa_kernels)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the annotations' array types (the same names in both adapters)
    from torch import Tensor as Array, Tensor as ArrayLike

from qsa_kernels.rope_cache import DOC, plan_rope_reshape_and_cache
from qsa_kernels.docs import torch_doc

from . import _launch


def rope_reshape_and_cache(q: ArrayLike, k: ArrayLike, v: ArrayLike, key_cache: ArrayLike,
                           value_cache: ArrayLike, slot_mapping: ArrayLike, positions: ArrayLike,
                           cos_sin: ArrayLike, *, is_neox: bool, k_scale: ArrayLike | None = None,
                           v_scale: ArrayLike | None = None, offsets: ArrayLike | None = None,
                           swa_slot_mapping: ArrayLike | None = None,
                           return_zeros: bool = False) -> tuple[Array, ...]:
    return _launch.call(plan_rope_reshape_and_cache, dict(q=q, k=k, v=v, key_cache=key_cache,
                                                          value_cache=value_cache, slot_mapping=slot_mapping,
                                                          positions=positions, cos_sin=cos_sin,
                                                          is_neox=is_neox, k_scale=k_scale, v_scale=v_scale,
                                                          offsets=offsets, swa_slot_mapping=swa_slot_mapping,
                                                          return_zeros=return_zeros))


rope_reshape_and_cache.__doc__ = torch_doc(DOC)
