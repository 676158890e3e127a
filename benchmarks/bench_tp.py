"""Tensor-parallel step benchmark: per-GPU time of one QSA layer's decode step on 1 and 2 GPUs.

Production geometry (``bench_step.py``), 128K context, 1 / 8 / 64 / 256
requests decoding one row each.  On N GPUs each GPU holds ``KH / N`` KV heads
and their ``QH / N`` query heads (its share of the KV cache); the indexer and
its caches are replicated, so the selection (scorer, top-k, expansion) is the
same work on every GPU and does not shrink.  The step itself needs no
communication: the heads' outputs meet in the output projection's
all-reduce, which is timed on its own (NCCL, ``[B, hidden]``) and not
included in the step.

torch (one process per GPU, spawned; NCCL; all GPUs measure at the same time,
between barriers), per GPU, CUDA-graph replay of ``LOOP_CALLS`` calls:
* ``step_us``: the whole ``qsa_attention_step``;
* ``attention_us``: ``sparse_paged_attention`` alone (stage 4, split by heads);
* ``rope_cache_us``: ``rope_reshape_and_cache`` alone (stage 1, split by heads);
* ``all_reduce_us``: ``torch.distributed.all_reduce`` of the projection
  output, ``[B, 1024]`` float32 (the demo model's) and ``[B, 6144]`` bf16
  (hidden = QH x D), reported separately.
JAX (one process, ``jax.shard_map`` over a Mesh of the N GPUs): ``jax_loop_us``,
one jitted ``lax.fori_loop`` of ``LOOP_CALLS`` sharded steps (donated state), per
step: the slowest GPU's device time.

Values are the largest over the GPUs.  Goal: at 64 and 256 requests the
per-GPU attention time on 2 GPUs at most 0.55x the 1-GPU time.

    NCCL_NVLS_ENABLE=0 python benchmarks/bench_tp.py --json tp.json           # 2 GPUs (--frameworks torch|jax)
    python benchmarks/bench_tp.py --smoke --json /tmp/tp.json                 # CPU: 2 gloo processes, 2 host devices
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from bench_step import PRODUCTION, SMOKE, Geometry, Shape, cache_bytes  # noqa: E402

BATCHES = [1, 8, 64, 256]
CONTEXT = 131072
SMOKE_BATCHES, SMOKE_CONTEXT = [1, 2], 64
LOOP_CALLS = 10
HIDDEN = [("float32", 1024), ("bfloat16", 6144)]  # the demo model's projection output; hidden = QH x D
MEMORY_MARGIN = 4 << 30


def local_geometry(g: Geometry, parts: int) -> Geometry:
    """One GPU's share: KH / parts KV heads and their QH / parts query heads; the indexer unchanged."""
    if g.KH % parts:
        raise ValueError(f"{parts} GPUs do not divide {g.KH} KV heads")
    return dataclasses.replace(g, QH=g.QH // parts, KH=g.KH // parts)


def _timed(fn, smoke: bool) -> float:
    """CUDA-graph µs per call on a GPU; wall-clock median on the CPU (smoke)."""
    import torch

    if torch.cuda.is_available():
        return common.torch_graph_us(fn, calls=LOOP_CALLS, smoke=smoke)
    return common.torch_median_us(fn, smoke=True)


def _all_reduce_us(batch: int, dtype_name: str, width: int, device, smoke: bool) -> float:
    import torch
    import torch.distributed as dist

    x = torch.ones(batch, width, dtype=getattr(torch, dtype_name), device=device)
    try:
        return _timed(lambda: dist.all_reduce(x), smoke)
    except Exception:  # a graph capture of the collective failed: time it eagerly
        if device.type != "cuda":
            raise
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(3):
            dist.all_reduce(x)
        dist.barrier()
        start.record()
        for _ in range(100):
            dist.all_reduce(x)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1000.0 / 100


def _torch_rank(rank: int, parts: int, port: int, smoke: bool, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    import qsa_torch

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if on_gpu else "gloo", rank=rank, world_size=parts,
                            **({"device_id": device} if on_gpu else {}))
    g = local_geometry(SMOKE if smoke else PRODUCTION, parts)
    batches, context = (SMOKE_BATCHES, SMOKE_CONTEXT) if smoke else (BATCHES, CONTEXT)
    rows, notes = [], []
    for batch in batches:
        need = cache_bytes(g, batch, context)
        free = torch.cuda.mem_get_info(device)[0] if on_gpu else float("inf")
        fits = torch.tensor([int(need + MEMORY_MARGIN <= free)], device=device)
        dist.all_reduce(fits, op=dist.ReduceOp.MIN)  # every GPU runs the shape, or none
        if not fits.item():
            notes.append(f"{parts} GPU(s), B={batch}: skipped, caches of {need / 2**30:.1f} GiB per GPU do not fit")
            continue
        shape = Shape(g, batch, context, device)
        _, _, indices = qsa_torch.qsa_attention_step(**shape.inputs, state=shape.state, metadata=shape.meta,
                                                     cos_sin=shape.cos_sin, index_cos_sin=shape.index_cos_sin,
                                                     return_token_indices=True, **shape.options)
        inputs, state, meta = shape.inputs, shape.state, shape.meta
        stages = dict(
            step_us=shape.torch_step,
            attention_us=lambda: qsa_torch.sparse_paged_attention(
                inputs["q"], state.key_cache, state.value_cache, indices, meta.block_table, meta.token_to_req),
            rope_cache_us=lambda: qsa_torch.rope_reshape_and_cache(
                inputs["q"], inputs["k"], inputs["v"], state.key_cache, state.value_cache, meta.slot_mapping,
                meta.positions, shape.cos_sin, is_neox=True),
        )
        row = dict(gpus=parts, batch=batch, context=context, cache_gib_per_gpu=round(need / 2**30, 2))
        for name, fn in stages.items():
            dist.barrier()  # every GPU measures at the same time
            row[name] = _timed(fn, smoke)
        if parts > 1:
            for dtype_name, width in HIDDEN:
                dist.barrier()
                row[f"all_reduce_{dtype_name}_{width}_us"] = _all_reduce_us(batch, dtype_name, width, device, smoke)
        del shape, indices, inputs, state, meta, stages
        if on_gpu:
            torch.cuda.empty_cache()
        everyone = [None] * parts
        dist.all_gather_object(everyone, row)
        merged = dict(row)
        for key, value in row.items():
            if key.endswith("_us"):
                values = [r[key] for r in everyone if r.get(key) is not None]
                merged[key] = max(values) if values else None  # the slowest GPU
                merged[key.replace("_us", "_per_gpu_us")] = values
        rows.append(merged)
        if rank == 0:
            common.print_table([merged], [k for k in merged if not k.endswith("per_gpu_us")])
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(dict(rows=rows, notes=notes), f)
    dist.destroy_process_group()


def run_torch(parts: int, smoke: bool) -> tuple[list, list]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rows.json")
        mp.start_processes(_torch_rank, args=(parts, port, smoke, out_path), nprocs=parts, start_method="spawn")
        with open(out_path) as f:
            saved = json.load(f)
    return saved["rows"], saved["notes"]


def jax_loop_us(parts: int, batch: int, context: int, smoke: bool) -> float:
    """One jitted fori_loop of LOOP_CALLS sharded steps (shard_map over ``parts`` devices), µs per step."""
    import warnings

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import qsa_jax
    from qsa_kernels.paging import METADATA_FIELDS, CacheGeometry, PagedRequests

    g = SMOKE if smoke else PRODUCTION
    mesh = Mesh(np.array(jax.devices()[:parts]), ("tp",))
    geometry = CacheGeometry(
        page_size=g.PAGE, num_pages=batch * -(-context // g.PAGE), compress_ratio=g.RATIO,
        compressed_page_size=g.CPAGE, num_compressed_pages=batch * -(-(context // g.RATIO) // g.CPAGE),
        max_context=context, max_requests=batch)
    pager = PagedRequests(geometry)
    for request in range(batch):
        pager.admit(request, context - 1)
    host_meta = pager.step({request: 1 for request in range(batch)})
    heads, cache_heads = P(None, "tp", None), P(None, None, "tp", None)
    state_spec = qsa_jax.QSAState(key_cache=cache_heads, value_cache=cache_heads, compressor_state_cache=P(),
                                  compressed_key_cache=P())
    meta_spec = qsa_jax.StepMetadata(**{name: P() for name in METADATA_FIELDS})
    sharded = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    keys = iter(jax.random.split(jax.random.key(0), 16))

    def random(shape, spec):  # drawn shard by shard on the devices (no full copy anywhere)
        return jax.jit(lambda k: jax.random.normal(k, shape, jnp.bfloat16), out_shardings=sharded(spec))(next(keys))

    shapes = geometry.state_shapes(g.KH, g.D, g.DI)
    state = qsa_jax.QSAState(**{name: random(shapes[name], getattr(state_spec, name)) for name in shapes})
    inputs = dict(q=random((batch, g.QH, g.D), heads), k=random((batch, g.KH, g.D), heads),
                  v=random((batch, g.KH, g.D), heads), index_q=random((batch, g.IH, g.DI), P()),
                  index_k=random((batch, 1, g.DI), P()))
    angles = np.arange(context)[:, None] * np.random.default_rng(0).random(g.D // 2)
    cos_sin = jnp.asarray(np.concatenate([np.cos(angles), np.sin(angles)], 1), jnp.float32)
    index_angles = angles[:, : g.DI // 2]
    index_cos_sin = jnp.asarray(np.concatenate([np.cos(index_angles), np.sin(index_angles)], 1), jnp.float32)
    meta = jax.tree_util.tree_map(lambda x, s: jax.device_put(x, sharded(s)),
                                  qsa_jax.StepMetadata.from_host(host_meta), meta_spec)
    inputs_spec = dict(q=heads, k=heads, v=heads, index_q=P(), index_k=P())

    def step(inputs, state, meta, cos_sin, index_cos_sin):
        return qsa_jax.qsa_attention_step(**inputs, state=state, metadata=meta, cos_sin=cos_sin,
                                          index_cos_sin=index_cos_sin, compress_ratio=g.RATIO,
                                          token_topk=g.TOKEN_TOPK)

    sharded_step = jax.shard_map(step, mesh=mesh, in_specs=(inputs_spec, state_spec, meta_spec, P(), P()),
                                 out_specs=(heads, state_spec))

    def loop(inputs, state, meta, cos_sin, index_cos_sin):
        def body(_, carry):
            q, state = carry
            return sharded_step(dict(inputs, q=q), state, meta, cos_sin, index_cos_sin)  # out feeds the next q

        return jax.lax.fori_loop(0, LOOP_CALLS, body, (inputs["q"], state), unroll=True)

    looped = jax.jit(loop, donate_argnums=1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        _, state = jax.block_until_ready(looped(inputs, state, meta, cos_sin, index_cos_sin))
        times = []
        for _ in range(3 if smoke else 7):
            start = time.perf_counter()
            _, state = jax.block_until_ready(looped(inputs, state, meta, cos_sin, index_cos_sin))
            times.append((time.perf_counter() - start) * 1e6 / LOOP_CALLS)
    return statistics.median(times)


def main():
    p = common.parser(__doc__, "tp.json")
    p.add_argument("--parts", type=int, default=2, help="GPUs of the tensor-parallel run (compared with 1)")
    p.add_argument("--frameworks", default="torch,jax",
                   help="comma-separated: torch (spawned processes, NCCL) and/or jax (shard_map in this process)")
    args = p.parse_args()
    frameworks = set(args.frameworks.split(","))
    started = time.perf_counter()
    from qsa_kernels import runtime

    if runtime.INTERPRETED:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.parts}").strip()
    batches, context = (SMOKE_BATCHES, SMOKE_CONTEXT) if args.smoke else (BATCHES, CONTEXT)
    rows, notes = [], []
    if "torch" in frameworks:
        for parts in (1, args.parts):
            print(f"torch, {parts} GPU(s){' (CPU smoke: gloo processes)' if runtime.INTERPRETED else ''}:",
                  flush=True)
            part_rows, part_notes = run_torch(parts, args.smoke)
            rows += part_rows
            notes += part_notes
    if "jax" in frameworks:  # after the torch processes have exited and freed the GPUs
        by_shape = {(r["gpus"], r["batch"]): r for r in rows}
        for parts in (1, args.parts):
            for batch in batches:
                row = by_shape.get((parts, batch))
                if row is None:
                    row = dict(gpus=parts, batch=batch, context=context)
                    rows.append(row)
                try:
                    row["jax_loop_us"] = jax_loop_us(parts, batch, context, args.smoke)
                except Exception as error:  # keep the other columns
                    notes.append(f"JAX, {parts} GPU(s), B={batch}: failed: {type(error).__name__}: "
                                 f"{str(error)[:200]}")
                print(f"  JAX {parts} GPU(s) B={batch}: jax_loop_us {row.get('jax_loop_us')} "
                      f"({time.perf_counter() - started:.0f} s)", flush=True)

    one = {r["batch"]: r for r in rows if r["gpus"] == 1}
    for row in rows:
        base = one.get(row["batch"])
        if row["gpus"] > 1 and base:
            for key in ("step_us", "attention_us", "rope_cache_us", "jax_loop_us"):
                if row.get(key) and base.get(key):
                    row[key.replace("_us", "_vs_1gpu")] = row[key] / base[key]
    columns = ["gpus", "batch", "context", "cache_gib_per_gpu", "step_us", "attention_us", "rope_cache_us",
               "jax_loop_us", "step_vs_1gpu", "attention_vs_1gpu", "jax_loop_vs_1gpu",
               *[f"all_reduce_{d}_{w}_us" for d, w in HIDDEN]]
    print()
    common.print_table(rows, columns)
    goals = []
    if "torch" in frameworks:
        ratios = {r["batch"]: r.get("attention_vs_1gpu") for r in rows if r["gpus"] == args.parts}
        wanted = SMOKE_BATCHES if args.smoke else [64, 256]
        got = {b: ratios.get(b) for b in wanted}
        met = all(v is not None and v <= 0.55 for v in got.values())
        goals.append(f"goal: per-GPU attention time (torch, stage 4) on {args.parts} GPUs <= 0.55x the 1-GPU "
                     f"time at B={','.join(map(str, wanted))}: " +
                     ", ".join(f"B={b}: {v:.3f}x" if v else f"B={b}: not measured" for b, v in got.items()) +
                     f" -> {'met' if met else 'NOT met'}")
    for line in goals + notes:
        print(line)
    common.write_json(args.json, "tensor_parallel_step", rows, [
        f"one QSA layer's decode step per GPU, KV heads split over {args.parts} GPUs (indexer replicated), "
        "production geometry, one row per request; values are the slowest GPU's, per-GPU lists alongside",
        f"torch: CUDA graph of {LOOP_CALLS} calls per GPU, all GPUs at once; all-reduce timed separately, "
        "not in the step",
        f"jax_loop_us: shard_map over the GPUs inside one jitted fori_loop of {LOOP_CALLS} steps (slowest GPU)",
        *goals, *notes])
    print(f"wall: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
