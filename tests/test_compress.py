"""Stage 2 (compress_groups, store_cache_rows): both adapters against the float64
reference, torch-vs-JAX bitwise parity under jax.jit, untouched cells, validation,
and a prefill-then-decode flow that keeps a paged compressed-key cache."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import numpy as np
import pytest
import torch

import qsa_jax
import qsa_torch

from . import reference as R
from .util import DEVICE, assert_bitwise_equal, assert_close, f64, host, to_jax, tolerance

# On the CPU the JAX side runs from a host callback, which cannot reuse a donated buffer.
pytestmark = pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")


def needs_x64(arrays) -> bool:
    """JAX keeps int64 only with x64 enabled: turn it on where the torch side uses int64."""
    return any(a is not None and a.dtype == torch.int64 for a in arrays)


# --------------------------------------------------------------------------
# compress_groups
# --------------------------------------------------------------------------

@dataclasses.dataclass
class Case:
    """One compress_groups configuration; options are spread pairwise over the cases."""

    lengths: tuple[int, ...] = (5, 1, 7)  # this step's rows of each request
    contexts: tuple[int, ...] = (9, 31, 2)  # position of each request's first row
    D: int = 64
    ratio: int = 4
    ring: int = 4
    dtype: torch.dtype = torch.bfloat16
    positions_dtype: torch.dtype = torch.int64  # raw_positions and rope_cache
    index_dtype: torch.dtype = torch.int32  # logical_positions and compressed_slots
    rope_cache: bool = False
    every_row: bool = False  # slots on rows that end no group: the window ending there is pooled
    broken: bool = False  # -1 / out-of-range ring blocks, rows of invalid requests, padding rows
    views: bool = False  # strided torch views instead of contiguous tensors
    seed: int = 0


def make_compress_inputs(c: Case) -> dict:
    g = torch.Generator().manual_seed(c.seed)
    requests, blocks = len(c.lengths), len(c.lengths) + 3
    starts = [0, *itertools.accumulate(c.lengths)]
    token_to_req = [req for req, n in enumerate(c.lengths) for _ in range(n)]
    positions = [ctx + j for ctx, n in zip(c.contexts, c.lengths) for j in range(n)]
    slots = [s if (p + 1) % c.ratio == 0 else -1 for s, p in enumerate(positions)]
    if c.every_row:
        extra = torch.rand(len(slots), generator=g) < 0.6
        slots = [s if s >= 0 or not e else 100 + i for i, (s, e) in enumerate(zip(slots, extra.tolist()))]
    if c.broken:
        # Padding rows (-1), a request past B, and rows outside their request's
        # range: slots and positions would pool them if the request were valid.
        token_to_req += [-1, requests, 0, requests - 1]
        positions += [50, 51, 52, 53]
        slots += [7, 8, 9, 10]
    rows = len(token_to_req)

    table = torch.randperm(blocks, generator=g)[: requests + 1].to(torch.int32)
    if c.broken:
        assert requests >= 3
        table[1], table[2] = -1, blocks + 3  # a missing and an out-of-range ring block
    table = torch.stack([table, torch.randint(0, blocks, (requests + 1,), generator=g, dtype=torch.int32)], 1)

    def rnd(*shape):
        if not c.views:
            return torch.randn(*shape, generator=g).to(c.dtype)
        # A row-major view with padding: last dimension contiguous, other strides not.
        return torch.randn(*shape[:-1], shape[-1] + 3, generator=g).to(c.dtype)[..., 2: 2 + shape[-1]]

    def positions_like(*shape):
        values = torch.randint(0, 1 << 20, (*shape[:-1], shape[-1] + (1 if c.views else 0)), generator=g)
        return values.to(c.positions_dtype)[..., -shape[-1]:]

    args = dict(
        raw_keys=rnd(rows, 1, c.D),
        raw_positions=positions_like(rows, 1, 3),
        compressor_state_cache=rnd(blocks, c.ring, 1, c.D),
        compressor_state_block_table=table[:, :1] if c.views else table,
        token_to_req=torch.tensor(token_to_req, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        logical_positions=torch.tensor(positions, dtype=c.index_dtype),
        compressed_slots=torch.tensor(slots, dtype=c.index_dtype),
        rope_cache=positions_like(blocks, c.ring, 1, 3) if c.rope_cache else None,
    )
    # Views stay views on the device: slicing after the move keeps the strides.
    return {n: (None if a is None else a.to(DEVICE) if a.is_contiguous() else _view_on_device(a))
            for n, a in args.items()}


def _view_on_device(view: torch.Tensor) -> torch.Tensor:
    base = view._base if view._base is not None else view
    moved = base.to(DEVICE)
    return moved.as_strided(view.shape, view.stride(), view.storage_offset())


def reference_compress(args: dict, ratio: int):
    arrays = {n: (None if a is None else host(a)) for n, a in args.items()}
    arrays["raw_keys"] = f64(args["raw_keys"])
    arrays["compressor_state_cache"] = f64(args["compressor_state_cache"])
    return R.compress_groups(**arrays, compress_ratio=ratio)


def jax_compress(args: dict, ratio: int):
    with jax.enable_x64(needs_x64(args.values())):
        call = jax.jit(lambda arrays: qsa_jax.compress_groups(**arrays, compress_ratio=ratio))
        out = call({n: (None if a is None else to_jax(a)) for n, a in args.items()})
        return tuple(np.asarray(o) for o in out)


def groups_spanning_ring_and_chunk(c: Case) -> int:
    """Pooled rows of the case whose group starts in the ring and ends in this step's rows."""
    count = 0
    for ctx, n in zip(c.contexts, c.lengths):
        count += sum(1 for p in range(ctx, ctx + n) if (p + 1) % c.ratio == 0 and 0 <= p - c.ratio + 1 < ctx)
    return count


