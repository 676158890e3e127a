"""Everything jax-triton-specific lives here (targets jax-triton 0.3.1's API).

A later move to jax-triton 0.4 should touch only this file.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from qsa_kernels.launch import Buffer, Launch, Program, execute


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


def _allocate(buffer: Buffer, fill):
    # Unfilled buffers are placeholders: the launch that writes one gets its
    # shape and dtype as an out_shape and returns the array.
    if fill is None:
        return jax.ShapeDtypeStruct(buffer.shape, jnp.dtype(buffer.dtype))
    return jnp.full(buffer.shape, fill, jnp.dtype(buffer.dtype))


def _launch(launch: Launch, inputs: list, outputs: list) -> list:
    return _jax_triton.triton_call(
        *inputs,
        kernel=launch.kernel,
        out_shape=[jax.ShapeDtypeStruct(value.shape, value.dtype) for value in outputs],
        grid=launch.grid,
        input_output_aliases=launch.aliases(),
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
        **launch.scalars,
        **launch.constexprs,
    )


def run(program: Program, env: dict[str, jax.Array]) -> tuple[jax.Array, ...]:
    """Run ``program`` through the shared executor, one ``triton_call`` per launch."""
    global _jax_triton
    if _jax_triton is None:
        _jax_triton = _import_jax_triton()
    return execute(program, env, adapter="jax", allocate=_allocate, launch=_launch)
