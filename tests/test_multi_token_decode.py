"""Multi-token decode rows (speculative decoding, MTP): 2-5 new rows per request in one step.

Such rows are a short prefill chunk per request: each row attends its own
causal tail (the tokens of its open group up to itself, this step's rows
before it included) and selects among the groups completed up to its
position, those this step completes included.  So a step of ``n`` rows per
request must select the same tokens, bit for bit, as feeding those rows one
step at a time; its outputs agree with the one-row steps' within the
rounding that the attention's split-K choice (which follows the row count)
allows; and the caches end identical (compared logically, through each
request's tables: the pager may hand the two runs' pages out in another
order).  Both runs are also checked against the float64 reference of the
whole step (tests/reference.py) on the tokens they selected.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import qsa_jax
import qsa_torch
from qsa_kernels.paging import CacheGeometry, PagedRequests

from . import reference as R
from .test_step import STATE_FIELDS, Model, clone_state, random_state, rope_table
from .util import DEVICE, assert_bitwise_equal, assert_close, f64, host, to_jax

pytestmark = pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")

GEOMETRY = CacheGeometry(page_size=8, num_pages=40, compress_ratio=4, compressed_page_size=4,
                         num_compressed_pages=24, max_context=48, max_requests=4)
#: The stated tolerance of a multi-row step's ``out`` against the one-row steps' (bf16 q, k, v):
#: every element within 2 bf16 ulps (2 * 2**-8 relative) of the larger of the two, plus 2**-12
#: absolute for elements near zero.  The split-K count follows the row count (docs/api.md,
#: stage 4), so the float32 partial sums are added in another order and may round to a
#: neighbouring bf16 value; the selected tokens, and so the attended set, are the same bits.
RELATIVE, ABSOLUTE = 2 * 2.0 ** -8, 2.0 ** -12


class Rows:
    """Random (never zero) per-token inputs, keyed by (request, position): the same rows whichever
    way they are batched."""

    def __init__(self, model: Model, seed: int):
        self.model, self.g, self.rows = model, torch.Generator().manual_seed(seed), {}

    def _row(self, request, position) -> dict:
        key = (request, position)
        if key not in self.rows:
            m = self.model
            rnd = lambda *shape, dtype: torch.randn(*shape, generator=self.g).to(dtype)  # noqa: E731
            self.rows[key] = dict(q=rnd(m.QH, m.D, dtype=m.dtype), k=rnd(m.KH, m.D, dtype=m.dtype),
                                  v=rnd(m.KH, m.D, dtype=m.dtype), index_q=rnd(m.IH, m.DI, dtype=m.index_dtype),
                                  index_k=rnd(1, m.DI, dtype=m.index_dtype))
        return self.rows[key]

    def batch(self, host_meta, requests: list) -> dict:
        """The inputs of a step, in its metadata's row order."""
        rows = [self._row(requests[b], int(p)) for b, p in zip(host_meta.token_to_req, host_meta.positions)]
        return {name: torch.stack([row[name] for row in rows]).to(DEVICE) for name in rows[0]}


