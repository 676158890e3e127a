"""One declaration per public function: both adapters build their functions from it.

The declarations (``qsa_kernels.stage.Stage``, listed in ``qsa_kernels.api``)
are the only place a public function's arrays, options and docstring are
written; these tests hold that the adapters add nothing of their own.
"""

from __future__ import annotations

import inspect
import os
import re

import numpy as np
import pytest

import qsa_jax
import qsa_torch
from qsa_kernels import api
from qsa_kernels.docs import framework_doc
from qsa_kernels.launch import ArrayInfo, Buffer, Program
from qsa_kernels.stage import Stage, when
from qsa_kernels.validate import BOOL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_both_adapters_generate_every_public_stage_from_its_declaration():
    names = [stage.name for stage in api.STAGES]
    assert len(set(names)) == len(names) == 9 and "merge_attention_states" in names
    for stage in api.STAGES:
        assert isinstance(stage, Stage)
        signature = stage.signature()
        for adapter, framework in ((qsa_torch, "torch"), (qsa_jax, "jax")):
            function = getattr(adapter, stage.name)
            assert function.__module__ == adapter.__name__
            # (api.define: the same parameters; the return annotation per variant)
            assert inspect.signature(function).parameters == signature.parameters, (stage.name, framework)
            assert function.__doc__ == framework_doc(stage.doc, framework)
            assert inspect.signature(function.plan).parameters == signature.parameters
        # The declaration is the plan's: every parameter but tuning is public, in the plan's order.
        plan_parameters = [p.name for p in inspect.signature(stage._plan).parameters.values()]
        assert [p for p in plan_parameters if p in signature.parameters] == list(signature.parameters)
        assert set(stage.arrays) | set(stage.options) == set(signature.parameters)


def test_every_function_has_its_public_signature_in_both_adapters():
    """The composed step too (its state and metadata containers): what kernels/functions.py types."""
    for stage in api.FUNCTIONS:
        for adapter in (qsa_torch, qsa_jax):
            function = getattr(adapter, stage.name)
            assert inspect.signature(function) == api.public_signature(stage), (adapter.__name__, stage.name)
            assert function.__qualname__ == stage.name and function.__module__ == adapter.__name__
    assert list(api.public_signature(api.plan_qsa_attention_step).parameters)[5:7] == ["state", "metadata"]
    assert not hasattr(qsa_torch.qsa_attention_step, "plan")


def test_the_declared_updates_are_what_the_programs_update():
    """The public functions that update arrays in place, as docs/api.md says (a Program must
    return and update exactly what its variant declares: the memo asserts it on every plan it makes)."""
    updating = {stage.name: set(stage.updates) for stage in api.FUNCTIONS if stage.updates}
    assert updating == {"rope_reshape_and_cache": {"key_cache", "value_cache"}, "store_cache_rows": {"cache"},
                        "qsa_attention_step": {"key_cache", "value_cache", "compressor_state_cache",
                                               "compressed_key_cache"}}


def test_each_function_has_the_variants_its_result_options_make():
    """One variant per value of the bool options that add results (the torch ops' names)."""
    variants = {stage.name: [(v.name, dict(v.selected), len(v.fresh), v.updated) for v in stage.variants]
                for stage in api.FUNCTIONS}
    assert variants["rope_reshape_and_cache"] == [
        ("rope_reshape_and_cache", {"return_zeros": False}, 2, ("key_cache", "value_cache")),
        ("rope_reshape_and_cache_return_zeros", {"return_zeros": True}, 3, ("key_cache", "value_cache"))]
    assert [(name, fresh) for name, _, fresh, _ in variants["qsa_attention_step"]] == [
        ("qsa_attention_step", 1), ("qsa_attention_step_return_lse", 2),
        ("qsa_attention_step_return_token_indices", 2), ("qsa_attention_step_return_token_indices_return_lse", 3)]
    assert [(name, fresh) for name, _, fresh, _ in variants["sparse_paged_attention"]] == [
        ("sparse_paged_attention", 1), ("sparse_paged_attention_return_lse", 2)]
    single = {name: entries for name, entries in variants.items()
              if name not in ("rope_reshape_and_cache", "qsa_attention_step", "sparse_paged_attention")}
    assert all(len(entries) == 1 and entries[0][0] == name and entries[0][1] == {} for name, entries in single.items())
    assert api.plan_rope_reshape_and_cache.variant({"return_zeros": np.bool_(True)}).name == \
        "rope_reshape_and_cache_return_zeros"
    assert api.plan_rope_reshape_and_cache.variant({}).name == "rope_reshape_and_cache"  # the default


def plan_toy_results_check(x: ArrayInfo, *, extra: bool = False, lie: bool = False) -> Program:
    out = Buffer("out", x.shape, x.dtype)
    results = ("out", "x") if lie else ("out",)  # lie: returns x although nothing updates it
    return Program("toy_results_check", (out,), (), results)


def test_a_plan_returning_other_than_its_declaration_fails_its_first_call():
    stage = Stage(plan_toy_results_check, arrays=("x",), options=dict(extra=BOOL, lie=BOOL),
                  results=("out", when("extra", "more")))
    x = ArrayInfo.contiguous((2, 3), "float32")
    assert stage.plan(x).results == ("out",)
    with pytest.raises(AssertionError, match=r"toy_results_check: the program returns \('out',\).*declares "
                                             r"results \('out', 'more'\)"):
        stage.plan(x, extra=True)
    with pytest.raises(AssertionError, match="toy_results_check: the program returns"):
        stage.plan(x, lie=True)


@pytest.mark.parametrize("results, message", [
    (("out", when("lie", "more"), when("nope", "y")), r"when\('nope', \.\.\.\) must name a bool option"),
    (("out", "lie"), "result 'lie' is an option or tuning parameter"),
    (("out", "out"), "name an array twice"),
])
def test_bad_results_declarations_are_refused(results, message):
    with pytest.raises(TypeError, match=message):
        Stage(plan_toy_results_check, arrays=("x",), options=dict(extra=BOOL, lie=BOOL), results=results)


def test_no_per_stage_wrapper_module_remains():
    for package in ("qsa_torch", "qsa_jax"):
        modules = sorted(name for name in os.listdir(os.path.join(ROOT, package)) if name.endswith(".py"))
        assert not set(modules) & {"_attention.py", "_compress.py", "_rope_cache.py", "_select.py"}, modules


def test_tests_and_benchmarks_plan_through_the_public_seam():
    """``function.plan(...)`` and ``run_program`` are the seam; adapter internals are the adapters' own."""
    pattern = re.compile(r"_launch\.(info|run|metadata)\b")
    offenders = []
    for folder in ("tests", "benchmarks", "scripts", "examples"):
        for directory, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in files:
                if name.endswith(".py") and name != "test_declarations.py":
                    path = os.path.join(directory, name)
                    with open(path) as f:
                        for number, line in enumerate(f, 1):
                            if pattern.search(line):
                                offenders.append(f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_a_plan_seen_by_a_public_function_is_the_calls_program():
    """``function.plan`` takes the call's own arguments and gives the Program the call runs."""
    import torch

    from qsa_kernels.launch import observe_launches

    from .util import DEVICE

    cache = torch.randn(3, 4, 1, 8, device=DEVICE)
    slots = torch.tensor([5, -1, 0], dtype=torch.int32, device=DEVICE)
    rows = torch.randn(3, 8, device=DEVICE)
    program = qsa_torch.store_cache_rows.plan(cache, slots, rows)
    with observe_launches() as events:
        qsa_torch.store_cache_rows(cache, slots, rows)
    assert [e.launch for e in events] == list(program.runnable_launches)
