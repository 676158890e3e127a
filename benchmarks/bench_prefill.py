"""Long-context prefill against the card's own limits (issue 55).

One chunk of ``rows`` prefill rows of one request at the end of a context
(positions context - rows .. context - 1), production geometry: attention 24 Q
/ 2 KV heads x d256 bf16, pages of 64 (bench_sparse_attention's shared pool);
indexer 4 heads x d128, ratio 4, compressed pages of 64 (bench_select's); top
512 blocks = 2048 tokens + the 3-token causal tail.  Chunks of 256 and 2048
rows at 8K/32K/128K.  The limits are measured in the same process: the bf16
matmul rate (``torch.mm`` of 8192^3, CUDA graph) and the copy rate
(``common.copy_gbps``).

Neighbour overlap is a parameter (``--overlaps``, default 0.8,0.5,0.95,0):
row r keeps round(f x topk) of row r - 1's blocks and draws the rest at
random among its visible blocks that row r - 1 did not select (0:
independent random selections); expanded to tokens as
bench_sparse_attention.select_tokens does.  ``overlap``: the realised mean
fraction of a row's blocks its previous row also selected.

Per (shape, overlap) row, CUDA-graph µs (without CUDA: wall clock, --smoke):
``attention_us`` (sparse_paged_attention on the synthetic selection),
``attention_flops`` = valid listed tokens x QH x D x 4 (QK and PV, each row's
own tokens only).  Once per shape, repeated on its overlap rows (the
selection scores random index keys, so the synthetic overlap does not enter):
``scorer_us`` (mqa_paged_scores), ``scorer_flops`` = sum over rows of the
visible blocks x index heads x index dim x 2; ``topk_us`` (topk_blocks, k 512
of the scorer's logits), ``topk_bytes`` = the logits read; ``select_attend_us``
(select_paged_tokens then sparse_paged_attention, as the step runs them;
``select_overlap``: that selection's own neighbour overlap).
Derived: ``*_tflops`` and ``*_pct_matmul`` (of ``matmul_tflops``),
``topk_gbps`` and ``topk_pct_copy`` (of ``copy_gbps``).
``seed_select_attend_us``: None (the source kernels do not run here);
``before_select_attend_us``: ``select_attend_us`` of ``--before-json``'s run.
"""

from __future__ import annotations

import json
from functools import partial

import numpy as np

import bench_select
import bench_sparse_attention as attention_bench
import common

RATIO = attention_bench.COMPRESS_RATIO
PREFILL_ROWS = [256, 2048]
CONTEXTS = [8192, 32768, 131072]
OVERLAPS = [0.8, 0.5, 0.95, 0.0]
MATMUL_N = 8192
GRAPH_BUDGET_S = 0.2  # per CUDA-graph measurement: fewer calls per graph for slow parts
# Tiny shapes for the CPU interpreter (bench_sparse_attention's and bench_select's smoke geometry).
SMOKE = dict(attention_bench.SMOKE, INDEX_PAGE=bench_select.SMOKE["PAGE"], INDEX_POOL_BYTES=1 << 20,
             PREFILL_ROWS=[4], CONTEXTS=[256])


def overlapping_blocks(rng: np.random.Generator, positions, ratio: int, topk: int, overlap: float) -> np.ndarray:
    """``[rows, topk]`` ascending distinct blocks, each row's visible at its position
    (blocks < (position + 1) // ratio).  ``overlap`` 0: independent random draws; else row r
    keeps round(overlap x topk) of row r - 1's blocks (those visible to it) and draws the rest
    among its visible blocks that row r - 1 did not select (any not kept, where too few remain)."""
    positions = np.asarray(positions)
    visible = (positions + 1) // ratio
    if visible.min() < topk:
        raise ValueError(f"a row sees {visible.min()} blocks, fewer than top-{topk}")
    keep = int(round(overlap * topk))
    out = np.empty((len(positions), topk), dtype=np.int64)
    previous = None
    for r, seen in enumerate(visible):
        if previous is None or overlap == 0:
            chosen = rng.choice(seen, topk, replace=False)
        else:
            kept = rng.permutation(previous[previous < seen])[:keep]
            free = np.ones(seen, dtype=bool)
            free[previous[previous < seen]] = False
            if free.sum() < topk - len(kept):
                free[:] = True
                free[kept] = False
            chosen = np.concatenate([kept, rng.choice(np.flatnonzero(free), topk - len(kept), replace=False)])
        out[r] = previous = np.sort(chosen)
    return out


