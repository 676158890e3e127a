"""topk_blocks by path against torch.topk and jax.lax.top_k, on one grid.

Grid: rows {1, 8, 64, 256, 2048} x columns {2048, 8192, 32768, 131072,
262144} (compressed blocks: contexts 8K..1M at ratio 4), k = 512; shapes
whose fp32 logits pass MAX_LOGITS_BYTES are skipped.  Logits: half-normal
scores (|N(0, 1)|, continuous like the scorer's), every column visible.

Per shape, CUDA-graph replay (device time, L2 warm), median µs per call:
- ``ours_us``: topk_blocks as planned (``TopkTuning.path = "auto"``;
  ``path`` says which path the plan chose);
- ``register_us`` / ``row_us`` / ``ticketed_us`` / ``sliced_us``: the
  register path (one program per row, the row in registers; rows up to
  ``topk.REGISTER_MAX_TILE`` columns, else absent), the one-program-per-row
  streaming path, the one-launch ticketed path (several programs a row)
  and the four-launch sliced path, each forced
  (``tuning.override`` of ``TopkTuning.path``), in the same run;
- ``torch_topk_us``: ``torch.topk(logits, k, sorted=False)`` (values and
  indices, unordered; ours also orders the columns);
- ``lax_topk_us``: ``jax.lax.top_k`` on the same logits (a jitted fori_loop
  of calls, per call: device-time estimate), where JAX has a GPU and the
  logits are at most MAX_LAX_BYTES.
Bytes: one pass over the logits is ``R x C x 4``; the register path reads the
row once, the row and ticketed paths twice (group maxima, compaction) plus
~1.4k candidates a row, the sliced path three times.  ``*_gbps`` is one pass's bytes over the time (a lower bound of
the achieved bandwidth).  The summary gives median speedups over the grid.

    python benchmarks/bench_topk.py [--json PATH] [--smoke] [--sweep | --register-sweep | --ticketed-sweep | ...]

``--shapes decode:R:C,...`` times only those rows x columns, in
``topk_shapes.json`` unless ``--json`` names another (the grid's JSON holds
whole grids); with a sweep, its shapes instead of the sweep's own.

``--sweep`` instead times the row path's tuning (``TopkTuning.row_warps`` x
``row_keys_per_thread`` x ``bound_passes``) on a few shapes;
``--register-sweep`` the register path's (``register_keys_per_thread`` x
``register_radix_bits``); ``--ticketed-sweep``
the ticketed path's (``ticketed_slice`` x ``ticketed_warps`` x ``ticketed_bound``);
``--stream-sweep`` the ticketed path's slice programs' warps a launch
(``ticketed_stream_warps``: wider slices streamed past it) beside the row and sliced paths, with ``torch.topk``,
from 1 to 256 rows (results/<card>/topk_stream_sweep.json);
``--wide-sweep`` the sliced path's programs a row (``target_programs`` x
``tile``) beside the row path (and its warps) on many wide rows, with
``torch.topk``;
``--bits-sweep`` the plan's path with 8-bit and with 4-bit radix digits (``register_radix_bits``,
``radix_bits``; the bound's passes doubled to keep its bits, or not), from 1 to 2048 rows.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the card

import common  # noqa: E402

K = 512
ROWS = [1, 8, 64, 256, 2048]
COLUMNS = [2048, 8192, 32768, 131072, 262144]
MAX_LOGITS_BYTES = 1 << 30  # skips 2048 x 262144 (2 GiB)
MAX_LAX_BYTES = 256 << 20
GRAPH_BUDGET_S = 0.15  # per measurement: fewer calls per graph for slow shapes
HARD_STOP_S = 420.0  # past this, remaining shapes are skipped (noted in the JSON)
SMOKE = dict(K=8, ROWS=[1, 3], COLUMNS=[64, 300], MAX_LOGITS_BYTES=1 << 20, MAX_LAX_BYTES=1 << 20)


def timed_us(fn, smoke):
    """CUDA-graph µs per call within this benchmark's budget per measurement."""
    return common.budgeted_graph_us(fn, smoke, GRAPH_BUDGET_S)


def ours_us(qsa_torch, topk_tuning, logits, visible, k, smoke):
    """(topk_blocks µs, its result) planned with ``topk_tuning``.

    The tuning is part of the plan's memo key: nothing to restore or clear afterwards.
    """
    from qsa_kernels import tuning

    with tuning.override(topk=topk_tuning):
        out = qsa_torch.topk_blocks(logits, visible, k)
        return timed_us(lambda: qsa_torch.topk_blocks(logits, visible, k), smoke), out


