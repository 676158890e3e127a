"""Stage 4 benchmark: split-K sparse paged GQA attention, production geometry.

24 query / 2 KV heads x d256, bf16, pages of 64, 2051 selected tokens per row
(top-512 blocks of 4 tokens + the 3-token causal tail).  Decode: one row per
request at 1/8/64/256/1024 requests; prefill: chunks of 256 and 2048 rows of
one request; contexts 8K/32K/128K.

Every request's block table maps its context onto random distinct pages of one
shared pool (8 GiB of K+V, far beyond L2), so 1024 requests x 128K need no
275 GB of cache.  Decode rows select independent random blocks; prefill rows
rank blocks by one shared score plus per-row noise, so neighbouring rows
overlap as real queries do (the measured overlap is reported).

Reported per shape: the plan's launch choice (splits, BLOCK_N, tiles per
split, warps, stages); qsa_torch by do_bench (L2 flushed) and CUDA-graph
replay (L2 warm); qsa_jax by wall clock and fori_loop on a subset; a dense
baseline (torch SDPA over the whole context, where its K/V fit); the seed's
H200 time where docs/design.md has one.  Bytes: each selected K and V row once per
KV head, plus q, out and the indices; prefill rows re-read tokens their
neighbours selected (L2 serves them), so its "% of peak" may pass 100.

``--sweep`` (a separate tuning run, a few minutes): CUDA-graph µs of launch
configurations around the plan's table (BLOCK_N x warps x stages, and half /
double the split count) on a few shapes, written to sparse_attention_sweep.json
(``--splits 4,8``: those split counts crossed with SPLIT_CANDIDATES instead;
``--configs 16:2:5,32:4:5:3,32:4:2:4:152``: exactly those BLOCK_N:warps:stages[:splits[:maxnreg]],
maxnreg capping the partial launch's registers, a benchmark-only experiment).

``--fp8``: the same shapes (decode 1/8/64/256 at 32K/128K and the 2048-row
prefill) also read fp8 e4m3 copies of the pools (per-tensor scales, pool amax
/ 448), side by side: ``fp8_*`` columns, ``fp8_vs_bf16`` = fp8 / bf16 CUDA-graph
time, ``fp8_rel_diff`` = ‖out_fp8 − out_bf16‖ / ‖out_bf16‖; fp8 bytes count 1
byte per K/V element plus the two scales.  ``--sweep`` also times the table's
configuration under the other row addressing (the ``variant`` column);
``--quick`` only the variants and the SWEEP_QUICK candidates; ``--shapes``
picks shapes.  With ``--sweep``, the sweep runs on the fp8 pools (results in
sparse_attention_fp8_sweep.json).

``--only decode`` (or ``prefill``) runs those shapes alone (``_decode`` added
to the file name).

Options beside the plain call (CUDA-graph µs, every shape): ``sinks_graph_us``
(``sinks=`` one logit per query head), ``lse_graph_us`` (``return_lse=True``),
``sinks_lse_graph_us`` (both), each also as a ratio to the plain call
(``*_vs_plain``).  ``merge_graph_us``: ``merge_attention_states`` of two bf16
``[rows, QH, D]`` partial outputs and their float32 lses (one the call's own,
``merge_bytes``: both outs and lses read, one out and lse written), with
``merge_pct_peak`` against the copy rate.  ``--no-options`` skips them.

``merge``: how the plan merges several splits (``in_launch``: merging programs
in the partial launch, AttentionTuning.fused_merge; ``launch``: a merge
launch; ``none``: one split), ``launches`` its launch count.
``--merge-paths``: where the plan splits, also CUDA-graph µs of both merge
paths forced (``fused_merge_graph_us``, ``merge_launch_graph_us``: the same
splits) and whether their outputs are the same bits (``fused_merge_bitwise``);
with ``--fp8`` on the fp8 pools too (``fp8_`` columns).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import unittest.mock

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the card

import common  # noqa: E402
from qsa_kernels import tuning  # noqa: E402
from qsa_kernels.tuning import ROW_ADDRESSING_MODES, AttentionTuning  # noqa: E402

QH, KH, D, PAGE = 24, 2, 256, 64
TOKEN_TOPK, COMPRESS_RATIO = 2048, 4
DECODE_ROWS = [1, 8, 64, 256, 1024]
PREFILL_ROWS = [256, 2048]
CONTEXTS = [8192, 32768, 131072]
POOL_BYTES = 8 << 30  # K+V of the shared page pool
DENSE_LIMIT_BYTES = 24 << 30  # K+V of the dense baseline
PREFILL_NOISE = 0.25  # per-row score noise against a shared N(0, 1) block score
JAX_SHAPES = {("decode", 1, 32768), ("decode", 64, 32768), ("decode", 256, 32768), ("prefill", 2048, 131072)}
# docs/design.md, "What the seed's kernels do on the H200" (CUDA-graph replay);
# decode cost does not depend on the context (2051 tokens per row whatever it is).
SEED_DECODE_US = {1: 9.7, 64: 121.0, 256: 410.0}
SEED_PREFILL_US = {(2048, 131072): 1306.0}

FP8_SHAPES = {(mode, rows, context) for mode, rows in (("decode", 1), ("decode", 8), ("decode", 64),
                                                      ("decode", 256), ("prefill", 2048))
              for context in (32768, 131072)}
SWEEP_SHAPES = [("decode", 1, 32768), ("decode", 64, 32768), ("decode", 256, 32768), ("prefill", 2048, 131072)]
SWEEP_BLOCK_N, SWEEP_WARPS, SWEEP_STAGES = (16, 32, 64), (2, 4, 8), (2, 3)
# --sweep --quick: (BLOCK_N, warps, stages) candidates of the fp8 table (docs/design.md, "Measured tuning values").
SWEEP_QUICK = ((16, 2, 2), (16, 2, 3), (32, 2, 2), (32, 4, 2), (32, 4, 3), (64, 2, 2), (64, 4, 2), (64, 8, 2), (64, 8, 3))
# --sweep --splits: (BLOCK_N, warps, stages) candidates crossed with the split counts given.
SPLIT_CANDIDATES = ((16, 2, 3), (32, 2, 3), (32, 4, 3), (64, 4, 2), (64, 8, 3))

# Tiny shapes for the CPU interpreter (still split: 67 indices are 3 tiles of 32).
SMOKE = dict(QH=4, KH=2, D=256, PAGE=16, TOKEN_TOPK=64, DECODE_ROWS=[1], PREFILL_ROWS=[4], CONTEXTS=[256],
             POOL_BYTES=1 << 20, DENSE_LIMIT_BYTES=1 << 30, JAX_SHAPES={("decode", 1, 256)},
             FP8_SHAPES={("decode", 1, 256), ("prefill", 4, 256)})


def page_bytes(g) -> int:
    return g["PAGE"] * g["KH"] * g["D"] * 2 * 2  # K and V, bf16


def select_tokens(torch, scores, positions, ratio, topk):
    """Top-``topk`` visible blocks of ``ratio`` tokens per row (ascending), then the causal tail."""
    groups = scores.shape[1]
    visible = (positions + 1) // ratio
    column = torch.arange(groups, device=scores.device)
    scores = scores.masked_fill(column[None, :] >= visible[:, None], float("-inf"))
    blocks = scores.topk(topk, dim=1).indices.sort(dim=1).values
    tokens = (blocks[:, :, None] * ratio + torch.arange(ratio, device=scores.device)).flatten(1)
    tail = positions[:, None] - torch.arange(ratio - 2, -1, -1, device=scores.device)[None, :]
    return torch.cat([tokens, tail], dim=1).to(torch.int32)


def make_shape(torch, g, mode, rows, context, k_pool, v_pool, device, generator):
    """The call's arrays for one shape over the pools (q, k_cache, v_cache, token_indices,
    block_table, token_to_req), and selection statistics."""
    ratio, topk = COMPRESS_RATIO, g["TOKEN_TOPK"] // COMPRESS_RATIO
    pool_pages = k_pool.shape[0]
    context_pages = context // g["PAGE"]
    requests = rows if mode == "decode" else 1
    # Distinct pages per request: a run of one random permutation of the pool.
    permutation = torch.randperm(pool_pages, device=device, generator=generator)
    starts = torch.randint(0, pool_pages, (requests, 1), device=device, generator=generator)
    block_table = permutation[(starts + torch.arange(context_pages, device=device)) % pool_pages].to(torch.int32)
    groups = context // ratio
    if mode == "decode":
        positions = torch.full((rows,), context - 1, device=device)
        scores = torch.rand(rows, groups, device=device, generator=generator)
        token_to_req = torch.arange(rows, device=device, dtype=torch.int32)
    else:
        positions = torch.arange(context - rows, context, device=device)
        shared = torch.randn(1, groups, device=device, generator=generator)
        scores = shared + PREFILL_NOISE * torch.randn(rows, groups, device=device, generator=generator)
        token_to_req = torch.zeros(rows, device=device, dtype=torch.int32)
    token_indices = select_tokens(torch, scores, positions, ratio, topk)
    q = torch.randn(rows, g["QH"], g["D"], device=device, generator=generator).to(torch.bfloat16)
    stats = {}
    if mode == "prefill":
        stats["unique_tokens"] = int(torch.unique(token_indices).numel())
        # Block tokens are sorted per row: look each up in the previous row.
        current, previous = token_indices[1:, :-(ratio - 1)], token_indices[:-1, :-(ratio - 1)].contiguous()
        at = torch.searchsorted(previous, current.contiguous()).clamp(max=previous.shape[1] - 1)
        stats["neighbour_overlap"] = float((previous.gather(1, at) == current).float().mean())
    arrays = dict(q=q, k_cache=k_pool, v_cache=v_pool, token_indices=token_indices, block_table=block_table,
                  token_to_req=token_to_req)
    return arrays, stats


def moved_bytes(g, rows, width, cache_bytes=2):
    """Selected K and V rows (``cache_bytes`` per element; fp8 adds its two 4-byte scales), q, out, indices."""
    scales = 2 * 4 if cache_bytes == 1 else 0
    return rows * g["KH"] * width * g["D"] * cache_bytes * 2 + 2 * rows * g["QH"] * g["D"] * 2 + rows * width * 4 + scales


def fp8_pool(torch, pool):
    """An fp8 e4m3 copy of a bf16 pool and its per-tensor scale (see common.fp8_pool)."""
    return common.fp8_pool(pool, chunk=4096)


def dense_baseline(torch, g, mode, rows, context, q, device):
    """SDPA over the full context for the same rows, as (fn, bytes), or None if its K/V do not fit."""
    import torch.nn.functional as F

    batch = rows if mode == "decode" else 1
    kv_bytes = 2 * batch * g["KH"] * context * g["D"] * 2
    if kv_bytes > g["DENSE_LIMIT_BYTES"]:
        return None
    group = g["QH"] // g["KH"]
    k = torch.empty(batch, g["KH"], context, g["D"], device=device, dtype=torch.bfloat16).normal_()
    v = torch.empty_like(k).normal_()
    # GQA as MQA per KV head: a KV head's query heads (and, for prefill, its
    # rows) form the query sequence; no mask (decode sees the whole context;
    # prefill is shown non-causal, an upper bound of the causal cost).
    if mode == "decode":
        dense_q = q.view(rows, g["KH"], group, g["D"])
    else:
        dense_q = q.view(rows, g["KH"], group, g["D"]).permute(1, 0, 2, 3).reshape(1, g["KH"], rows * group, g["D"])
    return (lambda: F.scaled_dot_product_attention(dense_q, k, v)), kv_bytes + 2 * q.numel() * 2


def plan_choice(qsa_torch, attention, arrays):
    """The plan's launch choice; ``merge``: how several splits are merged ("in_launch":
    AttentionTuning.fused_merge's merging programs, "launch": a merge launch, "none": one split)."""
    program = qsa_torch.sparse_paged_attention.plan(**arrays)
    partial = program.launches[0]
    in_launch = partial.kernel is attention.sparse_attention_fused_merge_kernel
    splits = program.buffer("partial_lse").shape[0]
    return dict(splits=splits, block_n=partial.constexprs["BLOCK_N"],
                tiles_per_split=partial.constexprs["TILES_PER_SPLIT"],
                warps=partial.num_warps, stages=partial.num_stages, launches=len(program.launches),
                merge="in_launch" if in_launch else "launch" if splits > 1 else "none")


