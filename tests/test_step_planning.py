"""How the composed step is planned: its memo, its metadata checks, its composition.

The step is one plan over its stages' plans (``qsa_kernels.step``); these
tests hold what that must guarantee whatever was called before: the tuning
in force decides the launches, contradictory metadata is refused before any
write, and the stages are planned once each.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import qsa_jax
import qsa_torch
from qsa_kernels import tuning
from qsa_kernels.launch import kernel_name, observe_launches
from qsa_kernels.paging import CacheGeometry, PagedRequests
from qsa_kernels.stage import clear_plan_caches

from .test_bad_arguments import _raised, step_arguments, step_to_jax
from .util import DEVICE, assert_bitwise_equal

STATE_FIELDS = ("key_cache", "value_cache", "compressor_state_cache", "compressed_key_cache")
PARTIAL = "sparse_attention_partial_kernel"


def _attention_warps(arguments) -> list[int]:
    """The warps of every attention partial launch one step call makes."""
    with observe_launches() as events:
        qsa_torch.qsa_attention_step(**arguments)
    warps = [event.launch.num_warps for event in events if event.kernel == PARTIAL]
    assert warps, [event.kernel for event in events]
    return warps


@pytest.mark.parametrize("override_first", [False, True], ids=["default_first", "override_first"])
def test_the_tuning_in_force_decides_the_steps_launches_whatever_came_first(override_first):
    """Issue 28.1: the step's memo once held its first plan whatever the attention tuning in force."""
    clear_plan_caches()
    forced = tuning.AttentionTuning(launch_table=((None, 16 * 1024, 1, 1, 64),))  # one warp for every row count
    default_warps = forced_warps = None
    for overridden in ((True, False) if override_first else (False, True)):
        if overridden:
            with tuning.override(attention=forced):
                forced_warps = _attention_warps(step_arguments())
        else:
            default_warps = _attention_warps(step_arguments())
    assert set(forced_warps) == {1}, forced_warps
    assert 1 not in default_warps, "the default tuning must plan other warps for this test to mean something"
    clear_plan_caches()
    assert _attention_warps(step_arguments()) == default_warps  # a fresh plan: the same as either order


def _assert_refused_and_unchanged(arguments: dict, expected: str):
    before = {n: getattr(arguments["state"], n).clone() for n in STATE_FIELDS}
    error = _raised(lambda: qsa_torch.qsa_attention_step(**arguments))
    assert type(error) is ValueError and str(error).startswith(expected), str(error)
    for n in STATE_FIELDS:
        assert_bitwise_equal(getattr(arguments["state"], n), before[n], f"{n} after a refused step")
    jax_error = _raised(lambda: qsa_jax.qsa_attention_step(**step_to_jax(arguments)))
    assert type(jax_error) is ValueError and str(jax_error) == str(error)


def _with_metadata(arguments: dict, **changes) -> dict:
    metadata = dataclasses.replace(arguments["metadata"], **{n: f(arguments["metadata"]) for n, f in changes.items()})
    return {**arguments, "metadata": metadata}


@pytest.mark.parametrize("field, change, expected", [
    ("block_table", lambda m: m.block_table[:1],
     "qsa_attention_step: metadata.block_table must have B = 2 rows, B = 2 requests as the other metadata arrays say"),
    ("compressor_state_block_table", lambda m: m.compressor_state_block_table[:1],
     "qsa_attention_step: metadata.compressor_state_block_table must have B = 2 rows"),
    ("query_start_loc", lambda m: m.query_start_loc[:2],
     "qsa_attention_step: metadata.query_start_loc must have B + 1 = 3 entries"),
    ("compressed_slots", lambda m: m.compressed_slots[:4],
     "qsa_attention_step: metadata.compressed_slots must have shape (5,) (T = 5 rows like metadata.positions)"),
])
def test_metadata_arrays_that_disagree_on_rows_or_requests_are_refused(field, change, expected):
    """Issue 28.7: a table of fewer rows than requests, or a query_start_loc of B entries, was accepted."""
    _assert_refused_and_unchanged(_with_metadata(step_arguments(), **{field: change}), expected)


def _metadata_of(page_size: int, compressed_page_size: int = 2):
    geometry = CacheGeometry(page_size=page_size, num_pages=32 // page_size, compress_ratio=2,
                             compressed_page_size=compressed_page_size, num_compressed_pages=6, max_context=16,
                             max_requests=2)
    return qsa_torch.StepMetadata.from_host(PagedRequests(geometry).step({"a": 3, "b": 2}), DEVICE)


def test_metadata_of_larger_pages_than_the_states_is_refused():
    """Issue 28.7: metadata of a page-8 geometry on a page-4 state read half of each request's K/V."""
    arguments = {**step_arguments(), "metadata": _metadata_of(8)}
    _assert_refused_and_unchanged(arguments, "qsa_attention_step: metadata.compressed_block_table must have at "
                                             "most 2 columns (metadata.block_table's 2 pages of state.key_cache's 4 "
                                             "tokens")


