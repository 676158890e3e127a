"""Stage 3: selection (being written)."""


def mqa_paged_scores(q, k_cache, page_table, token_to_req, query_positions, sequence_lengths,
                     compress_ratio, num_columns=None, score_divisor=None):
    raise NotImplementedError("mqa_paged_scores")


def topk_blocks(logits, visible_blocks, k):
    raise NotImplementedError("topk_blocks")


def expand_block_indices(block_indices, query_positions, sequence_lengths, token_to_req,
                         compress_ratio, token_topk):
    raise NotImplementedError("expand_block_indices")


def select_paged_tokens(q, k_cache, page_table, token_to_req, query_positions, sequence_lengths,
                        token_topk, compress_ratio):
    raise NotImplementedError("select_paged_tokens")
