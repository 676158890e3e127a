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

``--payload`` measures instead what a launch's call proto costs (docs/design.md,
"JAX call overhead"), in one process:

* ``sweep``: the same chain with each launch's PTX padded by N bytes of comment
  lines of random letters (``--pad-kb``; the kernel is unchanged, its payload
  grows by about 3/4 of N after compression): wall µs per kernel against
  payload bytes per launch, per lowering; then (``sweep_repeated``) the same
  with one comment line repeated, which compresses ~100-fold: where the cost
  follows the PTX's own size rather than the compressed payload's, these rows
  grow as the first ones do for the same N;
* ``step``: the step as above with each PTX form (``qsa_jax._lowering.ptx_form``:
  ``"full"``, Triton's PTX, and ``"minified"``, the default), per lowering and batch.

    python benchmarks/bench_jax_calls.py --payload --batches 1 8 --json benchmarks/results/h200/jax_calls_payload.json

``--arguments`` measures what a launch's argument count costs, in one process:
the same chain with each launch given N more input buffers (distinct arrays,
each read once by the kernel) or N more int scalars (``--extra``), wall µs per
kernel against N, per lowering, with a least-squares slope per argument.  The
step's launches take 5-32 buffers and up to ~50 scalars each.

``--host-profile`` shows where the host's time goes, in one process: the
chain's loop, then per lowering and batch (``--batches``) the step's 10-step
loop and its one-step call, with the previous call's output alive and freed
first, each run once after warm-up under ``jax.profiler.trace`` (XLA's and
jaxlib's own annotations of their host work and, through CUPTI, the driver
calls).  Per thread line: every event name's count, inclusive and self time
(less the events nested in it) per execution, and the first events in order,
so the gaps between launches can be read.  ``scripts/jax_flag_profiles.sh``
runs it under each XLA command-buffer setting.

``--fused-merge on|off`` forces the attention's split-K merge into its launch
(three launches a 1-8 request step) or into a merge launch
(``AttentionTuning.fused_merge``), and records it on every row.
"""

from __future__ import annotations

import collections
import contextlib
import os
import random
import re
import string
import statistics
import time
import warnings

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import common  # noqa: E402

CHAIN = 12
CHAIN_ELEMENTS = 1024
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


_WIDE_KERNELS: dict = {}


def wide_kernel(buffers: int, scalars: int):
    """The chain's kernel with ``buffers`` more input pointers and ``scalars`` more int arguments, each
    read once and added times zero (the output is unchanged).  Written to a file and imported:
    ``triton.jit`` reads its function's source."""
    import importlib.util
    import tempfile

    if not buffers and not scalars:
        return chain_kernel()
    if (buffers, scalars) in _WIDE_KERNELS:
        return _WIDE_KERNELS[buffers, scalars]
    pointers = "".join(f"    e{i}_ptr,  # [1] float32\n" for i in range(buffers))
    ints = "".join(f"    s{i},\n" for i in range(scalars))
    reads = " + ".join([f"tl.load(e{i}_ptr)" for i in range(buffers)] + [f"s{i}" for i in range(scalars)])
    source = (f"import triton\nimport triton.language as tl\n\n\n@triton.jit\ndef wide_add_one_kernel(\n"
              f"    x_ptr,  # [N] float32\n{pointers}    o_ptr,  # [N] float32\n{ints}"
              f"    N: tl.constexpr, BLOCK: tl.constexpr,\n):\n"
              f"    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)\n    mask = offsets < N\n"
              f"    extra = ({reads}) * 0.0\n"
              f"    tl.store(o_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + 1.0 + extra, mask=mask)\n")
    path = os.path.join(tempfile.mkdtemp(prefix="qsa_wide_"), f"wide_{buffers}_{scalars}.py")
    with open(path, "w") as file:
        file.write(source)
    spec = importlib.util.spec_from_file_location(f"qsa_wide_{buffers}_{scalars}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kernel = _WIDE_KERNELS[buffers, scalars] = module.wide_add_one_kernel
    return kernel


@contextlib.contextmanager
def padded_ptx(extra: int, repeated: bool = False):
    """Launches lowered inside the block carry their minified PTX followed by ``extra`` bytes of
    comment lines of random letters (``repeated``: one such line again and again): ptxas skips them
    (the kernel is the same), only the payload grows."""
    from qsa_jax import _lowering as _triton_call

    if not extra:
        yield
        return
    rng = random.Random(extra)
    count = -(-extra // 101)
    lines = ["//" + "".join(rng.choices(string.ascii_letters + string.digits, k=98)) for _ in range(1 if repeated else count)]
    lines *= count if repeated else 1
    pad, real = "\n".join(lines) + "\n", _triton_call._proto.minify_ptx
    _triton_call._proto.minify_ptx = lambda ptx: real(ptx) + pad
    try:
        yield
    finally:
        _triton_call._proto.minify_ptx = real


def payload_bytes(lowered) -> tuple[int, int]:
    """``(launches, compressed call-proto bytes of them all)`` in ``lowered``'s StableHLO."""
    from jax.extend.mlir import ir

    from qsa_jax import _lowering as _triton_call

    sizes = [len(_triton_call._proto.payload(op, ir)) for op in _triton_call._proto.custom_calls(lowered)]
    return len(sizes), sum(sizes)


def chain_function(buffers: int = 0, scalars: int = 0):
    """``chain(x, *others)``: ``CHAIN`` launches of :func:`wide_kernel`, each adding one to the
    previous one's output (``others``: the ``buffers`` extra inputs)."""
    from qsa_jax import _binding
    from qsa_kernels.launch import Buffer, Launch, Program

    n = CHAIN_ELEMENTS
    extras = tuple(f"e{i}" for i in range(buffers))
    program = Program("chain", (Buffer("y", (n,), "float32"),),
                      (Launch(wide_kernel(buffers, scalars), (1,), ("x", *extras), ("y",),
                              scalars={f"s{i}": 3 for i in range(scalars)},
                              constexprs=dict(N=n, BLOCK=n), num_warps=1),),
                      ("y",))

    def chain(x, *others):
        for _ in range(CHAIN):
            (x,) = _binding._run_compiled(program, ["x", *extras], [x, *others])
        return x

    return chain


def chain_us(lowering: str, pad: int | None = None, buffers: int = 0, scalars: int = 0,
             repeated: bool = False) -> dict:
    """The chain; ``pad``: bytes of comment appended to each launch's PTX (:func:`padded_ptx`, with
    ``repeated``);
    ``buffers``, ``scalars``: more arguments per launch (:func:`wide_kernel`).  The sweeps' rows
    (``pad`` given): wall only, no trace."""
    import jax
    import jax.numpy as jnp

    import qsa_jax

    n = CHAIN_ELEMENTS
    chain = chain_function(buffers, scalars)
    with qsa_jax.use_triton_lowering(lowering), padded_ptx(pad or 0, repeated):
        looped = jax.jit(lambda x, *others: jax.lax.fori_loop(0, LOOP, lambda i, x: chain(x, *others), x,
                                                              unroll=True))
        x = jnp.zeros((n,), jnp.float32)
        others = [jnp.zeros((1,), jnp.float32) + i for i in range(buffers)]  # distinct buffers
        lowered = looped.lower(x, *others)
        launches, payload = payload_bytes(lowered)
        hlo = lowered.compile().as_text() if pad is None else ""
        out = jax.block_until_ready(looped(x, *others))  # traced and compiled here, in the block: cached
    assert float(out[0]) == CHAIN * LOOP, out[0]
    times = []
    for _ in range(20):
        start = time.perf_counter()
        jax.block_until_ready(looped(x, *others))
        times.append((time.perf_counter() - start) * 1e6)
    per_loop = statistics.median(times)
    row = dict(lowering=lowering, us_per_kernel=per_loop / (CHAIN * LOOP), us_per_chain=per_loop / LOOP,
               payload_bytes_per_launch=payload / max(launches, 1))
    if pad is not None:
        return dict(row, pad_bytes=pad, pad_repeated=repeated, extra_buffers=buffers, extra_scalars=scalars)
    trace = common.gpu_trace(lambda: jax.block_until_ready(looped(x)), CHAIN * LOOP) or {}
    return dict(row, gpu_busy_us_per_kernel=trace.get("busy_us"), gpu_span_us_per_kernel=trace.get("device_us"),
                **hlo_counts(hlo))


def hlo_counts(hlo: str) -> dict:
    """Ops of XLA's optimised HLO (the whole module) besides the kernels' own work: custom calls by
    target, copies and fusions.  (Command buffers are formed after HLO, from the thunks: see the
    thunk dump, as tests/test_step.py reads it.)"""
    targets = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', hlo))
    return dict(custom_calls=dict(targets), copies=len(re.findall(r"\bcopy(-start)?\(", hlo)),
                fusions=len(re.findall(r"\bfusion\(", hlo)))


def step_trace(lowering: str, batch: int, context: int, ptx: str = "minified") -> dict:
    import jax
    import torch

    import bench_step
    import qsa_jax
    from qsa_jax import _lowering as _triton_call
    from qsa_kernels import tuning

    shape = bench_step.Shape(bench_step.PRODUCTION, batch, context, torch.device("cuda"))
    inputs, state, meta, tables = bench_step.jax_arrays(shape)
    step, loop = bench_step.jax_step_and_loop(shape, LOOP)

    with qsa_jax.use_triton_lowering(lowering), _triton_call.ptx_form(ptx), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        looped = jax.jit(loop, donate_argnums=1)
        lowered = looped.lower(inputs, state, meta, *tables)
        launches, payload = payload_bytes(lowered)
        hlo = lowered.compile().as_text()
        _, state = jax.block_until_ready(looped(inputs, state, meta, *tables))
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
    row = dict(lowering=lowering, ptx=ptx, batch=batch, context=context,
               fused_merge=tuning.current().attention.fused_merge, opaque_text_kb_per_step=opaque / 1e3,
               payload_bytes_per_step=payload / LOOP, launches_per_step=launches / LOOP,
               loop_us_per_step=statistics.median(times), loop_us_outputs_freed=statistics.median(dropped),
               wall_us_per_call=statistics.median(wall),
               **trace, **hlo_counts(hlo))
    del shape
    torch.cuda.empty_cache()
    return row


def main():
    p = common.parser(__doc__, "jax_calls.json")
    p.add_argument("--batches", type=int, nargs="*", default=None, help="default: 1 64 (--payload: 1 8)")
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--payload", action="store_true", help="the payload sweep and the step per PTX form")
    p.add_argument("--pad-kb", type=int, nargs="*", default=[0, 8, 32, 128, 256],
                   help="--payload: KB of comment appended to each chain launch's PTX")
    p.add_argument("--arguments", action="store_true", help="the per-argument sweep (buffers, then scalars)")
    p.add_argument("--extra", type=int, nargs="*", default=[0, 8, 24, 48],
                   help="--arguments: more buffers (and, separately, more scalars) per launch")
    p.add_argument("--host-profile", action="store_true",
                   help="the chain's and the step's loop under jax.profiler: host events per thread")
    p.add_argument("--budget-s", type=float, default=110.0,
                   help="--payload: start no step measurement past this many seconds of them")
    p.add_argument("--fused-merge", choices=("default", "on", "off"), default="default",
                   help="the step's attention merged in its launch (AttentionTuning.fused_merge forced on), "
                        "by a merge launch (off), or as the plans choose")
    args = p.parse_args()
    if args.fused_merge == "default":
        return dispatch(args)
    from qsa_kernels import tuning

    with tuning.override(attention=common.fused_merge_attention(args.fused_merge == "on")):
        return dispatch(args)


def dispatch(args) -> None:
    import qsa_jax

    lowerings = ["legacy"] + (["ffi"] if qsa_jax.triton_lowering_available("ffi") else [])
    flags = os.environ.get("XLA_FLAGS", "")
    if args.payload:
        return payload_main(args, lowerings, flags)
    if args.arguments:
        return arguments_main(args, lowerings, flags)
    if args.host_profile:
        return host_profile_main(args, lowerings, flags)
    rows = []
    for lowering in lowerings:
        row = dict(kind="chain", xla_flags=flags, **chain_us(lowering))
        print(row)
        rows.append(row)
    for batch in args.batches or [1, 64]:
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


def payload_main(args, lowerings: list[str], flags: str) -> None:
    import jaxlib

    rows = []
    for lowering in lowerings:
        for kind, repeated in (("sweep", False), ("sweep_repeated", True)):
            sweep = [dict(kind=kind, xla_flags=flags, **chain_us(lowering, kb << 10, repeated=repeated))
                     for kb in args.pad_kb]
            for row in sweep:
                print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()})
            for x, unit in (("payload_bytes_per_launch", "of payload"), ("pad_bytes", "of PTX")):
                xs, ys = [r[x] for r in sweep], [r["us_per_kernel"] for r in sweep]
                slope = statistics.linear_regression(xs, ys).slope * 1e5 if len(set(xs)) > 1 else None
                for row in sweep:
                    row["fit_us_per_100kb" + ("" if x == "payload_bytes_per_launch" else "_of_ptx")] = slope
                print(f"{lowering} {kind}: {slope and round(slope, 3)} us per launch per 100 KB {unit} "
                      f"(least squares over the pads, jaxlib {jaxlib.__version__})")
            rows += sweep
    began, skipped = time.perf_counter(), []
    for batch in args.batches or [1, 8]:
        for lowering in lowerings:
            for ptx in ("full", "minified"):
                if time.perf_counter() - began > args.budget_s:  # the whole run must stay < 3 min
                    skipped.append(f"{lowering}/{ptx}/{batch}")
                    continue
                row = dict(kind="step", xla_flags=flags, **step_trace(lowering, batch, args.context, ptx))
                print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()
                       if k not in ("ops", "custom_calls")})
                rows.append(row)
    common.write_json(args.json, "jax dispatch: per-launch host cost against the call proto's size", rows, [
        f"sweep: {CHAIN} chained 1024-element Triton kernels per jitted chain, unrolled fori_loop of {LOOP}; "
        "each launch's PTX padded by pad_bytes of comment lines of random letters (the same kernel); "
        "us_per_kernel = wall / (chains x kernels); payload_bytes_per_launch = the compressed call proto; "
        "sweep_repeated: the same with one comment line repeated (compresses ~100-fold); fit_us_per_100kb: "
        "slope against the payload, fit_us_per_100kb_of_ptx: against the PTX bytes added",
        f"step: the composed decode step, unrolled fori_loop of {LOOP}, per PTX form (ptx_form: full = "
        "Triton's PTX, minified = without comments and blanks; the same SASS)",
        f"XLA_FLAGS={flags!r}",
    ] + ([f"not run (past --budget-s {args.budget_s:g} s of steps): {', '.join(skipped)}"] if skipped else []))
    if skipped:
        print("not run, past the time budget:", ", ".join(skipped))


