"""The demo model tensor-parallel over N devices, in JAX (shard_map) and in PyTorch (torch.distributed).

Each device holds ``KH / N`` KV heads and their ``QH / N`` query heads: its
slice of the q/k/v projections' columns, of the output projection's rows and
of the KV cache.  The indexer (its projections, the compressor-state ring and
the compressed-key cache) is replicated: every device selects the same
tokens.  The output projection's partial products meet in an all-reduce
(``jax.lax.psum`` in JAX, ``torch.distributed.all_reduce`` in torch), then
everything after it is replicated.  Paging metadata comes from one
``qsa_kernels.paging.PagedRequests``: with heads split every device sees the
same metadata (torch: each process runs the same deterministic pager).

The run is compared with the same framework on one device: the greedy tokens
must be identical, and the logits are compared bit for bit.  The dense layers
are fixed point (``model.py``), so the all-reduce of partial projections is
exact; what could still differ is the attention kernel's split-K count, which
its plan derives from ``rows x KV heads`` (fewer KV heads per device may mean
more splits: the log-sum-exp merge is exact up to rounding).

    # CPU: JAX over 2 host devices (XLA_FLAGS is set here before jax is imported)
    python examples/tensor_parallel.py --framework jax --tensor-parallel 2
    # CPU: torch over 2 gloo processes
    python examples/tensor_parallel.py --framework torch --tensor-parallel 2
    # 2 GPUs: the production geometry (random 32K contexts, then greedy decoding)
    NCCL_NVLS_ENABLE=0 python examples/tensor_parallel.py --framework torch --tensor-parallel 2 --gpu-production

``--gpu-production`` also runs on the CPU with ``--smoke`` (the same code
path on a tiny model and context), which is how CI checks it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from model import CPU_CONFIG, PRODUCTION_CONFIG, ModelConfig, Request, make_weights  # noqa: E402
from qsa_kernels.paging import CacheGeometry, PagedRequests  # noqa: E402

AXIS = "tp"  # the mesh axis the heads are split over


# --------------------------------------------------------------------------
# Framework-free: how the model is split, what is run
# --------------------------------------------------------------------------

def shard_config(config: ModelConfig, parts: int) -> ModelConfig:
    """One device's share of the attention heads (the indexer and the dense sizes are unchanged)."""
    if parts < 1 or config.kv_heads % parts:
        raise ValueError(f"--tensor-parallel must divide the {config.kv_heads} KV heads, got {parts}")
    return dataclasses.replace(config, heads=config.heads // parts, kv_heads=config.kv_heads // parts)


def shard_weights(weights: dict, config: ModelConfig, part: int, parts: int) -> dict:
    """Device ``part``'s weights: its heads' columns of wq/wk/wv and rows of wo; the rest replicated."""
    q_width = config.heads // parts * config.head_dim
    kv_width = config.kv_heads // parts * config.head_dim
    layers = []
    for layer in weights["layers"]:
        layer = dict(layer)
        layer["wq"] = np.ascontiguousarray(layer["wq"][:, part * q_width:(part + 1) * q_width])
        for name in ("wk", "wv"):
            layer[name] = np.ascontiguousarray(layer[name][:, part * kv_width:(part + 1) * kv_width])
        layer["wo"] = np.ascontiguousarray(layer["wo"][part * q_width:(part + 1) * q_width])
        layers.append(layer)
    return dict(weights, layers=layers)


@dataclasses.dataclass(frozen=True)
class Scenario:
    """What to run: the model, the caches, the prompts; optionally random contexts first."""

    config: ModelConfig
    geometry: CacheGeometry
    prompts: tuple
    new_tokens: tuple
    chunk: int
    context: int = 0  # random context tokens per request written before the prompts (production)
    fill_chunk: int = 4096

    @property
    def requests(self) -> int:
        return len(self.prompts)


def small_scenario(prompt_lengths=(21, 14, 9), new_tokens=(8, 5, 10), chunk=8) -> Scenario:
    """The CPU demo's run (``demo.py``): prompts prefilled in chunks, then greedy decoding."""
    config = CPU_CONFIG
    rng = np.random.default_rng(2026)
    prompts = tuple(tuple(rng.integers(0, config.vocab, n).tolist()) for n in prompt_lengths)
    max_context = max(p + n for p, n in zip(prompt_lengths, new_tokens))
    geometry = CacheGeometry(page_size=8, num_pages=16, compress_ratio=config.compress_ratio,
                             compressed_page_size=4, num_compressed_pages=8,
                             max_context=max(32, max_context), max_requests=4)
    return Scenario(config, geometry, prompts, tuple(new_tokens), chunk)


def production_scenario(requests: int, context: int, steps: int, smoke: bool = False) -> Scenario:
    """Random contexts of ``context`` tokens per request, then ``steps`` greedy tokens from one first token.

    ``smoke``: the same on the CPU model with pages of 8 (checks the code path).
    """
    config = dataclasses.replace(CPU_CONFIG, max_position=context + steps + 8) if smoke else PRODUCTION_CONFIG
    page = 8 if smoke else 64
    max_context = context + steps + 1
    geometry = CacheGeometry(
        page_size=page, num_pages=requests * -(-max_context // page), compress_ratio=config.compress_ratio,
        compressed_page_size=page,
        num_compressed_pages=requests * max(1, -(-(max_context // config.compress_ratio) // page)),
        max_context=max_context, max_requests=requests)
    first = np.random.default_rng(0).integers(0, config.vocab, requests).tolist()
    return Scenario(config, geometry, tuple((t,) for t in first), (steps,) * requests, chunk=1,
                    context=context, fill_chunk=min(4096, context) if not smoke else 8)


@dataclasses.dataclass
class Result:
    logits: list  # per step, [B, vocab] float32
    generated: list  # per request
    decode_seconds: list  # wall clock of decode-only steps
    traces: int = 0


def fill_contexts(scenario: Scenario, pager: PagedRequests, fill_step, quiet: bool = False) -> None:
    """Production: random K/V and index keys of every context token, written through the QSA step."""
    done, chunk = 0, scenario.fill_chunk
    start = time.perf_counter()
    while done < scenario.context:
        count = min(chunk, scenario.context - done)
        fill_step(done // chunk, pager.step({r: count for r in range(scenario.requests)}))
        done += count
    if not quiet:
        print(f"  contexts: {scenario.context} random tokens per request written "
              f"({time.perf_counter() - start:.1f} s)", flush=True)


def generate(scenario: Scenario, model_step, fill_step=None, quiet: bool = False) -> Result:
    """The request loop of ``demo.py`` over ``model_step(tokens: list[int], host_meta) -> (logits, next)``."""
    pager = PagedRequests(scenario.geometry, seed=1)
    if scenario.context:
        fill_contexts(scenario, pager, fill_step, quiet)
    requests = [Request(list(p), n) for p, n in zip(scenario.prompts, scenario.new_tokens)]
    result = Result([], [], [])
    while not all(r.done for r in requests):
        active = [i for i, r in enumerate(requests) if not r.done]
        rows = {i: requests[i].next_rows(scenario.chunk) for i in active}
        decode = all(requests[i].fed >= len(requests[i].prompt) for i in active)
        host_meta = pager.step({i: len(rows[i]) for i in active})
        start = time.perf_counter()
        logits, next_tokens = model_step(sum(rows.values(), []), host_meta)
        if decode:
            result.decode_seconds.append(time.perf_counter() - start)
        result.logits.append(logits)
        for b, i in enumerate(active):
            requests[i].advance(len(rows[i]), int(next_tokens[b]))
            if requests[i].done:
                pager.release(i)
    result.generated = [r.generated for r in requests]
    return result


def compare(name: str, single: Result, parallel: Result, parts: int) -> bool:
    """Print and return whether the tokens are identical; the logits' bitwise equality is reported."""
    same_tokens = single.generated == parallel.generated
    same_bits = len(single.logits) == len(parallel.logits) and all(
        a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))
        for a, b in zip(single.logits, parallel.logits))
    worst = max(float(np.abs(a - b).max()) for a, b in zip(single.logits, parallel.logits))
    print(f"{name}: {parts} devices vs 1: identical tokens: {same_tokens}; logits bitwise identical at every "
          f"step: {same_bits} (largest difference {worst:.3g})")
    for i, tokens in enumerate(parallel.generated):
        print(f"  request {i}: generated {tokens[:16]}{' ...' if len(tokens) > 16 else ''}")
    for label, result in (("1 device", single), (f"{parts} devices", parallel)):
        if result.decode_seconds:
            times = result.decode_seconds[1:] or result.decode_seconds
            print(f"  {label}: {statistics.median(times) * 1e3:.2f} ms per decode step (median, wall clock, "
                  f"host included)")
    return same_tokens


# --------------------------------------------------------------------------
# JAX: one process, a Mesh of N devices, the step under shard_map
# --------------------------------------------------------------------------

def jax_specs(config: ModelConfig):
    """PartitionSpecs of the parameters, one layer's state and the metadata (heads split over AXIS)."""
    from jax.sharding import PartitionSpec as P

    import qsa_jax
    from qsa_kernels.paging import METADATA_FIELDS

    split_columns, split_rows = P(None, AXIS), P(AXIS, None)
    layer = dict(wq=split_columns, wk=split_columns, wv=split_columns, wo=split_rows,
                 wiq=P(), wik=P(), wup=P(), wdown=P())
    params = dict(embed=P(), lm_head=P(), cos_sin=P(), index_cos_sin=P(), layers=[layer] * config.layers)
    heads = P(None, None, AXIS, None)  # [pages, P, KH, D]
    state = qsa_jax.QSAState(key_cache=heads, value_cache=heads, compressor_state_cache=P(), compressed_key_cache=P())
    meta = qsa_jax.StepMetadata(**{name: P() for name in METADATA_FIELDS})
    return params, state, meta


class JaxTensorParallel:
    """The JAX model's step over ``devices``: ``shard_map`` of ``model_jax.forward`` with a ``psum``."""

    def __init__(self, config: ModelConfig, weights: dict, devices):
        import jax
        from jax.sharding import Mesh, NamedSharding

        import model_jax
        from model import rope_table

        self.config, self.parts = config, len(devices)
        self.mesh = Mesh(np.array(devices), (AXIS,))
        params_spec, self.state_spec, self.meta_spec = jax_specs(config)
        params = dict(weights, cos_sin=rope_table(config.head_dim, config.max_position, config.rope_base),
                      index_cos_sin=rope_table(config.index_head_dim, config.max_position, config.rope_base))
        self.place = lambda tree, spec: jax.tree_util.tree_map(  # noqa: E731
            lambda x, s: jax.device_put(x, NamedSharding(self.mesh, s)), tree, spec)
        self.params = self.place(params, params_spec)
        self.traces = 0
        local = shard_config(config, self.parts)

        def body(params, tokens, states, meta):
            self.traces += 1  # once per trace
            return model_jax.forward(params, tokens, states, meta, config=local,
                                     all_reduce=lambda x: jax.lax.psum(x, AXIS))

        P = jax.sharding.PartitionSpec
        states_spec = [self.state_spec] * config.layers
        self.step = jax.jit(jax.shard_map(
            body, mesh=self.mesh, in_specs=(params_spec, P(), states_spec, self.meta_spec),
            out_specs=(P(), P(), states_spec, [P()] * config.layers)), donate_argnums=(2,))

    def new_states(self, geometry: CacheGeometry):
        import jax.numpy as jnp

        import qsa_jax

        c = self.config
        states = [qsa_jax.QSAState.zeros(geometry, kv_heads=c.kv_heads, head_dim=c.head_dim,
                                         index_head_dim=c.index_head_dim, dtype=jnp.bfloat16)
                  for _ in range(c.layers)]
        return [self.place(s, self.state_spec) for s in states]

    def metadata(self, host_meta):
        import qsa_jax

        return self.place(qsa_jax.StepMetadata.from_host(host_meta), self.meta_spec)

    def fill_step(self):
        """``fill(chunk_index, host_meta)``: random q/k/v/index keys through the QSA step, each device its heads."""
        import jax
        from jax.sharding import PartitionSpec as P

        c, parts, states_spec = self.config, self.parts, [self.state_spec] * self.config.layers

        def body(params, key, states, meta):
            part = jax.lax.axis_index(AXIS)
            return _jax_fill_layers(c, params, key, states, meta, part, parts)

        fill = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=(jax_specs(c)[0], P(), states_spec,
                                                                       self.meta_spec),
                                     out_specs=states_spec), donate_argnums=(2,))

        def run(index, host_meta):
            self.states = jax.block_until_ready(
                fill(self.params, jax.random.key(index), self.states, self.metadata(host_meta)))

        return run


def _jax_fill_layers(c: ModelConfig, params, key, states, meta, part, parts):
    """Every layer's step on random inputs (full head count drawn, this device's heads kept)."""
    import jax
    import jax.numpy as jnp

    import qsa_jax

    rows = meta.positions.shape[0]
    out = []
    for layer, state in enumerate(states):
        keys = jax.random.split(jax.random.fold_in(key, layer), 5)
        draw = lambda k, h, d: jax.random.normal(k, (rows, h, d), jnp.float32).astype(jnp.bfloat16)  # noqa: E731
        mine = lambda x, h: jax.lax.dynamic_slice_in_dim(x, part * (h // parts), h // parts, axis=1)  # noqa: E731
        q = mine(draw(keys[0], c.heads, c.head_dim), c.heads)
        k = mine(draw(keys[1], c.kv_heads, c.head_dim), c.kv_heads)
        v = mine(draw(keys[2], c.kv_heads, c.head_dim), c.kv_heads)
        _, state = qsa_jax.qsa_attention_step(
            q, k, v, draw(keys[3], c.index_heads, c.index_head_dim), draw(keys[4], 1, c.index_head_dim), state,
            meta, params["cos_sin"], params["index_cos_sin"], compress_ratio=c.compress_ratio,
            token_topk=c.token_topk)
        out.append(state)
    return out


def run_jax(scenario: Scenario, parts: int) -> Result:
    """The scenario on the first ``parts`` JAX devices; ``parts == 1`` is the demo's own ``JaxModel``."""
    import warnings

    import jax
    import jax.numpy as jnp

    import model_jax
    import qsa_jax

    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    devices = jax.devices()
    if len(devices) < parts:
        raise SystemExit(f"--tensor-parallel {parts}: JAX sees only {len(devices)} device(s)")
    weights = make_weights(scenario.config)
    if parts == 1:
        model = model_jax.JaxModel(scenario.config, weights)
        metadata = qsa_jax.StepMetadata.from_host
        fill = jax.jit(functools.partial(_jax_fill_layers, scenario.config, part=0, parts=1), donate_argnums=(2,))

        def fill_step(index, host_meta):
            model.states = jax.block_until_ready(
                fill(model.params, jax.random.key(index), model.states, metadata(host_meta)))
    else:
        model = JaxTensorParallel(scenario.config, weights, devices[:parts])
        metadata, fill_step = model.metadata, model.fill_step()
    model.states = model.new_states(scenario.geometry)

    def step(tokens, host_meta):
        logits, next_tokens, model.states, _ = jax.block_until_ready(
            model.step(model.params, jnp.asarray(tokens, jnp.int32), model.states, metadata(host_meta)))
        return np.asarray(logits), np.asarray(next_tokens)

    result = generate(scenario, step, fill_step if scenario.context else None)
    result.traces = model.traces
    return result


# --------------------------------------------------------------------------
# torch: one process per device (torch.multiprocessing spawn), gloo or NCCL
# --------------------------------------------------------------------------

def _torch_worker(rank: int, parts: int, scenario: Scenario, port: int, out_path: str, graphs: bool):
    import torch
    import torch.distributed as dist

    from qsa_kernels import runtime

    on_gpu = not runtime.INTERPRETED
    if on_gpu:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)  # N processes share the CPU
        device = torch.device("cpu")
    if parts > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl" if on_gpu else "gloo", rank=rank, world_size=parts,
                                **({"device_id": device} if on_gpu else {}))
    try:
        result = _torch_generate(scenario, rank, parts, device, graphs and on_gpu)
        if rank == 0:
            np.savez(out_path, *result.logits, generated=np.array(result.generated, dtype=object),
                     decode_seconds=np.array(result.decode_seconds))
    finally:
        if parts > 1:
            dist.destroy_process_group()


def _torch_generate(scenario: Scenario, rank: int, parts: int, device, graphs: bool) -> Result:
    import torch
    import torch.distributed as dist

    import qsa_torch
    from model_torch import GraphedSteps, TorchModel

    c = scenario.config
    local = shard_config(c, parts)

    def all_reduce(x):
        dist.all_reduce(x)  # in place, sum
        return x

    model = TorchModel(local, shard_weights(make_weights(c), c, rank, parts), device,
                       all_reduce=all_reduce if parts > 1 else None)
    states = model.new_states(scenario.geometry)
    graphed = GraphedSteps(model, states) if graphs else None

    def step(tokens, host_meta):
        nonlocal states
        tokens = torch.tensor(tokens, device=device)
        if graphed is not None and host_meta.num_rows == host_meta.num_requests:  # decode: one graph per shape
            logits, next_tokens, _, _ = graphed(tokens, host_meta)
        else:
            meta = qsa_torch.StepMetadata.from_host(host_meta, device)
            logits, next_tokens, states, _ = model.forward(tokens, states, meta)
        return logits.cpu().numpy(), next_tokens.cpu().numpy()

    def fill(index, host_meta):
        # The full head count is drawn on every device (same seed), each keeps its own heads.
        generator = torch.Generator(device).manual_seed(index)
        rows = host_meta.num_rows
        meta = qsa_torch.StepMetadata.from_host(host_meta, device)

        def draw(heads, dim, keep=None):
            x = torch.randn(rows, heads, dim, generator=generator, device=device).to(torch.bfloat16)
            return x if keep is None else x[:, rank * keep:(rank + 1) * keep].contiguous()

        for layer, state in enumerate(states):
            q, k, v = (draw(c.heads, c.head_dim, local.heads), draw(c.kv_heads, c.head_dim, local.kv_heads),
                       draw(c.kv_heads, c.head_dim, local.kv_heads))
            qsa_torch.qsa_attention_step(q, k, v, draw(c.index_heads, c.index_head_dim), draw(1, c.index_head_dim),
                                         state, meta, model.cos_sin, model.index_cos_sin,
                                         compress_ratio=c.compress_ratio, token_topk=c.token_topk)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return generate(scenario, step, fill if scenario.context else None, quiet=rank != 0)


def run_torch(scenario: Scenario, parts: int, graphs: bool = True, timeout: float | None = None,
              inline: bool = False) -> Result:
    """The scenario over ``parts`` spawned processes (``parts == 1``: no process group; ``inline``: in
    this process, on its first device, eager)."""
    import socket

    if inline:
        import torch

        from qsa_kernels import runtime

        assert parts == 1
        device = torch.device("cpu" if runtime.INTERPRETED else "cuda")
        return _torch_generate(scenario, 0, 1, device, graphs=False)

    import torch.multiprocessing as mp

    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rank0.npz")
        context = mp.start_processes(_torch_worker, args=(parts, scenario, port, out_path, graphs), nprocs=parts,
                                     join=False, start_method="spawn")
        deadline = None if timeout is None else time.monotonic() + timeout
        while not context.join(timeout=5):
            if deadline is not None and time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"torch tensor-parallel run over {parts} processes took over {timeout} s")
        with np.load(out_path, allow_pickle=True) as saved:
            steps = len([k for k in saved.files if k.startswith("arr_")])
            return Result([saved[f"arr_{i}"] for i in range(steps)], [list(g) for g in saved["generated"]],
                          list(saved["decode_seconds"]))


# --------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--framework", choices=("jax", "torch", "both"), default="both")
    parser.add_argument("--tensor-parallel", type=int, default=2, metavar="N", help="devices to split the heads over")
    parser.add_argument("--gpu-production", action="store_true",
                        help="production geometry: random contexts, then greedy decoding (GPUs; CPU with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="with --gpu-production: the tiny CPU model")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--no-graphs", action="store_true", help="torch on GPU: eager steps, no CUDA graphs")
    args = parser.parse_args()

    from qsa_kernels import runtime

    if runtime.INTERPRETED and args.framework != "torch":
        # N host devices for JAX; must be set before jax is first imported.
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.tensor_parallel}".strip()
    if args.gpu_production:
        if runtime.INTERPRETED and not args.smoke:
            print("--gpu-production needs CUDA devices (or --smoke on the CPU)")
            return 2
        scenario = production_scenario(args.requests, args.context, args.steps, smoke=args.smoke)
    else:
        scenario = small_scenario()
    mode = "Triton interpreter (CPU)" if runtime.INTERPRETED else "compiled Triton (GPU)"
    c = scenario.config
    print(f"qsa tensor-parallel demo: {mode}; attention {c.heads} Q / {c.kv_heads} KV heads x d{c.head_dim} split "
          f"over {args.tensor_parallel} devices ({c.heads // args.tensor_parallel} Q / "
          f"{c.kv_heads // args.tensor_parallel} KV each), indexer replicated; {scenario.requests} requests"
          + (f" at {scenario.context} tokens of context" if scenario.context else ""), flush=True)
    ok = True
    if args.framework in ("jax", "both"):
        print("JAX, 1 device:", flush=True)
        single = run_jax(scenario, 1)
        print(f"JAX, {args.tensor_parallel} devices (shard_map over a Mesh):", flush=True)
        parallel = run_jax(scenario, args.tensor_parallel)
        ok &= compare("JAX", single, parallel, args.tensor_parallel)
    if args.framework in ("torch", "both"):
        print("torch, 1 process:", flush=True)
        single = run_torch(scenario, 1, graphs=not args.no_graphs)
        backend = "gloo" if runtime.INTERPRETED else "NCCL"
        print(f"torch, {args.tensor_parallel} processes ({backend}):", flush=True)
        parallel = run_torch(scenario, args.tensor_parallel, graphs=not args.no_graphs)
        ok &= compare("torch", single, parallel, args.tensor_parallel)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
