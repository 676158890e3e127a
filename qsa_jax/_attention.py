"""Stage 4: sparse paged attention (being written)."""


def sparse_paged_attention(q, k_cache, v_cache, token_indices, block_table, token_to_req,
                           softmax_scale=None):
    raise NotImplementedError("sparse_paged_attention")
