"""Run every QSA kernel on adversarial inputs, for compute-sanitizer.

    compute-sanitizer --tool memcheck python3 scripts/sanitize.py --framework torch
    compute-sanitizer --tool memcheck python3 scripts/sanitize.py --framework jax
    compute-sanitizer --tool racecheck python3 scripts/sanitize.py --framework torch \\
        --functions scores,topk,select,attention --small --no-big

Each public function runs on GPU-sized inputs full of indices the kernels
must skip: -1, other negatives, values just and far past every table
(``2**32 + s``, which aliases slot ``s`` if an offset were truncated to 32
bits), pages out of range or shared between requests, invalid requests,
positions past the rotary table, empty batches and empty selections.  The
sanitizer reports any access outside an allocation; run with
``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` / ``XLA_PYTHON_CLIENT_ALLOCATOR=platform``
so that every array is its own allocation (scripts/sanitize.sh does).

The big cases put caches past 2**31 elements, where an int32 offset would
wrap *inside* the allocation (no sanitizer error, just a wrong cell): they
write through ``rope_reshape_and_cache`` / ``store_cache_rows`` at the end of
the cache and read back through ``sparse_paged_attention``, and check the
values, so a wrapped offset fails the run.

Prints one line per case, then ``KERNELS COVERED: ...`` and a final
``SANITIZE RESULT {json}`` line; exits 1 if a check failed.  Without a GPU
(``TRITON_INTERPRET=1``) the same script runs through the interpreter (useful
to check the script itself; the big cases are skipped there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import ml_dtypes
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from anywhere: the checkout's qsa_torch / qsa_jax
    sys.path.insert(0, ROOT)

from qsa_kernels import runtime  # noqa: E402  (decides interpreted vs compiled first)
from qsa_kernels.launch import observe_launches  # noqa: E402

BF16, FP8 = np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn)
FUNCTIONS = ("rope", "compress", "store", "scores", "topk", "expand", "select", "attention", "step")
#: Functions whose kernels use shared memory (tl.dot, cross-warp reductions, histograms).
SHARED_MEMORY = ("scores", "topk", "select", "attention")


# --------------------------------------------------------------------------
# Frameworks: the same cases through qsa_torch or qsa_jax (under jax.jit)
# --------------------------------------------------------------------------

class TorchRunner:
    name = "torch"

    def __init__(self):
        import torch

        import qsa_torch

        self.torch, self.qsa = torch, qsa_torch
        self.device = torch.device("cpu" if runtime.INTERPRETED else "cuda")
        self.kernels: set[str] = set()  # filled by main() through the executor's launch hook

    def put(self, array: np.ndarray):
        torch = self.torch
        if array.size == 0:  # NumPy gives empty arrays all-zero strides: make a row-major tensor
            return self.put(np.zeros(1, array.dtype)).new_empty(array.shape)
        if array.dtype == BF16:
            tensor = torch.from_numpy(np.ascontiguousarray(array).view(np.uint16)).view(torch.bfloat16)
        elif array.dtype == FP8:
            tensor = torch.from_numpy(np.ascontiguousarray(array).view(np.uint8)).view(torch.float8_e4m3fn)
        else:
            tensor = torch.from_numpy(np.ascontiguousarray(array))
        return tensor.to(self.device)

    def empty(self, shape, dtype):
        """A large array without a fill kernel (its contents are never relied on)."""
        torch_dtype = {BF16: self.torch.bfloat16}[np.dtype(dtype)]
        return self.torch.empty(shape, dtype=torch_dtype, device=self.device)

    def call(self, function: str, arrays: dict, static: dict, in_place=()):
        out = getattr(self.qsa, function)(**arrays, **static)
        self.sync()
        return out if isinstance(out, tuple) else (out,)

    def get(self, value) -> np.ndarray:
        torch = self.torch
        value = value.detach().cpu().contiguous()
        if value.dtype == torch.bfloat16:
            return value.view(torch.uint16).numpy().view(BF16)
        if value.dtype == torch.float8_e4m3fn:
            return value.view(torch.uint8).numpy().view(FP8)
        return value.numpy()

    def sync(self):
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()


class JaxRunner:
    name = "jax"

    def __init__(self):
        import jax

        jax.config.update("jax_enable_x64", True)  # int64 indices stay int64
        import jax.numpy as jnp

        import qsa_jax

        self.jax, self.jnp, self.qsa = jax, jnp, qsa_jax
        self.kernels: set[str] = set()  # filled by main() through the executor's launch hook

    def put(self, array: np.ndarray):
        return self.jnp.asarray(array)

    def empty(self, shape, dtype):
        return self.jnp.zeros(shape, dtype)

    def call(self, function: str, arrays: dict, static: dict, in_place=()):
        """Under jax.jit, donating the caches updated in place (no copy of a big cache)."""
        names = [name for name, value in arrays.items() if value is not None]
        donate = tuple(i for i, name in enumerate(names) if name in in_place)
        fn = getattr(self.qsa, function)
        jitted = self.jax.jit(lambda *values: fn(**dict(zip(names, values)), **static), donate_argnums=donate)
        out = self.jax.block_until_ready(jitted(*(arrays[name] for name in names)))
        return out if isinstance(out, tuple) else (out,)

    def get(self, value) -> np.ndarray:
        return np.asarray(value)

    def sync(self):
        pass


# --------------------------------------------------------------------------
# Adversarial content
# --------------------------------------------------------------------------

def far_values(size: int, dtype) -> list[int]:
    """-1, other negatives, just and far past a table of ``size`` entries."""
    values = [-1, -2, -(2**31), size, size + 1, 2**31 - 1]
    if np.dtype(dtype) == np.int64:
        values += [2**32, 2**32 + 1, 2**62, -(2**63), 2**63 - 1]
    return values


def spoil(rng, values, size: int, dtype=np.int32, fraction: float = 0.25) -> np.ndarray:
    """``values`` (indices into a table of ``size``) with a fraction replaced by far_values."""
    values = np.array(values, dtype=np.int64)
    bad = rng.random(values.shape) < fraction
    values[bad] = rng.choice(np.array(far_values(size, dtype), dtype=np.int64), int(bad.sum()))
    return values.astype(dtype)


def floats(rng, shape, dtype=BF16) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def distinct_slots(rng, count: int, num_slots: int, dtype) -> np.ndarray:
    """Distinct valid slots (two writes to one slot are unspecified), a quarter spoilt."""
    slots = rng.permutation(num_slots)[:count]
    slots = np.concatenate([slots, np.full(max(0, count - len(slots)), -1)])
    return spoil(rng, slots, num_slots, dtype)


# --------------------------------------------------------------------------
# Cases: (name, function group, builder(rng, small) -> (public function, arrays, static, in-place names))
# --------------------------------------------------------------------------

def rope(layout, dtype=BF16, cache_dtype=None, index_dtype=np.int64, neox=True, swa=False, offsets=False,
         head_dim=None):
    """Stage 1's case; ``head_dim`` other than a power of two pads the rotation tile (masked lanes)."""
    def build(rng, small):
        t, extra, qh, kh, d, page, blocks = (5, 2, 4, 2, 32, 8, 6) if small else (48, 16, 24, 2, 128, 16, 64)
        d = head_dim or d
        x = 8 if small else 16
        num_slots = blocks * page
        if layout == "flash":
            k_shape = v_shape = (blocks, page, kh, d)
        else:
            k_shape = (blocks, kh, d // x, page, x)
            v_shape = (blocks, kh, d, page) if layout == "paged" else (blocks, kh, page // x, d, x)
        max_position = 64
        positions = spoil(rng, rng.integers(0, max_position, t), max_position, index_dtype)
        angles = rng.uniform(0, 6.3, (max_position, d // 2))
        cache = cache_dtype or dtype
        arrays = dict(
            q=floats(rng, (t, qh, d), dtype), k=floats(rng, (t + extra, kh, d), dtype),
            v=floats(rng, (t + extra, kh, d), dtype),
            key_cache=floats(rng, k_shape, cache), value_cache=floats(rng, v_shape, cache),
            slot_mapping=distinct_slots(rng, t + extra, num_slots, index_dtype), positions=positions,
            cos_sin=np.concatenate([np.cos(angles), np.sin(angles)], 1).astype(np.float32),
            k_scale=np.array(0.5, np.float32) if cache_dtype is not None else None,
            v_scale=np.array([2.0], np.float32) if cache_dtype is not None else None,
            offsets=spoil(rng, rng.integers(0, 4, t), 4, index_dtype) if offsets else None,
            # The final slot is swa[slot]: a table with -1 and out-of-range entries.
            swa_slot_mapping=spoil(rng, rng.permutation(num_slots), num_slots, index_dtype) if swa else None,
        )
        if swa:
            arrays["slot_mapping"] = distinct_slots(rng, t + extra, num_slots, index_dtype)
        return "rope_reshape_and_cache", arrays, dict(is_neox=neox, return_zeros=True), ("key_cache", "value_cache")
    return build


def compress(lengths, small_lengths, d, ratio, ring, dtype=BF16, positions_dtype=np.int64):
    def build(rng, small):
        lens = small_lengths if small else lengths
        requests, blocks = len(lens), len(lens) + 2
        starts = np.cumsum([0, *lens])
        token_to_req = np.repeat(np.arange(requests), lens)
        first = rng.integers(0, 40, requests)
        positions = np.concatenate([f + np.arange(n) for f, n in zip(first, lens)] + [np.zeros(0, int)])
        slots = np.where((positions + 1) % ratio == 0, np.arange(len(positions)), -1)
        # Stray rows (another request's or none), then padding rows past every request.
        token_to_req = np.concatenate([spoil(rng, token_to_req, requests, fraction=0.1), [-1, requests, 2**31 - 1]])
        positions = np.concatenate([positions, [2**40, -5, 2**62]])
        slots = np.concatenate([slots, [1, 2, 3]])
        rows = len(token_to_req)
        table = spoil(rng, rng.integers(0, blocks, (requests + 1, 2)), blocks)  # shared, -1, out of range
        arrays = dict(
            raw_keys=floats(rng, (rows, 1, d), dtype),
            raw_positions=rng.integers(0, 1 << 20, (rows, 1, 3)).astype(positions_dtype),
            compressor_state_cache=floats(rng, (blocks, ring, 1, d), dtype),
            compressor_state_block_table=table.astype(np.int32),
            token_to_req=token_to_req.astype(np.int32), query_start_loc=starts.astype(np.int32),
            logical_positions=positions.astype(np.int64), compressed_slots=spoil(rng, slots, 1 << 20, np.int64, 0.1),
            rope_cache=rng.integers(0, 1 << 20, (blocks, ring, 1, 3)).astype(positions_dtype),
        )
        return "compress_groups", arrays, dict(compress_ratio=ratio), ()
    return build


def store(width, dtype=BF16, rows_3d=False, index_dtype=np.int64):
    def build(rng, small):
        rows, pages, page = (7, 3, 4) if small else (300, 16, 64)
        if np.dtype(dtype).kind == "i":
            values = lambda *shape: rng.integers(-(2**30), 2**30, shape).astype(dtype)  # noqa: E731
        else:
            values = lambda *shape: floats(rng, shape, dtype)  # noqa: E731
        data = values(rows, width)
        arrays = dict(cache=values(pages, page, 1, width),
                      slot_mapping=distinct_slots(rng, rows, pages * page, index_dtype),
                      rows=data[:, None] if rows_3d else data)
        return "store_cache_rows", arrays, {}, ("cache",)
    return build


def scoring_arrays(rng, small, prefill=False, q_dtype=BF16, k_dtype=BF16, no_pages=False):
    rows, requests, context, heads, d, ratio, page = (
        (20 if prefill else 5), 3, 96, 2, 32, 4, 4) if small else ((100 if prefill else 32), 8, 4096, 4, 128, 4, 64)
    width = context // ratio // page + 1
    pages = 0 if no_pages else requests * width
    table = spoil(rng, rng.integers(0, max(pages, 1), (requests, width)), pages, np.int32, 0.1)
    table[1:, :2] = table[0, :2]  # prefix sharing: requests read request 0's first pages
    if prefill:
        token_to_req = np.concatenate([np.zeros(rows - 3, int), spoil(rng, [0, 1, 2], requests, fraction=1.0)])
        positions = np.concatenate([context - rows + np.arange(rows - 3), [context - 1, -1, 2**40]])
    else:
        token_to_req = spoil(rng, rng.integers(0, requests, rows), requests, fraction=0.2)
        positions = spoil(rng, rng.integers(0, context, rows), context, np.int64, 0.2)
    lengths = spoil(rng, rng.integers(0, context + 1, requests), context + 1, np.int64, 0.3)
    lengths[0] = context
    return dict(q=floats(rng, (rows, heads, d), q_dtype), k_cache=floats(rng, (pages, page, 1, d), k_dtype),
                page_table=table, token_to_req=token_to_req.astype(np.int32), query_positions=positions.astype(np.int64),
                sequence_lengths=lengths), ratio, width * page


def scores(prefill=False, q_dtype=BF16, k_dtype=BF16, extra_columns=0, divisor=None, no_pages=False):
    def build(rng, small):
        arrays, ratio, columns = scoring_arrays(rng, small, prefill, q_dtype, k_dtype, no_pages)
        return "mqa_paged_scores", arrays, dict(compress_ratio=ratio, num_columns=columns + extra_columns,
                                                score_divisor=divisor), ()
    return build


def select(prefill=False, chunk_rows=None):
    def build(rng, small):
        arrays, ratio, columns = scoring_arrays(rng, small, prefill)
        static = dict(token_topk=(16 if small else 512), compress_ratio=ratio)
        if chunk_rows is not None:
            static["_logits_workspace_bytes"] = 4 * columns * chunk_rows
        return "select_paged_tokens", arrays, static, ()
    return build


def topk(rows, columns, k, pattern, small_shape):
    def build(rng, small):
        r, c, kk = small_shape if small else (rows, columns, k)
        if pattern == "periodic":  # the large keys share one group: the candidate buffer overflows
            logits = np.zeros((r, c), np.float32)
            logits[:, ::8] = np.arange(len(logits[0, ::8]), dtype=np.float32)
        elif pattern == "ties":
            logits = rng.integers(0, 3, (r, c)).astype(np.float32)
        else:
            logits = rng.standard_normal((r, c)).astype(np.float32)
            special = rng.random((r, c))
            logits[special < 0.05] = np.nan
            logits[(special >= 0.05) & (special < 0.1)] = -np.inf
            logits[(special >= 0.1) & (special < 0.12)] = -0.0
        visible = spoil(rng, rng.integers(0, c + 1, r), c + 1, np.int64, 0.3)
        visible[0] = c
        return "topk_blocks", dict(logits=logits, visible_blocks=visible), dict(k=kk), ()
    return build


def expand():
    def build(rng, small):
        rows, requests, ratio, topk_blocks = (6, 2, 4, 4) if small else (128, 8, 4, 128)
        lengths = spoil(rng, rng.integers(0, 4096, requests), 4096, np.int64, 0.3)
        arrays = dict(block_indices=spoil(rng, rng.integers(0, 1024, (rows, topk_blocks)), 1024, np.int64),
                      query_positions=spoil(rng, rng.integers(0, 4096, rows), 4096, np.int64),
                      sequence_lengths=lengths,
                      token_to_req=spoil(rng, rng.integers(0, requests, rows), requests))
        return "expand_block_indices", arrays, dict(compress_ratio=ratio, token_topk=ratio * topk_blocks), ()
    return build


def attention(rows, width, dtype=BF16, d=128, blocks_override=None, small_shape=(2, 40)):
    def build(rng, small):
        r, w = small_shape if small else (rows, width)
        qh, kh, dim, page, requests = (4, 2, 16, 4, 2) if small else (24, 2, d, 64, 4)
        table_width = max(1, w // page + 2)
        blocks = requests * table_width if blocks_override is None else blocks_override
        table = spoil(rng, rng.integers(0, max(blocks, 1), (requests, table_width)), blocks, np.int64, 0.1)
        table[1:, :2] = table[0, :2]  # pages shared between requests
        indices = spoil(rng, rng.integers(0, table_width * page, (r, w)), table_width * page, np.int64, 0.2)
        arrays = dict(q=floats(rng, (r, qh, dim), dtype), k_cache=floats(rng, (blocks, page, kh, dim), dtype),
                      v_cache=floats(rng, (blocks, page, kh, dim), dtype), token_indices=indices,
                      block_table=table, token_to_req=spoil(rng, rng.integers(0, requests, r), requests))
        return "sparse_paged_attention", arrays, {}, ()
    return build


def step(fp8=False, neox=True, head_dims=None):
    """The composed step at most StepTuning.fused_max_rows rows (stage 2 and the index queries'
    RoPE in one launch), over metadata full of values to skip; ``head_dims``: ``(D, DI)``."""
    def build(rng, small):
        qh, kh, d, ih, di = (4, 2, 32, 2, 32) if small else (24, 2, 128, 4, 128)
        d, di = head_dims or (d, di)
        rows, requests, page, context, ratio, cpage, ring = 8, 3, 16, 256, 4, 8, 8
        width, cwidth = context // page, context // ratio // cpage
        pages, cpages, blocks, max_position = requests * width, requests * cwidth, requests + 1, 2 * context
        lengths = [5, 1, 2]
        starts = np.cumsum([0] + lengths)
        token_to_req = np.repeat(np.arange(requests), lengths)
        positions = np.concatenate([f + np.arange(n) for f, n in zip(rng.integers(0, context - 8, requests), lengths)])
        completes = (positions + 1) % ratio == 0
        angles = lambda dim: rng.uniform(0, 6.3, (max_position, dim // 2))  # noqa: E731
        table = lambda a: np.concatenate([np.cos(a), np.sin(a)], 1).astype(np.float32)  # noqa: E731
        compressed = floats(rng, (cpages, cpage, 1, di), FP8 if fp8 else BF16)
        arrays = dict(
            q=floats(rng, (rows, qh, d)), k=floats(rng, (rows, kh, d)), v=floats(rng, (rows, kh, d)),
            index_q=floats(rng, (rows, ih, di)), index_k=floats(rng, (rows, 1, di)),
            key_cache=floats(rng, (pages, page, kh, d)), value_cache=floats(rng, (pages, page, kh, d)),
            compressor_state_cache=floats(rng, (blocks, ring, 1, di)), compressed_key_cache=compressed,
            compressed_key_scale=np.array(0.5, np.float32) if fp8 else None,
            slot_mapping=distinct_slots(rng, rows, pages * page, np.int32),
            positions=spoil(rng, positions, max_position, fraction=0.2),
            raw_positions=np.repeat(positions[:, None, None], 3, axis=2).astype(np.int32),
            token_to_req=spoil(rng, token_to_req, requests, fraction=0.2), query_start_loc=starts.astype(np.int32),
            sequence_lengths=spoil(rng, positions[starts[1:] - 1] + 1, context + 1, fraction=0.3),
            block_table=spoil(rng, rng.integers(0, pages, (requests, width)), pages, fraction=0.1),
            compressed_block_table=spoil(rng, rng.integers(0, cpages, (requests, cwidth)), cpages, fraction=0.1),
            compressed_slots=spoil(rng, np.where(completes, rng.permutation(cpages * cpage)[:rows], -1),
                                   cpages * cpage, fraction=0.2),
            compressor_state_block_table=spoil(rng, rng.permutation(blocks)[:requests, None], blocks),
            compressor_state_slots=distinct_slots(rng, rows, blocks * ring, np.int32),
            cos_sin=table(angles(d)), index_cos_sin=table(angles(di)),
        )
        static = dict(compress_ratio=ratio, token_topk=16 if small else 64, is_neox=neox, return_token_indices=True)
        return "qsa_attention_step", arrays, static, ("state",)
    return build


def step_containers(rt, arrays: dict) -> dict:
    """The step's flat arrays as the adapter's ``state`` and ``metadata`` containers."""
    from qsa_kernels.step import METADATA_FIELDS, SCALE_FIELDS, STATE_FIELDS

    arrays = dict(arrays)
    state = rt.qsa.QSAState(**{name: arrays.pop(name, None) for name in STATE_FIELDS + SCALE_FIELDS})
    metadata = rt.qsa.StepMetadata(**{name: arrays.pop(name) for name in METADATA_FIELDS})
    return dict(arrays, state=state, metadata=metadata)


CASES = [
    ("rope_flash_bf16_swa_offsets", "rope", rope("flash", swa=True, offsets=True, index_dtype=np.int32)),
    ("rope_paged_fp16_gptj", "rope", rope("paged", dtype=np.float16, neox=False)),
    ("rope_shuffled_fp32_offsets", "rope", rope("shuffled", dtype=np.float32, offsets=True)),
    ("rope_flash_fp8_scales", "rope", rope("flash", cache_dtype=FP8, swa=True)),
    ("compress_prefill_bf16", "compress", compress((200, 1, 37, 0), (6, 1, 3, 0), 128, 4, 8)),
    ("compress_decode_fp32_d96", "compress", compress((1,) * 64, (1,) * 4, 96, 8, 8, np.float32, np.int32)),
    ("store_bf16_w128", "store", store(128)),
    ("store_int64_w3_rows3d_slots32", "store", store(3, np.int64, rows_3d=True, index_dtype=np.int32)),
    ("store_fp8_w64", "store", store(64, FP8)),
    ("scores_decode_bf16", "scores", scores(extra_columns=40)),
    ("scores_prefill_fp16", "scores", scores(prefill=True, q_dtype=np.float16, k_dtype=np.float16)),
    ("scores_fp32_q_bf16_cache", "scores", scores(q_dtype=np.float32, extra_columns=-17, divisor=2.5)),
    ("scores_no_pages", "scores", scores(no_pages=True)),
    ("topk_long_rows_special", "topk", topk(2, 70000, 512, "special", (2, 300, 9))),
    ("topk_overflowing_candidates", "topk", topk(3, 20000, 64, "periodic", (3, 200, 5))),
    ("topk_decode_ties", "topk", topk(64, 2048, 100, "ties", (5, 60, 7))),
    ("topk_k_past_columns", "topk", topk(4, 50, 64, "special", (3, 10, 16))),
    ("expand", "expand", expand()),
    ("select_decode", "select", select()),
    ("select_prefill_chunked", "select", select(prefill=True, chunk_rows=8)),
    ("attention_decode_split_k", "attention", attention(4, 2048, small_shape=(2, 300))),
    ("attention_prefill_fp16_d64", "attention", attention(128, 300, np.float16, d=64, small_shape=(20, 24))),
    ("attention_no_blocks", "attention", attention(8, 100, blocks_override=0, small_shape=(3, 10))),
    ("attention_empty_selection", "attention", attention(8, 0, small_shape=(3, 0))),
    ("step_fused_compression", "step", step()),
    ("step_fused_compression_fp8_gptj", "step", step(fp8=True, neox=False)),
    # Head dims other than powers of two (padded tiles); last, so that the cases above keep their seeds.
    ("rope_flash_bf16_d80", "rope", rope("flash", head_dim=80)),
    ("rope_paged_bf16_d96_gptj", "rope", rope("paged", neox=False, head_dim=96)),
    ("attention_decode_d80", "attention", attention(4, 2048, d=80, small_shape=(2, 300))),
    ("step_fused_compression_d80_di40", "step", step(head_dims=(80, 40))),
]


def run_case(rt, builder, rng, small: bool) -> None:
    from qsa_kernels import tuning

    function, arrays, static, in_place = builder(rng, small)
    workspace = static.pop("_logits_workspace_bytes", None)
    # Several row chunks reuse the workspaces (the tuning is part of the plan's key).
    overrides = {} if workspace is None else dict(select=tuning.SelectTuning(logits_workspace_bytes=workspace))
    with tuning.override(**overrides):
        device_arrays = {n: (None if a is None else rt.put(a)) for n, a in arrays.items()}
        if function == "qsa_attention_step":
            device_arrays = step_containers(rt, device_arrays)
        rt.call(function, device_arrays, static, in_place)


# --------------------------------------------------------------------------
# Big caches: past 2**31 elements, written at the end and read back
# --------------------------------------------------------------------------

def big_rope_then_attention(rt, rng) -> None:
    """rope_reshape_and_cache writes 2 pages at the end of [131080, 64, 2, 128] caches
    (2**31 + 2**17 elements each); sparse_paged_attention reads them back."""
    page, kh, d, qh = 64, 2, 128, 8
    blocks = 2**31 // (page * kh * d) + 8
    tokens = 2 * page
    last = np.array([blocks - 2, blocks - 1])
    slots = (last[:, None] * page + np.arange(page)).reshape(-1)
    order = rng.permutation(tokens)
    slot_mapping = np.concatenate([slots[order], [-1, blocks * page, 2**32 + 5, 2**32 + page]]).astype(np.int64)
    k = floats(rng, (len(slot_mapping), kh, d))
    v = floats(rng, (len(slot_mapping), kh, d))
    angles = rng.uniform(0, 6.3, (tokens, d // 2))
    positions = order.astype(np.int64)  # token i of the request is at slot_mapping[j] with order[j] = i
    key_cache, value_cache = rt.empty((blocks, page, kh, d), BF16), rt.empty((blocks, page, kh, d), BF16)
    first_page_before = [rt.get(c[0]) for c in (key_cache, value_cache)]
    _, k_out, key_cache, value_cache = rt.call(
        "rope_reshape_and_cache",
        dict(q=rt.put(floats(rng, (tokens, qh, d))), k=rt.put(k), v=rt.put(v), key_cache=key_cache,
             value_cache=value_cache, slot_mapping=rt.put(slot_mapping), positions=rt.put(positions),
             cos_sin=rt.put(np.concatenate([np.cos(angles), np.sin(angles)], 1).astype(np.float32))),
        dict(is_neox=True), ("key_cache", "value_cache"))
    k_out = rt.get(k_out)[:tokens]
    # The written pages hold exactly the rotated k and v rows (same dtype, no scale).
    for cache, rows, what in ((key_cache, k_out, "key"), (value_cache, v[:tokens], "value")):
        got = np.concatenate([rt.get(cache[int(p)]) for p in last])  # [2 * page, kh, d] in slot order
        expected = np.empty_like(rows)
        expected[order] = rows
        assert np.array_equal(got.view(np.uint16), expected.view(np.uint16)), f"{what} cache: last pages wrong"
    for cache, before, what in zip((key_cache, value_cache), first_page_before, ("key", "value")):
        # 2**32 + s must not alias slot s of page 0.
        assert np.array_equal(rt.get(cache[0]).view(np.uint16), before.view(np.uint16)), f"{what} cache: page 0 written"

    # Attention over the request's 128 tokens (logical pages 0, 1 -> the last pages) plus skipped ones.
    rows = 3
    q = floats(rng, (rows, qh, d))
    block_table = np.array([[blocks - 2, blocks - 1, -1, blocks + 7]], np.int64)
    indices = np.concatenate([np.tile(np.arange(tokens), (rows, 1)), np.tile([-1, 2 * page + 3, 3 * page, 4 * page + 1],
                                                                            (rows, 1))], 1)
    (out,) = rt.call("sparse_paged_attention",
                     dict(q=rt.put(q), k_cache=key_cache, v_cache=value_cache, token_indices=rt.put(indices),
                          block_table=rt.put(block_table), token_to_req=rt.put(np.zeros(rows, np.int32))), {})
    keys = k_out.astype(np.float64)  # row order: every token is attended, so order does not matter
    values = v[:tokens].astype(np.float64)
    group = qh // kh
    expected = np.empty((rows, qh, d))
    for h in range(qh):
        scores = q[:, h].astype(np.float64) @ keys[:, h // group].T * d ** -0.5
        weights = np.exp(scores - scores.max(1, keepdims=True))
        expected[:, h] = weights @ values[:, h // group] / weights.sum(1, keepdims=True)
    got = rt.get(out).astype(np.float64)
    error = np.linalg.norm(got - expected) / np.linalg.norm(expected)
    assert error < 2e-2, f"attention over the last pages: relative error {error:.2e}"


def big_store(rt, rng) -> None:
    """store_cache_rows into a [262152, 64, 1, 128] cache (2**31 + 2**16 elements)."""
    page, width = 64, 128
    pages = 2**31 // (page * width) + 8
    cache = rt.empty((pages, page, 1, width), BF16)
    first_page_before = rt.get(cache[0])
    slots = (pages - 1) * page + rng.permutation(page)
    slot_mapping = np.concatenate([slots, [-1, pages * page, 2**32 + 3, 2**63 - 1, -(2**63)]]).astype(np.int64)
    rows = floats(rng, (len(slot_mapping), width))
    (cache,) = rt.call("store_cache_rows", dict(cache=cache, slot_mapping=rt.put(slot_mapping), rows=rt.put(rows)),
                       {}, ("cache",))
    expected = np.empty((page, width), BF16)
    expected[slots - (pages - 1) * page] = rows[:page]
    assert np.array_equal(rt.get(cache[pages - 1])[:, 0].view(np.uint16), expected.view(np.uint16)), "last page wrong"
    # 2**32 + 3 must not alias slot 3 of page 0.
    assert np.array_equal(rt.get(cache[0]).view(np.uint16), first_page_before.view(np.uint16)), "page 0 written"


BIG_CASES = [
    ("big_rope_then_attention", ("rope", "attention"), big_rope_then_attention),
    ("big_store", ("store",), big_store),
]


# --------------------------------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--framework", choices=("torch", "jax"), required=True)
    parser.add_argument("--functions", default=",".join(FUNCTIONS),
                        help="comma-separated subset of: " + ",".join(FUNCTIONS))
    parser.add_argument("--small", action="store_true", help="tiny shapes (racecheck, or the CPU interpreter)")
    parser.add_argument("--no-big", action="store_true", help="skip the caches past 2**31 elements")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    functions = [f.strip() for f in args.functions.split(",") if f.strip()]
    unknown = set(functions) - set(FUNCTIONS)
    if unknown:
        parser.error(f"unknown functions {sorted(unknown)}")

    start = time.time()
    rt = TorchRunner() if args.framework == "torch" else JaxRunner()
    print(f"sanitize.py: framework {rt.name}, {'interpreter' if runtime.INTERPRETED else 'compiled'}, "
          f"functions {','.join(functions)}, {'small' if args.small else 'GPU'} shapes", flush=True)
    cases = [(name, lambda rng, b=builder: run_case(rt, b, rng, args.small))
             for name, group, builder in CASES if group in functions]
    if not args.no_big and not runtime.INTERPRETED:
        cases += [(name, lambda rng, fn=fn: fn(rt, rng)) for name, groups, fn in BIG_CASES
                  if any(g in functions for g in groups)]
    passed, failed = [], []
    # Every kernel any case launches, as the shared executor reports it.
    with observe_launches(lambda event: rt.kernels.add(event.kernel)):
        for i, (name, case) in enumerate(cases):
            case_start = time.time()
            try:
                case(np.random.default_rng(args.seed + i))
            except Exception as error:  # noqa: BLE001 - report every case, then fail the run
                failed.append(name)
                print(f"case {name}: FAILED {type(error).__name__}: {error}", flush=True)
                traceback.print_exc()
                if "CUDA" in str(error) or "illegal" in str(error).lower():
                    break  # the context is gone: later cases would only cascade
            else:
                passed.append(name)
                # The kernels so far on every line: a run cut short still tells what it covered.
                print(f"case {name}: ok ({time.time() - case_start:.1f} s); kernels: {' '.join(sorted(rt.kernels))}",
                      flush=True)
    kernels = sorted(rt.kernels)
    print("KERNELS COVERED: " + " ".join(kernels), flush=True)
    result = dict(framework=rt.name, interpreted=runtime.INTERPRETED, small=args.small, functions=functions,
                  cases_passed=passed, cases_failed=failed, kernels=kernels, seconds=round(time.time() - start, 1))
    print("SANITIZE RESULT " + json.dumps(result), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
