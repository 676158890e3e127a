"""A user's annotated code, for mypy only (tests/test_typing.py checks it; nothing runs it).

What the public annotations must give a type checker: the step's result
length follows ``return_token_indices``, the pager takes plain dicts, and the
containers' constructors return the adapter's own types.  Each
``# type: ignore[...]`` marks a mistake mypy must reject: the test runs with
``--warn-unused-ignores``, so an annotation that stops rejecting it fails.
"""

from __future__ import annotations

from typing import assert_type

import jax
import jax.numpy as jnp
import numpy as np
import torch

import qsa_jax
import qsa_torch
from qsa_kernels.paging import CacheGeometry, HostStepMetadata, PagedRequests

GEOMETRY = CacheGeometry(page_size=16, num_pages=32, compress_ratio=4, compressed_page_size=16,
                         num_compressed_pages=8, max_context=256, max_requests=4)


def host_steps(pager: PagedRequests) -> list[HostStepMetadata]:
    by_name: dict[str, int] = {"a": 24, "b": 5}
    by_number: dict[int, int] = {7: 1}
    numpy_counts = {("user", 3): np.int64(2)}
    steps = [pager.step(by_name), pager.step(by_number), pager.step(numpy_counts)]
    pager.step(["a", "b"])  # type: ignore[arg-type]  # a list is not a mapping of request -> count
    return steps


def torch_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_q: torch.Tensor,
               index_k: torch.Tensor, cos_sin: torch.Tensor, index_cos_sin: torch.Tensor,
               host: HostStepMetadata, return_indices: bool) -> torch.Tensor:
    state = qsa_torch.QSAState.zeros(GEOMETRY, kv_heads=1, head_dim=64, index_head_dim=32,
                                     dtype=torch.bfloat16, device="cpu")
    assert_type(state, qsa_torch.QSAState)
    meta = qsa_torch.StepMetadata.from_host(host, "cpu")
    assert_type(meta, qsa_torch.StepMetadata)
    arrays = (q, k, v, index_q, index_k)

    out, state = qsa_torch.qsa_attention_step(*arrays, state, meta, cos_sin, index_cos_sin,
                                              compress_ratio=4, token_topk=8)
    assert_type(out, torch.Tensor)
    assert_type(state, qsa_torch.QSAState)
    out, state, token_indices = qsa_torch.qsa_attention_step(
        *arrays, state, meta, cos_sin, index_cos_sin, compress_ratio=4, token_topk=8, return_token_indices=True)
    assert_type(token_indices, torch.Tensor)
    either = qsa_torch.qsa_attention_step(*arrays, state, meta, cos_sin, index_cos_sin, compress_ratio=4,
                                          token_topk=8, return_token_indices=return_indices)
    assert_type(either, tuple[torch.Tensor, qsa_torch.QSAState]
                | tuple[torch.Tensor, qsa_torch.QSAState, torch.Tensor])

    out, state, token_indices = qsa_torch.qsa_attention_step(  # type: ignore[misc]  # two results, not three
        *arrays, state, meta, cos_sin, index_cos_sin, compress_ratio=4, token_topk=8)
    qsa_torch.qsa_attention_step(*arrays, state, meta, cos_sin, index_cos_sin,  # type: ignore[call-overload]
                                 compress_ratio=4)  # token_topk is required
    qsa_torch.qsa_attention_step(*arrays, qsa_jax.QSAState.zeros(  # type: ignore[call-overload]
        GEOMETRY, kv_heads=1, head_dim=64, index_head_dim=32, dtype=jnp.bfloat16),  # the other adapter's state
        meta, cos_sin, index_cos_sin, compress_ratio=4, token_topk=8)
    return out


def jax_step(q: jax.Array, k: jax.Array, v: jax.Array, index_q: jax.Array, index_k: jax.Array,
             cos_sin: jax.Array, index_cos_sin: jax.Array, host: HostStepMetadata) -> jax.Array:
    state = qsa_jax.QSAState.zeros(GEOMETRY, kv_heads=1, head_dim=64, index_head_dim=32, dtype=jnp.bfloat16)
    assert_type(state, qsa_jax.QSAState)
    meta = qsa_jax.StepMetadata.from_host(host)
    assert_type(meta, qsa_jax.StepMetadata)

    out, state = qsa_jax.qsa_attention_step(q, k, v, index_q, index_k, state, meta, cos_sin, index_cos_sin,
                                            compress_ratio=4, token_topk=8)
    assert_type(out, jax.Array)
    assert_type(state, qsa_jax.QSAState)
    out, state, token_indices = qsa_jax.qsa_attention_step(
        np.asarray(q), k, v, index_q, index_k, state, meta, cos_sin, index_cos_sin,  # NumPy inputs too
        compress_ratio=4, token_topk=8, return_token_indices=True)
    assert_type(token_indices, jax.Array)
    out, state, token_indices = qsa_jax.qsa_attention_step(  # type: ignore[misc]  # two results, not three
        q, k, v, index_q, index_k, state, meta, cos_sin, index_cos_sin, compress_ratio=4, token_topk=8)
    return out


def torch_stages(logits: torch.Tensor, visible: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor,
                 positions: torch.Tensor, token_indices: torch.Tensor, block_table: torch.Tensor,
                 token_to_req: torch.Tensor) -> torch.Tensor:
    """The stage functions are typed as declared (qsa_kernels.functions), not ``Any``."""
    blocks = qsa_torch.topk_blocks(logits, visible, 16)
    assert_type(blocks, torch.Tensor)
    bad: int = qsa_torch.topk_blocks(logits, visible, 16)  # type: ignore[assignment]  # a Tensor, not an int
    qsa_torch.topk_blocks(logits, visible, k=2.5)  # type: ignore[arg-type]  # k is an int
    qsa_torch.topk_blocks(logits, visible)  # type: ignore[call-arg]  # k is required
    q_out, k_out, key_cache, value_cache = qsa_torch.rope_reshape_and_cache(
        q, k, v, key_cache, value_cache, slots, positions, None, is_neox=True)  # cos_sin None: q, k rotated
    assert_type(q_out, torch.Tensor)
    *_, zeros = qsa_torch.rope_reshape_and_cache(q, k, v, key_cache, value_cache, slots, positions, None,
                                                 is_neox=True, return_zeros=True)  # one result more
    assert_type(zeros, torch.Tensor)
    out = qsa_torch.sparse_paged_attention(q, key_cache, value_cache, token_indices, block_table, token_to_req)
    assert_type(out, torch.Tensor)
    out, lse = qsa_torch.sparse_paged_attention(q, key_cache, value_cache, token_indices, block_table,
                                                token_to_req, return_lse=True)  # the Literal selects a pair
    assert_type(lse, torch.Tensor)
    qsa_torch.sparse_paged_attention(q, key_cache, value_cache, token_indices,  # type: ignore[call-overload]
                                     block_table, token_to_req, return_lse=1)  # a bool, not an int
    return blocks + bad + out


def jax_stages(logits: jax.Array, visible: jax.Array) -> jax.Array:
    blocks = qsa_jax.topk_blocks(logits, visible, 16)
    assert_type(blocks, jax.Array)
    bad: str = qsa_jax.topk_blocks(logits, visible, 16)  # type: ignore[assignment]  # an Array, not a str
    assert_type(qsa_jax.topk_blocks(np.asarray(logits), visible, 16), jax.Array)  # NumPy in, a jax.Array out
    return blocks
