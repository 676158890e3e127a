"""Tensor parallelism on the CPU: JAX over 2 host devices, torch over 2 gloo processes.

Every check compares a sharded run with the same framework on one device, bit
for bit:

* ``qsa_attention_step`` split by KV heads (their query heads with them; the
  index caches and the metadata replicated), two steps (prefill chunks, then
  decode rows) over random caches: output, every cache and the selected tokens;
* JAX: ``qsa_attention_step`` split by requests, each device with its own
  pager and caches (stacked on a leading device axis);
* ``sparse_paged_attention`` split by KV heads, and split by rows;
* the demo model (``examples/tensor_parallel.py``): heads split, the output
  projection's all-reduce, greedy tokens and logits;
* the examples of ``docs/scaling-out.md`` run (and shard what they say);
* JAX only: a call whose arrays span several devices under plain ``jax.jit``
  (``NamedSharding`` inputs) or eagerly raises the error that points to
  ``shard_map`` (``qsa_jax._sharding``), while the same call inside
  ``shard_map`` and on one device works.

The JAX checks need a process whose jax starts with 2 host devices, and the
torch checks 2 processes: each framework's checks run in one subprocess
(``python -m tests.test_sharding jax|torch``) that prints one JSON line of
check -> "ok" or the failure; each test reads its entry.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
TIMEOUT_S = 900  # per framework, for hangs: the checks take about 30 s of CPU each (2 cores shared: minutes)
PARTS = 2

# One QSA layer: 4 Q / 2 KV heads x d32, indexer 2 heads x d32, ratio 4, top 8 tokens + tail.
QH, KH, D, IH, DI, RATIO, TOPK = 4, 2, 32, 2, 32, 4, 8
SCHEDULE = [{0: 6, 1: 5}, {0: 1, 1: 1}]  # prefill chunks, then one decode row each


def _geometry():
    from qsa_kernels.paging import CacheGeometry

    return CacheGeometry(page_size=4, num_pages=12, compress_ratio=RATIO, compressed_page_size=2,
                         num_compressed_pages=8, max_context=16, max_requests=2)


def _numpy_case(seed: int = 7, schedules=SCHEDULE):
    """Random caches, per-step inputs and host metadata of the steps (NumPy float32 / int32)."""
    from qsa_kernels.paging import PagedRequests

    rng = np.random.default_rng(seed)
    geometry = _geometry()
    shapes = geometry.state_shapes(KH, D, DI)
    state = {name: rng.normal(size=shape).astype(np.float32) for name, shape in shapes.items()}
    pager = PagedRequests(geometry, seed=seed)
    steps = []
    for schedule in schedules:
        meta = pager.step(schedule)
        rows = meta.num_rows
        inputs = dict(q=(rows, QH, D), k=(rows, KH, D), v=(rows, KH, D), index_q=(rows, IH, DI), index_k=(rows, 1, DI))
        steps.append(({name: rng.normal(size=s).astype(np.float32) for name, s in inputs.items()}, meta))
    positions = 32
    angles = np.arange(positions)[:, None] * rng.uniform(0.01, 1.0, size=D // 2)
    cos_sin = np.concatenate([np.cos(angles), np.sin(angles)], 1).astype(np.float32)
    return state, steps, cos_sin


def _attention_case(seed: int = 11):
    """Inputs of one sparse_paged_attention call: 6 rows of 2 requests, 4 Q / 2 KV heads, pages of 4."""
    rng = np.random.default_rng(seed)
    rows, pages, page, width = 6, 10, 4, 9
    return dict(
        q=rng.normal(size=(rows, QH, D)).astype(np.float32),
        k_cache=rng.normal(size=(pages, page, KH, D)).astype(np.float32),
        v_cache=rng.normal(size=(pages, page, KH, D)).astype(np.float32),
        token_indices=np.where(rng.random((rows, width)) < 0.2, -1, rng.integers(0, 16, (rows, width))).astype(np.int32),
        block_table=rng.permutation(pages)[:8].reshape(2, 4).astype(np.int32),
        token_to_req=np.array([0, 0, 0, 1, 1, 1], np.int32),
    )


def _tiny_scenario():
    sys.path.insert(0, EXAMPLES)
    import tensor_parallel

    return tensor_parallel, tensor_parallel.small_scenario(prompt_lengths=(7, 3), new_tokens=(3, 2), chunk=4)


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(f"u{a.dtype.itemsize}")


def _same(name: str, a, b) -> None:
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        raise AssertionError(f"{name}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}")
    mismatch = np.count_nonzero(_bits(a) != _bits(b))
    if mismatch:
        raise AssertionError(f"{name}: {mismatch} of {a.size} elements differ bitwise")


def _docs_example(index: int) -> str:
    """The ``index``-th Python block of docs/scaling-out.md (0: JAX, 1: torch)."""
    text = open(os.path.join(ROOT, "docs", "scaling-out.md")).read()
    return text.split("```python\n")[index + 1].split("```")[0]


def _run_checks(checks: dict) -> dict:
    results = {}
    for name, check in checks.items():
        try:
            check()
            results[name] = "ok"
        except BaseException:  # reported, not raised: the other checks still run
            results[name] = traceback.format_exc(limit=6)
    return results


# --------------------------------------------------------------------------
# JAX: one process, 2 host devices (run as ``python -m tests.test_sharding jax``)
# --------------------------------------------------------------------------

def _jax_checks() -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import qsa_jax
    from qsa_kernels.paging import METADATA_FIELDS, STATE_FIELDS

    assert len(jax.devices()) == PARTS, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("x",))
    bf16 = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    heads = P(None, "x", None)  # [T, heads, D]
    cache_heads = P(None, None, "x", None)  # [pages, P, KH, D]
    state_spec = qsa_jax.QSAState(key_cache=cache_heads, value_cache=cache_heads, compressor_state_cache=P(),
                                  compressed_key_cache=P())
    meta_spec = qsa_jax.StepMetadata(**{name: P() for name in METADATA_FIELDS})

    def step_split_by_kv_heads():
        state, steps, cos_sin = _numpy_case()
        table = jnp.asarray(cos_sin)

        def step(inputs, state, meta):
            return qsa_jax.qsa_attention_step(**inputs, state=state, metadata=meta, cos_sin=table,
                                              index_cos_sin=table, compress_ratio=RATIO, token_topk=TOPK,
                                              return_token_indices=True)

        inputs_spec = dict(q=heads, k=heads, v=heads, index_q=P(), index_k=P())
        sharded = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(inputs_spec, state_spec, meta_spec),
                                        out_specs=(heads, state_spec, P())))
        single = jax.jit(step)
        one = many = qsa_jax.QSAState(**{name: bf16(state[name]) for name in STATE_FIELDS})
        for number, (inputs, host_meta) in enumerate(steps):
            inputs = {name: bf16(x) for name, x in inputs.items()}
            meta = qsa_jax.StepMetadata.from_host(host_meta)
            out_one, one, picked_one = single(inputs, one, meta)
            out_many, many, picked_many = sharded(inputs, many, meta)
            _same(f"step {number}: out", out_one, out_many)
            _same(f"step {number}: token_indices", picked_one, picked_many)
            for name in STATE_FIELDS:
                _same(f"step {number}: state.{name}", getattr(one, name), getattr(many, name))
            assert out_many.sharding.is_equivalent_to(NamedSharding(mesh, heads), 3), out_many.sharding  # no gather

    def step_split_by_requests():
        # Each device its own requests, pager and caches (stacked on a leading device axis): the same as
        # running each device's batch alone.  Equal row and request counts keep the shapes equal.
        cases = [_numpy_case(seed=20, schedules=[{0: 6, 1: 5}, {0: 1, 1: 1}]),
                 _numpy_case(seed=21, schedules=[{0: 4, 1: 7}, {0: 1, 1: 1}])]
        table = jnp.asarray(cases[0][2])

        def step(inputs, state, meta):
            return qsa_jax.qsa_attention_step(**inputs, state=state, metadata=meta, cos_sin=table,
                                              index_cos_sin=table, compress_ratio=RATIO, token_topk=TOPK,
                                              return_token_indices=True)

        first, stack = (lambda tree: jax.tree_util.tree_map(lambda x: x[0], tree),  # noqa: E731
                        lambda trees: jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *trees))
        sharded = jax.jit(jax.shard_map(
            lambda i, s, m: jax.tree_util.tree_map(lambda x: x[None], step(first(i), first(s), first(m))),
            mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        single = jax.jit(step)
        alone = [qsa_jax.QSAState(**{name: bf16(state[name]) for name in STATE_FIELDS}) for state, _, _ in cases]
        together = stack(alone)
        for number in range(2):
            inputs = [{name: bf16(x) for name, x in case[1][number][0].items()} for case in cases]
            metas = [qsa_jax.StepMetadata.from_host(case[1][number][1]) for case in cases]
            out, together, picked = sharded(stack(inputs), together, stack(metas))
            for device in range(PARTS):
                out_one, alone[device], picked_one = single(inputs[device], alone[device], metas[device])
                _same(f"step {number}, device {device}: out", out_one, out[device])
                _same(f"step {number}, device {device}: token_indices", picked_one, picked[device])
                for name in STATE_FIELDS:
                    _same(f"step {number}, device {device}: state.{name}", getattr(alone[device], name),
                          getattr(together, name)[device])

    case = _attention_case()

    def attention(**split):
        arrays = {name: (bf16(x) if x.dtype == np.float32 else jnp.asarray(x)) for name, x in case.items()}
        single = jax.jit(qsa_jax.sparse_paged_attention)(**arrays)
        specs = {name: split.get(name, P()) for name in arrays}
        sharded = jax.jit(jax.shard_map(lambda a: qsa_jax.sparse_paged_attention(**a), mesh=mesh,
                                        in_specs=(specs,), out_specs=specs["q"]))(arrays)
        _same("out", single, sharded)

    def attention_split_by_kv_heads():
        attention(q=heads, k_cache=cache_heads, v_cache=cache_heads)

    def attention_split_by_rows():
        # token_to_req keeps indexing the whole (replicated) block table.
        attention(q=P("x", None, None), token_indices=P("x", None), token_to_req=P("x"))

    def model_split_by_kv_heads():
        tensor_parallel, scenario = _tiny_scenario()
        one, many = tensor_parallel.run_jax(scenario, 1), tensor_parallel.run_jax(scenario, PARTS)
        assert one.generated == many.generated, (one.generated, many.generated)
        assert all(len(g) == n for g, n in zip(many.generated, scenario.new_tokens))
        assert len(one.logits) == len(many.logits)
        for number, (a, b) in enumerate(zip(one.logits, many.logits)):
            _same(f"step {number}: logits", a, b)
        assert many.traces == one.traces, (one.traces, many.traces)  # one trace per batch shape in both

    def jit_over_named_sharding_raises():
        arrays = {name: (bf16(x) if x.dtype == np.float32 else jnp.asarray(x)) for name, x in case.items()}
        put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
        replicated = {name: put(x, P()) for name, x in arrays.items()}
        split = dict(replicated, q=put(arrays["q"], heads), k_cache=put(arrays["k_cache"], cache_heads),
                     v_cache=put(arrays["v_cache"], cache_heads))
        for label, inputs, call in (
                ("jit, heads split", split, jax.jit(lambda a: qsa_jax.sparse_paged_attention(**a))),
                ("jit, replicated on 2 devices", replicated, jax.jit(lambda a: qsa_jax.sparse_paged_attention(**a))),
                ("eager, heads split", split, lambda a: qsa_jax.sparse_paged_attention(**a))):
            try:
                call(inputs)
            except ValueError as error:
                message = str(error)
                assert message.startswith("sparse_paged_attention: its arrays span 2 devices outside "
                                          "jax.shard_map"), f"{label}: {message}"
                assert "docs/scaling-out.md" in message, message
            else:
                raise AssertionError(f"{label}: no error")
        # The same arrays on one device, and the composed step under jit (every stage guarded), still work.
        jax.block_until_ready(jax.jit(lambda a: qsa_jax.sparse_paged_attention(**a))(arrays))

    def docs_example():
        namespace: dict = {}
        exec(compile(_docs_example(0), "docs/scaling-out.md (JAX)", "exec"), namespace)
        projected, state = namespace["projected"], namespace["state"]
        assert projected.shape == (namespace["T"], namespace["HIDDEN"])
        assert projected.sharding.is_fully_replicated  # after the psum
        assert state.key_cache.sharding.is_equivalent_to(NamedSharding(namespace["mesh"], namespace["cache_heads"]), 4)
        assert state.compressed_key_cache.sharding.is_fully_replicated

    return _run_checks(dict(
        docs_example=docs_example,
        step_split_by_kv_heads=step_split_by_kv_heads,
        step_split_by_requests=step_split_by_requests,
        attention_split_by_kv_heads=attention_split_by_kv_heads,
        attention_split_by_rows=attention_split_by_rows,
        model_split_by_kv_heads=model_split_by_kv_heads,
        jit_over_named_sharding_raises=jit_over_named_sharding_raises,
    ))


# --------------------------------------------------------------------------
# torch: 2 gloo processes (run as ``python -m tests.test_sharding torch``)
# --------------------------------------------------------------------------

def _torch_step_shards(rank: int, parts: int, results: dict) -> None:
    """Each rank: its KV heads' step and its share of sparse_paged_attention; rank 0 compares the gathered shards."""
    import torch
    import torch.distributed as dist

    import qsa_torch
    from qsa_kernels.paging import STATE_FIELDS

    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    bf16 = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device, torch.bfloat16)  # noqa: E731
    keep = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    bits = lambda t: t.view(torch.uint16).cpu().numpy()  # noqa: E731

    def gathered(x: torch.Tensor, dim: int) -> torch.Tensor:
        pieces = [torch.empty_like(x) for _ in range(parts)]
        dist.all_gather(pieces, x.contiguous())
        return torch.cat(pieces, dim)

    def mine(x: np.ndarray, dim: int) -> np.ndarray:
        size = x.shape[dim] // parts
        return np.take(x, range(rank * size, (rank + 1) * size), axis=dim)

    def step_split_by_kv_heads():
        state, steps, cos_sin = _numpy_case()
        table = keep(cos_sin)

        def run(inputs, state, host_meta):
            return qsa_torch.qsa_attention_step(**inputs, state=state,
                                                metadata=qsa_torch.StepMetadata.from_host(host_meta, device),
                                                cos_sin=table, index_cos_sin=table, compress_ratio=RATIO,
                                                token_topk=TOPK, return_token_indices=True)

        split_dim = dict(key_cache=2, value_cache=2)
        one = qsa_torch.QSAState(**{name: bf16(state[name]) for name in STATE_FIELDS})
        part = qsa_torch.QSAState(**{name: bf16(mine(state[name], split_dim[name]) if name in split_dim
                                                else state[name]) for name in STATE_FIELDS})
        for number, (inputs, host_meta) in enumerate(steps):
            local = {name: bf16(mine(x, 1) if name in ("q", "k", "v") else x) for name, x in inputs.items()}
            out_part, part, picked_part = run(local, part, host_meta)
            out_all = gathered(out_part, 1)
            caches = {name: gathered(getattr(part, name), split_dim[name]) if name in split_dim
                      else getattr(part, name) for name in STATE_FIELDS}
            if rank == 0:
                out_one, one, picked_one = run({name: bf16(x) for name, x in inputs.items()}, one, host_meta)
                _same(f"step {number}: out", bits(out_one), bits(out_all))
                _same(f"step {number}: token_indices", picked_one.cpu().numpy(), picked_part.cpu().numpy())
                for name in STATE_FIELDS:
                    _same(f"step {number}: state.{name}", bits(getattr(one, name)), bits(caches[name]))

    case = _attention_case()

    def attention(split: dict, out_dim: int):
        convert = lambda x: bf16(x) if x.dtype == np.float32 else keep(x)  # noqa: E731
        arrays = {name: convert(x) for name, x in case.items()}
        local = {name: convert(mine(x, split[name])) if name in split else arrays[name] for name, x in case.items()}
        out = gathered(qsa_torch.sparse_paged_attention(**local), out_dim)
        if rank == 0:
            _same("out", bits(qsa_torch.sparse_paged_attention(**arrays)), bits(out))

    def attention_split_by_kv_heads():
        attention(dict(q=1, k_cache=2, v_cache=2), 1)

    def attention_split_by_rows():
        attention(dict(q=0, token_indices=0, token_to_req=0), 0)

    def model_split_by_kv_heads():
        # examples/tensor_parallel.py's torch path, in this process group: rank 0 also runs one device.
        tensor_parallel, scenario = _tiny_scenario()
        one = tensor_parallel.run_torch(scenario, 1, inline=True) if rank == 0 else None
        many = tensor_parallel._torch_generate(scenario, rank, parts, device, graphs=False)
        if rank == 0:
            assert one.generated == many.generated, (one.generated, many.generated)
            assert all(len(g) == n for g, n in zip(many.generated, scenario.new_tokens))
            assert len(one.logits) == len(many.logits)
            for number, (a, b) in enumerate(zip(one.logits, many.logits)):
                _same(f"step {number}: logits", a, b)

    outcome = _run_checks(dict(step_split_by_kv_heads=step_split_by_kv_heads,
                               attention_split_by_kv_heads=attention_split_by_kv_heads,
                               attention_split_by_rows=attention_split_by_rows,
                               model_split_by_kv_heads=model_split_by_kv_heads))
    results.update(outcome)


