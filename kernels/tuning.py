"""Tuning knobs of every stage: frozen values, part of each plan's memo key.

A plan reads its stage's knobs from a frozen dataclass passed to it (the
``tuning`` / ``topk_tuning`` keywords of the plan functions).  Callers never
pass them: the memo wrapper (:mod:`.memo`) fills in :func:`current` values
*before* the memo lookup, so a plan memoised under one tuning is never
reused under another, and nothing needs clearing after a sweep::

    from qsa_kernels import tuning

    with tuning.override(attention=tuning.AttentionTuning(tile_bytes=16 * 1024)):
        out = qsa_torch.sparse_paged_attention(...)   # planned with 16 KB tiles

The defaults are the tables measured on the H200 (below).  ``override`` is
context-local (a :class:`contextvars.ContextVar`): threads and asyncio tasks
see their own.  JAX plans when it traces: a function already traced by
``jax.jit`` keeps the plan of its first trace, so jit a fresh function inside
the ``with`` block.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Iterator

from .validate import POSITIVE_INT

__all__ = ["AttentionTuning", "CompressTuning", "RopeCacheTuning", "SelectTuning", "TopkTuning",
           "Tuning", "current", "override"]


def _tuning_value(cls):
    """A frozen dataclass whose hash is computed once: tuning values are hashed on
    every plan lookup (they are part of the memo key)."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    field_hash = cls.__hash__

    def __hash__(self):
        try:
            return self.__dict__["_hash"]
        except KeyError:
            value = field_hash(self)
            object.__setattr__(self, "_hash", value)
            return value

    cls.__hash__ = __hash__
    return cls


def _positive_int(owner: str, name: str, value, optional: bool = False) -> None:
    """The plans' own positive-int rule (and message), for a tuning field."""
    kind = POSITIVE_INT.or_none() if optional else POSITIVE_INT
    kind.canonical(owner, name, value)


@_tuning_value
class AttentionTuning:
    """Stage 4 (``sparse_paged_attention``) launch configuration.

    Programs = R x KH (rows x KV heads).  Splits: ``target_programs //
    programs``, a power of two capped at the number of tiles, so that a
    decode batch too small to fill the H200's 132 SMs still puts ~2 programs
    on each; no split (and no merge pass) once programs > 132.

    ``launch_table`` rows are ``(most programs or None, K/V tile bytes,
    warps, stages)``; the first row whose bound holds applies.  Swept on the
    H200 (CUDA-graph replay, 24 Q / 2 KV heads x d256, bf16, W = 2051;
    ``benchmarks/bench_sparse_attention.py --sweep``), best of 18
    configurations per shape:

    | programs  | K/V tile | warps | stages | measured on         | us (table before) |
    |-----------|----------|-------|--------|---------------------|-------------------|
    | <= 132    | 32 KB    | 8     | 3      | decode 1 / 64 rows  | 9.5 / 93 (10.9 / 101)  |
    | 133-4095  | 16 KB    | 2     | 3      | decode 256 rows     | 285 (386)         |
    | >= 4096   | 32 KB    | 2     | 2      | prefill 2048 rows   | 1206 (2193)       |

    (32 KB of K or V is BLOCK_N = 64 tokens at D = 256.)  Many small
    programs favour 2 warps: more of them fit on an SM, so more gathers are
    in flight.

    ``tile_bytes`` forces the tile of every row (sweeps); ``num_splits``
    forces the split count (tests), capped so that no split is empty.
    """

    target_programs: int = 264
    launch_table: tuple = (
        (132, 32 * 1024, 8, 3),
        (4095, 16 * 1024, 2, 3),
        (None, 32 * 1024, 2, 2),
    )
    tile_bytes: int | None = None
    num_splits: int | None = None
    #: float32 elements of one merge chunk (SPLIT_CHUNK x D): 32 registers per thread.
    merge_chunk_elements: int = 4096
    #: fp8 caches: tiles sized as for 16-bit ones (widened to q's dtype in
    #: registers, registers bound them).  Not yet swept on the H200; compiled
    #: for sm_90 offline: launch_table's prefill row spills with fp8 (16
    #: registers), so fp8 takes 16 KB tiles there (255 registers, no spill).
    fp8_launch_table: tuple = (
        (132, 32 * 1024, 8, 3),
        (4095, 16 * 1024, 2, 3),
        (None, 16 * 1024, 2, 2),
    )

    def __post_init__(self):
        _positive_int("AttentionTuning", "target_programs", self.target_programs)
        _positive_int("AttentionTuning", "tile_bytes", self.tile_bytes, optional=True)
        _positive_int("AttentionTuning", "num_splits", self.num_splits, optional=True)
        _positive_int("AttentionTuning", "merge_chunk_elements", self.merge_chunk_elements)
        for name in ("launch_table", "fp8_launch_table"):
            table = tuple(tuple(row) for row in getattr(self, name))
            object.__setattr__(self, name, table)
            if not table or table[-1][0] is not None:
                raise ValueError(f"AttentionTuning: {name} must end with a row whose bound is None, "
                                 f"got {table!r}")