def neighbour_overlap(blocks: np.ndarray) -> float | None:
    """Mean over rows 1.. of the fraction of a row's valid (>= 0) blocks its previous row selected too."""
    shares = [np.isin(row[row >= 0], prev[prev >= 0]).mean() for prev, row in zip(blocks[:-1], blocks[1:])
              if (row >= 0).any()]
    return float(np.mean(shares)) if shares else None


def overlapping_tokens(torch, positions, ratio, topk, overlap, seed):
    """Token indices of ``overlapping_blocks`` (blocks of ``ratio`` tokens + the causal tail), expanded
    by bench_sparse_attention.select_tokens from 0/1 block scores; and the blocks."""
    blocks = overlapping_blocks(np.random.default_rng(seed), positions.cpu().numpy(), ratio, topk, overlap)
    groups = int(positions.max()) // ratio + 1
    scores = torch.zeros(len(blocks), groups, device=positions.device)
    scores.scatter_(1, torch.from_numpy(blocks).to(positions.device), 1.0)
    return attention_bench.select_tokens(torch, scores, positions, ratio, topk), blocks


def matmul_tflops(torch, n: int = MATMUL_N, smoke: bool = False) -> float | None:
    """This card's bf16 matmul rate, TFLOP/s: ``torch.mm`` of random n x n operands, CUDA graph."""
    if not torch.cuda.is_available():
        return None
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty_like(a)
    us = common.torch_graph_us(lambda: torch.mm(a, b, out=c), calls=5, smoke=smoke)
    return 2 * n ** 3 / us / 1e6


