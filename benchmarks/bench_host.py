"""Host cost of one eager call of every public qsa_torch function, at tiny shapes.

At these shapes the kernels take a few µs of GPU time, so back-to-back calls
with no synchronisation in the timed loop measure the host path: argument
checks, planning, allocation and the launches.  Per function:

* ``public_us``: the public call (wall per call over many calls, steady shapes;
  ``torch.cuda.synchronize`` only outside the timed loop);
* ``kernel_grid_us``: its launches alone through ``kernel[grid](...)``
  (planned once, buffers allocated once);
* ``fast_us``: the same launches through ``qsa_torch._fast_launch.launch``
  (skipped when that module is absent, e.g. on an older checkout);
* ``device_us``: GPU time per call, from a CUDA graph of the public call
  (shows the GPU work is far below the host cost);
* ``launches``: kernel launches per call.

Only the public API is used for ``public_us`` (and the inputs come from one
recorded ``qsa_attention_step``), so pointing PYTHONPATH at an older checkout
gives the "before" numbers.  ``--smoke`` runs everything through Triton's
interpreter on the CPU with a few iterations: those numbers are interpreter
numbers, not host costs.
"""

from __future__ import annotations

import inspect
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FUNCTIONS = ("rope_reshape_and_cache", "compress_groups", "store_cache_rows", "mqa_paged_scores", "topk_blocks",
             "expand_block_indices", "select_paged_tokens", "sparse_paged_attention", "qsa_attention_step")
# Modules that may hold a function's plan (qsa_kernels.<module>.plan_<function>), across layouts.
STEPPED = ("rope_reshape_and_cache", "compress_groups", "store_cache_rows", "select_paged_tokens",
           "sparse_paged_attention")


