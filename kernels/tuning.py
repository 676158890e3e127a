"""Tuning knobs of every stage: frozen values, part of each plan's memo key.

A plan reads its stage's knobs from a frozen dataclass passed to it (the
``tuning`` / ``topk_tuning`` keywords of the plan functions).  Callers never
pass them: the stage's memo (:class:`.stage.Stage`) fills in :func:`current` values
*before* the memo lookup, so a plan memoised under one tuning is never
reused under another, and nothing needs clearing after a sweep::

    from qsa_kernels import tuning

    with tuning.override(attention=tuning.AttentionTuning(tile_bytes=16 * 1024)):
        out = qsa_torch.sparse_paged_attention(...)   # planned with 16 KB tiles

The defaults are the tables measured on the H200 (below) with Triton 3.6
(:data:`TIMED_TRITON`, the GPU image's).  Where one of those values makes
ptxas spill registers on sm_90 under a newer admitted Triton, that Triton's
defaults replace it with the nearest spill-free value (:data:`NEWER_TRITON`,
chosen once at import from ``triton.__version__``; found by
tests/test_compile_sm90.py on the CPU, never timed on a GPU).  ``override`` is
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

import numpy as np
import triton

from .validate import BOOL, POSITIVE_INT

__all__ = ["AttentionTuning", "CompressTuning", "RopeCacheTuning", "SelectTuning", "StepTuning", "TopkTuning",
           "Tuning", "current", "defaults", "override"]

#: The Triton release series the tables were timed on, on the H200 (the GPU image carries only it).
TIMED_TRITON = "3.6"
#: The release series (``major.minor``) of the Triton this process imports.
TRITON_SERIES = ".".join(triton.__version__.split(".")[:2])

#: Defaults of newer Triton series than :data:`TIMED_TRITON`: where a timed
#: value makes ptxas spill registers on sm_90 under that series (the compile
#: check, tests/test_compile_sm90.py, which needs no GPU), the nearest
#: spill-free value.  Chosen by that check alone and never timed on a GPU;
#: docs/design.md, "Measured tuning values", says which entries these are
#: and why.  ``series -> {"Class.field": value}``; for a launch table, the
#: value is ``{row index: row}`` (each row keeps its bound).  A series not
#: listed (3.6, 3.7) takes the timed values.
NEWER_TRITON: dict[str, dict[str, object]] = {
    "3.8": {
        # prefill (>= 4096 programs): 2 warps spill 72 (255 registers); 4 warps: 212, no spill.
        "AttentionTuning.launch_table": {5: (None, 32 * 1024, 4, 2, 264)},
        # The sliced top-k's 4096-column place pass: 128 registers, 2 spills; 2048 columns: 80.
        "TopkTuning.tile": 2048,
        # The row top-k at 16 warps, k = 2048: 8192-column tiles spill 2 (128 registers); 4096: 106.
        "TopkTuning.row_max_tile": 4096,
    },
    "3.9": {
        # decode 65-132 and 133-4095 programs: 3 stages spill 16-18 (255 registers); 2 stages: 213.
        # prefill: 2 warps spill 68 (2 stages) or 108 (1 stage); 4 warps: 212, no spill.
        "AttentionTuning.launch_table": {3: (132, 16 * 1024, 2, 2, 512), 4: (4095, 16 * 1024, 2, 2, 264),
                                         5: (None, 32 * 1024, 4, 2, 264)},
        # The row top-k at 16 warps: 8192-column tiles spill 10 (128 registers); 4096: 107-119.
        "TopkTuning.row_max_tile": 4096,
        # The ticketed top-k's compaction by 16-column chunks: ptxas holds it to 64 registers and
        # spills 2-6 (1 x 8192, 1 x 32768); 128-512 columns spill 2-4; 2048: 101-128, no spill.
        "TopkTuning.ticketed_chunk": 2048,
    },
}

#: ``"Class.field" -> its timed value`` for every default that a series may replace.
_TIMED: dict[str, object] = {}


def _series_value(series: str, key: str):
    """The default ``key`` ("Class.field") has under Triton ``series``."""
    timed = _TIMED[key]
    change = NEWER_TRITON.get(series, {}).get(key)
    if change is None:
        return timed
    if isinstance(change, dict):  # a launch table's rows, by index
        rows = list(timed)
        for index, row in change.items():
            if not 0 <= index < len(rows) or row[0] != rows[index][0]:
                raise ValueError(f"NEWER_TRITON[{series!r}][{key!r}] row {index}: {row!r} does not replace "
                                 f"a row of the timed table with the same bound")
            rows[index] = row
        return tuple(rows)
    return change


def _versioned(key: str, timed):
    """A field default: ``timed`` (the Triton 3.6 value), or this Triton series' replacement."""
    _TIMED[key] = timed
    return _series_value(TRITON_SERIES, key)


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