def check_compress(c: Case):
    args = make_compress_inputs(c)
    ring_before = args["compressor_state_cache"].clone()
    jax_out = jax_compress(args, c.ratio)
    pooled, first_positions = qsa_torch.compress_groups(**args, compress_ratio=c.ratio)
    ref_pooled, ref_first = reference_compress(args, c.ratio)

    rows = args["raw_keys"].shape[0]
    assert pooled.shape == (rows, 1, c.D) and pooled.dtype == c.dtype
    assert first_positions.shape == (rows, 3) and first_positions.dtype == c.positions_dtype
    assert_close(pooled, ref_pooled, tolerance(c.dtype), "pooled")
    # Rows not pooled (and groups read only from a missing ring block) are exact zeros.
    assert np.all(f64(pooled)[ref_pooled == 0] == 0), "rows not pooled must be zeros"
    np.testing.assert_array_equal(host(first_positions), ref_first, "first_positions")
    assert_bitwise_equal(args["compressor_state_cache"], ring_before, "the ring is read-only")
    assert_bitwise_equal(jax_out[0], pooled, "torch vs JAX pooled")
    assert_bitwise_equal(jax_out[1], first_positions, "torch vs JAX first_positions")
    # The case must exercise what it claims to.
    assert np.count_nonzero(np.any(ref_pooled != 0, axis=(1, 2))) >= 2, "the case pools almost nothing"
    assert groups_spanning_ring_and_chunk(c) > 0, "no group spans ring and chunk"


COMPRESS_CASES = {
    "bf16_d64_r4_ring4_broken": Case(broken=True),
    "fp16_d128_r8_ring8_rope64_every_row": Case(lengths=(11, 3, 20), contexts=(13, 5, 6), D=128, ratio=8, ring=8,
                                               dtype=torch.float16, rope_cache=True, every_row=True,
                                               index_dtype=torch.int64),
    "fp32_d256_r4_ring6_rope32_views_broken": Case(lengths=(9, 2, 14, 6), contexts=(6, 2, 10, 21), D=256, ring=6,
                                                  dtype=torch.float32, positions_dtype=torch.int32,
                                                  rope_cache=True, views=True, broken=True),
    "bf16_d128_r8_ring12_rope32_every_row_broken": Case(lengths=(10, 4, 17), contexts=(3, 60, 9), D=128, ratio=8,
                                                       ring=12, positions_dtype=torch.int32, rope_cache=True,
                                                       every_row=True, broken=True, index_dtype=torch.int64),
    "fp16_d64_r8_ring9_views_rope64": Case(lengths=(12, 9), contexts=(4, 19), D=64, ratio=8, ring=9,
                                          dtype=torch.float16, rope_cache=True, views=True),
    "fp32_d128_decode_rows": Case(lengths=(1, 1, 1, 1), contexts=(7, 15, 22, 3), D=128, ratio=4, ring=4,
                                  dtype=torch.float32, positions_dtype=torch.int32, every_row=True),
    "bf16_d256_r4_ring5_norope_every_row": Case(lengths=(6, 13), contexts=(2, 5), D=256, ring=5, every_row=True,
                                               index_dtype=torch.int64),
    "fp32_d48_not_a_power_of_two": Case(lengths=(3, 6), contexts=(1, 8), D=48, dtype=torch.float32, rope_cache=True),
}