@_tuning_value
class TopkTuning:
    """Stage 3b (``topk_blocks``, and the top-k of ``select_paged_tokens``).

    Three paths (:mod:`.topk`): the register path (one launch, one program
    per row holding the whole row in registers), the row path (one launch,
    one program per row streaming its row) and the sliced path (four
    launches over ``(row, slice)`` programs); ``path`` picks one or lets
    the static shape decide.
    """

    #: Columns a sliced-path program handles per step (raised to G where needed).
    tile: int = 4096
    #: Candidate buffer per row: at least this many, or 4k.
    min_candidates: int = 4096
    #: Enough (row, slice) programs to fill an H200 (132 SMs) about twice.
    target_programs: int = 256
    max_slices: int = 64
    max_groups: int = 4096
    #: Bits per radix pass (a divisor of 32, at most 8).
    radix_bits: int = 8
    #: Top-k path: "auto" (by shape, see ``topk.topk_path``), "register",
    #: "row" or "sliced" (forced; benchmarks compare them; "register" holds
    #: at most ``topk.REGISTER_MAX_TILE`` columns).
    path: str = "auto"
    #: The register path for rows at most this wide, whatever the rows.  Its
    #: cost is the radix passes over every key of the row, about 75
    #: instructions a key a pass on sm_90 (``tl.histogram`` of 8-bit
    #: digits): estimated from the sm_90 code (instructions x warps per
    #: scheduler; not measured yet), 1 x 2048 ~ 3-4 us of issue (row path:
    #: 14.1 us), 1 x 8192 ~ 12 us (19.5), 1 x 16384 ~ 25 us (sliced: ~24),
    #: 2048 x 2048 ~ 44 us (113), 2048 x 8192 ~ 180 us (179).
    register_max_columns: int = 8192
    #: A register-path program's keys per thread (warps = row tile / 32 /
    #: this, at most ``register_max_warps``; past that the keys per thread grow).
    register_keys_per_thread: int = 16
    register_max_warps: int = 32
    #: The register path's select: "histogram" (``register_radix_bits``-bit
    #: digits by ``tl.histogram``) or "count" (2-bit digits, counting the
    #: keys at or above each of 3 thresholds: about half the instructions a
    #: key on sm_90, 4x the passes; see ``topk._kth_largest_counted``).
    #: Which wins is for ``bench_topk.py --register-sweep`` to say.
    register_select: str = "histogram"
    #: Bits per radix pass of the register path's histograms (a divisor of 32, at most 8;
    #: ``tl.histogram`` costs about the same per bit at 4 and 8 bits, and 8
    #: makes half the passes, each with its block-wide reductions).
    register_radix_bits: int = 8
    #: One program per row for rows at most this wide, or for any width once
    #: there are this many rows (enough programs to fill an H200 without slicing).
    #: Measured on the H200 (benchmarks/results/topk.json, k = 512): with 1-8
    #: rows the row path wins to 8192 columns (19.5 vs 24.1 us) and loses from
    #: 32768 (39.5 vs 24.4 us: one program streams the whole row); from 64 rows
    #: it wins at every width.
    row_max_columns: int = 16384
    row_min_rows: int = 32
    #: A row program's warps, and the keys each of its threads handles per
    #: step: of the group maxima (a load and a max), and of the other passes
    #: (prefix sums and scattered stores: ~7 registers a key on sm_90).  From
    #: ``row_many_rows`` rows on, warps and the other passes' keys are halved,
    #: so that several programs share an SM.  (Powers of two: they make tiles.)
    row_warps: int = 16
    row_many_rows: int = 264
    row_group_keys_per_thread: int = 32
    row_keys_per_thread: int = 16
    #: Radix passes (of ``radix_bits``) of the row path's group-maximum bound.
    bound_passes: int = 2

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if field.name not in ("path", "register_select"):
                _positive_int("TopkTuning", field.name, getattr(self, field.name))
        for name in ("radix_bits", "register_radix_bits"):
            value = getattr(self, name)
            if 32 % value:
                raise ValueError(f"TopkTuning: {name} must divide 32, got {value!r}")
            if value > 8:  # a digit's counts (up to 2**bits) are packed in 16 bits
                raise ValueError(f"TopkTuning: {name} must be at most 8, got {value!r}")
        if not isinstance(self.register_select, str) or self.register_select not in REGISTER_SELECTS:
            raise ValueError(f"TopkTuning: register_select must be one of "
                             f"{', '.join(map(repr, REGISTER_SELECTS))}, got {self.register_select!r}")
        if not isinstance(self.path, str) or self.path not in TOPK_PATHS:
            raise ValueError(f"TopkTuning: path must be one of {', '.join(map(repr, TOPK_PATHS))}, "
                             f"got {self.path!r}")
        for name in ("row_warps", "row_group_keys_per_thread", "row_keys_per_thread",
                     "register_keys_per_thread", "register_max_warps"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"TopkTuning: {name} must be a power of two, got {value!r}")
        for name in ("row_warps", "register_max_warps"):
            if getattr(self, name) > 32:
                raise ValueError(f"TopkTuning: {name} must be at most 32, got {getattr(self, name)!r}")
        if self.bound_passes > 32 // self.radix_bits:
            raise ValueError(f"TopkTuning: bound_passes must be at most 32 // radix_bits = "
                             f"{32 // self.radix_bits}, got {self.bound_passes!r}")