def xspace_summary(path: str, calls: int, first: int = 300) -> dict:
    """The host planes of the profile at ``path`` (an ``.xplane.pb``) per thread line: for each
    event name its count, inclusive and self microseconds per call (``calls`` loop executions);
    and, per host line, its first ``first`` events from the first jitted call's (``PjitFunction``;
    else the line's first) as ``[start µs from there, duration µs, nesting depth, name]``."""
    from jax.profiler import ProfileData

    summary = {}
    for plane in ProfileData.from_file(path).planes:
        for line in plane.lines:
            events = sorted(((e.start_ns, e.duration_ns, e.name) for e in line.events),
                            key=lambda e: (e[0], -e[1]))
            if not events:
                continue
            names: dict = {}
            stack: list = []  # [end_ns, name, nested_ns] of the open events
            timeline = []
            origin = next((e[0] for e in events if e[2].startswith("PjitFunction")), events[0][0])
            for start, duration, name in events:
                while stack and stack[-1][0] <= start:
                    end, done, nested = stack.pop()
                    names[done][2] += nested
                if stack:
                    stack[-1][2] += duration
                entry = names.setdefault(name, [0, 0, 0])  # count, inclusive ns, nested ns
                entry[0] += 1
                entry[1] += duration
                if start >= origin and len(timeline) < first:
                    timeline.append([round((start - origin) / 1e3, 2), round(duration / 1e3, 2),
                                     len(stack), name[:80]])
                stack.append([start + duration, name, 0])
            for end, done, nested in stack:
                names[done][2] += nested
            rows = sorted(((name[:100], count / calls, total / 1e3 / calls, (total - nested) / 1e3 / calls)
                           for name, (count, total, nested) in names.items()), key=lambda r: -r[3])
            span = (events[-1][0] + events[-1][1] - events[0][0]) / 1e3 / calls
            summary[f"{plane.name} | {line.name}"] = dict(
                events_per_call=len(events) / calls, span_us_per_call=span,
                by_self_time=[dict(name=n, count=c, inclusive_us=i, self_us=x) for n, c, i, x in rows[:40]],
                timeline=timeline if "/host" in plane.name else [])
    return summary


