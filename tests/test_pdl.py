"""Programmatic dependent launch (qsa_kernels.pdl).

Every kernel of the package begins with the wait and is marked; the marker
refuses a kernel that does not begin with it.  On the GPU, the step's
launches carry ``launch_pdl`` on sm_90, and the step with early launches
(eager and CUDA-graph replays, many times) gives the bits of ordinary
launches: a kernel that read or wrote before its wait would race with the
kernel before it.  The launcher's decision itself is tested in
``tests/test_fast_launch.py``.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

import qsa_kernels
import qsa_torch
from qsa_kernels import pdl
from qsa_kernels.paging import CacheGeometry, PagedRequests

from .util import DEVICE, assert_bitwise_equal


def _every_kernel():
    """Every launchable kernel of qsa_kernels (``*_kernel`` Triton functions), by name."""
    kernels = {}
    for module in pkgutil.walk_packages(qsa_kernels.__path__, "qsa_kernels."):
        for name, value in vars(importlib.import_module(module.name)).items():
            if name.endswith("_kernel") and hasattr(value, "fn") and callable(getattr(value, "__getitem__", None)) \
                    and value is not pdl.wait_for_previous_kernel:
                kernels[name] = value
    return kernels


def test_every_kernel_begins_with_the_wait():
    kernels = _every_kernel()
    assert len(kernels) >= 19, sorted(kernels)
    assert [name for name, kernel in kernels.items() if not pdl.waits(kernel)] == []


def _waits_first(x_ptr):
    """The docstring comes before the wait."""
    pdl.wait_for_previous_kernel()
    tl.store(x_ptr, 1)


def _loads_first(x_ptr):
    tl.store(x_ptr, 1)
    pdl.wait_for_previous_kernel()


def _waits_later(x_ptr):
    if x_ptr is not None:
        pdl.wait_for_previous_kernel()


def test_dependent_marks_only_kernels_that_wait_first():
    kernel = JITFunction(_waits_first)
    assert pdl.dependent(kernel) is kernel and pdl.waits(kernel)
    for function in (_loads_first, _waits_later):
        with pytest.raises(TypeError, match="first statement must be wait_for_previous_kernel"):
            pdl.dependent(JITFunction(function))
        assert not pdl.waits(JITFunction(function))


@pytest.mark.parametrize("capability, expected", [((8, 0), False), ((8, 9), False), ((9, 0), True), ((12, 0), True)])
def test_launches_early_on_sm90_only_while_enabled(monkeypatch, capability, expected):
    kernel = _every_kernel()["merge_splits_kernel"]
    assert pdl.launches_early(kernel, capability) is (expected and pdl.ENABLED)
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert not pdl.launches_early(kernel, capability)
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.launches_early(kernel, capability) is expected
    assert not pdl.launches_early(JITFunction(_loads_first), capability)


def _production_step():
    """A 4-request decode step at production heads (24 Q / 2 KV x d256, indexer 4 x d128, top
    2048 tokens), after a prefill that fills ~650 compressed blocks a request: ``(run, state)``."""
    from .test_step import Model, clone_state, random_inputs, random_state, rope_table

    model = Model()
    model.QH, model.KH, model.D, model.IH, model.DI, model.token_topk = 24, 2, 256, 4, 128, 2048
    model.index_dtype = torch.bfloat16
    geometry = CacheGeometry(page_size=64, num_pages=256, compress_ratio=4, compressed_page_size=64,
                             num_compressed_pages=64, max_context=4096, max_requests=8)
    g = torch.Generator().manual_seed(3)
    pager = PagedRequests(geometry, seed=3)
    cs, ics = rope_table(model.D, 4096), rope_table(model.DI, 4096)
    state = random_state(model, g, geometry)
    meta = qsa_torch.StepMetadata.from_host(pager.step({r: 2600 + 37 * r for r in range(4)}), DEVICE)
    _, state = qsa_torch.qsa_attention_step(**random_inputs(model, meta.positions.shape[0], g), state=state,
                                            metadata=meta, cos_sin=cs, index_cos_sin=ics, **model.options())
    meta = qsa_torch.StepMetadata.from_host(pager.step({r: 1 for r in range(4)}), DEVICE)
    inputs = random_inputs(model, 4, g)

    def run(state):
        return qsa_torch.qsa_attention_step(**inputs, state=state, metadata=meta, cos_sin=cs, index_cos_sin=ics,
                                            return_token_indices=True, **model.options())

    return run, state, clone_state


@pytest.mark.gpu
def test_step_with_early_launches_equals_ordinary_launches(monkeypatch):
    """PDL off, then on: eager, and 20 CUDA-graph replays each from the same state, all the bits
    of the ordinary eager step; on sm_90 the step's launches were compiled with launch_pdl."""
    from qsa_torch import _fast_launch

    run, state, clone = _production_step()
    monkeypatch.setattr(pdl, "ENABLED", False)
    ordinary_state = clone(state)
    expected = run(ordinary_state)
    monkeypatch.setattr(pdl, "ENABLED", True)
    early_state = clone(state)
    with qsa_kernels.launch.observe_launches() as events:
        eager = run(early_state)
    for a, b, name in zip(eager, expected, ("out", "state", "indices")):
        if name != "state":
            assert_bitwise_equal(a, b, f"eager {name}")
    for name in ("key_cache", "value_cache", "compressor_state_cache", "compressed_key_cache"):
        assert_bitwise_equal(getattr(early_state, name), getattr(ordinary_state, name), f"eager {name}")
    capable = torch.cuda.get_device_capability() >= (9, 0)
    assert {e.kernel for e in events if _fast_launch.launch.early(e.launch.kernel, torch.cuda.current_device())} \
        == ({e.kernel for e in events} if capable else set())
    graph_state = clone(state)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed_out, _, graphed_indices = run(graph_state)
    for replay in range(20):
        for name in ("key_cache", "value_cache", "compressor_state_cache", "compressed_key_cache"):
            getattr(graph_state, name).copy_(getattr(state, name))
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise_equal(graphed_out, expected[0], f"replay {replay} out")
        assert_bitwise_equal(graphed_indices, expected[2], f"replay {replay} indices")
        for name in ("key_cache", "value_cache", "compressor_state_cache", "compressed_key_cache"):
            assert_bitwise_equal(getattr(graph_state, name), getattr(ordinary_state, name), f"replay {replay} {name}")