def public_calls(device) -> dict:
    """Keyword arguments of one tiny call of every public function, on ``device``.

    One small decode step (3 requests, 5 rows; 4 query / 2 KV heads of 32,
    bf16, pages of 8, ratio 4, top 16 tokens) is run with a backend that
    records what the step passes to each stage; the three selection parts get
    the selection's own inputs.  The step's arguments are included as well.
    """
    import torch

    import qsa_torch
    from qsa_kernels import step
    from qsa_kernels.paging import CacheGeometry, PagedRequests

    geometry = CacheGeometry(page_size=8, num_pages=24, compress_ratio=4, compressed_page_size=8,
                             num_compressed_pages=12, max_context=64, max_requests=3)
    pager = PagedRequests(geometry)
    for request, length in enumerate((37, 50, 20)):
        pager.admit(request, length)
    host = pager.step({0: 1, 1: 3, 2: 1})
    meta = qsa_torch.StepMetadata.from_host(host, device)
    gen = torch.Generator(device).manual_seed(1)
    state = qsa_torch.QSAState(**{name: torch.randn(shape, generator=gen, device=device).to(torch.bfloat16)
                                  for name, shape in geometry.state_shapes(2, 32, 32).items()})
    rows = host.positions.shape[0]

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(torch.bfloat16)

    def table(d):
        angles = torch.arange(64, device=device)[:, None] * torch.rand(d // 2, generator=gen, device=device)
        return torch.cat([angles.cos(), angles.sin()], 1)

    step_kwargs = dict(q=rnd(rows, 4, 32), k=rnd(rows, 2, 32), v=rnd(rows, 2, 32), index_q=rnd(rows, 2, 32),
                       index_k=rnd(rows, 1, 32), state=state, metadata=meta, cos_sin=table(32),
                       index_cos_sin=table(32), compress_ratio=4, token_topk=16)
    calls = dict(stage_calls(step_kwargs))
    select = calls["select_paged_tokens"]
    ratio, topk = select["compress_ratio"], select["token_topk"]
    common = {k: select[k] for k in ("query_positions", "sequence_lengths", "token_to_req")}
    calls["mqa_paged_scores"] = dict(q=select["q"], k_cache=select["k_cache"], page_table=select["page_table"],
                                     compress_ratio=ratio, **common)
    logits, visible = qsa_torch.mqa_paged_scores(**calls["mqa_paged_scores"])
    calls["topk_blocks"] = dict(logits=logits, visible_blocks=visible, k=topk // ratio)
    blocks = qsa_torch.topk_blocks(**calls["topk_blocks"])
    calls["expand_block_indices"] = dict(block_indices=blocks, compress_ratio=ratio, token_topk=topk, **common)
    calls["qsa_attention_step"] = step_kwargs
    return {name: calls[name] for name in FUNCTIONS}


def stage_calls(step_arguments) -> list:
    """``(function, arguments)`` of each stage call one ``qsa_attention_step(**step_arguments)`` makes.

    A checkout whose step is one plan (``plan_qsa_attention_step``) gets the
    stage calls built from the step's arrays (this step's RoPE'd inputs
    aside, the same arrays the step's stages read); an older checkout, whose
    step called the public stage functions through ``_BACKEND``, records them.
    """
    import qsa_torch

    if not hasattr(qsa_torch._step, "_BACKEND"):
        a, s, m = step_arguments, step_arguments["state"], step_arguments["metadata"]
        ratio, topk = a["compress_ratio"], a["token_topk"]
        select = dict(q=a["index_q"], k_cache=s.compressed_key_cache, page_table=m.compressed_block_table,
                      token_to_req=m.token_to_req, query_positions=m.positions,
                      sequence_lengths=m.sequence_lengths, token_topk=topk, compress_ratio=ratio)
        return [
            ("rope_reshape_and_cache", dict(q=a["q"], k=a["k"], v=a["v"], key_cache=s.key_cache,
                                            value_cache=s.value_cache, slot_mapping=m.slot_mapping,
                                            positions=m.positions, cos_sin=a["cos_sin"],
                                            is_neox=a.get("is_neox", True))),
            ("compress_groups", dict(raw_keys=a["index_k"], raw_positions=m.raw_positions,
                                     compressor_state_cache=s.compressor_state_cache,
                                     compressor_state_block_table=m.compressor_state_block_table,
                                     token_to_req=m.token_to_req, query_start_loc=m.query_start_loc,
                                     logical_positions=m.positions, compressed_slots=m.compressed_slots,
                                     compress_ratio=ratio)),
            ("store_cache_rows", dict(cache=s.compressor_state_cache, slot_mapping=m.compressor_state_slots,
                                      rows=a["index_k"])),
            ("select_paged_tokens", select),
            ("sparse_paged_attention", dict(q=a["q"], k_cache=s.key_cache, v_cache=s.value_cache,
                                            token_indices=qsa_torch.select_paged_tokens(**select),
                                            block_table=m.block_table, token_to_req=m.token_to_req,
                                            softmax_scale=a.get("softmax_scale"))),
        ]

    from qsa_kernels import step

    calls = []

    def recording(name, fn):
        def wrapped(*args, **kwargs):
            bound = inspect.signature(fn).bind(*args, **kwargs)
            bound.apply_defaults()
            calls.append((name, dict(bound.arguments)))
            return fn(*args, **kwargs)
        return wrapped

    backend = qsa_torch._step._BACKEND._replace(**{n: recording(n, getattr(qsa_torch, n)) for n in STEPPED})
    step.attention_step(backend, **step_arguments)
    return calls


def step_programs(step_arguments) -> list:
    """The programs one step runs: the step's own (one plan) or, in an older checkout, its stages'."""
    try:
        from qsa_kernels.step import STATE_FIELDS, METADATA_FIELDS, plan_qsa_attention_step  # noqa: F401
    except ImportError:
        return [program_of(name, recorded) for name, recorded in stage_calls(step_arguments)]
    arguments = dict(step_arguments)
    state, metadata = arguments.pop("state"), arguments.pop("metadata")
    arguments.update({name: getattr(state, name) for name in STATE_FIELDS})
    arguments.update({name: getattr(metadata, name) for name in METADATA_FIELDS})
    return [program_of("qsa_attention_step", arguments)]


def plan_of(function: str):
    """The declared stage (called as its plan) of ``function``."""
    import qsa_kernels.api  # noqa: F401  (imports every stage's declaration)
    from qsa_kernels.stage import stage_named

    return stage_named(function)


def program_of(function: str, arguments: dict):
    """The Program the adapter runs for ``function(**arguments)``, and its arrays by name (buffers allocated)."""
    import torch

    from qsa_kernels.launch import ArrayInfo

    names = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
             torch.float64: "float64", torch.float8_e4m3fn: "float8_e4m3fn", torch.int32: "int32",
             torch.int64: "int64", torch.uint8: "uint8"}
    dtypes = {v: k for k, v in names.items()}
    stage = plan_of(function)  # a qsa_kernels.stage.Stage: called as its plan
    arrays, options = stage.split(arguments)
    infos = {k: None if v is None else ArrayInfo(tuple(v.shape), names[v.dtype], v.stride()) for k, v in arrays.items()}
    program = stage(**infos, **options)
    device = next(v.device for v in arrays.values() if v is not None)
    env = {k: v for k, v in arrays.items() if v is not None}
    for buffer in program.buffers:
        env[buffer.name] = torch.zeros(buffer.shape, dtype=dtypes[buffer.dtype], device=device)
    return program, env


def launcher_calls(program, env, launcher):
    """A function running ``program``'s launches over ``env``: through kernel[grid], or ``launcher``."""
    launches = [(launch, tuple(env[n] for n in launch.inputs + launch.outputs)) for launch in program.runnable_launches]
    if launcher is None:
        def run():
            for launch, args in launches:
                launch.kernel[launch.grid](*args, **launch.scalars, **launch.constexprs, num_warps=launch.num_warps,
                                           num_stages=launch.num_stages)
    else:
        def run():
            for launch, args in launches:
                launcher(launch.kernel, launch.grid, args, launch.scalars, launch.constexprs, launch.num_warps,
                         launch.num_stages)
    return run


def host_us(fn, calls: int, repeats: int, sync) -> float:
    """Median over ``repeats`` of the wall µs per call of ``calls`` back-to-back calls (sync outside)."""
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) * 1e6 / calls)
        sync()
    return statistics.median(times)