def profiled(fn, calls: int) -> dict:
    """``fn()`` (which waits for its work) run once under ``jax.profiler.trace``; its summary."""
    import glob
    import tempfile

    import jax

    directory = tempfile.mkdtemp(prefix="qsa_host_profile_")
    with jax.profiler.trace(directory):
        fn()
    (path,) = glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True)
    return xspace_summary(path, calls)


def host_profile_main(args, lowerings: list[str], flags: str) -> None:
    import jax
    import jax.numpy as jnp
    import torch

    import bench_step
    import qsa_jax

    rows, n, chain = [], CHAIN_ELEMENTS, chain_function()
    for lowering in [] if args.smoke else lowerings:  # the chain calls jax-triton directly: GPU only
        with qsa_jax.use_triton_lowering(lowering):
            looped = jax.jit(lambda x: jax.lax.fori_loop(0, LOOP, lambda i, x: chain(x), x, unroll=True))
            x = jnp.zeros((n,), jnp.float32)
            for _ in range(5):
                jax.block_until_ready(looped(x))
        row = dict(kind="chain", xla_flags=flags, lowering=lowering, launches_per_call=CHAIN * LOOP,
                   profile=profiled(lambda: jax.block_until_ready(looped(x)), 1))
        print(row["kind"], lowering, {k: round(v["span_us_per_call"], 1) for k, v in row["profile"].items()})
        rows.append(row)
    geometry, device = (bench_step.SMOKE, torch.device("cpu")) if args.smoke else (
        bench_step.PRODUCTION, torch.device("cuda"))
    context = 64 if args.smoke else args.context
    for batch in args.batches or [1]:
        shape = bench_step.Shape(geometry, batch, context, device)
        inputs, state, meta, tables = bench_step.jax_arrays(shape)
        for lowering in lowerings:
            # New functions per lowering: jax's trace cache is keyed on the function, not on the
            # lowering's context variable.
            step, loop = bench_step.jax_step_and_loop(shape, LOOP)
            for kind, function, steps in (("step_loop", loop, LOOP), ("step_call", step, 1)):
                with qsa_jax.use_triton_lowering(lowering), warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    jitted = jax.jit(function, donate_argnums=1)
                    for _ in range(6):
                        out, state = jax.block_until_ready(jitted(inputs, state, meta, *tables))
                holder = {"state": state, "out": out}
                for outputs in ("alive", "freed"):  # the previous call's output kept (a caller's loop), or not

                    def once():
                        if outputs == "freed":
                            holder.pop("out", None)
                        holder["out"], holder["state"] = jax.block_until_ready(
                            jitted(inputs, holder["state"], meta, *tables))

                    walls = []
                    for _ in range(20):
                        start = time.perf_counter()
                        once()
                        walls.append((time.perf_counter() - start) * 1e6)
                    row = dict(kind=kind, xla_flags=flags, lowering=lowering, batch=batch, context=context,
                               steps_per_call=steps, previous_output=outputs,
                               unprofiled_call_us=statistics.median(walls),
                               warnings=sorted({str(w.message)[:300] for w in seen}),
                               profile=profiled(once, 1))
                    print(kind, lowering, batch, outputs, round(row["unprofiled_call_us"], 1),
                          {k: round(v["span_us_per_call"], 1) for k, v in row["profile"].items()})
                    rows.append(row)
                state = holder.pop("state")
                holder.clear()
        del shape, inputs, meta, tables
        torch.cuda.empty_cache()
    common.write_json(args.json, "jax dispatch: where the host's time goes (jax.profiler)", rows, [
        f"chain: {CHAIN} chained 1024-element Triton kernels per jitted chain, unrolled fori_loop of {LOOP}; "
        f"step: the composed decode step, unrolled fori_loop of {LOOP}; each executed once (after warm-up) "
        "under jax.profiler.trace; per plane and thread line: events by self time (per loop execution) and the "
        "first events in order [start us, duration us, depth, name]",
        f"XLA_FLAGS={flags!r}",
    ])


