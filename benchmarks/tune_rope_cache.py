"""Sweep stage 1's tile size and warps on the GPU (CUDA-graph replay, torch).

Prints µs and % of 4300 GB/s per (tile_elements, num_warps) for the production
geometries at T = 2048 and 8192, to choose the defaults of
``qsa_kernels.tuning.RopeCacheTuning``.
"""

from __future__ import annotations

import common
from bench_rope_cache import moved_bytes


def main():
    args = common.parser(__doc__, "tune_rope_cache.json").parse_args()
    import torch

    import qsa_torch
    from qsa_kernels import tuning

    rows = []
    for qh, kh, d in [(24, 2, 256), (32, 8, 128)]:
        for t in [2048, 8192]:
            page = 64
            blocks = t // page + 8
            q = torch.randn(t, qh, d, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(t, kh, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            key_cache = torch.randn(blocks, page, kh, d, device="cuda", dtype=torch.bfloat16)
            value_cache = torch.randn_like(key_cache)
            slots = torch.randperm(blocks * page, device="cuda")[:t]
            positions = torch.randint(0, 16384, (t,), device="cuda")
            cos_sin = torch.randn(16384, d, device="cuda", dtype=torch.bfloat16)
            for tile in [1024, 2048, 4096, 8192]:
                for warps in [2, 4, 8]:
                    fn = lambda: qsa_torch.rope_reshape_and_cache(  # noqa: E731
                        q, k, v, key_cache, value_cache, slots, positions, cos_sin, is_neox=True)
                    # Planned (and captured) inside the block: the tuning is in the plan's key.
                    with tuning.override(rope_cache=tuning.RopeCacheTuning(tile_elements=tile, num_warps=warps)):
                        us = common.torch_graph_us(fn)
                    row = dict(QH=qh, KH=kh, D=d, T=t, tile=tile, warps=warps, graph_us=us,
                               pct_peak=common.pct_peak(moved_bytes(t, qh, kh, d), us))
                    rows.append(row)
    common.print_table(rows, ["QH", "KH", "D", "T", "tile", "warps", "graph_us", "pct_peak"])
    common.write_json(args.json, "tune_rope_cache", rows)


if __name__ == "__main__":
    main()
