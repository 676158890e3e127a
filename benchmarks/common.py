"""Timing and reporting helpers shared by every benchmark (see docs/design.md).

torch: ``triton.testing.do_bench`` (median) and CUDA-graph replay.
JAX: wall clock of N back-to-back jitted calls after ``block_until_ready``
(median of repeats, includes host overhead), and device time from one jitted
``lax.fori_loop`` of N calls (compare with a CUDA graph of N torch calls).
Bandwidth is reported against the H200's measured ~4300 GB/s copy rate.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

PEAK_GBPS = 4300.0
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def fused_merge_attention(on: bool):
    """The current ``AttentionTuning`` with its split-K merge forced into the
    attention's launch (``on``) or into a merge launch (``fused_merge``)."""
    import dataclasses

    from qsa_kernels import tuning

    return dataclasses.replace(tuning.current().attention, fused_merge=on)


def card() -> str:
    """This machine's results folder, ``benchmarks/results/<card>``: ``h100``, ``h200``, another GPU's
    lowercase name, or ``cpu``."""
    try:
        import torch

        if not torch.cuda.is_available():
            return "cpu"
        name = torch.cuda.get_device_name().lower()
    except Exception:
        return "cpu"
    known = [c for c in ("h100", "h200") if c in name]
    return known[0] if known else "_".join(name.replace("nvidia", "").split()) or "gpu"


def results_dir() -> str:
    return os.path.join(ROOT, "benchmarks", "results", card())


def parser(description: str, default_json: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", default=os.path.join(results_dir(), default_json),
                   help="where to write the results")
    p.add_argument("--shapes", type=parse_shapes, default=None,
                   help="only these shapes, e.g. decode:256:131072,prefill:2048:131072 (mode:rows:context)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes, few repeats: checks the script runs (CPU interpreter too)")
    return p


def parse_shapes(text: str) -> list[tuple[str, int, int]]:
    """``"decode:256:131072,prefill:2048:131072"`` -> [("decode", 256, 131072), ...]."""
    shapes = []
    for item in text.split(","):
        mode, rows, context = item.split(":")
        if mode not in ("decode", "prefill"):
            raise argparse.ArgumentTypeError(f"mode must be decode or prefill, got {mode!r}")
        shapes.append((mode, int(rows), int(context)))
    return shapes


def torch_median_us(fn, smoke: bool = False) -> float:
    """Median µs of ``fn`` by triton.testing.do_bench (events, L2 flushed)."""
    import triton.testing
    import torch

    if not torch.cuda.is_available():
        return _wall_median_us(fn, 3 if smoke else 20)
    return 1000.0 * triton.testing.do_bench(fn, warmup=5 if smoke else 25, rep=20 if smoke else 100,
                                            return_mode="median")


def torch_graph_us(fn, calls: int = 20, smoke: bool = False) -> float | None:
    """Median µs per call from replaying a CUDA graph of ``calls`` calls of ``fn``."""
    import torch

    if not torch.cuda.is_available():
        return None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3 if smoke else 15):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    del graph
    return statistics.median(times)


def torch_loop_us(fn, calls: int = 20, smoke: bool = False) -> float | None:
    """Median µs per call of ``calls`` back-to-back calls of ``fn`` between two CUDA events (GPU only).

    For functions that replay graphs themselves (``torch.compile(mode="reduce-overhead")``):
    comparable to :func:`torch_graph_us` of the same ``calls``, host cost included.
    """
    import torch

    if not torch.cuda.is_available():
        return None
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3 if smoke else 15):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    return statistics.median(times)


def _wall_median_us(fn, repeats: int, calls: int = 1, sync=None) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn()
        if sync is not None:
            sync(out)
        times.append((time.perf_counter() - t0) * 1e6 / calls)
    return statistics.median(times)


def jax_wall_us(fn, args, calls: int = 20, smoke: bool = False) -> float:
    """Median µs per call of N back-to-back calls of a jitted ``fn(*args)`` (host overhead included)."""
    import jax

    jax.block_until_ready(fn(*args))
    return _wall_median_us(lambda: fn(*args), 3 if smoke else 15, calls=calls,
                           sync=jax.block_until_ready)


def jax_loop_us(step, carry, calls: int = 20, smoke: bool = False, consts=()) -> float:
    """Device-time estimate: one jitted ``fori_loop`` of ``calls`` steps, µs per step.

    ``step(carry, *consts) -> carry``; the carry is threaded so XLA cannot
    hoist or drop the calls.  Large read-only inputs (caches) go in ``consts``:
    a jitted function must copy a non-donated input it returns, so carrying
    them would time a copy of the cache.  Unrolled: a rolled XLA while loop on
    the GPU reads its predicate back to the host every iteration, which would
    dominate.
    """
    import jax

    looped = jax.jit(lambda c, k: jax.lax.fori_loop(0, calls, lambda i, c: step(c, *k), c, unroll=True))
    jax.block_until_ready(looped(carry, tuple(consts)))
    return _wall_median_us(lambda: looped(carry, tuple(consts)), 3 if smoke else 10,
                           sync=jax.block_until_ready) / calls


def gpu_trace(fn, calls: int = 1) -> dict | None:
    """What the GPU ran during ``fn()`` (which must wait for its work): a CUPTI trace through
    ``torch.profiler``, which sees every kernel of the process (XLA's too).  Per call (``fn`` runs
    ``calls`` steps): ``device_us`` = first kernel start to last kernel end, ``busy_us`` = summed
    kernel time, ``gpu_ops`` = kernels and copies; ``ops``: count by name.  None without CUDA."""
    import collections
    import re

    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    if not events:
        return None
    return dict(device_us=(events[-1].time_range.end - events[0].time_range.start) / calls,
                busy_us=sum(e.time_range.elapsed_us() for e in events) / calls,
                gpu_ops=len(events) / calls,
                ops=dict(collections.Counter(re.sub(r"_\d+$", "", e.name)[:60] for e in events).most_common(24)))


