"""How often fp8 index keys change the selected blocks (CPU, no kernels).

Decides the scale convention of the fp8 compressed-key cache.  Data as in
bench_select.py: keys and queries N(0, 1), indexer 4 heads x d128, ratio 4,
top-512 blocks, contexts 32K and 128K (8192 / 32768 blocks).  Each query row
is scored in float64 (sum over heads of relu(q_h . k) / sqrt(D), the
reference's formula) against the keys rounded to bf16 (the baseline) and
against the keys quantised to fp8 e4m3 with torch's (correct) casts and
dequantised, for each scale convention; exact top-k (no ties in float64).
Agreement of a row = |selected(fp8) & selected(bf16)| / 512.

Also: "scaled rows", where each key row is multiplied by a log-normal factor
(sigma 1.5), a harder case for one per-tensor scale; and bf16 against the
exact (float64) keys, for scale: how much bf16 rounding alone changes.

    python benchmarks/fp8_selection_agreement.py [--rows 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch

HEADS, D, RATIO, TOPK_BLOCKS, FP8_MAX = 4, 128, 4, 512, 448.0


def fp8_per_tensor(keys, scale=None):
    scale = keys.abs().max() / FP8_MAX if scale is None else torch.tensor(scale, dtype=keys.dtype)
    return (keys / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float64) * scale


def fp8_per_row(keys):
    scale = keys.abs().amax(dim=1, keepdim=True) / FP8_MAX
    # The scale itself is stored as float32 beside the row.
    scale = scale.to(torch.float32).to(torch.float64)
    return (keys / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float64) * scale


def bf16(keys):
    return keys.to(torch.bfloat16).to(torch.float64)


def selected(q, keys):
    """Top-512 block indices of each query row: q [rows, H, D], keys [N, D]."""
    scores = torch.relu(torch.einsum("rhd,nd->rhn", q, keys)).sum(1) / D ** 0.5
    return torch.topk(scores, TOPK_BLOCKS, dim=1).indices


def agreement(a, b):
    hits = [len(set(x.tolist()) & set(y.tolist())) / TOPK_BLOCKS for x, y in zip(a, b)]
    hits = torch.tensor(hits, dtype=torch.float64)
    return dict(mean=round(hits.mean().item(), 4), min=round(hits.min().item(), 4))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32, help="query rows per context")
    parser.add_argument("--json", help="write the table here")
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    results = []
    for data in ("N(0,1)", "scaled rows"):
        for context in (32768, 131072):
            blocks = context // RATIO
            exact = torch.randn(blocks, D, generator=g, dtype=torch.float64)
            if data == "scaled rows":
                exact = exact * torch.exp(1.5 * torch.randn(blocks, 1, generator=g, dtype=torch.float64))
            q = torch.randn(args.rows, HEADS, D, generator=g).to(torch.bfloat16).to(torch.float64)
            base = selected(q, bf16(exact))
            variants = {
                "bf16 vs exact keys": selected(q, exact),
                "fp8 per-tensor (amax / 448)": selected(q, fp8_per_tensor(exact)),
                "fp8 per-tensor (scale 1)": selected(q, fp8_per_tensor(exact, 1.0)),
                "fp8 per-row (row amax / 448)": selected(q, fp8_per_row(exact)),
            }
            for name, chosen in variants.items():
                row = dict(data=data, context=context, variant=name, **agreement(chosen, base))
                results.append(row)
                print(f"{data:12s} {context:7d}  {name:30s} mean {row['mean']:.4f}  min {row['min']:.4f}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(dict(rows_per_context=args.rows, topk_blocks=TOPK_BLOCKS, results=results), file, indent=1)


if __name__ == "__main__":
    main()
