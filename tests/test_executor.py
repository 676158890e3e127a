"""The one executor (qsa_kernels.launch.execute), its launch hook and the Launch/Program checks."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch

import qsa_jax
import qsa_torch
from qsa_kernels import compress, select
from qsa_kernels.launch import ArrayInfo, Buffer, Launch, Program, execute, observe_launches
from qsa_kernels.tuning import TopkTuning

from .util import DEVICE, host

KERNEL = compress.store_cache_rows_kernel  # (cache, slot_mapping, rows, scale, cache_out, sizes..., constexprs...)
# The names the shipped plan binds (so these tests follow a renamed parameter).
_SHIPPED = compress.plan_store_cache_rows(ArrayInfo.contiguous((3, 4, 1, 8), "float32"),
                                          ArrayInfo.contiguous((3,), "int32"),
                                          ArrayInfo.contiguous((3, 8), "float32")).launches[0]
SCALARS, CONSTEXPRS = dict(_SHIPPED.scalars), dict(_SHIPPED.constexprs)
A_SCALAR, A_CONSTEXPR = next(iter(SCALARS)), next(iter(CONSTEXPRS))


def store_launch(**changes):
    fields = dict(kernel=KERNEL, grid=(1,), inputs=_SHIPPED.inputs, outputs=("cache",),
                  scalars=dict(SCALARS), constexprs=dict(CONSTEXPRS))
    fields.update(changes)
    return Launch(**fields)


def test_launch_accepts_its_kernels_parameters():
    assert store_launch().kernel is KERNEL


@pytest.mark.parametrize("change, message", [
    (dict(scalars=dict(SCALARS, rows_stride_typo=1)), "scalars key 'rows_stride_typo' is not a parameter"),
    (dict(constexprs=dict(CONSTEXPRS, BLOCKW=1)), "constexprs key 'BLOCKW' is not a parameter"),
    (dict(scalars={k: v for k, v in SCALARS.items() if k != A_SCALAR}), f"['{A_SCALAR}'] are not bound"),
    (dict(scalars=dict(SCALARS, **{A_CONSTEXPR: 1}), constexprs={k: v for k, v in CONSTEXPRS.items() if k != A_CONSTEXPR}),
     f"'{A_CONSTEXPR}' is given in scalars but is a tl.constexpr parameter"),
    (dict(scalars=dict(SCALARS, cache_out_ptr=0)), "'cache_out_ptr' is also bound positionally"),
    (dict(outputs=("cache", "rows")), f"'{A_SCALAR}' is also bound positionally"),  # one pointer too many
])
def test_launch_refuses_names_that_do_not_match_the_kernel(change, message):
    with pytest.raises(TypeError, match="Launch of store_cache_rows_kernel") as error:
        store_launch(**change)
    assert message in str(error.value)


def test_program_refuses_writing_an_argument_it_does_not_read():
    launch = store_launch(inputs=("slot_mapping",) + _SHIPPED.inputs[1:])  # writes cache, never reads it
    with pytest.raises(ValueError, match="writes argument 'cache' without reading it"):
        Program("store_cache_rows", (), (launch,), ("cache",))


def test_every_plan_launch_matches_its_kernel():
    """The shipped plans build (so their launches passed the check) and bind every kernel parameter."""
    a = ArrayInfo.contiguous
    arrays = (a((3, 2, 16), "float32"), a((4, 4, 1, 16), "float32"), a((2, 3), "int32"), a((3,), "int32"),
              a((3,), "int32"), a((2,), "int32"))
    program = select.plan_select_paged_tokens(*arrays, token_topk=4, compress_ratio=2)
    assert len(program.runnable_launches) == 3  # score, the top-k row path, expand
    sliced = select.plan_select_paged_tokens(*arrays, token_topk=4, compress_ratio=2,
                                             topk_tuning=TopkTuning(path="sliced"))
    assert len(sliced.runnable_launches) == 6  # score, 4 top-k phases, expand


def recording_allocate(made):
    def allocate(buffer, fill):
        made[buffer.name] = fill
        return np.full(buffer.shape, -7 if fill is None else fill, buffer.dtype)
    return allocate


def test_execute_threads_outputs_skips_empty_launches_and_fills_unwritten_results():
    # Fake kernels: each launch adds one to its first input into its output.
    def add_one(launch, inputs, outputs):
        return [inputs[0] + 1]

    plus = KERNEL  # any kernel whose parameters fit (the fake launch ignores it)
    pad = ("x",) * (len(_SHIPPED.inputs) - 3)  # the kernel's other pointers: unread by the fake launch
    first = Launch(plus, (1,), ("x", "a", "a") + pad, ("a",), dict(SCALARS), dict(CONSTEXPRS))
    second = Launch(plus, (2,), ("a", "x", "x") + pad, ("b",), dict(SCALARS), dict(CONSTEXPRS))
    never = Launch(plus, (0,), ("x", "x", "x") + pad, ("c",), dict(SCALARS), dict(CONSTEXPRS))
    program = Program("toy", (Buffer("a", (2,), "int32"), Buffer("b", (2,), "int32"), Buffer("c", (2,), "int32", fill=5)),
                      (first, second, never), ("b", "c"))
    assert program.runnable_launches == (first, second)
    assert program.filled_buffers == {"a", "c"}  # `a` is read by the first launch before any writes it
    made = {}
    with observe_launches() as events:
        b, c = execute(program, {"x": np.arange(2)}, adapter="test", allocate=recording_allocate(made),
                       launch=add_one)
    assert made == {"a": 0, "b": None, "c": 5}
    np.testing.assert_array_equal(b, np.arange(2) + 2)  # x + 1 + 1: the second launch saw the first one's output
    np.testing.assert_array_equal(c, [5, 5])
    assert [(e.adapter, e.function, e.kernel, e.grid) for e in events] == [
        ("test", "toy", "store_cache_rows_kernel", (1,)), ("test", "toy", "store_cache_rows_kernel", (2,))]
    assert events[0].launch is first


def store_arguments(rng):
    cache = torch.from_numpy(rng.standard_normal((3, 4, 1, 8)).astype(np.float32)).to(DEVICE)
    slots = torch.tensor([5, -1, 0], dtype=torch.int32, device=DEVICE)
    rows = torch.from_numpy(rng.standard_normal((3, 8)).astype(np.float32)).to(DEVICE)
    return cache, slots, rows


def test_hook_sees_each_adapters_launches_and_nothing_after_the_context():
    rng = np.random.default_rng(0)
    cache, slots, rows = store_arguments(rng)
    program = qsa_torch.store_cache_rows.plan(cache, slots, rows)
    expected = [(launch.kernel, launch.grid) for launch in program.runnable_launches]
    seen = []
    with observe_launches(seen.append):
        qsa_torch.store_cache_rows(cache.clone(), slots, rows)
        jax.jit(qsa_jax.store_cache_rows)(*(jax.numpy.asarray(host(t)) for t in (cache, slots, rows)))
    adapter = "jax-host" if qsa_jax._launch.runtime.INTERPRETED else "jax"
    assert [e.adapter for e in seen] == ["torch", adapter]
    assert all((e.launch.kernel, e.grid) == expected[0] for e in seen)
    qsa_torch.store_cache_rows(cache.clone(), slots, rows)
    assert len(seen) == 2


def test_adapters_never_import_each_other():
    code = r"""
import sys, numpy as np
import jax.numpy as jnp
import qsa_jax
qsa_jax.store_cache_rows(jnp.zeros((2, 4, 1, 8)), jnp.asarray(np.array([1, -1], np.int32)), jnp.ones((2, 8)))
assert "qsa_torch" not in sys.modules, "qsa_jax imported qsa_torch"
import qsa_torch, torch
from qsa_kernels import runtime
device = "cpu" if runtime.INTERPRETED else "cuda"  # a compiled process takes CUDA tensors only
qsa_torch.store_cache_rows(torch.zeros(2, 4, 1, 8, device=device), torch.tensor([1, -1], dtype=torch.int32, device=device),
                           torch.ones(2, 8, device=device))
print("ok")
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
    for adapter, other in (("qsa_torch", "qsa_jax"), ("qsa_jax", "qsa_torch")):
        folder = os.path.join(root, adapter)
        for name in os.listdir(folder):
            if name.endswith(".py"):
                text = open(os.path.join(folder, name)).read()
                assert f"import {other}" not in text and f"from {other}" not in text, f"{adapter}/{name} imports {other}"