@pytest.mark.parametrize("name", list(COMPRESS_CASES))
def test_compress_against_reference_and_jax(name):
    check_compress(COMPRESS_CASES[name])


@pytest.mark.gpu
def test_compress_production_shapes():
    # Decode: 256 requests, one row each; prefill: one chunk of 2048 rows starting mid-group.
    check_compress(Case(lengths=(1,) * 256, contexts=tuple(4 * i + 3 for i in range(256)), D=128,
                        rope_cache=True, broken=False))
    check_compress(Case(lengths=(2048, 5, 3), contexts=(4098, 9, 1), D=256, rope_cache=True))


def test_compress_zero_rows():
    c = Case(lengths=(0, 0), contexts=(5, 9))
    args = make_compress_inputs(c)
    # No rows: an empty ring is fine too.
    args["compressor_state_cache"] = args["compressor_state_cache"][:0]
    pooled, first_positions = qsa_torch.compress_groups(**args, compress_ratio=c.ratio)
    assert pooled.shape == (0, 1, c.D) and first_positions.shape == (0, 3)
    jax_pooled, jax_first = jax_compress(args, c.ratio)
    assert jax_pooled.shape == (0, 1, c.D) and jax_first.shape == (0, 3)


# --------------------------------------------------------------------------
# store_cache_rows
# --------------------------------------------------------------------------

@dataclasses.dataclass
class StoreCase:
    R: int = 7
    pages: int = 5
    P: int = 4
    W: int = 64
    dtype: torch.dtype = torch.bfloat16
    rows_3d: bool = False  # rows [R, 1, W] instead of [R, W]
    slot_dtype: torch.dtype = torch.int64
    views: bool = False  # cache and rows are strided views of larger tensors
    seed: int = 0


def make_store_inputs(c: StoreCase):
    g = torch.Generator().manual_seed(c.seed)
    pad = 5 if c.views else 0

    def values(*shape):
        if c.dtype.is_floating_point:
            return (torch.randn(*shape, generator=g) * 8).to(c.dtype)
        return torch.randint(-(1 << 30), 1 << 30, shape, generator=g).to(c.dtype)

    pool = values(c.pages, c.P, 1, c.W + pad).to(DEVICE)
    cache = pool[..., pad:] if c.views else pool
    rows_pool = values(c.R, c.W + 2 * pad).to(DEVICE)
    rows = rows_pool[:, pad: pad + c.W] if c.views else rows_pool
    if c.rows_3d:
        rows = rows[:, None]
    num_slots = c.pages * c.P
    slots = torch.randperm(num_slots, generator=g)[: c.R].to(torch.int64)
    slots[1] = -1
    slots[-1] = num_slots + 2
    # Out of range, but aliases a real slot if offsets were truncated to 32 bits.
    slots[2] = (1 << 32) + slots[2] if c.slot_dtype == torch.int64 else (1 << 31) - 1
    return pool, cache, slots.to(c.slot_dtype).to(DEVICE), rows


def jax_store(cache, slots, rows):
    with jax.enable_x64(needs_x64((cache, slots, rows))):
        call = jax.jit(qsa_jax.store_cache_rows, donate_argnums=0)
        return np.asarray(call(to_jax(cache), to_jax(slots), to_jax(rows)))