def merge_paths(torch, qsa_torch, arrays, smoke):
    """``--merge-paths``: CUDA-graph µs of the split-K merged in its launch and by a merge
    launch (AttentionTuning.fused_merge forced each way: the same splits), and whether their
    outputs are the same bits."""
    row, outputs = {}, {}
    for fused, name in ((True, "fused_merge"), (False, "merge_launch")):
        with tuning.override(attention=dataclasses.replace(tuning.current().attention, fused_merge=fused)):
            program = qsa_torch.sparse_paged_attention.plan(**arrays)
        call = lambda: qsa_torch.run_program(program, arrays)  # noqa: E731
        row[f"{name}_graph_us"] = common.torch_graph_us(call, smoke=smoke) or common.torch_median_us(call, smoke)
        (outputs[fused],) = call()
    row["fused_merge_bitwise"] = bool(torch.equal(outputs[True].view(torch.int16), outputs[False].view(torch.int16)))
    return row


def merge_function(qsa_torch):
    """qsa_torch.merge_attention_states."""
    return qsa_torch.merge_attention_states


def merge_bytes(rows, heads, d, out_bytes=2):
    """merge_attention_states' traffic: two outs and two float32 lses read, one of each written."""
    return 3 * rows * heads * d * out_bytes + 3 * rows * heads * 4