def selection_parts(torch, qsa_torch, index, arrays, token_topk, graph_us) -> dict:
    """The parts that do not depend on the synthetic overlap, timed once per shape: the scorer,
    the top-k of its logits, select + attend (as the step runs them) and that selection's overlap."""
    k = token_topk // RATIO
    logits, visible = qsa_torch.mqa_paged_scores(**index, compress_ratio=RATIO)
    parts = dict(scorer_us=graph_us(partial(qsa_torch.mqa_paged_scores, **index, compress_ratio=RATIO)),
                 scorer_flops=int(visible.sum()) * bench_select.HEADS * bench_select.D * 2,
                 topk_us=graph_us(partial(qsa_torch.topk_blocks, logits, visible, k)),
                 topk_bytes=logits.numel() * logits.element_size())
    del logits, visible
    select = partial(qsa_torch.select_paged_tokens, **index, token_topk=token_topk, compress_ratio=RATIO)
    cache = {name: a for name, a in arrays.items() if name != "token_indices"}
    parts["select_attend_us"] = graph_us(lambda: qsa_torch.sparse_paged_attention(**cache, token_indices=select()))
    starts = select()[:, :token_topk:RATIO].cpu().numpy()  # each block's first token (-1: padding)
    parts["select_overlap"] = neighbour_overlap(np.where(starts >= 0, starts // RATIO, -1))
    return parts


def quotient(num, den, scale=1.0):
    return scale * num / den if num is not None and den else None


def main():
    parser = common.parser(__doc__, "prefill.json")
    parser.add_argument("--overlaps", type=lambda text: [float(f) for f in text.split(",")], default=OVERLAPS,
                        help="neighbour overlaps of the synthetic selections (0: independent random)")
    parser.add_argument("--before-json", help="a previous run's prefill.json: its select_attend_us becomes "
                                              "before_select_attend_us (matched by rows, context, overlap_target)")
    args = parser.parse_args()
    import torch

    import qsa_torch

    g = dict(QH=attention_bench.QH, KH=attention_bench.KH, D=attention_bench.D, PAGE=attention_bench.PAGE,
             TOKEN_TOPK=attention_bench.TOKEN_TOPK, POOL_BYTES=attention_bench.POOL_BYTES, INDEX_PAGE=bench_select.PAGE,
             INDEX_POOL_BYTES=bench_select.POOL_BYTES, PREFILL_ROWS=PREFILL_ROWS, CONTEXTS=CONTEXTS)
    if args.smoke:
        g.update(SMOKE)
    shapes = args.shapes or [("prefill", r, c) for r in g["PREFILL_ROWS"] for c in g["CONTEXTS"]]
    if any(mode != "prefill" for mode, _, _ in shapes):
        parser.error("bench_prefill times prefill chunks only (--shapes prefill:rows:context,...)")
    before = {}
    if args.before_json:
        with open(args.before_json) as f:
            before = {(r["rows"], r["context"], r["overlap_target"]): r.get("select_attend_us")
                      for r in json.load(f)["rows"]}

    torch.manual_seed(0)  # the pools' contents
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device=device).manual_seed(0)
    longest = max(context for _, _, context in shapes)
    limits = dict(card=common.card(), matmul_tflops=matmul_tflops(torch, smoke=args.smoke),
                  copy_gbps=common.copy_gbps(smoke=args.smoke))
    if device == "cuda":
        torch.cuda.empty_cache()
    pool_pages = max(g["POOL_BYTES"] // attention_bench.page_bytes(g), longest // g["PAGE"])
    k_pool = torch.empty(pool_pages, g["PAGE"], g["KH"], g["D"], device=device, dtype=torch.bfloat16).normal_()
    v_pool = torch.empty_like(k_pool).normal_()
    index_page_bytes = g["INDEX_PAGE"] * bench_select.D * 2
    index_pages = max(g["INDEX_POOL_BYTES"] // index_page_bytes, longest // RATIO // g["INDEX_PAGE"])
    index_pool = torch.empty(index_pages, g["INDEX_PAGE"], 1, bench_select.D, device=device,
                             dtype=torch.bfloat16).normal_()
    token_topk, k = g["TOKEN_TOPK"], g["TOKEN_TOPK"] // RATIO

    def graph_us(fn):
        return common.budgeted_graph_us(fn, args.smoke, GRAPH_BUDGET_S)

    rows_out = []
    for mode, rows, context in shapes:
        arrays, _ = attention_bench.make_shape(torch, g, mode, rows, context, k_pool, v_pool, device, generator)
        index = bench_select.make_shape(torch, dict(PAGE=g["INDEX_PAGE"]), mode, rows, context, index_pool,
                                        device, generator)
        shape_row = selection_parts(torch, qsa_torch, index, arrays, token_topk, graph_us)
        positions = index["query_positions"].long()
        for target in args.overlaps:
            tokens, blocks = overlapping_tokens(torch, positions, RATIO, k, target, seed=rows + context)
            row = dict(mode=mode, rows=rows, context=context, **limits, overlap_target=target,
                       overlap=neighbour_overlap(blocks),
                       attention_us=graph_us(partial(qsa_torch.sparse_paged_attention,
                                                     **dict(arrays, token_indices=tokens))),
                       attention_flops=int((tokens >= 0).sum()) * g["QH"] * g["D"] * 4)
            row.update(shape_row, seed_select_attend_us=None,
                       before_select_attend_us=before.get((rows, context, target)))
            row["attention_tflops"] = quotient(row["attention_flops"], row["attention_us"], 1e-6)
            row["attention_pct_matmul"] = quotient(row["attention_tflops"], row["matmul_tflops"], 100.0)
            row["scorer_tflops"] = quotient(row["scorer_flops"], row["scorer_us"], 1e-6)
            row["scorer_pct_matmul"] = quotient(row["scorer_tflops"], row["matmul_tflops"], 100.0)
            row["topk_gbps"] = common.gbps(row["topk_bytes"], row["topk_us"])
            row["topk_pct_copy"] = quotient(row["topk_gbps"], row["copy_gbps"], 100.0)
            row["select_attend_vs_before"] = quotient(row["before_select_attend_us"], row["select_attend_us"])
            rows_out.append(row)
            del tokens
        del arrays, index

    notes = [
        f"card limits measured in this process: matmul_tflops = torch.mm of two random {MATMUL_N}x{MATMUL_N} bf16 "
        "operands (2 n^3 FLOP, CUDA graph of 5 calls); copy_gbps = common.copy_gbps (2 GiB read + written by a "
        "kernel, CUDA graph); both None without CUDA",
        f"geometry: attention {g['QH']} Q / {g['KH']} KV heads x d{g['D']} bf16, pages of {g['PAGE']} "
        f"({pool_pages} pages shared, random distinct pages per request); indexer {bench_select.HEADS} heads x "
        f"d{bench_select.D} bf16, ratio {RATIO}, compressed pages of {g['INDEX_PAGE']}; top-{k} blocks = "
        f"{token_topk} tokens + the {RATIO - 1}-token causal tail; one request, positions context - rows .. "
        "context - 1",
        "*_us: CUDA-graph replay per call (L2 warm; up to 20 calls a graph, fewer for slow parts); without CUDA "
        "(--smoke on the interpreter) the wall-clock median, meaningless as a rate",
        "attention_us: sparse_paged_attention on the synthetic selection of this row's overlap_target; "
        "attention_flops = valid listed tokens (index >= 0, all of them here) x QH x D x 4 (QK and PV "
        "multiply-adds as 2 FLOP each): each row's own tokens only (a tail token that repeats a selected "
        "block's, as select_tokens may list it, counts twice, as the kernel attends it twice); "
        "attention_tflops and attention_pct_matmul (of matmul_tflops)",
        "synthetic selection: row r keeps round(overlap_target x topk) of row r - 1's blocks and draws the rest "
        "at random among its visible blocks (block < (position + 1) // ratio) that row r - 1 did not select; "
        "overlap_target 0: independent random draws; expanded like bench_sparse_attention.select_tokens; "
        "overlap: the realised mean fraction of a row's blocks its previous row also selected (rows 1..)",
        "scorer_us: mqa_paged_scores of the chunk (logits written); scorer_flops = sum over rows of its visible "
        f"compressed blocks (the scorer's visible_blocks) x {bench_select.HEADS} heads x d{bench_select.D} x 2 "
        "(q.k multiply-adds; relu, head sum and the masked columns past the visible ones not counted); "
        "scorer_tflops, scorer_pct_matmul",
        f"topk_us: topk_blocks(logits, visible, {k}) of the scorer's logits; topk_bytes = the logits read "
        "(rows x columns x 4); topk_gbps, topk_pct_copy (of copy_gbps)",
        "select_attend_us: select_paged_tokens (score, top-k, expand on random index keys and queries) then "
        "sparse_paged_attention on its tokens, one CUDA graph, as the step runs them; select_overlap: the "
        "realised neighbour overlap of that selection",
        "scorer_*, topk_*, select_attend_us and select_overlap do not depend on the synthetic overlap: measured "
        "once per shape and repeated on each of its overlap rows; only attention_us depends on it",
        "seed_select_attend_us: None: no runnable copy of the source kernels is in the package",
        "before_select_attend_us: select_attend_us of the --before-json run "
        f"({args.before_json or 'none given'}) at the same rows, context, overlap_target; "
        "select_attend_vs_before = before / now",
    ]
    common.print_table(rows_out, [
        "rows", "context", "overlap_target", "overlap", "matmul_tflops", "copy_gbps", "attention_us",
        "attention_flops", "attention_tflops", "attention_pct_matmul", "scorer_us", "scorer_flops", "scorer_tflops",
        "scorer_pct_matmul", "topk_us", "topk_bytes", "topk_gbps", "topk_pct_copy", "select_attend_us",
        "select_overlap", "before_select_attend_us"])
    common.write_json(args.json, "prefill (issue 55)", rows_out, notes)


if __name__ == "__main__":
    main()
