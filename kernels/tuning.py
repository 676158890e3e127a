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

from .validate import BOOL, POSITIVE_INT

__all__ = ["AttentionTuning", "CompressTuning", "RopeCacheTuning", "SelectTuning", "StepTuning", "TopkTuning",
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

    Programs = R x KH (rows x KV heads).  ``launch_table`` rows are ``(most
    programs or None, K/V tile bytes, warps, stages, target programs)``; the
    first row whose bound holds applies.  Splits: ``target programs //
    programs``, a power of two capped at the number of tiles (and re-derived
    so that no split is empty), so that a decode batch too small to fill the
    H200's 132 SMs still fills it; no split (and no merge pass) once
    programs > 132 (their rows' targets are below twice their programs).
    Swept on the H200 (CUDA-graph replay, 24 Q / 2 KV heads x d256, bf16, W
    = 2051; ``benchmarks/bench_sparse_attention.py --sweep``, best of 18
    configurations per shape; ``--sweep --splits``, the split counts
    crossed with 5 configurations, for 8 and 64 rows):

    | programs | K/V tile | warps | stages | target | measured on | us (table before) |
    |----------|----------|-------|--------|--------|-------------|-------------------|
    | <= 4     | 32 KB    | 8     | 3      | 264    | decode 1 row (33 splits) | 9.5 (10.9) |
    | 5-16     | 16 KB    | 4     | 3      | 512    | decode 8 rows (22 splits) | 18.1 (21.4) |
    | 17-64    | 32 KB    | 8     | 3      | 264    | (the previous table's) | decode 16 rows: 35.6 |
    | 65-132   | 16 KB    | 2     | 3      | 512    | decode 64 rows (4 splits) | 93.0 (100.0) |
    | 133-4095 | 16 KB    | 2     | 3      | 264    | decode 256 rows     | 285 (386)         |
    | >= 4096  | 32 KB    | 2     | 2      | 264    | prefill 2048 rows   | 1206 (2193)       |

    (32 KB of K or V is BLOCK_N = 64 tokens at D = 256.)  Many small
    programs favour 2 warps: more of them fit on an SM, so more gathers are
    in flight.  (The 8-, 16- and 64-row figures are ``--sweep --splits``
    runs that timed the table before in the same run.  At 16 rows the
    8-row configuration took 40.3 us and 32 KB tiles on 4 warps, 2 stages,
    11 splits 32.8: a candidate not yet checked against the reference on
    the GPU, so 17-64 programs keep the previous table's row.)

    ``tile_bytes`` forces the tile of every row (sweeps); ``num_splits``
    forces the split count (tests), capped so that no split is empty.
    """

    launch_table: tuple = (
        (4, 32 * 1024, 8, 3, 264),
        (16, 16 * 1024, 4, 3, 512),
        (64, 32 * 1024, 8, 3, 264),
        (132, 16 * 1024, 2, 3, 512),
        (4095, 16 * 1024, 2, 3, 264),
        (None, 32 * 1024, 2, 2, 264),
    )
    tile_bytes: int | None = None
    num_splits: int | None = None
    #: Split-K (programs <= 132) in one launch: the last split of each (row,
    #: KV head) to finish merges the partials (an atomic ticket).  False:
    #: a second launch merges them (one program per (row, head)).  Measured
    #: on the H200 (CUDA graphs, bench_sparse_attention.py --merge both):
    #: fused / two launches 16.3 / 9.1 us at 1 row (33 splits: one program
    #: reads all 33 partials of its KV head from L2), 28.1 / 23.1 at 8 rows,
    #: 100.6 / 99.8 at 64; the ticket fill is 1.1 us more.  So off.
    fused_merge: bool = False
    #: float32 partial elements a fused merge loads per step (SPLIT_CHUNK x
    #: BLOCK_M x D; 16384 at 8 warps: 64 registers per thread).
    fused_merge_chunk_elements: int = 16384
    #: float32 elements of one merge launch's chunk (SPLIT_CHUNK x D): 32 registers per thread.
    merge_chunk_elements: int = 4096
    #: fp8 caches: tiles sized as for 16-bit ones (BLOCK_N from the tile bytes
    #: at 2 bytes an element: fp8 tiles move half the bytes).  Not yet swept on
    #: the H200 (``bench_sparse_attention.py --sweep --fp8`` times the
    #: candidates).  Compiled for sm_90 offline with the defaults below
    #: (registers / shared memory -> programs per SM; SASS instructions of the
    #: main loop per warp and token): decode 256, 32-token tiles, 2 warps, 3
    #: stages (this table): 254 / 57 KB -> 4 (8 warps); 102.  Candidates: 4
    #: warps, 2 stages: 166 / 57 KB -> 3 (12 warps); 99.  16-token tiles, 2
    #: warps, 2 stages: 196 / 33 KB -> 5 (10 warps); 103.  Decode 64 (the
    #: first row): 172 / 105 KB; 105.  Prefill (16 KB tiles): 251 registers;
    #: 64-token tiles on 2 warps now compile without spills too (255, 104 KB).
    #: 64-token tiles take far fewer instructions a token on 2 warps: at decode
    #: 256, 2 stages, 255 / 104 KB -> 2 (4 warps); 61; with fp8_late_values
    #: 255 / 74 KB -> 3 (6 warps); 62.  4 warps: 168 / 104 KB -> 2; 90 (late
    #: values: 200 / 75 KB).  (fp8_late_values at the table's rows: decode 256
    #: 252 / 41 KB, decode 64 186 / 75 KB, prefill 236 / 41 KB.)
    #: Swept on the H200 (``--sweep --quick --fp8``, CUDA graphs, 128K): at
    #: decode 64 the first row went from 64-token tiles, 8 warps, 3 stages
    #: (123.5 us) to 4 warps, 2 stages (88.6 us; bf16 99.3); at decode 256
    #: the second row is the fastest of the candidates once fp8_late_values
    #: is on (279 us; 389.5 without it; 64-token tiles 306-309; bf16 294).
    fp8_launch_table: tuple = (
        (132, 32 * 1024, 4, 2, 264),
        (4095, 16 * 1024, 2, 3, 264),
        (None, 16 * 1024, 2, 2, 264),
    )
    #: fp8 caches: where K/V tiles are widened to q's dtype.  "registers": right
    #: after the load, in its layout; the dots then read 16-bit tiles from
    #: shared memory with ldmatrix, as for 16-bit caches.  "dot_operand" (the
    #: first release's code, kept to compare): Triton stages the fp8 bytes in
    #: shared memory and widens them in the dot-operand layout, so V (the P.V
    #: operand, tokens not contiguous) is read one byte at a time.
    #:
    #: sm_90 SASS of the main loop, decode 256 rows (32-token tiles, 2 warps,
    #: 3 stages), instructions per thread and tile / registers / shared memory:
    #: fp8 first release ("dot_operand", "page") 2875 / 255 / 26 KB (128
    #: LDS.U8); "registers", "page" 1751 / 253 / 57 KB; "registers", "slot"
    #: (the defaults) 1636 / 254 / 57 KB; with fp8_unscaled_values 1565 / 250.
    #: bf16: "page" 1867 / 201 / 42 KB, "slot" 1620 / 216.  Decode 64 (64-token
    #: tiles, 8 warps): fp8 first release 1485 / 182, defaults 840 / 172; bf16
    #: 957 / 128.
    fp8_widen: str = "registers"
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
    #: fp8 caches, bf16 q, widened in registers: V's bit trick leaves out its
    #: multiply by 2**120 (V enters the dot as V x 2**-120, e4m3 subnormals as
    #: bf16 subnormals) and the probabilities are multiplied by 2**120 in
    #: float32 before their bf16 rounding: the same products if the tensor
    #: cores keep bf16 subnormal inputs (the GPU tests check it bitwise), 64
    #: fewer instructions per thread and tile at decode 256.  Off until the
    #: GPU tests pass with it.
    fp8_unscaled_values: bool = False
    #: fp8 caches widened in registers: widen V after the softmax, right
    #: before P.V, instead of beside K (its 16-bit tile then reuses K's shared
    #: memory).  See fp8_launch_table's notes for its registers and memory.
    #: On: measured on the H200 at decode 256 x 128K, 279 against 389.5 us
    #: (three programs an SM instead of two); at decode 64 a tie (89.2 / 88.6).
    fp8_late_values: bool = True

    def __post_init__(self):
        _positive_int("AttentionTuning", "tile_bytes", self.tile_bytes, optional=True)
        _positive_int("AttentionTuning", "num_splits", self.num_splits, optional=True)
        _positive_int("AttentionTuning", "merge_chunk_elements", self.merge_chunk_elements)
        _positive_int("AttentionTuning", "fused_merge_chunk_elements", self.fused_merge_chunk_elements)
        object.__setattr__(self, "fused_merge", BOOL.canonical("AttentionTuning", "fused_merge", self.fused_merge))
        for name in ("row_addressing", "fp8_row_addressing"):
            if getattr(self, name) not in ROW_ADDRESSING_MODES:
                raise ValueError(f"AttentionTuning: {name} must be one of "
                                 f"{', '.join(map(repr, ROW_ADDRESSING_MODES))}, got {getattr(self, name)!r}")
        if self.fp8_widen not in FP8_WIDEN_MODES:
            raise ValueError(f"AttentionTuning: fp8_widen must be one of {', '.join(map(repr, FP8_WIDEN_MODES))}, "
                             f"got {self.fp8_widen!r}")
        for name in ("launch_table", "fp8_launch_table"):
            table = tuple(tuple(row) for row in getattr(self, name))
            object.__setattr__(self, name, table)
            if any(len(row) != 5 for row in table):
                raise ValueError(f"AttentionTuning: {name} rows must be (most programs or None, tile bytes, "
                                 f"warps, stages, target programs), got {table!r}")
            if not table or table[-1][0] is not None:
                raise ValueError(f"AttentionTuning: {name} must end with a row whose bound is None, "
                                 f"got {table!r}")


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
    #: "row", "ticketed" or "sliced" (forced; benchmarks compare them;
    #: "register" holds at most ``topk.REGISTER_MAX_TILE`` columns).
    path: str = "auto"
    #: The register path for rows at most this wide, whatever the rows: on
    #: the H200 it wins at 2048 columns (2048 rows: 69.9 vs the row path's
    #: 113.1 us) and loses from 8192 (309.6 vs 179.1; benchmarks/results/topk.json).
    register_max_columns: int = 2048
    #: A register-path program's keys per thread (warps = row tile / 32 /
    #: this, at most ``register_max_warps``; past that the keys per thread grow).
    register_keys_per_thread: int = 16
    register_max_warps: int = 32
    #: Bits per radix pass of the register path's histograms (a divisor of 32, at most 8;
    #: ``tl.histogram`` costs about the same per bit at 4 and 8 bits, and 8
    #: makes half the passes, each with its block-wide reductions).
    register_radix_bits: int = 8
    #: One program per row for rows at most this wide, or for any width once
    #: there are this many rows (enough programs to fill an H200 without
    #: slicing); else the ticketed path.  Row / ticketed us on the H200
    #: (benchmarks/results/topk.json): 1 x 8192 19.4 / 16.0, 1 x 32768 39.6 /
    #: 16.2, but 64 x 32768 41.5 / 45.7; 4096 (unmeasured) stays with the row path.
    row_max_columns: int = 4096
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
    #: Few rows wider than this take the sliced path: ticketed / sliced us
    #: 8 x 131072 32.3 / 34.9, but 8 x 262144 60.1 / 48.6 (benchmarks/results/topk.json).
    ticketed_max_columns: int = 131072
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
        for name in ("row_warps", "row_group_keys_per_thread", "row_keys_per_thread",
                     "register_keys_per_thread", "register_max_warps", "ticketed_slice", "ticketed_warps"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"TopkTuning: {name} must be a power of two, got {value!r}")
        for name in ("row_warps", "register_max_warps", "ticketed_warps"):
            if getattr(self, name) > 32:
                raise ValueError(f"TopkTuning: {name} must be at most 32, got {getattr(self, name)!r}")
        if not 16 <= self.ticketed_slice <= 4096:  # registers: 8 keys a thread at 16 warps
            raise ValueError(f"TopkTuning: ticketed_slice must be from 16 to 4096, got {self.ticketed_slice!r}")
        for name in ("bound_passes", "ticketed_bound_passes"):
            if getattr(self, name) > 32 // self.radix_bits:
                raise ValueError(f"TopkTuning: {name} must be at most 32 // radix_bits = "
                                 f"{32 // self.radix_bits}, got {getattr(self, name)!r}")


#: The values of ``AttentionTuning.fp8_widen``.
FP8_WIDEN_MODES = ("registers", "dot_operand")
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
    #: The scorer (``mqa_paged_scores``, and the selection's) with fp8 keys:
    #: where key tiles are widened (as ``AttentionTuning.fp8_widen``), and the
    #: columns and warps of a program that scores one row (decode; columns a
    #: power of two >= 128).  The first release's: "dot_operand", 256 columns
    #: (as many key bytes a program as with bf16 keys), 8 warps.  sm_90 SASS at
    #: decode 256 x 128K (instructions per warp and column, registers,
    #: programs per SM): first release 32, 96, 2 (no pipelining: few
    #: programs hide little latency); 128 columns, "registers", 8 warps: 36,
    #: 40, 6 (36 KB of shared memory each); 4 warps (the defaults): 28, 70, 6;
    #: 2 warps: 25, 107, 6; "dot_operand", 4 warps: 33, 88, 5.  bf16 keys
    #: (128 columns, 8 warps): 31, 63, 4.  Not yet measured on the H200.
    fp8_widen: str = "registers"
    fp8_row_columns: int = 128
    fp8_row_warps: int = 4
    #: Decode rows whose top-k takes the ticketed path are scored, ranked and
    #: expanded by one launch (``select.select_fused_kernel``): bit for bit
    #: the three launches.  Off: the three launches (tests compare the two).
    #: Up to ``fused_max_rows`` rows of at most ``fused_max_columns``
    #: compressed blocks; ``fused_warps`` warps, each scoring program
    #: ``fused_score_columns`` columns (a power of two, at least the scorer's
    #: tile).  Measured on the H200 (bench_select.py --fused-sweep, CUDA
    #: graphs, us, rows x columns: fused at 8 warps and 256 columns / the
    #: three launches, same run): 1 x 8192 20.4 / 21.7, 8 x 8192 26.2 /
    #: 25.1, 1 x 32768 22.1 / 23.5, 2 x 32768 25.5 / 27.6, 4 x 32768 31.5 /
    #: 32.7, 8 x 32768 47.2 / 49.2, 16 x 32768 71.7 / 71.6, 1 x 131072 38.7 /
    #: 37.3, 8 x 131072 124.7 / 116.2 (the selection's registers leave room
    #: for 2 programs an SM where the scorer runs 4: fewer loads in flight).
    #: 16 warps (103 registers, no spill; 8 warps spill 18 at ptxas's 128):
    #: the best 16-warp variant is slower than the best 8-warp one at every
    #: shape.
    fused: bool = True
    fused_max_rows: int = 8
    fused_max_columns: int = 32768
    fused_warps: int = 8
    fused_score_columns: int = 256

    def __post_init__(self):
        object.__setattr__(self, "fused", BOOL.canonical("SelectTuning", "fused", self.fused))
        for name in ("logits_workspace_bytes", "fp8_row_columns", "fp8_row_warps", "fused_max_rows",
                     "fused_max_columns", "fused_warps", "fused_score_columns"):
            _positive_int("SelectTuning", name, getattr(self, name))
        for name in ("fp8_row_columns", "fused_score_columns"):
            value = getattr(self, name)
            if value < 128 or value & (value - 1):
                raise ValueError(f"SelectTuning: {name} must be a power of two >= 128, got {value!r}")
        if self.fp8_widen not in FP8_WIDEN_MODES:
            raise ValueError(f"SelectTuning: fp8_widen must be one of {', '.join(map(repr, FP8_WIDEN_MODES))}, "
                             f"got {self.fp8_widen!r}")


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
class StepTuning:
    """The composed step (``qsa_attention_step``): which stages share a launch.

    ``fuse_stages``: with at most ``fused_max_rows`` rows, the step runs its
    compression stage (pooling, the ring store, the pooled keys' RoPE and
    their store) and the index queries' RoPE as one launch
    (``compress.plan_compress_rotate_store``) instead of five; bit for bit the
    same results.  One program of that launch holds every row (so that the
    ring is read before it is overwritten), hence the bound.  Off: the
    separate launches (tests compare the two).  The bound is not yet measured
    on the H200: a decode batch of up to 16 rows is one [16, DI] tile.
    """

    fuse_stages: bool = True
    fused_max_rows: int = 16

    def __post_init__(self):
        if not isinstance(self.fuse_stages, bool):
            raise ValueError(f"StepTuning: fuse_stages must be a bool, got {self.fuse_stages!r}")
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
