"""Stage 3 benchmark: block scoring, exact top-k and the fused selection.

Production geometry: indexer 4 heads x d128, bf16 queries and compressed keys,
compress ratio 4, compressed pages of 64, top-512 blocks (token_topk 2048).
Contexts 8K/32K/128K/512K/1M tokens (columns = context / 4); decode: 1, 8, 64,
256 rows (one request each); prefill: chunks of 256 and 2048 rows of one
request (contexts up to 128K only: larger ones are skipped to keep the run
short).  Every request maps its pages onto random distinct pages of one shared
pool, so 256 requests x 1M tokens need no 16 GB of keys.

Per shape:
- scorer (``mqa_paged_scores``): µs and GB/s.  Bytes: decode reads each row's
  request keys once per row, plus the logits written; prefill counts the
  request's keys once (unique bytes; L2 serves the other rows' reads) plus
  the logits written, which dominate.
- top-k (``topk_blocks``, k = 512) against ``torch.topk(sorted=False)`` on the
  same logits, and ``jax.lax.top_k`` on a subset of shapes;
- ``select_paged_tokens`` end to end (torch; JAX on a subset), its launches
  per call (observed) and, where the fused selection runs (decode rows whose
  top-k is ticketed), the three launches it replaces (``SelectTuning(fused=
  False)``) timed in the same run, and whether both give the same bits.
``--fp8``: on decode 1/8/64/256 at 32K/128K and the 2048-row prefill, the
scorer and the selection also read an fp8 e4m3 copy of the key pool (one
per-tensor scale, pool amax / 448), side by side: ``fp8_*`` columns,
``fp8_scorer_vs_bf16`` (CUDA-graph time ratio), and the selection agreement
with bf16 (fraction of a row's top-k blocks both select: mean and min over
rows).  fp8 bytes count 1 byte per key element plus the scale.
``fp8_scorer_<variant>_*``: the fp8 scorer under the SelectTuning variants of
FP8_SCORER_VARIANTS, with ``_equal``: logits bitwise the default's.
``--fp8-sweep``: only the fp8 scorer, at decode 8/64/256 x 128K: the bf16 scorer,
the fp8 default and each FP8_SWEEP candidate (issue 27's row loop) in one process.
torch: CUDA-graph replay (device time; fewer calls per graph for slow
shapes) and do_bench (median, L2 flushed) for the scorer.  JAX: wall clock of
back-to-back jitted calls (host overhead included) and, for the selection and
the top-k, a jitted fori_loop (device-time estimate).
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the card

import common  # noqa: E402
from qsa_kernels import tuning  # noqa: E402
from qsa_kernels.tuning import SelectTuning  # noqa: E402

HEADS, D, RATIO, PAGE, TOKEN_TOPK = 4, 128, 4, 64, 2048
DECODE_ROWS = [1, 8, 64, 256]
PREFILL_ROWS = [256, 2048]
CONTEXTS = [8192, 32768, 131072, 524288, 1048576]
PREFILL_CONTEXTS = [8192, 32768, 131072]
POOL_BYTES = 2 << 30
JAX_SHAPES = {("decode", 1, 131072), ("decode", 64, 32768), ("prefill", 256, 32768)}
LAX_TOPK_SHAPES = JAX_SHAPES | {("decode", 1, 1048576), ("decode", 256, 131072), ("prefill", 2048, 131072)}
GRAPH_BUDGET_S = 0.2  # per CUDA-graph measurement: fewer calls per graph for slow shapes
DEADLINE_S = 90.0  # past this, JAX measurements are skipped (noted in the JSON)
HARD_STOP_S = 110.0  # past this, remaining shapes are skipped (noted in the JSON)
# docs/design.md, "What the seed's kernels do on the H200" (CUDA-graph replay).
SEED_SCORER_US = {("decode", 256, 131072): 850.0, ("prefill", 2048, 131072): 6314.0}
SEED_TOPK_US = {("decode", 1, 131072): 43.0, ("decode", 256, 131072): 167.0}

FP8_SHAPES = {(mode, rows, context) for mode, rows in (("decode", 1), ("decode", 8), ("decode", 64),
                                                      ("decode", 256), ("prefill", 2048))
              for context in (32768, 131072)}
FP8_EXTRA_S = 60.0  # --fp8: added to DEADLINE_S and HARD_STOP_S
#: --fused-sweep: the fused selection's (fused_score_columns, fused_warps) variants.
FUSED_SWEEP = [(columns, warps) for warps in (8, 16) for columns in (128, 256, 512, 1024)]
FUSED_SWEEP_EXTRA_S = 150.0  # --fused-sweep: added to the deadlines
#: --fp8: the scorer also under these SelectTuning variants (fp8_scorer_<name>_* columns).
FP8_SCORER_VARIANTS = {
    "256_columns": dict(fp8_row_columns=256),
    "8_warps": dict(fp8_row_warps=8),
    "2_warps": dict(fp8_row_warps=2),
}

#: --fp8-sweep (issue 27): the fp8 scorer's row-loop candidates (SelectTuning fields), each
#: timed beside the default fp8 scorer and the bf16 one on FP8_SWEEP_SHAPES, in one process.
FP8_SWEEP = {
    "loop_8": dict(fp8_row_tiles=8),
    "loop_8_no_prefetch": dict(fp8_row_tiles=8, fp8_row_prefetch=False),
    "loop_4": dict(fp8_row_tiles=4),
    "loop_16": dict(fp8_row_tiles=16),
    "loop_8_1024_programs": dict(fp8_row_tiles=8, fp8_row_min_programs=1024),
    "loop_8_3_stages": dict(fp8_row_tiles=8, fp8_row_prefetch=False, fp8_row_stages=3),
    "loop_8_8_warps": dict(fp8_row_tiles=8, fp8_row_warps=8),
}
FP8_SWEEP_SHAPES = [("decode", rows, 131072) for rows in (8, 64, 256)]

SMOKE = dict(PAGE=16, TOKEN_TOPK=32, DECODE_ROWS=[1, 2], PREFILL_ROWS=[8], CONTEXTS=[512, 2048],
             PREFILL_CONTEXTS=[512], POOL_BYTES=1 << 20, JAX_SHAPES={("decode", 1, 512)},
             LAX_TOPK_SHAPES={("decode", 1, 512)}, FP8_SHAPES={("decode", 2, 2048), ("prefill", 8, 512)})


def make_shape(torch, g, mode, rows, context, pool, device, generator):
    """The scorer's arguments for one shape (pages drawn from the shared pool)."""
    columns = context // RATIO
    width = columns // g["PAGE"]
    requests = rows if mode == "decode" else 1
    permutation = torch.randperm(pool.shape[0], device=device, generator=generator)
    starts = torch.randint(0, pool.shape[0], (requests, 1), device=device, generator=generator)
    page_table = permutation[(starts + torch.arange(width, device=device)) % pool.shape[0]].to(torch.int32)
    if mode == "decode":
        positions = torch.full((rows,), context - 1, device=device, dtype=torch.int32)
        token_to_req = torch.arange(rows, device=device, dtype=torch.int32)
    else:
        positions = torch.arange(context - rows, context, device=device, dtype=torch.int32)
        token_to_req = torch.zeros(rows, device=device, dtype=torch.int32)
    q = torch.randn(rows, HEADS, D, device=device, generator=generator).to(torch.bfloat16)
    return dict(q=q, k_cache=pool, page_table=page_table, token_to_req=token_to_req, query_positions=positions,
                sequence_lengths=torch.full((requests,), context, device=device, dtype=torch.int32))