def test_metadata_of_smaller_pages_than_the_states_is_refused():
    """The other way round (page-2 metadata on the page-4 state) asks for more compressed pages than it has."""
    arguments = {**step_arguments(), "metadata": _metadata_of(2)}
    _assert_refused_and_unchanged(arguments, "qsa_attention_step: metadata.compressed_block_table must have at "
                                             "least")


def test_the_steps_own_metadata_passes_the_geometry_checks():
    """The pager's metadata for the state's geometry is accepted (the checks' band is not too tight)."""
    for page, compressed_page in ((4, 2), (4, 1)):
        geometry = CacheGeometry(page_size=page, num_pages=8, compress_ratio=2, compressed_page_size=compressed_page,
                                 num_compressed_pages=12, max_context=16, max_requests=2)
        arguments = step_arguments()
        state = qsa_torch.QSAState(**{name: torch.randn(shape, dtype=getattr(arguments["state"], name).dtype,
                                                        device=DEVICE)
                                      for name, shape in geometry.state_shapes(2, 16, 16).items()})
        metadata = qsa_torch.StepMetadata.from_host(PagedRequests(geometry).step({"a": 3, "b": 2}), DEVICE)
        out, _ = qsa_torch.qsa_attention_step(**{**arguments, "state": state, "metadata": metadata})
        assert out.shape == (5, 4, 16)


def test_each_stage_is_planned_once_per_step_plan(monkeypatch):
    """Issue 22: the fused stage-2 launch used to be planned beside the separate stages' plans."""
    from qsa_kernels import compress, fused, rope_cache, step

    planned = []
    for module in (compress, fused, rope_cache):
        for name in dir(module):
            stage = getattr(module, name)
            if name.startswith("plan_") and hasattr(stage, "_plan"):
                original = stage._plan
                monkeypatch.setattr(stage, "_plan", lambda *a, _o=original, _n=name, **k: (planned.append(_n), _o(*a, **k))[1])
    clear_plan_caches()
    step.plan_qsa_attention_step.cache_clear()
    with observe_launches() as events:
        qsa_torch.qsa_attention_step(**step_arguments())
    clear_plan_caches()
    assert planned == ["plan_rope_reshape_and_cache", "plan_compress_rotate_store"], planned
    assert "rope_compress_store_kernel" in [kernel_name(e.launch.kernel) for e in events]  # stages 1 and 2


def test_a_kernel_that_cannot_be_built_fails_the_call_before_any_launch():
    """Issue 28.2: the executor builds every launch of a multi-launch program before the first runs.

    (The torch adapter's compiled path builds with Triton's ``warmup``; on
    the CPU there is nothing to build, so the contract is held here with a
    ``prepare`` that fails on the last launch, as a kernel that does not
    compile or does not fit the device would.)
    """
    import numpy as np

    from qsa_kernels.launch import Program, execute

    rng = np.random.default_rng(3)
    cache = torch.from_numpy(rng.standard_normal((3, 4, 1, 8)).astype(np.float32)).to(DEVICE)
    slots = torch.tensor([5, -1, 0], dtype=torch.int32, device=DEVICE)
    rows = torch.from_numpy(rng.standard_normal((3, 8)).astype(np.float32)).to(DEVICE)
    (store,) = qsa_torch.store_cache_rows.plan(cache, slots, rows).launches
    program = Program("two_stores", (), (store, store), ("cache",))
    before = cache.clone()
    prepared = []

    def prepare(launch, inputs, outputs):
        prepared.append(launch)
        if len(prepared) == 2:
            raise RuntimeError("the last kernel cannot be built")

    with observe_launches() as events, pytest.raises(RuntimeError, match="cannot be built"):
        execute(program, dict(cache=cache, slot_mapping=slots, rows=rows), adapter="test",
                allocate=lambda buffer, fill: None, launch=lambda launch, i, o: o, prepare=prepare)
    assert events == [] and len(prepared) == 2
    assert_bitwise_equal(cache, before, "the cache after a call whose last kernel failed to build")


@pytest.mark.gpu
def test_a_step_whose_attention_cannot_be_built_writes_no_cache(monkeypatch):
    """On the GPU: when Triton cannot build the step's last kernels (the attention: a compile error, or a
    configuration that does not fit the device, as ``OutOfResources``), the step fails before stage 1
    writes.  The failure is injected into the attention kernel's ``compile`` (a configuration used by no
    other test, so no in-memory build of it exists): a real over-sized configuration depends on the
    shape (the plan caps the tile at the row's width) and on the Triton version's pipelining."""
    from qsa_kernels import attention

    arguments = step_arguments()
    before = {n: getattr(arguments["state"], n).clone() for n in STATE_FIELDS}

    def cannot_build(*args, **kwargs):
        raise RuntimeError("injected: the attention kernel cannot be built for this device")

    monkeypatch.setattr(attention.sparse_attention_partial_kernel, "compile", cannot_build)
    unbuilt = tuning.AttentionTuning(launch_table=((None, 16 * 1024, 2, 5, 64),))
    with tuning.override(attention=unbuilt), pytest.raises(RuntimeError, match="injected"):
        qsa_torch.qsa_attention_step(**arguments)
        torch.cuda.synchronize()
    for n in STATE_FIELDS:
        assert_bitwise_equal(getattr(arguments["state"], n), before[n], f"{n} after a step that failed to build")
