"""torch.compile with dynamic row and request counts: one compiled frame, the eager bits (docs/api.md).

An engine's token count changes every step: vLLM compiles its model once
with a symbolic token count, then captures one CUDA graph per batch size.
The ops' fake implementations allocate their results with the arguments'
symbolic rows and plan with the sizes' hints, so nothing guards on a row or
request count: four steps of different row and request counts run through
one compiled frame, bitwise equal to eager, caches included.  Dynamo still
specialises sizes 0 and 1 (its own rule), so the schedules avoid them.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx.experimental._config  # noqa: F401  (Dynamo's duck sizing, switched in one test)
from torch._dynamo.testing import CompileCounterWithBackend

import qsa_torch
from qsa_kernels.paging import PagedRequests

from .test_step import GEOMETRY, STATE_FIELDS, Model, clone_state, random_inputs, random_state, rope_table
from .test_torch_ops import CASES, assert_same_results, build, cloned
from .util import DEVICE, assert_bitwise_equal

#: Steps of 8, 2, 9 and 3 rows over 2, 2, 3 and 3 requests: prefill, decode, a join mixed with
#: decode rows, decode (no count is 0 or 1, which Dynamo specialises).
SCHEDULE = ({"a": 5, "b": 3}, {"a": 1, "b": 1}, {"a": 2, "b": 1, "c": 6}, {"a": 1, "b": 1, "c": 1})
ROW_ARRAYS = ("q", "k", "v", "index_q", "index_k")
ROW_METADATA = ("slot_mapping", "positions", "raw_positions", "token_to_req", "compressed_slots",
                "compressor_state_slots")
REQUEST_METADATA = ("sequence_lengths", "block_table", "compressed_block_table", "compressor_state_block_table")


def _steps(model: Model, seed: int = 0):
    """The schedule's inputs and metadata, and an initial state (random: stale data must never be read)."""
    g = torch.Generator().manual_seed(seed)
    pager = PagedRequests(GEOMETRY)
    state = random_state(model, g)
    steps = []
    for new_tokens in SCHEDULE:
        host = pager.step(new_tokens)
        steps.append((random_inputs(model, host.num_rows, g), qsa_torch.StepMetadata.from_host(host, DEVICE)))
    return state, steps


def _mark_dynamic(inputs: dict, meta) -> None:
    for name in ROW_ARRAYS:
        torch._dynamo.mark_dynamic(inputs[name], 0)
    for name in ROW_METADATA + REQUEST_METADATA:
        torch._dynamo.mark_dynamic(getattr(meta, name), 0)
    torch._dynamo.mark_dynamic(meta.query_start_loc, 0)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("how", ["dynamic=True", "mark_dynamic"])
def test_one_compiled_frame_serves_steps_of_every_row_count(backend, how):
    model = Model()
    cos_sin = rope_table(model.D)
    state, steps = _steps(model)
    options = dict(model.options(), return_token_indices=True)

    def layer(q, k, v, index_q, index_k, state, metadata):
        out, state, token_indices = qsa_torch.qsa_attention_step(q, k, v, index_q, index_k, state, metadata,
                                                                 cos_sin, cos_sin, **options)
        return out * 1, state, token_indices  # (an op of the graph's own after the step)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True if how == "dynamic=True" else None)
    eager_state, compiled_state = clone_state(state), clone_state(state)
    # dynamic=True makes every size symbolic, and Dynamo's duck sizing then gives sizes equal in the
    # first call one symbol (here the first step's 8 rows and the pages' 8 slots): a guard of Dynamo's
    # own, not the ops', which engines avoid by marking the row and request dimensions (mark_dynamic).
    with torch.fx.experimental._config.patch(use_duck_shape=how == "mark_dynamic"):
        _run_schedule(layer, compiled, steps, eager_state, compiled_state, how)
    assert counter.frame_count == 1, f"{counter.frame_count} frames compiled for {len(steps)} row counts"


def _run_schedule(layer, compiled, steps, eager_state, compiled_state, how):
    for number, (inputs, meta) in enumerate(steps):
        if how == "mark_dynamic":
            _mark_dynamic(inputs, meta)
        expected = layer(**inputs, state=eager_state, metadata=meta)
        got = compiled(**inputs, state=compiled_state, metadata=meta)
        rows = inputs["q"].shape[0]
        assert_bitwise_equal(got[0], expected[0], f"out, step {number} ({rows} rows)")
        assert_bitwise_equal(got[2], expected[2], f"token_indices, step {number}")
        for name in STATE_FIELDS:
            assert_bitwise_equal(getattr(compiled_state, name), getattr(eager_state, name), f"{name}, step {number}")