def scorer_bytes(mode, rows, columns, key_bytes=2):
    key_rows = rows * columns if mode == "decode" else columns  # prefill: unique keys
    scale = 4 if key_bytes == 1 else 0  # fp8: the per-tensor scale
    return key_rows * D * key_bytes + rows * columns * 4 + rows * HEADS * D * 2 + scale


def fp8_pool(torch, pool):
    """An fp8 e4m3 copy of a bf16 pool and its per-tensor scale (see common.fp8_pool)."""
    return common.fp8_pool(pool, chunk=8192)


def block_agreement(torch, a, b, columns):
    """Per row, the fraction of a's top-k blocks (-1 padded) that b selects too: (mean, min)."""
    def chosen(blocks):
        hot = torch.zeros(blocks.shape[0], columns + 1, dtype=torch.bool, device=blocks.device)
        return hot.scatter_(1, torch.where(blocks < 0, columns, blocks).long(), True)[:, :columns]
    both = (chosen(a) & chosen(b)).sum(1).float() / (a >= 0).sum(1).clamp(min=1).float()
    return float(both.mean()), float(both.min())


def select_launches(select) -> tuple[int, bool]:
    """(kernel launches of one call, observed; whether the fused selection ran)."""
    from qsa_kernels.launch import observe_launches

    with observe_launches() as events:
        select()
    return len(events), any(event.kernel == "select_fused_kernel" for event in events)