def check_store(c: StoreCase):
    pool, cache, slots, rows = make_store_inputs(c)
    pool_before, cache_before = pool.clone(), host(cache)
    jax_out = jax_store(cache, slots, rows)
    out = qsa_torch.store_cache_rows(cache, slots, rows)
    assert out is cache, "the cache must be updated in place and returned"
    ref, written = R.store_cache_rows(cache_before, host(slots), host(rows))
    assert written.any() and not written.all(), "the case must write some cells and leave others"
    assert_bitwise_equal(out, ref, "cache vs reference")
    if c.views:
        assert_bitwise_equal(pool[..., : pool.shape[-1] - c.W], pool_before[..., : pool.shape[-1] - c.W],
                             "pool outside the cache view")
    assert_bitwise_equal(jax_out, out, "torch vs JAX cache")


STORE_CASES = {
    "bf16_w128_rows2d_slots64": StoreCase(W=128),
    "fp32_w64_rows3d_slots32_views": StoreCase(dtype=torch.float32, rows_3d=True, slot_dtype=torch.int32, views=True),
    "int64_w3_positions_rows3d": StoreCase(W=3, dtype=torch.int64, rows_3d=True, P=8),
    "int32_w3_rows2d_slots32_views": StoreCase(W=3, dtype=torch.int32, slot_dtype=torch.int32, views=True),
    "fp16_w256_rows3d_p16": StoreCase(W=256, dtype=torch.float16, rows_3d=True, P=16, pages=2),
    "fp8_w32_rows2d_slots32": StoreCase(W=32, dtype=torch.float8_e4m3fn, slot_dtype=torch.int32),
    "bf16_w64_many_rows": StoreCase(R=45, pages=8, P=8, W=64, views=True),
}


@pytest.mark.parametrize("name", list(STORE_CASES))
def test_store_against_reference_and_jax(name):
    check_store(STORE_CASES[name])


def test_store_zero_rows():
    pool, cache, _, _ = make_store_inputs(StoreCase())
    before = cache.clone()
    slots = torch.empty(0, dtype=torch.int32, device=DEVICE)
    rows = torch.empty(0, 1, cache.shape[-1], dtype=cache.dtype, device=DEVICE)
    assert qsa_torch.store_cache_rows(cache, slots, rows) is cache
    assert_bitwise_equal(cache, before, "cache after an empty store")
    assert_bitwise_equal(jax_store(cache, slots, rows), before, "JAX cache after an empty store")


def test_store_jax_donation_under_jit():
    """Donating the cache under jit: the result holds the update and can be donated again."""
    _, cache, slots, rows = make_store_inputs(StoreCase(slot_dtype=torch.int32))
    call = jax.jit(qsa_jax.store_cache_rows, donate_argnums=0)
    jax_cache = call(to_jax(cache), to_jax(slots), to_jax(rows))
    jax_cache = call(jax_cache, to_jax(slots.flip(0)), to_jax(rows * 2))
    qsa_torch.store_cache_rows(cache, slots, rows)
    qsa_torch.store_cache_rows(cache, slots.flip(0), rows * 2)
    assert_bitwise_equal(jax_cache, cache, "cache after two donated stores")


@pytest.mark.gpu
def test_store_jax_donation_reuses_the_buffer():
    _, cache, slots, rows = make_store_inputs(StoreCase(R=32, pages=16, P=16, slot_dtype=torch.int32))
    call = jax.jit(qsa_jax.store_cache_rows, donate_argnums=0)
    jax_cache = to_jax(cache)
    pointer = jax_cache.unsafe_buffer_pointer()
    out = call(jax_cache, to_jax(slots), to_jax(rows))
    assert out.unsafe_buffer_pointer() == pointer, "donated cache was copied"
    assert jax_cache.is_deleted(), "the donated input must be consumed"
    qsa_torch.store_cache_rows(cache, slots, rows)
    assert_bitwise_equal(out, cache, "donated store vs torch")


