"""Stage 2: key compression and row store (being written)."""


def compress_groups(raw_keys, raw_positions, compressor_state_cache, compressor_state_block_table,
                    token_to_req, query_start_loc, logical_positions, compressed_slots,
                    compress_ratio, rope_cache=None):
    raise NotImplementedError("compress_groups")


def store_cache_rows(cache, slot_mapping, rows):
    raise NotImplementedError("store_cache_rows")