def option_rows(torch, qsa_torch, arrays, plain_us, smoke):
    """CUDA-graph µs of the call with sinks, with return_lse, with both (ratios to ``plain_us``), and of
    merge_attention_states over the call's out and lse and a second random partial state."""
    q = arrays["q"]
    rows, heads, d = q.shape
    sinks = torch.randn(heads, device=q.device, dtype=torch.float32)
    row = {}
    for name, options in (("sinks", dict(sinks=sinks)), ("lse", dict(return_lse=True)),
                          ("sinks_lse", dict(sinks=sinks, return_lse=True))):
        call = lambda: qsa_torch.sparse_paged_attention(**arrays, **options)  # noqa: E731
        us = common.torch_graph_us(call, smoke=smoke) or common.torch_median_us(call, smoke)
        row[f"{name}_graph_us"] = us
        row[f"{name}_vs_plain"] = us / plain_us if us and plain_us else None
    merge = merge_function(qsa_torch)
    out_a, lse_a = qsa_torch.sparse_paged_attention(**arrays, return_lse=True)
    out_b, lse_b = torch.randn_like(out_a), torch.randn_like(lse_a)
    call = lambda: merge(out_a, lse_a, out_b, lse_b)  # noqa: E731
    row["merge_bytes"] = merge_bytes(rows, heads, d)
    row["merge_graph_us"] = common.torch_graph_us(call, smoke=smoke) or common.torch_median_us(call, smoke)
    row["merge_pct_peak"] = common.pct_peak(row["merge_bytes"], row["merge_graph_us"])
    return row