#: The most warps a program may have (1024 threads on NVIDIA GPUs).
MAX_WARPS = 32


def _power_of_two(owner: str, name: str, value, optional: bool = False, most: int | None = None) -> None:
    """A positive int that is a power of two (a ``tl.arange`` size, a warp count: what the
    kernels need), at most ``most``: refused here rather than at launch, naming the knob."""
    _positive_int(owner, name, value, optional)
    if value is None:
        return
    if value & (value - 1):
        raise ValueError(f"{owner}: {name} must be a power of two, got {value!r}")
    if most is not None and value > most:
        raise ValueError(f"{owner}: {name} must be at most {most}, got {value!r}")


def _table_rows(owner: str, name: str, table) -> tuple:
    """A launch table as a tuple of row tuples (rows that are not sequences: the table's error)."""
    try:
        return tuple(tuple(row) for row in table)
    except TypeError:
        raise ValueError(f"{owner}: {name} must be a sequence of rows (most programs or None, tile bytes, "
                         f"warps, stages, target programs), got {table!r}") from None


#: A launch table row's fields: (name, what it must be, whether it is, given an int that is not a bool).
_ROW_FIELDS = (
    ("most programs", "a positive int or None", lambda v: v is None or v >= 1),
    ("tile bytes", "a power of two", lambda v: v is not None and v >= 1 and not v & (v - 1)),
    ("warps", f"a power of two up to {MAX_WARPS}", lambda v: v is not None and 1 <= v <= MAX_WARPS and not v & (v - 1)),
    ("stages", "a positive int", lambda v: v is not None and v >= 1),
    ("target programs", "a positive int", lambda v: v is not None and v >= 1),
)


def _launch_rows(owner: str, name: str, table: tuple) -> None:
    """Every value of a launch table's (5-field) rows is what the plan needs: typed ints."""
    for i, row in enumerate(table):
        for (field, expected, accepts), value in zip(_ROW_FIELDS, row):
            typed = value is None or (isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)))
            if not typed or not accepts(value):
                raise ValueError(f"{owner}: {name} row {i} {field} must be {expected}, got {value!r} in {row!r}")


