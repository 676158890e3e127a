"""Stage 3b's tuning: ``topk_blocks``'s paths and their tiles."""

from __future__ import annotations

import dataclasses

from ._values import _positive_int, _power_of_two, _tuning_value, _versioned

#: The values of ``TopkTuning.path``.
TOPK_PATHS = ("auto", "register", "row", "ticketed", "sliced")
#: The values of ``TopkTuning.ticketed_bound``.
TICKETED_BOUNDS = ("scaled", "fixed")


@_tuning_value
class TopkTuning:
    """Stage 3b (``topk_blocks``, and the top-k of ``select_paged_tokens``).

    Four paths (:mod:`.topk`): the register path (one launch, one program
    per row holding the whole row in registers), the row path (one launch,
    one program per row streaming its row), the ticketed path (one launch
    of several programs per row, which take their roles by ticket) and the
    sliced path (four launches over ``(row, slice)`` programs); ``path``
    picks one or lets the static shape decide.  Each default below is the
    fastest of its sweep (``bench_topk.py``; figures: docs/performance.md,
    "Top-k"; the sweeps: docs/design.md, "Measured tuning values").
    """

    #: Columns a sliced-path program handles per step (raised to G where needed;
    #: 2048 under Triton 3.8, where 4096 spills: :data:`NEWER_TRITON`).
    tile: int = _versioned("TopkTuning.tile", 4096)
    #: Candidate buffer per row: at least this many, or 4k.
    min_candidates: int = 4096
    #: Enough (row, slice) programs to fill the GPU's SMs about twice.
    target_programs: int = 256
    max_slices: int = 64
    max_groups: int = 4096
    #: Bits per radix pass (a divisor of 32, at most 8): 4 won a little on the ticketed path and
    #: lost more on the row path.
    radix_bits: int = 8
    #: Top-k path: "auto" (by shape, see ``topk.topk_path``), "register",
    #: "row", "ticketed" or "sliced" (forced; benchmarks compare them;
    #: "register" holds at most ``topk.REGISTER_MAX_TILE`` columns).
    path: str = "auto"
    #: The register path for rows at most this wide, whatever the rows: it wins at 2048
    #: columns and loses from 8192 to the row path.
    register_max_columns: int = 2048
    #: A register-path program's keys per thread (warps = row tile / 32 /
    #: this, at most ``register_max_warps``; past that the keys per thread grow).
    register_keys_per_thread: int = 8
    register_max_warps: int = 32
    #: Bits per radix pass of the register path's histograms (a divisor of 32, at most 8):
    #: 16 bins beat 256 though they take twice the passes.
    register_radix_bits: int = 4
    #: One program per row for rows at most this wide, or for any width once
    #: there are this many rows (enough programs to fill the GPU without
    #: slicing); else the ticketed path, faster below that many rows.
    row_max_columns: int = 4096
    row_min_rows: int = 65
    #: A row program's warps, and the keys each of its threads handles per
    #: step: of the group maxima (a load and a max), and of the other passes
    #: (prefix sums and scattered stores).  From ``row_many_rows`` rows on,
    #: warps are halved, so that several programs share an SM.  (Powers of
    #: two: they make tiles.)  8 keys a compaction step at any row count: 16
    #: and 4 spill at some shapes, and neither was faster.
    row_warps: int = 16
    row_many_rows: int = 264
    row_group_keys_per_thread: int = 32
    row_keys_per_thread: int = 8
    #: The row path's other-pass tile (keys a thread x threads) at most this
    #: many columns (at most 16384: its prefix sums pack two 16-bit counts).
    #: The keys and warps above decide (8 x 512 = 4096 columns at 16 warps);
    #: newer series cap it at 4096 (:data:`NEWER_TRITON`), where 8192 spills.
    row_max_tile: int = _versioned("TopkTuning.row_max_tile", 16384)
    #: The row path's compaction takes its prefix sums within chunks of this
    #: many consecutive columns, then over the chunks' counts (a power of
    #: two; :func:`.topk.common.exclusive_cumsum_2d`): 16 beat 64 and one scan.
    row_chunk: int = 16
    #: Radix passes (of ``radix_bits``) of the row and ticketed paths' group-maximum bound.
    bound_passes: int = 2
    #: The ticketed path's columns per slice program (held in registers), and
    #: its programs' warps (raised where a tile needs more: 16 keys a thread).
    #: Past ``ticketed_max_slices`` slices a row, slices widen (to 4096
    #: columns at most).  The fastest of ``bench_topk.py --ticketed-sweep``.
    ticketed_slice: int = 2048
    ticketed_max_slices: int = 16
    ticketed_warps: int = 8
    #: Warps of a ticketed launch's slice programs (rows x slices x a
    #: program's warps) at most this many: past it, slices widen (to a power
    #: of two of columns), streamed in tiles of the held width, so that fewer
    #: programs pay a slice's fixed costs (G atomic maxima, a bound, tickets).
    #: The fastest of ``--stream-sweep``'s settings at every shape.
    ticketed_stream_warps: int = 2048
    #: The ticketed path's compaction (and the fused selection's) takes its
    #: prefix sums within chunks of this many consecutive columns of its
    #: slice, as the row path's (``row_chunk``): faster than one scan of the
    #: slice, and the fused selection spill-free on Triton 3.6.
    ticketed_chunk: int = _versioned("TopkTuning.ticketed_chunk", 16)
    #: Few rows wider than this take the sliced path, slower below it; one row
    #: takes the ticketed path up to ``ticketed_single_row_max_columns`` (a 1M-token
    #: context's blocks).
    ticketed_max_columns: int = 262144
    ticketed_single_row_max_columns: int = 262144
    #: The ticketed path's group-maximum bound: "fixed" (``bound_passes``
    #: radix passes from the top bit, truncated, as the row path) or
    #: "scaled" (``ticketed_bound_passes`` passes of digits fitted to the
    #: maxima's span: ``topk.ticketed._scaled_lower_bound``; faster).  With
    #: fewer than k group maxima the plan takes "fixed" whatever this says.
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