def graph_us(fn, smoke, estimate_us=None):
    """CUDA-graph µs per call within this benchmark's budget per measurement."""
    return common.budgeted_graph_us(fn, smoke, GRAPH_BUDGET_S, estimate_us)


def jax_topk_us(jax, qsa_jax, logits, visible, k, smoke):
    """Ours (jax) and lax.top_k: wall µs per call and fori_loop µs per step.

    The loop threads each result into one element of the next input (an
    in-place update), so XLA can neither hoist nor drop a call."""
    jnp = jax.numpy
    calls = 2 if smoke else 20
    ours = jax.jit(qsa_jax.topk_blocks, static_argnums=2)
    lax = jax.jit(lambda x: jax.lax.top_k(x, k))
    result = dict(jax_topk_wall_us=common.jax_wall_us(ours, (logits, visible, k), calls=calls, smoke=smoke),
                  lax_topk_wall_us=common.jax_wall_us(lax, (logits,), calls=calls, smoke=smoke))

    def ours_step(carry):
        x, v = carry
        out = qsa_jax.topk_blocks(x, v, k)
        return x, v.at[0].set(jnp.where(out[0, 0] == -12345, v[0] + 1, v[0]))

    def lax_step(x):
        _, index = jax.lax.top_k(x, k)
        return x.at[0, 0].set(jnp.where(index[0, 0] == -12345, 1.0, x[0, 0]))

    result["jax_topk_loop_us"] = common.jax_loop_us(ours_step, (logits, visible), calls=calls, smoke=smoke)
    result["lax_topk_loop_us"] = common.jax_loop_us(lax_step, logits, calls=calls, smoke=smoke)
    return result


def jax_select_us(jax, qsa_jax, arrays, topk, smoke):
    jnp = jax.numpy
    calls = 2 if smoke else 20
    args = tuple(common.to_jax(a) for a in arrays.values())
    select = jax.jit(qsa_jax.select_paged_tokens, static_argnums=(6, 7))
    wall = common.jax_wall_us(select, args + (topk, RATIO), calls=calls, smoke=smoke)

    def step(carry):
        out = qsa_jax.select_paged_tokens(*carry, topk, RATIO)
        positions = carry[4]
        positions = positions.at[0].set(jnp.where(out[0, 0] == -12345, positions[0] + 1, positions[0]))
        return (*carry[:4], positions, carry[5])

    return wall, common.jax_loop_us(step, args, calls=calls, smoke=smoke)


