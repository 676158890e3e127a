"""The public functions' declarations (:class:`~.stage.Stage`), in the order of docs/api.md.

Both adapters generate their public functions from these, so the two APIs
cannot drift apart: one declaration per function, beside its plan in its
stage's module (``@stage(...)`` on ``plan_<function>``).
"""

from __future__ import annotations

from .attention import plan_sparse_paged_attention
from .compress import plan_compress_groups, plan_store_cache_rows
from .expand import plan_expand_block_indices
from .merge import plan_merge_attention_states
from .rope_cache import plan_rope_reshape_and_cache
from .score import plan_mqa_paged_scores
from .select import plan_select_paged_tokens
from .step import plan_qsa_attention_step
from .topk import plan_topk_blocks

__all__ = ["FUNCTIONS", "STAGES", "plan_qsa_attention_step"]

#: The per-stage public functions (the composed step, whose arguments are
#: containers, is :data:`plan_qsa_attention_step`).
STAGES = (plan_rope_reshape_and_cache, plan_compress_groups, plan_store_cache_rows, plan_mqa_paged_scores,
          plan_topk_blocks, plan_expand_block_indices, plan_select_paged_tokens, plan_sparse_paged_attention,
          plan_merge_attention_states)

#: Every public function, the composed step last (the torch adapter registers
#: one custom op per variant of each, ``Stage.variants``, at import).
FUNCTIONS = STAGES + (plan_qsa_attention_step,)
