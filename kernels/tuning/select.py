"""Stage 3's tuning: ``select_paged_tokens`` (its chunks, the fp8 scorer, the fused selection)."""

from __future__ import annotations

from ..validate import BOOL
from ._values import MAX_WARPS, _positive_int, _power_of_two, _tuning_value


@_tuning_value
class SelectTuning:
    """Stage 3 composition (``select_paged_tokens``).  Figures:
    docs/performance.md, "Per stage" and "Fused selection"; the sweeps:
    docs/design.md, "Measured tuning values"."""

    #: Logits of one chunk of rows stay under this many bytes (rows are processed in chunks).
    logits_workspace_bytes: int = 128 * 1024 * 1024
    #: The scorer (``mqa_paged_scores``, and the selection's) with fp8 keys, a
    #: row a program (decode): its columns (a power of two >= 128) and warps,
    #: the fastest of ``bench_select.py``'s fp8 grid.
    fp8_row_columns: int = 128
    fp8_row_warps: int = 4
    #: ``fp8_row_tiles`` > 1 (the default, 16; 1: one tile a program) scores each row's tiles of
    #: ``fp8_row_columns`` in a loop, up to that many tiles a program (``score.scores_rows_kernel``:
    #: the row's request, q and pages read once, a tile's keys as at most two contiguous page
    #: spans), halved while fewer than ``fp8_row_min_programs`` programs would cover the launch;
    #: with ``fp8_row_prefetch``, the next tile's keys are hinted into L2 while a tile is scored;
    #: ``fp8_row_stages`` is Triton's num_stages for the loop (3: the next tile's keys loaded by
    #: cp.async into shared memory).  The same bits as one tile a program, faster at every decode
    #: size (``bench_select.py --fp8-sweep``); the fused selection's scoring does not take them.
    fp8_row_tiles: int = 16
    fp8_row_min_programs: int = 4096
    fp8_row_prefetch: bool = True
    fp8_row_stages: int = 1
    #: Decode rows whose top-k takes the ticketed path are scored, ranked and
    #: expanded by one launch (``select.select_fused_kernel``): bit for bit
    #: the three launches.  Off: the three launches (the test oracle: tests
    #: compare the two).  Up to ``fused_max_rows`` rows of at most
    #: ``fused_max_columns`` compressed blocks (where it was faster);
    #: ``fused_warps`` warps (16 were slower everywhere), each scoring program
    #: ``fused_score_columns`` columns (a power of two, at least the scorer's tile).
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
