"""Stage 3b: exact top-k blocks of each row (``topk_blocks``).

An exact radix select on order-preserving uint32 keys (``-0.0 == +0.0``;
NaN below ``-inf``), by one of four paths that the plan chooses from the
static shape (:func:`topk_path`), each in its own module:

- :mod:`.register`: one program per row holding the row in registers (short rows);
- :mod:`.row`: one program per row streaming its row (mid-width rows, or many rows);
- :mod:`.ticketed`: one launch of several programs a row that take their
  roles by ticket (a few long rows);
- :mod:`.sliced`: four launches over ``(row, slice)`` programs (a few very long rows).

:mod:`.common` holds what they share (order keys, radix digits,
placement), :mod:`.plan` the plan.  On every path, selected columns are
written in ascending column order with ties taken by lower column (prefix
sums over column order), so the result is exact, deterministic and the same
on every path: integer counts only, no host synchronisation, and atomics
only where their order cannot matter (the ticketed path's maxima and
tickets).
"""

from .common import order_key, topk_groups
from .plan import TOPK_DOC, plan_topk_blocks, topk_parts, topk_path
from .register import REGISTER_MAX_TILE, register_tiling, topk_register_kernel
from .row import topk_row_kernel
from .sliced import topk_bound_kernel, topk_finish_kernel, topk_group_max_kernel, topk_place_kernel
from .ticketed import (slice_column_view, ticketed_buffers, ticketed_compact_and_select, ticketed_layout,
                       topk_ticketed_kernel)

__all__ = ["REGISTER_MAX_TILE", "TOPK_DOC", "order_key", "plan_topk_blocks", "register_tiling", "slice_column_view",
           "ticketed_buffers", "ticketed_compact_and_select", "ticketed_layout", "topk_bound_kernel",
           "topk_finish_kernel", "topk_group_max_kernel", "topk_groups", "topk_parts", "topk_path",
           "topk_place_kernel", "topk_register_kernel", "topk_row_kernel", "topk_ticketed_kernel"]
