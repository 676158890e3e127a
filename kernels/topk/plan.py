"""``topk_blocks``' plan: the path from the static shape, and its launches."""

from __future__ import annotations

from ..launch import ArrayInfo, Buffer, Program
from ..stage import stage
from ..tuning import TopkTuning
from ..validate import FLOAT_DTYPES, NONNEGATIVE_INT, Checker
from .register import REGISTER_MAX_TILE, register_parts
from .row import row_parts
from .sliced import sliced_parts
from .ticketed import ticketed_parts


TOPK_DOC = """\
Exact top-k blocks of each row, in ascending column order.

Row ``r`` considers its first ``V = min(max(visible_blocks[r], 0), C)``
columns and holds the ``min(k, V)`` highest-scoring ones in ascending column
order, then ``-1`` padding (``k > C`` is allowed).  Ranking: larger values
first, ``-0.0 == +0.0``, ``-inf`` below every finite value, NaN below
``-inf``; equal values go to the lower column.  Deterministic and bitwise
identical in torch and JAX, with no host synchronisation.

Args:
    logits: ``[R, C]`` scores (float32; bf16/fp16 also accepted).
    visible_blocks: ``[R]`` int32/int64 visible columns per row.
    k: blocks to keep (non-negative int).

Returns:
    ``[R, k]`` int32 column indices.
"""


def topk_path(rows: int, columns: int, k: int, tuning: TopkTuning) -> str:
    """``"register"`` (one program per row, the row in registers), ``"row"``
    (one program per row, streamed), ``"ticketed"`` (rows split over the
    programs of one launch) or ``"sliced"`` (rows split over the programs of
    four launches), from the static shape unless ``tuning.path`` forces one."""
    if tuning.path != "auto":
        if tuning.path == "register" and columns > REGISTER_MAX_TILE:
            raise ValueError(f"TopkTuning: path 'register' holds a row in registers: at most "
                             f"{REGISTER_MAX_TILE} columns, got {columns}")
        return tuning.path
    if columns <= min(tuning.register_max_columns, REGISTER_MAX_TILE):
        return "register"
    if columns <= tuning.row_max_columns or rows >= tuning.row_min_rows:
        return "row"
    # One row may take the ticketed path further (its own bound), never less far.
    widest = max(tuning.ticketed_max_columns, tuning.ticketed_single_row_max_columns if rows == 1 else 0)
    return "ticketed" if columns <= widest else "sliced"


def topk_parts(rows: int, columns: int, k: int, logits_stride: int, row_counts,
               logits: str, visible: str, out: str, tuning: TopkTuning):
    """Workspaces and launches of an exact top-k over ``logits`` ``[rows, columns]``.

    The path and tiling are chosen for ``rows``; ``row_counts`` are the rows
    of each run of the launches (several runs reuse the workspaces).
    """
    if rows == 0 or k == 0:
        return (), ()
    parts = dict(register=register_parts, row=row_parts, ticketed=ticketed_parts,
                 sliced=sliced_parts)[topk_path(rows, columns, k, tuning)]
    return parts(rows, columns, k, logits_stride, row_counts, logits, visible, out, tuning)


@stage(arrays=("logits", "visible_blocks"), options=dict(k=NONNEGATIVE_INT), results=("out",), doc=TOPK_DOC,
       returns="Array", tuning=dict(tuning="topk"))
def plan_topk_blocks(logits: ArrayInfo, visible_blocks: ArrayInfo, k: int, *,
                     tuning: TopkTuning | None = None) -> Program:
    """Validate ``topk_blocks`` arguments and describe its launches (see docs/api.md)."""
    check = Checker("topk_blocks")
    check.array("logits", logits, 2, "[R, C]", FLOAT_DTYPES)
    rows, columns = logits.shape
    check.index_vector("visible_blocks", visible_blocks, rows, "R")
    out = Buffer("out", (rows, k), "int32")
    buffers, launches = topk_parts(rows, columns, k, logits.strides[0], [rows],
                                   "logits", "visible_blocks", "out", tuning)
    return Program("topk_blocks", (out,) + buffers, launches, ("out",))