@_tuning_value
class AttentionTuning:
    """Stage 4 (``sparse_paged_attention``) launch configuration.

    Programs = R x KH (rows x KV heads).  ``launch_table`` rows are ``(most
    programs or None, K/V tile bytes, warps, stages, target programs)``; the
    first row whose bound holds applies.  Splits: ``target programs //
    programs``, a power of two capped at the number of tiles (and re-derived
    so that no split is empty), so that a decode batch too small to fill the
    H200's 132 SMs still fills it; no split (and no merge pass) once
    programs > 132 (their rows' targets are below twice their programs).
    Many small programs favour 2 warps: more of them fit on an SM, so more
    gathers are in flight.  Each row was measured on the H200 with Triton
    3.6 (``bench_sparse_attention.py --sweep`` and ``--sweep --splits``:
    benchmarks/results/sparse_attention_sweep.json,
    sparse_attention_splits_{8,16,64}.json); the figures are in
    docs/design.md, "Measured tuning values".  Newer Triton series replace
    the rows that spill registers there (:data:`NEWER_TRITON`: not timed).

    ``tile_bytes`` forces the tile of every row (sweeps); ``num_splits``
    forces the split count (tests), capped so that no split is empty.
    """

    launch_table: tuple = _versioned("AttentionTuning.launch_table", (
        (4, 32 * 1024, 8, 3, 264),
        (16, 16 * 1024, 4, 3, 512),
        (64, 32 * 1024, 8, 3, 264),
        (132, 16 * 1024, 2, 3, 512),
        (4095, 16 * 1024, 2, 3, 264),
        (None, 32 * 1024, 2, 2, 264),
    ))
    tile_bytes: int | None = None
    num_splits: int | None = None
    #: float32 elements of one merge launch's chunk (SPLIT_CHUNK x D): 32 registers per thread.
    merge_chunk_elements: int = 4096
    #: fp8 caches: tiles sized as for 16-bit ones (BLOCK_N from the tile bytes
    #: at 2 bytes an element: fp8 tiles move half the bytes).  Swept on the H200
    #: (``--sweep --quick --fp8``, benchmarks/results/sparse_attention_fp8_sweep.json):
    #: decode 64 x 128K 88.6 us (bf16 99.3), decode 256 279 us (bf16 294); the
    #: candidates' sm_90 registers and shared memory: docs/design.md, "Measured tuning values".
    fp8_launch_table: tuple = _versioned("AttentionTuning.fp8_launch_table", (
        (132, 32 * 1024, 4, 2, 264),
        (4095, 16 * 1024, 2, 3, 264),
        (None, 16 * 1024, 2, 2, 264),
    ))
    #: How a gathered K/V row's address is computed, for 16-bit and for fp8
    #: caches.  "slot" (where each page is a run of rows and the cache has
    #: < 2**31 rows; else "page"): the token's int32 slot (page x P + offset)
    #: times the row stride, one widening multiply per row, shared by K and V
    #: when their row strides agree.  "page" (the first release's): page x
    #: block stride + offset x row stride in int64, for K and V apart.  The
    #: same addresses either way.  16-bit caches keep "page" until measured:
    #: "slot" takes 15 more registers at decode 256 (5 -> 4 programs per SM).
    row_addressing: str = "page"
    fp8_row_addressing: str = "slot"
    #: Several splits merged in their own launch (``sparse_attention_fused_merge_kernel``:
    #: after the splits of a (row, KV head), merging programs that wait for them by
    #: ticket) instead of a merge launch, for at most ``fused_merge_max_programs``
    #: programs (rows x KV heads: decode batches of up to 8 requests at 2 KV heads), so
    #: that a decode step is three launches.  ``fused_merge`` True / False forces either
    #: path (benchmarks time both), None takes it by that bound; the split count, hence
    #: the bits, are the same.  Off by default: on the H200 (``bench_sparse_attention.py
    #: --merge-paths``, 128K, CUDA graphs) it took 12.5 us against the merge launch's 9.5
    #: at 1 row and 20.6 against 18.1 at 8 (fp8 11.9 / 9.7 and 21.9 / 21.1); the first
    #: in-launch merge, one program merging a KV head's whole group, was 16.4 against 9.2
    #: (docs/design.md, "Retired variants").
    fused_merge: bool | None = False
    fused_merge_max_programs: int = 16
    #: Query heads each merging program merges (a power of two): GROUP / this programs a (row, KV head).
    fused_merge_heads: int = 1

    def __post_init__(self):
        _positive_int("AttentionTuning", "tile_bytes", self.tile_bytes, optional=True)
        _power_of_two("AttentionTuning", "tile_bytes", self.tile_bytes, optional=True)  # BLOCK_N = tile / (2 D)
        _positive_int("AttentionTuning", "num_splits", self.num_splits, optional=True)
        _positive_int("AttentionTuning", "merge_chunk_elements", self.merge_chunk_elements)
        if self.fused_merge is not None:
            object.__setattr__(self, "fused_merge", BOOL.or_none().canonical("AttentionTuning", "fused_merge",
                                                                              self.fused_merge))
        _positive_int("AttentionTuning", "fused_merge_max_programs", self.fused_merge_max_programs)
        _positive_int("AttentionTuning", "fused_merge_heads", self.fused_merge_heads)
        _power_of_two("AttentionTuning", "fused_merge_heads", self.fused_merge_heads)
        for name in ("row_addressing", "fp8_row_addressing"):
            if getattr(self, name) not in ROW_ADDRESSING_MODES:
                raise ValueError(f"AttentionTuning: {name} must be one of "
                                 f"{', '.join(map(repr, ROW_ADDRESSING_MODES))}, got {getattr(self, name)!r}")
        for name in ("launch_table", "fp8_launch_table"):
            table = _table_rows("AttentionTuning", name, getattr(self, name))
            object.__setattr__(self, name, table)
            if any(len(row) != 5 for row in table):
                raise ValueError(f"AttentionTuning: {name} rows must be (most programs or None, tile bytes, "
                                 f"warps, stages, target programs), got {table!r}")
            if not table or table[-1][0] is not None:
                raise ValueError(f"AttentionTuning: {name} must end with a row whose bound is None, "
                                 f"got {table!r}")
            _launch_rows("AttentionTuning", name, table)


