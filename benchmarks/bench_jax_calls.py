"""How the jitted JAX path dispatches Triton launches: legacy custom call against the FFI handler.

Two measurements per lowering (``qsa_jax.use_triton_lowering``), in one process:

* ``chain``: 12 chained tiny Triton kernels in one jitted function, an unrolled
  ``lax.fori_loop`` of 10 chains: wall µs per kernel, and the GPU's busy time
  and span per kernel (what XLA adds per launch is the rest).
* ``step``: the composed QSA decode step (``benchmarks/bench_step.py``'s shape,
  128K context): a jitted unrolled loop of 10 steps, per step, with the
  previous output alive and freed first; back-to-back calls of a one-step
  jitted function (wall per call); the kernels the GPU ran in one loop (a
  CUPTI trace through ``torch.profiler``, which sees XLA's kernels too), their
  summed time and span; the call protos' size in XLA's optimised HLO and its
  custom calls, copies and fusions.

``XLA_FLAGS`` decides command buffers (XLA's default: on); run once as is and
once with ``--xla_gpu_enable_command_buffer=`` to compare (``--json`` names the
file).
"""

from __future__ import annotations

import collections
import os
import re
import statistics
import time
import warnings

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import common  # noqa: E402

CHAIN = 12
LOOP = 10


def chain_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def add_one_kernel(
        x_ptr,  # [N] float32
        o_ptr,  # [N] float32
        N: tl.constexpr, BLOCK: tl.constexpr,
    ):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < N
        tl.store(o_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + 1.0, mask=mask)

    return add_one_kernel


def chain_us(lowering: str) -> dict:
    import jax
    import jax.numpy as jnp

    import qsa_jax
    from qsa_jax import _triton_call
    from qsa_kernels.launch import Buffer, Launch, Program

    kernel, n = chain_kernel(), 1024
    program = Program("chain", (Buffer("y", (n,), "float32"),),
                      (Launch(kernel, (1,), ("x",), ("y",), constexprs=dict(N=n, BLOCK=n), num_warps=1),),
                      ("y",))

    def chain(x):
        for _ in range(CHAIN):
            (x,) = _triton_call.run(program, {"x": x})
        return x

    with qsa_jax.use_triton_lowering(lowering):
        looped = jax.jit(lambda x: jax.lax.fori_loop(0, LOOP, lambda i, x: chain(x), x, unroll=True))
        x = jnp.zeros((n,), jnp.float32)
        out = jax.block_until_ready(looped(x))
    assert float(out[0]) == CHAIN * LOOP, out[0]
    times = []
    for _ in range(20):
        start = time.perf_counter()
        jax.block_until_ready(looped(x))
        times.append((time.perf_counter() - start) * 1e6)
    per_loop = statistics.median(times)
    hlo = looped.lower(x).compile().as_text()
    trace = common.gpu_trace(lambda: jax.block_until_ready(looped(x)), CHAIN * LOOP) or {}
    return dict(lowering=lowering, us_per_kernel=per_loop / (CHAIN * LOOP), us_per_chain=per_loop / LOOP,
                gpu_busy_us_per_kernel=trace.get("busy_us"), gpu_span_us_per_kernel=trace.get("device_us"),
                **hlo_counts(hlo))


def hlo_counts(hlo: str) -> dict:
    """Ops of XLA's optimised HLO (the whole module) besides the kernels' own work: custom calls by
    target, copies and fusions.  (Command buffers are formed after HLO, from the thunks: see the
    thunk dump, as tests/test_step.py reads it.)"""
    targets = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', hlo))
    return dict(custom_calls=dict(targets), copies=len(re.findall(r"\bcopy(-start)?\(", hlo)),
                fusions=len(re.findall(r"\bfusion\(", hlo)))


def step_trace(lowering: str, batch: int, context: int) -> dict:
    import jax
    import torch

    import bench_step
    import qsa_jax

    shape = bench_step.Shape(bench_step.PRODUCTION, batch, context, torch.device("cuda"))
    inputs, state, meta, tables = bench_step.jax_arrays(shape)
    step, loop = bench_step.jax_step_and_loop(shape, LOOP)

    with qsa_jax.use_triton_lowering(lowering), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        looped = jax.jit(loop, donate_argnums=1)
        _, state = jax.block_until_ready(looped(inputs, state, meta, *tables))
        hlo = looped.lower(inputs, state, meta, *tables).compile().as_text()
        single = jax.jit(step, donate_argnums=1)
        out, state = jax.block_until_ready(single(inputs, state, meta, *tables))
    opaque = sum(len(m) for m in re.findall(r'(?:opaque = |backend_config=)"((?:[^"\\]|\\.)*)"', hlo)) / LOOP
    for _ in range(3):
        _, state = jax.block_until_ready(looped(inputs, state, meta, *tables))
    times, dropped = [], []
    for _ in range(5):  # the previous call's output alive (as a caller's usually is)
        start = time.perf_counter()
        out, state = jax.block_until_ready(looped(inputs, state, meta, *tables))
        times.append((time.perf_counter() - start) * 1e6 / LOOP)
    for _ in range(5):  # freed first: its buffer can come back at the same address
        del out
        start = time.perf_counter()
        out, state = jax.block_until_ready(looped(inputs, state, meta, *tables))
        dropped.append((time.perf_counter() - start) * 1e6 / LOOP)
    wall = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(LOOP):
            out, state = single(inputs, state, meta, *tables)
        jax.block_until_ready(state)
        wall.append((time.perf_counter() - start) * 1e6 / LOOP)
    trace = common.gpu_trace(lambda: jax.block_until_ready(looped(inputs, state, meta, *tables)), LOOP)
    row = dict(lowering=lowering, batch=batch, context=context, opaque_text_kb_per_step=opaque / 1e3,
               loop_us_per_step=statistics.median(times), loop_us_outputs_freed=statistics.median(dropped),
               wall_us_per_call=statistics.median(wall),
               **trace, **hlo_counts(hlo))
    del shape
    torch.cuda.empty_cache()
    return row


def main():
    p = common.parser(__doc__, "jax_calls.json")
    p.add_argument("--batches", type=int, nargs="*", default=[1, 64])
    p.add_argument("--context", type=int, default=131072)
    args = p.parse_args()
    import qsa_jax

    lowerings = ["legacy"] + (["ffi"] if qsa_jax.triton_lowering_available("ffi") else [])
    flags = os.environ.get("XLA_FLAGS", "")
    rows = []
    for lowering in lowerings:
        row = dict(kind="chain", xla_flags=flags, **chain_us(lowering))  # a 1 KB call proto: slimming moot
        print(row)
        rows.append(row)
    for batch in args.batches:
        for lowering in lowerings:
            row = dict(kind="step", xla_flags=flags, **step_trace(lowering, batch, args.context))
            print({k: v for k, v in row.items() if k != "ops"})
            rows.append(row)
    common.write_json(args.json, "jax dispatch: legacy vs FFI lowering", rows, [
        f"chain: {CHAIN} chained 1024-element Triton kernels per jitted chain, unrolled fori_loop of {LOOP}; "
        "us_per_kernel = wall / (chains x kernels)",
        f"step: the composed decode step, unrolled fori_loop of {LOOP}; gpu ops from a CUPTI trace "
        "(torch.profiler) of one loop; busy = summed op time, span = first start to last end",
        f"XLA_FLAGS={flags!r}",
    ])


if __name__ == "__main__":
    main()