def fp8_sweep(torch, qsa_torch, g, pool, shapes, device, generator, smoke):
    """--fp8-sweep: per shape, the bf16 scorer, the fp8 default, each FP8_SWEEP candidate
    (``fp8_<name>_graph_us``, ``_vs_bf16``, ``_vs_default``; ``_equal``: logits and visible
    blocks bitwise the default's) and the fp8 default again (drift), CUDA-graph µs."""
    pool8, k_scale = fp8_pool(torch, pool)
    rows_out = []
    for mode, rows, context in shapes:
        arrays = make_shape(torch, g, mode, rows, context, pool, device, generator)
        columns = context // RATIO
        fp8_arrays = dict(arrays, k_cache=pool8, k_scale=k_scale)
        score = lambda: qsa_torch.mqa_paged_scores(**arrays, compress_ratio=RATIO)  # noqa: E731
        score8 = lambda: qsa_torch.mqa_paged_scores(**fp8_arrays, compress_ratio=RATIO)  # noqa: E731
        row = dict(mode=mode, rows=rows, context=context, columns=columns,
                   scorer_bytes=scorer_bytes(mode, rows, columns),
                   fp8_scorer_bytes=scorer_bytes(mode, rows, columns, key_bytes=1))
        row["bf16_graph_us"] = graph_us(score, smoke)
        row["bf16_pct_peak"] = common.pct_peak(row["scorer_bytes"], row["bf16_graph_us"])
        row["fp8_default_graph_us"] = graph_us(score8, smoke)
        default_logits, default_visible = score8()
        for name, variant in [("default", {})] + list(FP8_SWEEP.items()):
            if name != "default":
                with tuning.override(select=SelectTuning(**variant)):
                    row[f"fp8_{name}_graph_us"] = graph_us(score8, smoke)
                    logits, visible = score8()
                row[f"fp8_{name}_equal"] = bool(torch.equal(logits, default_logits)
                                                and torch.equal(visible, default_visible))
                del logits, visible
            us = row[f"fp8_{name}_graph_us"]
            if us:
                row[f"fp8_{name}_pct_peak"] = common.pct_peak(row["fp8_scorer_bytes"], us)
                if row["bf16_graph_us"]:
                    row[f"fp8_{name}_vs_bf16"] = us / row["bf16_graph_us"]
                if row["fp8_default_graph_us"]:
                    row[f"fp8_{name}_vs_default"] = us / row["fp8_default_graph_us"]
        row["fp8_default_again_graph_us"] = graph_us(score8, smoke)
        del default_logits, default_visible
        rows_out.append(row)
        common.print_table([row], list(row))
    return rows_out