def _torch_worker(rank: int, parts: int, port: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if torch.cuda.is_available():  # the GPU run of the suite: one GPU per process, NCCL
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=parts, device_id=torch.device("cuda", rank))
    else:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=parts)
    results: dict = {}
    try:
        _torch_step_shards(rank, parts, results)
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.barrier()  # both ranks reach the teardown before either closes its connections
        dist.destroy_process_group()
    # The results are written.  Leave without the interpreter's teardown: there,
    # under CI load, a rank died of a C++ thread still joinable (SIGABRT,
    # "terminate called without an active exception") after writing its results.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _torch_checks() -> dict:
    import socket
    import tempfile

    import torch.multiprocessing as mp

    results = {}
    with tempfile.TemporaryDirectory() as out_dir:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            mp.start_processes(_torch_worker, args=(PARTS, port, out_dir), nprocs=PARTS, start_method="spawn")
        except Exception:
            results["processes"] = traceback.format_exc(limit=4)
        for rank in range(PARTS):
            path = os.path.join(out_dir, f"rank{rank}.json")
            if not os.path.exists(path):
                results[f"rank {rank}"] = "wrote no results"
                continue
            with open(path) as f:
                for name, outcome in json.load(f).items():
                    if outcome != "ok" or name not in results:
                        results[name] = outcome if outcome == "ok" else f"rank {rank}: {outcome}"

    def docs_example():
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "scaling_out_torch.py")
            with open(path, "w") as f:
                f.write(_docs_example(1))
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                # The example is written for the CPU (gloo, CPU tensors): hide any GPU from it.
                env = dict(os.environ, MASTER_PORT=str(s.getsockname()[1]), CUDA_VISIBLE_DEVICES="")
            done = subprocess.run([sys.executable, path], capture_output=True, text=True, timeout=TIMEOUT_S / 3,
                                  env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "torch.Size([8, 64]) torch.Size([8, 8, 1, 32])" in done.stdout, done.stdout

    results.update(_run_checks(dict(docs_example=docs_example)))
    return results


# --------------------------------------------------------------------------
# The tests: one subprocess per framework, one test per check
# --------------------------------------------------------------------------

_OUTCOMES: dict = {}
_STDERR: dict = {}  # the checks subprocess's stderr tail (its workers' too: a crash's message lands there)


def _outcomes(framework: str) -> dict:
    if framework not in _OUTCOMES:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={PARTS}".strip()
        try:
            done = subprocess.run([sys.executable, "-m", "tests.test_sharding", framework], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired as error:
            _OUTCOMES[framework] = f"timed out after {TIMEOUT_S} s; output:\n{error.stdout}\n{error.stderr}"
            return _OUTCOMES[framework]
        _STDERR[framework] = done.stderr[-3000:]
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        _OUTCOMES[framework] = (json.loads(lines[-1]) if done.returncode == 0 and lines else
                                f"exit {done.returncode}; stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}")
    return _OUTCOMES[framework]


def _check(framework: str, name: str) -> None:
    outcomes = _outcomes(framework)
    if isinstance(outcomes, str):
        pytest.fail(f"{framework} checks did not run: {outcomes}")
    failures = {k: v for k, v in outcomes.items() if v != "ok" and (k == name or k not in _KNOWN[framework])}
    assert name in outcomes, f"{framework}: check {name} did not run: {outcomes}"
    assert not failures, "\n".join([*(f"{k}: {v}" for k, v in failures.items()),
                                    f"stderr of the checks' processes:\n{_STDERR.get(framework, '')}"])


_KNOWN = {
    "jax": ("docs_example", "step_split_by_kv_heads", "step_split_by_requests", "attention_split_by_kv_heads", "attention_split_by_rows",
            "model_split_by_kv_heads", "jit_over_named_sharding_raises"),
    "torch": ("step_split_by_kv_heads", "attention_split_by_kv_heads", "attention_split_by_rows",
              "model_split_by_kv_heads", "docs_example"),
}


def _need_two_devices():
    from qsa_kernels import runtime

    if not runtime.INTERPRETED:
        import torch

        if torch.cuda.device_count() < PARTS:
            pytest.skip(f"a compiled (GPU) process needs {PARTS} GPUs for these checks")


@pytest.mark.parametrize("name", _KNOWN["jax"])
def test_jax_two_host_devices(name):
    """On the CPU 2 host devices; in the GPU run of the suite, 2 GPUs (jax-triton under shard_map)."""
    _need_two_devices()
    _check("jax", name)


@pytest.mark.parametrize("name", _KNOWN["torch"])
def test_torch_two_gloo_processes(name):
    """On the CPU 2 gloo processes; in the GPU run of the suite, 2 NCCL processes on 2 GPUs."""
    _need_two_devices()
    _check("torch", name)


def test_single_device_lowering_unchanged():
    """The guard adds nothing to a one-device program: no custom call, no extra op around the callback."""
    import jax
    import jax.numpy as jnp

    import qsa_jax

    case = _attention_case()
    arrays = {name: (jnp.asarray(x, jnp.bfloat16) if x.dtype == np.float32 else jnp.asarray(x))
              for name, x in case.items()}
    text = jax.jit(lambda a: qsa_jax.sparse_paged_attention(**a)).lower(arrays).as_text()
    assert "qsa_single_device_guard" not in text
    assert "CustomSPMDPartitioning" not in text


if __name__ == "__main__":
    framework = sys.argv[1]
    print(json.dumps(_jax_checks() if framework == "jax" else _torch_checks()), flush=True)
