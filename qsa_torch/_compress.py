"""Stage 2: key compression and row store (torch adapter: binds the shared plans; see qsa_kernels)."""

from __future__ import annotations

from qsa_kernels.compress import (COMPRESS_GROUPS_DOC, STORE_CACHE_ROWS_DOC, plan_compress_groups,
                                  plan_store_cache_rows)
from qsa_kernels.docs import torch_doc

from . import _launch


def compress_groups(raw_keys, raw_positions, compressor_state_cache, compressor_state_block_table,
                    token_to_req, query_start_loc, logical_positions, compressed_slots,
                    compress_ratio, rope_cache=None):
    return _launch.call(plan_compress_groups, locals())  # every argument, by name


def store_cache_rows(cache, slot_mapping, rows, *, scale=None):
    return _launch.call(plan_store_cache_rows, locals())  # every argument, by name


compress_groups.__doc__ = torch_doc(COMPRESS_GROUPS_DOC)
store_cache_rows.__doc__ = torch_doc(STORE_CACHE_ROWS_DOC)