def main():
    parser = common.parser(__doc__, "select.json")
    parser.add_argument("--fused-sweep", action="store_true",
                        help="where the selection is fused: also time it under every FUSED_SWEEP variant "
                             "(fused_<columns>c_<warps>w_graph_us, _equal: the three launches' bits)")
    parser.add_argument("--fp8", action="store_true",
                        help="also score an fp8 e4m3 key pool (per-tensor scale) on FP8_SHAPES, side by side")
    parser.add_argument("--fp8-sweep", action="store_true",
                        help="only the fp8 scorer: the default and each FP8_SWEEP candidate beside the bf16 scorer "
                             "on FP8_SWEEP_SHAPES (--shapes to change them), then exit")
    args = parser.parse_args()
    import jax
    import torch

    import qsa_jax
    import qsa_torch

    started = time.perf_counter()
    g = dict(PAGE=PAGE, TOKEN_TOPK=TOKEN_TOPK, DECODE_ROWS=DECODE_ROWS, PREFILL_ROWS=PREFILL_ROWS,
             CONTEXTS=CONTEXTS, PREFILL_CONTEXTS=PREFILL_CONTEXTS, POOL_BYTES=POOL_BYTES,
             JAX_SHAPES=JAX_SHAPES, LAX_TOPK_SHAPES=LAX_TOPK_SHAPES, FP8_SHAPES=FP8_SHAPES)
    if args.smoke:
        g.update(SMOKE)
        if args.fp8_sweep:  # the candidates' kernel needs a tile within two pages
            g["PAGE"] = PAGE
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device=device).manual_seed(0)
    page_bytes = g["PAGE"] * D * 2
    pool_pages = max(g["POOL_BYTES"] // page_bytes, max(g["CONTEXTS"]) // RATIO // g["PAGE"])
    pool = torch.empty(pool_pages, g["PAGE"], 1, D, device=device, dtype=torch.bfloat16).normal_()
    extra_s = (FP8_EXTRA_S if args.fp8 else 0.0) + (FUSED_SWEEP_EXTRA_S if args.fused_sweep else 0.0)
    deadline_s, hard_stop_s = DEADLINE_S + extra_s, HARD_STOP_S + extra_s
    if args.fp8_sweep:
        started = time.perf_counter()
        if args.json == parser.get_default("json"):  # not over the full run's select.json
            args.json = args.json.replace("select.json", "select_fp8_sweep.json")
        sweep_shapes = args.shapes or ([("decode", r, c) for c in g["CONTEXTS"][-1:] for r in g["DECODE_ROWS"]]
                                       if args.smoke else FP8_SWEEP_SHAPES)
        rows_out = fp8_sweep(torch, qsa_torch, g, pool, sweep_shapes, device, generator, args.smoke)
        names = ["default", *FP8_SWEEP]
        common.print_table(rows_out, ["rows", "context", "bf16_graph_us", "fp8_default_again_graph_us"]
                           + [f"fp8_{name}_{what}" for name in names for what in ("graph_us", "vs_bf16")])
        common.write_json(args.json, "fp8 scorer sweep (mqa_paged_scores, issue 27)", rows_out, [
            f"pool of {pool_pages} pages shared by all requests (random distinct pages per request); fp8: an e4m3 "
            "copy (per-tensor scale amax / 448)", "*_graph_us: CUDA-graph replay per call (L2 warm)",
            "candidates (SelectTuning fields): " + "; ".join(f"{k}: {v}" for k, v in FP8_SWEEP.items()),
            "*_equal: logits and visible blocks bitwise the fp8 default's",
            f"total run time {time.perf_counter() - started:.0f} s"])
        return
    if args.fp8:
        pool8, k_scale = fp8_pool(torch, pool)
    k = g["TOKEN_TOPK"] // RATIO
    notes = [
        f"geometry: {HEADS} heads x d{D} bf16, ratio {RATIO}, compressed pages of {g['PAGE']}, top-{k} blocks "
        f"(token_topk {g['TOKEN_TOPK']}); pool of {pool_pages} pages ({pool_pages * page_bytes / 2**30:.1f} GiB) "
        "shared by all requests through random distinct pages per request",
        "scorer bytes: decode = each row's request keys once per row + logits written + q; prefill = the "
        "request's keys once (unique bytes) + logits written (the bulk) + q",
        "*_graph_us: CUDA-graph replay per call (device time, L2 warm; 20 calls per graph, fewer for slow "
        "shapes); scorer_us: do_bench median (L2 flushed)",
        "torch_topk: torch.topk(logits, k, sorted=False) on the scorer's logits (ours also orders columns)",
        "jax_*_wall_us: back-to-back jitted calls, wall clock per call (host overhead included); "
        "jax_*_loop_us: one jitted fori_loop of calls, per call (device-time estimate)",
        f"skipped: prefill at contexts above {max(g['PREFILL_CONTEXTS'])}; JAX selection/top-k only on "
        f"{sorted(g['JAX_SHAPES'])}; lax.top_k only on {sorted(g['LAX_TOPK_SHAPES'])}",
        "seed_*: docs/design.md's H200 table (CUDA-graph replay); the seed's top-k is torch.topk at 1 x 32768 cols "
        "(43 us) and 256 x 32768 (167 us)",
        *([f"fp8_*: the same calls on an fp8 e4m3 copy of the pool (per-tensor scale = amax / 448) on "
           f"{sorted(g['FP8_SHAPES'])}; fp8 bytes: 1 byte per key element + the scale; "
           "fp8_block_agreement_*: fraction of a row's top-k blocks (bf16 logits) that the fp8 logits select "
           "too, mean and min over rows"] if args.fp8 else []),
    ]
    shapes = [("decode", r, c) for c in g["CONTEXTS"] for r in g["DECODE_ROWS"]]
    shapes += [("prefill", r, c) for c in g["PREFILL_CONTEXTS"] for r in g["PREFILL_ROWS"]]
    shapes = args.shapes or shapes
    rows_out = []
    for mode, rows, context in shapes:
        if time.perf_counter() - started > hard_stop_s:
            notes.append(f"stopped after {hard_stop_s:.0f} s: shape {(mode, rows, context)} and later ones skipped")
            break
        arrays = make_shape(torch, g, mode, rows, context, pool, device, generator)
        columns = context // RATIO
        row = dict(mode=mode, rows=rows, context=context, columns=columns)
        score = lambda: qsa_torch.mqa_paged_scores(**arrays, compress_ratio=RATIO)  # noqa: E731
        logits, visible = score()
        nbytes = scorer_bytes(mode, rows, columns)
        row["scorer_bytes"] = nbytes
        row["scorer_us"] = common.torch_median_us(score, args.smoke)
        row["scorer_graph_us"] = graph_us(score, args.smoke, row["scorer_us"])
        row["scorer_graph_gbps"] = common.gbps(nbytes, row["scorer_graph_us"])
        row["scorer_graph_pct_peak"] = common.pct_peak(nbytes, row["scorer_graph_us"])

        row["topk_graph_us"] = graph_us(lambda: qsa_torch.topk_blocks(logits, visible, k), args.smoke)
        row["torch_topk_graph_us"] = graph_us(lambda: torch.topk(logits, k, dim=1, sorted=False), args.smoke)
        if row["topk_graph_us"] and row["torch_topk_graph_us"]:
            row["topk_speedup_vs_torch"] = row["torch_topk_graph_us"] / row["topk_graph_us"]

        select = lambda: qsa_torch.select_paged_tokens(**arrays, token_topk=g["TOKEN_TOPK"],  # noqa: E731
                                                       compress_ratio=RATIO)
        row["select_graph_us"] = graph_us(select, args.smoke)
        row["select_launches"], row["select_fused"] = select_launches(select)
        if row["select_fused"]:
            # The same selection as three launches (score, top-k, expand), in the same process.
            with tuning.override(select=SelectTuning(fused=False)):
                row["select_unfused_graph_us"] = graph_us(select, args.smoke)
                unfused = select()
            row["select_fused_equal"] = bool(torch.equal(select(), unfused))
            for columns, warps in FUSED_SWEEP if args.fused_sweep else ():
                with tuning.override(select=SelectTuning(fused_score_columns=columns, fused_warps=warps)):
                    name = f"fused_{columns}c_{warps}w"
                    row[f"{name}_graph_us"] = graph_us(select, args.smoke)
                    row[f"{name}_equal"] = bool(torch.equal(select(), unfused))
            if row["select_graph_us"] and row["select_unfused_graph_us"]:
                row["select_fused_speedup"] = row["select_unfused_graph_us"] / row["select_graph_us"]
        shape = (mode, rows, context)
        if not args.smoke:
            for key, table in (("seed_scorer_us", SEED_SCORER_US), ("seed_topk_us", SEED_TOPK_US)):
                if shape in table:
                    row[key] = table[shape]
            if "seed_scorer_us" in row and row["scorer_graph_us"]:
                row["scorer_speedup_vs_seed"] = row["seed_scorer_us"] / row["scorer_graph_us"]

        if args.fp8 and shape in g["FP8_SHAPES"]:
            fp8_arrays = dict(arrays, k_cache=pool8, k_scale=k_scale)
            score8 = lambda: qsa_torch.mqa_paged_scores(**fp8_arrays, compress_ratio=RATIO)  # noqa: E731
            row["fp8_scorer_bytes"] = scorer_bytes(mode, rows, columns, key_bytes=1)
            row["fp8_scorer_graph_us"] = graph_us(score8, args.smoke)
            row["fp8_scorer_graph_pct_peak"] = common.pct_peak(row["fp8_scorer_bytes"], row["fp8_scorer_graph_us"])
            if row["fp8_scorer_graph_us"] and row["scorer_graph_us"]:
                row["fp8_scorer_vs_bf16"] = row["fp8_scorer_graph_us"] / row["scorer_graph_us"]
            select8 = lambda: qsa_torch.select_paged_tokens(**fp8_arrays, token_topk=g["TOKEN_TOPK"],  # noqa: E731
                                                            compress_ratio=RATIO)
            row["fp8_select_graph_us"] = graph_us(select8, args.smoke)
            if row["fp8_select_graph_us"] and row["select_graph_us"]:
                row["fp8_select_vs_bf16"] = row["fp8_select_graph_us"] / row["select_graph_us"]
            logits8, _ = score8()
            # The scorer's other fp8 tilings (SelectTuning), each knob alone; logits bitwise
            # the default's (a tiling changes which program scores a column, not its arithmetic).
            for name, variant in FP8_SCORER_VARIANTS.items():
                with tuning.override(select=SelectTuning(**variant)):
                    us = graph_us(score8, args.smoke)
                    row[f"fp8_scorer_{name}_graph_us"] = us
                    if us and row["scorer_graph_us"]:
                        row[f"fp8_scorer_{name}_vs_bf16"] = us / row["scorer_graph_us"]
                    row[f"fp8_scorer_{name}_equal"] = bool(torch.equal(score8()[0], logits8))
            blocks16, blocks8 = qsa_torch.topk_blocks(logits, visible, k), qsa_torch.topk_blocks(logits8, visible, k)
            row["fp8_block_agreement_mean"], row["fp8_block_agreement_min"] = block_agreement(
                torch, blocks16, blocks8, columns)
            del logits8, blocks16, blocks8

        in_time = time.perf_counter() - started < deadline_s
        if shape in g["LAX_TOPK_SHAPES"] | g["JAX_SHAPES"] and not in_time:
            row["jax_skipped"] = "deadline"
        elif shape in g["LAX_TOPK_SHAPES"] | g["JAX_SHAPES"]:
            if device == "cuda":
                torch.cuda.synchronize()
            row.update(jax_topk_us(jax, qsa_jax, common.to_jax(logits), common.to_jax(visible), k, args.smoke))
            if shape in g["JAX_SHAPES"]:
                row["jax_select_wall_us"], row["jax_select_loop_us"] = jax_select_us(
                    jax, qsa_jax, arrays, g["TOKEN_TOPK"], args.smoke)
        del logits, visible
        rows_out.append(row)
        common.print_table([row], list(row))
    if any(r.get("jax_skipped") for r in rows_out):
        notes.append(f"JAX measurements past {deadline_s:.0f} s of run time were skipped (jax_skipped)")
    notes.append(f"total run time {time.perf_counter() - started:.0f} s")
    common.print_table(rows_out, [
        "mode", "rows", "context", "scorer_us", "scorer_graph_us", "scorer_graph_pct_peak", "seed_scorer_us",
        "topk_graph_us", "torch_topk_graph_us", "topk_speedup_vs_torch", "lax_topk_loop_us", "jax_topk_loop_us",
        "select_graph_us", "select_launches", "select_unfused_graph_us", "select_fused_speedup",
        "select_fused_equal", "jax_select_wall_us", "jax_select_loop_us"]
        + (["fp8_scorer_graph_us", "fp8_scorer_graph_pct_peak", "fp8_scorer_vs_bf16", "fp8_select_graph_us",
            "fp8_select_vs_bf16", "fp8_block_agreement_mean", "fp8_block_agreement_min"] if args.fp8 else []))
    common.write_json(args.json, "selection (mqa_paged_scores, topk_blocks, select_paged_tokens)", rows_out, notes)


if __name__ == "__main__":
    main()