#: The values of ``TopkTuning.path``.
TOPK_PATHS = ("auto", "register", "row", "sliced")
#: The values of ``TopkTuning.register_select``.
REGISTER_SELECTS = ("histogram", "count")


@_tuning_value
class SelectTuning:
    """Stage 3 composition (``select_paged_tokens``)."""

    #: Logits of one chunk of rows stay under this many bytes (rows are processed in chunks).
    logits_workspace_bytes: int = 128 * 1024 * 1024

    def __post_init__(self):
        _positive_int("SelectTuning", "logits_workspace_bytes", self.logits_workspace_bytes)


@_tuning_value
class RopeCacheTuning:
    """Stage 1 (``rope_reshape_and_cache``).

    Query heads per program: a ``[BLOCK_H, D]`` tile of about
    ``tile_elements``.  Swept on the H200 (``benchmarks/tune_rope_cache.py``,
    T = 2048 and 8192, bf16): small tiles on 2 warps keep the most rows in
    flight: 24 Q / 2 KV x d256 reaches 85-87% of 4.3 TB/s, 32 Q / 8 KV x
    d128 83-85% (4096 on 4 warps: 73-76% and 83-86%).
    """

    tile_elements: int = 1024
    num_warps: int = 2

    def __post_init__(self):
        _positive_int("RopeCacheTuning", "tile_elements", self.tile_elements)
        _positive_int("RopeCacheTuning", "num_warps", self.num_warps)


@_tuning_value
class CompressTuning:
    """Stage 2 (``compress_groups`` and ``store_cache_rows``).

    Elements per program: with 4 warps each thread moves 8 elements (one
    16-byte load of bf16 per group member), and a decode batch of 256 rows
    still spreads over 32-64 programs.
    """

    tile_elements: int = 1024

    def __post_init__(self):
        _positive_int("CompressTuning", "tile_elements", self.tile_elements)


@_tuning_value
class Tuning:
    """The knobs of every stage (the defaults: the measured tables)."""

    attention: AttentionTuning = AttentionTuning()
    topk: TopkTuning = TopkTuning()
    select: SelectTuning = SelectTuning()
    rope_cache: RopeCacheTuning = RopeCacheTuning()
    compress: CompressTuning = CompressTuning()


#: Stage name (a :class:`Tuning` field) -> its tuning class.
STAGES = {"attention": AttentionTuning, "topk": TopkTuning, "select": SelectTuning,
          "rope_cache": RopeCacheTuning, "compress": CompressTuning}
#: Tuning class name -> stage: the memo wrapper fills plan parameters so annotated.
STAGE_OF = {cls.__name__: stage for stage, cls in STAGES.items()}

#: The measured tables (what plans use outside any ``override``).
DEFAULT = Tuning()
_CURRENT: contextvars.ContextVar[Tuning] = contextvars.ContextVar("qsa_tuning", default=DEFAULT)


def current() -> Tuning:
    """The tuning plans are made with here and now (the defaults unless overridden)."""
    return _CURRENT.get()


@contextlib.contextmanager
def override(**stages) -> Iterator[Tuning]:
    """Plan with other knobs for some stages inside the ``with`` block.

    Keywords are :class:`Tuning` fields (``attention``, ``topk``, ``select``,
    ``rope_cache``, ``compress``), each a value of that stage's class;
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
