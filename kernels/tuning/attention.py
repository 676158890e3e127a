"""Stage 4's tuning: ``sparse_paged_attention``'s launch tables."""

from __future__ import annotations

from ..validate import BOOL
from ._values import _launch_rows, _positive_int, _power_of_two, _table_rows, _tuning_value, _versioned

#: The values of ``AttentionTuning.row_addressing``.
ROW_ADDRESSING_MODES = ("slot", "page")


@_tuning_value
class AttentionTuning:
    """Stage 4 (``sparse_paged_attention``) launch configuration.

    Programs = R x KH (rows x KV heads).  ``launch_table`` rows are ``(most
    programs or None, K/V tile bytes, warps, stages, target programs)``; the
    first row whose bound holds applies.  Splits: ``target programs //
    programs``, a power of two capped at the number of tiles (and re-derived
    so that no split is empty), so that a decode batch too small to fill the
    GPU's SMs still fills it; no split (and no merge pass) once programs pass
    the SM count.  Many small programs take 2 warps: more of them fit an SM,
    so more gathers are in flight.  Each row is the fastest of a sweep
    (``bench_sparse_attention.py --sweep``, ``--sweep --splits``; figures:
    docs/performance.md, "Attention"; the sweeps: docs/design.md, "Measured
    tuning values"); newer Triton series replace the rows that spill there
    (:data:`NEWER_TRITON`: not timed).

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
    #: fp8 caches: tiles sized as for 16-bit ones (BLOCK_N from the tile bytes at 2 bytes an
    #: element: fp8 tiles move half the bytes); the fastest of ``--sweep --fp8``
    #: (docs/performance.md, "fp8 caches").
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
    #: same addresses either way.  16-bit caches keep "page" until timed: "slot"
    #: costs them registers (a program an SM at decode 256).
    row_addressing: str = "page"
    fp8_row_addressing: str = "slot"
    #: Several splits merged in their own launch (``sparse_attention_fused_merge_kernel``:
    #: after the splits of a (row, KV head), merging programs that wait for them by
    #: ticket) instead of a merge launch, for at most ``fused_merge_max_programs``
    #: programs (rows x KV heads), so that a decode step is three launches.  True /
    #: False forces either path (benchmarks time both), None takes it by that bound;
    #: the split count, hence the bits, are the same.  Off by default: slower than the
    #: merge launch at 1 and 8 rows (docs/design.md, "Retired variants").
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
