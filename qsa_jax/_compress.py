"""Stage 2 for JAX: key compression and row store."""

from __future__ import annotations

from qsa_kernels.compress import (COMPRESS_GROUPS_DOC, STORE_CACHE_ROWS_DOC, plan_compress_groups,
                                  plan_store_cache_rows)
from qsa_kernels.docs import jax_doc

from . import _launch


def compress_groups(raw_keys, raw_positions, compressor_state_cache, compressor_state_block_table,
                    token_to_req, query_start_loc, logical_positions, compressed_slots,
                    compress_ratio, rope_cache=None):
    arrays = dict(raw_keys=raw_keys, raw_positions=raw_positions,
                  compressor_state_cache=compressor_state_cache,
                  compressor_state_block_table=compressor_state_block_table,
                  token_to_req=token_to_req, query_start_loc=query_start_loc,
                  logical_positions=logical_positions, compressed_slots=compressed_slots,
                  rope_cache=rope_cache)
    arrays, infos = _launch.metadata("compress_groups", arrays)
    program = plan_compress_groups(**infos, compress_ratio=compress_ratio)
    return _launch.run(program, arrays)


def store_cache_rows(cache, slot_mapping, rows):
    arrays, infos = _launch.metadata("store_cache_rows", dict(cache=cache, slot_mapping=slot_mapping, rows=rows))
    (cache,) = _launch.run(plan_store_cache_rows(**infos), arrays)
    return cache


compress_groups.__doc__ = jax_doc(COMPRESS_GROUPS_DOC)
store_cache_rows.__doc__ = jax_doc(STORE_CACHE_ROWS_DOC)
