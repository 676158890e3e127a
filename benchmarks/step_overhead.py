"""Host cost per call of the composed step, eager against ``torch.compile`` (a timing script).

    PYTHONPATH=.:.dev python benchmarks/step_overhead.py [--calls 500] [--repeats 15] [--json PATH]

On the CPU (Triton's interpreter) every kernel launch is replaced by a
no-op (``InterpretedFunction.run``), so what is timed is the torch adapter,
torch's dispatcher and torch.compile's wrappers around the launches: the part
of a call's host time that no faster launcher removes.  On a GPU the kernels
run (use ``profile_host.py`` there for where the time goes): the rows then
include the launches' host time, except the ``_without_run`` rows.

Rows, each CPU µs per call (``time.process_time``: robust to a shared
machine) of ``--calls`` back-to-back calls, the least and the median of
``--repeats`` runs (the rows interleaved, so that a busy machine disturbs them
alike), with grad mode on (the default a model runs under) and under
``torch.no_grad()``:

* ``eager``: ``qsa_torch.qsa_attention_step`` (the prepared eager path: no
  dispatcher round trip);
* ``compile_default``: ``torch.compile(step, fullgraph=True)``, Inductor's
  default mode (Dynamo's guards, AOTAutograd's runtime wrapper, Inductor's
  wrapper, then the step's op through the dispatcher);
* ``op``: the step's op called directly, ``torch.ops.qsa.qsa_attention_step.default(...)``
  (how a compiled graph and a loaded ``torch.export`` program call it): the
  dispatcher's cost is ``op`` less ``op_implementation``;
* ``op_implementation``: the Python function the op's backend kernel runs,
  called without the dispatcher;
* ``eager_without_run``, ``compile_default_without_run`` (and the same for
  any row): the row with the prepared run (``qsa_torch._eager``: the call
  key, the allocations, the launches) replaced by returning one real call's
  results: what each calling path costs around the work both share, so that
  ``compile_default_without_run`` less ``eager_without_run`` is what
  torch.compile's wrappers add per call;
* ``one_launch_eager``, ``one_launch_compile_default``: one
  ``store_cache_rows`` call (one launch: a decode row per request into the
  compressed-key cache), eager and compiled.

The step is bench_step.py's (``SMOKE`` geometry on the CPU, ``PRODUCTION`` on a
GPU), at ``--batch`` requests of ``--context`` tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import common  # noqa: F401  (puts the checkout on sys.path)
import bench_step


def per_call_us(fn, calls: int) -> float:
    """CPU µs per call of ``calls`` back-to-back calls."""
    start = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=None, help="default: 64 on the CPU, 131072 on a GPU")
    parser.add_argument("--rows", default="eager,compile_default,op,op_implementation,eager_without_run,"
                                          "compile_default_without_run,op_without_run,op_implementation_without_run,"
                                          "one_launch_eager,one_launch_compile_default")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()

    import torch
    import triton

    import qsa_torch
    from qsa_kernels import runtime
    from qsa_kernels.stage import stage_named
    from qsa_torch import _launch

    cuda = not runtime.INTERPRETED
    device = torch.device("cuda" if cuda else "cpu")
    geometry = bench_step.PRODUCTION if cuda else bench_step.SMOKE
    shape = bench_step.Shape(geometry, args.batch, args.context or (131072 if cuda else 64), device)
    shape.torch_step()  # the first call plans, builds and prepares (real kernels)
    if not cuda:
        from triton.runtime.interpreter import InterpretedFunction

        InterpretedFunction.run = lambda self, *a, **k: None

    stage = stage_named("qsa_attention_step")
    from qsa_kernels import step as _step

    arguments = _step.state_arguments(dict(
        **shape.inputs, state=shape.state, metadata=shape.meta, cos_sin=shape.cos_sin,
        index_cos_sin=shape.index_cos_sin, **shape.options, is_neox=True, softmax_scale=None,
        return_token_indices=False), qsa_torch.QSAState, qsa_torch.StepMetadata)
    op, values = _launch.op_call(stage, arguments)
    implementation = getattr(_launch, "_IMPLEMENTATIONS", {}).get(op)
    if implementation is None:  # ops made by torch.library.custom_op
        from torch._library.custom_ops import OPDEFS

        opdef = OPDEFS.get(op._schema.name)
        implementation = opdef and opdef._init_fn

    rows = args.rows.split(",")
    results: dict = dict(torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                         qsa_torch=os.path.dirname(qsa_torch.__file__),
                         device=str(device), stubbed=not cuda, batch=args.batch, context=shape.context,
                         op_arguments=len(op._schema.arguments))
    print(f"torch {torch.__version__}, triton {triton.__version__}, {device}, kernels "
          f"{'stubbed' if not cuda else 'real'}; the step's op has {len(op._schema.arguments)} arguments")
    from qsa_torch import _eager

    real_run, real__run = _eager.run, getattr(_eager, "_run", None)
    stubbed_run = None
    if real__run is not None:
        prepared = real__run(stage, arguments, False)  # (Prepared, results, tensors) of one real call
        stubbed_run = (lambda stage, arguments, keep: prepared,
                       lambda stage, arguments: (prepared[0].program, prepared[1]))

    functions = {}  # row -> (function, whether the prepared run is stubbed)
    torch._dynamo.reset()
    for row in rows:
        base, floor = row.removesuffix("_without_run"), row.endswith("_without_run")
        if floor and stubbed_run is None:
            continue
        if base == "eager":
            functions[row] = (shape.torch_step, floor)
        elif base == "compile_default":
            functions[row] = (shape.compiled_step(None), floor)
        elif base == "op":
            functions[row] = ((lambda: op(*values)), floor)
        elif base == "op_implementation":
            if implementation is not None:
                functions[row] = ((lambda: implementation(*values)), floor)
        elif base in ("one_launch_eager", "one_launch_compile_default"):
            if floor:
                continue
            cache = shape.state.compressed_key_cache  # [pages, P, 1, DI]
            rows_in = shape.inputs["index_k"][:, 0]  # [B, DI]: one row per request
            slots = torch.arange(args.batch, device=device) * 7  # distinct live slots
            store = qsa_torch.store_cache_rows
            if base == "one_launch_compile_default":
                store = torch.compile(store, fullgraph=True)
            functions[row] = ((lambda store=store: store(cache, slots, rows_in)), False)
        else:
            raise SystemExit(f"unknown row {row!r}")

    def timed(fn, floor: bool) -> float:
        if floor:
            _eager._run, _eager.run = stubbed_run
        try:
            return per_call_us(fn, args.calls)
        finally:
            _eager.run, _eager._run = real_run, real__run

    print(f"{'row':28s} {'grad_min':>9s} {'grad_med':>9s} {'no_grad_min':>11s} {'no_grad_med':>11s}")
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            for fn, floor in functions.values():  # warm (a compiled function compiles once per grad mode)
                for _ in range(20):
                    fn()
            times = {row: [] for row in functions}
            for _ in range(args.repeats):  # rows interleaved: a busy machine disturbs them alike
                for row, (fn, floor) in functions.items():
                    times[row].append(timed(fn, floor))
        for row, figures in times.items():
            entry = results.setdefault(row, {})
            mode = "grad" if grad else "no_grad"
            entry[f"{mode}_min_us"], entry[f"{mode}_median_us"] = min(figures), statistics.median(figures)
    for row, entry in results.items():
        if isinstance(entry, dict):
            print(f"{row:28s} {entry['grad_min_us']:9.1f} {entry['grad_median_us']:9.1f} "
                  f"{entry['no_grad_min_us']:11.1f} {entry['no_grad_median_us']:11.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
