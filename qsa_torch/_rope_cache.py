"""Stage 1 for torch: RoPE + paged KV-cache write."""

from __future__ import annotations

from qsa_kernels.docs import torch_doc
from qsa_kernels.rope_cache import DOC, plan_rope_reshape_and_cache

from . import _launch


def rope_reshape_and_cache(q, k, v, key_cache, value_cache, slot_mapping, positions, cos_sin, *,
                           is_neox, k_scale=None, v_scale=None, offsets=None,
                           swa_slot_mapping=None, return_zeros=False):
    arrays = dict(q=q, k=k, v=v, key_cache=key_cache, value_cache=value_cache,
                  slot_mapping=slot_mapping, positions=positions, cos_sin=cos_sin,
                  k_scale=k_scale, v_scale=v_scale, offsets=offsets,
                  swa_slot_mapping=swa_slot_mapping)
    infos = _launch.metadata("rope_reshape_and_cache", arrays)
    program = plan_rope_reshape_and_cache(**infos, is_neox=is_neox, return_zeros=return_zeros)
    return _launch.run(program, arrays, q.device)


rope_reshape_and_cache.__doc__ = torch_doc(DOC)