@_tuning_value
class TopkTuning:
    """Stage 3b (``topk_blocks``, and the top-k of ``select_paged_tokens``).

    Four paths (:mod:`.topk`): the register path (one launch, one program
    per row holding the whole row in registers), the row path (one launch,
    one program per row streaming its row), the ticketed path (one launch
    of several programs per row, which take their roles by ticket) and the
    sliced path (four launches over ``(row, slice)`` programs); ``path``
    picks one or lets the static shape decide.
    """

    #: Columns a sliced-path program handles per step (raised to G where needed;
    #: 2048 under Triton 3.8, where 4096 spills: :data:`NEWER_TRITON`).
    tile: int = _versioned("TopkTuning.tile", 4096)
    #: Candidate buffer per row: at least this many, or 4k.
    min_candidates: int = 4096
    #: Enough (row, slice) programs to fill an H200 (132 SMs) about twice.
    target_programs: int = 256
    max_slices: int = 64
    max_groups: int = 4096
    #: Bits per radix pass (a divisor of 32, at most 8).
    radix_bits: int = 8
    #: Top-k path: "auto" (by shape, see ``topk.topk_path``), "register",
    #: "row", "ticketed" or "sliced" (forced; benchmarks compare them;
    #: "register" holds at most ``topk.REGISTER_MAX_TILE`` columns).
    path: str = "auto"
    #: The register path for rows at most this wide, whatever the rows: on
    #: the H200 it wins at 2048 columns (2048 rows: 69.9 vs the row path's
    #: 113.1 us) and loses from 8192 (309.6 vs 179.1; benchmarks/results/topk.json).
    register_max_columns: int = 2048
    #: A register-path program's keys per thread (warps = row tile / 32 /
    #: this, at most ``register_max_warps``; past that the keys per thread grow).
    register_keys_per_thread: int = 8
    register_max_warps: int = 32
    #: Bits per radix pass of the register path's histograms (a divisor of 32,
    #: at most 8).  16 bins beat 256 though they take twice the passes: with
    #: 8 keys a thread, 1 / 64 / 2048 x 2048 took 6.8 / 8.6 / 61.9 us against
    #: 16 keys and 8 bits' 8.6 / 10.8 / 69.8 (an H100, bench_topk.py --register-sweep).
    register_radix_bits: int = 4
    #: One program per row for rows at most this wide, or for any width once
    #: there are this many rows (enough programs to fill an H200 without
    #: slicing); else the ticketed path.  Row / ticketed us on the H200
    #: (benchmarks/results/topk.json): 1 x 8192 19.4 / 16.0, 1 x 32768 39.6 /
    #: 16.2, but 64 x 32768 41.5 / 45.7; 4096 (unmeasured) stays with the row path.
    #: On an H100 (2026-12-06, docs/performance.md), row / ticketed, streamed:
    #: 64 x 32768 31.7 / 24.2, 64 x 131072 88.6 / 66.5, but 80 x 32768 31.2 /
    #: 34.1, 96 x 131072 92.3 / 119.7 us: 65 (40 before streaming).
    row_max_columns: int = 4096
    row_min_rows: int = 65
    #: A row program's warps, and the keys each of its threads handles per
    #: step: of the group maxima (a load and a max), and of the other passes
    #: (prefix sums and scattered stores).  From ``row_many_rows`` rows on,
    #: warps are halved, so that several programs share an SM.  (Powers of
    #: two: they make tiles.)  8 keys a compaction step at any row count:
    #: with its prefix sums by chunks (``row_chunk``) 16 spill 2 registers at
    #: 16 warps on Triton 3.6, 4 (halved, as before, at 8 warps) spill 4 at
    #: k = 2048, and neither was faster (an H100, 2026-12-06,
    #: docs/performance.md).
    row_warps: int = 16
    row_many_rows: int = 264
    row_group_keys_per_thread: int = 32
    row_keys_per_thread: int = 8
    #: The row path's other-pass tile (keys a thread x threads) at most this
    #: many columns (at most 16384: its prefix sums pack two 16-bit counts).
    #: The keys and warps above decide (8 x 512 = 4096 columns at 16 warps);
    #: newer series cap it at 4096 (:data:`NEWER_TRITON`), where 8192 (16 keys,
    #: the default before 2026-12-06) spilled.
    row_max_tile: int = _versioned("TopkTuning.row_max_tile", 16384)
    #: The row path's compaction takes its prefix sums within chunks of this
    #: many consecutive columns, then over the chunks' counts (a power of
    #: two; :func:`.topk.common.exclusive_cumsum_2d`): 16 beat 64 at every
    #: shape timed.
    row_chunk: int = 16
    #: Radix passes (of ``radix_bits``) of the row and ticketed paths' group-maximum bound.
    bound_passes: int = 2
    #: The ticketed path's columns per slice program (held in registers), and
    #: its programs' warps (raised where a tile needs more: 16 keys a thread).
    #: Past ``ticketed_max_slices`` slices a row, slices widen (to 4096
    #: columns at most).  Swept on the H200 (bench_topk.py --ticketed-sweep:
    #: benchmarks/results/topk_ticketed_sweep.json, docs/performance.md).
    ticketed_slice: int = 2048
    ticketed_max_slices: int = 16
    ticketed_warps: int = 8
    #: Warps of a ticketed launch's slice programs (rows x slices x a
    #: program's warps) at most this many: past it, slices widen (to a power
    #: of two of columns), streamed in tiles of the held width, so that fewer
    #: programs pay a slice's fixed costs (G atomic maxima, a bound, tickets).
    #: The fastest of 7 settings at every shape swept on an H100 (2026-12-06,
    #: docs/performance.md; 64 x 32768: 24.5 us, 256 slices of 8 warps).
    ticketed_stream_warps: int = 2048
    #: The ticketed path's compaction (and the fused selection's) takes its
    #: prefix sums within chunks of this many consecutive columns of its
    #: slice, then over the chunks' counts, as the row path's (``row_chunk``):
    #: 1 x 131072 17.5-17.9 us against 19.1-19.5 as one scan of the slice, and
    #: the fused selection spill-free on Triton 3.6 (an H100, 2026-12-06,
    #: docs/performance.md).
    ticketed_chunk: int = _versioned("TopkTuning.ticketed_chunk", 16)
    #: Few rows wider than this take the sliced path: 8 x 262144 ticketed /
    #: sliced 26.5 / 47.8 us streamed (H100; held slices: 60.1 / 48.6 on the H200).
    #: One row takes the ticketed path up to ``ticketed_single_row_max_columns``:
    #: 1 x 262144 (a 1M-token context's blocks) 23.2 / 27.1 us ticketed / sliced,
    #: with the 1024-key candidate tile (H200, 2026-12-04, docs/performance.md).
    ticketed_max_columns: int = 262144
    ticketed_single_row_max_columns: int = 262144
    #: The ticketed path's group-maximum bound: "fixed" (``bound_passes``
    #: radix passes from the top bit, truncated, as the row path) or
    #: "scaled" (``ticketed_bound_passes`` passes of digits fitted to the
    #: maxima's span: ``topk.ticketed._scaled_lower_bound``; 16.1 vs 17.6 us at
    #: 1 x 32768, benchmarks/results/topk_ticketed_sweep.json).  With fewer
    #: than k group maxima the plan takes "fixed" whatever this says.
    ticketed_bound: str = "scaled"
    ticketed_bound_passes: int = 1

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if field.name not in ("path", "ticketed_bound"):  # the choices, below
                _positive_int("TopkTuning", field.name, getattr(self, field.name))
        for name in ("radix_bits", "register_radix_bits"):
            value = getattr(self, name)
            if 32 % value:
                raise ValueError(f"TopkTuning: {name} must divide 32, got {value!r}")
            if value > 8:  # a digit's counts (up to 2**bits) are packed in 16 bits
                raise ValueError(f"TopkTuning: {name} must be at most 8, got {value!r}")
        for name, choices in (("ticketed_bound", TICKETED_BOUNDS), ("path", TOPK_PATHS)):
            value = getattr(self, name)
            if not isinstance(value, str) or value not in choices:
                raise ValueError(f"TopkTuning: {name} must be one of {', '.join(map(repr, choices))}, "
                                 f"got {value!r}")
        for name in ("row_warps", "row_group_keys_per_thread", "row_keys_per_thread", "row_chunk",
                     "register_keys_per_thread", "register_max_warps", "ticketed_slice", "ticketed_warps",
                     "ticketed_chunk"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"TopkTuning: {name} must be a power of two, got {value!r}")
        for name in ("max_groups", "tile"):  # tl.arange sizes (GROUPS, the sliced path's TILE)
            _power_of_two("TopkTuning", name, getattr(self, name))
        _power_of_two("TopkTuning", "row_max_tile", self.row_max_tile, most=16384)  # the row path's TILE
        for name in ("row_warps", "register_max_warps", "ticketed_warps"):
            if getattr(self, name) > 32:
                raise ValueError(f"TopkTuning: {name} must be at most 32, got {getattr(self, name)!r}")
        if not 16 <= self.ticketed_slice <= 4096:  # registers: 8 keys a thread at 16 warps
            raise ValueError(f"TopkTuning: ticketed_slice must be from 16 to 4096, got {self.ticketed_slice!r}")
        for name in ("bound_passes", "ticketed_bound_passes"):
            if getattr(self, name) > 32 // self.radix_bits:
                raise ValueError(f"TopkTuning: {name} must be at most 32 // radix_bits = "
                                 f"{32 // self.radix_bits}, got {getattr(self, name)!r}")


