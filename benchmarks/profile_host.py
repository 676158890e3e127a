"""Where the host time of one torch call goes: a profile per calling path (a measuring script, not a test).

    python benchmarks/profile_host.py --out DIR [--batch 1] [--context 131072]

For the composed decode step (``bench_step.py``'s production shape) and one
one-launch function (``store_cache_rows`` at a decode row), per path --
eager, ``torch.compile`` default, ``mode="reduce-overhead"``, the hand-captured
CUDA graph -- it writes:

* ``host_us``: wall per call of back-to-back calls (no sync in the loop);
  ``eager-per-call-workspaces`` times eager with its workspaces allocated per
  call, then eager again (``eager_again``), in the same process;
* cProfile of 200 calls, by own time and cumulative (all in ``profiles.txt``);
* the kernels the GPU ran for 20 calls (CUPTI through
  ``torch.profiler``) with their total time, and the CPU-side ops;
* the fast launcher's misses, ordinary-path launches and general-path calls
  (``qsa_torch._launch._call``: validated and planned) over the timed calls
  and their five warm-up calls (a first call of a key is a general one);
* for reduce-overhead: Inductor's cudagraph counters and the
  ``cudagraphs,perf_hints`` log lines (``compile_log.txt``).

On the CPU it runs the eager path only, on the smoke geometry (interpreter
numbers, not host costs).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import os
import pstats
import time

import common  # noqa: F401  (puts the checkout on sys.path)
import bench_step


def wall_us(fn, calls: int) -> float:
    import torch

    for _ in range(5):
        fn()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) * 1e6 / calls)
        sync()
    return best


def profile(fn, calls: int, path: str, title: str) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    text = io.StringIO()
    for order in ("tottime", "cumulative"):
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(45)
    with open(path, "a") as f:
        f.write(f"\n==== cProfile: {title} ====\n" + text.getvalue())


def kernels(fn, calls: int, path: str, title: str) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile as tprofile

    if not torch.cuda.is_available():
        return {}
    fn()
    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
    gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    with open(path, "a") as f:
        f.write(f"\n==== torch.profiler: {title} ====\n" + table)
    return dict(gpu_kernels_per_call=len(gpu) / calls,
                gpu_busy_us_per_call=sum(e.device_time for e in gpu) / calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--paths", default="eager,graph,compile,reduce-overhead,reduce-overhead-static,one-launch",
                        help="also: eager-per-call-workspaces (eager with nothing kept between calls, then again)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    import torch

    from qsa_torch import _fast_launch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    g = bench_step.PRODUCTION if cuda else bench_step.SMOKE
    shape = bench_step.Shape(g, args.batch, args.context if cuda else 64, device)
    paths = args.paths.split(",")
    report = os.path.join(args.out, "profiles.txt")  # every profile, one file
    results: dict = dict(batch=args.batch, context=args.context, launches=bench_step.launches(shape))

    launcher = _fast_launch.launch
    slow_calls = [0]
    slow = launcher._slow

    def counting_slow(*a, **k):
        slow_calls[0] += 1
        return slow(*a, **k)

    launcher._slow = counting_slow
    from qsa_torch import _launch

    general_calls = [0]
    general = _launch._call

    def counting_general(*a, **k):
        general_calls[0] += 1
        return general(*a, **k)

    _launch._call = counting_general  # the general (validating, planning) eager path

    def measure(name: str, fn) -> None:
        misses, slows, generals = launcher.misses, slow_calls[0], general_calls[0]
        row = dict(host_us=wall_us(fn, args.calls))
        row["fast_launch_misses"] = launcher.misses - misses
        row["ordinary_launches"] = slow_calls[0] - slows
        row["general_path_calls"] = general_calls[0] - generals
        profile(fn, args.calls, report, name)
        row.update(kernels(fn, 20, report, name))
        results[name] = row
        print(name, row, flush=True)

    if "eager" in paths:
        measure("eager", shape.torch_step)
    if "eager-per-call-workspaces" in paths:
        # The same path with nothing kept between calls (the workspaces allocated, the zeroed one
        # filled, per call, as before qsa_torch._eager kept them), then kept again: an A/B in one process.
        from qsa_torch import _eager

        kept_bytes = _eager._KEPT_BYTES
        _eager._KEPT_BYTES = 0
        _eager._KEPT.clear()
        try:
            measure("eager_per_call_workspaces", shape.torch_step)
        finally:
            _eager._KEPT_BYTES = kept_bytes
        measure("eager_again", shape.torch_step)
    if "one-launch" in paths:
        import qsa_torch

        cache = shape.state.compressed_key_cache  # [pages, P, 1, DI]
        rows = shape.inputs["index_k"][:, 0]  # [B, DI]: one row per request
        slots = torch.arange(args.batch, device=device) * 7  # distinct live slots
        measure("one_launch_store_cache_rows", lambda: qsa_torch.store_cache_rows(cache, slots, rows))
    if cuda and "graph" in paths:
        results["graph_replay_us"] = common.torch_graph_us(shape.torch_step, calls=10)
        results["graph_one_step_host_us"] = wall_us(common.one_call_graph(shape.torch_step).replay, args.calls)
    if cuda:
        log_path = os.path.join(args.out, "compile_log.txt")
        handler = logging.FileHandler(log_path)
        handler.setLevel(logging.DEBUG)
        torch._logging.set_logs(cudagraphs=True, perf_hints=True, recompiles=True, graph_breaks=True)
        for logger_name in ("torch._inductor", "torch._dynamo", "torch._inductor.cudagraph_trees"):
            logging.getLogger(logger_name).addHandler(handler)
        from torch._dynamo.utils import counters

        for name, mode, static in (("compile", None, False), ("reduce_overhead", "reduce-overhead", False),
                                   ("reduce_overhead_static", "reduce-overhead", True)):
            if name.replace("_", "-") not in paths:
                continue
            counters.clear()
            torch._dynamo.reset()
            try:
                step = shape.compiled_step(mode, every_input_static=static)
                measure(name, step)
                results[name]["counters"] = {k: dict(v) for k, v in counters.items() if v}
                results[name]["events_us"] = common.torch_loop_us(step, calls=10)
            except Exception as error:  # keep the other paths
                results[name] = dict(error=f"{type(error).__name__}: {str(error)[:400]}")
                print(name, results[name], flush=True)
    with open(os.path.join(args.out, "profile_host.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