def to_jax(tensor):
    """A torch tensor as a JAX array: zero-copy through DLPack on the GPU."""
    import jax
    import jax.numpy as jnp
    import torch

    if tensor.is_cuda:
        return jax.dlpack.from_dlpack(tensor)
    if tensor.dtype == torch.bfloat16:
        return jnp.asarray(tensor.float().numpy()).astype(jnp.bfloat16)
    if tensor.dtype == torch.float8_e4m3fn:  # NumPy has no fp8: move the bits
        import ml_dtypes

        return jnp.asarray(tensor.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn))
    return jnp.asarray(tensor.numpy())


def gbps(nbytes: int, microseconds: float | None) -> float | None:
    if not microseconds:
        return None
    return nbytes / (microseconds * 1e-6) / 1e9


def copy_gbps(nbytes: int = 2 << 30, smoke: bool = False) -> float | None:
    """This card's device-to-device copy rate, GB/s, measured now: ``nbytes`` (read + written)
    copied by an SM kernel (``torch.mul(source, 1, out=target)`` on float32) in a CUDA graph, the
    median of replays.  Not ``copy_``: in a graph that is a memcpy node, which the copy engines
    run slower (H100, 2026-12-07: 2445 GB/s against the kernel's 3037).  None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    source = torch.empty(nbytes // 8, dtype=torch.float32, device="cuda").normal_()
    target = torch.empty_like(source)
    return gbps(nbytes, torch_graph_us(lambda: torch.mul(source, 1.0, out=target), calls=5, smoke=smoke))


def pct_peak(nbytes: int, microseconds: float | None) -> float | None:
    rate = gbps(nbytes, microseconds)
    return None if rate is None else 100.0 * rate / PEAK_GBPS


def environment() -> dict:
    info = {"python": platform.python_version(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
    except Exception:
        pass
    for name in ("triton", "jax"):
        try:
            info[name] = __import__(name).__version__
        except Exception:
            pass
    return info


def commit() -> str:
    """The checkout's commit: ``QSA_COMMIT`` (a copy without .git, e.g. the device machine's), else git's."""
    if os.environ.get("QSA_COMMIT"):
        return os.environ["QSA_COMMIT"]
    try:
        import subprocess

        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def write_json(path: str, benchmark: str, rows: list[dict], notes: list[str] | None = None) -> None:
    """The run's JSON: its date, card and commit (docs/performance.md cites them), environment, rows."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"benchmark": benchmark, "date": time.strftime("%Y-%m-%d"), "card": card(), "commit": commit(),
                   "environment": environment(), "peak_gbps": PEAK_GBPS, "notes": notes or [], "rows": rows},
                  f, indent=1)
    print(f"wrote {path}")


def print_table(rows: list[dict], columns: list[str]) -> None:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"
        return "-" if v is None else str(v)

    widths = [max(len(c), *(len(fmt(r.get(c))) for r in rows)) for c in columns] if rows else [len(c) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(fmt(r.get(c)).rjust(w) for c, w in zip(columns, widths)))


def torch_host_us(fn, calls: int = 200) -> float | None:
    """Host cost per call: wall clock of back-to-back calls with no sync in between.

    When the device work is shorter than the host work, this is the time the
    Python call path (checks, plan, launch) takes per call.
    """
    import torch

    if not torch.cuda.is_available():
        return None
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed * 1e6 / calls


def one_call_graph(fn):
    """A CUDA graph of one call of ``fn``, captured after a warm-up call on a side stream."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def torch_wall_us(fn, calls: int = 100, smoke: bool = False) -> float | None:
    """Wall µs per call of ``calls`` back-to-back calls of ``fn``, the final synchronize included (GPU only).

    What a caller sees: the host cost per call where the host is the bound,
    the GPU time where the GPU is; median of 5 repeats.
    """
    import torch

    if not torch.cuda.is_available():
        return None
    return _wall_median_us(fn, 2 if smoke else 5, calls=10 if smoke else calls, sync=lambda _: torch.cuda.synchronize())


def budgeted_graph_us(fn, smoke: bool, budget_s: float, estimate_us: float | None = None) -> float:
    """CUDA-graph µs per call, with as many calls per graph (1..20) as fit ``budget_s``
    (without CUDA: the wall-clock median, so that --smoke exercises the path)."""
    import torch

    if not torch.cuda.is_available():
        return torch_median_us(fn, smoke)
    if estimate_us is None:
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        estimate_us = (time.perf_counter() - start) * 1e6
    calls = max(1, min(20, int(budget_s * 1e6 / 18 / max(estimate_us, 1.0))))
    return torch_graph_us(fn, calls=calls, smoke=smoke)


def fp8_pool(pool, chunk: int = 8192):
    """An fp8 e4m3 copy of a bf16 cache pool and its per-tensor scale (amax / 448),
    quantised ``chunk`` pages at a time (bounded float32 temporaries)."""
    import torch

    scale = float(pool.abs().amax().float()) / 448.0
    out = torch.empty(pool.shape, dtype=torch.float8_e4m3fn, device=pool.device)
    for first in range(0, pool.shape[0], chunk):
        out[first:first + chunk] = (pool[first:first + chunk].float() / scale).clamp(-448.0, 448.0).to(out.dtype)
    return out, torch.full((), scale, dtype=torch.float32, device=pool.device)
