"""Stage 2: key compression and row store (torch adapter: binds the shared plans; see qsa_kernels)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the annotations' array types (the same names in both adapters)
    from torch import Tensor as Array, Tensor as ArrayLike

from qsa_kernels.compress import (COMPRESS_GROUPS_DOC, STORE_CACHE_ROWS_DOC, plan_compress_groups,
                                  plan_store_cache_rows)
from qsa_kernels.docs import torch_doc

from . import _launch


def compress_groups(raw_keys: ArrayLike, raw_positions: ArrayLike, compressor_state_cache: ArrayLike,
                    compressor_state_block_table: ArrayLike, token_to_req: ArrayLike,
                    query_start_loc: ArrayLike, logical_positions: ArrayLike, compressed_slots: ArrayLike,
                    compress_ratio: int, rope_cache: ArrayLike | None = None) -> tuple[Array, Array]:
    return _launch.call(plan_compress_groups, dict(raw_keys=raw_keys, raw_positions=raw_positions,
                                                   compressor_state_cache=compressor_state_cache,
                                                   compressor_state_block_table=compressor_state_block_table,
                                                   token_to_req=token_to_req, query_start_loc=query_start_loc,
                                                   logical_positions=logical_positions,
                                                   compressed_slots=compressed_slots,
                                                   compress_ratio=compress_ratio, rope_cache=rope_cache))


def store_cache_rows(cache: ArrayLike, slot_mapping: ArrayLike, rows: ArrayLike) -> Array:
    return _launch.call(plan_store_cache_rows, dict(cache=cache, slot_mapping=slot_mapping, rows=rows))


compress_groups.__doc__ = torch_doc(COMPRESS_GROUPS_DOC)
store_cache_rows.__doc__ = torch_doc(STORE_CACHE_ROWS_DOC)
