"""Every public plan's launches compile for sm_90 (the H200), and none spills.

Triton's interpreter accepts code that the compiler rejects (a non-constexpr
global, a constexpr ``if`` that returns early, values of different shapes
assigned in the branches of a runtime ``if``...), so the CPU suite alone
would let such bugs reach the GPU.  Here the launches of every plan, at
production geometry and at edge options, are compiled to PTX and cubin with
Triton's bundled ptxas, in one subprocess that does not interpret
(``TRITON_INTERPRET=0``: ``qsa_kernels.runtime`` then decides "compiled"),
and each cubin's registers and local memory are read with the bundled
cuobjdump.

A spill fails its case under every admitted Triton (3.6 to 3.9: each has its
own register allocation, and each series' defaults are chosen spill-free,
``qsa_kernels.tuning.NEWER_TRITON``), except the few of ``SPILLS_ALLOWED``;
CI runs this check under each series (.ci/run).

Launches are specialised as the torch adapter's calls are (:func:`specialise`).
The JAX adapter passes scalars as compile-time constants instead: that
variant is not compiled here.

The register table of every launch::

    TRITON_INTERPRET=0 QSA_PDL_EMIT=1 .venv/bin/python -m tests.test_compile_sm90
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from qsa_kernels.attention import plan_sparse_paged_attention
from qsa_kernels.compress import plan_compress_groups, plan_store_cache_rows, plan_store_rows_in_table
from qsa_kernels.fused import plan_compress_rotate_store
from qsa_kernels.launch import ArrayInfo, Launch
from qsa_kernels.rope_cache import plan_rope_reshape_and_cache
from qsa_kernels.expand import plan_expand_block_indices
from qsa_kernels.score import plan_mqa_paged_scores
from qsa_kernels.select import plan_select_paged_tokens
from qsa_kernels.topk import plan_topk_blocks
from qsa_kernels.tuning import TRITON_SERIES, AttentionTuning, SelectTuning, TopkTuning

ROOT = Path(__file__).resolve().parent.parent
#: The Triton series pyproject.toml admits (triton>=3.6,<3.10): CI runs this check on each.
ADMITTED_SERIES = ("3.6", "3.7", "3.8", "3.9")
a = ArrayInfo.contiguous
I32, I64, BF16, FP16, FP32, FP8 = "int32", "int64", "bfloat16", "float16", "float32", "float8_e4m3fn"

# --------------------------------------------------------------------------
# The cases: label -> (plan, keyword arguments).  Production geometry
# (docs/design.md, "Benchmark geometry"): attention 24 Q / 2 KV heads x d256 bf16,
# KV pages of 64; indexer 4 heads x d128, compress ratio 4, compressed pages
# of 64, top-512 blocks (2048 tokens); contexts up to 1M tokens.
# --------------------------------------------------------------------------


def _rope(t=2048, t_kv=None, qh=24, kh=2, d=256, dtype=BF16, layout="flash", x=8, page=64, pages=4096,
          cache=None, full_rotary=False, cos_dtype=FP32, index=I32, is_neox=True, scales=False,
          offsets=False, swa=False, zeros=False):
    t_kv = t if t_kv is None else t_kv
    cache = cache or dtype
    if layout == "flash":
        key = value = a((pages, page, kh, d), cache)
    else:  # paged keys, with paged or shuffled values
        key = a((pages, kh, d // x, page, x), cache)
        value = a((pages, kh, d, page) if layout == "paged" else (pages, kh, page // x, d, x), cache)
    scale = a((1,), FP32) if scales else None
    return plan_rope_reshape_and_cache, dict(
        q=a((t, qh, d), dtype), k=a((t_kv, kh, d), dtype), v=a((t_kv, kh, d), dtype),
        key_cache=key, value_cache=value, slot_mapping=a((t_kv,), index), positions=a((t,), index),
        cos_sin=a((1 << 17, 2 * d if full_rotary else d), cos_dtype), is_neox=is_neox,
        k_scale=scale, v_scale=scale, offsets=a((t,), index) if offsets else None,
        swa_slot_mapping=a((pages * page,), index) if swa else None, return_zeros=zeros)


def _compress(rows, d, requests, rope_cache=True, index=I32, dtype=BF16, ratio=4):
    ring = 2 * ratio
    return plan_compress_groups, dict(
        raw_keys=a((rows, 1, d), dtype), raw_positions=a((rows, 1, 3), index),
        compressor_state_cache=a((requests, ring, 1, d), dtype),
        compressor_state_block_table=a((requests, 1), I32), token_to_req=a((rows,), I32),
        query_start_loc=a((requests + 1,), I32), logical_positions=a((rows,), index),
        compressed_slots=a((rows,), index), compress_ratio=ratio,
        rope_cache=a((requests, ring, 1, 3), index) if rope_cache else None)


def _fused_compression(rows, d=128, requests=None, dtype=BF16, ratio=4, cache=None, index=I32, heads=4,
                       is_neox=True, full_rotary=False):
    """The composed step's fused stage 2 + index-query RoPE (kernels/step.py, at most
    StepTuning.fused_max_rows rows)."""
    requests = requests or rows
    cache = cache or dtype
    return plan_compress_rotate_store, dict(
        raw_keys=a((rows, 1, d), dtype), raw_positions=a((rows, 1, 3), index),
        compressor_state_cache=a((requests, 2 * ratio, 1, d), dtype),
        compressor_state_block_table=a((requests, 1), I32), token_to_req=a((rows,), index),
        query_start_loc=a((requests + 1,), index), logical_positions=a((rows,), index),
        compressed_slots=a((rows,), index), compressor_state_slots=a((rows,), index),
        compressed_key_cache=a((4096, 64, 1, d), cache), cos_sin=a((1 << 17, 2 * d if full_rotary else d), FP32),
        index_q=a((rows, heads, d), dtype), compress_ratio=ratio, is_neox=is_neox,
        scale=a((), FP32) if cache == FP8 else None, max_row_position=1 << 17)


def _first_launch_of_step(**arrays_and_options):
    """The composed step's plan with its first launch only (the selection and the attention have
    cases of their own)."""
    from qsa_kernels.step import plan_qsa_attention_step

    program = plan_qsa_attention_step(**arrays_and_options)
    return dataclasses.replace(program, launches=program.launches[:1])


def _stages_1_and_2(requests, context=131072, cache=BF16, d=256, di=128):
    """The composed decode step's first launch (a row per request): at 1-16 rows its stages 1 and 2
    in one (kernels/fused.py: rope_compress_store_kernel); head dims ``d`` (attention) and ``di``
    (the indexer)."""
    from qsa_kernels.paging import CacheGeometry

    b = requests
    g = CacheGeometry(page_size=64, num_pages=b * -(-context // 64), compress_ratio=4, compressed_page_size=64,
                      num_compressed_pages=b * -(-(context // 4) // 64), max_context=context, max_requests=b)
    scales = dict(k_scale=a((), FP32), v_scale=a((), FP32), compressed_key_scale=a((), FP32)) if cache == FP8 else {}
    return _first_launch_of_step, dict(
        q=a((b, 24, d), BF16), k=a((b, 2, d), BF16), v=a((b, 2, d), BF16), index_q=a((b, 4, di), BF16),
        index_k=a((b, 1, di), BF16), **{name: a(shape, cache if name != "compressor_state_cache" else BF16)
                                        for name, shape in g.state_shapes(2, d, di).items()},
        slot_mapping=a((b,), I32), positions=a((b,), I32), raw_positions=a((b, 1, 3), I32),
        token_to_req=a((b,), I32), query_start_loc=a((b + 1,), I32), sequence_lengths=a((b,), I32),
        block_table=a((b, g.table_width), I32), compressed_block_table=a((b, g.compressed_table_width), I32),
        compressed_slots=a((b,), I32), compressor_state_block_table=a((b, 1), I32),
        compressor_state_slots=a((b,), I32), cos_sin=a((context, d), FP32),
        index_cos_sin=a((context, di), FP32), compress_ratio=4, token_topk=2048, **scales)


def _store(rows, width, dtype, index=I32, squeezed=True, quantise_from=None):
    row_dtype = quantise_from or dtype
    scale = dict(scale=a((1,), FP32)) if quantise_from else {}
    return plan_store_cache_rows, dict(cache=a((8192, 64, 1, width), dtype), slot_mapping=a((rows,), index),
                                       rows=a((rows, width) if squeezed else (rows, 1, width), row_dtype), **scale)


def _store_in_table(rows, width, dtype, index=I32, quantise_from=None):
    """The composed step's ring and compressed-key stores (rows past cos_sin skipped by position)."""
    scale = dict(scale=a((), FP32)) if quantise_from else {}
    return plan_store_rows_in_table, dict(cache=a((8192, 64, 1, width), dtype), slot_mapping=a((rows,), index),
                                          rows=a((rows, 1, width), quantise_from or dtype),
                                          positions=a((rows,), index), max_position=1 << 17, **scale)


