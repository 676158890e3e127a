"""Determinism: every public function (the composed step included) gives
bitwise-identical results when run again on the same inputs, in torch and in
JAX (under ``jax.jit``), and the two agree.

Between repeats, every fresh torch allocation is filled with a different byte
pattern (NaN-ish 0x7F, zeros, 0xFF, random bytes), so a result that depended
on an unwritten output element or on stale workspace contents would change.
Caches updated in place start each repeat from the same contents.

On the CPU (interpreter) the shapes are tiny and each call repeats 3 times; the
GPU cases (marked ``gpu``) use production-like shapes and 5 repeats: split-K
attention (one decode row over thousands of tokens), long top-k rows with
massive ties, prefill-sized scoring and selection, and the composed step at
production head sizes.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import pytest
import torch

import qsa_jax
import qsa_torch
from qsa_kernels import runtime

from .util import DEVICE, assert_bitwise_equal, to_jax

STATE_FIELDS = ("key_cache", "value_cache", "compressor_state_cache", "compressed_key_cache")

pytestmark = pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")

BF16 = torch.bfloat16


@dataclasses.dataclass
class Call:
    """One public call: arrays (in signature order), static options, caches updated in place."""

    function: str
    arrays: dict
    static: dict
    in_place: tuple[str, ...] = ()


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _floats(rng, shape, dtype=BF16, integer=False):
    values = rng.integers(-3, 4, shape) if integer else rng.standard_normal(shape)
    return torch.from_numpy(np.asarray(values, np.float32)).to(dtype).to(DEVICE)


def _ints(values, dtype=torch.int32):
    return torch.as_tensor(np.asarray(values)).to(dtype).to(DEVICE)


def _spoil(values: np.ndarray, rng, size: int, fraction: float = 0.2) -> np.ndarray:
    """Replace a fraction of indices by -1, other negatives and values past ``size``."""
    values = values.copy()
    bad = rng.random(values.shape) < fraction
    values[bad] = rng.choice(np.array([-1, -7, size, size + 5, 2**31 - 1]), bad.sum())
    return values


# --------------------------------------------------------------------------
# Calls of every function, at a given scale
# --------------------------------------------------------------------------

def rope_call(seed, T, QH, KH, D, P, blocks):
    rng = _rng(seed)
    slots = rng.permutation(blocks * P)[:T]  # distinct: two writes to one slot are unspecified
    slots = np.where(rng.random(T) < 0.1, -1, slots)
    positions = rng.integers(0, 4096, T)
    positions[::7] = 5000  # past cos_sin: NaN rows, no cache write
    angles = rng.uniform(0, 6.3, (4096, D // 2))
    return Call("rope_reshape_and_cache", dict(
        q=_floats(rng, (T, QH, D)), k=_floats(rng, (T, KH, D)), v=_floats(rng, (T, KH, D)),
        key_cache=_floats(rng, (blocks, P, KH, D)), value_cache=_floats(rng, (blocks, P, KH, D)),
        slot_mapping=_ints(slots, torch.int64), positions=_ints(positions),
        cos_sin=torch.from_numpy(np.concatenate([np.cos(angles), np.sin(angles)], 1)).float().to(DEVICE),
    ), dict(is_neox=True, return_zeros=True), in_place=("key_cache", "value_cache"))


def compress_call(seed, lengths, D, ratio):
    rng = _rng(seed)
    rows = sum(lengths)
    starts = np.cumsum([0, *lengths])
    token_to_req = np.repeat(np.arange(len(lengths)), lengths)
    first = rng.integers(0, 50, len(lengths))
    positions = np.concatenate([f + np.arange(n) for f, n in zip(first, lengths)])
    slots = np.where((positions + 1) % ratio == 0, np.arange(rows), -1)
    blocks = len(lengths) + 2
    table = _spoil(rng.permutation(blocks)[:len(lengths)][:, None], rng, blocks)
    return Call("compress_groups", dict(
        raw_keys=_floats(rng, (rows, 1, D)), raw_positions=_ints(rng.integers(0, 1 << 20, (rows, 1, 3))),
        compressor_state_cache=_floats(rng, (blocks, ratio, 1, D)), compressor_state_block_table=_ints(table),
        token_to_req=_ints(token_to_req), query_start_loc=_ints(starts), logical_positions=_ints(positions),
        compressed_slots=_ints(slots), rope_cache=_ints(rng.integers(0, 1 << 20, (blocks, ratio, 1, 3))),
    ), dict(compress_ratio=ratio))


def store_call(seed, R, pages, P, W):
    rng = _rng(seed)
    slots = _spoil(rng.permutation(pages * P)[:R], rng, pages * P)
    return Call("store_cache_rows", dict(cache=_floats(rng, (pages, P, 1, W)), slot_mapping=_ints(slots),
                                         rows=_floats(rng, (R, W))), {}, in_place=("cache",))


def scoring_arrays(seed, rows, requests, context, heads, D, ratio, P, prefill=False):
    rng = _rng(seed)
    width = -(-context // ratio // P)
    pages = requests * width + 2
    table = _spoil(rng.permutation(pages)[:requests * width].reshape(requests, width), rng, pages, 0.05)
    table[:, ::3] = table[0, ::3]  # prefix sharing: pages read by every request
    if prefill:  # consecutive rows of request 0, then one row per request
        token_to_req = np.concatenate([np.zeros(rows - requests, int), np.arange(requests)])
        positions = np.concatenate([context - rows + requests + np.arange(rows - requests), np.full(requests, context - 1)])
    else:
        token_to_req = rng.integers(0, requests, rows)
        positions = rng.integers(0, context, rows)
    token_to_req = _spoil(token_to_req, rng, requests, 0.05)
    lengths = rng.integers(context // 2, context + 1, requests)
    lengths[0] = context
    return dict(q=_floats(rng, (rows, heads, D), integer=True), k_cache=_floats(rng, (pages, P, 1, D), integer=True),
                page_table=_ints(table), token_to_req=_ints(token_to_req), query_positions=_ints(positions),
                sequence_lengths=_ints(lengths))


def scores_call(seed, *args, **kwargs):
    return Call("mqa_paged_scores", scoring_arrays(seed, *args, **kwargs), dict(compress_ratio=args[5]))


def select_call(seed, *args, token_topk, **kwargs):
    return Call("select_paged_tokens", scoring_arrays(seed, *args, **kwargs),
                dict(token_topk=token_topk, compress_ratio=args[5]))


def topk_call(seed, rows, columns, k, distinct=4):
    """Integer-valued logits with only ``distinct`` values: ties everywhere, resolved by column."""
    rng = _rng(seed)
    logits = rng.integers(0, distinct, (rows, columns)).astype(np.float32)
    logits[:, ::97] = np.nan
    logits[:, 5::89] = -np.inf
    visible = rng.integers(0, columns + 1, rows)
    visible[0] = columns
    return Call("topk_blocks", dict(logits=_ints(logits, torch.float32), visible_blocks=_ints(visible)), dict(k=k))


def expand_call(seed, rows, requests, ratio, token_topk):
    rng = _rng(seed)
    lengths = rng.integers(0, 4096, requests)
    blocks = _spoil(rng.integers(0, 1024, (rows, token_topk // ratio)), rng, 1024)
    return Call("expand_block_indices", dict(
        block_indices=_ints(blocks), query_positions=_ints(rng.integers(-2, 4096, rows)),
        sequence_lengths=_ints(lengths), token_to_req=_ints(_spoil(rng.integers(0, requests, rows), rng, requests)),
    ), dict(compress_ratio=ratio, token_topk=token_topk))


def attention_call(seed, rows, QH, KH, D, P, tokens, width, requests=2):
    rng = _rng(seed)
    table_width = -(-tokens // P)
    blocks = requests * table_width + 3
    table = _spoil(rng.permutation(blocks)[:requests * table_width].reshape(requests, table_width), rng, blocks, 0.02)
    indices = _spoil(rng.integers(0, tokens, (rows, width)), rng, table_width * P, 0.1)  # duplicates too
    return Call("sparse_paged_attention", dict(
        q=_floats(rng, (rows, QH, D)), k_cache=_floats(rng, (blocks, P, KH, D)),
        v_cache=_floats(rng, (blocks, P, KH, D)), token_indices=_ints(indices), block_table=_ints(table),
        token_to_req=_ints(_spoil(rng.integers(0, requests, rows), rng, requests, 0.1)),
    ), dict())


# --------------------------------------------------------------------------
# Repeating a call
# --------------------------------------------------------------------------

GARBAGE = (0x7F, 0x00, 0xFF, None)  # None: random bytes


@pytest.fixture
def varying_garbage(monkeypatch):
    """``set(i)`` makes every later torch.empty/empty_like come back filled with pattern i."""
    empty, empty_like = torch.empty, torch.empty_like
    state = {"pattern": 0x7F, "generator": torch.Generator().manual_seed(0)}

    def fill(tensor):
        if tensor.numel() and tensor.is_contiguous():
            raw = tensor.view(torch.uint8)
            pattern = state["pattern"]
            if pattern is None:
                raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=state["generator"]))
            else:
                raw.fill_(pattern)
        return tensor

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(empty_like(*a, **k)))
    return lambda i: state.update(pattern=GARBAGE[i % len(GARBAGE)])


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def assert_deterministic(call: Call, repeats: int, set_garbage, jax_repeats: int = 2) -> None:
    originals = {name: call.arrays[name].clone() for name in call.in_place}
    first = None
    for i in range(repeats):
        set_garbage(i)
        arrays = {**call.arrays, **{name: value.clone() for name, value in originals.items()}}
        out = tuple(t.clone() for t in _as_tuple(getattr(qsa_torch, call.function)(**arrays, **call.static)))
        if first is None:
            first = out
            continue
        for j, (a, b) in enumerate(zip(first, out)):
            assert_bitwise_equal(a, b, f"{call.function}: output {j}, repeat {i} vs repeat 0")
    x64 = any(a.dtype == torch.int64 for a in call.arrays.values())
    with jax.enable_x64(x64):
        jitted = jax.jit(lambda values: getattr(qsa_jax, call.function)(**values, **call.static))
        for i in range(jax_repeats):
            out = _as_tuple(jitted({name: to_jax(value) for name, value in {**call.arrays, **originals}.items()}))
            for j, (a, b) in enumerate(zip(first, out)):
                assert_bitwise_equal(a, np.asarray(b), f"{call.function}: output {j}, JAX repeat {i} vs torch")


# --------------------------------------------------------------------------
# CPU (interpreter): tiny shapes
# --------------------------------------------------------------------------

CPU_CALLS = {
    "rope": lambda: rope_call(0, T=5, QH=4, KH=2, D=16, P=4, blocks=3),
    "compress": lambda: compress_call(1, lengths=(5, 1, 3), D=16, ratio=4),
    "store": lambda: store_call(2, R=6, pages=3, P=4, W=24),
    "scores_decode": lambda: scores_call(3, 4, 3, 40, 2, 16, 4, 4),
    "scores_prefill": lambda: scores_call(4, 20, 2, 60, 2, 16, 4, 4, prefill=True),
    "topk": lambda: topk_call(5, rows=3, columns=70, k=9),
    "expand": lambda: expand_call(6, rows=4, requests=2, ratio=4, token_topk=12),
    "select": lambda: select_call(7, 5, 2, 60, 2, 16, 4, 4, token_topk=12),
    "attention_split_k": lambda: attention_call(8, rows=2, QH=4, KH=2, D=16, P=4, tokens=40, width=300),
}


def assert_split_k(call: Call) -> None:
    """The call takes the split-K path: its tokens split across programs whose partial
    outputs are merged (by a merge launch, or in their launch by merging programs that take
    their role by ticket, AttentionTuning.fused_merge: which program does which split varies
    from run to run on a GPU, the merge order never does)."""
    program = getattr(qsa_torch, call.function).plan(**call.arrays)
    assert program.buffer("partial_lse").shape[0] > 1, "the case must split its tokens across programs"


@pytest.mark.skipif(not runtime.INTERPRETED, reason="on a GPU the production-sized variant below runs instead")
@pytest.mark.parametrize("name", list(CPU_CALLS))
def test_repeated_calls_are_bitwise_identical(name, varying_garbage):
    call = CPU_CALLS[name]()
    if name.endswith("split_k"):
        assert_split_k(call)
    assert_deterministic(call, repeats=3, set_garbage=varying_garbage)


# --------------------------------------------------------------------------
# GPU: production-like shapes, 5 repeats
# --------------------------------------------------------------------------

GPU_CALLS = {
    "rope_prefill_2048": lambda: rope_call(10, T=2048, QH=24, KH=2, D=256, P=64, blocks=64),
    "compress_prefill_2048": lambda: compress_call(11, lengths=(2048, 1, 7), D=128, ratio=4),
    "store_4096_rows": lambda: store_call(12, R=4096, pages=256, P=64, W=128),
    "scores_prefill_512_rows": lambda: scores_call(14, 512, 2, 32768, 4, 128, 4, 64, prefill=True),
    "topk_long_row": lambda: topk_call(15, rows=1, columns=262144, k=2048),  # ticketed
    "topk_long_rows": lambda: topk_call(16, rows=2, columns=262144, k=2048),  # sliced
    "expand_256_rows": lambda: expand_call(17, rows=256, requests=8, ratio=4, token_topk=2048),
    "select_64_rows_32k": lambda: select_call(18, 64, 8, 32768, 4, 128, 4, 64, token_topk=2048),
    # Decode rows over 2559 / 2051 tokens: the plan splits them across many programs (split-K, merged in the launch).
    "attention_split_k_decode": lambda: attention_call(19, rows=1, QH=24, KH=2, D=256, P=64, tokens=8192, width=2559),
    "attention_split_k_decode_8": lambda: attention_call(20, rows=8, QH=24, KH=2, D=256, P=64, tokens=8192,
                                                         width=2051),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CALLS))
def test_repeated_calls_are_bitwise_identical_on_gpu(name, varying_garbage):
    call = GPU_CALLS[name]()
    if "split_k" in name:
        assert_split_k(call)
    assert_deterministic(call, repeats=5, set_garbage=varying_garbage)


# --------------------------------------------------------------------------
# The composed step: the same state and metadata, the same results
# --------------------------------------------------------------------------

def step_arguments(seed, schedule: dict, QH, KH, D, IH, DI, ratio, page, token_topk, max_context):
    """One step of ``schedule`` rows per request from a random (stale, never zero) state."""
    from qsa_kernels.paging import CacheGeometry, PagedRequests

    rng = _rng(seed)
    requests = len(schedule)
    geometry = CacheGeometry(page_size=page, num_pages=requests * math.ceil(max_context / page) + 2,
                             compress_ratio=ratio, compressed_page_size=page,
                             num_compressed_pages=requests * math.ceil(max_context / ratio / page) + 2,
                             max_context=max_context, max_requests=requests)
    host_meta = PagedRequests(geometry, seed=seed).step(schedule)
    rows = host_meta.num_rows
    shapes = geometry.state_shapes(KH, D, DI)
    state = qsa_torch.QSAState(**{n: _floats(rng, shapes[n], BF16 if n in ("key_cache", "value_cache") else torch.float32)
                                  for n in STATE_FIELDS})
    angles = rng.uniform(0, 6.3, (max_context, max(D, DI) // 2))
    table = lambda d: torch.from_numpy(  # noqa: E731
        np.concatenate([np.cos(angles[:, : d // 2]), np.sin(angles[:, : d // 2])], 1)).float().to(DEVICE)
    return dict(q=_floats(rng, (rows, QH, D)), k=_floats(rng, (rows, KH, D)), v=_floats(rng, (rows, KH, D)),
                index_q=_floats(rng, (rows, IH, DI), torch.float32), index_k=_floats(rng, (rows, 1, DI), torch.float32),
                state=state, metadata=qsa_torch.StepMetadata.from_host(host_meta, DEVICE),
                cos_sin=table(D), index_cos_sin=table(DI), compress_ratio=ratio, token_topk=token_topk,
                return_token_indices=True)


def assert_step_deterministic(arguments: dict, repeats: int, set_garbage, jax_repeats: int = 2) -> None:
    original = arguments["state"]
    first = None
    for i in range(repeats):
        set_garbage(i)
        state = dataclasses.replace(original, **{n: getattr(original, n).clone() for n in STATE_FIELDS})
        out, state, indices = qsa_torch.qsa_attention_step(**{**arguments, "state": state})
        results = (out.clone(), indices.clone(), *(getattr(state, n).clone() for n in STATE_FIELDS))
        if first is None:
            first = results
            continue
        for j, (a, b) in enumerate(zip(first, results)):
            assert_bitwise_equal(a, b, f"qsa_attention_step: result {j}, repeat {i} vs repeat 0")
    static = {n: arguments[n] for n in ("compress_ratio", "token_topk", "return_token_indices")}
    jitted = jax.jit(lambda a: qsa_jax.qsa_attention_step(**a, **static))
    for i in range(jax_repeats):
        jax_arguments = {n: to_jax(arguments[n]) for n in ("q", "k", "v", "index_q", "index_k", "cos_sin", "index_cos_sin")}
        jax_arguments["state"] = qsa_jax.QSAState(**{n: to_jax(getattr(original, n)) for n in STATE_FIELDS})
        jax_arguments["metadata"] = qsa_jax.StepMetadata(**{f.name: to_jax(getattr(arguments["metadata"], f.name))
                                                            for f in dataclasses.fields(arguments["metadata"])})
        out, state, indices = jitted(jax_arguments)
        for j, (a, b) in enumerate(zip(first, (out, indices, *(getattr(state, n) for n in STATE_FIELDS)))):
            assert_bitwise_equal(a, np.asarray(b), f"qsa_attention_step: result {j}, JAX repeat {i} vs torch")


@pytest.mark.skipif(not runtime.INTERPRETED, reason="on a GPU the production-sized variant below runs instead")
def test_repeated_steps_are_bitwise_identical(varying_garbage):
    arguments = step_arguments(30, {"a": 6, "b": 1, "c": 3}, QH=4, KH=2, D=16, IH=2, DI=16, ratio=2, page=4,
                               token_topk=4, max_context=24)
    assert_step_deterministic(arguments, repeats=3, set_garbage=varying_garbage)


@pytest.mark.gpu
def test_repeated_steps_are_bitwise_identical_on_gpu(varying_garbage):
    """Production heads (24 Q / 2 KV x d256, indexer 4 x d128, ratio 4, pages of 64, top 512 tokens):
    a prefill chunk of one request next to decode-like rows of three others."""
    arguments = step_arguments(31, {"a": 700, "b": 1, "c": 1, "d": 5}, QH=24, KH=2, D=256, IH=4, DI=128, ratio=4,
                               page=64, token_topk=512, max_context=4096)
    assert_step_deterministic(arguments, repeats=5, set_garbage=varying_garbage)
