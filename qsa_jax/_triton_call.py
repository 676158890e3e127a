"""Everything jax-triton-specific lives here (targets jax-triton 0.3.1's API).

A later move to jax-triton 0.4 should touch only this file.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from qsa_kernels.launch import Program


def _import_jax_triton():
    # Importing jax_triton sets TRITON_CACHE_DIR to "", after which every
    # torch-side Triton launch in the process fails: put the old value back.
    previous = os.environ.get("TRITON_CACHE_DIR")
    import jax_triton

    if previous is None:
        os.environ.pop("TRITON_CACHE_DIR", None)
    else:
        os.environ["TRITON_CACHE_DIR"] = previous
    return jax_triton


_jax_triton = None


def run(program: Program, env: dict[str, jax.Array]) -> tuple[jax.Array, ...]:
    global _jax_triton
    if _jax_triton is None:
        _jax_triton = _import_jax_triton()
    env = dict(env)
    for buffer in program.buffers:
        # Buffers that no launch writes (empty grids) still need a value.
        env[buffer.name] = None
    for launch in program.runnable_launches:
        for name in launch.inputs:
            if env[name] is None:  # a buffer read before any launch writes it (the step's empty scratch caches)
                buffer = program.buffer(name)
                env[name] = jnp.zeros(buffer.shape, jnp.dtype(buffer.dtype))
        out_shapes = []
        for name in launch.outputs:
            buffer = program.buffer(name)
            if name in launch.inputs or buffer is None:
                source = env[name]
                out_shapes.append(jax.ShapeDtypeStruct(source.shape, source.dtype))
            else:
                out_shapes.append(jax.ShapeDtypeStruct(buffer.shape, jnp.dtype(buffer.dtype)))
        outputs = _jax_triton.triton_call(
            *(env[name] for name in launch.inputs),
            kernel=launch.kernel,
            out_shape=out_shapes,
            grid=launch.grid,
            input_output_aliases=launch.aliases(),
            num_warps=launch.num_warps,
            num_stages=launch.num_stages,
            **launch.scalars,
            **launch.constexprs,
        )
        for name, value in zip(launch.outputs, outputs):
            env[name] = value
    results = []
    for name in program.results:
        value = env[name]
        if value is None:
            buffer = program.buffer(name)
            value = jnp.zeros(buffer.shape, jnp.dtype(buffer.dtype))
        results.append(value)
    return tuple(results)
