"""One declaration per public function: both adapters generate their functions from it.

The declarations (``qsa_kernels.stage.Stage``, listed in ``qsa_kernels.api``)
are the only place a public function's arrays, options and docstring are
written; these tests hold that the adapters add nothing of their own.
"""

from __future__ import annotations

import inspect
import os
import re

import qsa_jax
import qsa_torch
from qsa_kernels import api
from qsa_kernels.docs import framework_doc
from qsa_kernels.stage import Stage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_both_adapters_generate_every_public_stage_from_its_declaration():
    names = [stage.name for stage in api.STAGES]
    assert len(set(names)) == len(names) == 8
    for stage in api.STAGES:
        assert isinstance(stage, Stage)
        signature = stage.signature()
        for adapter, framework in ((qsa_torch, "torch"), (qsa_jax, "jax")):
            function = getattr(adapter, stage.name)
            assert function.__module__ == adapter.__name__
            assert inspect.signature(function) == signature, (stage.name, framework)
            assert function.__doc__ == framework_doc(stage.doc, framework)
            assert inspect.signature(function.plan).parameters == signature.parameters
        # The declaration is the plan's: every parameter but tuning is public, in the plan's order.
        plan_parameters = [p.name for p in inspect.signature(stage._plan).parameters.values()]
        assert [p for p in plan_parameters if p in signature.parameters] == list(signature.parameters)
        assert set(stage.arrays) | set(stage.options) == set(signature.parameters)


def test_the_declared_updates_are_what_the_programs_update():
    """The public functions that update arrays in place, as docs/api.md says (a Program may
    update only declared arrays: the memo asserts it on every plan it makes)."""
    updating = {stage.name: set(stage.updates) for stage in api.STAGES if stage.updates}
    assert updating == {"rope_reshape_and_cache": {"key_cache", "value_cache"},
                        "compress_groups": {"rope_cache"}, "store_cache_rows": {"cache"}}


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