def lax_topk_us(jax, logits, k, smoke):
    """jax.lax.top_k per call in one jitted fori_loop (each result feeds the next input)."""
    jnp = jax.numpy

    def step(x):
        _, index = jax.lax.top_k(x, k)
        return x.at[0, 0].set(jnp.where(index[0, 0] == -12345, 1.0, x[0, 0]))

    return common.jax_loop_us(step, logits, calls=2 if smoke else 20, smoke=smoke)


SWEEP_SHAPES = [(1, 32768), (64, 262144), (2048, 2048), (2048, 32768)]
SWEEP = dict(row_warps=[8, 16], row_keys_per_thread=[8, 16], bound_passes=[1, 2])  # TopkTuning fields
REGISTER_SWEEP_SHAPES = [(1, 2048), (1, 8192), (1, 16384), (256, 8192), (2048, 2048), (2048, 8192)]
REGISTER_SWEEP = dict(register_keys_per_thread=[2, 4, 8, 16], register_radix_bits=[4, 8])
TICKETED_SWEEP_SHAPES = [(1, 8192), (1, 32768), (8, 32768), (8, 131072)]
TICKETED_SWEEP = dict(ticketed_slice=[2048, 4096], ticketed_warps=[4, 8], ticketed_bound=["scaled", "fixed"])
#: --wide-sweep: the sliced path's programs a row, and the row path's warps, where
#: the plan takes the row path for many wide rows (one program a row: 64 of an
#: H200's 132 SMs at 64 rows); path "row" first, the plan's choice there.
WIDE_SWEEP_SHAPES = [(64, 32768), (64, 131072), (64, 262144), (256, 32768), (256, 131072), (256, 262144),
                     (2048, 32768), (2048, 131072)]
WIDE_SWEEP = ([dict(path="row"), dict(path="row", row_warps=32), dict(path="row", row_group_keys_per_thread=64)]
              + [dict(path="sliced", target_programs=programs, tile=tile)
                 for tile in (2048, 4096) for programs in (256, 1024, 2048, 4096)])
#: --stream-sweep: the ticketed path's slice programs' warps a launch (past
#: ``ticketed_stream_warps``, wider slices streamed in tiles; 1 << 20: held slices only, as
#: before) beside the row and sliced paths, from few to many rows.
STREAM_SWEEP_SHAPES = [(1, 262144), (8, 131072), (8, 262144), (16, 32768), (32, 32768), (48, 32768), (64, 32768),
                       (128, 32768), (256, 32768), (32, 131072), (64, 131072), (128, 131072), (64, 262144),
                       (256, 8192)]
STREAM_SWEEP = ([dict(path="row"), dict(path="sliced")]
                + [dict(path="ticketed", ticketed_stream_warps=n) for n in (1 << 20, 4096, 2048, 1024, 512, 256)])
#: --bits-sweep: the register path's 8-bit digits (16 keys a thread) against its 4-bit default, and the
#: other paths' 4-bit digits (16-bin histograms) against their 8-bit default; their group-maximum bound
#: keeps its bits (twice the passes) or its passes (half the bits).
BITS_SWEEP_SHAPES = [(1, 2048), (64, 2048), (2048, 2048), (1, 8192), (64, 8192), (1, 32768), (8, 32768),
                     (64, 32768), (1, 131072), (8, 262144), (256, 32768), (2048, 8192), (2048, 32768)]
BITS_SWEEP = [dict(), dict(register_keys_per_thread=16, register_radix_bits=8),
              dict(radix_bits=4, bound_passes=4, ticketed_bound_passes=2), dict(radix_bits=4)]