def seed_us(mode, rows, context):
    return SEED_DECODE_US.get(rows) if mode == "decode" else SEED_PREFILL_US.get((rows, context))


def sweep(qsa_torch, attention, arrays, smoke, quick=False, split_counts=(), chosen=()):
    """CUDA-graph µs of configurations around the table's (partial kernel's warps/stages overridden).

    Every configuration takes AttentionTuning's default row addressing (fp8: slot; 16-bit:
    page); the table's configuration also runs with the other (``variant``), so one run
    compares them."""
    d = arrays["q"].shape[2]
    planned = qsa_torch.sparse_paged_attention.plan(**arrays).buffer("partial_lse").shape[0]
    fp8 = "float8_e4m3fn" in str(arrays["k_cache"].dtype)
    default = AttentionTuning()
    addressing = "fp8_row_addressing" if fp8 else "row_addressing"
    variants = [{}] + [{addressing: mode} for mode in ROW_ADDRESSING_MODES if mode != getattr(default, addressing)]
    configs = [(None, None, None, None, variant) for variant in variants]
    if chosen:  # --configs: exactly these (BLOCK_N, warps, stages, splits or None, maxnreg), beside the table's
        configs = [(None, None, None, None, {})] + [(b, s, w, st, {}, r) for b, w, st, s, r in chosen]
    elif split_counts:  # --splits: those split counts crossed with SPLIT_CANDIDATES, instead
        configs = [(None, None, None, None, {})] + [
            (block_n, splits, warps, stages, {}) for splits in split_counts
            for block_n, warps, stages in SPLIT_CANDIDATES]
    elif quick:  # fp8: the launch-table candidates; 16-bit: the variants only
        if fp8:
            configs += [(block_n, None, warps, stages, {}) for block_n, warps, stages in SWEEP_QUICK]
    else:
        configs += [(block_n, None, warps, stages, {})
                    for block_n in SWEEP_BLOCK_N for warps in SWEEP_WARPS for stages in SWEEP_STAGES]
        configs += [(None, splits, None, None, {})
                    for splits in sorted({max(1, planned // 2), 2 * planned} - {planned})]
    results = []
    for block_n, splits, warps, stages, variant, *registers in configs[:2] if smoke else configs:
        maxnreg = registers[0] if registers else None
        # The tuning is part of the plan's memo key: nothing to restore or clear afterwards.
        forced = AttentionTuning(tile_bytes=block_n * 2 * d if block_n else None, num_splits=splits, **variant)
        with tuning.override(attention=forced):
            program = qsa_torch.sparse_paged_attention.plan(**arrays)
        partial = program.launches[0]
        partial = dataclasses.replace(partial, num_warps=warps or partial.num_warps,
                                      num_stages=stages or partial.num_stages)
        program = dataclasses.replace(program, launches=(partial, *program.launches[1:]))
        result = dict(block_n=partial.constexprs["BLOCK_N"], splits=program.buffer("partial_lse").shape[0],
                      tiles_per_split=partial.constexprs["TILES_PER_SPLIT"],
                      warps=partial.num_warps, stages=partial.num_stages, maxnreg=maxnreg,
                      variant=",".join(f"{k}={v}" for k, v in variant.items()) or "default")
        call = lambda: qsa_torch.run_program(program, arrays)  # noqa: E731
        try:
            # Without CUDA (smoke): the wall clock, to check the path runs.
            with register_cap(qsa_torch, partial.kernel, maxnreg):
                result["graph_us"] = common.torch_graph_us(call, smoke=smoke) or common.torch_median_us(call, smoke)
        except Exception as error:  # e.g. out of shared memory
            result["error"] = f"{type(error).__name__}: {str(error)[:120]}"
        results.append(result)
    return results


@contextlib.contextmanager
def register_cap(qsa_torch, kernel, maxnreg: int | None):
    """With ``maxnreg``: ``kernel``'s launches through the torch binding capped at that many registers
    a thread (Triton's ``maxnreg`` launch option; ptxas spills the rest): a tuning experiment only,
    the package's launches carry no cap."""
    if maxnreg is None:
        yield
        return
    from qsa_torch import _binding
    plain = _binding._launch

    def capped(launch, inputs, outputs):
        if launch.kernel is not kernel:
            return plain(launch, inputs, outputs)
        launch.kernel[launch.grid](*inputs, *outputs, **launch.scalars, **launch.constexprs,
                                   num_warps=launch.num_warps, num_stages=launch.num_stages, maxnreg=maxnreg)
        return outputs

    with unittest.mock.patch.object(_binding, "_launch", capped):
        yield


def parse_configs(text: str) -> list[tuple[int, int, int, int | None, int | None]]:
    """``"16:2:5,32:4:5:3,64:4:2:2:168"`` -> [(16, 2, 5, None, None), (32, 4, 5, 3, None),
    (64, 4, 2, 2, 168)]: BLOCK_N, warps, stages, splits (empty or absent: the table's), maxnreg."""
    configs = []
    for item in text.split(","):
        values = [int(v) if v else None for v in item.split(":")]
        configs.append(tuple(values + [None] * (5 - len(values))))
    return configs


def main():
    parser = common.parser(__doc__, "sparse_attention.json")
    parser.add_argument("--sweep", action="store_true", help="tune: sweep launch configurations instead")
    parser.add_argument("--quick", action="store_true",
                        help="with --sweep: the variants, and with --fp8 the SWEEP_QUICK candidates, only")
    parser.add_argument("--splits", type=lambda text: [int(n) for n in text.split(",")], default=[],
                        help="with --sweep: these split counts (e.g. 4,8,16) crossed with SPLIT_CANDIDATES")
    parser.add_argument("--configs", type=parse_configs, default=[],
                        help="with --sweep: exactly these BLOCK_N:warps:stages[:splits[:maxnreg]] configurations (comma-separated) "
                             "beside the table's")
    parser.add_argument("--fp8", action="store_true",
                        help="also read fp8 e4m3 caches (per-tensor scales) on FP8_SHAPES, side by side")
    parser.add_argument("--only", choices=("decode", "prefill"), help="run only these shapes")
    parser.add_argument("--merge-paths", action="store_true",
                        help="where the plan splits: also time the split-K merged in its launch and by a merge "
                             "launch (AttentionTuning.fused_merge forced each way), and compare their bits")
    parser.add_argument("--no-options", action="store_true",
                        help="skip the sinks / return_lse variants and merge_attention_states beside the plain call")
    args = parser.parse_args()
    import jax
    import torch

    import qsa_jax
    import qsa_torch
    from qsa_kernels import attention

    g = dict(QH=QH, KH=KH, D=D, PAGE=PAGE, TOKEN_TOPK=TOKEN_TOPK, DECODE_ROWS=DECODE_ROWS,
             PREFILL_ROWS=PREFILL_ROWS, CONTEXTS=CONTEXTS, POOL_BYTES=POOL_BYTES,
             DENSE_LIMIT_BYTES=DENSE_LIMIT_BYTES, JAX_SHAPES=JAX_SHAPES, FP8_SHAPES=FP8_SHAPES)
    if args.smoke:
        g.update(SMOKE)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device=device).manual_seed(0)
    pool_pages = max(g["POOL_BYTES"] // page_bytes(g), max(g["CONTEXTS"]) // g["PAGE"])
    k_pool = torch.empty(pool_pages, g["PAGE"], g["KH"], g["D"], device=device, dtype=torch.bfloat16).normal_()
    v_pool = torch.empty_like(k_pool).normal_()
    if args.fp8:
        (k_pool8, k_scale), (v_pool8, v_scale) = fp8_pool(torch, k_pool), fp8_pool(torch, v_pool)
        fp8_arrays = dict(k_cache=k_pool8, v_cache=v_pool8, k_scale=k_scale, v_scale=v_scale)
    width = g["TOKEN_TOPK"] + COMPRESS_RATIO - 1
    notes = [
        f"geometry: {g['QH']} Q / {g['KH']} KV heads x d{g['D']}, bf16, pages of {g['PAGE']}, "
        f"{width} indices per row; pool of {pool_pages} pages ({pool_pages * page_bytes(g) / 2**30:.1f} GiB K+V) "
        "shared by all requests through random distinct pages per request",
        "bytes: each selected K and V row once per KV head + q + out + indices; prefill re-reads neighbours' "
        "tokens from L2 (unique_bytes counts each token once), so its pct_peak may pass 100",
        "torch_us: do_bench median (L2 flushed); *_graph_us: CUDA graph replay (L2 warm: at 1-8 decode rows "
        "the whole selection fits in L2)",
        "jax_wall_us: 20 back-to-back jitted calls, wall clock per call; jax_loop_us: one jitted fori_loop of 20 "
        "calls per call (device time estimate); JAX runs a subset of shapes",
        "dense_*: torch SDPA (flash) over the whole context for the same rows, GQA as MQA per KV head; prefill "
        "non-causal; skipped where its K/V exceed "
        f"{g['DENSE_LIMIT_BYTES'] / 2**30:.0f} GiB (e.g. 256 requests x 128K: the seed table has 16098 us)",
        *(["fp8_*: the same call on fp8 e4m3 copies of the pools (per-tensor scales = pool amax / 448), on "
           f"{sorted(g['FP8_SHAPES'])}; fp8 bytes: 1 byte per K/V element + 2 scales; fp8_vs_bf16 = fp8 / bf16 "
           "CUDA-graph µs; fp8_rel_diff = |out_fp8 - out_bf16| / |out_bf16|"] if args.fp8 else []),
        f"prefill selection: shared N(0,1) block score + {PREFILL_NOISE} x N(0,1) per row; neighbour_overlap: "
        "fraction of a row's selected block tokens its previous row also selected",
        "seed_us: docs/design.md's H200 table (CUDA-graph replay); speedup_vs_seed uses torch_graph_us",
        *([] if args.no_options else [
            "sinks/lse/sinks_lse_graph_us: the call with sinks=, return_lse=True, both (CUDA graph); *_vs_plain: "
            "over torch_graph_us; merge_graph_us: merge_attention_states of two bf16 [rows, QH, D] outs and "
            "float32 lses, merge_bytes = 3 outs + 3 lses (two read, one written), merge_pct_peak of the copy rate"]),
    ]
    shapes = [("decode", r, c) for r in g["DECODE_ROWS"] for c in g["CONTEXTS"]]
    shapes += [("prefill", r, c) for r in g["PREFILL_ROWS"] for c in g["CONTEXTS"]]
    if args.only:
        shapes = [shape for shape in shapes if shape[0] == args.only]
    if args.sweep:
        shapes = shapes[:1] if args.smoke else SWEEP_SHAPES
    shapes = args.shapes or shapes
    if args.sweep:
        rows_out = []
        for mode, rows, context in shapes:
            arrays, _ = make_shape(torch, g, mode, rows, context, k_pool, v_pool, device, generator)
            nbytes = moved_bytes(g, rows, width)
            if args.fp8:
                arrays.update(fp8_arrays)
                nbytes = moved_bytes(g, rows, width, cache_bytes=1)
            table = plan_choice(qsa_torch, attention, arrays)
            for result in sweep(qsa_torch, attention, arrays, args.smoke, args.quick, args.splits, args.configs):
                is_table = all(result[k] == table[k] for k in ("block_n", "splits", "warps", "stages")) and (
                result["variant"] == "default")
                rows_out.append(dict(mode=mode, rows=rows, context=context, table=is_table, bytes=nbytes, **result,
                                     pct_peak=common.pct_peak(nbytes, result.get("graph_us"))))
            shape_rows = [r for r in rows_out if (r["mode"], r["rows"], r["context"]) == (mode, rows, context)]
            shape_rows.sort(key=lambda r: r.get("graph_us") or float("inf"))
            common.print_table(shape_rows[:8], ["mode", "rows", "context", "table", "block_n", "splits",
                                                "tiles_per_split", "warps", "stages", "maxnreg", "variant", "graph_us",
                                                "pct_peak", "error"])
        common.write_json(args.json.replace(".json", "_fp8_sweep.json" if args.fp8 else "_sweep.json"),
                          "sparse_paged_attention sweep", rows_out,
                          notes[:1] + ["graph_us: CUDA graph replay of 20 calls, per call; table: the plan's choice"])
        return
    rows_out = []
    for mode, rows, context in shapes:
        arrays, stats = make_shape(torch, g, mode, rows, context, k_pool, v_pool, device, generator)
        nbytes = moved_bytes(g, rows, width)
        row = dict(mode=mode, rows=rows, context=context, width=width, **plan_choice(qsa_torch, attention, arrays),
                   bytes=nbytes, **stats)
        if "unique_tokens" in stats:
            row["unique_bytes"] = stats["unique_tokens"] * g["KH"] * g["D"] * 2 * 2
        call = lambda: qsa_torch.sparse_paged_attention(**arrays)  # noqa: E731
        row["torch_us"] = common.torch_median_us(call, args.smoke)
        row["torch_graph_us"] = common.torch_graph_us(call, smoke=args.smoke)
        for key in ("torch_us", "torch_graph_us"):
            row[key.replace("_us", "_gbps")] = common.gbps(nbytes, row[key])
            row[key.replace("_us", "_pct_peak")] = common.pct_peak(nbytes, row[key])
        seed = seed_us(mode, rows, context)
        if seed and not args.smoke:
            row["seed_us"] = seed
            if row["torch_graph_us"]:
                row["speedup_vs_seed"] = seed / row["torch_graph_us"]

        if not args.no_options:
            row.update(option_rows(torch, qsa_torch, arrays, row["torch_graph_us"] or row["torch_us"], args.smoke))

        if args.merge_paths and row["splits"] > 1:
            row.update(merge_paths(torch, qsa_torch, arrays, args.smoke))
            if args.fp8 and (mode, rows, context) in g["FP8_SHAPES"]:
                row.update({f"fp8_{k}": v for k, v in merge_paths(torch, qsa_torch, dict(arrays, **fp8_arrays),
                                                                  args.smoke).items()})

        if args.fp8 and (mode, rows, context) in g["FP8_SHAPES"]:
            fp8_args = dict(arrays, **fp8_arrays)
            call8 = lambda: qsa_torch.sparse_paged_attention(**fp8_args)  # noqa: E731
            row.update({f"fp8_{k}": v for k, v in plan_choice(qsa_torch, attention, fp8_args).items()})
            row["fp8_bytes"] = moved_bytes(g, rows, width, cache_bytes=1)
            row["fp8_torch_graph_us"] = common.torch_graph_us(call8, smoke=args.smoke)
            if row["fp8_torch_graph_us"] is None:  # no CUDA (smoke): the wall clock, to run the path
                row["fp8_torch_us"] = common.torch_median_us(call8, args.smoke)
            row["fp8_torch_graph_pct_peak"] = common.pct_peak(row["fp8_bytes"], row["fp8_torch_graph_us"])
            if row["fp8_torch_graph_us"] and row["torch_graph_us"]:
                row["fp8_vs_bf16"] = row["fp8_torch_graph_us"] / row["torch_graph_us"]
            out16, out8 = call(), call8()
            row["fp8_rel_diff"] = float((out8.float() - out16.float()).norm() / out16.float().norm())
            del out16, out8

        if (mode, rows, context) in g["JAX_SHAPES"]:
            if device == "cuda":
                torch.cuda.synchronize()
            jax_arrays = tuple(common.to_jax(a) for a in arrays.values())
            # A fresh function: jit's trace cache would keep the plan of another tuning.
            jitted = jax.jit(lambda *a: qsa_jax.sparse_paged_attention(*a))
            calls = 2 if args.smoke else 20
            row["jax_wall_us"] = common.jax_wall_us(jitted, jax_arrays, calls=calls, smoke=args.smoke)
            # The output has q's shape: thread it as the next q so no call is dropped;
            # the caches and indices are read-only constants of the loop.
            row["jax_loop_us"] = common.jax_loop_us(
                lambda q, *rest: qsa_jax.sparse_paged_attention(q, *rest), jax_arrays[0], calls=calls,
                smoke=args.smoke, consts=jax_arrays[1:])
            row["jax_loop_pct_peak"] = common.pct_peak(nbytes, row["jax_loop_us"])
            if row["torch_graph_us"]:
                row["jax_vs_torch_device"] = row["jax_loop_us"] / row["torch_graph_us"]
            del jax_arrays

        dense = dense_baseline(torch, g, mode, rows, context, arrays["q"], device)
        if dense is not None:
            dense_fn, dense_bytes = dense
            row["dense_bytes"] = dense_bytes
            row["dense_us"] = common.torch_median_us(dense_fn, args.smoke)
            row["dense_graph_us"] = common.torch_graph_us(dense_fn, calls=5, smoke=args.smoke)
            row["dense_graph_pct_peak"] = common.pct_peak(dense_bytes, row["dense_graph_us"])
            if row["dense_graph_us"] and row["torch_graph_us"]:
                row["sparse_speedup_vs_dense"] = row["dense_graph_us"] / row["torch_graph_us"]
            del dense, dense_fn
        rows_out.append(row)
        common.print_table([row], list(row))
    common.print_table(rows_out, [
        "mode", "rows", "context", "splits", "merge", "launches", "block_n", "tiles_per_split", "bytes", "torch_us",
        "torch_graph_us",
        "torch_graph_gbps", "torch_graph_pct_peak", "seed_us", "speedup_vs_seed", "jax_wall_us", "jax_loop_us",
        "jax_vs_torch_device", "dense_graph_us", "sparse_speedup_vs_dense", "neighbour_overlap"]
        + ([] if args.no_options else ["sinks_graph_us", "sinks_vs_plain", "lse_graph_us", "lse_vs_plain",
                                       "sinks_lse_graph_us", "sinks_lse_vs_plain", "merge_bytes", "merge_graph_us",
                                       "merge_pct_peak"])
        + (["fp8_torch_graph_us", "fp8_torch_graph_pct_peak", "fp8_vs_bf16", "fp8_rel_diff"] if args.fp8 else [])
        + (["fused_merge_graph_us", "merge_launch_graph_us", "fused_merge_bitwise"]
           + (["fp8_fused_merge_graph_us", "fp8_merge_launch_graph_us", "fp8_fused_merge_bitwise"] if args.fp8 else [])
           if args.merge_paths else []))
    suffix = f"_{args.only}" if args.only else ""
    common.write_json(args.json.replace(".json", f"{suffix}.json"), "sparse_paged_attention", rows_out, notes)


if __name__ == "__main__":
    main()
