"""The composed step (qsa_attention_step) and its paging metadata.

* paging: every index array of a scripted run (joins, finishes, page reuse)
  checked against a brute-force model of the caches;
* the composed step against the same stages called one by one, bitwise;
* a multi-step run mixing prefill chunks and decode rows, requests joining
  and finishing: torch and JAX (jit, donated state) bit-identical at every
  step, the JAX step traced once per batch shape, and every step against a
  dense (unpaged) float64 reference of the whole step;
* the same argument errors from both adapters;
* a row past cos_sin writes nothing anywhere (issue 28, item 5), fused and
  separate compression launches, and a retried step completes its group.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest
import torch

import qsa_jax
import qsa_torch
from qsa_kernels.paging import CacheGeometry, PagedRequests

from . import reference as R
from .util import DEVICE, assert_bitwise_equal, assert_close, f64, host, to_jax

# On the CPU the JAX side runs from a host callback, which cannot reuse a donated buffer.
pytestmark = pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")

STATE_FIELDS = ("key_cache", "value_cache", "compressor_state_cache", "compressed_key_cache")


# --------------------------------------------------------------------------
# Paging metadata
# --------------------------------------------------------------------------

def check_metadata(geometry: CacheGeometry, meta, lengths_before: dict, schedule: dict, ring: dict) -> None:
    """Brute-force checks of one step's metadata; ``ring`` maps ring slot -> (request, position)."""
    g = geometry
    requests = list(schedule)
    assert meta.query_start_loc.tolist() == np.cumsum([0] + [schedule[r] for r in requests]).tolist()
    row = 0
    for b, request in enumerate(requests):
        start = lengths_before.get(request, 0)
        assert meta.sequence_lengths[b] == start + schedule[request]
        pages = meta.block_table[b]
        cpages = meta.compressed_block_table[b]
        for position in range(start, start + schedule[request]):
            assert meta.token_to_req[row] == b and meta.positions[row] == position
            assert meta.raw_positions[row, 0].tolist() == [position] * 3
            page = pages[position // g.page_size]
            assert 0 <= page < g.num_pages
            assert meta.slot_mapping[row] == page * g.page_size + position % g.page_size
            if (position + 1) % g.compress_ratio == 0:
                group = position // g.compress_ratio
                cpage = cpages[group // g.compressed_page_size]
                assert 0 <= cpage < g.num_compressed_pages
                assert meta.compressed_slots[row] == cpage * g.compressed_page_size + group % g.compressed_page_size
            else:
                assert meta.compressed_slots[row] == -1
            slot = meta.compressor_state_slots[row]
            if slot >= 0:
                assert slot == meta.compressor_state_block_table[b, 0] * g.ring_size + position % g.ring_size
                ring[int(slot)] = (request, position)
            row += 1
        # Every member of the open group is in the ring for the next step.
        end = int(meta.sequence_lengths[b])
        for position in range(end // g.compress_ratio * g.compress_ratio, end):
            slot = meta.compressor_state_block_table[b, 0] * g.ring_size + position % g.ring_size
            assert ring[int(slot)] == (request, position), f"ring lost {request}@{position}"
        assert (pages[-(-end // g.page_size):] == -1).all()
    assert row == meta.num_rows
    # Ring slots are distinct within a step; KV and compressed pages are never shared.
    ring_slots = meta.compressor_state_slots[meta.compressor_state_slots >= 0]
    assert len(set(ring_slots.tolist())) == len(ring_slots)
    for table in (meta.block_table, meta.compressed_block_table, meta.compressor_state_block_table):
        used = table[table >= 0]
        assert len(set(used.tolist())) == len(used)
    for name in dataclasses.asdict(meta):
        assert getattr(meta, name).dtype == np.int32, name


def test_paging_metadata_over_joins_and_finishes():
    geometry = CacheGeometry(page_size=4, num_pages=14, compress_ratio=4, compressed_page_size=2,
                             num_compressed_pages=6, max_context=24, max_requests=3, ring_size=6)
    pager = PagedRequests(geometry, seed=3)
    ring: dict = {}
    script = [{"a": 9, "b": 3}, {"a": 2, "b": 5, "c": 1}, {"a": 1, "b": 1, "c": 7},
              "finish b", {"d": 6, "a": 1, "c": 1}, "finish a", {"c": 1, "d": 4, "e": 13}, {"e": 1}]
    for item in script:
        if isinstance(item, str):
            pager.release(item.split()[1])
            continue
        before = dict(pager.lengths)
        check_metadata(geometry, pager.step(item), before, item, ring)
    # The pools came back: 3 requests in flight hold exactly the pages their lengths need.
    held = sum(-(-n // 4) for n in pager.lengths.values())
    assert len(pager._free_pages) == geometry.num_pages - held
    with pytest.raises(ValueError, match="past max_context"):
        pager.step({"e": 11})
    with pytest.raises(ValueError, match="out of compressor-state rings"):
        pager.step({"f": 1})


def test_paging_admit_and_exhaustion():
    geometry = CacheGeometry(page_size=8, num_pages=4, compress_ratio=4, compressed_page_size=4,
                             num_compressed_pages=2, max_context=64, max_requests=2)
    pager = PagedRequests(geometry)
    pager.admit("x", 17)  # 3 pages, 4 groups -> 1 compressed page
    meta = pager.step({"x": 3})
    assert meta.positions.tolist() == [17, 18, 19] and meta.sequence_lengths.tolist() == [20]
    assert meta.compressed_slots.tolist() == [-1, -1, meta.compressed_block_table[0, 1] * 4 + 0]
    with pytest.raises(ValueError, match="out of KV pages"):
        pager.step({"y": 9})
    with pytest.raises(ValueError, match="already in flight"):
        pager.admit("x", 1)


# --------------------------------------------------------------------------
# The step
# --------------------------------------------------------------------------

@dataclasses.dataclass
class Model:
    """Head geometry of one QSA attention layer and its step options."""

    QH: int = 4
    KH: int = 2
    D: int = 32
    IH: int = 2
    DI: int = 32
    ratio: int = 4
    token_topk: int = 8
    dtype: torch.dtype = torch.bfloat16
    index_dtype: torch.dtype = torch.float32
    is_neox: bool = True

    def options(self) -> dict:
        return dict(compress_ratio=self.ratio, token_topk=self.token_topk, is_neox=self.is_neox)


GEOMETRY = CacheGeometry(page_size=8, num_pages=40, compress_ratio=4, compressed_page_size=4,
                         num_compressed_pages=24, max_context=48, max_requests=4)


def rope_table(d: int, positions: int = 64) -> torch.Tensor:
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * inv_freq
    return torch.cat([angles.cos(), angles.sin()], 1).float().to(DEVICE)


def random_state(model: Model, g: torch.Generator, geometry: CacheGeometry = GEOMETRY) -> qsa_torch.QSAState:
    """Random (never zero) caches: stale contents a correct step must never read."""
    shapes = geometry.state_shapes(model.KH, model.D, model.DI)
    dtypes = dict(key_cache=model.dtype, value_cache=model.dtype,
                  compressor_state_cache=model.index_dtype, compressed_key_cache=model.index_dtype)
    return qsa_torch.QSAState(**{n: torch.randn(shapes[n], generator=g).to(dtypes[n]).to(DEVICE)
                                 for n in STATE_FIELDS})


def random_inputs(model: Model, rows: int, g: torch.Generator) -> dict:
    rnd = lambda *shape, dtype: torch.randn(*shape, generator=g).to(dtype).to(DEVICE)  # noqa: E731
    return dict(q=rnd(rows, model.QH, model.D, dtype=model.dtype), k=rnd(rows, model.KH, model.D, dtype=model.dtype),
                v=rnd(rows, model.KH, model.D, dtype=model.dtype),
                index_q=rnd(rows, model.IH, model.DI, dtype=model.index_dtype),
                index_k=rnd(rows, 1, model.DI, dtype=model.index_dtype))


def clone_state(state):
    return dataclasses.replace(state, **{n: getattr(state, n).clone() for n in STATE_FIELDS})


def stage_by_stage(model: Model, inputs: dict, state, meta, cos_sin, index_cos_sin):
    """The step written out with the public stage functions, in the documented order."""
    m, neox = meta, model.is_neox
    q, _, key_cache, value_cache = qsa_torch.rope_reshape_and_cache(
        inputs["q"], inputs["k"], inputs["v"], state.key_cache, state.value_cache, m.slot_mapping, m.positions,
        cos_sin, is_neox=neox)
    pooled, first = qsa_torch.compress_groups(
        inputs["index_k"], m.raw_positions, state.compressor_state_cache, m.compressor_state_block_table,
        m.token_to_req, m.query_start_loc, m.positions, m.compressed_slots, model.ratio)
    qsa_torch.store_cache_rows(state.compressor_state_cache, m.compressor_state_slots, inputs["index_k"])

    def rotate(x, positions):
        scratch = torch.zeros(2, 1, 1, x.shape[-1], dtype=x.dtype, device=x.device)
        no_slots = torch.full_like(positions, -1)
        return qsa_torch.rope_reshape_and_cache(x, x[:, :1], x[:, :1], scratch[:1], scratch[1:], no_slots,
                                                positions, index_cos_sin, is_neox=neox)[0]

    qsa_torch.store_cache_rows(state.compressed_key_cache, m.compressed_slots, rotate(pooled, first[:, 0].contiguous()))
    indices = qsa_torch.select_paged_tokens(rotate(inputs["index_q"], m.positions), state.compressed_key_cache,
                                            m.compressed_block_table, m.token_to_req, m.positions,
                                            m.sequence_lengths, model.token_topk, model.ratio)
    out = qsa_torch.sparse_paged_attention(q, key_cache, value_cache, indices, m.block_table, m.token_to_req)
    return out, indices


@pytest.mark.parametrize("model", [
    Model(),
    Model(QH=8, KH=2, D=16, IH=4, DI=16, ratio=8, token_topk=16, index_dtype=torch.bfloat16, is_neox=False),
    # Head dims other than powers of two (issue 50): the attention's tile and RoPE's pairs padded.
    Model(D=80, DI=24, is_neox=False),
], ids=["bf16_fp32index_r4", "gqa4_bf16index_r8_gptj", "d80_di24_gptj"])
def test_step_equals_stage_by_stage(model):
    g = torch.Generator().manual_seed(11)
    geometry = dataclasses.replace(GEOMETRY, compress_ratio=model.ratio, ring_size=None)
    pager = PagedRequests(geometry, seed=5)
    cos_sin, index_cos_sin = rope_table(model.D), rope_table(model.DI)
    state = random_state(model, g, geometry)
    # A first step fills rings and compressed pages that the compared step reads.
    meta = qsa_torch.StepMetadata.from_host(pager.step({"a": 13, "b": 6}), DEVICE)
    _, state = qsa_torch.qsa_attention_step(**random_inputs(model, 19, g), state=state, metadata=meta,
                                            cos_sin=cos_sin, index_cos_sin=index_cos_sin, **model.options())
    manual_state = clone_state(state)
    meta = qsa_torch.StepMetadata.from_host(pager.step({"a": 7, "b": 1, "c": 3}), DEVICE)
    inputs = random_inputs(model, 11, g)
    out, new_state, indices = qsa_torch.qsa_attention_step(
        **inputs, state=state, metadata=meta, cos_sin=cos_sin, index_cos_sin=index_cos_sin,
        return_token_indices=True, **model.options())
    manual_out, manual_indices = stage_by_stage(model, inputs, manual_state, meta, cos_sin, index_cos_sin)
    assert all(getattr(new_state, n) is getattr(state, n) for n in STATE_FIELDS), "torch updates in place"
    assert_bitwise_equal(out, manual_out, "out")
    assert_bitwise_equal(indices, manual_indices, "token_indices")
    for name in STATE_FIELDS:
        assert_bitwise_equal(getattr(state, name), getattr(manual_state, name), name)
    assert (host(indices) >= 0).sum() > 3 * 11, "the step selected almost nothing"


class Run:
    """One layer stepped through torch and JAX side by side, with the histories a dense reference needs."""

    def __init__(self, model: Model, seed: int):
        self.model = model
        self.g = torch.Generator().manual_seed(seed)
        self.pager = PagedRequests(GEOMETRY, seed=seed)
        self.cos_sin, self.index_cos_sin = rope_table(model.D), rope_table(model.DI)
        self.torch_state = random_state(model, self.g)
        self.jax_state = qsa_jax.QSAState(**{n: to_jax(getattr(self.torch_state, n)) for n in STATE_FIELDS})
        self.histories: dict = {}
        self.traces = 0

        def step(inputs, state, meta, cos_sin, index_cos_sin):
            self.traces += 1  # runs only while tracing
            return qsa_jax.qsa_attention_step(**inputs, state=state, metadata=meta, cos_sin=cos_sin,
                                              index_cos_sin=index_cos_sin, return_token_indices=True,
                                              **model.options())

        self.jax_step = jax.jit(step, donate_argnums=(1,))

    def finish(self, request):
        self.pager.release(request)
        del self.histories[request]

    def step(self, schedule: dict):
        host_meta = self.pager.step(schedule)
        inputs = random_inputs(self.model, host_meta.num_rows, self.g)
        out, self.torch_state, indices = qsa_torch.qsa_attention_step(
            **inputs, state=self.torch_state, metadata=qsa_torch.StepMetadata.from_host(host_meta, DEVICE),
            cos_sin=self.cos_sin, index_cos_sin=self.index_cos_sin, return_token_indices=True,
            **self.model.options())
        jax_out, self.jax_state, jax_indices = self.jax_step(
            {n: to_jax(a) for n, a in inputs.items()}, self.jax_state, qsa_jax.StepMetadata.from_host(host_meta),
            to_jax(self.cos_sin), to_jax(self.index_cos_sin))
        assert_bitwise_equal(out, jax_out, "torch vs JAX out")
        assert_bitwise_equal(indices, jax_indices, "torch vs JAX token_indices")
        for name in STATE_FIELDS:
            assert_bitwise_equal(getattr(self.torch_state, name), getattr(self.jax_state, name), f"torch vs JAX {name}")
        self.check_reference(schedule, host_meta, inputs, out, indices)

    def check_reference(self, schedule, host_meta, inputs, out, indices):
        requests = list(schedule)
        for b, request in enumerate(requests):
            rows = slice(host_meta.query_start_loc[b], host_meta.query_start_loc[b + 1])
            new = dict(k=f64(inputs["k"][rows]), v=f64(inputs["v"][rows]), index_k=f64(inputs["index_k"][rows])[:, 0])
            old = self.histories.get(request)
            self.histories[request] = new if old is None else {n: np.concatenate([old[n], new[n]]) for n in new}
        row_requests = [requests[b] for b in host_meta.token_to_req]
        ref_out, ref_indices = R.qsa_attention_step(
            f64(inputs["q"]), f64(inputs["index_q"]), row_requests, host_meta.positions,
            {r: h["k"] for r, h in self.histories.items()}, {r: h["v"] for r, h in self.histories.items()},
            {r: h["index_k"] for r, h in self.histories.items()}, f64(self.cos_sin), f64(self.index_cos_sin),
            **self.model.options())
        np.testing.assert_array_equal(host(indices), ref_indices, "token_indices vs float64 reference")
        assert_close(out, ref_out, 1e-2, "out vs float64 reference")
        self.check_compressed_keys(requests, host_meta)

    def check_compressed_keys(self, requests, host_meta):
        """Every complete group's key: the mean of its raw index keys, rotated at its first position."""
        cache = f64(self.torch_state.compressed_key_cache)
        ratio, page_size = self.model.ratio, GEOMETRY.compressed_page_size
        table = f64(self.index_cos_sin)
        for b, request in enumerate(requests):
            raw = self.histories[request]["index_k"]
            for group in range(len(raw) // ratio):
                first = group * ratio
                cos, sin = R.cos_sin_row(table, first, raw.shape[-1], self.model.is_neox)
                expected = R.rope(raw[first: first + ratio].mean(0), cos, sin, self.model.is_neox)
                page = host_meta.compressed_block_table[b, group // page_size]
                assert_close(cache[page, group % page_size, 0], expected, 1e-5, f"{request} group {group}")


def test_multi_step_run_torch_jax_and_reference():
    """Chunked prefill mixed with decode, joins and finishes (a finished request's pages and
    ring are reused, stale), steps of a repeated shape reusing the JAX trace."""
    run = Run(Model(), seed=7)
    run.step({"a": 6, "b": 9})  # prefill chunks; a's group 4..7 straddles into the next step
    run.step({"a": 5, "b": 1, "c": 3})  # a continues, b decodes, c joins
    run.step({"a": 1, "b": 1, "c": 1})
    run.finish("b")
    run.step({"a": 1, "c": 1, "d": 7})  # d takes b's ring block and pages; (T, B) of the second step
    run.step({"a": 1, "c": 1, "d": 1})  # (T, B) of the third step
    run.step({"a": 1, "c": 1, "d": 1})
    assert run.traces == 3, f"the JAX step was traced {run.traces} times for 3 batch shapes"
    assert run.pager.lengths == {"a": 15, "c": 7, "d": 9}


def test_multi_step_run_any_even_head_dim():
    """Issue 50: attention head dim 48 (a tile of 64 lanes), index head dim 40 (20 rotation pairs in
    32 lanes): a prefill of 18 rows (the separate compression launches), then a step of 9 rows
    (stages 1 and 2 in one launch): torch and JAX bit-identical, against the float64 reference."""
    run = Run(Model(D=48, DI=40), seed=9)
    run.step({"a": 11, "b": 7})
    run.step({"a": 3, "b": 1, "c": 5})
    assert run.pager.lengths == {"a": 14, "b": 8, "c": 5}


def valid_arguments():
    """Keyword arguments of one valid step, for torch and for JAX."""
    model = Model()
    g = torch.Generator().manual_seed(0)
    host_meta = PagedRequests(GEOMETRY).step({"a": 3})
    inputs = random_inputs(model, 3, g)
    state = random_state(model, g)
    cs = rope_table(model.D)
    torch_args = dict(**inputs, state=state, metadata=qsa_torch.StepMetadata.from_host(host_meta, DEVICE),
                      cos_sin=cs, index_cos_sin=cs, **model.options())
    jax_args = dict({n: to_jax(a) for n, a in inputs.items()},
                    state=qsa_jax.QSAState(**{n: to_jax(getattr(state, n)) for n in STATE_FIELDS}),
                    metadata=qsa_jax.StepMetadata.from_host(host_meta), cos_sin=to_jax(cs), index_cos_sin=to_jax(cs),
                    **model.options())
    return torch_args, jax_args


def test_invalid_arguments_same_error_in_both_adapters():
    torch_args, jax_args = valid_arguments()
    cases = {
        "topk": (ValueError, dict(token_topk=6)),
        "ratio": (ValueError, dict(compress_ratio=0)),
        "rows": (ValueError, dict(index_q=lambda a: a[:2])),
        "index_heads": (ValueError, dict(index_k=lambda a: a[:, [0, 0]])),
    }
    for name, (error, change) in cases.items():
        messages = []
        for adapter, args in ((qsa_torch, torch_args), (qsa_jax, jax_args)):
            args = dict(args)
            for key, value in change.items():
                args[key] = value(args[key]) if callable(value) else value
            with pytest.raises(error) as info:
                adapter.qsa_attention_step(**args)
            messages.append(str(info.value))
        assert messages[0] == messages[1], name
        assert messages[0].startswith("qsa_attention_step: "), messages[0]


def test_wrong_array_types_name_the_argument():
    torch_args, jax_args = valid_arguments()
    numpy_cache = host(torch_args["state"].key_cache)
    cases = [
        (qsa_torch, dict(torch_args, q=host(torch_args["q"])), "q must be a torch.Tensor, got ndarray"),
        (qsa_torch, dict(torch_args, state=dataclasses.replace(torch_args["state"], key_cache=numpy_cache)),
         "state.key_cache must be a torch.Tensor, got ndarray"),
        (qsa_jax, dict(jax_args, metadata=dataclasses.replace(jax_args["metadata"],
                                                              positions=torch_args["metadata"].positions)),
         "metadata.positions must be a JAX array, got Tensor"),
        (qsa_jax, dict(jax_args, metadata=torch_args["metadata"]),
         "metadata must be a qsa_jax.StepMetadata, got qsa_torch.StepMetadata"),
        (qsa_torch, dict(torch_args, state=dict(key_cache=None)), "state must be a qsa_torch.QSAState, got dict"),
    ]
    for adapter, args, message in cases:
        with pytest.raises(TypeError) as info:
            adapter.qsa_attention_step(**args)
        assert str(info.value) == f"qsa_attention_step: {message}"


LOWERINGS = ["legacy", "ffi", "jax-triton"]


def _lowering(name: str):
    """``qsa_jax.use_triton_lowering(name)``, skipping where these versions cannot lower that way."""
    if not qsa_jax.triton_lowering_available(name):
        pytest.skip(f"the {name} lowering is not available with these jax-triton and jaxlib versions")
    return qsa_jax.use_triton_lowering(name)


@pytest.mark.gpu
def test_unverified_versions_fall_back_to_jax_tritons_lowering_with_the_same_bits(monkeypatch):
    """A jax-triton release outside qsa_jax's version table (faked: the installed one as a release
    candidate) makes ``auto`` take jax-triton's own lowering; an in-place launch (donated caches) and
    a launch without aliases give the bits of the package's own lowering.  With 0.4's API the
    fallback's public triton_call cannot bind an in-place launch: that is refused, clearly."""
    from qsa_jax import _lowering as _triton_call

    g = torch.Generator().manual_seed(3)
    T, QH, KH, D, P = 8, 8, 2, 64, 16
    q, k, v = (to_jax(torch.randn(T, h, D, generator=g).to(DEVICE, torch.bfloat16)) for h in (QH, KH, KH))
    caches = [to_jax(torch.randn(8, P, KH, D, generator=g).to(DEVICE, torch.bfloat16)) for _ in range(2)]
    slots, positions = to_jax(torch.tensor([17, 18, 19, -1, 40, 41, 90, 127], device=DEVICE, dtype=torch.int32)), \
        to_jax(torch.arange(T, device=DEVICE, dtype=torch.int32))
    cos_sin = to_jax(torch.randn(128, D, generator=g).to(DEVICE))
    logits = to_jax(torch.randn(4, 300, generator=g).to(DEVICE))
    visible = to_jax(torch.tensor([300, 17, 0, 256], device=DEVICE, dtype=torch.int32))

    def run():  # fresh functions: JAX reuses a function's trace, lowering included
        write = jax.jit(lambda q, k, v, kc, vc: qsa_jax.rope_reshape_and_cache(
            q, k, v, kc, vc, slots, positions, cos_sin, is_neox=True), donate_argnums=(3, 4))
        top = jax.jit(lambda logits, visible: qsa_jax.topk_blocks(logits, visible, 16))
        copies = [jax.numpy.array(c, copy=True) for c in caches]
        return jax.block_until_ready((write(q, k, v, *copies), top(logits, visible)))

    expected_write, expected_top = run()
    jax_triton, jaxlib = _triton_call._versions()
    monkeypatch.setattr(_triton_call, "_versions", lambda: (jax_triton + "rc1", jaxlib))
    assert qsa_jax.triton_lowering() == "jax-triton"
    if jax_triton.startswith("0.3"):
        fallback_write, fallback_top = run()
        for name, a, b in zip(("q_out", "k_out", "key_cache", "value_cache"), fallback_write, expected_write):
            assert_bitwise_equal(a, b, name)
    else:
        with pytest.raises(NotImplementedError, match="updates arrays in place"):
            run()
        fallback_top = jax.block_until_ready(
            jax.jit(lambda logits, visible: qsa_jax.topk_blocks(logits, visible, 16))(logits, visible))
    for a, b in zip(jax.tree.leaves(fallback_top), jax.tree.leaves(expected_top)):
        assert_bitwise_equal(a, b, "topk")


def production_decode_step(seed: int, d: int = 256, di: int = 128):
    """24 Q / 2 KV heads x d256 (``d``), indexer 4 x d128 (``di``), ratio 4, pages of 64, top 2048
    tokens: a prefill chunk (~650 complete groups per request: the top 512 blocks are a real choice),
    then a 4-request decode step's arguments: ``(model, state, host metadata, inputs, cos_sin,
    index_cos_sin, torch_step)``, ``torch_step(state)`` running the step eagerly on ``state``
    (with the token indices)."""
    model = Model(QH=24, KH=2, D=d, IH=4, DI=di, token_topk=2048, index_dtype=torch.bfloat16)
    geometry = CacheGeometry(page_size=64, num_pages=256, compress_ratio=4, compressed_page_size=64,
                             num_compressed_pages=64, max_context=4096, max_requests=8)
    g = torch.Generator().manual_seed(seed)
    pager = PagedRequests(geometry, seed=seed)
    cs, ics = rope_table(model.D, 4096), rope_table(model.DI, 4096)
    state = random_state(model, g, geometry)
    meta = qsa_torch.StepMetadata.from_host(pager.step({r: 2600 + 37 * r for r in range(4)}), DEVICE)
    _, state = qsa_torch.qsa_attention_step(**random_inputs(model, meta.positions.shape[0], g), state=state,
                                            metadata=meta, cos_sin=cs, index_cos_sin=ics, **model.options())
    host_meta = pager.step({r: 1 for r in range(4)})
    meta = qsa_torch.StepMetadata.from_host(host_meta, DEVICE)
    inputs = random_inputs(model, 4, g)

    def torch_step(state):
        return qsa_torch.qsa_attention_step(**inputs, state=state, metadata=meta, cos_sin=cs, index_cos_sin=ics,
                                            return_token_indices=True, **model.options())

    return model, state, host_meta, inputs, cs, ics, torch_step


@pytest.mark.gpu
@pytest.mark.parametrize("lowering, ptx, d, di", [
    ("legacy", "minified", 256, 128), ("legacy", "full", 256, 128), ("ffi", "minified", 256, 128),
    ("ffi", "full", 256, 128), ("jax-triton", "full", 256, 128),
    # head dims other than powers of two (issue 50): padded attention, RoPE and index tiles
    ("ffi", "minified", 192, 96), ("ffi", "minified", 80, 128)])
def test_production_geometry_graph_and_jax(lowering, ptx, d, di):
    """24 Q / 2 KV heads x d256, indexer 4 x d128, ratio 4, pages of 64, top 2048 tokens: a prefill
    chunk then a decode step; torch eager, torch CUDA-graph replay and JAX (each Triton lowering, with
    each PTX form it can carry: ``qsa_jax._lowering.ptx_form``; state donated: its buffers are
    updated in place) agree bitwise.  Also at head dims 192 / 96 and 80 / 128."""
    from qsa_jax import _lowering as _triton_call

    model, state, host_meta, inputs, cs, ics, torch_step = production_decode_step(seed=0, d=d, di=di)
    jax_state = qsa_jax.QSAState(**{n: to_jax(getattr(state, n)) for n in STATE_FIELDS})

    eager_state, graph_state = clone_state(state), clone_state(state)
    eager, _, eager_indices = torch_step(eager_state)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # every kernel was compiled by the eager call
        graphed, _, graphed_indices = torch_step(graph_state)
    graph.replay()
    torch.cuda.synchronize()
    jax_step = jax.jit(lambda i, s, m, c, ic: qsa_jax.qsa_attention_step(
        **i, state=s, metadata=m, cos_sin=c, index_cos_sin=ic, return_token_indices=True, **model.options()),
        donate_argnums=(1,))
    pointers = {n: getattr(jax_state, n).unsafe_buffer_pointer() for n in STATE_FIELDS}
    with _lowering(lowering), _triton_call.ptx_form(ptx):
        jax_out, jax_state, jax_indices = jax_step({n: to_jax(a) for n, a in inputs.items()}, jax_state,
                                                   qsa_jax.StepMetadata.from_host(host_meta), to_jax(cs), to_jax(ics))
    assert {n: getattr(jax_state, n).unsafe_buffer_pointer() for n in STATE_FIELDS} == pointers, \
        "a donated cache was copied instead of updated in place"
    for name, a, b in (("graph out", graphed, eager), ("graph indices", graphed_indices, eager_indices),
                       ("jax out", jax_out, eager), ("jax indices", jax_indices, eager_indices)):
        assert_bitwise_equal(a, b, name)
    for name in STATE_FIELDS:
        assert_bitwise_equal(getattr(graph_state, name), getattr(eager_state, name), f"graph {name}")
        assert_bitwise_equal(getattr(jax_state, name), getattr(eager_state, name), f"jax {name}")
    assert (host(eager_indices) >= 0).sum(1).min() >= 2048


def _thunks(make_step, args, lowering: str, directory) -> list[tuple[int, str]]:
    """XLA's thunk sequence of a fresh ``make_step()`` compiled with ``lowering``, as ``(nesting,
    kind)`` rows, read from the dump XLA writes when asked (``xla_dump_to``: a per-compilation
    option).  Fresh: JAX reuses a function's trace, and with it the lowering it was traced with."""
    import re

    with qsa_jax.use_triton_lowering(lowering):
        make_step().lower(*args).compile(compiler_options={"xla_dump_to": str(directory)})
    dumps = sorted(directory.glob("*thunk_sequence_after_thunk_passes.txt")) or sorted(
        directory.glob("*thunk_sequence.txt"))
    assert dumps, f"XLA wrote no thunk sequence to {directory}: {sorted(p.name for p in directory.iterdir())[:20]}"
    rows = re.findall(r"^( *)\d+: (k\w+)", dumps[-1].read_text(), re.M)
    return [(len(indent), kind) for indent, kind in rows]


@pytest.mark.gpu
def test_ffi_lowering_puts_the_step_in_command_buffers(tmp_path):
    """With the FFI lowering, XLA's compiled step (jit, donated state) runs every Triton launch
    inside a command buffer (a CUDA graph launched as one), none dispatched alone; with the
    legacy lowering every launch is a thunk of its own (the baseline the FFI lowering beats)."""
    if not qsa_jax.triton_lowering_available("ffi"):
        pytest.skip("this jaxlib has no FFI Triton handler")
    model = Model(QH=24, KH=2, D=256, IH=4, DI=128, token_topk=2048, index_dtype=torch.bfloat16)
    geometry = CacheGeometry(page_size=64, num_pages=256, compress_ratio=4, compressed_page_size=64,
                             num_compressed_pages=64, max_context=4096, max_requests=8)
    g = torch.Generator().manual_seed(1)
    pager = PagedRequests(geometry, seed=0)
    for r in range(2):
        pager.admit(r, 3000)
    host_meta = pager.step({r: 1 for r in range(2)})
    state = qsa_jax.QSAState(**{n: to_jax(getattr(random_state(model, g, geometry), n)) for n in STATE_FIELDS})
    inputs = {n: to_jax(a) for n, a in random_inputs(model, 2, g).items()}
    args = (inputs, state, qsa_jax.StepMetadata.from_host(host_meta), to_jax(rope_table(model.D, 4096)),
            to_jax(rope_table(model.DI, 4096)))
    def make_step():
        return jax.jit(lambda i, s, m, c, ic: qsa_jax.qsa_attention_step(
            **i, state=s, metadata=m, cos_sin=c, index_cos_sin=ic, **model.options()), donate_argnums=(1,))

    (tmp_path / "ffi").mkdir()
    (tmp_path / "legacy").mkdir()
    ffi = _thunks(make_step, args, "ffi", tmp_path / "ffi")
    top = [kind for nesting, kind in ffi if nesting == 0]
    nested = [kind for nesting, kind in ffi if nesting > 0]
    assert "kCommandBuffer" in top and "kCustomCall" not in top, ffi
    # The step's launches, recorded into the command buffer (4 at 2 requests: stage 1, the fused
    # stage 2, the fused selection, the attention with its split-K merged in the launch).
    assert nested.count("kCustomCall") >= 4, ffi
    legacy = _thunks(make_step, args, "legacy", tmp_path / "legacy")
    assert [kind for nesting, kind in legacy if nesting == 0].count("kCustomCall") == nested.count("kCustomCall"), legacy


# --------------------------------------------------------------------------
# All or nothing: a step that raises has changed no cache (issue 13)
# --------------------------------------------------------------------------

def _two_step_arguments():
    """A fresh copy of :func:`_two_step_base` (the first step runs once per session)."""
    base = _two_step_base()
    return dict(base, state=clone_state(base["state"]))


@functools.lru_cache(maxsize=1)
def _two_step_base():
    """Arguments of a second step whose groups straddle the first: pooling reads the ring.

    Ratio 2, ring 2: request a's position 3 pools position 2 from the ring,
    which this step's position 4 overwrites.  So a failed step that had
    already stored its raw keys would make a retry pool the wrong key.
    """
    from .test_bad_arguments import step_arguments

    geometry = CacheGeometry(page_size=4, num_pages=8, compress_ratio=2, compressed_page_size=2,
                             num_compressed_pages=6, max_context=16, max_requests=2)
    pager = PagedRequests(geometry)
    arguments = step_arguments()  # its metadata is this pager's first step
    pager.step({"a": 3, "b": 2})
    _, state = qsa_torch.qsa_attention_step(**arguments)
    host_meta = pager.step({"a": 3, "b": 1})
    g = torch.Generator().manual_seed(11)
    rand = lambda *shape, dtype=torch.bfloat16: torch.randn(*shape, generator=g).to(dtype).to(DEVICE)  # noqa: E731
    return dict(arguments, q=rand(4, 4, 16), k=rand(4, 2, 16), v=rand(4, 2, 16),
                index_q=rand(4, 2, 16, dtype=torch.float32), index_k=rand(4, 1, 16, dtype=torch.float32),
                state=state, metadata=qsa_torch.StepMetadata.from_host(host_meta, DEVICE), return_token_indices=True)


def _meta(**changes):
    return lambda a: dict(metadata=dataclasses.replace(a["metadata"], **{n: f(a["metadata"]) for n, f in changes.items()}))


def _non_contiguous(x):
    wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype, device=x.device)
    wide[..., ::2] = x
    return wide[..., ::2]


# (name, change, error type, message start, torch only)
FAILED_STEPS = [
    ("softmax_scale", lambda a: dict(softmax_scale=float("nan")), ValueError,
     "qsa_attention_step: softmax_scale must be a finite Python number or None, got nan", False),
    ("compressed_block_table_rank", _meta(compressed_block_table=lambda m: m.compressed_block_table[0]), ValueError,
     "qsa_attention_step: metadata.compressed_block_table must be", False),
    ("compressed_block_table_dtype", _meta(compressed_block_table=lambda m: m.compressed_block_table.float()),
     ValueError, "qsa_attention_step: metadata.compressed_block_table must have dtype", False),
    ("compressed_block_table_narrow", _meta(compressed_block_table=lambda m: m.compressed_block_table[:, :2]),
     ValueError, "qsa_attention_step: metadata.compressed_block_table must have at least 3 columns", False),
    ("sequence_lengths_length", _meta(sequence_lengths=lambda m: m.sequence_lengths[:1]), ValueError,
     "qsa_attention_step: metadata.sequence_lengths must", False),
    ("index_q_non_contiguous", lambda a: dict(index_q=_non_contiguous(a["index_q"])), ValueError,
     "qsa_attention_step: index_q must have a contiguous last dimension (stride 1)", True),
    ("index_cos_sin_width", lambda a: dict(index_cos_sin=a["index_cos_sin"][:, :8]), ValueError,
     "qsa_attention_step: index_cos_sin must have width 2*F", False),
    ("index_cos_sin_shorter_than_cos_sin", lambda a: dict(index_cos_sin=a["index_cos_sin"][:20]), ValueError,
     "qsa_attention_step: index_cos_sin must have at least cos_sin's 32 rows (positions)", False),
    ("compress_ratio_past_ring", lambda a: dict(compress_ratio=4, token_topk=4), ValueError,
     "qsa_attention_step: state.compressor_state_cache must have a ring of at least compress_ratio = 4", False),
    ("token_to_req_float", _meta(token_to_req=lambda m: m.token_to_req.float()), ValueError,
     "qsa_attention_step: metadata.token_to_req must have dtype int32 or int64", False),
    ("metadata_field_none", _meta(token_to_req=lambda m: None), TypeError,
     "qsa_attention_step: metadata.token_to_req must be an array (it is required), got None", False),
    ("index_k_dtype", lambda a: dict(index_k=a["index_k"].to(torch.bfloat16)), ValueError,
     "qsa_attention_step: index_k must have index_q's dtype float32, got bfloat16", False),
]


def _jax_arguments(arguments):
    from .test_bad_arguments import step_to_jax

    converted = step_to_jax(arguments)
    if arguments["metadata"].token_to_req is None:
        converted["metadata"] = dataclasses.replace(converted["metadata"], token_to_req=None)
    return converted


@pytest.mark.parametrize("name, change, error, message, torch_only", FAILED_STEPS, ids=[c[0] for c in FAILED_STEPS])
def test_failed_step_changes_no_cache_and_names_the_step_argument(name, change, error, message, torch_only):
    arguments = _two_step_arguments()
    bad = {**arguments, **change(arguments)}
    before = {n: getattr(bad["state"], n).clone() for n in STATE_FIELDS}
    with pytest.raises(error) as info:
        qsa_torch.qsa_attention_step(**bad)
    assert str(info.value).startswith(message), str(info.value)
    for n in STATE_FIELDS:
        assert_bitwise_equal(getattr(bad["state"], n), before[n], f"{n} after a failed step")
    if not torch_only:
        with jax.enable_x64(True):  # so that int64 stays int64 on the JAX side
            jax_bad = _jax_arguments(bad)
            with pytest.raises(error) as jax_info:
                qsa_jax.qsa_attention_step(**jax_bad)
        assert str(jax_info.value) == str(info.value)


@pytest.mark.parametrize("name", ["index_cos_sin_width", "compress_ratio_past_ring", "metadata_field_none"])
def test_retry_after_a_failed_step_equals_a_clean_run(name):
    """The failed call wrote nothing, so the corrected retry pools the right ring keys: bit for bit a clean run."""
    change = next(c[1] for c in FAILED_STEPS if c[0] == name)
    arguments = _two_step_arguments()
    jax_arguments = _jax_arguments(arguments)  # before torch updates the state in place
    clean_state = clone_state(arguments["state"])
    clean = qsa_torch.qsa_attention_step(**{**arguments, "state": clean_state})
    with pytest.raises((ValueError, TypeError)):
        qsa_torch.qsa_attention_step(**{**arguments, **change(arguments)})
    retry = qsa_torch.qsa_attention_step(**arguments)
    for what, a, b in (("out", retry[0], clean[0]), ("token_indices", retry[2], clean[2])):
        assert_bitwise_equal(a, b, what)
    for n in STATE_FIELDS:
        assert_bitwise_equal(getattr(retry[1], n), getattr(clean[1], n), n)
    # JAX: the same retry after the same failure, and the same bits as torch.
    with pytest.raises((ValueError, TypeError)):  # JAX arrays are immutable: only the retry matters here
        qsa_jax.qsa_attention_step(**_jax_arguments({**arguments, **change(arguments)}))
    jax_retry = qsa_jax.qsa_attention_step(**jax_arguments)
    assert_bitwise_equal(jax_retry[0], clean[0], "jax out")
    for n in STATE_FIELDS:
        assert_bitwise_equal(getattr(jax_retry[1], n), getattr(clean[1], n), f"jax {n}")


def test_compressed_table_width_check_accepts_every_geometry():
    """The width rule of the step (from the KV table's width) passes every CacheGeometry's tables,
    and rejects one column fewer than the least context those KV tables imply needs."""
    from qsa_kernels.launch import ArrayInfo
    from qsa_kernels.step import _check_compressed_table_width
    from qsa_kernels.validate import Checker

    rng = np.random.default_rng(0)
    check = Checker("qsa_attention_step")
    for _ in range(3000):
        page, ratio, cpage = (int(rng.integers(1, 70)) for _ in range(3))
        max_context = int(rng.integers(1, 3000))
        g = CacheGeometry(page_size=page, num_pages=1, compress_ratio=ratio, compressed_page_size=cpage,
                          num_compressed_pages=1, max_context=max_context, max_requests=1)
        arrays = dict(block_table=ArrayInfo.contiguous((2, g.table_width), "int32"),
                      compressed_block_table=ArrayInfo.contiguous((2, g.compressed_table_width), "int32"),
                      key_cache=ArrayInfo.contiguous((1, page, 1, 16), "bfloat16"),
                      compressed_key_cache=ArrayInfo.contiguous((1, cpage, 1, 16), "float32"))
        _check_compressed_table_width(check, arrays, ratio)
        least = CacheGeometry(page_size=page, num_pages=1, compress_ratio=ratio, compressed_page_size=cpage,
                              num_compressed_pages=1, max_context=(g.table_width - 1) * page + 1, max_requests=1)
        if least.compressed_table_width > 1:
            narrow = dict(arrays, compressed_block_table=ArrayInfo.contiguous((2, least.compressed_table_width - 1), "int32"))
            with pytest.raises(ValueError, match="metadata.compressed_block_table must have at least"):
                _check_compressed_table_width(check, narrow, ratio)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_position_past_cos_sin_gives_nan_out_rows():
    """Stage 1's error signal (a position past cos_sin: NaN q row, no K/V write) reaches
    ``out``: attention no longer turns a NaN query into zeros.  Only that row is NaN."""
    arguments = _two_step_arguments()
    positions = host(arguments["metadata"].positions)
    assert positions.tolist() == [3, 4, 5, 2]
    arguments["cos_sin"] = arguments["cos_sin"][:5]  # position 5 is past it; index_cos_sin covers it
    jax_arguments = _jax_arguments(arguments)
    key_cache = arguments["state"].key_cache.clone()
    torch_out, state, _ = qsa_torch.qsa_attention_step(**arguments)
    out = f64(torch_out)
    assert np.isnan(out[2]).all(), "the row past cos_sin must be NaN"
    assert np.isfinite(out[[0, 1, 3]]).all()
    slot = int(host(arguments["metadata"].slot_mapping)[2])
    page, offset = divmod(slot, key_cache.shape[1])
    assert_bitwise_equal(state.key_cache[page, offset], key_cache[page, offset], "no K write for the NaN row")
    jax_out, _, _ = qsa_jax.qsa_attention_step(**jax_arguments)
    assert_bitwise_equal(jax_out, torch_out, "torch vs JAX")


# --------------------------------------------------------------------------
# Stage 2 and the index queries' RoPE fused into one launch (issue 14)
# --------------------------------------------------------------------------

#: The default's launch for stages 1 and 2 of a few rows (StepTuning.fuse_rope), and with
#: fuse_rope off the launch of stage 2 alone (stage 1's rope_cache_kernel before it).
FUSED_KERNEL, COMPRESSION_KERNEL = "rope_compress_store_kernel", "compress_rotate_store_kernel"
#: The launches stage 2's fused one replaces, in the order the unfused step runs them.
UNFUSED_KERNELS = ["compress_groups_kernel", "store_cache_rows_kernel", "rope_rows_kernel",
                   "store_cache_rows_kernel", "rope_rows_kernel"]


def _step_tuning(fuse):
    """``fuse``: True, the step tuning in force; "compression", that with stage 2 fused without
    stage 1 (``fuse_rope`` off); False, no stage fused."""
    import contextlib

    from qsa_kernels import tuning

    if fuse is True:
        return contextlib.nullcontext()
    return tuning.override(step=dataclasses.replace(tuning.current().step, fuse_stages=bool(fuse), fuse_rope=False))


def _run_step(arguments: dict, fuse):
    """One torch step on a copy of the state; ``(results, final state, kernel names launched)``;
    ``fuse`` as :func:`_step_tuning`'s."""
    from qsa_kernels.launch import observe_launches

    arguments = dict(arguments, state=clone_state(arguments["state"]))
    with _step_tuning(fuse), observe_launches() as events:
        results = qsa_torch.qsa_attention_step(**arguments)
    return results, [event.kernel for event in events]


def _assert_same_step(arguments: dict, expect_fused: bool = True, valid: bool = True):
    """The step with the fused launches (stages 1 and 2 in one; stage 2 alone in one) and with
    the separate ones: the same out, token indices and caches, bit for bit.

    ``valid``: pager-built metadata, so the step stores compressed keys and
    ring rows and every out row is finite (the comparison is not vacuous).
    """
    before = {n: getattr(arguments["state"], n).clone() for n in STATE_FIELDS}
    (ref_out, ref_state, ref_indices), unfused_kernels = _run_step(arguments, fuse=False)
    assert unfused_kernels[:6] == ["rope_cache_kernel", *UNFUSED_KERNELS], unfused_kernels
    for fuse, replaced in ((True, 6), ("compression", 5)):
        (out, state, indices), fused_kernels = _run_step(arguments, fuse=fuse)
        kernel = FUSED_KERNEL if fuse is True else COMPRESSION_KERNEL
        assert (kernel in fused_kernels) == expect_fused, fused_kernels
        if expect_fused:  # the one launch stands where the six (or five) were
            assert fused_kernels == unfused_kernels[:6 - replaced] + [kernel] + unfused_kernels[6:], fused_kernels
        else:
            assert fused_kernels == unfused_kernels, fused_kernels
        assert_bitwise_equal(out, ref_out, f"out ({fuse})")
        assert_bitwise_equal(indices, ref_indices, f"token_indices ({fuse})")
        for name in STATE_FIELDS:
            assert_bitwise_equal(getattr(state, name), getattr(ref_state, name), f"{name} ({fuse})")
    # Not vacuous: the step stored compressed keys and ring rows.
    for name in ("compressor_state_cache", "compressed_key_cache"):
        assert not torch.equal(host_bits(getattr(state, name)), host_bits(before[name])), f"{name} unchanged"
    assert np.isfinite(f64(out)).all() or not valid


def host_bits(x: torch.Tensor) -> torch.Tensor:
    return x.detach().cpu().view(torch.uint8)


def _fused_step_arguments(schedule: str, is_neox: bool, cache: str, model: Model | None = None) -> dict:
    """A second step's arguments after a first that fills rings and compressed pages.

    decode: one row per request, two of three completing a group whose older
    members are in the ring (ring of 2 * ratio slots); prefill chunk: 7 rows of
    one request and 2 of another (ring of ratio slots), the chunk's first group
    straddling into the ring slots that its later rows overwrite.
    """
    model = model or Model(index_dtype=torch.bfloat16, is_neox=is_neox)
    first, second, ring = {"decode": ({"a": 15, "b": 7, "c": 2}, {"a": 1, "b": 1, "c": 1}, 2 * model.ratio),
                           "prefill": ({"a": 13, "b": 6}, {"a": 7, "b": 2}, model.ratio)}[schedule]
    geometry = dataclasses.replace(GEOMETRY, ring_size=ring)
    g = torch.Generator().manual_seed(21)
    pager = PagedRequests(geometry, seed=4)
    cos_sin, index_cos_sin = rope_table(model.D), rope_table(model.DI)
    state = random_state(model, g, geometry)
    if cache == "fp8":
        state = dataclasses.replace(state, compressed_key_cache=state.compressed_key_cache.to(torch.float8_e4m3fn),
                                    compressed_key_scale=torch.tensor(0.75, device=DEVICE))
    options = dict(cos_sin=cos_sin, index_cos_sin=index_cos_sin, return_token_indices=True, **model.options())
    meta = qsa_torch.StepMetadata.from_host(pager.step(first), DEVICE)
    rows = int(meta.positions.shape[0])
    _, state, _ = qsa_torch.qsa_attention_step(**random_inputs(model, rows, g), state=state, metadata=meta, **options)
    meta = qsa_torch.StepMetadata.from_host(pager.step(second), DEVICE)
    return dict(random_inputs(model, int(meta.positions.shape[0]), g), state=state, metadata=meta, **options)


@pytest.mark.parametrize("cache", ["bf16", "fp8"])  # fp8: the interpreter's casts are exact (interpreter_compat)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("schedule", ["decode", "prefill"])
def test_fused_compression_equals_separate_launches(schedule, is_neox, cache):
    _assert_same_step(_fused_step_arguments(schedule, is_neox, cache))


@pytest.mark.parametrize("schedule, is_neox, cache", [("decode", True, "bf16"), ("prefill", False, "fp8")])
def test_fused_compression_any_even_head_dim(schedule, is_neox, cache):
    """Issue 50: head dims 80 (the attention's tile padded to 128) and 40 (the index keys' and
    queries' 20 rotation pairs padded to 32 lanes, a ring row of 40 values in 64): the fused
    launches give the separate ones' bits."""
    model = Model(D=80, DI=40, index_dtype=torch.bfloat16, is_neox=is_neox)
    _assert_same_step(_fused_step_arguments(schedule, is_neox, cache, model))


def test_fused_compression_reads_the_ring_before_overwriting_it():
    """Ratio 2, ring 2: position 3 pools position 2 from the ring, which position 4 of the
    same launch overwrites; and a step past ``fused_max_rows`` keeps the separate launches."""
    from qsa_kernels import tuning

    arguments = _two_step_arguments()
    assert host(arguments["metadata"].positions).tolist()[:3] == [3, 4, 5]
    _assert_same_step(arguments)
    with tuning.override(step=tuning.StepTuning(fused_max_rows=3)):  # the step has 4 rows
        _assert_same_step(arguments, expect_fused=False)


def _production_decode_plan(context: int, fuse: bool = True, requests: int = 1):
    """The plan of a decode step of ``requests`` requests (a row each) at production geometry
    (docs/design.md), ``context`` tokens each; ``fuse``: StepTuning's fused compression and
    SelectTuning's fused selection (else neither; the attention's tuning is the one in force)."""
    from qsa_kernels import tuning
    from qsa_kernels.launch import ArrayInfo
    from qsa_kernels.step import plan_qsa_attention_step

    a, i32, bf16, b = ArrayInfo.contiguous, "int32", "bfloat16", requests
    g = CacheGeometry(page_size=64, num_pages=b * -(-context // 64), compress_ratio=4, compressed_page_size=64,
                      num_compressed_pages=b * -(-(context // 4) // 64), max_context=context, max_requests=b)
    shapes = g.state_shapes(2, 256, 128)
    with tuning.override(step=tuning.StepTuning(fuse_stages=fuse),
                         select=dataclasses.replace(tuning.current().select, fused=fuse)):
        return plan_qsa_attention_step(
            q=a((b, 24, 256), bf16), k=a((b, 2, 256), bf16), v=a((b, 2, 256), bf16), index_q=a((b, 4, 128), bf16),
            index_k=a((b, 1, 128), bf16), **{name: a(shape, bf16) for name, shape in shapes.items()},
            slot_mapping=a((b,), i32), positions=a((b,), i32), raw_positions=a((b, 1, 3), i32),
            token_to_req=a((b,), i32), query_start_loc=a((b + 1,), i32), sequence_lengths=a((b,), i32),
            block_table=a((b, g.table_width), i32), compressed_block_table=a((b, g.compressed_table_width), i32),
            compressed_slots=a((b,), i32), compressor_state_block_table=a((b, 1), i32),
            compressor_state_slots=a((b,), i32), cos_sin=a((context, 256), "float32"),
            index_cos_sin=a((context, 128), "float32"), compress_ratio=4, token_topk=2048)


def test_decode_step_launch_count():
    """A 1-request decode step at production geometry, 32K context (8192 compressed columns: the
    ticketed top-k, one launch).

    Unfused: RoPE + KV (1), compress_groups, the ring store, the pooled keys'
    RoPE, their store, the index queries' RoPE (5), score + top-k + expand
    (3), attention (2: partial + merge launch; 1 with
    ``AttentionTuning(fused_merge=True)``, split-K merged in its launch) = 11.
    Fused: stages 1 and 2 in one launch (1) + the fused selection (1) + attention (2) = 4.
    """
    from qsa_kernels.launch import kernel_name

    fused = [kernel_name(launch.kernel) for launch in _production_decode_plan(32768).runnable_launches]
    unfused = [kernel_name(launch.kernel) for launch in _production_decode_plan(32768, fuse=False).runnable_launches]
    attention = [name for name in unfused if name.startswith(("sparse_attention", "merge_splits"))]
    assert attention == ["sparse_attention_partial_kernel", "merge_splits_kernel"] and unfused[-2:] == attention
    selection = ["scores_kernel", "topk_ticketed_kernel", "expand_kernel"]
    assert unfused == ["rope_cache_kernel", *UNFUSED_KERNELS, *selection, *attention]
    assert fused == [FUSED_KERNEL, "select_fused_kernel", *attention]


#: Launches of a decode step at production geometry x 128K context per batch-size class
#: (requests: launches), by default (the merge launch) and with the merge in the attention's launch
#: (AttentionTuning(fused_merge=None): at most 16 programs).  1 and 8 requests: RoPE + KV and the
#: compression in one launch, the fused selection, the attention and its merge launch (3 with the
#: merge in the attention's launch).  64: RoPE + KV, the separate compression launches (5: more
#: than StepTuning.fused_max_rows rows), score + top-k (the ticketed path, streamed) + expand (3: past
#: SelectTuning.fused_max_rows), partial + merge launch (2: 128 programs, past
#: AttentionTuning.fused_merge_max_programs) = 11.  256: the same with no split to merge = 10.
DECODE_LAUNCHES = {1: 4, 8: 4, 64: 11, 256: 10}
FUSED_MERGE_LAUNCHES = {1: 3, 8: 3}


@pytest.mark.parametrize("requests", sorted(DECODE_LAUNCHES))
def test_decode_step_launches_per_batch_size(requests):
    """Issue 26: the decode step's launches per batch size (128K context, production geometry),
    pinned: at most four at 1-8 requests (stages 1 and 2 in one launch, ``StepTuning.fuse_rope``);
    three with the attention's merge in its launch (``AttentionTuning(fused_merge=True)``), which
    the default leaves off, measured slower on the H200 (docs/performance.md)."""
    from qsa_kernels import tuning
    from qsa_kernels.launch import kernel_name

    names = [kernel_name(la.kernel) for la in _production_decode_plan(131072, requests=requests).runnable_launches]
    assert len(names) == DECODE_LAUNCHES[requests] and (requests > 8 or len(names) <= 4), names
    assert "sparse_attention_fused_merge_kernel" not in names
    if requests in FUSED_MERGE_LAUNCHES:
        with tuning.override(attention=tuning.AttentionTuning(fused_merge=None)):  # by the programs' bound
            names = [kernel_name(la.kernel)
                     for la in _production_decode_plan(131072, requests=requests).runnable_launches]
        assert len(names) == FUSED_MERGE_LAUNCHES[requests] <= 4, names
        assert "sparse_attention_fused_merge_kernel" in names and "merge_splits_kernel" not in names


def test_step_with_the_merge_in_its_launch_equals_the_merge_launch():
    """A decode step (3 requests) whose attention splits: merged in its launch and by a merge
    launch (the default), the same out, token indices and caches, bit for bit."""
    from qsa_kernels import tuning

    # 32 + 3 selected tokens: 3 tiles of 16 (16-token tiles at D = 32), 2 splits.
    arguments = dict(_fused_step_arguments("decode", True, "bf16"), token_topk=32)
    results = {}
    for fused in (True, False):
        with tuning.override(attention=tuning.AttentionTuning(num_splits=2, tile_bytes=16 * 2 * 32,
                                                              fused_merge=fused)):
            results[fused], kernels = _run_step(arguments, fuse=True)
        merged_in_launch = "sparse_attention_fused_merge_kernel" in kernels
        assert merged_in_launch == fused and ("merge_splits_kernel" in kernels) == (not fused), kernels
    for what, a, b in zip(("out", "state", "token_indices"), results[True], results[False]):
        if what == "state":
            for name in STATE_FIELDS:
                assert_bitwise_equal(getattr(a, name), getattr(b, name), name)
        else:
            assert_bitwise_equal(a, b, what)
    assert np.isfinite(f64(results[True][0])).all() and np.abs(f64(results[True][0])).sum() > 0


@pytest.mark.parametrize("case", ["step_fused_compression", "step_fused_compression_d80_di40",
                                  pytest.param("step_fused_compression_fp8_gptj", marks=pytest.mark.gpu)])
def test_fused_compression_equals_separate_launches_on_metadata_to_skip(case):
    """scripts/sanitize.py's step cases: stray rows (another request's, none), positions past
    the tables, -1 and far slots, ring blocks missing or out of range.  The fused launch skips
    and computes exactly what the separate launches do (NaN rows included, bit for bit)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import sanitize

    index = next(i for i, (name, _, _) in enumerate(sanitize.CASES) if name == case)
    _, arrays, static, _ = sanitize.CASES[index][2](np.random.default_rng(index), True)
    runner = sanitize.TorchRunner.__new__(sanitize.TorchRunner)
    runner.torch, runner.device, runner.qsa = torch, DEVICE, qsa_torch
    tensors = {n: (None if a is None else runner.put(a)) for n, a in arrays.items()}
    positions = host(tensors["positions"])
    assert (positions < 0).any() or (positions >= tensors["index_cos_sin"].shape[0]).any(), "no position to skip"
    _assert_same_step(dict(sanitize.step_containers(runner, tensors), **static), valid=False)


# --------------------------------------------------------------------------
# A row past cos_sin writes nothing anywhere (issue 28, item 5)
# --------------------------------------------------------------------------


CACHE_SLOTS = (("key_cache", "slot_mapping"), ("value_cache", "slot_mapping"),
               ("compressor_state_cache", "compressor_state_slots"), ("compressed_key_cache", "compressed_slots"))


def _slot_rows(cache: torch.Tensor, meta, slots_name: str, rows: np.ndarray) -> list[torch.Tensor]:
    """The cache rows (``[..., D]`` of one slot) that ``rows`` of the metadata address."""
    flat = cache.view(-1, *cache.shape[2:])
    return [flat[slot] for slot in host(getattr(meta, slots_name))[rows].tolist() if 0 <= slot < flat.shape[0]]


def _poison_slots(state, meta, rows: np.ndarray) -> None:
    """-3.25 in every cache slot that ``rows`` address (K/V, ring, compressed keys)."""
    for cache, slots in CACHE_SLOTS:
        for row in _slot_rows(getattr(state, cache), meta, slots, rows):
            row.fill_(-3.25)


def _assert_rows_write_nothing(arguments, meta, past, fuse):
    """Run the step: the ``past`` rows' out is NaN, the others' finite, and out and every cache equal the
    same step without those rows bitwise; their slots keep their poison; torch and JAX agree.  Returns
    ``(out, new state)``."""
    (out, new_state, _), kernels = _run_step(arguments, fuse)
    assert (FUSED_KERNEL in kernels) == fuse
    (ref_out, ref_state, _), _ = _run_step(dict(arguments, metadata=_without_rows(meta, past)), fuse)
    with _step_tuning(fuse):
        jax_out, jax_state, _ = qsa_jax.qsa_attention_step(**_jax_arguments(arguments))
    assert np.isnan(f64(out)[past]).all() and np.isfinite(f64(out)[~past]).all()
    assert_bitwise_equal(out, ref_out, "out")
    assert_bitwise_equal(jax_out, out, "torch vs JAX out")
    for name in STATE_FIELDS:
        assert_bitwise_equal(getattr(new_state, name), getattr(ref_state, name), f"{name} vs the step without the row")
        assert_bitwise_equal(getattr(jax_state, name), getattr(new_state, name), f"torch vs JAX {name}")
    _assert_slots_poisoned(new_state, meta, past, "torch")
    return out, new_state


def _assert_slots_poisoned(state, meta, rows: np.ndarray, what: str) -> None:
    for cache, slots in CACHE_SLOTS:
        for row in _slot_rows(getattr(state, cache), meta, slots, rows):
            assert (f64(row) == -3.25).all(), f"{what}: {cache} written at a slot of a row past cos_sin"


def _without_rows(meta, rows: np.ndarray):
    """``meta`` with ``rows``' K/V, ring and compressed-key slots -1 (a step that writes nothing for them)."""
    mask = torch.from_numpy(rows).to(meta.slot_mapping.device)
    return dataclasses.replace(meta, **{name: torch.where(mask, -1, getattr(meta, name)) for name in
                                        ("slot_mapping", "compressor_state_slots", "compressed_slots")})


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("table_rows, index_rows", [(5, None), (4, 4)], ids=["index_table_covers", "index_table_too"])
def test_rows_past_cos_sin_write_no_ring_slot_and_no_compressed_key(fuse, table_rows, index_rows):
    """Bug (issue 28, item 5): a row past cos_sin wrote no K/V, but its raw index key went into
    the ring and the group it completes into the compressed-key cache (a NaN key when the
    group's first position is past index_cos_sin too: ranked last by every later selection).
    Now it writes nothing anywhere: every cache equals, bitwise, the same step with that row's
    slots -1, its slots keep their poison, and the other rows' out is unchanged; torch and JAX
    agree.  Fused and separate compression launches."""
    arguments = _two_step_arguments()
    meta, state = arguments["metadata"], arguments["state"]
    past = host(meta.positions) >= table_rows
    assert (host(meta.compressed_slots)[past] >= 0).any() and (host(meta.compressor_state_slots)[past] >= 0).any()
    assert not past.all()
    arguments["cos_sin"] = arguments["cos_sin"][:table_rows]
    if index_rows is not None:
        arguments["index_cos_sin"] = arguments["index_cos_sin"][:index_rows]
    _poison_slots(state, meta, past)
    before = {n: getattr(state, n).clone() for n in STATE_FIELDS}
    out, new_state = _assert_rows_write_nothing(arguments, meta, past, fuse)
    for name in ("compressor_state_cache", "compressed_key_cache"):  # not vacuous: the valid rows wrote
        assert not torch.equal(host_bits(getattr(new_state, name)), host_bits(before[name])), name


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_step_with_every_row_past_cos_sin_changes_no_cache(fuse):
    """Every row past cos_sin (and index_cos_sin): out is NaN and the four caches are bitwise
    what they were, in torch and JAX."""
    arguments = _two_step_arguments()
    arguments.update(cos_sin=arguments["cos_sin"][:2], index_cos_sin=arguments["index_cos_sin"][:2])
    assert (host(arguments["metadata"].positions) >= 2).all()
    before = {n: getattr(arguments["state"], n).clone() for n in STATE_FIELDS}
    (out, state, _), _ = _run_step(arguments, fuse)
    with _step_tuning(fuse):
        jax_out, jax_state, _ = qsa_jax.qsa_attention_step(**_jax_arguments(arguments))
    assert np.isnan(f64(out)).all()
    assert_bitwise_equal(jax_out, out, "torch vs JAX out")
    for name in STATE_FIELDS:
        assert_bitwise_equal(getattr(state, name), before[name], f"{name} (torch)")
        assert_bitwise_equal(getattr(jax_state, name), before[name], f"{name} (JAX)")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("index_table", ["covers", "cut"])
def test_decode_step_past_cos_sin_then_retried_equals_a_clean_run(fuse, index_table):
    """A decode step whose row at position 15 (completing group 12..15) is past a 12-row
    cos_sin writes nothing for it; rerun with tables that cover it, the step completes that
    group: every cache equals a clean run's bitwise, and the next step's out and selection are
    the clean run's (docs/api.md: a later valid step completes the group).  ``cut``:
    index_cos_sin is 12 rows too (the group's first position, 12, is past it: before the fix a
    NaN key was stored)."""
    model = Model(index_dtype=torch.bfloat16)
    geometry = dataclasses.replace(GEOMETRY, ring_size=2 * model.ratio)
    g = torch.Generator().manual_seed(23)
    pager = PagedRequests(geometry, seed=5)
    cos_sin, index_cos_sin = rope_table(model.D), rope_table(model.DI)
    state = random_state(model, g, geometry)
    options = dict(return_token_indices=True, **model.options())
    full = dict(cos_sin=cos_sin, index_cos_sin=index_cos_sin)
    short = dict(cos_sin=cos_sin[:12], index_cos_sin=index_cos_sin[:12] if index_table == "cut" else index_cos_sin)

    def step(state, schedule_meta, inputs, tables):
        with _step_tuning(fuse):
            return qsa_torch.qsa_attention_step(**inputs, state=state, metadata=schedule_meta, **tables, **options)

    meta = qsa_torch.StepMetadata.from_host(pager.step({"a": 15, "b": 7, "c": 2}), DEVICE)
    _, state, _ = step(state, meta, random_inputs(model, 24, g), full)
    host_meta = pager.step({"a": 1, "b": 1, "c": 1})
    meta = qsa_torch.StepMetadata.from_host(host_meta, DEVICE)
    assert host(meta.positions).tolist() == [15, 7, 2] and host(meta.compressed_slots)[0] >= 0
    inputs = random_inputs(model, 3, g)
    after_meta = qsa_torch.StepMetadata.from_host(pager.step({"a": 1, "b": 1, "c": 1}), DEVICE)
    next_inputs = random_inputs(model, 3, g)

    clean_out, clean, clean_indices = step(clone_state(state), meta, inputs, full)
    clean_next = step(clone_state(clean), after_meta, next_inputs, full)

    bad = clone_state(state)
    _poison_slots(bad, meta, np.array([True, False, False]))
    poisoned = clone_state(bad)
    jax_arguments = _jax_arguments(dict(inputs, state=bad, metadata=meta, **short, **options))
    with _step_tuning(fuse):
        jax_out, jax_bad, _ = qsa_jax.qsa_attention_step(**jax_arguments)
    out, bad, _ = step(bad, meta, inputs, short)
    assert np.isnan(f64(out)[0]).all() and np.isfinite(f64(out)[1:]).all()
    assert_bitwise_equal(jax_out, out, "torch vs JAX out")
    _assert_slots_poisoned(bad, meta, np.array([True, False, False]), "the step past cos_sin")
    for name in STATE_FIELDS:
        assert_bitwise_equal(getattr(jax_bad, name), getattr(bad, name), f"torch vs JAX {name}")
        assert_bitwise_equal(getattr(bad, name), getattr(_without_rows_step(step, poisoned, meta, inputs, full), name),
                             f"{name}: the bad step vs the step without row 0")

    retry_out, retried, retry_indices = step(bad, meta, inputs, full)
    assert_bitwise_equal(retry_out, clean_out, "retried out")
    assert_bitwise_equal(retry_indices, clean_indices, "retried token_indices")
    for name in STATE_FIELDS:
        assert_bitwise_equal(getattr(retried, name), getattr(clean, name), f"{name} after the retry")
    next_out, _, next_indices = step(retried, after_meta, next_inputs, full)
    assert_bitwise_equal(next_out, clean_next[0], "the next step's out")
    assert_bitwise_equal(next_indices, clean_next[2], "the next step's selection")


def _without_rows_step(step, state, meta, inputs, tables):
    """The caches after ``step`` with row 0's slots -1 (on a copy of ``state``)."""
    return step(clone_state(state), _without_rows(meta, np.array([True, False, False])), inputs, tables)[1]


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_decode_row_past_cos_sin_writes_nothing_production_heads(fuse, cache):
    """Production heads (24 Q / 2 KV x d256; indexer 4 x d128, ratio 4, pages of 64), bf16 or
    fp8 caches: a decode row past cos_sin completing a group writes nothing (every cache bitwise
    the step without its slots, its slots' poison kept), the other row as usual; torch and JAX
    agree."""
    from .test_fp8 import fp8_state

    model = Model(QH=24, KH=2, D=256, IH=4, DI=128, ratio=4, token_topk=64, index_dtype=torch.bfloat16)
    geometry = CacheGeometry(page_size=64, num_pages=8, compress_ratio=4, compressed_page_size=64,
                             num_compressed_pages=4, max_context=256, max_requests=2)
    g = torch.Generator().manual_seed(37)
    pager = PagedRequests(geometry, seed=6)
    state = random_state(model, g, geometry)
    if cache == "fp8":
        state = fp8_state(state)
    options = dict(return_token_indices=True, **model.options())
    tables = dict(cos_sin=rope_table(model.D, 256), index_cos_sin=rope_table(model.DI, 256))
    meta = qsa_torch.StepMetadata.from_host(pager.step({"a": 63, "b": 30}), DEVICE)
    _, state, _ = qsa_torch.qsa_attention_step(**random_inputs(model, 93, g), state=state, metadata=meta,
                                               **tables, **options)
    meta = qsa_torch.StepMetadata.from_host(pager.step({"a": 1, "b": 1}), DEVICE)
    past = np.array([True, False])
    assert host(meta.positions).tolist() == [63, 30] and host(meta.compressed_slots)[0] >= 0
    _poison_slots(state, meta, past)
    arguments = dict(random_inputs(model, 2, g), state=state, metadata=meta, **options,
                     cos_sin=tables["cos_sin"][:40], index_cos_sin=tables["index_cos_sin"])
    _assert_rows_write_nothing(arguments, meta, past, fuse)


# --------------------------------------------------------------------------
# cos_sin=None: q and k arrive rotated (issue 56)
# --------------------------------------------------------------------------

def _identity_table(rows: int, d: int, dtype=torch.float32) -> torch.Tensor:
    return torch.from_numpy(R.identity_cos_sin(rows, d)).to(dtype).to(DEVICE)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("index_rows", [64, 16], ids=["positions_covered", "positions_past_index_cos_sin"])
def test_step_without_cos_sin_is_an_identity_table(index_rows):
    """``cos_sin=None``: bit for bit an identity table (cos 1, sin 0) of ``index_cos_sin``'s rows,
    torch and JAX, over a prefill step (separate stage-2 launches) and a decode/chunk step (the
    fused launch); the covered run also against the float64 reference (no RoPE on q and k).
    Rows past ``index_cos_sin`` give NaN out rows and write nothing, as with such a table."""
    model = Model()
    g = torch.Generator().manual_seed(17)
    pager = PagedRequests(GEOMETRY, seed=2)
    index_cos_sin = rope_table(model.DI, positions=index_rows)
    identity = _identity_table(index_rows, model.D, torch.bfloat16)
    state = random_state(model, g)
    identity_state = clone_state(state)
    jax_state = qsa_jax.QSAState(**{n: to_jax(getattr(state, n)) for n in STATE_FIELDS})
    jax_step = jax.jit(lambda inputs, state, meta, index_cos_sin: qsa_jax.qsa_attention_step(
        **inputs, state=state, metadata=meta, cos_sin=None, index_cos_sin=index_cos_sin,
        return_token_indices=True, **model.options()), donate_argnums=(1,))
    histories: dict = {}
    for schedule in ({"a": 13, "b": 6}, {"a": 5, "b": 1, "c": 3}):
        host_meta = pager.step(schedule)
        meta = qsa_torch.StepMetadata.from_host(host_meta, DEVICE)
        inputs = random_inputs(model, host_meta.num_rows, g)
        options = dict(index_cos_sin=index_cos_sin, return_token_indices=True, **model.options())
        out, state, indices = qsa_torch.qsa_attention_step(**inputs, state=state, metadata=meta, cos_sin=None,
                                                           **options)
        ref_out, identity_state, ref_indices = qsa_torch.qsa_attention_step(
            **inputs, state=identity_state, metadata=meta, cos_sin=identity, **options)
        jax_out, jax_state, jax_indices = jax_step({n: to_jax(a) for n, a in inputs.items()}, jax_state,
                                                   qsa_jax.StepMetadata.from_host(host_meta), to_jax(index_cos_sin))
        for what, a, b, c in (("out", out, ref_out, jax_out), ("token_indices", indices, ref_indices, jax_indices),
                              *((n, getattr(state, n), getattr(identity_state, n), getattr(jax_state, n))
                                for n in STATE_FIELDS)):
            assert_bitwise_equal(a, b, f"cos_sin=None vs an identity table: {what}")
            assert_bitwise_equal(c, a, f"JAX vs torch: {what}")
        past = host_meta.positions >= index_rows
        assert np.isnan(f64(out)[past]).all() and np.isfinite(f64(out)[~past]).all()
        requests = list(schedule)
        for b, request in enumerate(requests):
            rows = slice(host_meta.query_start_loc[b], host_meta.query_start_loc[b + 1])
            new = dict(k=f64(inputs["k"][rows]), v=f64(inputs["v"][rows]), index_k=f64(inputs["index_k"][rows])[:, 0])
            old = histories.get(request)
            histories[request] = new if old is None else {n: np.concatenate([old[n], new[n]]) for n in new}
        if past.any():
            continue
        ref, ref_tokens = R.qsa_attention_step(
            f64(inputs["q"]), f64(inputs["index_q"]), [requests[b] for b in host_meta.token_to_req],
            host_meta.positions, {r: h["k"] for r, h in histories.items()}, {r: h["v"] for r, h in histories.items()},
            {r: h["index_k"] for r, h in histories.items()}, R.identity_cos_sin(index_rows, model.D),
            f64(index_cos_sin), **model.options())
        np.testing.assert_array_equal(host(indices), ref_tokens, "token_indices vs float64 reference")
        assert_close(out, ref, 1e-2, "out vs float64 reference")
    assert index_rows < 64 or not np.isnan(f64(out)).any()


# --------------------------------------------------------------------------
# sinks and return_lse through the step (issue 50): the plan's keyword-only options
# --------------------------------------------------------------------------

def _call_plan(adapter: str, arguments: dict):
    """The step with the plan's own options, through the adapter's generic call (the path its public
    ``qsa_attention_step`` takes) and ``public_results``."""
    from qsa_kernels import step as S

    if adapter == "torch":
        from qsa_torch import _binding
        state_type, metadata_type = qsa_torch.QSAState, qsa_torch.StepMetadata
    else:
        from qsa_jax import _binding
        state_type, metadata_type = qsa_jax.QSAState, qsa_jax.StepMetadata
    flat = S.state_arguments(arguments, state_type, metadata_type)
    return S.public_results(_binding.call(S.plan_qsa_attention_step, flat), arguments["state"])


def test_step_sinks_and_lse_equal_the_attention_stage_and_the_reference():
    model = Model()
    g = torch.Generator().manual_seed(23)
    pager = PagedRequests(GEOMETRY, seed=6)
    cos_sin, index_cos_sin = rope_table(model.D), rope_table(model.DI)
    state = random_state(model, g)
    meta = qsa_torch.StepMetadata.from_host(pager.step({"a": 13, "b": 6}), DEVICE)
    _, state = qsa_torch.qsa_attention_step(**random_inputs(model, 19, g), state=state, metadata=meta,
                                            cos_sin=cos_sin, index_cos_sin=index_cos_sin, **model.options())
    host_meta = pager.step({"a": 2, "b": 1, "c": 3})
    meta = qsa_torch.StepMetadata.from_host(host_meta, DEVICE)
    inputs = random_inputs(model, host_meta.num_rows, g)
    sinks = (torch.randn(model.QH, generator=g) * 2).to(DEVICE)
    manual_state, plain_state = clone_state(state), clone_state(state)
    jax_arguments = dict({n: to_jax(a) for n, a in inputs.items()},
                         state=qsa_jax.QSAState(**{n: to_jax(getattr(state, n)) for n in STATE_FIELDS}),
                         metadata=qsa_jax.StepMetadata.from_host(host_meta), cos_sin=to_jax(cos_sin),
                         index_cos_sin=to_jax(index_cos_sin), sinks=to_jax(sinks), return_lse=True,
                         return_token_indices=True, **model.options())
    arguments = dict(inputs, state=state, metadata=meta, cos_sin=cos_sin, index_cos_sin=index_cos_sin,
                     **model.options())
    out, new_state, indices, lse = _call_plan("torch", dict(arguments, sinks=sinks, return_lse=True,
                                                            return_token_indices=True))
    assert new_state is state and lse.shape == (host_meta.num_rows, model.QH) and lse.dtype == torch.float32
    # Options off: the plain step's results; lse alone: (out, state, lse).
    plain_out, _, plain_indices = qsa_torch.qsa_attention_step(**dict(arguments, state=plain_state),
                                                               return_token_indices=True)
    assert_bitwise_equal(plain_indices, indices, "token_indices with and without sinks")
    assert not torch.equal(plain_out, out), "the sinks changed nothing"
    # The step's attention is the attention stage over the step's own selection, bit for bit.
    q_rot, _, key_cache, value_cache = qsa_torch.rope_reshape_and_cache(
        inputs["q"], inputs["k"], inputs["v"], manual_state.key_cache, manual_state.value_cache, meta.slot_mapping,
        meta.positions, cos_sin, is_neox=model.is_neox)
    stage_out, stage_lse = qsa_torch.sparse_paged_attention(q_rot, key_cache, value_cache, indices, meta.block_table,
                                                            meta.token_to_req, sinks=sinks, return_lse=True)
    assert_bitwise_equal(out, stage_out, "out vs sparse_paged_attention")
    assert_bitwise_equal(lse, stage_lse, "lse vs sparse_paged_attention")
    # Against the float64 reference of the attention with sinks and its LSE.
    ref_out, ref_lse = R.sparse_paged_attention_lse(
        f64(q_rot), f64(state.key_cache), f64(state.value_cache), host(indices), host(meta.block_table),
        host(meta.token_to_req), sinks=f64(sinks))
    assert_close(out, ref_out, 1e-2, "out vs float64 reference")
    np.testing.assert_allclose(f64(lse), ref_lse, rtol=1e-5, atol=1e-5)
    # JAX: the same bits.
    jax_out, jax_state, jax_indices, jax_lse = _call_plan("jax", jax_arguments)
    for what, a, b in (("out", jax_out, out), ("token_indices", jax_indices, indices), ("lse", jax_lse, lse),
                       *((n, getattr(jax_state, n), getattr(state, n)) for n in STATE_FIELDS)):
        assert_bitwise_equal(a, b, f"JAX vs torch {what}")
    only_lse = _call_plan("torch", dict(arguments, state=clone_state(plain_state), return_lse=True))
    assert len(only_lse) == 3 and only_lse[2].shape == (host_meta.num_rows, model.QH)
