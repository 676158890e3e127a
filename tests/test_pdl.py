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
from qsa_kernels import pdl

from .util import assert_bitwise_equal


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
def test_launches_early_on_sm90_only_while_enabled_and_emitted(monkeypatch, capability, expected):
    kernel = _every_kernel()["merge_splits_kernel"]
    assert pdl.launches_early(kernel, capability) is (expected and pdl.ENABLED and pdl.EMIT)
    monkeypatch.setattr(pdl, "EMIT", True)
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert not pdl.launches_early(kernel, capability)
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.launches_early(kernel, capability) is expected
    assert not pdl.launches_early(JITFunction(_loads_first), capability)
    # Kernels compiled without the wait (an interpreted process, or a host with an older device)
    # are never launched early.
    monkeypatch.setattr(pdl, "EMIT", False)
    assert not pdl.launches_early(kernel, capability)


def test_the_wait_is_emitted_only_in_compiled_processes_on_sm90_hosts(monkeypatch):
    from qsa_kernels import runtime

    assert not pdl.EMIT or not runtime.INTERPRETED  # this process: interpreted on a CPU, never emitted
    monkeypatch.delenv("QSA_PDL_EMIT", raising=False)
    monkeypatch.setattr(runtime, "INTERPRETED", False)
    for capabilities, emits in (([(9, 0)], True), ([(9, 0), (10, 0)], True), ([(9, 0), (8, 0)], False),
                                ([], False), (None, False)):
        monkeypatch.setattr(runtime, "nvml_capabilities", lambda: capabilities)
        assert pdl._emits() is emits, capabilities
    for forced, emits in (("1", True), ("0", False)):
        monkeypatch.setenv("QSA_PDL_EMIT", forced)
        assert pdl._emits() is emits
    monkeypatch.setattr(runtime, "INTERPRETED", True)
    assert pdl._emits() is False  # the interpreter cannot run the instructions
    monkeypatch.setattr(runtime, "INTERPRETED", False)
    monkeypatch.setenv("QSA_PDL_EMIT", "yes")  # the one switch parser's spellings (runtime.env_switch)
    assert pdl._emits() is True
    monkeypatch.setenv("QSA_PDL_EMIT", "sometimes")
    with pytest.raises(ValueError, match="QSA_PDL_EMIT must be one of 1, on, true, yes"):
        pdl._emits()


@pytest.mark.gpu
def test_step_with_early_launches_equals_ordinary_launches(monkeypatch):
    """PDL off, then on: eager, and 20 CUDA-graph replays each from the same state, all the bits
    of the ordinary eager step; on sm_90 the step's launches were compiled with launch_pdl."""
    from qsa_torch._accel import _fast_launch

    from .test_step import STATE_FIELDS, clone_state as clone, production_decode_step

    _, state, _, _, _, _, run = production_decode_step(seed=3)
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
    for name in STATE_FIELDS:
        assert_bitwise_equal(getattr(early_state, name), getattr(ordinary_state, name), f"eager {name}")
    capable = torch.cuda.get_device_capability() >= (9, 0)
    assert {e.kernel for e in events if _fast_launch.launch.early(e.launch.kernel, torch.cuda.current_device())} \
        == ({e.kernel for e in events} if capable else set())
    graph_state = clone(state)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed_out, _, graphed_indices = run(graph_state)
    for replay in range(20):
        for name in STATE_FIELDS:
            getattr(graph_state, name).copy_(getattr(state, name))
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise_equal(graphed_out, expected[0], f"replay {replay} out")
        assert_bitwise_equal(graphed_indices, expected[2], f"replay {replay} indices")
        for name in STATE_FIELDS:
            assert_bitwise_equal(getattr(graph_state, name), getattr(ordinary_state, name), f"replay {replay} {name}")
