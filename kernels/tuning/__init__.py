"""Tuning knobs of every stage: frozen values, part of each plan's memo key.

A plan reads its stage's knobs from a frozen dataclass passed to it (the
``tuning`` / ``topk_tuning`` keywords of the plan functions).  Callers never
pass them: the stage's memo (:class:`..stage.Stage`) fills in :func:`current`
values *before* the memo lookup, so a plan memoised under one tuning is never
reused under another, and nothing needs clearing after a sweep::

    from qsa_kernels import tuning

    with tuning.override(attention=tuning.AttentionTuning(tile_bytes=16 * 1024)):
        out = qsa_torch.sparse_paged_attention(...)   # planned with 16 KB tiles

One module per stage (:mod:`.attention`, :mod:`.topk`, :mod:`.select`,
:mod:`.stages`); each default keeps a one-line reason, the figures are in
docs/performance.md and the sweeps behind them in docs/design.md, "Measured
tuning values".  The defaults were timed with Triton 3.6
(:data:`TIMED_TRITON`, the GPU image's).  Where one of those values makes
ptxas spill registers on sm_90 under a newer admitted Triton, that Triton's
defaults replace it with the nearest spill-free value (:data:`NEWER_TRITON`,
chosen once at import from ``triton.__version__``; found by
tests/test_compile_sm90.py on the CPU, never timed on a GPU).  ``override`` is
context-local (a :class:`contextvars.ContextVar`): threads and asyncio tasks
see their own.  JAX plans when it traces: a function already traced by
``jax.jit`` keeps the plan of its first trace, so jit a fresh function inside
the ``with`` block.

Fused launches and the separate launches they replace (``SelectTuning.fused``,
``StepTuning.fuse_stages`` / ``fuse_rope``) are kept as pairs on purpose:
the separate launches are the oracle the tests compare the fused ones with.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Iterator

from ._values import (MAX_WARPS, NEWER_TRITON, TIMED_TRITON, TRITON_SERIES, _TIMED, _series_value,
                      _tuning_value)
from .attention import ROW_ADDRESSING_MODES, AttentionTuning
from .select import SelectTuning
from .stages import CompressTuning, RopeCacheTuning, StepTuning
from .topk import TICKETED_BOUNDS, TOPK_PATHS, TopkTuning

__all__ = ["AttentionTuning", "CompressTuning", "RopeCacheTuning", "SelectTuning", "StepTuning", "TopkTuning",
           "Tuning", "current", "defaults", "override"]


@_tuning_value
class Tuning:
    """The knobs of every stage (the defaults: the measured tables)."""

    attention: AttentionTuning = AttentionTuning()
    topk: TopkTuning = TopkTuning()
    select: SelectTuning = SelectTuning()
    rope_cache: RopeCacheTuning = RopeCacheTuning()
    compress: CompressTuning = CompressTuning()
    step: StepTuning = StepTuning()


#: Stage name (a :class:`Tuning` field) -> its tuning class.
STAGES = {"attention": AttentionTuning, "topk": TopkTuning, "select": SelectTuning,
          "rope_cache": RopeCacheTuning, "compress": CompressTuning, "step": StepTuning}


def defaults(series: str = TRITON_SERIES) -> Tuning:
    """The defaults under Triton ``series`` ("3.6", "3.9"...; default: this process's):
    the timed values with that series' :data:`NEWER_TRITON` replacements.  Any series'
    values can be built under any Triton (tests compare plans made with them)."""
    fields: dict[str, dict[str, object]] = {}
    for key in _TIMED:
        owner, name = key.split(".")
        fields.setdefault(owner, {})[name] = _series_value(series, key)
    return Tuning(**{stage: cls(**fields.get(cls.__name__, {})) for stage, cls in STAGES.items()})


for _series, _changes in NEWER_TRITON.items():  # every replacement names a versioned default
    for _key in _changes:
        if _key not in _TIMED:
            raise ValueError(f"NEWER_TRITON[{_series!r}]: {_key!r} is not a versioned default")
        _series_value(_series, _key)

#: The measured tables, with this Triton series' replacements (what plans use outside any ``override``).
DEFAULT = Tuning()
_CURRENT: contextvars.ContextVar[Tuning] = contextvars.ContextVar("qsa_tuning", default=DEFAULT)


def current() -> Tuning:
    """The tuning plans are made with here and now (the defaults unless overridden)."""
    return _CURRENT.get()


@contextlib.contextmanager
def override(**stages) -> Iterator[Tuning]:
    """Plan with other knobs for some stages inside the ``with`` block.

    Keywords are :class:`Tuning` fields (``attention``, ``topk``, ``select``,
    ``rope_cache``, ``compress``, ``step``), each a value of that stage's class;
    stages not named keep their current values.  Nests; yields the tuning
    in force.
    """
    for name, value in stages.items():
        if name not in STAGES:
            raise TypeError(f"tuning.override: unknown stage {name!r} (stages: {', '.join(STAGES)})")
        if not isinstance(value, STAGES[name]):
            raise TypeError(f"tuning.override: {name} must be a {STAGES[name].__name__}, got {type(value).__name__}")
    # No stages: the same value stays in force (and its plans stay memoised).
    token = _CURRENT.set(dataclasses.replace(_CURRENT.get(), **stages) if stages else _CURRENT.get())
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)
