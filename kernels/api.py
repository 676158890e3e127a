"""The public functions' declarations (:class:`~.stage.Stage`), in the order of docs/api.md.

Both adapters build their public functions from these (:func:`define`), so
the two APIs cannot drift apart: one declaration per function, beside its
plan in its stage's module (``@stage(...)`` on ``plan_<function>``).  Their
types, for a type checker, are the Protocol of :mod:`.functions`, which
scripts/generate_functions.py writes from the same signatures
(:func:`public_signature`, :func:`overloads`).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from .attention import plan_sparse_paged_attention
from .compress import plan_compress_groups, plan_store_cache_rows
from .expand import plan_expand_block_indices
from .functions import PublicFunctions
from .merge import plan_merge_attention_states
from .rope_cache import plan_rope_reshape_and_cache
from .score import plan_mqa_paged_scores
from .select import plan_select_paged_tokens
from .stage import Stage, Variant, make_function
from .step import FUNCTION as STEP, METADATA_FIELDS, SCALE_FIELDS, STATE_FIELDS, plan_qsa_attention_step
from .topk import plan_topk_blocks

__all__ = ["FUNCTIONS", "STAGES", "define", "overloads", "plan_qsa_attention_step", "public_signature"]

#: The per-stage public functions (the composed step, whose arguments are
#: containers, is :data:`plan_qsa_attention_step`).
STAGES = (plan_rope_reshape_and_cache, plan_compress_groups, plan_store_cache_rows, plan_mqa_paged_scores,
          plan_topk_blocks, plan_expand_block_indices, plan_select_paged_tokens, plan_sparse_paged_attention,
          plan_merge_attention_states)

#: Every public function, the composed step last (the torch adapter registers
#: one custom op per variant of each, ``Stage.variants``, at import).
FUNCTIONS = STAGES + (plan_qsa_attention_step,)


def _result_type(stage: Stage, variant: Variant) -> str:
    if stage.name == STEP:  # the four caches come back as one QSAState
        names = [n for n in variant.results if n not in STATE_FIELDS]
        kinds = ["Array", "QSAState"] + ["Array"] * (len(names) - 1)
    else:
        kinds = ["Array"] * len(variant.results)
    return kinds[0] if len(kinds) == 1 else f"tuple[{', '.join(kinds)}]"


def _returns(stage: Stage, variants) -> str:
    return " | ".join(dict.fromkeys(_result_type(stage, v) for v in variants))


def public_signature(stage: Stage) -> inspect.Signature:
    """The public function's signature: the declared one (:meth:`Stage.signature`; the step takes
    its state and metadata containers, ``QSAState`` and ``StepMetadata``, in place of their fields),
    returning any of its variants' results (``Array``, ``tuple[Array, Array]``, ...)."""
    parameters = list(stage.signature().parameters.values())
    if stage.name == STEP:
        containers = {STATE_FIELDS[0]: ("state", "QSAState"), METADATA_FIELDS[0]: ("metadata", "StepMetadata")}
        folded = set(STATE_FIELDS + SCALE_FIELDS + METADATA_FIELDS) - containers.keys()
        parameters = [p.replace(name=containers[p.name][0], annotation=containers[p.name][1], default=p.empty)
                      if p.name in containers else p for p in parameters if p.name not in folded]
    return inspect.Signature(parameters, return_annotation=_returns(stage, stage.variants))


def overloads(stage: Stage) -> list[inspect.Signature]:
    """The ``@overload`` signatures of a function whose bool options add results (none for the others):
    one per variant (``Literal`` on each such option), then, with several options, each a ``bool``
    with the others at their defaults, then all of them ``bool``.  Defaults are ``...`` (a stub's)."""
    public = public_signature(stage)
    selectors = [name for name, _ in stage.variants[0].selected]
    defaults = {name: public.parameters[name].default for name in selectors}

    def overload(annotations: dict[str, str], variants) -> inspect.Signature:
        parameters = []
        for p in public.parameters.values():
            if p.name in annotations:  # no default only for a keyword-only Literal other than the default's
                annotation = annotations[p.name]
                keeps = annotation in ("bool", f"Literal[{defaults[p.name]}]") or p.kind is not p.KEYWORD_ONLY
                p = p.replace(annotation=annotation, default=... if keeps else p.empty)
            parameters.append(p)
        return inspect.Signature(parameters, return_annotation=_returns(stage, variants))

    if not selectors:
        return []
    signatures = [overload({name: f"Literal[{value}]" for name, value in v.selected}, [v]) for v in stage.variants]
    if len(selectors) > 1:  # one option a bool, the others at their defaults
        signatures += [overload({n: "bool" if n == name else f"Literal[{defaults[n]}]" for n in selectors},
                                [v for v in stage.variants
                                 if all(value == defaults[n] for n, value in v.selected if n != name)])
                       for name in selectors]
    return signatures + [overload(dict.fromkeys(selectors, "bool"), stage.variants)]


def define(framework: str, module: str, call: Callable[[Stage, dict], Any], step_call: Callable[[Stage, dict], Any],
           plan_seam: Callable[[Stage], Callable[..., Any]]) -> PublicFunctions[Any, Any, Any, Any]:
    """An adapter's public functions, in :data:`FUNCTIONS`' order: a real function per declaration, with
    its :func:`public_signature`, ``framework``'s docstring and ``__module__`` ``module`` (the adapter,
    as ``help()`` names it), handing its arguments by name to ``call(stage, arguments)`` (the composed
    step: ``step_call``), and but for the step ``.plan = plan_seam(stage)``.  The adapter types the
    result as :class:`.functions.PublicFunctions` of its own array and container types."""
    functions = {}
    for stage in FUNCTIONS:
        step = stage.name == STEP
        function = make_function(stage, step_call if step else call, framework=framework, module=module,
                                 signature=public_signature(stage))
        if not step:
            function.plan = plan_seam(stage)
        functions[stage.name] = function
    return PublicFunctions(**functions)  # by name: a stale kernels/functions.py fails here