def sweep(args, path="row", grid=SWEEP, sweep_shapes=SWEEP_SHAPES, name=None, with_torch=False):
    """A path's µs per tuning, on ``sweep_shapes`` (results checked against the default's).

    ``grid``: field -> values (every combination), or a list of field dicts (those variants,
    which may force another path).  ``with_torch``: ``torch.topk`` timed on each shape too."""
    import itertools

    import torch

    import qsa_torch
    from qsa_kernels.tuning import TopkTuning

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = [(1, 64), (3, 300)] if args.smoke else ([(rows, columns) for _, rows, columns in args.shapes]
                                                     if args.shapes else sweep_shapes)
    k = SMOKE["K"] if args.smoke else K
    generator = torch.Generator(device=device).manual_seed(0)
    row = TopkTuning(path=path)
    variants = grid if isinstance(grid, list) else [dict(zip(grid, values))
                                                    for values in itertools.product(*grid.values())]
    defaults = {field: getattr(row, field) for variant in variants for field in variant}
    results = []
    for rows, columns in shapes:
        logits = torch.randn(rows, columns, device=device, generator=generator).abs_()
        visible = torch.full((rows,), columns, device=device, dtype=torch.int32)
        _, expected = ours_us(qsa_torch, row, logits, visible, k, args.smoke)
        if with_torch:
            torch_us = timed_us(lambda: torch.topk(logits, k, dim=1, sorted=False), args.smoke)
            results.append(dict(rows=rows, columns=columns, k=k, torch_topk_us=torch_us))
            common.print_table([results[-1]], list(results[-1]))
        for fields in variants:
            us, out = ours_us(qsa_torch, dataclasses.replace(row, **fields), logits, visible, k, args.smoke)
            result = dict(rows=rows, columns=columns, k=k, **fields, **{f"{fields.get('path', path)}_us": us},
                          matches=bool(torch.equal(out, expected)))
            results.append(result)
            common.print_table([result], list(result))
    name = name or ("topk_sweep.json" if path == "row" else f"topk_{path}_sweep.json")
    default = args.json == os.path.join(common.results_dir(), "topk.json")
    out = args.json.replace("topk.json", name) if default else args.json
    common.write_json(out, f"topk_blocks {path}-path tuning sweep", results,
                      [f"defaults {defaults}; CUDA-graph replay, median us per call; logits |N(0,1)|"])


#: The sweeps, each run instead of the grid: flag -> (its help, :func:`sweep`'s arguments after ``args``).
SWEEPS = {
    "--sweep": ("time the row path's tuning instead of the grid", {}),
    "--register-sweep": ("time the register path's tuning instead of the grid",
                         dict(path="register", grid=REGISTER_SWEEP, sweep_shapes=REGISTER_SWEEP_SHAPES)),
    "--ticketed-sweep": ("time the ticketed path's tuning instead of the grid",
                         dict(path="ticketed", grid=TICKETED_SWEEP, sweep_shapes=TICKETED_SWEEP_SHAPES)),
    "--wide-sweep": ("time the sliced path's programs a row and the row path's warps on many wide rows",
                     dict(path="row", grid=WIDE_SWEEP, sweep_shapes=WIDE_SWEEP_SHAPES, name="topk_wide_sweep.json",
                          with_torch=True)),
    "--stream-sweep": ("time the ticketed path's streamed slices beside the row and sliced paths instead",
                       dict(path="ticketed", grid=STREAM_SWEEP, sweep_shapes=STREAM_SWEEP_SHAPES,
                            name="topk_stream_sweep.json", with_torch=True)),
    "--bits-sweep": ("time the plan's path with its default radix digits, the register path's old 8-bit ones, "
                     "and 4-bit ones for the other paths instead",
                     dict(path="auto", grid=BITS_SWEEP, sweep_shapes=BITS_SWEEP_SHAPES, name="topk_bits_sweep.json",
                          with_torch=True)),
}