class Layer:
    """One layer's state, pager and step history; :meth:`step` runs one step and records each row's
    results and each request's tables by (request, position)."""

    def __init__(self, model: Model, state, rows: Rows, cos_sin, index_cos_sin):
        self.model, self.state, self.rows = model, clone_state(state), rows
        self.pager = PagedRequests(GEOMETRY, seed=9)
        self.cos_sin, self.index_cos_sin = cos_sin, index_cos_sin
        self.out, self.tokens, self.tables = {}, {}, {}
        self.launches: list[int] = []

    def step(self, schedule: dict) -> None:
        from qsa_kernels.launch import observe_launches

        host_meta = self.pager.step(schedule)
        requests = list(schedule)
        inputs = self.rows.batch(host_meta, requests)
        with observe_launches() as events:
            out, self.state, indices = qsa_torch.qsa_attention_step(
                **inputs, state=self.state, metadata=qsa_torch.StepMetadata.from_host(host_meta, DEVICE),
                cos_sin=self.cos_sin, index_cos_sin=self.index_cos_sin, return_token_indices=True,
                **self.model.options())
        self.launches.append(len(events))
        for row, (b, position) in enumerate(zip(host_meta.token_to_req, host_meta.positions)):
            key = (requests[b], int(position))
            self.out[key], self.tokens[key] = out[row], indices[row]
        for b, request in enumerate(requests):
            self.tables[request] = (host_meta.block_table[b].copy(), host_meta.compressed_block_table[b].copy(),
                                    int(host_meta.compressor_state_block_table[b, 0]))
        return host_meta, inputs, out, indices

    def logical_caches(self, request) -> dict:
        """The request's K, V, compressed keys and open group's ring rows, in position order."""
        table, compressed_table, ring_block = self.tables[request]
        length = self.pager.lengths[request]
        g, s = GEOMETRY, self.state
        ratio, ring = g.compress_ratio, g.ring_size
        kv = [(table[p // g.page_size], p % g.page_size) for p in range(length)]
        groups = [(compressed_table[c // g.compressed_page_size], c % g.compressed_page_size)
                  for c in range(length // ratio)]
        open_group = range(length // ratio * ratio, length)
        return dict(
            key_cache=torch.stack([s.key_cache[page, offset] for page, offset in kv]),
            value_cache=torch.stack([s.value_cache[page, offset] for page, offset in kv]),
            compressed_key_cache=torch.stack([s.compressed_key_cache[page, offset] for page, offset in groups]),
            compressor_state_cache=torch.stack([s.compressor_state_cache[ring_block, p % ring] for p in open_group])
            if len(open_group) else torch.zeros(0))


PREFILL = {"a": 13, "b": 6, "c": 3}


def _two_runs(decode: dict, seed: int):
    """The same prefill, then ``decode`` rows per request as one step (``multi``) and one row a step
    (``single``, requests that still have rows)."""
    model = Model()
    g = torch.Generator().manual_seed(seed)
    state = random_state(model, g, GEOMETRY)
    rows = Rows(model, seed)
    cos_sin, index_cos_sin = rope_table(model.D), rope_table(model.DI)
    multi, single = Layer(model, state, rows, cos_sin, index_cos_sin), Layer(model, state, rows, cos_sin, index_cos_sin)
    for layer in (multi, single):
        layer.step(PREFILL)
    multi_step = multi.step(decode)
    for i in range(max(decode.values())):
        single.step({request: 1 for request, n in decode.items() if n > i})
    return model, multi, single, multi_step


@pytest.mark.parametrize("decode", [{"a": 2, "b": 2, "c": 2}, {"a": 5, "b": 3, "c": 4}, {"c": 5, "a": 4}],
                         ids=["2_rows_each", "5_3_4_rows", "5_4_rows_reordered"])
def test_multi_token_decode_equals_one_row_steps(decode):
    model, multi, single, (host_meta, inputs, out, indices) = _two_runs(decode, seed=sum(decode.values()))
    keys = [key for key in multi.tokens if key[1] >= PREFILL[key[0]]]
    assert len(keys) == sum(decode.values())
    for key in keys:
        assert_bitwise_equal(multi.tokens[key], single.tokens[key], f"token_indices of {key}")
        a, b = f64(multi.out[key]), f64(single.out[key])
        assert np.isfinite(a).all() and np.isfinite(b).all()
        bound = RELATIVE * np.maximum(np.abs(a), np.abs(b)) + ABSOLUTE
        assert (np.abs(a - b) <= bound).all(), f"out of {key}: max difference {np.abs(a - b).max():.3e}"
    for request in decode:
        assert multi.pager.lengths[request] == single.pager.lengths[request] == PREFILL[request] + decode[request]
        mine, theirs = multi.logical_caches(request), single.logical_caches(request)
        for name in STATE_FIELDS:
            assert_bitwise_equal(mine[name], theirs[name], f"{request}'s {name}")
    # Not vacuous: the rows selected whole groups, and some rows completed one this step.
    assert sum(int((host(multi.tokens[key]) >= 0).sum()) for key in keys) > 4 * len(keys)
    assert (host_meta.compressed_slots >= 0).sum() >= 1
    # Against the float64 reference of the whole step, on the tokens it selected.
    histories = {}
    for request in decode:
        length = multi.pager.lengths[request]
        rows = [multi.rows._row(request, p) for p in range(length)]
        histories[request] = {name: np.stack([f64(row[name]) for row in rows]) for name in ("k", "v", "index_k")}
    requests = list(decode)
    ref_out, _ = R.qsa_attention_step(
        f64(inputs["q"]), f64(inputs["index_q"]), [requests[b] for b in host_meta.token_to_req], host_meta.positions,
        {r: h["k"] for r, h in histories.items()}, {r: h["v"] for r, h in histories.items()},
        {r: h["index_k"][:, 0] for r, h in histories.items()}, f64(multi.cos_sin), f64(multi.index_cos_sin),
        token_indices=host(indices), **model.options())
    assert_close(out, ref_out, 1e-2, "multi-row out vs float64 reference")


def test_multi_token_decode_torch_and_jax_bitwise():
    """The multi-row step in JAX (jit) gives torch's bits."""
    model, multi, _, (host_meta, inputs, out, indices) = _two_runs({"a": 3, "b": 4, "c": 2}, seed=5)
    # Replay the multi-row step in JAX from the state before it (a fresh run of the prefill).
    g = torch.Generator().manual_seed(5)
    state = random_state(model, g, GEOMETRY)
    replay = Layer(model, state, multi.rows, multi.cos_sin, multi.index_cos_sin)
    replay.step(PREFILL)
    jax_state = qsa_jax.QSAState(**{n: to_jax(getattr(replay.state, n)) for n in STATE_FIELDS})
    jax_meta = qsa_jax.StepMetadata.from_host(replay.pager.step({"a": 3, "b": 4, "c": 2}))
    jax_out, jax_state, jax_indices = qsa_jax.qsa_attention_step(
        **{n: to_jax(a) for n, a in inputs.items()}, state=jax_state, metadata=jax_meta, cos_sin=to_jax(multi.cos_sin),
        index_cos_sin=to_jax(multi.index_cos_sin), return_token_indices=True, **model.options())
    assert_bitwise_equal(jax_out, out, "out")
    assert_bitwise_equal(jax_indices, indices, "token_indices")
    for name in STATE_FIELDS:
        assert_bitwise_equal(getattr(jax_state, name), getattr(multi.state, name), name)
