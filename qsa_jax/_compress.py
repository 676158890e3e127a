"""Stage 2: key compression and row store (JAX adapter: binds the shared plans; see qsa_kernels)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the annotations' array types (the same names in both adapters)
    from jax import Array
    from jax.typing import ArrayLike

from qsa_kernels.compress import (COMPRESS_GROUPS_DOC, STORE_CACHE_ROWS_DOC, plan_compress_groups,
                                  plan_store_cache_rows)
from qsa_kernels.docs import jax_doc

from . import _launch


def compress_groups(raw_keys: ArrayLike, raw_positions: ArrayLike, compressor_state_cache: ArrayLike,
                    compressor_state_block_table: ArrayLike, token_to_req: ArrayLike,
                    query_start_loc: ArrayLike, logical_positions: ArrayLike, compressed_slots: ArrayLike,
                    compress_ratio: int, rope_cache: ArrayLike | None = None) -> tuple[Array, Array]:
    return _launch.call(plan_compress_groups, locals())  # every argument, by name


def store_cache_rows(cache: ArrayLike, slot_mapping: ArrayLike, rows: ArrayLike) -> Array:
    return _launch.call(plan_store_cache_rows, locals())  # every argument, by name


compress_groups.__doc__ = jax_doc(COMPRESS_GROUPS_DOC)
store_cache_rows.__doc__ = jax_doc(STORE_CACHE_ROWS_DOC)