def main():
    parser = common.parser(__doc__, "topk.json")
    sweeps = parser.add_mutually_exclusive_group()
    for flag, (text, _) in SWEEPS.items():
        sweeps.add_argument(flag, action="store_true", help=text)
    args = parser.parse_args()
    if args.shapes and args.json == parser.get_default("json"):
        args.json = args.json.replace("topk.json", "topk_shapes.json")
    for flag, (_, arguments) in SWEEPS.items():
        if getattr(args, flag[2:].replace("-", "_")):
            return sweep(args, **arguments)
    import torch

    import qsa_kernels.topk as topk_plans
    import qsa_torch
    from qsa_kernels.tuning import TopkTuning

    try:
        import jax

        jax_gpu = any(d.platform == "gpu" for d in jax.devices())
    except Exception:  # noqa: BLE001 -- JAX is optional here
        jax = None
        jax_gpu = False
    g = dict(K=K, ROWS=ROWS, COLUMNS=COLUMNS, MAX_LOGITS_BYTES=MAX_LOGITS_BYTES, MAX_LAX_BYTES=MAX_LAX_BYTES)
    if args.smoke:
        g.update(SMOKE)
    k = g["K"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device=device).manual_seed(0)
    auto = TopkTuning()  # the defaults: path "auto"
    started = time.perf_counter()
    notes = [
        f"k = {k}; logits |N(0,1)| fp32, every column visible; CUDA-graph replay, median us per call",
        "ours_us: TopkTuning.path auto (path = the plan's choice); register_us / row_us / ticketed_us / sliced_us: "
        f"each path forced (register_us up to {topk_plans.REGISTER_MAX_TILE} columns)",
        "torch_topk_us: torch.topk(sorted=False); lax_topk_us: jax.lax.top_k, jitted fori_loop per call",
        "one pass = R x C x 4 bytes; *_gbps = one pass / time; register path reads a row once, row and "
        "ticketed paths twice, sliced thrice",
        f"skipped: logits above {g['MAX_LOGITS_BYTES'] >> 20} MiB; lax.top_k above {g['MAX_LAX_BYTES'] >> 20} MiB"
        + ("" if jax_gpu else " and everywhere (no JAX GPU in this process)"),
    ]
    # --shapes decode:R:C,...: only those (rows, columns), in their own JSON (not the grid's).
    grid = ([(rows, columns) for _, rows, columns in args.shapes] if args.shapes and not args.smoke else
            [(rows, columns) for rows in g["ROWS"] for columns in g["COLUMNS"]])
    if args.shapes and not args.smoke:
        notes.append("shapes: " + ", ".join(f"{rows} x {columns}" for rows, columns in grid) + " (--shapes)")
    results = []
    for rows, columns in grid:
        nbytes = rows * columns * 4
        if nbytes > g["MAX_LOGITS_BYTES"]:
            continue
        if time.perf_counter() - started > HARD_STOP_S:
            notes.append(f"stopped after {HARD_STOP_S:.0f} s: ({rows}, {columns}) and later shapes skipped")
            break
        logits = torch.randn(rows, columns, device=device, generator=generator).abs_()
        visible = torch.full((rows,), columns, device=device, dtype=torch.int32)
        row = dict(rows=rows, columns=columns, k=k, bytes_one_pass=nbytes,
                   path=topk_plans.topk_path(rows, columns, k, auto))
        row["ours_us"], expected = ours_us(qsa_torch, auto, logits, visible, k, args.smoke)
        for path in ("register", "row", "ticketed", "sliced"):
            if path == "register" and columns > topk_plans.REGISTER_MAX_TILE:
                continue
            forced = dataclasses.replace(auto, path=path)
            row[f"{path}_us"], out = ours_us(qsa_torch, forced, logits, visible, k, args.smoke)
            row[f"{path}_matches"] = bool(torch.equal(out, expected))
        row["torch_topk_us"] = timed_us(lambda: torch.topk(logits, k, dim=1, sorted=False), args.smoke)
        if jax_gpu and nbytes <= g["MAX_LAX_BYTES"]:
            torch.cuda.synchronize()
            row["lax_topk_us"] = lax_topk_us(jax, common.to_jax(logits), k, args.smoke)
        for name in ("ours", "register", "row", "ticketed", "sliced", "torch_topk", "lax_topk"):
            row[f"{name}_gbps"] = common.gbps(nbytes, row.get(f"{name}_us"))
        for name in ("torch_topk", "sliced", "lax_topk"):
            if row.get(f"{name}_us") and row["ours_us"]:
                row[f"speedup_vs_{name}"] = row[f"{name}_us"] / row["ours_us"]
        results.append(row)
        common.print_table([row], list(row))
        del logits, visible
    summary = {}
    for name in ("torch_topk", "sliced", "lax_topk"):
        speedups = [r[f"speedup_vs_{name}"] for r in results if f"speedup_vs_{name}" in r]
        if speedups:
            summary[f"median_speedup_vs_{name}"] = statistics.median(speedups)
            summary[f"min_speedup_vs_{name}"] = min(speedups)
    notes.append("summary: " + ", ".join(f"{key} {value:.2f}" for key, value in summary.items()))
    notes.append(f"total run time {time.perf_counter() - started:.0f} s")
    common.print_table(results, ["rows", "columns", "path", "ours_us", "register_us", "row_us", "ticketed_us",
                                 "sliced_us", "torch_topk_us", "lax_topk_us", "speedup_vs_torch_topk",
                                 "speedup_vs_sliced", "ours_gbps", "register_matches", "row_matches",
                                 "ticketed_matches", "sliced_matches"])
    print(notes[-2])
    common.write_json(args.json, "topk_blocks paths vs torch.topk and jax.lax.top_k", results, notes)


if __name__ == "__main__":
    main()