@pytest.mark.gpu
def test_int64_cache_offsets():
    """Caches past 2**31 elements: the last page is written and read at its true address."""
    import jax.numpy as jnp

    pages, page, width = (1 << 31) // (64 * 256) + 2, 64, 256
    cache = torch.zeros(pages, page, 1, width, dtype=torch.bfloat16, device=DEVICE)
    slots = torch.tensor([pages * page - 3, 5], dtype=torch.int64, device=DEVICE)
    rows = torch.randn(2, width, device=DEVICE).to(torch.bfloat16)
    qsa_torch.store_cache_rows(cache, slots, rows)
    assert_bitwise_equal(cache[pages - 1, page - 3, 0], rows[0], "row stored past 2**31 elements")
    # The same cache as a compressor ring (ring = P): one decode row whose group's
    # three older members sit in the last block.
    raw = torch.randn(1, 1, width, device=DEVICE).to(torch.bfloat16)
    position = 64 * 10 + 3 + 60  # slots 60..62 of the ring, then this row
    cache[pages - 1, 60:63, 0] = torch.randn(3, width, device=DEVICE).to(torch.bfloat16)
    args = dict(raw_keys=raw, raw_positions=torch.zeros(1, 1, 3, dtype=torch.int32, device=DEVICE),
                compressor_state_cache=cache,
                compressor_state_block_table=torch.tensor([[pages - 1]], dtype=torch.int32, device=DEVICE),
                token_to_req=torch.zeros(1, dtype=torch.int32, device=DEVICE),
                query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
                logical_positions=torch.tensor([position], dtype=torch.int32, device=DEVICE),
                compressed_slots=torch.zeros(1, dtype=torch.int32, device=DEVICE))
    pooled, _ = qsa_torch.compress_groups(**args, compress_ratio=4)
    expected = (f64(cache[pages - 1, 60:63, 0]).sum(0) + f64(raw[0, 0])) / 4
    assert_close(pooled[0, 0], expected, 1e-2, "pooled from a block past 2**31 elements")
    jax_args = {n: (jnp.asarray(host(a)) if n != "compressor_state_cache" else None) for n, a in args.items()}
    jax_args["compressor_state_cache"] = jnp.zeros(cache.shape, jnp.bfloat16).at[pages - 1, 60:63].set(
        jnp.asarray(host(cache[pages - 1, 60:63])))
    jax_pooled, _ = jax.jit(lambda a: qsa_jax.compress_groups(**a, compress_ratio=4))(jax_args)
    assert_bitwise_equal(jax_pooled, pooled, "JAX pooled from a block past 2**31 elements")


# --------------------------------------------------------------------------
# The realistic flow: chunked prefill, then decode, keeping a compressed cache
# --------------------------------------------------------------------------

@dataclasses.dataclass
class Flow:
    lengths: tuple[int, ...] = (37, 22, 45)
    chunks: tuple[tuple[int, ...], ...] = ((7, 13, 5), (11, 2), (3, 17, 9))  # then decode one token a step
    D: int = 32
    ratio: int = 4
    ring: int = 4
    dtype: torch.dtype = torch.bfloat16
    page: int = 4  # compressed-cache page size
    seed: int = 0