def main(argv=None) -> None:
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import common

    if os.environ.get("QSA_BENCH_BEFORE"):  # a --before child: the packages come from PYTHONPATH only
        while ROOT in sys.path:  # (common puts this checkout first)
            sys.path.remove(ROOT)

    p = common.parser(__doc__.splitlines()[0], "host.json")
    p.add_argument("--before", metavar="CHECKOUT",
                   help="also run this script against another checkout (PYTHONPATH=CHECKOUT:CHECKOUT/.pypath) "
                        "first, and put its public_us and kernel_grid_us beside ours as before_*")
    args = p.parse_args(argv)
    before = _run_before(args.before, args.smoke) if args.before else None
    import torch

    import qsa_torch
    from qsa_kernels import runtime

    try:
        from qsa_torch._fast_launch import launch as fast_launch
    except ImportError:
        fast_launch = None
    interpreted = runtime.INTERPRETED
    device = torch.device("cpu" if interpreted else "cuda")
    smoke = args.smoke or interpreted
    calls, repeats = (3, 1) if smoke else (2000, 7)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    guard = runtime.interpreter_lock if interpreted else torch.cuda.device(device)

    rows, notes = [], []
    if interpreted:
        notes.append("CPU run through Triton's interpreter: these are interpreter numbers, not host costs")
        print("NOTE:", notes[-1])
    if fast_launch is None:
        notes.append("qsa_torch._fast_launch not found (older checkout): fast_us skipped")
    with guard:
        inputs = public_calls(device)
        for function, arguments in inputs.items():
            fn = getattr(qsa_torch, function)
            row = dict(function=function, public_us=host_us(lambda: fn(**arguments), calls, repeats, sync))
            if function == "qsa_attention_step":
                programs = step_programs(arguments)
            else:
                programs = [program_of(function, arguments)]
            row["launches"] = sum(len(p.runnable_launches) for p, _ in programs)
            grid_runs = [launcher_calls(p, env, None) for p, env in programs]
            row["kernel_grid_us"] = host_us(lambda: [r() for r in grid_runs], calls, repeats, sync)
            if fast_launch is not None:
                fast_runs = [launcher_calls(p, env, fast_launch) for p, env in programs]
                row["fast_us"] = host_us(lambda: [r() for r in fast_runs], calls, repeats, sync)
            if not interpreted:
                row["device_us"] = common.torch_graph_us(lambda: fn(**arguments), calls=10, smoke=smoke)
            rows.append(row)
            print(f"  {function}: done", flush=True)
    columns = ["function", "launches", "public_us", "kernel_grid_us", "fast_us", "device_us"]
    if before is not None:
        by_name = {row["function"]: row for row in before["rows"]}
        for row in rows:
            old = by_name.get(row["function"], {})
            row["before_public_us"] = old.get("public_us")
            row["before_kernel_grid_us"] = old.get("kernel_grid_us")
        notes.append(f"before_*: the same script against {os.path.abspath(args.before)}")
        columns[2:2] = ["before_public_us"]
    common.print_table(rows, columns)
    if interpreted:
        print("(interpreter numbers: the CPU runs every kernel through Triton's interpreter)")
    common.write_json(args.json, "host", rows, notes)


def _run_before(checkout: str, smoke: bool) -> dict:
    """This script's results against another checkout, from a child process."""
    import json
    import subprocess
    import tempfile

    checkout = os.path.abspath(checkout)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "before.json")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([checkout, os.path.join(checkout, ".pypath")]),
                   QSA_BENCH_BEFORE="1")
        command = [sys.executable, os.path.abspath(__file__), "--json", out] + (["--smoke"] if smoke else [])
        print(f"before: {' '.join(command)} with PYTHONPATH={env['PYTHONPATH']}", flush=True)
        subprocess.run(command, env=env, check=True)
        with open(out) as f:
            return json.load(f)


if __name__ == "__main__":
    main()