@pytest.mark.parametrize("case_id", list(CASES))
def test_every_public_function_compiles_with_dynamic_shapes(case_id):
    """Each public function, fullgraph under dynamic=True: no graph break, the eager bits."""
    function, arguments = build(case_id)
    torch._dynamo.reset()
    compiled = torch.compile(lambda arguments: function(**arguments), backend="aot_eager", fullgraph=True,
                             dynamic=True)
    eager_arguments, compiled_arguments = cloned(arguments), cloned(arguments)
    expected = function(**eager_arguments)
    got = compiled(compiled_arguments)
    assert_same_results(got, expected, compiled_arguments, eager_arguments, f"{case_id} under dynamic=True")


def test_stage_functions_keep_one_frame_over_row_counts():
    """topk_blocks and sparse_paged_attention over three row counts: one frame each."""
    g = torch.Generator().manual_seed(1)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    def topk(logits, visible):
        return qsa_torch.topk_blocks(logits, visible, 5)

    compiled = torch.compile(topk, backend=counter, fullgraph=True, dynamic=True)
    for rows in (3, 6, 11):
        logits = torch.randn(rows, 40, generator=g).to(DEVICE)
        visible = torch.randint(1, 41, (rows,), generator=g, dtype=torch.int32).to(DEVICE)
        assert_bitwise_equal(compiled(logits, visible), topk(logits, visible), f"{rows} rows")
    assert counter.frame_count == 1


def _decode_at(requests: int, context: int = 131072):
    """Production geometry (24 Q / 2 KV heads x d256, indexer 4 x d128, ratio 4, pages of 64, top 2048
    tokens), ``requests`` requests of ``context`` tokens each (random caches: the pager's tables, no
    prefill run), then their decode step's arguments."""
    from qsa_kernels.paging import CacheGeometry

    model = Model(QH=24, KH=2, D=256, IH=4, DI=128, token_topk=2048, index_dtype=torch.bfloat16)
    pages = requests * (context // 64 + 2)
    geometry = CacheGeometry(page_size=64, num_pages=pages, compress_ratio=4, compressed_page_size=64,
                             num_compressed_pages=requests * (context // 256 + 2), max_context=context + 64,
                             max_requests=requests)
    g = torch.Generator().manual_seed(requests)
    pager = PagedRequests(geometry, seed=requests)
    pager.step({r: context for r in range(requests)})  # (host only: the caches are random)
    shapes = geometry.state_shapes(model.KH, model.D, model.DI)
    state = qsa_torch.QSAState(**{n: torch.randn(shapes[n], device=DEVICE, dtype=torch.bfloat16)
                                  for n in STATE_FIELDS})
    meta = qsa_torch.StepMetadata.from_host(pager.step({r: 1 for r in range(requests)}), DEVICE)
    inputs = {n: t.to(DEVICE) for n, t in random_inputs(model, requests, g).items()}
    cos_sin, index_cos_sin = rope_table(model.D, context + 64), rope_table(model.DI, context + 64)
    return model, state, meta, inputs, cos_sin, index_cos_sin


@pytest.mark.gpu
@pytest.mark.parametrize("requests", [1, 8, 64])
def test_engine_pattern_compile_once_then_a_cuda_graph_per_batch_size(requests):
    """As vLLM does: torch.compile with a dynamic token count, then one CUDA graph per batch size,
    replayed: bitwise the eager step (production geometry, 128K context)."""
    model, state, meta, inputs, cos_sin, index_cos_sin = _decode_at(requests)
    options = model.options()

    def layer(q, k, v, index_q, index_k, state, metadata):
        return qsa_torch.qsa_attention_step(q, k, v, index_q, index_k, state, metadata, cos_sin, index_cos_sin,
                                            **options)[0]

    eager_state = clone_state(state)
    expected = layer(**inputs, state=eager_state, metadata=meta)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up off the capture
        for _ in range(2):
            compiled(**inputs, state=clone_state(state), metadata=meta)
    torch.cuda.current_stream().wait_stream(stream)
    graph_state = clone_state(state)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = compiled(**inputs, state=graph_state, metadata=meta)
    for name in STATE_FIELDS:  # capture ran nothing: replay from the eager step's start
        getattr(graph_state, name).copy_(getattr(state, name))
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise_equal(out, expected, f"out, {requests} requests")
    for name in STATE_FIELDS:
        assert_bitwise_equal(getattr(graph_state, name), getattr(eager_state, name), name)
