"""Bad arguments: every documented precondition of every public function, as a table.

Each row takes a small valid call, breaks one precondition, and asserts that
both adapters raise the same exception type with the same text, which starts
with ``"<function>: <argument> "`` and contains the row's expected phrase.
Also: wrong framework's arrays (TypeError naming the argument), arrays on two
devices (ValueError naming both), non-contiguous last dimensions (torch; JAX
arrays are always row-major) and zero-sized dimensions, both those that are
errors and those that are valid (empty batches run and return empty results).

The composed step (``qsa_attention_step``) takes containers (``QSAState``,
``StepMetadata``): its own table, STEP_TABLE, covers its checks, the stage
checks it passes through, and every array inside its containers.

These tables are the complete list: the stage test files keep no tables of
their own (their former cases are rows here, built from the shared bases).
Also here: options of every kind (canonical and typed, whatever was called
before: tests/test_validation.py), ``None`` for every required array, and
expanded (stride-0) views of every argument updated in place.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import textwrap
from typing import Callable

import jax
import numpy as np
import pytest
import torch

import qsa_jax
import qsa_torch
from qsa_kernels import runtime

from .util import DEVICE, host, to_jax

pytestmark = pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")

BF16, FP16, FP32, FP8 = torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn
I32, I64 = torch.int32, torch.int64


def floats(*shape, dtype=BF16):
    g = torch.Generator().manual_seed(sum(shape) + len(shape))
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


def ints(values, dtype=I32):
    return torch.tensor(values, dtype=dtype).to(DEVICE)


def strided(tensor: torch.Tensor) -> torch.Tensor:
    """The same values with a last-dimension stride of 2 (the only thing wrong)."""
    wide = torch.zeros(*tensor.shape[:-1], 2 * tensor.shape[-1], dtype=tensor.dtype, device=tensor.device)
    view = wide[..., ::2]
    view.copy_(tensor)
    return view


# --------------------------------------------------------------------------
# One valid call per function: (arrays in signature order, options)
# --------------------------------------------------------------------------

def rope_flash():
    """T = 3, T_kv = 4, QH = 4, KH = 2, D = 8, P = 4, 3 pages, flash layout."""
    return dict(q=floats(3, 4, 8), k=floats(4, 2, 8), v=floats(4, 2, 8), key_cache=floats(3, 4, 2, 8),
                value_cache=floats(3, 4, 2, 8), slot_mapping=ints([0, 5, -1, 11]), positions=ints([0, 1, 2]),
                cos_sin=floats(16, 8), offsets=ints([1, 0, 2]), swa_slot_mapping=ints([3, 2, 1, 0, 4, 5, 6, 7, 8, 9, 10, 11])), \
        dict(is_neox=True)


def rope_paged():
    """As rope_flash with paged caches: keys [3, KH, D//X, P, X] (X = 4), values [3, KH, D, P]."""
    arrays, options = rope_flash()
    arrays.update(key_cache=floats(3, 2, 2, 4, 4), value_cache=floats(3, 2, 8, 4))
    return arrays, options


def rope_shuffled():
    arrays, options = rope_flash()
    arrays.update(key_cache=floats(3, 2, 2, 4, 4), value_cache=floats(3, 2, 1, 8, 4))
    return arrays, options


def as_fp8(base: Callable, caches: tuple[str, ...], **scales: tuple[float, tuple[int, ...]]):
    """``base``'s valid call with its arrays ``caches`` cast to fp8 and the ``scales`` added,
    each ``name=(value, shape)``: a float32 array of that shape filled with that value."""
    arrays, options = base()
    arrays.update({name: arrays[name].to(FP8) for name in caches})
    arrays.update({name: torch.full(shape, value, device=DEVICE) for name, (value, shape) in scales.items()})
    return arrays, options


def rope_fp8():
    """As rope_flash with fp8 caches and both scales (16-bit caches take none: issue 28)."""
    return as_fp8(rope_flash, ("key_cache", "value_cache"), k_scale=(1.0, ()), v_scale=(1.0, (1,)))


def compress():
    """R = 6 rows of B = 2 requests, D = 8, ratio 2, ring 3, 2 ring blocks."""
    return dict(raw_keys=floats(6, 1, 8), raw_positions=ints([[[p] * 3] for p in range(6)]),
                compressor_state_cache=floats(2, 3, 1, 8), compressor_state_block_table=ints([[0], [1]]),
                token_to_req=ints([0, 0, 0, 1, 1, 1]), query_start_loc=ints([0, 3, 6]),
                logical_positions=ints([3, 4, 5, 0, 1, 2]), compressed_slots=ints([0, -1, 1, -1, 2, -1]),
                rope_cache=ints(np.zeros((2, 3, 1, 3), np.int32))), dict(compress_ratio=2)


def store():
    """A [4 pages, P = 2, 1, W = 5] cache, R = 3 rows."""
    return dict(cache=floats(4, 2, 1, 5), slot_mapping=ints([0, 7, -1]), rows=floats(3, 5)), {}


def scoring():
    """R = 3 rows, H = 2 heads, D = 16, a [5 pages, P = 4, 1, 16] cache, B = 2 requests of W = 2 pages."""
    return dict(q=floats(3, 2, 16), k_cache=floats(5, 4, 1, 16), page_table=ints([[0, 1], [2, -1]]),
                token_to_req=ints([0, 1, 1]), query_positions=ints([20, 9, 3]), sequence_lengths=ints([21, 10]))


def scores():
    return scoring(), dict(compress_ratio=2)


def select():
    return scoring(), dict(token_topk=4, compress_ratio=2)


def topk():
    return dict(logits=floats(3, 10, dtype=FP32), visible_blocks=ints([10, 4, 0])), dict(k=3)


def merge():
    """Two partial attentions of R = 2 rows x 4 heads x d16."""
    return dict(out_a=floats(2, 4, 16, dtype=BF16), lse_a=floats(2, 4, dtype=FP32), out_b=floats(2, 4, 16, dtype=BF16),
                lse_b=floats(2, 4, dtype=FP32)), {}


def expand():
    """R = 3 rows, B = 2, ratio 2, token_topk 4 (2 blocks a row)."""
    return dict(block_indices=ints([[0, 1], [2, -1], [0, 3]]), query_positions=ints([5, 9, 7]),
                sequence_lengths=ints([6, 10]), token_to_req=ints([0, 1, 1])), \
        dict(compress_ratio=2, token_topk=4)


def attention():
    """R = 3, QH = 4, KH = 2, D = 16, [4 blocks, P = 4, KH, D] caches, W = 5 tokens, B = 2."""
    return dict(q=floats(3, 4, 16), k_cache=floats(4, 4, 2, 16), v_cache=floats(4, 4, 2, 16),
                token_indices=ints([[0, 1, 2, -1, 5]] * 3), block_table=ints([[0, 1], [3, 2]]),
                token_to_req=ints([0, 1, 0])), dict(softmax_scale=None)


def store_fp8():
    """As store, quantising bf16 rows into an fp8 cache with a scale."""
    return as_fp8(store, ("cache",), scale=(0.5, ()))


def scores_fp8():
    """As scores, over an fp8 k_cache with its scale."""
    return as_fp8(scores, ("k_cache",), k_scale=(0.5, (1,)))


def select_fp8():
    """As select, over an fp8 k_cache with its scale."""
    return as_fp8(select, ("k_cache",), k_scale=(0.5, ()))


def attention_fp8():
    """As attention, over fp8 K/V caches with their scales."""
    return as_fp8(attention, ("k_cache", "v_cache"), k_scale=(0.5, ()), v_scale=(2.0, (1,)))


#: Valid calls with fp8 caches (rows of the table break them; test_fp8 runs them).
FP8_BASES: dict[str, Callable] = {
    "rope_reshape_and_cache": rope_fp8,
    "store_cache_rows": store_fp8,
    "mqa_paged_scores": scores_fp8,
    "select_paged_tokens": select_fp8,
    "sparse_paged_attention": attention_fp8,
}


BASES: dict[str, Callable] = {
    "rope_reshape_and_cache": rope_flash,
    "compress_groups": compress,
    "store_cache_rows": store,
    "mqa_paged_scores": scores,
    "topk_blocks": topk,
    "expand_block_indices": expand,
    "select_paged_tokens": select,
    "sparse_paged_attention": attention,
    "merge_attention_states": merge,
}


# --------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Bad:
    function: str
    name: str
    change: Callable[[dict], dict]  # current arrays and options -> replacements
    expected: str  # a phrase of the message (which starts "<function>: <argument> ")
    base: Callable | None = None
    torch_only: bool = False  # JAX arrays cannot express it (row-major strides)
    error: type = ValueError

    @property
    def id(self) -> str:
        return f"{self.function}-{self.name}"


def _rows(function: str, base=None):
    def row(name, change, expected, **kwargs):
        return Bad(function, name, change, expected, base or BASES[function], **kwargs)
    return row


def _rope_rows():
    r = _rows("rope_reshape_and_cache")
    paged, shuffled = _rows("rope_reshape_and_cache", rope_paged), _rows("rope_reshape_and_cache", rope_shuffled)
    fp8 = _rows("rope_reshape_and_cache", rope_fp8)
    d7 = lambda a: dict(q=floats(3, 4, 7), k=floats(4, 2, 7), v=floats(4, 2, 7), cos_sin=floats(16, 7),  # noqa: E731
                        key_cache=floats(3, 4, 2, 7), value_cache=floats(3, 4, 2, 7))
    d0 = lambda a: dict(q=floats(3, 4, 0), k=floats(4, 2, 0), v=floats(4, 2, 0), cos_sin=floats(16, 0),  # noqa: E731
                        key_cache=floats(3, 4, 2, 0), value_cache=floats(3, 4, 2, 0))
    d1 = lambda a: dict(q=floats(3, 4, 1), k=floats(4, 2, 1), v=floats(4, 2, 1), cos_sin=floats(16, 2),  # noqa: E731
                        key_cache=floats(3, 4, 2, 1), value_cache=floats(3, 4, 2, 1))
    return [
        r("q_rank", lambda a: dict(q=a["q"][0]), "q must be [T, QH, D] (rank 3)"),
        r("k_rank", lambda a: dict(k=a["k"][:, 0]), "k must be [T_kv, KH, D] (rank 3)"),
        r("v_rank", lambda a: dict(v=a["v"][None]), "v must be [T_kv, KH, D] (rank 3)"),
        r("q_dtype_int", lambda a: dict(q=a["q"].to(I32)), "q must have dtype bfloat16 or float16 or float32"),
        r("q_dtype_float64", lambda a: dict(q=a["q"].double()), "q must have dtype bfloat16 or float16 or float32"),
        r("k_dtype", lambda a: dict(k=a["k"].half()), "k must have q's dtype bfloat16"),
        r("v_dtype", lambda a: dict(v=a["v"].float()), "v must have q's dtype bfloat16"),
        r("k_head_dim", lambda a: dict(k=a["k"][..., :4], v=a["v"][..., :4]), "k must have q's head dim D = 8"),
        r("v_shape", lambda a: dict(v=a["v"][:3]), "v must have k's shape"),
        r("t_kv_below_t", lambda a: dict(k=a["k"][:2], v=a["v"][:2], slot_mapping=a["slot_mapping"][:2]),
          "k must have at least T = 3 rows (T_kv >= T)"),
        r("d_odd", d7, "q must have an even head dim D >= 2 (its rotation pairs), got 7"),
        r("d_zero", d0, "q must have an even head dim D >= 2 (its rotation pairs), got 0"),
        r("d_one", d1, "q must have an even head dim D >= 2 (its rotation pairs), got 1"),
        r("qh_not_multiple_of_kh", lambda a: dict(q=a["q"][:, :3]), "q must have a number of heads QH divisible by k's KH = 2"),
        r("kh_zero", lambda a: dict(k=a["k"][:, :0], v=a["v"][:, :0]), "divisible by k's KH = 0"),
        r("slot_mapping_rank", lambda a: dict(slot_mapping=a["slot_mapping"][:, None]), "slot_mapping must be [T_kv] (rank 1)"),
        r("slot_mapping_dtype", lambda a: dict(slot_mapping=a["slot_mapping"].float()), "slot_mapping must have dtype int32 or int64"),
        r("slot_mapping_uint8", lambda a: dict(slot_mapping=a["slot_mapping"].to(torch.uint8)), "slot_mapping must have dtype int32 or int64"),
        r("slot_mapping_length", lambda a: dict(slot_mapping=a["slot_mapping"][:3]), "slot_mapping must have T_kv = 4 entries"),
        r("positions_rank", lambda a: dict(positions=a["positions"][None]), "positions must be [T] (rank 1)"),
        r("positions_dtype", lambda a: dict(positions=a["positions"].float()), "positions must have dtype int32 or int64"),
        r("positions_length", lambda a: dict(positions=a["positions"][:2]), "positions must have T = 3 entries"),
        r("offsets_rank", lambda a: dict(offsets=a["offsets"][:, None]), "offsets must be [T] (rank 1)"),
        r("offsets_dtype", lambda a: dict(offsets=a["offsets"].double()), "offsets must have dtype int32 or int64"),
        r("offsets_length", lambda a: dict(offsets=a["offsets"][:1]), "offsets must have T = 3 entries"),
        r("cos_sin_rank", lambda a: dict(cos_sin=a["cos_sin"][0]), "cos_sin must be [max_position, 2*F] (rank 2)"),
        r("cos_sin_dtype", lambda a: dict(cos_sin=a["cos_sin"].half()), "cos_sin must have dtype bfloat16 or float32"),
        r("cos_sin_width", lambda a: dict(cos_sin=a["cos_sin"][:, :6]), "cos_sin must have width 2*F with F = D/2 or D, i.e. 8 or 16"),
        r("cos_sin_width_zero", lambda a: dict(cos_sin=a["cos_sin"][:, :0]), "cos_sin must have width 2*F"),
        # Scales: the source's rule (issue 56): both for fp8 caches, optional (applied) for the others.
        fp8("k_scale_two_elements", lambda a: dict(k_scale=torch.ones(2, device=DEVICE)), "k_scale must be a 0-d or 1-element tensor"),
        fp8("k_scale_empty", lambda a: dict(k_scale=torch.ones(0, device=DEVICE)), "k_scale must be a 0-d or 1-element tensor"),
        fp8("v_scale_rank_2", lambda a: dict(v_scale=torch.ones(1, 1, device=DEVICE)), "v_scale must be a 0-d or 1-element tensor"),
        fp8("v_scale_dtype", lambda a: dict(v_scale=ints([1])), "v_scale must have dtype bfloat16 or float16 or float32"),
        r("k_scale_two_elements_bf16_caches", lambda a: dict(k_scale=torch.ones(2, device=DEVICE)), "k_scale must be a 0-d or 1-element tensor, got shape (2,)"),
        r("v_scale_dtype_bf16_caches", lambda a: dict(v_scale=ints([1])), "v_scale must have dtype bfloat16 or float16 or float32, got int32"),
        paged("k_scale_rank_2_paged_bf16_caches", lambda a: dict(k_scale=torch.ones(1, 1, device=DEVICE), v_scale=torch.ones((), device=DEVICE)), "k_scale must be a 0-d or 1-element tensor"),
        fp8("k_scale_missing", lambda a: dict(k_scale=None), "k_scale must be given (a 0-d or 1-element float tensor) for float8_e4m3fn caches, got None"),
        fp8("v_scale_missing", lambda a: dict(v_scale=None), "v_scale must be given (a 0-d or 1-element float tensor) for float8_e4m3fn caches, got None"),
        fp8("both_scales_missing", lambda a: dict(k_scale=None, v_scale=None), "k_scale must be given (a 0-d or 1-element float tensor) for float8_e4m3fn caches, got None"),
        fp8("value_cache_bf16", lambda a: dict(value_cache=a["value_cache"].to(BF16)), "value_cache must have key_cache's dtype float8_e4m3fn, got bfloat16"),
        r("swa_rank", lambda a: dict(swa_slot_mapping=a["swa_slot_mapping"][None]), "swa_slot_mapping must be [num_swa_slots] (rank 1)"),
        r("swa_dtype", lambda a: dict(swa_slot_mapping=a["swa_slot_mapping"].float()), "swa_slot_mapping must have dtype int32 or int64"),
        r("key_cache_rank_3", lambda a: dict(key_cache=a["key_cache"][0]), "key_cache must be [num_blocks, P, KH, D] (flash) or [num_blocks, KH, D//X, P, X] (paged)"),
        r("key_cache_rank_6", lambda a: dict(key_cache=a["key_cache"][None, None]), "key_cache must be [num_blocks, P, KH, D] (flash)"),
        r("flash_value_rank", lambda a: dict(value_cache=a["value_cache"][None]), "value_cache must be [num_blocks, P, KH, D] like a flash key_cache (rank 4)"),
        r("flash_value_shape", lambda a: dict(value_cache=a["value_cache"][:2]), "value_cache must have key_cache's shape (3, 4, 2, 8) (flash layout)"),
        r("flash_cache_heads", lambda a: dict(key_cache=a["key_cache"][:, :, :1], value_cache=a["value_cache"][:, :, :1]), "key_cache must have KH = 2 heads like k"),
        r("flash_cache_head_dim", lambda a: dict(key_cache=a["key_cache"][..., :4], value_cache=a["value_cache"][..., :4]), "key_cache must have D = 8 like k"),
        r("flash_page_size_zero", lambda a: dict(key_cache=a["key_cache"][:, :0], value_cache=a["value_cache"][:, :0]), "key_cache must have a page size P >= 1"),
        paged("paged_x_not_power_of_two", lambda a: dict(key_cache=floats(3, 2, 2, 4, 3)), "key_cache must have X (its last dimension) a power of two, got 3"),
        paged("paged_x_not_dividing_d", lambda a: dict(key_cache=floats(3, 2, 0, 4, 16)),
              "key_cache cannot hold head dim D = 8 in the paged layout [num_blocks, KH, D//X, P, X]: X (its last "
              "dimension) must divide D, got X = 16"),
        paged("paged_x_times_dx", lambda a: dict(key_cache=floats(3, 2, 1, 4, 4)), "key_cache must have D//X * X = D = 8 (dimensions 2 and 4)"),
        paged("paged_value_shape", lambda a: dict(value_cache=floats(3, 2, 4, 8)), "value_cache must be [num_blocks, KH, D, P] for a paged key_cache = (3, 2, 8, 4)"),
        paged("paged_value_rank", lambda a: dict(value_cache=floats(3, 2, 8)), "value_cache must be [num_blocks, KH, D, P] or [num_blocks, KH, P//X, D, X] for a paged key_cache"),
        paged("paged_cache_heads", lambda a: dict(key_cache=floats(3, 1, 2, 4, 4)), "key_cache must have KH = 2 heads like k"),
        paged("paged_page_size_zero", lambda a: dict(key_cache=floats(3, 2, 2, 0, 4), value_cache=floats(3, 2, 8, 0)), "key_cache must have a page size P >= 1"),
        shuffled("shuffled_page_not_multiple_of_x", lambda a: dict(key_cache=floats(3, 2, 2, 6, 4), value_cache=floats(3, 2, 1, 8, 4)), "value_cache needs P divisible by X = 4 for the shuffled layout, got P = 6"),
        shuffled("shuffled_value_shape", lambda a: dict(value_cache=floats(3, 2, 1, 8, 2)), "value_cache must be [num_blocks, KH, P//X, D, X] for a paged key_cache = (3, 2, 1, 8, 4)"),
        r("key_cache_dtype", lambda a: dict(key_cache=a["key_cache"].half(), value_cache=a["value_cache"].half()), "key_cache must have dtype bfloat16 or float8_e4m3fn"),
        r("value_cache_dtype", lambda a: dict(value_cache=a["value_cache"].half()), "value_cache must have key_cache's dtype bfloat16"),
        r("value_cache_fp8_key_bf16", lambda a: dict(value_cache=a["value_cache"].to(torch.float8_e4m3fn)), "value_cache must have key_cache's dtype bfloat16"),
        r("flash_value_head_dim", lambda a: dict(value_cache=a["value_cache"][..., :4]), "value_cache must have key_cache's shape (3, 4, 2, 8) (flash layout)"),
        r("is_neox_string", lambda a: dict(is_neox="false"), "is_neox must be a bool, got 'false'"),
        r("is_neox_none", lambda a: dict(is_neox=None), "is_neox must be a bool, got None"),
        r("is_neox_int", lambda a: dict(is_neox=1), "is_neox must be a bool, got 1"),
        r("is_neox_list", lambda a: dict(is_neox=[True]), "is_neox must be a bool, got [True]"),
        r("return_zeros_string", lambda a: dict(return_zeros="yes"), "return_zeros must be a bool, got 'yes'"),
    ]


def _compress_rows():
    r = _rows("compress_groups")
    return [
        r("ratio_zero", lambda a: dict(compress_ratio=0), "compress_ratio must be a positive int, got 0"),
        r("ratio_negative", lambda a: dict(compress_ratio=-2), "compress_ratio must be a positive int, got -2"),
        r("ratio_float", lambda a: dict(compress_ratio=2.0), "compress_ratio must be a positive int, got 2.0"),
        r("ratio_bool", lambda a: dict(compress_ratio=True), "compress_ratio must be a positive int, got True"),
        r("ratio_none", lambda a: dict(compress_ratio=None), "compress_ratio must be a positive int, got None"),
        r("ratio_string", lambda a: dict(compress_ratio="2"), "compress_ratio must be a positive int, got '2'"),
        r("ratio_list", lambda a: dict(compress_ratio=[2]), "compress_ratio must be a positive int, got [2]"),
        r("ratio_numpy_float", lambda a: dict(compress_ratio=np.float64(2.0)), "compress_ratio must be a positive int, got np.float64(2.0)"),
        r("raw_keys_rank", lambda a: dict(raw_keys=a["raw_keys"][:, 0]), "raw_keys must be [R, 1, D] (rank 3)"),
        r("raw_keys_dtype", lambda a: dict(raw_keys=a["raw_keys"].to(I32)), "raw_keys must have dtype bfloat16 or float16 or float32"),
        r("raw_keys_heads", lambda a: dict(raw_keys=a["raw_keys"].expand(-1, 2, -1).contiguous()), "raw_keys must have heads = 1 in dimension 1"),
        r("raw_keys_head_dim_zero", lambda a: dict(raw_keys=a["raw_keys"][..., :0], compressor_state_cache=a["compressor_state_cache"][..., :0]), "raw_keys must have head dim D >= 1"),
        r("raw_positions_shape", lambda a: dict(raw_positions=a["raw_positions"][..., :2]), "raw_positions must be [R, 1, 3] = (6, 1, 3)"),
        r("raw_positions_rows", lambda a: dict(raw_positions=a["raw_positions"][1:]), "raw_positions must be [R, 1, 3] = (6, 1, 3)"),
        r("raw_positions_dtype", lambda a: dict(raw_positions=a["raw_positions"].float()), "raw_positions must have dtype int32 or int64"),
        r("token_to_req_length", lambda a: dict(token_to_req=a["token_to_req"][:-1]), "token_to_req must have R = 6 entries"),
        r("token_to_req_dtype", lambda a: dict(token_to_req=a["token_to_req"].float()), "token_to_req must have dtype int32 or int64"),
        r("logical_positions_length", lambda a: dict(logical_positions=a["logical_positions"][:2]), "logical_positions must have R = 6 entries"),
        r("logical_positions_dtype", lambda a: dict(logical_positions=a["logical_positions"].float()), "logical_positions must have dtype int32 or int64"),
        r("compressed_slots_rank", lambda a: dict(compressed_slots=a["compressed_slots"][:, None]), "compressed_slots must be [R] (rank 1)"),
        r("compressed_slots_length", lambda a: dict(compressed_slots=a["compressed_slots"][:-2]), "compressed_slots must have R = 6 entries"),
        r("compressed_slots_dtype", lambda a: dict(compressed_slots=a["compressed_slots"].to(torch.int16)), "compressed_slots must have dtype int32 or int64"),
        r("ring_rank", lambda a: dict(compressor_state_cache=a["compressor_state_cache"][:, :, 0]), "compressor_state_cache must be [blocks, ring, 1, D] (rank 4)"),
        r("ring_heads", lambda a: dict(compressor_state_cache=a["compressor_state_cache"].expand(-1, -1, 2, -1).contiguous()), "compressor_state_cache must have heads = 1 in dimension 2"),
        r("ring_smaller_than_ratio", lambda a: dict(compress_ratio=4), "compressor_state_cache must have a ring of at least compress_ratio = 4 slots (dimension 1)"),
        r("ring_of_zero_slots", lambda a: dict(compressor_state_cache=a["compressor_state_cache"][:, :0]), "compressor_state_cache must have a ring of at least compress_ratio = 2 slots"),
        r("ring_head_dim", lambda a: dict(compressor_state_cache=a["compressor_state_cache"][..., :4]), "compressor_state_cache must have raw_keys' head dim D = 8"),
        r("ring_dtype", lambda a: dict(compressor_state_cache=a["compressor_state_cache"].half()), "compressor_state_cache must have raw_keys' dtype bfloat16"),
        r("ring_no_blocks_with_rows", lambda a: dict(compressor_state_cache=a["compressor_state_cache"][:0], rope_cache=a["rope_cache"][:0]), "compressor_state_cache must have at least one block when there are rows"),
        r("query_start_loc_rank", lambda a: dict(query_start_loc=a["query_start_loc"][None]), "query_start_loc must be [B + 1] (rank 1)"),
        r("query_start_loc_dtype", lambda a: dict(query_start_loc=a["query_start_loc"].float()), "query_start_loc must have dtype int32 or int64"),
        r("query_start_loc_one_entry", lambda a: dict(query_start_loc=a["query_start_loc"][:1]), "query_start_loc must have B + 1 >= 2 entries"),
        r("query_start_loc_empty", lambda a: dict(query_start_loc=a["query_start_loc"][:0]), "query_start_loc must have B + 1 >= 2 entries"),
        r("block_table_rank", lambda a: dict(compressor_state_block_table=a["compressor_state_block_table"][:, 0]), "compressor_state_block_table must be [>= B, >= 1] (rank 2)"),
        r("block_table_dtype", lambda a: dict(compressor_state_block_table=a["compressor_state_block_table"].float()), "compressor_state_block_table must have dtype int32 or int64"),
        r("block_table_too_few_rows", lambda a: dict(compressor_state_block_table=a["compressor_state_block_table"][:1]), "compressor_state_block_table must have at least B = 2 rows and one column"),
        r("block_table_no_column", lambda a: dict(compressor_state_block_table=a["compressor_state_block_table"][:, :0]), "compressor_state_block_table must have at least B = 2 rows and one column"),
        r("rope_cache_shape", lambda a: dict(rope_cache=a["rope_cache"][:, :2]), "rope_cache must be [blocks, ring, 1, 3] like compressor_state_cache = (2, 3, 1, 3)"),
        r("rope_cache_width", lambda a: dict(rope_cache=a["rope_cache"][..., :2]), "rope_cache must be [blocks, ring, 1, 3] like compressor_state_cache"),
        r("rope_cache_dtype", lambda a: dict(rope_cache=a["rope_cache"].long()), "rope_cache must have raw_positions' dtype int32"),
    ]


def _store_rows():
    r = _rows("store_cache_rows")
    fp8 = _rows("store_cache_rows", store_fp8)
    return [
        r("cache_rank", lambda a: dict(cache=a["cache"][:, :, 0]), "cache must be [pages, P, 1, W] (rank 4)"),
        r("cache_heads", lambda a: dict(cache=a["cache"].expand(-1, -1, 2, -1).contiguous()), "cache must have heads = 1 in dimension 2"),
        r("cache_no_pages", lambda a: dict(cache=a["cache"][:0]), "cache must have nonzero dimensions"),
        r("cache_page_size_zero", lambda a: dict(cache=a["cache"][:, :0]), "cache must have nonzero dimensions"),
        r("cache_width_zero", lambda a: dict(cache=a["cache"][..., :0], rows=a["rows"][:, :0]), "cache must have nonzero dimensions"),
        r("cache_dtype", lambda a: dict(cache=a["cache"].to(torch.uint8), rows=a["rows"].to(torch.uint8)), "cache must have dtype bfloat16 or float16 or float32 or float8_e4m3fn or int32 or int64"),
        r("cache_float64", lambda a: dict(cache=a["cache"].double(), rows=a["rows"].double()), "cache must have dtype"),
        r("slot_mapping_rank", lambda a: dict(slot_mapping=a["slot_mapping"][:, None]), "slot_mapping must be [R] (rank 1)"),
        r("slot_mapping_dtype", lambda a: dict(slot_mapping=a["slot_mapping"].float()), "slot_mapping must have dtype int32 or int64"),
        r("rows_rank", lambda a: dict(rows=a["rows"][0]), "rows must be [R, W] or [R, 1, W]"),
        r("rows_rank_4", lambda a: dict(rows=a["rows"][:, None, None]), "rows must be [R, W] or [R, 1, W]"),
        r("rows_heads", lambda a: dict(rows=a["rows"][:, None].expand(-1, 2, -1).contiguous()), "rows must have heads = 1 in dimension 1"),
        r("rows_count", lambda a: dict(rows=a["rows"][:2]), "rows must have one row per slot_mapping entry (R = 3) of cache's width W = 5"),
        r("rows_width", lambda a: dict(rows=a["rows"][:, :4]), "rows must have one row per slot_mapping entry (R = 3) of cache's width W = 5"),
        r("rows_dtype", lambda a: dict(rows=a["rows"].half()), "rows must have cache's dtype bfloat16"),
        # fp8 caches: quantising stores take a scale, and only they do.
        r("scale_for_bf16_cache", lambda a: dict(scale=torch.ones((), device=DEVICE)), "scale must be None for a bfloat16 cache (a scale quantises rows into a float8_e4m3fn cache), got an array of shape ()"),
        r("fp8_cache_bf16_rows_no_scale", lambda a: dict(cache=a["cache"].to(FP8)), "scale must be given to store bfloat16 rows into a float8_e4m3fn cache, got None"),
        r("fp8_cache_int_rows_no_scale", lambda a: dict(cache=a["cache"].to(FP8), rows=a["rows"].to(I32)), "rows must have cache's dtype float8_e4m3fn, got int32"),
        fp8("scale_two_elements", lambda a: dict(scale=torch.ones(2, device=DEVICE)), "scale must be a 0-d or 1-element tensor, got shape (2,)"),
        fp8("scale_dtype", lambda a: dict(scale=ints([1])), "scale must have dtype bfloat16 or float16 or float32, got int32"),
        fp8("quantised_rows_int", lambda a: dict(rows=a["rows"].to(I32)), "rows must have dtype bfloat16 or float16 or float32, got int32"),
        fp8("quantised_rows_fp8", lambda a: dict(rows=a["rows"].to(FP8)), "rows must have dtype bfloat16 or float16 or float32, got float8_e4m3fn"),
    ]


def _scoring_rows(function: str):
    r = _rows(function)
    return [
        r("q_rank", lambda a: dict(q=a["q"][0]), "q must be [R, H, D] (rank 3)"),
        r("q_dtype", lambda a: dict(q=a["q"].to(I32)), "q must have dtype bfloat16 or float16 or float32"),
        r("q_no_heads", lambda a: dict(q=a["q"][:, :0]), "q must have at least one head and a head dim D >= 1"),
        r("q_head_dim_zero", lambda a: dict(q=a["q"][..., :0], k_cache=a["k_cache"][..., :0]), "q must have at least one head and a head dim D >= 1"),
        r("k_cache_rank", lambda a: dict(k_cache=a["k_cache"][:, :, 0]), "k_cache must be [num_pages, P, 1, D] (rank 4)"),
        r("k_cache_dtype", lambda a: dict(k_cache=a["k_cache"].double()), "k_cache must have dtype bfloat16 or float16 or float32"),
        r("k_cache_heads", lambda a: dict(k_cache=a["k_cache"].expand(-1, -1, 2, -1).contiguous()), "k_cache must have one key head (dimension 2 of size 1)"),
        r("k_cache_head_dim", lambda a: dict(k_cache=a["k_cache"][..., :8]), "k_cache must have q's head dim D = 16"),
        r("k_cache_page_size_zero", lambda a: dict(k_cache=a["k_cache"][:, :0]), "k_cache must have a page size P >= 1"),
        r("page_table_rank", lambda a: dict(page_table=a["page_table"][0]), "page_table must be [B, W] (rank 2)"),
        r("page_table_dtype", lambda a: dict(page_table=a["page_table"].float()), "page_table must have dtype int32 or int64"),
        r("token_to_req_rank", lambda a: dict(token_to_req=a["token_to_req"][:, None]), "token_to_req must be [R] (rank 1)"),
        r("token_to_req_dtype", lambda a: dict(token_to_req=a["token_to_req"].float()), "token_to_req must have dtype int32 or int64"),
        r("token_to_req_length", lambda a: dict(token_to_req=a["token_to_req"][:2]), "token_to_req must have R = 3 entries"),
        r("query_positions_length", lambda a: dict(query_positions=a["query_positions"][:0]), "query_positions must have R = 3 entries"),
        r("query_positions_dtype", lambda a: dict(query_positions=a["query_positions"].to(torch.int16)), "query_positions must have dtype int32 or int64"),
        r("sequence_lengths_length", lambda a: dict(sequence_lengths=a["sequence_lengths"][:1]), "sequence_lengths must have B = 2 entries"),
        r("sequence_lengths_rank", lambda a: dict(sequence_lengths=a["sequence_lengths"][None]), "sequence_lengths must be [B] (rank 1)"),
        r("ratio_zero", lambda a: dict(compress_ratio=0), "compress_ratio must be a positive int, got 0"),
        r("ratio_float", lambda a: dict(compress_ratio=2.0), "compress_ratio must be a positive int, got 2.0"),
        r("ratio_bool", lambda a: dict(compress_ratio=True), "compress_ratio must be a positive int, got True"),
    ]


def _key_scale_rows(function: str, base, fp8_base):
    """k_scale: given exactly for an fp8 k_cache, as a scalar float array."""
    r, fp8 = _rows(function, base), _rows(function, fp8_base)
    return [
        r("k_scale_for_bf16_keys", lambda a: dict(k_scale=torch.ones((), device=DEVICE)), "k_scale must be None for a bfloat16 k_cache (a scale is for float8_e4m3fn keys), got an array of shape ()"),
        fp8("k_scale_missing", lambda a: dict(k_scale=None), "k_scale must be given (a 0-d or 1-element float tensor) for a float8_e4m3fn k_cache, got None"),
        fp8("k_scale_matrix", lambda a: dict(k_scale=torch.ones(1, 1, device=DEVICE)), "k_scale must be a 0-d or 1-element tensor, got shape (1, 1)"),
        fp8("k_scale_dtype", lambda a: dict(k_scale=torch.ones((), dtype=torch.float64, device=DEVICE)), "k_scale must have dtype bfloat16 or float16 or float32, got float64"),
        fp8("fp8_queries", lambda a: dict(q=a["q"].to(FP8)), "q must have dtype bfloat16 or float16 or float32, got float8_e4m3fn"),
    ]


def _scores_rows():
    r = _rows("mqa_paged_scores")
    return _scoring_rows("mqa_paged_scores") + _key_scale_rows("mqa_paged_scores", scores, scores_fp8) + [
        r("num_columns_negative", lambda a: dict(num_columns=-1), "num_columns must be a non-negative int or None, got -1"),
        r("num_columns_float", lambda a: dict(num_columns=8.0), "num_columns must be a non-negative int or None, got 8.0"),
        r("num_columns_bool", lambda a: dict(num_columns=True), "num_columns must be a non-negative int or None, got True"),
        r("score_divisor_zero", lambda a: dict(score_divisor=0.0), "score_divisor must be a finite positive Python number or None, got 0.0"),
        r("score_divisor_negative", lambda a: dict(score_divisor=-2), "score_divisor must be a finite positive Python number or None, got -2"),
        r("score_divisor_nan", lambda a: dict(score_divisor=math.nan), "score_divisor must be a finite positive Python number or None, got nan"),
        r("score_divisor_bool", lambda a: dict(score_divisor=True), "score_divisor must be a finite positive Python number or None, got True"),
        r("score_divisor_string", lambda a: dict(score_divisor="2"), "score_divisor must be a finite positive Python number or None, got '2'"),
        r("score_divisor_inf", lambda a: dict(score_divisor=math.inf), "score_divisor must be a finite positive Python number or None, got inf"),
        r("score_divisor_list", lambda a: dict(score_divisor=[2.0]), "score_divisor must be a finite positive Python number or None, got [2.0]"),
        r("num_columns_string", lambda a: dict(num_columns="8"), "num_columns must be a non-negative int or None, got '8'"),
    ]


def _select_rows():
    r = _rows("select_paged_tokens")
    return _scoring_rows("select_paged_tokens") + _key_scale_rows("select_paged_tokens", select, select_fp8) + [
        r("token_topk_negative", lambda a: dict(token_topk=-2), "token_topk must be a non-negative int, got -2"),
        r("token_topk_float", lambda a: dict(token_topk=4.0), "token_topk must be a non-negative int, got 4.0"),
        r("token_topk_not_multiple", lambda a: dict(token_topk=5), "token_topk must be a multiple of compress_ratio = 2, got 5"),
        r("token_topk_bool", lambda a: dict(token_topk=True), "token_topk must be a non-negative int, got True"),
        r("token_topk_none", lambda a: dict(token_topk=None), "token_topk must be a non-negative int, got None"),
    ]


def _topk_rows():
    r = _rows("topk_blocks")
    return [
        r("logits_rank", lambda a: dict(logits=a["logits"][0]), "logits must be [R, C] (rank 2)"),
        r("logits_rank_3", lambda a: dict(logits=a["logits"][None]), "logits must be [R, C] (rank 2)"),
        r("logits_dtype", lambda a: dict(logits=a["logits"].double()), "logits must have dtype bfloat16 or float16 or float32"),
        r("logits_int", lambda a: dict(logits=a["logits"].to(I32)), "logits must have dtype bfloat16 or float16 or float32"),
        r("visible_rank", lambda a: dict(visible_blocks=a["visible_blocks"][None]), "visible_blocks must be [R] (rank 1)"),
        r("visible_dtype", lambda a: dict(visible_blocks=a["visible_blocks"].float()), "visible_blocks must have dtype int32 or int64"),
        r("visible_length", lambda a: dict(visible_blocks=a["visible_blocks"][:2]), "visible_blocks must have R = 3 entries"),
        r("k_negative", lambda a: dict(k=-1), "k must be a non-negative int, got -1"),
        r("k_float", lambda a: dict(k=3.0), "k must be a non-negative int, got 3.0"),
        r("k_bool", lambda a: dict(k=True), "k must be a non-negative int, got True"),
        r("k_none", lambda a: dict(k=None), "k must be a non-negative int, got None"),
        r("k_list", lambda a: dict(k=[3]), "k must be a non-negative int, got [3]"),
        r("k_string", lambda a: dict(k="3"), "k must be a non-negative int, got '3'"),
        r("k_numpy_bool", lambda a: dict(k=np.bool_(True)), "k must be a non-negative int, got np.True_"),
    ]


def _merge_rows():
    r = _rows("merge_attention_states")
    return [
        r("out_b_shape", lambda a: dict(out_b=a["out_b"][:, :3]), "out_b must have out_a's shape"),
        r("lse_a_dtype", lambda a: dict(lse_a=a["lse_a"].to(BF16)), "lse_a must have dtype float32"),
        r("lse_b_shape", lambda a: dict(lse_b=a["lse_b"][:, :2]), "lse_b must be [R, H] = (2, 4)"),
        r("out_a_rank", lambda a: dict(out_a=a["out_a"][0]), "out_a must be [R, H, D]"),
        r("out_a_dtype", lambda a: dict(out_a=a["out_a"].to(I32)), "out_a must have dtype"),
    ]


def _expand_rows():
    r = _rows("expand_block_indices")
    return [
        r("ratio_zero", lambda a: dict(compress_ratio=0), "compress_ratio must be a positive int, got 0"),
        r("ratio_float", lambda a: dict(compress_ratio=2.5), "compress_ratio must be a positive int, got 2.5"),
        r("ratio_bool", lambda a: dict(compress_ratio=True), "compress_ratio must be a positive int, got True"),
        r("token_topk_negative", lambda a: dict(token_topk=-4), "token_topk must be a non-negative int, got -4"),
        r("token_topk_float", lambda a: dict(token_topk=4.0), "token_topk must be a non-negative int, got 4.0"),
        r("token_topk_not_multiple", lambda a: dict(token_topk=5), "token_topk must be a multiple of compress_ratio = 2, got 5"),
        r("block_indices_rank", lambda a: dict(block_indices=a["block_indices"][0]), "block_indices must be [R, token_topk // compress_ratio] (rank 2)"),
        r("block_indices_dtype", lambda a: dict(block_indices=a["block_indices"].float()), "block_indices must have dtype int32 or int64"),
        r("block_indices_columns", lambda a: dict(block_indices=a["block_indices"][:, :1]), "block_indices must have token_topk // compress_ratio = 2 columns"),
        r("query_positions_length", lambda a: dict(query_positions=a["query_positions"][:2]), "query_positions must have R = 3 entries"),
        r("query_positions_dtype", lambda a: dict(query_positions=a["query_positions"].double()), "query_positions must have dtype int32 or int64"),
        r("sequence_lengths_rank", lambda a: dict(sequence_lengths=a["sequence_lengths"][None]), "sequence_lengths must be [B] (rank 1)"),
        r("sequence_lengths_dtype", lambda a: dict(sequence_lengths=a["sequence_lengths"].float()), "sequence_lengths must have dtype int32 or int64"),
        r("token_to_req_length", lambda a: dict(token_to_req=a["token_to_req"][:1]), "token_to_req must have R = 3 entries"),
        r("token_to_req_rank", lambda a: dict(token_to_req=a["token_to_req"][:, None]), "token_to_req must be [R] (rank 1)"),
    ]


def _attention_rows():
    r = _rows("sparse_paged_attention")
    fp8 = _rows("sparse_paged_attention", attention_fp8)
    d8 = lambda a: dict(q=floats(3, 4, 8), k_cache=floats(4, 4, 2, 8), v_cache=floats(4, 4, 2, 8))  # noqa: E731
    d24 = lambda a: dict(q=floats(3, 4, 24), k_cache=floats(4, 4, 2, 24), v_cache=floats(4, 4, 2, 24))  # noqa: E731
    d0 = lambda a: dict(q=floats(3, 4, 0), k_cache=floats(4, 4, 2, 0), v_cache=floats(4, 4, 2, 0))  # noqa: E731
    return [
        r("q_rank", lambda a: dict(q=a["q"][0]), "q must be [R, QH, D] (rank 3)"),
        r("k_cache_rank", lambda a: dict(k_cache=a["k_cache"][0]), "k_cache must be [num_blocks, P, KH, D] (flash layout) (rank 4)"),
        r("v_cache_rank", lambda a: dict(v_cache=a["v_cache"][None]), "v_cache must be [num_blocks, P, KH, D] (flash layout) (rank 4)"),
        r("q_fp32", lambda a: dict(q=a["q"].float(), k_cache=a["k_cache"].float(), v_cache=a["v_cache"].float()), "q must have dtype bfloat16 or float16"),
        r("k_cache_dtype", lambda a: dict(k_cache=a["k_cache"].half()), "k_cache must have q's dtype bfloat16"),
        r("v_cache_dtype", lambda a: dict(v_cache=a["v_cache"].half()), "v_cache must have q's dtype bfloat16"),
        r("v_cache_fp8", lambda a: dict(v_cache=a["v_cache"].to(torch.float8_e4m3fn)), "v_cache must have q's dtype bfloat16"),
        # Any multiple of 16 up to 256 since issue 50 (80, 96, 192 are valid).
        r("d_not_multiple_of_16", d24, "q must have head dim D a multiple of 16 from 16 to 256, got 24"),
        r("d_below_16", d8, "q must have head dim D a multiple of 16 from 16 to 256, got 8"),
        r("d_zero", d0, "q must have head dim D a multiple of 16 from 16 to 256, got 0"),
        r("cache_head_dim", lambda a: dict(k_cache=a["k_cache"][..., :8], v_cache=a["v_cache"][..., :8]), "k_cache must have q's head dim D = 16"),
        r("v_cache_shape", lambda a: dict(v_cache=a["v_cache"][:3]), "v_cache must have k_cache's shape (4, 4, 2, 16)"),
        r("qh_not_multiple_of_kh", lambda a: dict(q=a["q"][:, :3]), "q must have a number of heads QH divisible by k_cache's KH = 2, got QH = 3"),
        r("kh_zero", lambda a: dict(k_cache=a["k_cache"][:, :, :0], v_cache=a["v_cache"][:, :, :0]), "divisible by k_cache's KH = 0"),
        r("page_size_zero", lambda a: dict(k_cache=a["k_cache"][:, :0], v_cache=a["v_cache"][:, :0]), "k_cache must have a page size P >= 1"),
        r("token_indices_rank", lambda a: dict(token_indices=a["token_indices"][0]), "token_indices must be [R, W] (rank 2)"),
        r("token_indices_dtype", lambda a: dict(token_indices=a["token_indices"].float()), "token_indices must have dtype int32 or int64"),
        r("token_indices_rows", lambda a: dict(token_indices=a["token_indices"][:2]), "token_indices must have R = 3 rows like q"),
        r("block_table_rank", lambda a: dict(block_table=a["block_table"][0]), "block_table must be [B, max_pages] (rank 2)"),
        r("block_table_dtype", lambda a: dict(block_table=a["block_table"].to(torch.uint8)), "block_table must have dtype int32 or int64"),
        r("token_to_req_rank", lambda a: dict(token_to_req=a["token_to_req"][None]), "token_to_req must be [R] (rank 1)"),
        r("token_to_req_dtype", lambda a: dict(token_to_req=a["token_to_req"].float()), "token_to_req must have dtype int32 or int64"),
        r("token_to_req_length", lambda a: dict(token_to_req=a["token_to_req"][:2]), "token_to_req must have R = 3 entries like q"),
        r("softmax_scale_inf", lambda a: dict(softmax_scale=math.inf), "softmax_scale must be a finite Python number or None, got inf"),
        r("softmax_scale_nan", lambda a: dict(softmax_scale=math.nan), "softmax_scale must be a finite Python number or None, got nan"),
        r("softmax_scale_bool", lambda a: dict(softmax_scale=True), "softmax_scale must be a finite Python number or None, got True"),
        r("softmax_scale_string", lambda a: dict(softmax_scale="0.1"), "softmax_scale must be a finite Python number or None, got '0.1'"),
        r("softmax_scale_complex", lambda a: dict(softmax_scale=1j), "softmax_scale must be a finite Python number or None, got 1j"),
        r("softmax_scale_list", lambda a: dict(softmax_scale=[0.1]), "softmax_scale must be a finite Python number or None, got [0.1]"),
        r("softmax_scale_numpy_inf", lambda a: dict(softmax_scale=np.float32("inf")), "softmax_scale must be a finite Python number or None, got np.float32(inf)"),
        # fp8 caches: both fp8, both scales, and scales only for them.
        r("k_cache_fp8_v_cache_bf16", lambda a: dict(k_cache=a["k_cache"].to(FP8)), "v_cache must be float8_e4m3fn like k_cache, got bfloat16"),
        r("k_cache_fp16_with_bf16_q", lambda a: dict(k_cache=a["k_cache"].half(), v_cache=a["v_cache"].half()), "k_cache must have q's dtype bfloat16 or be float8_e4m3fn, got float16"),
        r("k_scale_for_bf16_caches", lambda a: dict(k_scale=torch.ones((), device=DEVICE)), "k_scale must be None for bfloat16 caches (scales are for float8_e4m3fn caches), got an array of shape ()"),
        r("v_scale_for_bf16_caches", lambda a: dict(v_scale=torch.ones(1, device=DEVICE)), "v_scale must be None for bfloat16 caches (scales are for float8_e4m3fn caches), got an array of shape (1,)"),
        fp8("k_scale_missing", lambda a: dict(k_scale=None), "k_scale must be given (a 0-d or 1-element float tensor) for float8_e4m3fn caches, got None"),
        fp8("v_scale_missing", lambda a: dict(v_scale=None), "v_scale must be given (a 0-d or 1-element float tensor) for float8_e4m3fn caches, got None"),
        fp8("k_scale_two_elements", lambda a: dict(k_scale=torch.ones(2, device=DEVICE)), "k_scale must be a 0-d or 1-element tensor, got shape (2,)"),
        fp8("v_scale_empty", lambda a: dict(v_scale=torch.ones(0, device=DEVICE)), "v_scale must be a 0-d or 1-element tensor, got shape (0,)"),
        fp8("v_scale_dtype", lambda a: dict(v_scale=ints([2])), "v_scale must have dtype bfloat16 or float16 or float32, got int32"),
        fp8("v_cache_bf16", lambda a: dict(v_cache=a["v_cache"].to(BF16)), "v_cache must be float8_e4m3fn like k_cache, got bfloat16"),
        fp8("fp8_q", lambda a: dict(q=a["q"].to(FP8)), "q must have dtype bfloat16 or float16, got float8_e4m3fn"),
        fp8("fp32_q", lambda a: dict(q=a["q"].float()), "q must have dtype bfloat16 or float16, got float32"),
        fp8("fp8_cache_shape", lambda a: dict(v_cache=a["v_cache"][:3]), "v_cache must have k_cache's shape (4, 4, 2, 16)"),
    ]


def _non_contiguous_rows():
    """Every array argument of every function with a last-dimension stride of 2 (torch only)."""
    rows = []
    for function, base in BASES.items():
        arrays, _ = base()
        for name, value in arrays.items():
            if isinstance(value, torch.Tensor) and value.dim() and value.shape[-1] > 1:
                rows.append(Bad(function, f"{name}_non_contiguous", lambda a, name=name: {name: strided(a[name])},
                                f"{name} must have a contiguous last dimension (stride 1)", base, torch_only=True))
    return rows


#: Optional array arguments (``None`` is valid for them).
OPTIONAL_ARRAYS = {"rope_reshape_and_cache": {"k_scale", "v_scale", "offsets", "swa_slot_mapping", "cos_sin"},
                   "compress_groups": {"rope_cache"}}


def _missing_array_rows():
    """``None`` for every required array argument of every function: a TypeError naming it."""
    rows = []
    for function, base in BASES.items():
        for name in base()[0]:
            if name not in OPTIONAL_ARRAYS.get(function, ()):
                rows.append(Bad(function, f"{name}_none", lambda a, name=name: {name: None},
                                f"{name} must be an array (it is required), got None", base, error=TypeError))
    return rows


#: Arguments updated in place, per function.
UPDATED_ARRAYS = {"rope_reshape_and_cache": ("key_cache", "value_cache"), "store_cache_rows": ("cache",)}


def _expanded_rows():
    """Every argument updated in place as an expanded (stride-0) view of its first page (torch only)."""
    def expand_first(tensor):
        return tensor[:1].expand(tensor.shape)
    return [Bad(function, f"{name}_expanded", lambda a, name=name: {name: expand_first(a[name])},
                f"{name} must not be an expanded view (a stride-0 dimension of size > 1): it is updated in place",
                BASES[function], torch_only=True)
            for function, names in UPDATED_ARRAYS.items() for name in names]


TABLE = (_rope_rows() + _compress_rows() + _store_rows() + _scores_rows() + _topk_rows() + _expand_rows()
         + _select_rows() + _attention_rows() + _merge_rows() + _non_contiguous_rows() + _missing_array_rows()
         + _expanded_rows())


def _build(row: Bad):
    arrays, options = row.base()
    changes = row.change({**arrays, **options})
    for name, value in changes.items():
        (arrays if name in arrays else options)[name] = value
    return arrays, options


def _jax_inputs(arrays: dict, options: dict):
    return ({name: (to_jax(value) if isinstance(value, torch.Tensor) else value) for name, value in arrays.items()},
            {name: (to_jax(value) if isinstance(value, torch.Tensor) else value) for name, value in options.items()})


def _raised(call) -> BaseException:
    with pytest.raises(Exception) as info:
        call()
    return info.value


@pytest.mark.parametrize("row", TABLE, ids=[row.id for row in TABLE])
def test_bad_argument(row: Bad):
    arrays, options = _build(row)
    torch_error = _raised(lambda: getattr(qsa_torch, row.function)(**arrays, **options))
    message = str(torch_error)
    assert type(torch_error) is row.error, f"{type(torch_error).__name__}: {message}"
    assert message.startswith(f"{row.function}: "), message
    assert row.expected in message, message
    if row.torch_only:
        return
    with jax.enable_x64(True):  # int64 stays int64 on the JAX side
        jax_arrays, jax_options = _jax_inputs(arrays, options)
        jax_error = _raised(lambda: getattr(qsa_jax, row.function)(**jax_arrays, **jax_options))
    assert type(jax_error) is type(torch_error) and str(jax_error) == message, (type(jax_error), str(jax_error))


#: The composed step and its containers: their own table (STEP_TABLE, below).
STEP_NAMES = {"qsa_attention_step", "QSAState", "StepMetadata"}


def test_table_covers_every_public_function():
    assert {row.function for row in TABLE} == set(BASES)
    assert set(qsa_torch.__all__) - STEP_NAMES == set(BASES), "a public function has no rows in the table"


#: Calls that launch kernels only to check shapes: on a GPU they would compile a kernel
#: per case for nothing the CPU run does not already show (scripts/sanitize.py runs
#: empty batches compiled, under memcheck).
CPU_ONLY = pytest.mark.skipif(not runtime.INTERPRETED, reason="shape checks; the GPU would only compile kernels")


def run_in_both_adapters(function: str, base: Callable) -> None:
    """Runs ``base``'s call of ``function`` in qsa_torch, then in qsa_jax (x64 on): neither raises."""
    arrays, options = base()
    getattr(qsa_torch, function)(**arrays, **options)
    with jax.enable_x64(True):
        jax_arrays, jax_options = _jax_inputs(arrays, options)
        jax.block_until_ready(getattr(qsa_jax, function)(**jax_arrays, **jax_options))


@CPU_ONLY
@pytest.mark.parametrize("function", list(BASES))
def test_bases_are_valid(function):
    """Each table row changes exactly one thing of a call that works in both adapters."""
    run_in_both_adapters(function, BASES[function])
    for base in (rope_paged, rope_shuffled) if function == "rope_reshape_and_cache" else ():
        qsa_torch.rope_reshape_and_cache(**base()[0], **base()[1])


# --------------------------------------------------------------------------
# Wrong array types, wrong devices
# --------------------------------------------------------------------------

ARGUMENTS = [(function, name) for function, base in BASES.items()
             for name, value in base()[0].items() if isinstance(value, torch.Tensor)]


@pytest.mark.parametrize("function, name", ARGUMENTS, ids=[f"{f}-{n}" for f, n in ARGUMENTS])
def test_wrong_framework_array_names_the_argument(function, name):
    arrays, options = BASES[function]()
    for value, got in ((host(arrays[name]), "ndarray"), (to_jax(arrays[name]), "ArrayImpl"), ([0, 1], "list")):
        error = _raised(lambda: getattr(qsa_torch, function)(**{**arrays, name: value}, **options))
        assert type(error) is TypeError and str(error) == f"{function}: {name} must be a torch.Tensor, got {got}", error
    jax_arrays, jax_options = _jax_inputs(arrays, options)
    for value, got in ((arrays[name], "Tensor"), ([0, 1], "list"), (3, "int")):
        error = _raised(lambda: getattr(qsa_jax, function)(**{**jax_arrays, name: value}, **jax_options))
        assert type(error) is TypeError and str(error) == f"{function}: {name} must be a JAX array, got {got}", error


@pytest.mark.skipif(not runtime.INTERPRETED, reason="CPU and meta tensors are two devices under the interpreter")
@pytest.mark.parametrize("function, name", ARGUMENTS, ids=[f"{f}-{n}" for f, n in ARGUMENTS])
def test_torch_meta_tensor_is_another_device(function, name):
    arrays, options = BASES[function]()
    first = next(iter(arrays))
    moved = {**arrays, name: arrays[name].to("meta")}
    error = _raised(lambda: getattr(qsa_torch, function)(**moved, **options))
    if name == first:  # the second argument is the odd one out
        second = list(arrays)[1]
        expected = f"{function}: all arrays must be on one device: {second} is on cpu, {first} is on meta"
    else:
        expected = f"{function}: all arrays must be on one device: {name} is on meta, {first} is on cpu"
    assert type(error) is ValueError and str(error) == expected, error


@pytest.mark.parametrize("function", list(BASES))
def test_torch_all_meta_gives_meta_results_without_launching(function):
    """All-meta calls are shape-only (the ops' fake implementations, issue 12): the eager results' shapes, no launch."""
    from qsa_kernels.launch import observe_launches

    arrays, options = BASES[function]()
    expected = getattr(qsa_torch, function)(**{n: a.clone() for n, a in arrays.items()}, **options)
    expected = expected if isinstance(expected, tuple) else (expected,)
    with observe_launches() as launches:
        got = getattr(qsa_torch, function)(**{n: a.to("meta") for n, a in arrays.items()}, **options)
    got = got if isinstance(got, tuple) else (got,)
    assert not launches
    assert [(t.shape, t.dtype, t.device.type) for t in got] == [(t.shape, t.dtype, "meta") for t in expected]


@pytest.mark.skipif(not runtime.INTERPRETED, reason="forces two XLA CPU devices in a CPU-only subprocess")
def test_jax_arrays_on_two_devices():
    """Every argument of every function, committed to a second (CPU) device."""
    code = textwrap.dedent("""
        import jax
        from tests import test_bad_arguments as t
        from tests.util import to_jax
        other = jax.devices("cpu")[1]
        failures = []
        for function, name in t.ARGUMENTS:
            arrays, options = t.BASES[function]()
            with jax.enable_x64(True):
                jax_arrays, jax_options = t._jax_inputs(arrays, options)
                first = next(iter(jax_arrays))
                jax_arrays[name] = jax.device_put(jax_arrays[name], other)
                try:
                    getattr(t.qsa_jax, function)(**jax_arrays, **jax_options)
                    failures.append(f"{function}/{name}: no error")
                except ValueError as error:
                    odd, base = (list(jax_arrays)[1], first) if name == first else (name, first)
                    expected = f"{function}: all arrays must be on one device: {odd} is on "
                    if not str(error).startswith(expected) or f", {base} is on " not in str(error):
                        failures.append(f"{function}/{name}: {error}")
        print("\\n".join(failures) or "ok")
    """)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "ok", result.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("function", list(BASES))
def test_cpu_arrays_in_a_compiled_process(function):
    arrays, options = BASES[function]()
    name = list(arrays)[-1]
    error = _raised(lambda: getattr(qsa_torch, function)(**{**arrays, name: arrays[name].cpu()}, **options))
    assert type(error) is ValueError and str(error).startswith(
        f"{function}: all arrays must be on one device: {name} is on cpu"), error
    error = _raised(lambda: getattr(qsa_torch, function)(**{n: a.cpu() for n, a in arrays.items()}, **options))
    assert type(error) is ValueError and str(error) == (
        f"{function}: this process runs compiled Triton kernels, so tensors must be on a CUDA device, got cpu"), error
    cpu = jax.devices("cpu")[0]
    with jax.enable_x64(True):
        jax_arrays, jax_options = _jax_inputs(arrays, options)
        jax_arrays = {n: jax.device_put(a, cpu) for n, a in jax_arrays.items()}
        error = _raised(lambda: getattr(qsa_jax, function)(**jax_arrays, **jax_options))
    assert type(error) is ValueError and str(error).startswith(
        f"{function}: this process runs compiled Triton kernels, so arrays must be on a CUDA device"), error


# --------------------------------------------------------------------------
# Zero-sized dimensions that are valid: empty batches run, results are empty
# --------------------------------------------------------------------------

def _zero_rope_tokens(a):
    return dict(q=a["q"][:0], k=a["k"][:0], v=a["v"][:0], slot_mapping=a["slot_mapping"][:0],
                positions=a["positions"][:0], offsets=a["offsets"][:0])


VALID_EMPTY = [
    # (function, name, change, shapes of the results)
    ("rope_reshape_and_cache", "no_tokens", _zero_rope_tokens, [(0, 4, 8), (0, 2, 8), (3, 4, 2, 8), (3, 4, 2, 8)]),
    ("rope_reshape_and_cache", "kv_only_rows", lambda a: dict(q=a["q"][:0], positions=a["positions"][:0], offsets=a["offsets"][:0]),
     [(0, 4, 8), (4, 2, 8), (3, 4, 2, 8), (3, 4, 2, 8)]),
    ("rope_reshape_and_cache", "no_query_heads", lambda a: dict(q=a["q"][:, :0]), [(3, 0, 8), (4, 2, 8), (3, 4, 2, 8), (3, 4, 2, 8)]),
    ("rope_reshape_and_cache", "no_pages", lambda a: dict(key_cache=a["key_cache"][:0], value_cache=a["value_cache"][:0]),
     [(3, 4, 8), (4, 2, 8), (0, 4, 2, 8), (0, 4, 2, 8)]),
    ("rope_reshape_and_cache", "no_cos_sin_rows", lambda a: dict(cos_sin=a["cos_sin"][:0]), [(3, 4, 8), (4, 2, 8), (3, 4, 2, 8), (3, 4, 2, 8)]),
    ("rope_reshape_and_cache", "no_cos_sin", lambda a: dict(cos_sin=None), [(3, 4, 8), (4, 2, 8), (3, 4, 2, 8), (3, 4, 2, 8)]),
    ("rope_reshape_and_cache", "scales_on_bf16_caches", lambda a: dict(k_scale=torch.full((), 0.5, device=DEVICE), v_scale=torch.full((1,), 2.0, device=DEVICE)),
     [(3, 4, 8), (4, 2, 8), (3, 4, 2, 8), (3, 4, 2, 8)]),
    ("rope_reshape_and_cache", "empty_swa_table", lambda a: dict(swa_slot_mapping=a["swa_slot_mapping"][:0]),
     [(3, 4, 8), (4, 2, 8), (3, 4, 2, 8), (3, 4, 2, 8)]),
    ("compress_groups", "no_rows", lambda a: {n: a[n][:0] for n in ("raw_keys", "raw_positions", "token_to_req", "logical_positions", "compressed_slots")},
     [(0, 1, 8), (0, 3)]),
    ("compress_groups", "no_rows_no_blocks", lambda a: {**{n: a[n][:0] for n in ("raw_keys", "raw_positions", "token_to_req", "logical_positions", "compressed_slots", "compressor_state_cache", "rope_cache")}},
     [(0, 1, 8), (0, 3)]),
    ("store_cache_rows", "no_rows", lambda a: dict(slot_mapping=a["slot_mapping"][:0], rows=a["rows"][:0]), [(4, 2, 1, 5)]),
    ("mqa_paged_scores", "no_rows", lambda a: {n: a[n][:0] for n in ("q", "token_to_req", "query_positions")}, [(0, 8), (0,)]),
    ("mqa_paged_scores", "no_requests", lambda a: dict(page_table=a["page_table"][:0], sequence_lengths=a["sequence_lengths"][:0]), [(3, 8), (3,)]),
    ("mqa_paged_scores", "no_pages", lambda a: dict(k_cache=a["k_cache"][:0]), [(3, 8), (3,)]),
    ("mqa_paged_scores", "zero_columns", lambda a: dict(num_columns=0), [(3, 0), (3,)]),
    ("topk_blocks", "no_rows", lambda a: dict(logits=a["logits"][:0], visible_blocks=a["visible_blocks"][:0]), [(0, 3)]),
    ("topk_blocks", "no_columns", lambda a: dict(logits=a["logits"][:, :0]), [(3, 3)]),
    ("topk_blocks", "k_zero", lambda a: dict(k=0), [(3, 0)]),
    ("expand_block_indices", "no_rows", lambda a: {n: a[n][:0] for n in ("block_indices", "query_positions", "token_to_req")}, [(0, 5)]),
    ("expand_block_indices", "no_blocks", lambda a: dict(block_indices=a["block_indices"][:, :0], token_topk=0), [(3, 1)]),
    ("expand_block_indices", "no_requests", lambda a: dict(sequence_lengths=a["sequence_lengths"][:0]), [(3, 5)]),
    ("select_paged_tokens", "no_rows", lambda a: {n: a[n][:0] for n in ("q", "token_to_req", "query_positions")}, [(0, 5)]),
    ("select_paged_tokens", "no_table_columns", lambda a: dict(page_table=a["page_table"][:, :0]), [(3, 5)]),
    ("select_paged_tokens", "token_topk_zero", lambda a: dict(token_topk=0), [(3, 1)]),
    ("sparse_paged_attention", "no_rows", lambda a: {n: a[n][:0] for n in ("q", "token_indices", "token_to_req")}, [(0, 4, 16)]),
    ("sparse_paged_attention", "no_tokens", lambda a: dict(token_indices=a["token_indices"][:, :0]), [(3, 4, 16)]),
    ("sparse_paged_attention", "no_blocks", lambda a: dict(k_cache=a["k_cache"][:0], v_cache=a["v_cache"][:0]), [(3, 4, 16)]),
    ("sparse_paged_attention", "no_requests", lambda a: dict(block_table=a["block_table"][:0]), [(3, 4, 16)]),
    ("sparse_paged_attention", "empty_block_table_rows", lambda a: dict(block_table=a["block_table"][:, :0]), [(3, 4, 16)]),
]


@CPU_ONLY
@pytest.mark.parametrize("function, name, change, shapes", VALID_EMPTY, ids=[f"{c[0]}-{c[1]}" for c in VALID_EMPTY])
def test_valid_zero_sized_dimensions(function, name, change, shapes):
    row = Bad(function, name, change, "", BASES[function])
    arrays, options = _build(row)
    out = getattr(qsa_torch, function)(**arrays, **options)
    out = out if isinstance(out, tuple) else (out,)
    assert [tuple(o.shape) for o in out] == shapes
    with jax.enable_x64(True):
        jax_arrays, jax_options = _jax_inputs(arrays, options)
        jax_out = jax.jit(lambda xs: getattr(qsa_jax, function)(**xs, **jax_options))(jax_arrays)
    jax_out = jax_out if isinstance(jax_out, tuple) else (jax_out,)
    assert [tuple(o.shape) for o in jax_out] == shapes


# --------------------------------------------------------------------------
# The composed step: its own checks, and the containers of its arrays
# --------------------------------------------------------------------------

def step_arguments():
    """Keyword arguments of one valid torch step: T = 5 rows of 2 requests, QH = 4, KH = 2,
    D = 16, IH = 2, DI = 16, ratio 2, token_topk 4."""
    from qsa_kernels.paging import CacheGeometry, PagedRequests

    geometry = CacheGeometry(page_size=4, num_pages=8, compress_ratio=2, compressed_page_size=2,
                             num_compressed_pages=6, max_context=16, max_requests=2)
    metadata = qsa_torch.StepMetadata.from_host(PagedRequests(geometry).step({"a": 3, "b": 2}), DEVICE)
    state = qsa_torch.QSAState(**{name: floats(*shape, dtype=BF16 if name in ("key_cache", "value_cache") else FP32)
                                  for name, shape in geometry.state_shapes(2, 16, 16).items()})
    return dict(q=floats(5, 4, 16), k=floats(5, 2, 16), v=floats(5, 2, 16), index_q=floats(5, 2, 16, dtype=FP32),
                index_k=floats(5, 1, 16, dtype=FP32), state=state, metadata=metadata,
                cos_sin=floats(32, 16, dtype=FP32), index_cos_sin=floats(32, 16, dtype=FP32),
                compress_ratio=2, token_topk=4)


def step_to_jax(arguments: dict) -> dict:
    """The same call for qsa_jax: arrays, state and metadata converted."""
    def convert(value):
        if isinstance(value, torch.Tensor):
            return to_jax(value)
        for torch_type, jax_type in ((qsa_torch.QSAState, qsa_jax.QSAState), (qsa_torch.StepMetadata, qsa_jax.StepMetadata)):
            if isinstance(value, torch_type):
                return jax_type(**{f.name: convert(getattr(value, f.name)) for f in dataclasses.fields(value)})
        return value
    return {name: convert(value) for name, value in arguments.items()}


def _state(**changes):
    return lambda a: dict(state=dataclasses.replace(a["state"], **{n: f(a["state"]) for n, f in changes.items()}))


def _metadata(**changes):
    return lambda a: dict(metadata=dataclasses.replace(a["metadata"], **{n: f(a["metadata"]) for n, f in changes.items()}))


STEP_TABLE = [
    # (name, change, expected phrase); the step's own checks name the step ...
    ("token_topk_not_multiple", lambda a: dict(token_topk=3), "qsa_attention_step: token_topk must be a multiple of compress_ratio = 2, got 3"),
    ("token_topk_zero", lambda a: dict(token_topk=0), "qsa_attention_step: token_topk must be a positive int, got 0"),
    ("token_topk_float", lambda a: dict(token_topk=4.0), "qsa_attention_step: token_topk must be a positive int, got 4.0"),
    ("compress_ratio_zero", lambda a: dict(compress_ratio=0), "qsa_attention_step: compress_ratio must be a positive int, got 0"),
    ("compress_ratio_bool", lambda a: dict(compress_ratio=True), "qsa_attention_step: compress_ratio must be a positive int, got True"),
    ("no_rows", _metadata(positions=lambda m: m.positions[:0]), "qsa_attention_step: metadata must describe at least one row"),
    ("q_rows", lambda a: dict(q=a["q"][:4]), "qsa_attention_step: q must be [T, heads, dim] with T = 5 rows like metadata.positions"),
    ("q_rank", lambda a: dict(q=a["q"][:, 0]), "qsa_attention_step: q must be [T, heads, dim] with T = 5 rows"),
    ("k_rows", lambda a: dict(k=a["k"][1:]), "qsa_attention_step: k must be [T, heads, dim] with T = 5 rows"),
    ("v_rows", lambda a: dict(v=a["v"][:0]), "qsa_attention_step: v must be [T, heads, dim] with T = 5 rows"),
    ("index_q_rows", lambda a: dict(index_q=a["index_q"][:2]), "qsa_attention_step: index_q must be [T, heads, dim] with T = 5 rows"),
    ("index_k_rank", lambda a: dict(index_k=a["index_k"][:, 0]), "qsa_attention_step: index_k must be [T, heads, dim] with T = 5 rows"),
    ("index_k_heads", lambda a: dict(index_k=a["index_k"].expand(-1, 2, -1).contiguous()), "qsa_attention_step: index_k must have one head ([T, 1, DI])"),
    ("index_dtype_mismatch", lambda a: dict(index_k=a["index_k"].to(BF16)),
     "qsa_attention_step: index_k must have index_q's dtype float32, got bfloat16"),
    # q, k and v are checked before the state (the signature's order, issue 56): fp32 q/k/v with
    # a bf16 state names q, not state.key_cache.
    ("attention_dtype_fp32", lambda a: dict(q=a["q"].float(), k=a["k"].float(), v=a["v"].float()),
     "qsa_attention_step: q must have dtype bfloat16 or float16, got float32"),
    ("attention_dtype_fp32_state_too", lambda a: dict(q=a["q"].float(), k=a["k"].float(), v=a["v"].float(),
                                                      **_state(key_cache=lambda s: s.key_cache.float(),
                                                               value_cache=lambda s: s.value_cache.float())(a)),
     "qsa_attention_step: q must have dtype bfloat16 or float16, got float32"),
    ("k_dtype_before_state", lambda a: dict(k=a["k"].half(), **_state(key_cache=lambda s: s.key_cache.float())(a)),
     "qsa_attention_step: k must have q's dtype bfloat16, got float16"),
    ("v_head_dim_before_state", lambda a: dict(v=a["v"][..., :8], **_state(value_cache=lambda s: s.value_cache[:1])(a)),
     "qsa_attention_step: v must have k's shape (5, 2, 16), got shape (5, 2, 8)"),
    # A head-major K cache: the expected layout, blamed on state.key_cache (not state.value_cache).
    ("key_cache_head_major", _state(key_cache=lambda s: s.key_cache.transpose(1, 2).contiguous()),
     "qsa_attention_step: state.key_cache must be [num_pages, page_size, kv_heads, head_dim] (flash layout) with "
     "kv_heads = 2 and head_dim = 16 like k, got shape (8, 2, 4, 16)"),
    ("kv_caches_head_major", _state(key_cache=lambda s: s.key_cache.transpose(1, 2).contiguous(),
                                    value_cache=lambda s: s.value_cache.transpose(1, 2).contiguous()),
     "qsa_attention_step: state.key_cache must be [num_pages, page_size, kv_heads, head_dim] (flash layout)"),
    ("key_cache_paged_layout", _state(key_cache=lambda s: s.key_cache.reshape(8, 2, 2, 4, 8)),
     "qsa_attention_step: state.key_cache must be [num_pages, page_size, kv_heads, head_dim] (flash layout)"),
    ("value_cache_head_major", _state(value_cache=lambda s: s.value_cache.transpose(1, 2).contiguous()),
     "qsa_attention_step: state.value_cache must have state.key_cache's shape (8, 4, 2, 16) (flash layout), got shape (8, 2, 4, 16)"),
    # ... and so do the stages' checks, naming the step argument the stage's is bound to.
    ("index_cache_dtype_mismatch", lambda a: dict(index_q=a["index_q"].to(BF16), index_k=a["index_k"].to(BF16)),
     "qsa_attention_step: state.compressor_state_cache must have index_k's dtype bfloat16, got float32"),
]


@pytest.mark.parametrize("name, change, expected", STEP_TABLE, ids=[row[0] for row in STEP_TABLE])
def test_step_bad_argument(name, change, expected):
    arguments = step_arguments()
    arguments.update(change(arguments))
    torch_error = _raised(lambda: qsa_torch.qsa_attention_step(**arguments))
    assert type(torch_error) is ValueError and expected in str(torch_error), repr(torch_error)
    jax_error = _raised(lambda: qsa_jax.qsa_attention_step(**step_to_jax(arguments)))
    assert type(jax_error) is ValueError and str(jax_error) == str(torch_error), (str(jax_error), str(torch_error))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
def test_state_zeros_on_a_missing_device_names_the_function_and_the_argument():
    """torch's bare ``AssertionError`` (CUDA-less build) and JAX's error for a device it cannot
    use, wrapped in an error naming ``QSAState.zeros`` and its ``device`` argument (issue 56)."""
    from qsa_kernels.paging import CacheGeometry

    geometry = CacheGeometry(page_size=4, num_pages=8, compress_ratio=2, compressed_page_size=2,
                             num_compressed_pages=6, max_context=16, max_requests=2)
    for adapter, dtype in ((qsa_torch, BF16), (qsa_jax, jax.numpy.bfloat16)):
        error = _raised(lambda: adapter.QSAState.zeros(geometry, kv_heads=2, head_dim=16, index_head_dim=16,
                                                       dtype=dtype, device="cuda"))
        assert type(error) is ValueError, repr(error)
        assert str(error).startswith("QSAState.zeros: cannot allocate the caches on device='cuda' (the device "
                                     "argument): the framework raised "), str(error)
        assert error.__cause__ is not None


@CPU_ONLY
def test_step_base_is_valid():
    arguments = step_arguments()
    qsa_torch.qsa_attention_step(**arguments)
    jax.block_until_ready(qsa_jax.qsa_attention_step(**step_to_jax(step_arguments())))


STEP_ARRAYS = (["q", "k", "v", "index_q", "index_k", "cos_sin", "index_cos_sin"]
               + [f"state.{n}" for n in ("key_cache", "value_cache", "compressor_state_cache", "compressed_key_cache")]
               + [f"metadata.{f.name}" for f in dataclasses.fields(qsa_torch.StepMetadata)])


def _replace_array(arguments: dict, path: str, value) -> dict:
    container, _, field = path.rpartition(".")
    if not container:
        return {**arguments, path: value}
    return {**arguments, container: dataclasses.replace(arguments[container], **{field: value})}


def _get_array(arguments: dict, path: str):
    container, _, field = path.rpartition(".")
    return getattr(arguments[container], field) if container else arguments[path]


@pytest.mark.parametrize("path", STEP_ARRAYS)
def test_step_wrong_framework_array_names_the_argument(path):
    arguments = step_arguments()
    error = _raised(lambda: qsa_torch.qsa_attention_step(**_replace_array(arguments, path, host(_get_array(arguments, path)))))
    assert type(error) is TypeError and str(error) == f"qsa_attention_step: {path} must be a torch.Tensor, got ndarray"
    jax_arguments = step_to_jax(arguments)
    error = _raised(lambda: qsa_jax.qsa_attention_step(**_replace_array(jax_arguments, path, _get_array(arguments, path))))
    assert type(error) is TypeError and str(error) == f"qsa_attention_step: {path} must be a JAX array, got Tensor"


def test_step_wrong_containers():
    arguments = step_arguments()
    jax_arguments = step_to_jax(arguments)
    for adapter, name, value, expected in (
            (qsa_torch, "state", jax_arguments["state"], "state must be a qsa_torch.QSAState, got qsa_jax.QSAState"),
            (qsa_jax, "state", arguments["state"], "state must be a qsa_jax.QSAState, got qsa_torch.QSAState"),
            (qsa_torch, "metadata", dataclasses.asdict(arguments["metadata"]), "metadata must be a qsa_torch.StepMetadata, got dict"),
            (qsa_jax, "metadata", None, "metadata must be a qsa_jax.StepMetadata, got NoneType")):
        base = arguments if adapter is qsa_torch else jax_arguments
        error = _raised(lambda: adapter.qsa_attention_step(**{**base, name: value}))
        assert type(error) is TypeError and str(error) == f"qsa_attention_step: {expected}", error


@pytest.mark.skipif(not runtime.INTERPRETED, reason="CPU and meta tensors are two devices under the interpreter")
@pytest.mark.parametrize("path", ["k", "state.compressed_key_cache", "metadata.block_table"])
def test_step_meta_tensor_is_another_device(path):
    arguments = step_arguments()
    moved = _replace_array(arguments, path, _get_array(arguments, path).to("meta"))
    error = _raised(lambda: qsa_torch.qsa_attention_step(**moved))
    assert type(error) is ValueError and str(error) == (
        f"qsa_attention_step: all arrays must be on one device: {path} is on meta, q is on cpu"), error