#: The values of ``AttentionTuning.row_addressing``.
ROW_ADDRESSING_MODES = ("slot", "page")

#: The values of ``TopkTuning.path``.
TOPK_PATHS = ("auto", "register", "row", "ticketed", "sliced")
#: The values of ``TopkTuning.ticketed_bound``.
TICKETED_BOUNDS = ("scaled", "fixed")


@_tuning_value
class SelectTuning:
    """Stage 3 composition (``select_paged_tokens``)."""

    #: Logits of one chunk of rows stay under this many bytes (rows are processed in chunks).
    logits_workspace_bytes: int = 128 * 1024 * 1024
    #: The scorer (``mqa_paged_scores``, and the selection's) with fp8 keys, a
    #: row a program (decode): its columns (a power of two >= 128) and warps.
    #: Measured on the H200 (benchmarks/results/select_fp8_grid.json, decode
    #: 256 x 128K, CUDA graphs): 432.5 us; 256 columns 485.0, 8 warps 529.7, 2
    #: warps 466.3 (sm_90 registers: docs/design.md, "Measured tuning values").
    fp8_row_columns: int = 128
    fp8_row_warps: int = 4
    #: ``fp8_row_tiles`` > 1 (the default, 16; 1: the kernel above) scores each row's tiles of ``fp8_row_columns`` in a loop,
    #: up to that many tiles a program (``score.scores_rows_kernel``: the row's
    #: request, q and pages read once, a tile's keys as at most two contiguous page
    #: spans), halved while fewer than ``fp8_row_min_programs`` programs would cover
    #: the launch; with ``fp8_row_prefetch``, the next tile's keys are hinted into L2
    #: while a tile is scored; ``fp8_row_stages`` is Triton's num_stages for the loop
    #: (3: the next tile's keys loaded by cp.async into shared memory).  The same bits
    #: as one tile a program (docs/design.md, "Measured tuning values"); the fused
    #: selection's scoring does not take them.  Timed on the H200 in one process
    #: (``bench_select.py --fp8-sweep``, benchmarks/results/select_fp8_sweep.json,
    #: decode 8 / 64 / 256 x 128K, CUDA graphs): one tile a program 17.6 / 117.2 /
    #: 453.8 us, 16 tiles 16.1 / 100.7 / 386.5 (8 tiles 16.1 / 100.6 / 400.6), bf16
    #: keys 23.9 / 148.2 / 593.2: fp8 / bf16 0.67 / 0.68 / 0.65, against 0.73-0.79.
    fp8_row_tiles: int = 16
    fp8_row_min_programs: int = 4096
    fp8_row_prefetch: bool = True
    fp8_row_stages: int = 1
    #: Decode rows whose top-k takes the ticketed path are scored, ranked and
    #: expanded by one launch (``select.select_fused_kernel``): bit for bit
    #: the three launches.  Off: the three launches (tests compare the two).
    #: Up to ``fused_max_rows`` rows of at most ``fused_max_columns``
    #: compressed blocks; ``fused_warps`` warps, each scoring program
    #: ``fused_score_columns`` columns (a power of two, at least the scorer's
    #: tile).  Measured on the H200 (benchmarks/results/select_fused_sweep.json,
    #: CUDA graphs, rows x columns, fused / three launches): 1 x 32768 22.1 / 23.5 us, 8 x 32768
    #: 47.2 / 49.2, past the bounds 8 x 131072 124.7 / 116.2; 16 warps slower
    #: than 8 at every shape (docs/performance.md, "Fused selection").
    fused: bool = True
    fused_max_rows: int = 8
    fused_max_columns: int = 32768
    fused_warps: int = 8
    fused_score_columns: int = 256

    def __post_init__(self):
        object.__setattr__(self, "fused", BOOL.canonical("SelectTuning", "fused", self.fused))
        object.__setattr__(self, "fp8_row_prefetch", BOOL.canonical("SelectTuning", "fp8_row_prefetch",
                                                                    self.fp8_row_prefetch))
        for name in ("logits_workspace_bytes", "fp8_row_columns", "fp8_row_warps", "fp8_row_tiles",
                     "fp8_row_min_programs", "fp8_row_stages", "fused_max_rows",
                     "fused_max_columns", "fused_warps", "fused_score_columns"):
            _positive_int("SelectTuning", name, getattr(self, name))
        for name in ("fp8_row_warps", "fused_warps"):
            _power_of_two("SelectTuning", name, getattr(self, name), most=MAX_WARPS)
        _power_of_two("SelectTuning", "fp8_row_tiles", self.fp8_row_tiles)
        for name in ("fp8_row_columns", "fused_score_columns"):
            value = getattr(self, name)
            if value < 128 or value & (value - 1):
                raise ValueError(f"SelectTuning: {name} must be a power of two >= 128, got {value!r}")


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
        # A tile of tile_elements // D query heads (a tl.arange size); warps as Triton takes them.
        _power_of_two("RopeCacheTuning", "tile_elements", self.tile_elements)
        _power_of_two("RopeCacheTuning", "num_warps", self.num_warps, most=MAX_WARPS)


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
        _power_of_two("CompressTuning", "tile_elements", self.tile_elements)  # rows a tile: tile_elements // W


@_tuning_value
class StepTuning:
    """The composed step (``qsa_attention_step``): which stages share a launch.

    ``fuse_stages``: with at most ``fused_max_rows`` rows, the step runs its
    compression stage (pooling, the ring store, the pooled keys' RoPE and
    their store) and the index queries' RoPE as one launch
    (``fused.plan_compress_rotate_store``) instead of five; bit for bit the
    same results.  One program of that launch holds every row (so that the
    ring is read before it is overwritten), hence the bound.  Off: the
    separate launches (tests compare the two).  The bound is not yet measured
    on the H200: a decode batch of up to 16 rows is one [16, DI] tile.

    ``fuse_rope``: stage 1 (RoPE on q and k, k and v into the KV cache) runs
    its programs in that same launch (``fused.rope_compress_store``): one
    launch fewer (four per decode step at 1-8 requests), the same bits.
    """

    fuse_stages: bool = True
    fused_max_rows: int = 16
    fuse_rope: bool = True

    def __post_init__(self):
        for name in ("fuse_stages", "fuse_rope"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"StepTuning: {name} must be a bool, got {getattr(self, name)!r}")
        _positive_int("StepTuning", "fused_max_rows", self.fused_max_rows)


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
