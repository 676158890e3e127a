"""Stage 1 benchmark: RoPE + paged KV-cache write (flash layout, bf16).

For each geometry, token count and page size: median µs and GB/s of
qsa_torch (do_bench and CUDA-graph replay), qsa_jax (wall clock of donated
back-to-back calls, and device time from one jitted fori_loop) and a
plain-PyTorch baseline (RoPE with torch ops + index_copy_ into the cache).

Bytes moved: q read + q_out written, k read + k_out written + k cached,
v read + v cached, and each row's cos/sin, positions and slot.
"""

from __future__ import annotations

import statistics
import time

import common

GEOMETRIES = [(24, 2, 256), (32, 8, 128)]  # (QH, KH, D)
TOKENS = [1, 64, 256, 2048, 8192]
PAGES = [16, 64]
MAX_POSITION = 16384


def moved_bytes(t, qh, kh, d, elem=2):
    return (2 * t * qh * d + 3 * t * kh * d + 2 * t * kh * d) * elem + t * d * elem + t * 8 * 2


def torch_baseline(q, k, v, key_cache, value_cache, slots, positions, cos_sin):
    """RoPE (NeoX, F = D/2) with torch ops, then index_copy_ into the flash cache."""
    import torch

    d = q.shape[-1]
    cos, sin = cos_sin[positions].chunk(2, dim=-1)
    cos = torch.cat([cos, cos], -1)[:, None].float()
    sin = torch.cat([sin, sin], -1)[:, None].float()

    def rope(x):
        x = x.float()
        rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
        return (x * cos + rotated * sin).to(q.dtype)

    q_out, k_out = rope(q), rope(k)
    flat_k = key_cache.view(-1, *key_cache.shape[2:])
    flat_v = value_cache.view(-1, *value_cache.shape[2:])
    flat_k.index_copy_(0, slots, k_out)
    flat_v.index_copy_(0, slots, v)
    return q_out, k_out


