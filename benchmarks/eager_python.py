"""The Python of a prepared eager call's compiled branch, timed on the CPU (a measuring script).

    PYTHONPATH=. python benchmarks/eager_python.py [--batch 1] [--calls 2000] [--json PATH]

On a GPU a steady eager call of the composed step is its Python plus its
launches; this times the Python alone, where no GPU is.  In a CPU process
(Triton's interpreter) it first runs the step and one ``store_cache_rows``
call for real, which prepares their programs (``qsa_torch._eager``), then
takes the compiled branch of ``Prepared.run`` as on a GPU: the current-device
and current-stream reads return the CPU's, every bound launch is a no-op
Python function (``Prepared._bind`` replaced), and a stream is never being
captured.  So each row is what the call costs before and around its launches:
the call key, the prepared program's lookup, the allocations, the pointer
list, the checks, one no-op call per launch.  Rows: ``step`` (bench_step.py's
SMOKE geometry: the same arrays and options as production, smaller) and
``store_cache_rows`` (one launch), µs per call, the least of 7 runs of
``--calls`` calls.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import common  # noqa: F401  (puts the checkout on sys.path)
import bench_step


def best_us(fn, calls: int, runs: int = 7) -> float:
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import torch
    import triton

    import qsa_torch
    from qsa_kernels import runtime
    from qsa_torch import _eager, _fast_launch

    if not runtime.INTERPRETED:
        raise SystemExit("eager_python.py runs on the CPU (on a GPU use profile_host.py: the launches are real)")
    shape = bench_step.Shape(bench_step.SMOKE, args.batch, 64, torch.device("cpu"))
    cache = shape.state.compressed_key_cache  # [pages, P, 1, DI]
    rows = shape.inputs["index_k"][:, 0]  # [B, DI]: a decode row per request
    slots = torch.arange(args.batch) * 7
    step = shape.torch_step
    store = lambda: qsa_torch.store_cache_rows(cache, slots, rows)  # noqa: E731
    step()  # real calls: planned, built and prepared
    store()

    def no_op(*arguments):
        return None

    def bind(self, env, alignment, process):  # every launch a no-op, bound as Prepared._bind binds
        records = []
        for launch, slot_numbers in self.schedule.launches:
            take = _eager._getter(tuple(self.positions[i] for i in slot_numbers))
            records.append((no_op, (0, 0, None, None, None), take, (0,) * (len(launch.scalars) + 2), 1, 1, 1))
        self.bound[alignment] = (process, (), tuple(records))

    runtime.INTERPRETED = False  # the compiled branch from here on
    _fast_launch.launch._get_device = lambda: -1  # the CPU tensors' device index
    _fast_launch.launch._get_stream = lambda index: 0
    _eager.Prepared._bind = bind
    _eager._capturing = lambda: False
    results = {}
    for name, fn in (("step", step), ("store_cache_rows", store)):
        for _ in range(50):
            fn()
        results[name] = round(best_us(fn, args.calls), 2)
        print(f"{name:18s} {results[name]:8.2f} µs per call")
    launches = {prepared.program.function: len(prepared.schedule.launches) for prepared in _eager._PREPARED.values()}
    if args.json:
        with open(args.json, "w") as file:
            json.dump(dict(torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                           batch=args.batch, calls=args.calls, launches=launches, us_per_call=results), file,
                      indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