def _scoring(rows, requests, context, heads=4, d=128, q=BF16, k=BF16, page=64, index=I32):
    pages = -(-context // 4 // page)
    scale = dict(k_scale=a((), FP32)) if k == FP8 else {}
    return dict(q=a((rows, heads, d), q), k_cache=a((65536, page, 1, d), k),
                page_table=a((requests, pages), index), token_to_req=a((rows,), index),
                query_positions=a((rows,), index), sequence_lengths=a((requests,), index), **scale)


def _scores(rows, requests, context, num_columns=None, score_divisor=None, tuning=None, **kw):
    """``tuning``: SelectTuning fields (the fp8 variants benchmarks/bench_select.py times)."""
    return plan_mqa_paged_scores, dict(_scoring(rows, requests, context, **kw), compress_ratio=4,
                                       num_columns=num_columns, score_divisor=score_divisor,
                                       **(dict(tuning=SelectTuning(**tuning)) if tuning else {}))


def _topk(rows, columns, k, dtype=FP32, index=I32, **tuning):
    """``tuning``: TopkTuning fields (a path forced, as benchmarks/bench_topk.py does)."""
    return plan_topk_blocks, dict(logits=a((rows, columns), dtype), visible_blocks=a((rows,), index), k=k,
                                  tuning=TopkTuning(**tuning))


def _expand(rows, token_topk, ratio=4, index=I32):
    return plan_expand_block_indices, dict(
        block_indices=a((rows, token_topk // ratio), index), query_positions=a((rows,), index),
        sequence_lengths=a((rows,), index), token_to_req=a((rows,), index),
        compress_ratio=ratio, token_topk=token_topk)


def _select(rows, requests, context, token_topk=2048, topk=None, **kw):
    """``topk``: TopkTuning fields (the fused selection's top-k variants)."""
    return plan_select_paged_tokens, dict(_scoring(rows, requests, context, **kw), token_topk=token_topk,
                                          compress_ratio=4, **(dict(topk_tuning=TopkTuning(**topk)) if topk else {}))


def _attention(rows, qh=24, kh=2, d=256, dtype=BF16, index=I32, width=2051, page=64, scale=None, cache=None,
               **tuning):
    """``tuning``: AttentionTuning fields (the variants benchmarks/bench_sparse_attention.py times)."""
    cache = cache or dtype
    scales = dict(k_scale=a((), FP32), v_scale=a((1,), FP32)) if cache == FP8 else {}
    return plan_sparse_paged_attention, dict(
        q=a((rows, qh, d), dtype), k_cache=a((4096, page, kh, d), cache), v_cache=a((4096, page, kh, d), cache),
        token_indices=a((rows, width), index), block_table=a((max(rows, 8), 2048), index),
        token_to_req=a((rows,), index), softmax_scale=scale, **scales,
        **(dict(tuning=AttentionTuning(**tuning)) if tuning else {}))


CASES = {
    # Stage 1: rope_reshape_and_cache.
    "rope/flash-neox-prefill-2048": _rope(),
    "rope/flash-decode-1": _rope(t=1),
    "rope/paged-gptj-full-rotary-offsets-zeros": _rope(qh=32, kh=8, d=128, layout="paged", full_rotary=True,
                                                       is_neox=False, offsets=True, zeros=True),
    "rope/shuffled-fp8-scales-swa-int64": _rope(qh=32, kh=8, d=128, layout="shuffled", cache=FP8, scales=True,
                                                swa=True, index=I64),
    "rope/flash-fp8-gptj-kv-only-rows": _rope(t=3, t_kv=64, cache=FP8, scales=True, is_neox=False),
    "rope/fp16-full-rotary-d64": _rope(t=256, qh=16, kh=4, d=64, dtype=FP16, cos_dtype=FP16, full_rotary=True,
                                       zeros=True, page=16),
    "rope/fp32-paged-x4-mqa": _rope(t=64, qh=8, kh=1, d=128, dtype=FP32, layout="paged", x=4, page=16),
    # Head dims other than powers of two (issue 50): D/2 padded to a power of two, masked lanes.
    "rope/flash-neox-d192-prefill-2048": _rope(d=192),
    "rope/paged-gptj-d96-x16-full-rotary-fp8": _rope(t=256, qh=32, kh=8, d=96, layout="paged", x=16,
                                                     full_rotary=True, is_neox=False, cache=FP8, scales=True),
    # Stage 2: compress_groups, store_cache_rows.
    "compress/decode-256-d128-rope-cache": _compress(256, 128, 256),
    "compress/prefill-2048-d256-int64": _compress(2048, 256, 1, rope_cache=False, index=I64),
    "compress/decode-1-fp32-ratio8": _compress(1, 128, 1, dtype=FP32, ratio=8),
    "fused-compression/decode-1-d128": _fused_compression(1),
    "fused-compression/decode-16-d128-fp8-int64": _fused_compression(16, cache=FP8, index=I64),
    "fused-compression/chunk-16-of-2-d256-gptj-full-rotary": _fused_compression(16, d=256, requests=2,
                                                                                is_neox=False, full_rotary=True),
    "fused-compression/decode-8-fp32-ratio8-fp8-12-heads": _fused_compression(8, dtype=FP32, ratio=8, cache=FP8,
                                                                              heads=12),
    "fused-compression/decode-16-d96-gptj": _fused_compression(16, d=96, is_neox=False),
    "step/stages-1-2-decode-1-128k": _stages_1_and_2(1),
    "step/stages-1-2-decode-8-128k-fp8": _stages_1_and_2(8, cache=FP8),
    "step/stages-1-2-decode-16-128k": _stages_1_and_2(16),
    "step/stages-1-2-decode-8-128k-d192-index-d96": _stages_1_and_2(8, d=192, di=96),
    "store/bf16-d128-decode-256": _store(256, 128, BF16),
    "store/fp8-d256-prefill-2048-3d-rows": _store(2048, 256, FP8, squeezed=False),
    "store/int64-positions-1-row": _store(1, 3, I64, index=I64),
    "store/fp8-from-bf16-d128-decode-256": _store(256, 128, FP8, quantise_from=BF16),
    "store/fp8-from-fp32-d128-prefill-2048-3d-rows": _store(2048, 128, FP8, squeezed=False, quantise_from=FP32),
    "store/int32-positions-2048": _store(2048, 3, I32),
    "store/in-table-ring-bf16-d128-prefill-2048": _store_in_table(2048, 128, BF16),
    "store/in-table-fp8-from-bf16-d128-decode-256-int64": _store_in_table(256, 128, FP8, index=I64, quantise_from=BF16),
    # Stage 3: scoring tilings (rows per tile 1 / 16 / 64; exact fp32 dot).
    "scores/decode-256-128k": _scores(256, 256, 1 << 17),
    "scores/decode-1-1m": _scores(1, 1, 1 << 20),
    "scores/prefill-2048-128k": _scores(2048, 1, 1 << 17),
    "scores/prefill-256-columns-divisor-int64": _scores(256, 1, 1 << 15, num_columns=5000, score_divisor=3.0,
                                                        index=I64),
    "scores/fp32-int64": _scores(256, 256, 1 << 17, q=FP32, k=FP32, index=I64),
    "scores/mixed-bf16-fp32": _scores(8, 8, 1 << 15, k=FP32),
    "scores/fp16-d64-8-heads": _scores(512, 2, 1 << 15, heads=8, d=64, q=FP16, k=FP16),
    "scores/fp8-decode-256-128k": _scores(256, 256, 1 << 17, k=FP8),
    "scores/fp8-prefill-2048-128k": _scores(2048, 1, 1 << 17, k=FP8),
    "scores/fp8-fp16-prefill-256-d64": _scores(256, 1, 1 << 15, heads=8, d=64, q=FP16, k=FP8),
    "scores/fp8-fp32-queries": _scores(8, 8, 1 << 15, q=FP32, k=FP8),
    "scores/fp8-decode-256-128k-8-warps": _scores(256, 256, 1 << 17, k=FP8, tuning=dict(fp8_row_warps=8)),
    "scores/fp8-decode-256-128k-256-columns": _scores(256, 256, 1 << 17, k=FP8, tuning=dict(fp8_row_columns=256)),
    # The row loop's candidates (SelectTuning.fp8_row_*, bench_select.py --fp8-sweep; issue 27).
    **{f"scores/fp8-decode-{rows}-128k-row-loop-{name}": _scores(rows, rows, 1 << 17, k=FP8, tuning=variant)
       for rows in (8, 64, 256) for name, variant in (
           ("8-tiles", dict(fp8_row_tiles=8)), ("8-tiles-no-prefetch", dict(fp8_row_tiles=8, fp8_row_prefetch=False)),
           ("4-tiles", dict(fp8_row_tiles=4)), ("16-tiles", dict(fp8_row_tiles=16)),
           ("8-tiles-1024-programs", dict(fp8_row_tiles=8, fp8_row_min_programs=1024)),
           ("8-tiles-3-stages", dict(fp8_row_tiles=8, fp8_row_prefetch=False, fp8_row_stages=3)),
           ("8-tiles-8-warps", dict(fp8_row_tiles=8, fp8_row_warps=8)))},
    "scores/fp8-decode-256-128k-row-loop-page-128-int64": _scores(256, 256, 1 << 17, k=FP8, page=128, index=I64,
                                                                  tuning=dict(fp8_row_tiles=8)),
    # Stage 3: top-k (a top-k set takes ~20 s of compiling: few shapes).
    "topk/decode-1-1m-k512": _topk(1, 1 << 18, 512),  # the ticketed path at ticketed_single_row_max_columns
    "topk/decode-256-128k-k512": _topk(256, 1 << 15, 512),
    "topk/prefill-2048-128k-k2048-bf16": _topk(2048, 1 << 15, 2048, dtype=BF16),
    "topk/short-rows-k-past-row-end-fp16-int64": _topk(8, 100, 128, dtype=FP16, index=I64),
    # The register path (the row in registers, 8 keys a thread): 8 warps
    # at 2048 columns (the plan's widest, TopkTuning.register_max_columns),
    # forced: 32 at 8192 and at its widest (REGISTER_MAX_TILE).
    "topk/register-decode-1-8k-k512": _topk(1, 1 << 11, 512),
    "topk/ticketed-decode-1-32k-k512": _topk(1, 1 << 13, 512),  # the plan's path past 2048 columns
    "topk/forced-register-decode-1-32k-k512": _topk(1, 1 << 13, 512, path="register"),
    "topk/register-prefill-2048-8k-k512": _topk(2048, 1 << 11, 512),
    "topk/forced-register-decode-1-64k-k512": _topk(1, 1 << 14, 512, path="register"),
    "topk/forced-register-prefill-2048-32k-k1-fp16-int64": _topk(2048, 1 << 13, 1, dtype=FP16, index=I64,
                                                                 path="register"),
    "topk/register-k2048-4096-bf16": _topk(16, 4096, 2048, dtype=BF16),
    # The row path (one program per row): bounded with 16 warps, halved tiles
    # for many rows, and the direct select of single-column groups.
    "topk/row-decode-1-32k-k512": _topk(1, 1 << 14, 512, path="row"),
    "topk/row-prefill-2048-8k-k512": _topk(2048, 1 << 11, 512, path="row"),
    "topk/row-decode-128-1m-k512": _topk(128, 1 << 18, 512),
    "topk/row-direct-k2048-4096": _topk(16, 4096, 2048, path="row"),
    "topk/row-decode-1-256k-k2048": _topk(1, 1 << 16, 2048, path="row"),
    "topk/row-prefill-2048-8k-k1": _topk(2048, 1 << 13, 1, dtype=FP16, path="row"),
    # The ticketed path (one launch, roles by ticket) with few long rows: 4
    # warps at k = 512, 16 for k = 2048's candidate tile and 4096-column slices.
    "topk/ticketed-decode-1-128k-k512": _topk(1, 1 << 15, 512),
    "topk/ticketed-decode-8-512k-k512-bf16": _topk(8, 1 << 17, 512, dtype=BF16),
    "topk/ticketed-decode-1-256k-k2048": _topk(1, 1 << 16, 2048),
    "topk/ticketed-4096-slices-1-1m-k512": _topk(1, 1 << 18, 512, path="ticketed", ticketed_slice=4096),
    "topk/ticketed-fixed-bound-1-128k-k512": _topk(1, 1 << 15, 512, ticketed_bound="fixed"),
    # Slices streamed in tiles past TopkTuning.ticketed_max_row_slices: 8192 columns a slice at
    # 64 x 32768; 65536 at 64 x 262144; k = 2048's 4096-column maxima tiles over 2048-column ones.
    "topk/ticketed-streamed-decode-64-128k-k512": _topk(64, 1 << 15, 512),
    "topk/ticketed-streamed-decode-64-1m-k512-bf16": _topk(64, 1 << 18, 512, dtype=BF16),
    "topk/ticketed-streamed-decode-32-256k-k2048": _topk(32, 1 << 16, 2048),
    # Each path forced where another is chosen (benchmarks/bench_topk.py
    # times them all), and the --sweep's smallest row-path configuration.
    "topk/forced-sliced-decode-256-128k-k512": _topk(256, 1 << 15, 512, path="sliced"),
    "topk/forced-sliced-decode-8-512k-k512": _topk(8, 1 << 17, 512, path="sliced"),
    "topk/sliced-decode-8-2m-k512": _topk(8, 1 << 19, 512),
    "topk/forced-ticketed-decode-256-128k-k512": _topk(256, 1 << 15, 512, path="ticketed"),
    "topk/forced-row-decode-1-1m-k512": _topk(1, 1 << 18, 512, path="row"),
    "topk/row-8-warps-8-keys-1-bound-pass-2048-8k": _topk(2048, 1 << 13, 512, path="row", row_warps=8,
                                                           row_keys_per_thread=8, bound_passes=1),
    "topk/register-8-bit-digits-16-keys-1-2k": _topk(1, 1 << 11, 512, register_radix_bits=8,
                                                     register_keys_per_thread=16),
    # Stage 3: expansion, and the whole selection (chunked past 128 MiB of
    # logits).  Shapes shared with the cases above compile once.
    "expand/decode-256-topk2048": _expand(256, 2048),
    "expand/ratio8-int64": _expand(7, 64, ratio=8, index=I64),
    "expand/no-blocks": _expand(5, 0),
    "select/decode-256-128k": _select(256, 256, 1 << 17),
    "select/decode-256-fp32-int64": _select(256, 256, 1 << 17, q=FP32, k=FP32, index=I64),
    "select/prefill-2048-1m-chunked": _select(2048, 1, 1 << 20),
    "select/fp8-decode-256-128k": _select(256, 256, 1 << 17, k=FP8),
    # The fused selection (one launch: decode rows whose top-k is ticketed).
    "select/fused-decode-1-128k": _select(1, 1, 1 << 17),
    "select/fused-decode-8-128k-int64": _select(8, 8, 1 << 17, index=I64),
    "select/fused-fp8-decode-1-128k": _select(1, 1, 1 << 17, k=FP8),
    "select/fused-fp16-16-heads-decode-3-32k-topk1024": _select(3, 3, 1 << 15, token_topk=1024, q=FP16, k=FP16,
                                                               heads=16),
    # Stage 4: sparse_paged_attention (split-K where programs are few, merged by a merge launch; with
    # AttentionTuning.fused_merge, off by default, in the launch by merging programs).
    "attention/decode-1": _attention(1),  # 33 splits, then the merge launch
    "attention/decode-8-22-splits": _attention(8),  # the merge launch's chunks of 16 splits, with a tail
    "attention/decode-1-fused-merge": _attention(1, fused_merge=True),  # 33 splits + 12 merging programs
    "attention/decode-8-fused-merge": _attention(8, fused_merge=True),
    "attention/decode-1-fused-merge-4-heads": _attention(1, fused_merge=True, fused_merge_heads=4),
    "attention/decode-16-fused-merge-forced": _attention(16, fused_merge=True),
    "attention/decode-16": _attention(16),
    "attention/decode-32": _attention(32),
    "attention/decode-64": _attention(64),
    "attention/decode-256": _attention(256),
    "attention/prefill-2048": _attention(2048),
    "attention/d128-32q-8kv": _attention(32, qh=32, kh=8, d=128),
    "attention/d64-fp16-int64": _attention(8, qh=16, kh=4, d=64, dtype=FP16, index=I64, page=16),
    "attention/mqa-d128-narrow-scale": _attention(4, qh=16, kh=1, d=128, width=20, scale=0.1),
    "attention/decode-256-slot-addressing": _attention(256, row_addressing="slot"),
    "attention/fp8-decode-1": _attention(1, cache=FP8),
    "attention/fp8-decode-8": _attention(8, cache=FP8),
    "attention/fp8-decode-1-fused-merge": _attention(1, cache=FP8, fused_merge=True),
    "attention/fp8-decode-8-fused-merge": _attention(8, cache=FP8, fused_merge=True),
    "attention/fp8-decode-64": _attention(64, cache=FP8),
    "attention/fp8-decode-256": _attention(256, cache=FP8),
    "attention/fp8-prefill-2048": _attention(2048, cache=FP8),
    # A candidate of the fp8 table's sweep (64-token tiles on 2 warps).
    "attention/fp8-decode-256-64-token-tiles": _attention(256, cache=FP8, tile_bytes=32 * 1024),
    "attention/fp8-fp16-decode-64-page-addressing": _attention(64, dtype=FP16, cache=FP8, fp8_row_addressing="page"),
    "attention/fp8-fp16-d64-int64": _attention(8, qh=16, kh=4, d=64, dtype=FP16, index=I64, page=16, cache=FP8),
}

#: Cases whose launches may spill registers on sm_90: label -> (the Triton
#: series where they may, why).  Any other spilling launch fails its case, on
#: every admitted Triton: the defaults of each series are spill-free
#: (qsa_kernels.tuning.NEWER_TRITON replaces the Triton 3.6 values that spill
#: under a newer one), and CI runs this check on every admitted series.
_CANDIDATE_SPILL = ("a forced candidate, not a default (the plans never choose it): {}; its spills under this "
                    "Triton are part of what a sweep of it would measure")
SPILLS_ALLOWED: dict[str, tuple[tuple[str, ...], str]] = {
    "attention/fp8-decode-256-64-token-tiles": (("3.8", "3.9"), _CANDIDATE_SPILL.format(
        "64-token fp8 tiles on 2 warps (bench_sparse_attention.py --sweep --fp8; 306-309 us against the "
        "table's 279 on Triton 3.6)")),
    "attention/decode-16-fused-merge-forced": (("3.7",), _CANDIDATE_SPILL.format(
        "the attention's split-K merged in its launch, forced at 16 rows (AttentionTuning.fused_merge, off "
        "by default: slower on the H200; 128 registers and 2 spills on Triton 3.7.1, none on 3.6, 3.8, 3.9)")),
    "topk/row-8-warps-8-keys-1-bound-pass-2048-8k": (("3.9",), _CANDIDATE_SPILL.format(
        "the row path's sweep candidate of 8 warps (4 from 264 rows) x 8 keys and one bound pass, at 2048 rows "
        "(bench_topk.py --sweep; 72 registers and 2 spills on Triton 3.9.0, none on 3.6, 3.7.1, 3.8)")),
    "topk/forced-register-decode-1-64k-k512": (("3.9",), _CANDIDATE_SPILL.format(
        "the register top-k forced at its widest row (REGISTER_MAX_TILE columns on 32 warps: at most 64 "
        "registers a thread; the plan takes it up to 2048 columns, TopkTuning.register_max_columns; "
        "4 spills on Triton 3.9.0, none on 3.6, 3.7.1, 3.8 with 4-bit digits)")),
}
#: Cases known not to compile: label -> the error (xfail).
COMPILE_FAILURES: dict[str, str] = {}


def runnable_launches(label: str) -> tuple[Launch, ...]:
    plan, kwargs = CASES[label]
    return plan(**kwargs).runnable_launches


# --------------------------------------------------------------------------
# The subprocess: specialise as torch does, compile in a pool, read the cubins.
# --------------------------------------------------------------------------

class _Tensor:
    """What Triton's argument specialisation reads of a torch tensor.

    ``dtype`` is an ArrayInfo's name: Triton maps it to the pointer type
    (``"float8_e4m3fn"`` -> ``*fp8e4nv``...).  The address is 16-byte aligned
    like every torch allocation.
    """

    def __init__(self, dtype: str):
        self.dtype = dtype

    @staticmethod
    def data_ptr() -> int:
        return 0


def specialise(launch: Launch, arrays: dict[str, ArrayInfo], backend):
    """``(options, signature, constexprs, attrs)`` of the torch adapter's call of ``launch``.

    The adapter calls ``kernel[grid](*arrays, **scalars, **constexprs,
    num_warps=..., num_stages=...)``; ``JITFunction.run`` binds that with the
    binder built here and packs it with ``_pack_args``, so every rule is
    Triton's own (triton/runtime/jit.py, ``native_specialize_impl``):
    pointers ``*<dtype>`` with divisibility 16; ints ``i32`` (``i64`` past
    int32), divisibility 16 when a multiple of 16, and ``constexpr`` when
    equal to 1; floats ``fp32``, never specialised.
    """
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    kwargs = dict(launch.scalars, **launch.constexprs, num_warps=launch.num_warps, num_stages=launch.num_stages)
    pointers = [_Tensor(arrays[name].dtype) for name in launch.inputs + launch.outputs]
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*pointers, **kwargs)
    return kernel._pack_args(backend, kwargs, bound, specialization, options)


def _resources(cubin: bytes) -> tuple[int, int]:
    """``(n_regs, n_spills)`` as Triton's driver reports them (``CompiledKernel.n_regs``, ``n_spills``).

    ``n_spills`` is the driver's local memory per thread / 4, and that local
    memory is ptxas's stack frame, where spills go: cuobjdump's ``STACK``.
    """
    import tempfile

    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        usage = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", file.name],
                               check=True, capture_output=True, text=True).stdout
    # "Function <name>:\n  REG:40 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:560 ..."
    fields = dict(item.split(":", 1) for item in usage.split() if item[:1].isupper() and ":" in item[1:])
    return int(fields["REG"]), int(fields["STACK"]) // 4


_JOBS: list = []  # (kernel, options, signature, constexprs, attrs): read by the forked workers


def _compile(job: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel, options, signature, constexprs, attrs = _JOBS[job]
    try:
        compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                                  target=GPUTarget("cuda", 90, 32), options=options.__dict__)
        return [*_resources(compiled.asm["cubin"]), None]
    except Exception as error:  # noqa: BLE001 -- reported with its case
        # One CompilationError per inlined call: the innermost shows the line at fault.
        while type(error.__cause__).__name__ == "CompilationError":
            error = error.__cause__
        return [None, None, f"{type(error).__name__}: {error}"[-3000:]]


def compile_all() -> dict:
    """label -> [[kernel name, n_regs, n_spills, error or None] per runnable launch]."""
    import multiprocessing

    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", 90, 32))
    distinct: dict[str, int] = {}
    launches = {}
    for label, (plan, kwargs) in CASES.items():
        program = plan(**kwargs)
        arrays = {name: info for name, info in kwargs.items() if isinstance(info, ArrayInfo)}
        arrays.update((b.name, b.info) for b in program.buffers)
        launches[label] = []
        for launch in program.runnable_launches:
            spec = specialise(launch, arrays, backend)
            key = repr((launch.kernel.__name__, spec))  # one compile per kernel Triton would cache
            if key not in distinct:
                distinct[key] = len(_JOBS)
                _JOBS.append((launch.kernel, *spec))
            launches[label].append((launch.kernel.__name__, distinct[key]))
    # Forked after the plans (and before any compile), so the workers share _JOBS.
    with multiprocessing.get_context("fork").Pool(len(os.sched_getaffinity(0))) as pool:
        results = pool.map(_compile, range(len(_JOBS)), chunksize=1)
    return {label: [[name, *results[job]] for name, job in jobs] for label, jobs in launches.items()}


def main() -> None:
    from qsa_kernels import runtime

    from qsa_kernels import pdl

    assert not runtime.INTERPRETED, "run with TRITON_INTERPRET=0: kernels must be compiled, not interpreted"
    assert pdl.EMIT, "run with QSA_PDL_EMIT=1: kernels must hold the wait a compiled sm_90 process compiles"
    results = compile_all()
    for label, kernels in results.items():
        for name, regs, spills, error in dict.fromkeys(map(tuple, kernels)):  # chunks repeat launches
            state = f"ERROR {error.splitlines()[-1][:100]}" if error else f"regs {regs:3d}  spills {spills}"
            print(f"{label:44s} {name:32s} {state}")
    launches = [kernel for kernels in results.values() for kernel in kernels]
    failed = sum(1 for *_, error in launches if error)
    print(f"{len(launches) - failed} of {len(launches)} launches ({len(_JOBS)} distinct kernels) compiled for sm_90")
    print("RESULTS " + json.dumps(results))


# --------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compiled() -> dict:
    from triton import knobs

    try:
        knobs.nvidia.ptxas.path, knobs.nvidia.cuobjdump.path
    except RuntimeError as error:  # "Cannot find ptxas"
        pytest.skip(f"no bundled NVIDIA tools in this triton installation: {error}")
    # QSA_PDL_EMIT=1: the kernels as a compiled sm_90 process holds them (qsa_kernels.pdl.EMIT).
    env = dict(os.environ, TRITON_INTERPRET="0", QSA_PDL_EMIT="1")
    result = subprocess.run([sys.executable, "-m", "tests.test_compile_sm90"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    table, _, results = result.stdout.rpartition("RESULTS ")
    print(table)  # the register table, shown with -s
    return json.loads(results)


def _case(label: str):
    marks = [pytest.mark.xfail(reason=COMPILE_FAILURES[label], strict=True)] if label in COMPILE_FAILURES else []
    return pytest.param(label, marks=marks, id=label)


@pytest.mark.parametrize("label", [_case(label) for label in CASES])
def test_compiles_for_sm90_without_spills(compiled, label):
    kernels = compiled[label]
    assert [name for name, *_ in kernels] == [launch.kernel.__name__ for launch in runnable_launches(label)]
    errors = [f"{name}: {error}" for name, _, _, error in kernels if error]
    assert not errors, "\n".join(errors)
    spills = [(name, regs, spills) for name, regs, spills, _ in kernels if spills]
    series, reason = SPILLS_ALLOWED.get(label, ((), ""))
    if TRITON_SERIES not in series:
        assert not spills, (f"triton {triton.__version__}: launches spilling registers (name, n_regs, n_spills): "
                            f"{spills} (a spill-free default for this Triton series belongs in "
                            f"qsa_kernels.tuning.NEWER_TRITON)")


def test_admitted_series_are_checked():
    """ADMITTED_SERIES is pyproject's Triton range; CI runs this check under each; every
    allowance and every series of replaced defaults is one of them (a typo would allow nothing)."""
    import re

    from packaging.specifiers import SpecifierSet

    from qsa_kernels.tuning import NEWER_TRITON

    pyproject = (ROOT / "pyproject.toml").read_text()
    admitted = SpecifierSet(re.search(r'"triton(>=[^"]+)"', pyproject).group(1))
    assert tuple(f"3.{minor}" for minor in range(20) if admitted.contains(f"3.{minor}.0")) == ADMITTED_SERIES
    # The Tritons CI installs: scripts/setup.sh's default (the first run) and each QSA_TRITON of .ci/run.
    installed = re.findall(r'QSA_TRITON="triton([^"]+)"', (ROOT / ".ci" / "run").read_text())
    installed += re.findall(r"^TRITON=\$\{QSA_TRITON:-triton([^}]+)\}$", (ROOT / "scripts" / "setup.sh").read_text(),
                            re.M)
    for series in ADMITTED_SERIES:
        assert any(SpecifierSet(spec).contains(f"{series}.{patch}") for spec in installed for patch in range(10)), \
            f"CI installs no triton {series} (.ci/run, scripts/setup.sh: {installed})"
    assert set(NEWER_TRITON) <= set(ADMITTED_SERIES)
    for label, (series, reason) in SPILLS_ALLOWED.items():
        assert label in CASES and reason, label
        assert set(series) <= set(ADMITTED_SERIES), (label, series)


def test_every_launch_compiled(compiled):
    expected = sum(len(runnable_launches(label)) for label in CASES)
    assert sum(map(len, compiled.values())) == expected


if __name__ == "__main__":
    main()
