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
    adapter = "jax-host" if qsa_jax._binding.runtime.INTERPRETED else "jax"
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


def test_fused_launch_joins_the_parts_arguments_under_their_prefixes():
    """launch.fused_launch (the step's stages 1 and 2 in one launch): one grid of every part's programs in turn,
    the parts' inputs then their outputs, each part's scalars and constexprs under its prefix."""
    from qsa_kernels import fused
    from qsa_kernels.launch import fused_launch
    from qsa_kernels.rope_cache import plan_rope_reshape_and_cache

    a, i32 = ArrayInfo.contiguous, "int32"
    rope = plan_rope_reshape_and_cache(
        q=a((3, 8, 32), "bfloat16"), k=a((3, 2, 32), "bfloat16"), v=a((3, 2, 32), "bfloat16"),
        key_cache=a((4, 8, 2, 32), "bfloat16"), value_cache=a((4, 8, 2, 32), "bfloat16"),
        slot_mapping=a((3,), i32), positions=a((3,), i32), cos_sin=a((64, 32), "float32"), is_neox=True).launches[0]
    compression = fused.plan_compress_rotate_store(
        raw_keys=a((3, 1, 16), "bfloat16"), raw_positions=a((3, 1, 3), i32),
        compressor_state_cache=a((2, 4, 1, 16), "bfloat16"), compressor_state_block_table=a((2, 1), i32),
        token_to_req=a((3,), i32), query_start_loc=a((3,), i32), logical_positions=a((3,), i32),
        compressed_slots=a((3,), i32), compressor_state_slots=a((3,), i32),
        compressed_key_cache=a((4, 8, 1, 16), "bfloat16"), cos_sin=a((64, 16), "float32"),
        index_q=a((3, 2, 16), "bfloat16"), compress_ratio=2, is_neox=True, max_row_position=64).launches[0]
    assert len(rope.grid) == 2 and rope.grid[1] > 1 and len(compression.grid) == 1  # a 2-D part flattened
    joined = fused.rope_compress_store(rope, compression)
    assert joined.kernel is fused.rope_compress_store_kernel
    assert joined.grid == (rope.grid[0] * rope.grid[1] + compression.grid[0],)
    assert joined.inputs == rope.inputs + compression.inputs and joined.outputs == rope.outputs + compression.outputs
    assert (joined.scalars["r_programs"], joined.scalars["r_grid_1"]) == (rope.grid[0] * rope.grid[1], rope.grid[1])
    assert (joined.scalars["c_programs"], joined.scalars["c_grid_1"]) == (compression.grid[0], 1)
    for prefix, part in (("r_", rope), ("c_", compression)):
        assert all(joined.scalars[prefix + name] == value for name, value in part.scalars.items())
        assert all(joined.constexprs[prefix + name] == value for name, value in part.constexprs.items())
    assert joined.num_warps == max(rope.num_warps, compression.num_warps)
    with pytest.raises(ValueError, match="rope_compress_store: got launches of"):
        fused.rope_compress_store(compression, rope)
    with pytest.raises(ValueError, match="3-dimensional grid"):
        fused_launch(fused.rope_compress_store_kernel, (("r_", Launch(**{**rope.__dict__, "grid": (1, 1, 2)})),
                                                        ("c_", compression)), num_warps=4)


def test_the_fused_kernels_are_generated_from_their_parts():
    """kernels/fused.py's fused kernels are what scripts/generate_fused_kernels.py reads from their parts'
    kernels (a part that gains a parameter regenerates them), and the generator reads a part as it is."""
    script = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "generate_fused_kernels.py")
    result = subprocess.run([sys.executable, script, "--check"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    sys.path.insert(0, os.path.dirname(script))
    try:
        import generate_fused_kernels as generator
    finally:
        sys.path.pop(0)
    part = generator.Part("x_", "fused", "compress_rotate_store_kernel")
    read = generator._read(part)
    names = [p.name for p in read.parameters]
    assert read.program == "compress_rotate_store_program" and read.program_ids == ("tl.program_id(0)",)
    assert [p.name for p in read.parameters if p.section == "outputs"] == \
        ["ring_out_ptr", "compressed_out_ptr", "index_q_out_ptr"]
    assert names[-1] == "BLOCK_HALF" and read.parameters[-1].constexpr and not read.parameters[0].constexpr
    from qsa_kernels.fused import rope_compress_store_kernel
    from qsa_kernels.launch import _kernel_parameters

    fused_names = [p[0] for p in _kernel_parameters(rope_compress_store_kernel)]
    assert fused_names.count("c_BLOCK_HALF") == 1 and len(fused_names) == len(set(fused_names))