def main():
    parser = common.parser(__doc__, "rope_cache.json")
    parser.add_argument("--geometries", nargs="+", type=lambda text: tuple(map(int, text.split(","))),
                        metavar="QH,KH,D", help=f"(default {' '.join(','.join(map(str, g)) for g in GEOMETRIES)}); "
                        "a D other than a power of two pads the rotation tile")
    parser.add_argument("--tokens", nargs="+", type=int, help=f"token counts (default {TOKENS})")
    parser.add_argument("--pages", nargs="+", type=int, help=f"page sizes (default {PAGES})")
    parser.add_argument("--skip-jax", action="store_true", help="leave out the JAX columns")
    args = parser.parse_args()
    import jax
    import jax.numpy as jnp
    import torch

    import qsa_jax
    import qsa_torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens = args.tokens or ([1, 8] if args.smoke else TOKENS)
    geometries = args.geometries or ([(4, 2, 32)] if args.smoke else GEOMETRIES)
    pages = args.pages or ([16] if args.smoke else PAGES)
    rows = []
    for qh, kh, d in geometries:
        for page in pages:
            for t in tokens:
                torch.manual_seed(0)
                blocks = (t + page - 1) // page + 8
                q = torch.randn(t, qh, d, device=device, dtype=torch.bfloat16)
                k = torch.randn(t, kh, d, device=device, dtype=torch.bfloat16)
                v = torch.randn(t, kh, d, device=device, dtype=torch.bfloat16)
                key_cache = torch.randn(blocks, page, kh, d, device=device, dtype=torch.bfloat16)
                value_cache = torch.randn_like(key_cache)
                slots = torch.randperm(blocks * page, device=device)[:t].to(torch.int64)
                positions = torch.randint(0, MAX_POSITION, (t,), device=device, dtype=torch.int64)
                angles = torch.rand(MAX_POSITION, d // 2, device=device) * 6.28
                cos_sin = torch.cat([angles.cos(), angles.sin()], -1).to(torch.bfloat16)
                call_torch = lambda: qsa_torch.rope_reshape_and_cache(  # noqa: E731
                    q, k, v, key_cache, value_cache, slots, positions, cos_sin, is_neox=True)
                call_base = lambda: torch_baseline(q, k, v, key_cache, value_cache, slots, positions, cos_sin)  # noqa: E731
                nbytes = moved_bytes(t, qh, kh, d)
                row = dict(QH=qh, KH=kh, D=d, P=page, T=t, bytes=nbytes)
                row["torch_us"] = common.torch_median_us(call_torch, args.smoke)
                row["torch_graph_us"] = common.torch_graph_us(call_torch, smoke=args.smoke)
                row["torch_host_us"] = common.torch_host_us(call_torch)
                row["baseline_us"] = common.torch_median_us(call_base, args.smoke)
                row["baseline_graph_us"] = common.torch_graph_us(call_base, smoke=args.smoke)

                if not args.skip_jax:
                    to_j = lambda x: jnp.asarray(x.cpu().float().numpy()).astype(jnp.bfloat16) if x.dtype == torch.bfloat16 else jnp.asarray(x.cpu().numpy().astype("int32"))  # noqa: E731
                    jq, jk, jv, jpos, jslots, jcs = map(to_j, (q, k, v, positions, slots, cos_sin))
                    jkc, jvc = to_j(key_cache), to_j(value_cache)

                    def step(kc, vc):
                        out = qsa_jax.rope_reshape_and_cache(jq, jk, jv, kc, vc, jslots, jpos, jcs, is_neox=True)
                        return out[2], out[3]

                    donated = jax.jit(step, donate_argnums=(0, 1))
                    jkc, jvc = jax.block_until_ready(donated(jkc, jvc))
                    times = []
                    calls = 20
                    for _ in range(3 if args.smoke else 10):
                        t0 = time.perf_counter()
                        for _ in range(calls):
                            jkc, jvc = donated(jkc, jvc)
                        jax.block_until_ready((jkc, jvc))
                        times.append((time.perf_counter() - t0) * 1e6 / calls)
                    row["jax_wall_us"] = statistics.median(times)
                    row["jax_loop_us"] = common.jax_loop_us(lambda c: step(*c), (jkc, jvc), smoke=args.smoke)
                for key in ("torch_graph_us", "jax_loop_us", "baseline_graph_us"):
                    if key in row:
                        row[key.replace("_us", "_pct_peak")] = common.pct_peak(nbytes, row[key])
                row["torch_graph_gbps"] = common.gbps(nbytes, row["torch_graph_us"])
                if row["torch_graph_us"] and row.get("jax_loop_us"):
                    row["jax_vs_torch_device"] = row["jax_loop_us"] / row["torch_graph_us"]
                rows.append(row)
                common.print_table([row], list(row))
    common.print_table(rows, ["QH", "KH", "D", "P", "T", "bytes", "torch_us", "torch_host_us", "torch_graph_us", "torch_graph_pct_peak",
                              "jax_wall_us", "jax_loop_us", "jax_loop_pct_peak", "jax_vs_torch_device",
                              "baseline_graph_us", "baseline_graph_pct_peak"])
    common.write_json(args.json, "rope_reshape_and_cache", rows, [
        "torch_us: triton.testing.do_bench median (L2 flushed between calls); *_graph_us: CUDA graph of 20 calls, per call",
        "torch_host_us: wall clock per call of 200 back-to-back eager calls without sync (host cost of the call path)",
        "jax_wall_us: 20 back-to-back donated jitted calls, wall clock per call (host overhead included)",
        "jax_loop_us: one jitted, unrolled lax.fori_loop of 20 calls, wall clock per call (device time estimate)",
        "pct_peak: bytes moved over time, against 4300 GB/s",
    ])


if __name__ == "__main__":
    main()