def arguments_main(args, lowerings: list[str], flags: str) -> None:
    import jaxlib

    rows = []
    for lowering in lowerings:
        for kind in ("buffers", "scalars"):
            sweep = [dict(kind=kind, xla_flags=flags, **chain_us(lowering, 0, **{kind: extra})) for extra in args.extra]
            xs, ys = [r[f"extra_{kind}"] for r in sweep], [r["us_per_kernel"] for r in sweep]
            slope = statistics.linear_regression(xs, ys).slope if len(set(xs)) > 1 else None
            for row in sweep:
                row["fit_us_per_argument"] = slope
                print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()})
            print(f"{lowering}: {slope and round(slope, 4)} us per launch per extra {kind[:-1]} "
                  f"(least squares, jaxlib {jaxlib.__version__})")
            rows += sweep
    common.write_json(args.json, "jax dispatch: per-launch host cost against the launch's argument count", rows, [
        f"{CHAIN} chained 1024-element Triton kernels per jitted chain, unrolled fori_loop of {LOOP}; each launch "
        "given extra_buffers more input buffers (distinct [1] float32 arrays, jit arguments) or extra_scalars more "
        "int scalars, each read once by the kernel; us_per_kernel = wall / (chains x kernels); "
        "fit_us_per_argument: the least-squares slope over the row's sweep",
        f"XLA_FLAGS={flags!r}",
    ])


if __name__ == "__main__":
    main()