def flow_inputs(f: Flow):
    g = torch.Generator().manual_seed(f.seed)
    keys = [torch.randn(n, f.D, generator=g).to(f.dtype) for n in f.lengths]
    # The 3 stored position values of a token: distinct per request and component.
    stored = [np.stack([np.arange(n), np.arange(n) + 1000 * (i + 1), 2 * np.arange(n) + 7], 1).astype(np.int32)
              for i, n in enumerate(f.lengths)]
    groups = [n // f.ratio for n in f.lengths]
    pages_per_request = [-(-n // f.page) for n in groups]
    pages = sum(pages_per_request) + 2
    order = torch.randperm(pages, generator=g).tolist()
    page_table = [order[sum(pages_per_request[:i]): sum(pages_per_request[: i + 1])] for i in range(len(f.lengths))]
    blocks = len(f.lengths) + 2
    ring_blocks = torch.randperm(blocks, generator=g)[: len(f.lengths)].tolist()
    caches = dict(  # random garbage to start with: nothing may read it as a key
        ring=torch.randn(blocks, f.ring, 1, f.D, generator=g).to(f.dtype),
        rope=torch.randint(0, 99, (blocks, f.ring, 1, 3), generator=g, dtype=torch.int32),
        compressed=torch.randn(pages, f.page, 1, f.D, generator=g).to(f.dtype),
        compressed_positions=torch.randint(0, 99, (pages, f.page, 1, 3), generator=g, dtype=torch.int32),
    )
    return keys, stored, page_table, ring_blocks, caches


def flow_steps(f: Flow, stored, page_table, ring_blocks):
    """Per step, the batch metadata (NumPy): every request with tokens left contributes
    its next prefill chunk, or one decode token."""
    done = [0] * len(f.lengths)
    step = 0
    while any(d < n for d, n in zip(done, f.lengths)):
        sizes = [0 if d >= n else (f.chunks[i][step] if step < len(f.chunks[i]) else 1)
                 for i, (d, n) in enumerate(zip(done, f.lengths))]
        rows = [(i, p) for i, s in enumerate(sizes) for p in range(done[i], done[i] + s)]
        compressed_slots = []
        for i, p in rows:
            group = (p + 1) // f.ratio - 1
            complete = (p + 1) % f.ratio == 0
            compressed_slots.append(page_table[i][group // f.page] * f.page + group % f.page if complete else -1)
        yield dict(
            token_rows=rows,
            raw_positions=np.stack([stored[i][p] for i, p in rows])[:, None].astype(np.int32),
            token_to_req=np.array([i for i, _ in rows], np.int32),
            query_start_loc=np.array([0, *itertools.accumulate(sizes)], np.int32),
            logical_positions=np.array([p for _, p in rows], np.int32),
            compressed_slots=np.array(compressed_slots, np.int32),
            # Only a chunk's last `ring` positions go into the ring: earlier ones
            # would share slots with them, and two rows writing one slot in one
            # call is unspecified (on the GPU, whichever program runs last wins).
            ring_slots=np.array([ring_blocks[i] * f.ring + p % f.ring if p >= done[i] + sizes[i] - f.ring else -1
                                 for i, p in rows], np.int32),
        )
        done = [d + s for d, s in zip(done, sizes)]
        step += 1


class TorchApi:
    qsa = qsa_torch

    @staticmethod
    def array(value):
        return torch.from_numpy(value).to(DEVICE) if isinstance(value, np.ndarray) else value.to(DEVICE)

    def compress(self, *args, **kwargs):
        return self.qsa.compress_groups(*args, **kwargs)

    def store(self, cache, slots, rows):
        out = self.qsa.store_cache_rows(cache, slots, rows)
        assert out is cache
        return out


class JaxApi:
    def __init__(self, ratio):
        self._compress = jax.jit(lambda *a: qsa_jax.compress_groups(*a[:8], ratio, rope_cache=a[8]))
        self._store = jax.jit(qsa_jax.store_cache_rows, donate_argnums=0)

    @staticmethod
    def array(value):
        return jax.numpy.asarray(value) if isinstance(value, np.ndarray) else to_jax(value)

    def compress(self, *args, compress_ratio, rope_cache):
        return self._compress(*args, rope_cache)

    def store(self, cache, slots, rows):
        return self._store(cache, slots, rows)


def run_flow(f: Flow, api, compress_first: bool = True):
    """Run every step through ``api``; returns the final caches as NumPy arrays."""
    keys, stored, page_table, ring_blocks, caches = flow_inputs(f)
    caches = {n: api.array(c) for n, c in caches.items()}
    table = np.array([[b, 0] for b in ring_blocks], np.int32)
    for meta in flow_steps(f, stored, page_table, ring_blocks):
        raw_keys = torch.stack([keys[i][p] for i, p in meta["token_rows"]])[:, None]
        raw_keys, raw_positions = api.array(raw_keys), api.array(meta["raw_positions"])
        ring_slots, compressed_slots = api.array(meta["ring_slots"]), api.array(meta["compressed_slots"])

        def store_raw():
            caches["ring"] = api.store(caches["ring"], ring_slots, raw_keys)
            caches["rope"] = api.store(caches["rope"], ring_slots, raw_positions)

        if not compress_first:
            store_raw()
        pooled, first_positions = api.compress(
            raw_keys, raw_positions, caches["ring"], api.array(table), api.array(meta["token_to_req"]),
            api.array(meta["query_start_loc"]), api.array(meta["logical_positions"]), compressed_slots,
            compress_ratio=f.ratio, rope_cache=caches["rope"])
        if compress_first:
            store_raw()
        caches["compressed"] = api.store(caches["compressed"], compressed_slots, pooled)
        caches["compressed_positions"] = api.store(caches["compressed_positions"], compressed_slots, first_positions)
    return {n: (host(c) if isinstance(c, torch.Tensor) else np.asarray(c)) for n, c in caches.items()}, keys, stored, page_table


def flow_errors(f: Flow, caches, keys, stored, page_table):
    """Per request: (relative error of its compressed keys, whether its group positions are right)."""
    results = []
    for i, request_keys in enumerate(keys):
        expected = R.mean_pool_groups(f64(request_keys), f.ratio)
        groups = np.arange(len(expected))
        pages, offsets = np.array(page_table[i])[groups // f.page], groups % f.page
        got = caches["compressed"][pages, offsets, 0].astype(np.float64)
        error = np.linalg.norm(got - expected) / np.linalg.norm(expected)
        positions_ok = np.array_equal(caches["compressed_positions"][pages, offsets, 0], stored[i][groups * f.ratio])
        results.append((error, positions_ok))
    return results


FLOWS = {
    "bf16_d32_r4_ring4": Flow(),
    "fp16_d64_r8_ring12": Flow(lengths=(41, 26, 33), chunks=((9, 14), (3, 10, 4), (17,)), D=64, ratio=8, ring=12,
                               dtype=torch.float16, page=2, seed=1),
}


@pytest.mark.parametrize("name", list(FLOWS))
def test_prefill_then_decode_flow(name):
    f = FLOWS[name]
    torch_caches, keys, stored, page_table = run_flow(f, TorchApi())
    for i, (error, positions_ok) in enumerate(flow_errors(f, torch_caches, keys, stored, page_table)):
        assert error <= tolerance(f.dtype), f"request {i}: compressed keys off by {error:.2e}"
        assert positions_ok, f"request {i}: wrong first positions in the compressed cache"
    jax_caches, *_ = run_flow(f, JaxApi(f.ratio))
    for name_ in torch_caches:
        assert_bitwise_equal(jax_caches[name_], torch_caches[name_], f"torch vs JAX {name_}")


def test_flow_storing_raw_keys_first_breaks_groups():
    """compress_groups must run before the step's raw keys go into the ring: a ring
    only `ratio` wide loses members a chunk's first group still needs."""
    f = FLOWS["bf16_d32_r4_ring4"]
    caches, keys, stored, page_table = run_flow(f, TorchApi(), compress_first=False)
    errors = [error for error, _ in flow_errors(f, caches, keys, stored, page_table)]
    assert max(errors) > 10 * tolerance(f.dtype), "storing first should corrupt groups spanning ring and chunk"


# --------------------------------------------------------------------------
# Wrong array types (every bad-argument case is a row of tests/test_bad_arguments.py).
# --------------------------------------------------------------------------

def _compress_base():
    return make_compress_inputs(Case(positions_dtype=torch.int32, rope_cache=True)), 4


def test_wrong_array_types():
    args, ratio = _compress_base()
    with pytest.raises(TypeError, match="compress_groups: query_start_loc must be a torch.Tensor"):
        qsa_torch.compress_groups(**{**args, "query_start_loc": [0, 5, 6, 13]}, compress_ratio=ratio)
    with pytest.raises(TypeError, match="compress_groups: rope_cache must be a JAX array"):
        jax_args = {n: to_jax(a) for n, a in args.items()}
        qsa_jax.compress_groups(**{**jax_args, "rope_cache": args["rope_cache"]}, compress_ratio=ratio)
    _, cache, slots, rows = make_store_inputs(StoreCase())
    with pytest.raises(TypeError, match="store_cache_rows: rows must be a torch.Tensor"):
        qsa_torch.store_cache_rows(cache, slots, host(rows))
    with pytest.raises(TypeError, match="store_cache_rows: cache must be a JAX array"):
        qsa_jax.store_cache_rows(cache, to_jax(slots), to_jax(rows))
