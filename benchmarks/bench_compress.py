"""Stage 2 benchmark: compress_groups and store_cache_rows from torch and JAX.

Rows R in {1, 64, 256, 2048, 8192} x D in {128, 256}, compress ratio 4, bf16,
int32 index tensors (JAX runs without x64), ring of 2 * ratio slots:

* R <= 256 is decode: one row per request, every row ends a group, so each
  pools three ring members and its own raw key (rope_cache given);
* R >= 2048 is one prefill chunk starting mid-group: a quarter of the rows end
  a group, the first group spans ring and chunk;
* store_cache_rows writes the R rows of D into a [pages, 64, 1, D] cache at
  shuffled slots (JAX donates the cache).

Bytes counted are the bytes a kernel must move: metadata, the members of
every pooled group, and the outputs (compress); rows, slots and cache rows
(store).  Goal: CUDA-graph replay under 3 µs per call at R <= 256.

    python benchmarks/bench_compress.py [--smoke] [--json PATH]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the card

import common  # noqa: E402

RATIO = 4
RING = 2 * RATIO
PAGE = 64
GOAL_US = 3.0
GOAL_ROWS = 256


def compress_workload(rows: int, d: int):
    """NumPy arguments of one compress_groups call (see the module docstring)."""
    import ml_dtypes
    import numpy as np

    rng = np.random.default_rng(rows * 1000 + d)
    if rows <= GOAL_ROWS:  # decode: one row per request, each ending a group
        requests = rows
        positions = RATIO * rng.integers(256, 32768, rows) + RATIO - 1
        token_to_req = np.arange(rows)
        query_start_loc = np.arange(rows + 1)
        slots = np.arange(rows)
    else:  # one prefill chunk starting mid-group
        requests = 1
        positions = 4096 + RATIO // 2 + np.arange(rows)
        token_to_req = np.zeros(rows)
        query_start_loc = np.array([0, rows])
        ends = (positions + 1) % RATIO == 0
        slots = np.where(ends, (positions + 1) // RATIO - 1, -1)
    keys = lambda *shape: rng.standard_normal(shape).astype(ml_dtypes.bfloat16)  # noqa: E731
    i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    args = dict(
        raw_keys=keys(rows, 1, d),
        raw_positions=i32(rng.integers(0, 1 << 20, (rows, 1, 3))),
        compressor_state_cache=keys(requests, RING, 1, d),
        compressor_state_block_table=i32(rng.permutation(requests)[:, None]),
        token_to_req=i32(token_to_req),
        query_start_loc=i32(query_start_loc),
        logical_positions=i32(positions),
        compressed_slots=i32(slots),
        rope_cache=i32(rng.integers(0, 1 << 20, (requests, RING, 1, 3))),
    )
    pooled_rows = int(np.count_nonzero(slots >= 0))
    nbytes = (
        rows * 3 * 4  # token_to_req, logical_positions, compressed_slots
        + (requests + 1) * 4 + requests * 4  # query_start_loc, block table column
        + pooled_rows * (RATIO * d * 2 + 3 * 4)  # group members and first positions read
        + rows * (d * 2 + 3 * 4)  # pooled and first_positions written
    )
    return args, nbytes


def store_workload(rows: int, d: int):
    import ml_dtypes
    import numpy as np

    rng = np.random.default_rng(rows * 1000 + d + 1)
    pages = max(1, -(-rows // PAGE)) * 2
    args = dict(
        cache=rng.standard_normal((pages, PAGE, 1, d)).astype(ml_dtypes.bfloat16),
        slot_mapping=rng.permutation(pages * PAGE)[:rows].astype(np.int32),
        rows=rng.standard_normal((rows, 1, d)).astype(ml_dtypes.bfloat16),
    )
    return args, rows * (2 * d * 2 + 4)


def to_torch(array, device):
    import numpy as np
    import torch

    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(array).to(device)


def bench_compress(args, smoke):
    import jax
    import jax.numpy as jnp

    import qsa_jax
    import qsa_torch

    device = "cuda" if _cuda() else "cpu"
    t = {n: to_torch(a, device) for n, a in args.items()}
    torch_call = lambda: qsa_torch.compress_groups(**t, compress_ratio=RATIO)  # noqa: E731
    j = {n: jnp.asarray(a) for n, a in args.items()}
    rest = {n: a for n, a in j.items() if n != "raw_keys"}
    jitted = jax.jit(lambda raw_keys, rest: qsa_jax.compress_groups(raw_keys, **rest, compress_ratio=RATIO))
    # pooled has raw_keys' shape and dtype: thread it through the loop as the next call's keys.
    step = lambda keys: jitted(keys, rest)[0]  # noqa: E731
    return dict(
        torch_us=common.torch_median_us(torch_call, smoke),
        graph_us=common.torch_graph_us(torch_call, smoke=smoke),
        jax_us=common.jax_wall_us(jitted, (j["raw_keys"], rest), smoke=smoke),
        jax_loop_us=common.jax_loop_us(step, j["raw_keys"], smoke=smoke),
    )


def bench_store(args, smoke):
    import jax
    import jax.numpy as jnp

    import qsa_jax
    import qsa_torch

    device = "cuda" if _cuda() else "cpu"
    t = {n: to_torch(a, device) for n, a in args.items()}
    torch_call = lambda: qsa_torch.store_cache_rows(**t)  # noqa: E731
    slots, rows = jnp.asarray(args["slot_mapping"]), jnp.asarray(args["rows"])
    donating = jax.jit(qsa_jax.store_cache_rows, donate_argnums=0)
    state = {"cache": jnp.asarray(args["cache"])}

    def jax_call():  # the donated cache is consumed: thread the result into the next call
        state["cache"] = donating(state["cache"], slots, rows)
        return state["cache"]

    step = lambda cache: qsa_jax.store_cache_rows(cache, slots, rows)  # noqa: E731
    return dict(
        torch_us=common.torch_median_us(torch_call, smoke),
        graph_us=common.torch_graph_us(torch_call, smoke=smoke),
        jax_us=common.jax_wall_us(jax_call, (), smoke=smoke),
        jax_loop_us=common.jax_loop_us(step, jnp.asarray(args["cache"]), smoke=smoke),
    )


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main():
    p = common.parser(__doc__.splitlines()[0], "compress.json")
    options = p.parse_args()
    import warnings

    # Without a GPU the JAX side runs from a host callback, which cannot reuse donated buffers.
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    shapes = [(r, d) for d in ((32,) if options.smoke else (128, 256))
              for r in ((1, 8) if options.smoke else (1, 64, 256, 2048, 8192))]
    results = []
    for function, workload, bench in (("compress_groups", compress_workload, bench_compress),
                                      ("store_cache_rows", store_workload, bench_store)):
        for rows, d in shapes:
            args, nbytes = workload(rows, d)
            times = bench(args, options.smoke)
            row = dict(function=function, R=rows, D=d, MB=nbytes / 1e6, **times)
            for key in ("torch", "graph", "jax", "jax_loop"):
                row[f"{key}_GBps"] = common.gbps(nbytes, times[f"{key}_us"])
            if rows <= GOAL_ROWS and times["graph_us"] is not None:
                row["goal"] = "ok" if times["graph_us"] < GOAL_US else "MISS"
            results.append(row)
            print(f"  {function} R={rows} D={d}: " + ", ".join(
                f"{k} {v:.2f}" for k, v in times.items() if v is not None), flush=True)
    common.print_table(results, ["function", "R", "D", "MB", "torch_us", "graph_us", "jax_us", "jax_loop_us",
                                 "torch_GBps", "graph_GBps", "jax_GBps", "goal"])
    notes = [
        f"ratio {RATIO}, ring {RING}, bf16 keys, int32 indices; R <= {GOAL_ROWS}: decode (every row pools "
        "3 ring members + itself), larger R: one prefill chunk starting mid-group",
        "torch_us: triton.testing.do_bench median (L2 flushed); graph_us: CUDA-graph replay per call; "
        "jax_us: wall clock per call of back-to-back jitted calls; jax_loop_us: one jitted fori_loop, per call",
        f"goal: graph_us < {GOAL_US} us per call at R <= {GOAL_ROWS}",
    ]
    common.write_json(options.json, "compress", results, notes)


if __name__ == "__main__":
    main()
